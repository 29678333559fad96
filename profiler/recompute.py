"""The recompute modes a torch block can run under, as the profiler measures them and a plan applies them.

`full`: the block under non-reentrant `torch.utils.checkpoint`; only its inputs are kept (and, on the
CPU, the random generator's state: `checkpoint_state_bytes`).
`selective`: selective activation checkpointing that keeps matmul and attention outputs and recomputes
the cheap elementwise work (norms, activations, rotary) in backward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from solver.vocabulary.profile import FULL, NONE, SELECTIVE

TORCH_MODES = (NONE, SELECTIVE, FULL)

_aten = torch.ops.aten
# Outputs worth keeping: the matmuls and attention kernels that cost the most to redo (grouped: the
# experts of transformers' MoE blocks, which run all experts in one call).
SELECTIVE_SAVE_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)


def selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# newer torch calls the policy after the op, with its output (`ctx.op_output`); older torch (2.11) before it
POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def _counting_policy(on_kept: Callable[[torch.Tensor], None]) -> Callable[..., CheckpointPolicy]:
    """`selective_policy` that also shows `on_kept` every output it keeps in the forward."""

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        decision = selective_policy(ctx, op, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            for leaf in tree_leaves(ctx.op_output):
                if isinstance(leaf, torch.Tensor):
                    on_kept(leaf)
        return decision

    return policy


class _KeptCounter(TorchDispatchMode):
    """Where the policy cannot see outputs: shows `on_kept` each output selective mode keeps as its op
    returns, from inside selective checkpointing's own mode (a second Python hop per op, which the
    profiled forward time then includes)."""

    def __init__(self, on_kept: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.on_kept = on_kept

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        output = func(*args, **(kwargs or {}))
        if func in SELECTIVE_SAVE_OPS:
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor):
                    self.on_kept(leaf)
        return output


def _counting_contexts(on_kept: Callable[[torch.Tensor], None]) -> tuple[contextlib.AbstractContextManager, object]:
    """Selective checkpointing's forward and recompute contexts, the forward one counting what it keeps."""
    if POLICY_SEES_OUTPUT:
        return create_selective_checkpoint_contexts(_counting_policy(on_kept))
    caching, cached = create_selective_checkpoint_contexts(selective_policy)

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        with caching, _KeptCounter(on_kept):
            yield

    return forward(), cached


def checkpoint_state_bytes(device: torch.device) -> int:
    """What each checkpointed call holds on `device` until its backward besides the tensors it saves:
    the CPU generator's state, which `torch.utils.checkpoint` keeps to recompute with the same random
    numbers (5,056 bytes in torch 2.13; a CPU tensor, so nothing on an accelerator, whose own states
    it keeps as CPU tensors too)."""
    return torch.get_rng_state().nbytes if device.type == "cpu" else 0


def checkpoint_function(mode: str, on_kept: Callable[[torch.Tensor], None] | None = None) -> Callable[..., object]:
    """`fn, *args -> fn(*args)` under recompute `mode` (`full` or `selective`). `on_kept` sees each tensor
    selective mode keeps beyond the block's inputs (saved-tensor hooks cannot: checkpointing keeps them
    in its own cache)."""
    if mode == FULL:
        return functools.partial(checkpoint, use_reentrant=False)
    if mode == SELECTIVE:
        if on_kept is None:
            context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy)
        else:
            context_fn = functools.partial(_counting_contexts, on_kept)
        return functools.partial(checkpoint, use_reentrant=False, context_fn=context_fn)
    raise ValueError(f"recompute mode {mode!r}: expected {FULL} or {SELECTIVE}")


def set_recompute(
    module: nn.Module, mode: str, on_kept: Callable[[torch.Tensor], None] | None = None
) -> Callable[[], None]:
    """Run `module` under recompute `mode` from its next call on; returns the function that undoes it.

    transformers' layers (`GradientCheckpointingLayer`) are switched through their own checkpointing
    attributes, which also stop the layer from writing its KV cache twice (once more in the recompute).
    Other modules get their `forward` wrapped; hooks on the module stay outside the checkpoint either way.
    """
    if mode == NONE:
        return _nothing
    function = checkpoint_function(mode, on_kept)
    if any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__):
        saved = {name: module.__dict__[name] for name in _HF_ATTRIBUTES if name in module.__dict__}
        module.gradient_checkpointing = True
        module._gradient_checkpointing_func = function

        def undo_attributes() -> None:
            for name in _HF_ATTRIBUTES:
                module.__dict__.pop(name, None)
            module.__dict__.update(saved)

        return undo_attributes
    had_forward = "forward" in module.__dict__
    original = module.forward
    module.forward = functools.partial(function, original)

    def undo_forward() -> None:
        if had_forward:
            module.forward = original
        else:
            del module.forward

    return undo_forward


_HF_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _nothing() -> None:
    pass
