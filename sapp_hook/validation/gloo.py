"""The gloo process groups of the CPU ranks sapp-hook spawns itself (validation runs, multi-process tests)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def spawn(main: Callable[..., None], args: tuple, world_size: int, join: bool = True) -> Any:
    """Run `main(rank, *args)` on `world_size` spawned processes (torch.multiprocessing.spawn: its context
    when `join` is False). A rank whose `main` returns ends at once, without interpreter teardown."""
    import torch.multiprocessing as mp

    return mp.spawn(_rank, args=(main, *args), nprocs=world_size, join=join)


def _rank(rank: int, main: Callable[..., None], *args: Any) -> None:
    main(rank, *args)
    # Gloo groups can outlive destroy_process_group (a DeviceMesh in DTensor's caches holds its groups,
    # torch.distributed.nn.functional binds group.WORLD)
    end_without_teardown(0)


def end_without_teardown(status: int) -> None:
    """End the process with `status`, logs and streams flushed, without tearing the interpreter down: gloo's
    threads torn down with it now and then abort the process (SIGABRT, "terminate called without an active
    exception")."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextmanager
def gloo_group(rank: int, world_size: int, store: str | Path) -> Iterator[None]:
    """Join a gloo group of `world_size` ranks that meet at the file `store`, one intra-op thread each;
    destroy it on leaving."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
