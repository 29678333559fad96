"""Renamed public names: the old name keeps working for one release, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

Function = TypeVar("Function", bound=Callable[..., Any])
Class = TypeVar("Class", bound=type)


def renamed_message(old: str, new: str) -> str:
    """What a warning about the former name `old` of `new` says."""
    return f"{old} is deprecated and goes in the next release; use {new}"


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated in favour of `new` (`stacklevel` 3: the caller of the caller)."""
    warnings.warn(renamed_message(old, new), DeprecationWarning, stacklevel=stacklevel)


def renamed_keywords(**renames: str) -> Callable[[Function], Function]:
    """A decorator: a call passing an old keyword (`stages=4`) gets it under its new name (`pipeline_parallel=4`),
    with a DeprecationWarning; passing both is a TypeError."""

    def wrap(function: Function) -> Function:
        name = function.__qualname__.removesuffix(".__init__")  # a class is called by its own name

        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{name}() got {old}= and {new}=; pass {new}= only")
                    warn_renamed(f"{name}({old}=...)", f"{new}=")
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def renamed_attributes(**renames: str) -> Callable[[Class], Class]:
    """A class decorator: each former attribute or method name (`stage_peak_memory_bytes`) reads the new one
    (`rank_peak_memory_bytes`), with a DeprecationWarning."""

    def decorate(cls: Class) -> Class:
        for old, new in renames.items():

            def former(self: object, old: str = old, new: str = new) -> Any:
                warn_renamed(f"{type(self).__name__}.{old}", f"{type(self).__name__}.{new}")
                return getattr(self, new)

            setattr(cls, old, property(former, doc=f"Deprecated: the former name of `{new}`."))
        return cls

    return decorate
