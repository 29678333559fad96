"""Test-only: TorchTitan 0.2.2's own Trainer on a CPU-only machine with torch 2.13's CPU build and gloo.
Imported before torchtitan by the training scripts the TorchTitan tests launch; each patch says why."""

from __future__ import annotations

import os
import resource
import sys
import types

import torch
import torch._utils
import torch.distributed as dist

# TorchTitan picks its device when imported and falls back to "cuda": report "cpu" (it then picks gloo itself)
torch._utils._get_available_device_type = lambda: "cpu"


class _Properties:
    """The fields of torch.cuda.get_device_properties() TorchTitan's memory monitor reads."""

    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name = "cpu"


def _resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_stats(*args: object, **kwargs: object) -> dict[str, int]:
    rss = _resident_bytes()
    return {
        "active_bytes.all.peak": rss,
        "active_bytes.all.current": rss,
        "reserved_bytes.all.peak": rss,
        "reserved_bytes.all.current": rss,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


# TorchTitan's DeviceMemoryMonitor calls torch.<device>'s CUDA-style memory functions, which torch.cpu lacks
for _name, _function in {
    "get_device_name": lambda *args, **kwargs: "cpu",
    "get_device_properties": lambda *args, **kwargs: _Properties(),
    "reset_peak_memory_stats": lambda *args, **kwargs: None,
    "empty_cache": lambda *args, **kwargs: None,
    "memory_stats": _memory_stats,
}.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _function)

_barrier = dist.barrier


def _barrier_without_cpu_device(group=None, async_op=False, device_ids=None):  # type: ignore[no-untyped-def]
    """TorchTitan passes device_ids=[torch.cpu.current_device()], the string "cpu", which gloo refuses."""
    if device_ids is not None and not all(isinstance(device, int) for device in device_ids):
        device_ids = None
    return _barrier(group=group, async_op=async_op, device_ids=device_ids)


dist.barrier = _barrier_without_cpu_device
if not hasattr(dist, "set_timeout"):  # TorchTitan calls the name torch gave it after 2.13
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.set_timeout = _set_pg_timeout


def _needs_triton(*args: object, **kwargs: object) -> None:
    raise RuntimeError("TorchTitan's MoE token permutation needs triton")


# TorchTitan's MoE token-permutation kernels import triton, which CPU-only machines lack; the dense model never
# runs them, so they stand in as functions that say so
_kernels = types.ModuleType("torchtitan.models.moe.kernels")
_kernels.generate_permute_indices = _kernels.fill_indices_wrapper = _needs_triton
sys.modules.setdefault("torchtitan.models.moe.kernels", _kernels)
