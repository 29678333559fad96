"""Reading untrusted mappings (profile JSON, plan YAML) field by field, with one clear error each."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from basics.errors import InputError, check_non_negative, shown


class Fields:
    """Typed access to `data`, an object found at `where`; `done()` refuses keys nobody read."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, Mapping):
            raise InputError(where, f"expected an object, got {type(data).__name__}")
        self.data = data
        self.where = where
        self.read: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def renamed(self, old: str, new: str) -> None:
        """Read `old`, a key's former name (in a file an earlier release wrote), as `new`, with a FutureWarning."""
        if old in self.data and new not in self.data:
            warnings.warn(
                f"{self.at(old)} is the former name of {self.at(new)}; read as {new}", FutureWarning, stacklevel=3
            )
            self.data = {new if key == old else key: value for key, value in self.data.items()}

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self.data.get(key, default)

    def number(self, key: str, default: float | None = None, *, required: bool = False) -> float | None:
        self.read.add(key)
        if key not in self.data or self.data[key] is None:
            if required:
                raise InputError(self.at(key), "missing; expected a number >= 0")
            return default
        return check_non_negative(self.data[key], self.at(key))

    def integer(self, key: str, default: int | None = None, *, required: bool = False, least: int = 0) -> int | None:
        self.read.add(key)
        if key not in self.data:
            if required:
                raise InputError(self.at(key), f"missing; expected an integer >= {least}")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(self.at(key), f"expected an integer >= {least}, got {shown(value)}")
        return value

    def text(self, key: str, default: str = "", *, required: bool = False) -> str:
        self.read.add(key)
        if key not in self.data:
            if required:
                raise InputError(self.at(key), "missing; expected a string")
            return default
        value = self.data[key]
        if not isinstance(value, str):
            raise InputError(self.at(key), f"expected a string, got {shown(value)}")
        return value

    def done(self) -> None:
        unknown = sorted(str(key) for key in self.data if key not in self.read)
        if unknown:
            raise InputError(self.at(unknown[0]), f"unknown key; expected one of {', '.join(sorted(self.read))}")
