"""Byte sizes with units: `56GB`, `56000MB`, `52GiB` in, `12.3 GiB` out."""

from __future__ import annotations

import math
import re

from basics.errors import InputError

MIB = 2**20  # the unit the solver states memory in (SAPP's files too)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": MIB,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, field: str) -> int:
    """`56GB` -> 56_000_000_000; `52GiB` -> 55_834_574_848. A bare number is taken only for 0."""
    match = _SIZE.match(str(text))
    if match is None:
        raise InputError(field, f"expected a size such as 56GB, 56000MB or 52GiB, got {_shown(text)}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit:
        if number == 0:
            return 0
        raise InputError(field, f"expected a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) after {_shown(text)}")
    if unit not in _UNITS:
        raise InputError(
            field, f"unknown unit {_shown(match.group(2))}; expected B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    size = number * _UNITS[unit]
    if not math.isfinite(size):
        raise InputError(field, f"{_shown(text)} is too large to be a size")
    return round(size)


def _shown(text: str) -> str:
    """`text` quoted for an error line, its middle left out where it is long."""
    text = str(text)
    return repr(text if len(text) <= 40 else f"{text[:24]}...{text[-12:]}")


def format_bytes(size: float) -> str:
    """Binary units, three significant figures: `12.3 GiB`, `512 MiB`, `0 B`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


def format_ms(milliseconds: float) -> str:
    """Six significant figures, never in exponent form: `27`, `1,525.31`, `1,076,938`."""
    if abs(milliseconds) >= 1e5:
        return f"{milliseconds:,.0f}"
    return f"{milliseconds:,.6g}"
