"""Work that makes many objects and no reference cycles, with the cyclic garbage collector paused."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause `gc` for the block, as it was before afterwards: a collector pass runs every 700 new
    containers and a full one looks at every object the process holds, which, for a schedule's
    tens of thousands of action tuples, costs more than much of the work. gc is the process's: another
    thread that disables it meanwhile finds it enabled again when the block ends."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def without_collector(function: Callable[P, R]) -> Callable[P, R]:
    """`function` run under `collector_paused`."""

    @functools.wraps(function)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        with collector_paused():
            return function(*args, **kwargs)

    return paused
