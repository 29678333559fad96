"""Errors for bad input every package raises, and the checks of numbers and names that raise them."""

from __future__ import annotations

import math
import reprlib

# beyond any real cost (11.6 days an action, a pebibyte): typos, and beyond what HiGHS solves reliably
MAX_MS = 1e9
MAX_BYTES = 2.0**50


_SHORT = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 2, 4, 4, 4
_SHORT.maxstring = _SHORT.maxother = 40


def shown(value: object) -> str:
    """`value` as an error line quotes it: nested and long values cut short, so the line stays one line."""
    try:
        return _SHORT.repr(value)
    except ValueError:  # an integer past Python's 4,300 digits (0x..., 0b... in a YAML or TOML file)
        return f"an integer of {value.bit_length():,} bits" if isinstance(value, int) else type(value).__name__


def named(text: str, most: int = 40) -> str:
    """A name as an error line shows it, unquoted: a long one cut short."""
    return text if len(text) <= most else text[:most] + "..."


def check_printable(text: object, field: str) -> None:
    """A name that tables and error lines show: printable text, no line break, tab or control character."""
    if not isinstance(text, str) or not text.isprintable():
        raise InputError(
            field, f"is {shown(text)}; expected printable text (no line breaks, tabs or control characters)"
        )


class InputError(ValueError):
    """Bad input: names the field and says what was expected."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class Terminated(BaseException):
    """SIGTERM arrived (the CLI's handler raises it): like KeyboardInterrupt, it unwinds every `finally`
    and `except BaseException` clean-up on its way out, and no `except Exception` stops it."""


def check_instance(value: object, kind: type | tuple[type, ...], field: str, expected: str) -> None:
    """InputError naming `field` unless `value` is a `kind` (`expected` says which, as the error line does)."""
    if not isinstance(value, kind):
        raise InputError(field, f"expected {expected}, got {'None' if value is None else type(value).__name__}")


def _float(value: object) -> float | None:
    """`value` as a float if it is a number a float holds (not a bool, not an integer past 1.8e308)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def check_non_negative(value: object, field: str) -> float:
    """`value` as a float if it is a finite number >= 0; InputError naming `field` otherwise."""
    number = _float(value)
    if number is None or not math.isfinite(number) or number < 0:
        raise InputError(field, f"expected a finite number >= 0, got {shown(value)}")
    return number


def check_seconds(value: object, field: str) -> float:
    """A time limit: a number of seconds > 0, `math.inf` for none."""
    number = _float(value)
    if number is None or not number > 0:
        raise InputError(field, f"expected a number of seconds > 0 (inf: no limit), got {shown(value)}")
    return number


def check_ms(value: object, field: str) -> None:
    """A duration: a finite number of milliseconds, >= 0 and at most MAX_MS."""
    if check_non_negative(value, field) > MAX_MS:
        raise InputError(field, f"expected at most {MAX_MS:g} ms, got {shown(value)}")


def check_bytes(value: object, field: str) -> None:
    """A size: a finite number of bytes, >= 0 and at most MAX_BYTES."""
    if check_non_negative(value, field) > MAX_BYTES:
        raise InputError(field, f"expected at most 2**50 bytes (1 PiB), got {shown(value)}")
