"""The job the hook runs in, as the ranks agree on it: whether it is distributed, this process's rank, and
what every rank (or rank 0) says, as bytes over the default process group (nothing is pickled)."""

from __future__ import annotations

import torch.distributed as dist

from profiler.distributed import all_gather_bytes


def distributed() -> bool:
    """Whether this process is one rank of a torch.distributed job of more than one."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def everyone(payload: bytes) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank (every rank must call it)."""
    return all_gather_bytes(payload) if distributed() else [payload]


def from_rank0(payload: bytes) -> bytes:
    """Rank 0's `payload`, on every rank (every rank must call it)."""
    return everyone(payload)[0]
