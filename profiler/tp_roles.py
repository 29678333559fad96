"""What tensor parallelism splits of a transformers Llama-family model under TorchTitan's plan, tagged
while the profiler measures one process: each saved tensor and parameter by the module that owns it.

The plan (measured with DTensor on torch 2.13: docs/results/nd-validation.md): q/k/v and gate/up projections and the LM head
column-parallel (their input whole on every rank, their output split), o/down projections row-parallel
(input split, output whole: partial sums, then reduced), attention and the MLP's inner work split by
heads and FFN width, norms, the router and row-parallel biases replicated, the embedding split by
vocabulary with its gradient whole. With sequence parallel the residual stream (a block's input, the
norms' inner tensors) is split by sequence too; the column-parallel inputs stay whole (all-gathered).
Roles of a saved tensor: SPLIT (/ t), SEQUENCE (whole, / t with sequence parallel), REPLICATED (whole),
EXPERT (the routed experts' token copies: split, and scaled by expert parallel's token bound).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from profiler.estimate.shape import LLAMA_FAMILY

SPLIT, SEQUENCE, REPLICATED, EXPERT = "split", "sequence", "replicated", "expert"
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"})
ROW = frozenset({"o_proj", "down_proj"})
ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})
EXPERTS = frozenset({"experts"})
REGIONS = frozenset({"self_attn", "mlp", "block_sparse_moe"})  # attention and MLP: split but for the above


def tagged(model: nn.Module) -> bool:
    """Whether the model is one whose modules these names describe."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in LLAMA_FAMILY


def is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


@dataclass
class _Frame:
    leaf: str
    norm: bool
    inputs: frozenset[int]


class Owners:
    """The modules running now, innermost last (hooks on every module of the model), and the role of a
    tensor saved under them."""

    def __init__(self, model: nn.Module, storage_key) -> None:  # type: ignore[no-untyped-def]
        self.stack: list[_Frame] = []
        # what row-parallel layers and routers returned, whole on every rank: storage -> the tensor, while it
        # lives (a freed storage's address is soon another tensor's)
        self.whole_outputs: dict[int, weakref.ref] = {}
        self._key = storage_key
        self._handles = []
        for name, module in model.named_modules():
            if module is model:
                continue
            leaf = name.rsplit(".", 1)[-1]
            self._handles.append(module.register_forward_pre_hook(self._enter(leaf, is_norm(module)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave(leaf), always_call=True))

    def _enter(self, leaf: str, norm: bool):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs = frozenset(self._key(t)[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.stack.append(_Frame(leaf, norm, inputs))

        return hook

    def _leave(self, leaf: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if self.stack:
                self.stack.pop()
            if leaf in ROW or leaf in ROUTERS:
                self.whole_outputs.update(
                    (self._key(t)[0], weakref.ref(t)) for t in tree_leaves(output) if isinstance(t, torch.Tensor)
                )

        return hook

    def reset(self) -> None:
        self.stack.clear()
        self.whole_outputs.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def role(self, key: int, body: bool) -> str:
        """The role of the storage `key` saved now, in a body block (`body`) or in the head or tail."""
        frames = self.stack
        if any(frame.leaf in EXPERTS for frame in frames):
            return EXPERT
        output = self.whole_outputs.get(key)
        if output is not None and output() is not None and self._key(output())[0] == key:
            return REPLICATED
        for depth in range(len(frames) - 1, -1, -1):
            frame = frames[depth]
            if frame.leaf in COLUMN:
                return REPLICATED if key in frame.inputs else SPLIT
            if frame.leaf in ROW:
                return SPLIT if key in frame.inputs else REPLICATED
            if frame.leaf in ROUTERS:
                return REPLICATED
            if frame.norm:  # a norm over heads (Qwen3's q_norm, k_norm) is split with its heads
                return SPLIT if any(outer.leaf in REGIONS for outer in frames[:depth]) else SEQUENCE
            if frame.leaf in REGIONS:
                return SPLIT
        # the residual stream of a block (its input, which a checkpoint keeps); outside the blocks the
        # token ids and the loss's tensors, on the replicated logits
        return SEQUENCE if body else REPLICATED


def role_bytes(kept: Mapping[int, int], roles: Mapping[int, str], left_out: Iterable[int]) -> tuple[int, int, int]:
    """(bytes whole under tensor parallel, whole under sequence parallel, the experts') of `kept`
    (storage -> bytes), leaving `left_out` out."""
    skip = set(left_out)
    sums = {SPLIT: 0, SEQUENCE: 0, REPLICATED: 0, EXPERT: 0}
    for key, size in kept.items():
        if key not in skip:
            sums[roles.get(key, SPLIT)] += size
    return sums[SEQUENCE] + sums[REPLICATED], sums[REPLICATED], sums[EXPERT]


def parameter_roles(model: nn.Module) -> dict[int, tuple[bool, bool, bool]]:
    """id(parameter) -> (replicated under tensor parallel, a routed expert's, its gradient whole)."""
    roles: dict[int, tuple[bool, bool, bool]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        for param_name, param in module.named_parameters(recurse=False):
            replicated = is_norm(module) or leaf in ROUTERS or (leaf in ROW and param_name == "bias")
            # torch's DTensor embedding backward returns a whole (Replicate) gradient for a split weight
            whole_gradient = replicated or isinstance(module, nn.Embedding)
            roles.setdefault(id(param), (replicated, leaf in EXPERTS, whole_gradient))
    return roles
