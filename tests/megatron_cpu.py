"""Test-only: Megatron-core 0.16.1's pipeline schedules on a CPU-only machine with torch 2.13's CPU build and gloo.
Imported before megatron by the training scripts the Megatron tests launch; each patch says why."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device: object) -> object:
    cuda = isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda"))
    return torch.device("cpu") if cuda or (isinstance(device, torch.device) and device.type == "cuda") else device


class _CudaToCpu(TorchFunctionMode):
    """Megatron makes its schedules' and p2p buffers' tensors with device="cuda" (or the current CUDA device's
    index) and moves modules with .cuda(): each becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if getattr(func, "__name__", "") == "cuda":
            return args[0]
        return func(*args, **kwargs)


# Megatron asks CUDA for its device, synchronizes it, and keeps its model-parallel random state there
torch.cuda.current_device = lambda: 0
torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
_CudaToCpu().__enter__()

import megatron.core.tensor_parallel.random as _random  # noqa: E402  (after the CUDA calls it reads are patched)

_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
