"""The tensors the recorder handles: storages and their bytes, a block's input and output, copies of its
inputs to re-run it alone."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._pytree import tree_leaves


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """A key for the memory behind `tensor` and its size in bytes (views share their base's key; a
    DTensor's are its local shard's)."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr() or id(storage), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return id(tensor), tensor.numel() * tensor.element_size()


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return storage_key(tensor)[1]


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages behind `tensors`, each counted once (tied and viewed tensors share one)."""
    return sum(dict(storage_key(t) for t in tensors).values())


def _input_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The activation a block receives: the first floating tensor argument that requires grad."""
    candidates = [*args, kwargs.get("hidden_states"), *kwargs.values()]
    for value in candidates:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


def _output_tensor(output: object) -> torch.Tensor | None:
    for value in tree_leaves(output):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _without_cache(kwargs: dict) -> dict:
    """A block's keyword arguments without a KV cache, which a re-run would append to a second time."""
    kwargs = {key: None if key in _CACHE_ARGUMENTS else value for key, value in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _detached(values: object) -> object:
    """A copy of a block's inputs (or the tail's) for re-running it alone: tensors detached and cloned."""

    def copy(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return value.detach().clone().requires_grad_(value.requires_grad)
        return value

    return torch.utils._pytree.tree_map(copy, values)
