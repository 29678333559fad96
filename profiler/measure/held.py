"""How many bytes autograd holds for backward at its peak, in any run (a real pipeline step included).

Each saved tensor is wrapped in a small holder when autograd saves it; the holder goes when autograd
frees it (after the backward that used it). Storages are counted once however many tensors share
them (a DTensor's local shard); parameters and buffers are left out, FSDP's gathered parameters too,
whose storages are new at every all-gather (`moving`). What checkpointing keeps in its own cache
(selective recompute's saved op outputs) the hooks do not see: `keep` counts it, handed each such tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from types import TracebackType

import torch

from profiler.measure.recorder import storage_key


class _Held:
    __slots__ = ("key", "tensor", "tracker")

    def __init__(self, tracker: HeldActivations, key: int, tensor: torch.Tensor) -> None:
        self.tracker, self.key, self.tensor = tracker, key, tensor

    def __del__(self) -> None:
        self.tracker._release(self.key)


class HeldActivations:
    """`with HeldActivations(model.parameters()) as held: ...`; then `held.peak_bytes`."""

    def __init__(self, excluded: Iterable[torch.Tensor] = (), moving: Callable[[], set[int]] | None = None) -> None:
        self.excluded = {storage_key(t)[0] for t in excluded}
        self.moving = moving  # the storage keys to leave out as they are at each save
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counts: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> HeldActivations:
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, trace)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def keep(self, tensor: torch.Tensor) -> None:
        """Count `tensor` until its memory is freed (`profiler.recompute.set_recompute`'s `on_kept`)."""
        key, size = storage_key(tensor)
        if key in self.excluded:
            return
        weakref.finalize(tensor.untyped_storage(), self._release, key)
        self._hold(key, size)

    def _pack(self, tensor: torch.Tensor) -> object:
        key, size = storage_key(tensor)
        if key in self.excluded or (self.moving is not None and key in self.moving()):
            return tensor
        self._hold(key, size)
        # detached: holding the pack hook's tensor with its grad_fn closes a cycle a kept graph never frees
        return _Held(self, key, tensor.detach())

    def _hold(self, key: int, size: int) -> None:
        entry = self._counts.get(key)
        if entry is None:
            self._counts[key] = [1, size]
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1

    @staticmethod
    def _unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        entry = self._counts.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._counts[key]
            self.live_bytes -= entry[1]
