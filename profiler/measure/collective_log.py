"""The collectives each layer runs on a device mesh, as the `Recorder` times the layer: which, how many,
how many bytes, how long.

While a `CollectiveLog` is entered, every collective torch.distributed or DTensor's functional ops issue is
waited out where it is issued, timed with the recorder's clock and put down to the layer (and phase) the
recorder says is running. On gloo the training thread waits for each collective anyway (DTensor's
at its next use, FSDP's at its copy-out), so all of its time is exposed: `exposed_ms` is `ms`. A
collective a pipeline runs once a step (`period`) is taken out of the layer's times (`Pass.step_collective_ms`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from profiler.measure.recorder import Recorder

MICRO_BATCH, STEP = "micro-batch", "step"
# torch.distributed's and DTensor's functional collectives, by the operation they run
OPERATIONS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "all_gather_single": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_single": "reduce-scatter",
    "all_to_all": "all-to-all",
    "all_to_all_single": "all-to-all",
    "broadcast": "broadcast",
}
FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


@dataclass(frozen=True)
class Call:
    """One collective: the layer slot and phase it ran in (slot None: outside every layer), the mesh
    dimension, its operation, the bytes of its whole tensor (the largest it takes or returns: an
    all-gather's output, a reduce-scatter's input), its milliseconds and how often a pipeline runs it."""

    slot: object
    phase: str
    dimension: str
    operation: str
    bytes: int
    ms: float
    per: str


def period(dimension: str, operation: str, phase: str, reshard_after_forward: bool) -> str:
    """How often a pipeline runs a collective (profiler.estimate.collectives counts the same): tensor-parallel ones
    each micro-batch; FSDP's reduce-scatter once a step (after the chunk's last backward) and its
    gathers once a step unless it re-shards after each forward (then in every forward and backward)."""
    if dimension != "data":
        return MICRO_BATCH
    if operation == "all-gather" and reshard_after_forward:
        return MICRO_BATCH
    return STEP


class CollectiveLog:
    """While entered: every collective on the groups of `dimensions` (process group name -> mesh
    dimension) waited out, timed and put down to the running layer; `calls` holds them."""

    def __init__(self, recorder: Recorder, dimensions: Mapping[str, str], reshard_after_forward: bool = False) -> None:
        self.recorder = recorder
        self.dimensions = dict(dimensions)
        self.reshard_after_forward = reshard_after_forward
        self.calls: list[Call] = []
        self._outside: object = None

    @contextlib.contextmanager
    def outside(self, label: object) -> Iterator[None]:
        """Collectives outside every layer's time meanwhile go down to the slot `label` (the optimizer step)."""
        self._outside = label
        try:
            yield
        finally:
            self._outside = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[CollectiveLog]:
        namespace = torch.ops._c10d_functional
        saved = [(dist, name, getattr(dist, name)) for name in OPERATIONS if hasattr(dist, name)]
        saved += [(namespace, name, getattr(namespace, name)) for name in FUNCTIONAL if hasattr(namespace, name)]
        try:
            for owner, name, original in saved:
                setattr(owner, name, self._timed(original, OPERATIONS[name], functional=owner is namespace))
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    def _timed(self, original: Callable[..., Any], operation: str, *, functional: bool) -> Callable[..., Any]:
        clock = self.recorder.clock

        def call(*args: Any, **kwargs: Any) -> Any:
            running = self.recorder.running
            start = clock.mark()
            if functional:
                result = original(*args, **kwargs)
                torch.ops._c10d_functional.wait_tensor(result)
            else:
                asked = kwargs.pop("async_op", False)
                work = original(*args, async_op=True, **kwargs)
                if work is not None:
                    work.wait()
                result = work if asked else None  # a waited work: the caller's wait returns at once
            ms = clock.elapsed_ms(start, clock.mark())
            self._note(running, operation, _whole_bytes(args, kwargs, result), ms, self._dimension(args, kwargs))
            return result

        return _Standing(original, call)

    def _note(self, running: object, operation: str, size: int, ms: float, dimension: str) -> None:
        if running is None:
            self.calls.append(Call(self._outside, "", dimension, operation, size, ms, STEP))
            return
        step, phase = running
        per = period(dimension, operation, phase, self.reshard_after_forward)
        if per == STEP:
            step.step_collective_ms[phase] = step.step_collective_ms.get(phase, 0.0) + ms
        slot = next((slot for slot, each in reversed(self.recorder.passes) if each is step), None)
        self.calls.append(Call(slot, phase, dimension, operation, size, ms, per))

    def _dimension(self, args: tuple, kwargs: dict) -> str:
        """The mesh dimension of the call's group (None: the default group), by its name."""
        name = None
        for value in (*args, *kwargs.values()):
            if isinstance(value, dist.ProcessGroup):
                name = value.group_name
            elif isinstance(value, str) and value in self.dimensions:
                name = value
        if name is None:
            name = dist.distributed_c10d._get_default_group().group_name
        if name not in self.dimensions:
            raise RuntimeError(f"a collective on process group {name!r}, which is no dimension of the mesh measured")
        return self.dimensions[name]


class _Standing:
    """`call` standing in for `original`, which answers for every attribute (an op's `.default`, which
    selective recompute's policy looks up)."""

    def __init__(self, original: Any, call: Callable[..., Any]) -> None:
        self._original, self._call = original, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


def _whole_bytes(args: tuple, kwargs: dict, result: object) -> int:
    """The largest tensor, or list of tensors, a collective takes or returns: its whole, unsharded tensor."""
    sizes = []
    for value in (*args, *kwargs.values(), result):
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        sizes.append(sum(t.numel() * t.element_size() for t in tensors))
    return max(sizes, default=0)
