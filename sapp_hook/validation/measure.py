"""Measuring a rank of a multi-process run to the byte: collectives settled on the calling thread, what
the rank holds for the whole run (local shards walked), and the time its collectives take.

torch.profiler records no allocation or free made on a thread it does not watch, and gloo's worker
thread often drops the last reference to a collective's work, freeing its buffers (reduce-scatter
inputs, gloo's temporaries) there. While `settled_collectives` is entered, each synchronous collective
returns once gloo has let go of its work, and each functional one (DTensor's) once gloo's worker has
dropped its references, so that every free happens where the profiler sees it. Lifetimes the program
decides are unchanged; collectives take longer, so times are measured without it.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

SYNCHRONOUS = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "all_to_all",
)
FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
LINGER_S = 0.005  # how long past its wait a work is held: gloo's worker lets go of it first
FUNCTIONAL_TIMEOUT_S = 1.0
# torch.profiler's names of collectives and FSDP's ranges around them
COLLECTIVE_PREFIXES = (
    "FSDP::all_gather",
    "FSDP::post_backward_reduce",
    "FSDP::pre_backward",
    "c10d::",
    "_c10d_functional::",
    "c10d_functional::",
)


@contextlib.contextmanager
def settled_collectives() -> Iterator[None]:
    """Collectives settled on the calling thread meanwhile (see the module's docstring)."""
    namespace = torch.ops._c10d_functional
    saved = [(dist, name, getattr(dist, name)) for name in SYNCHRONOUS if hasattr(dist, name)]
    saved += [(namespace, name, getattr(namespace, name)) for name in FUNCTIONAL if hasattr(namespace, name)]
    try:
        for owner, name, original in saved:
            setattr(owner, name, (_settled_functional if owner is namespace else _settled)(original))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _settled(original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.pop("async_op", False):  # the caller holds the work (and its tensors) until it waits
            return original(*args, async_op=True, **kwargs)
        work = original(*args, async_op=True, **kwargs)
        if work is not None:
            work.wait()
            time.sleep(LINGER_S)
        return None

    return call


def _settled_functional(original: Any) -> Any:
    from torch.utils._pytree import tree_leaves

    def call(*args: Any, **kwargs: Any) -> Any:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        uses = [t._use_count() for t in inputs]
        output = original(*args, **kwargs)
        torch.ops._c10d_functional.wait_tensor(output)
        deadline = time.perf_counter() + FUNCTIONAL_TIMEOUT_S
        while (output._use_count() > 1 or [t._use_count() for t in inputs] > uses) and time.perf_counter() < deadline:
            time.sleep(0)
        return output

    return call


def held_bytes(parameters: Iterable[torch.Tensor], optimizer_state: Iterable[torch.Tensor]) -> dict[str, int]:
    """What a rank holds for the whole run, per kind, each storage once (a DTensor's local shard)."""
    from profiler.measure.recorder import unique_bytes

    parameters = list(parameters)
    return {
        "parameter_bytes": unique_bytes(parameters),
        "gradient_bytes": unique_bytes([p.grad for p in parameters if p.grad is not None]),
        "optimizer_bytes": unique_bytes(optimizer_state),
    }


def ddp_bucket_bytes(modules: Iterable[Any]) -> int:
    """The bytes of DDP's gradient buckets (kept for the whole run): none where its gradients are views
    into them, as they then are the gradients."""
    total = 0
    for module in modules:
        if hasattr(module, "reducer") and not module.gradient_as_bucket_view:
            sizes = str(module._get_ddp_logging_data().get("bucket_sizes", ""))  # "bytes, bytes, ..."
            total += sum(int(size) for size in sizes.split(",") if size.strip())
    return total


def collective_times(events: Iterable[Any], start_ns: int, end_ns: int, thread: int) -> list[dict[str, Any]]:
    """Per collective (or FSDP range around collectives) and layer, the calls torch.profiler recorded in
    [start_ns, end_ns] on the rank's training thread `thread`, and their milliseconds there: the time
    the step waits on them, exposed (on gloo every collective runs as that thread waits). FSDP's ranges
    hold the c10d ops they run (`FSDP::pre_backward` the all-gathers it waits for)."""
    totals: dict[tuple[str, str], list[float]] = {}
    for event in events:
        name = event.name()
        if (
            not name.startswith(COLLECTIVE_PREFIXES)
            or event.start_thread_id() != thread
            or not start_ns <= event.start_ns() <= end_ns
        ):
            continue
        found = re.match(r"(.*?) \((.*)\)$", name)
        key = (found.group(1), found.group(2)) if found else (name, "")
        entry = totals.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += (event.end_ns() - event.start_ns()) / 1e6
    return [
        {"name": name, "layer": layer, "calls": int(calls), "exposed_ms": ms}
        for (name, layer), (calls, ms) in sorted(totals.items())
    ]
