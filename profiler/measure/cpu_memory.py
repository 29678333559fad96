"""The CPU allocator's counters, which torch does not keep: bytes of the tensors ops create, until freed.

While entered, a dispatch mode sees every op's outputs; a storage no input of the op shares (not a view,
not written in place) is new, and is counted until Python's weak reference to it reports it freed.
Buffers a kernel allocates and frees inside one op are not seen. It costs Python work per op (a
tiny-llama training step ran 1.0-1.5x as long), so the profiler counts memory this way only in steps
it does not time.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from profiler.measure.recorder import storage_key


class CpuMemory(TorchDispatchMode):
    """`allocated()`, `reset_peak()` and `peak()` as an accelerator's allocator gives them, for what
    ops create on the CPU while the mode is entered (`with memory: ...`)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, weakref.ref] = {}  # storage key -> a weak reference that reports its release

    def allocated(self) -> int:
        return self.live_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def peak(self) -> int:
        return self.peak_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {storage_key(t)[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self._count(tensor, inputs)
        return out

    def _count(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        key, size = storage_key(tensor)
        if key in inputs or key in self._live:
            return
        try:
            reference = weakref.ref(tensor.untyped_storage(), lambda _, key=key, size=size: self._release(key, size))
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a plain storage
            return
        self._live[key] = reference
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor`'s storage, if counted: what is held for the whole step from now on
        (a parameter's new gradient, which plans count with the static bytes)."""
        key, size = storage_key(tensor)
        self._release(key, size)

    def _release(self, key: int, size: int) -> None:
        if self._live.pop(key, None) is not None:
            self.live_bytes -= size
