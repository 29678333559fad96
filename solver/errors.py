"""Errors the solver raises."""

from __future__ import annotations

from basics.deprecation import renamed_attributes
from basics.errors import InputError


@renamed_attributes(binding_stage="binding_rank")
class InfeasibleError(InputError):
    """No plan fits the memory budget. Says the smallest budget that would fit and what to try."""

    def __init__(self, message: str, *, smallest_budget_bytes: float | None, binding_rank: int | None) -> None:
        super().__init__("memory_budget_bytes", message)
        self.smallest_budget_bytes = smallest_budget_bytes
        self.binding_rank = binding_rank
