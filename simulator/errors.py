"""Errors the simulator raises for bad input."""

from __future__ import annotations

import math


class InputError(ValueError):
    """Bad input: names the field and says what was expected."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class ScheduleError(InputError):
    """An action list that cannot run: a missing, repeated or misplaced action, or a deadlock."""


def check_non_negative(value: object, field: str) -> float:
    """`value` as a float if it is a finite number >= 0; InputError naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(field, f"expected a finite number >= 0, got {value!r}")
    return float(value)
