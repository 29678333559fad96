"""The gloo process group of the CPU ranks sapp-hook spawns itself (validation runs, multi-process tests)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def gloo_group(rank: int, world_size: int, store: str | Path) -> Iterator[None]:
    """Join a gloo group of `world_size` ranks that meet at the file `store`, one intra-op thread each;
    destroy it on leaving."""
    import torch
    import torch.distributed as dist

    # torch.distributed.nn.functional binds `group.WORLD` into default arguments when first imported
    # (FSDP imports it, and transformers imports FSDP on building a model). Imported after the group
    # is made, it holds the group past destroy_process_group; the group's gloo threads are then torn
    # down with the interpreter, which now and then aborts the rank at exit (SIGABRT, "terminate
    # called without an active exception"). Imported first, its defaults are None.
    import torch.distributed.nn.functional

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
