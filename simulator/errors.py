"""Errors the simulator raises for bad input."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: names the field and says what was expected."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class ScheduleError(InputError):
    """An action list that cannot run: a missing, repeated or misplaced action, or a deadlock."""
