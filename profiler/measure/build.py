"""From measured samples to a `ModelProfile`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from profiler.estimate.blocks import expert_gradient_bytes
from profiler.estimate.shape import model_dimensions
from profiler.layers import Block
from profiler.measure.recorder import HEAD, TAIL, Recorder, unique_bytes
from profiler.measure.samples import LayerSamples, median, spread
from profiler.measure.split import SplitBackward
from profiler.recompute import checkpoint_state_bytes
from profiler.tp_roles import parameter_roles, tagged
from solver.vocabulary.profile import (
    NONE,
    LayerProfile,
    ModelProfile,
    RecomputeCost,
    TiedParameter,
)


def build_profile(
    recorder: Recorder,
    samples: Mapping[object, LayerSamples],
    *,
    model: nn.Module,
    model_name: str,
    device: torch.device,
    blocks: Sequence[Block],
    modes: Sequence[str],
    pool: bool,
    micro_batch: dict[str, int] | None,
    backward_splits: Mapping[str, SplitBackward],
) -> ModelProfile:
    """The profile of what `recorder` and `samples` measured of `model`'s head, `blocks` (each in
    `modes`) and tail; with `pool`, the blocks of each body kind take their kind's pooled times."""
    structure = recorder.structure
    body = [*structure.body_order, *structure.mtp_order]  # MTP blocks last, whatever order they ran in
    slots: list[object] = [
        *([HEAD] if recorder.has_head else []),
        *body,
        *([TAIL] if recorder.has_tail else []),
    ]
    samples = {slot: samples.get(slot, LayerSamples()) for slot in slots}
    timing = dict(samples)
    if pool:
        by_kind: dict[str, LayerSamples] = {}
        for index in body:
            kind = blocks[index].kind
            by_kind[kind] = by_kind[kind].merged(samples[index]) if kind in by_kind else samples[index]
        timing.update({index: by_kind[blocks[index].kind] for index in body})
    state = checkpoint_state_bytes(device)  # in every recompute mode's activations, and stated
    dimensions = model_dimensions(model.config.to_dict()) if tagged(model) else {}
    roles = parameter_roles(model) if tagged(model) else None
    parts = _Parts(roles, dimensions, _tokens(micro_batch or _micro_batch(recorder.input_shape)), _dtype_size(model))
    layers = []
    for slot in slots:
        params = structure.slot_parameters.get(slot, [])
        if slot in (HEAD, TAIL):
            name, kind, layer_modes = str(slot), str(slot), (NONE,)
        else:
            name, kind = blocks[slot].name, blocks[slot].kind
            layer_modes = (NONE,) if slot in recorder.mtp else modes  # frameworks recompute no MTP layer
        layers.append(
            _layer(
                name,
                kind,
                layer_modes,
                samples[slot],
                timing[slot],
                params,
                recorder,
                backward_splits.get(kind),
                state,
                parts,
            )
        )
    return ModelProfile(
        layers=tuple(layers),
        model=model_name,
        source="measured",
        device=device_name(device),
        dtype=parameters_dtype(model),
        micro_batch=micro_batch or _micro_batch(recorder.input_shape),
        fingerprint=fingerprint([model_structure(model, blocks)]),
        # the hidden state a body block receives is what a stage sends on
        stage_output_bytes=median([size for index in structure.body_order for size in samples[index].input_bytes]),
        model_output_bytes=median(recorder.output_bytes),
        loss_bytes=median(recorder.loss_bytes),
        stage_shared_bytes=_shared_bytes(samples, structure.body_order),
        checkpoint_state_bytes=state,
        tied_parameters=tied_parameters(model, structure.slot_parameters, dict(zip(slots, layers))),
        dimensions=dimensions,
    )


def _shared_bytes(samples: dict[object, LayerSamples], body_order: list[int]) -> float:
    """Per micro-batch, what the blocks keep of what a stage computes for them all: each storage
    counts once per forward, for the first block to keep it, so the sum over the blocks' passes
    over the first block's passes. Without recompute: checkpointing keeps such tensors through its
    own frame, out of the saved-tensor hook's sight (the allocator holds them all the same)."""
    if not body_order:
        return 0.0
    passes = len(samples[body_order[0]].shared_bytes.get(NONE, []))
    return sum(sum(samples[index].shared_bytes.get(NONE, [])) for index in body_order) / max(passes, 1)


def _layer(
    name: str,
    kind: str,
    modes: Sequence[str],
    memory: LayerSamples,
    timing: LayerSamples,
    params: list[nn.Parameter],
    recorder: Recorder,
    split: SplitBackward | None,
    checkpoint_state: int,
    parts: _Parts,
) -> LayerProfile:
    """One layer's profile from its samples. `split`: the layer kind's split backward, where it was
    measured. `checkpoint_state`: what each checkpointed call keeps beside its saved tensors
    (`checkpoint_state_bytes`).

    torch's split backward frees everything a layer saved at its W: no retained_bytes. What it holds
    from I to W is measured per body kind, and for the tail where the profiler was given it as a
    module (its I holds the logits' gradient for the LM head's weight gradient but frees about as
    much of what the loss saved); none for the head, whose input takes no gradient (torch runs the
    first stage's whole backward at its W). What a layer's I holds until its stage's I ends is more
    than it leaves pending: torch frees the graph on the side of the stage's output only then (the
    tail's: what the loss saved, its log-softmax), and in a stage every layer but the last keeps its
    own (less the gradient handed to it, which its W does not need and frees)."""
    forward_ms = median(timing.forward_ms.get(NONE, []))
    backward_ms = median(timing.backward_ms.get(NONE, []))
    kept_none = median(memory.kept_bytes.get(NONE, []))
    boundary_bytes = median(memory.input_bytes)
    recompute = {}
    for mode in modes:
        extra_ms = 0.0
        if mode != NONE:  # what the mode adds to the whole layer, its slower forward included
            with_mode = median(timing.forward_ms.get(mode, [])) + median(timing.backward_ms.get(mode, []))
            extra_ms = max(0.0, with_mode - forward_ms - backward_ms)
        # what checkpointing keeps beside the saved tensors (out of their hooks' sight) counts as kept
        kept = min(median(memory.kept_bytes.get(mode, [])) + (0 if mode == NONE else checkpoint_state), kept_none)
        saved_input = min(median(memory.saved_input_bytes.get(mode, [])), kept)
        if memory.backward_peak_bytes.get(mode):
            working = median(memory.backward_peak_bytes[mode])
        elif kind.startswith("body:"):  # memory not counted: the gradients flowing in and out, and what is rebuilt
            working = 2 * boundary_bytes + (kept_none - kept)
        else:
            working = 0.0
        recompute[mode] = RecomputeCost(
            extra_ms=extra_ms,
            activation_bytes=kept,
            working_bytes=working,
            **split_cost_fields(split, mode, kept),
            saved_input_bytes=saved_input,
            **parts.of_mode(memory, mode, kept, 0 if mode == NONE else checkpoint_state),
        )
    static = parts.of_parameters(_unique(params), recorder)
    if "expert_parameter_bytes" in static:
        gradients = parts.expert_gradient_bytes() if static["expert_parameter_bytes"] else 0.0
        recompute = {
            mode: dataclasses.replace(cost, expert_working_bytes=min(gradients, cost.working_bytes))
            for mode, cost in recompute.items()
        }
    input_ms = weight_ms = None
    if kind == HEAD:
        weight_ms = backward_ms  # the head's input is token ids: all its backward is weight gradients
    elif split is not None:
        weight_ms = min(backward_ms * split.weight_share, backward_ms)
        input_ms = backward_ms * split.input_share
    return LayerProfile(
        name=name,
        kind=kind,
        forward_ms=forward_ms,
        backward_ms=backward_ms,
        weight_ms=weight_ms,
        input_ms=input_ms,
        recompute=recompute,
        parameter_bytes=unique_bytes(params),
        gradient_bytes=sum(recorder.gradient_bytes.get(id(p), 0) for p in _unique(params)),
        optimizer_bytes=sum(recorder.optimizer_bytes.get(id(p), 0) for p in _unique(params)),
        spread={
            "forward_ms": spread(timing.forward_ms.get(NONE, [])),
            "backward_ms": spread(timing.backward_ms.get(NONE, [])),
        },
        **static,
    )


@dataclass(frozen=True)
class _Parts:
    """What tensor and expert parallelism treat apart in a layer (`tp_roles`), for the models it tags:
    `roles` None for others, whose layers state only their parameter tensors."""

    roles: dict[int, tuple[bool, bool, bool]] | None
    dimensions: dict[str, int]
    tokens: int
    dtype_bytes: int

    def of_mode(self, memory: LayerSamples, mode: str, kept: float, checkpoint_state: int) -> dict[str, float]:
        """A recompute mode's parts; what a checkpoint holds besides its saved tensors stays whole."""
        if self.roles is None or mode not in memory.tp_whole_bytes:
            return {}
        return {
            "tp_whole_activation_bytes": min(median(memory.tp_whole_bytes[mode]) + checkpoint_state, kept),
            "sp_whole_activation_bytes": min(median(memory.sp_whole_bytes[mode]) + checkpoint_state, kept),
            "expert_activation_bytes": min(median(memory.expert_bytes[mode]), kept),
        }

    def of_parameters(self, params: list[nn.Parameter], recorder: Recorder) -> dict[str, float]:
        if self.roles is None:
            return {"parameter_tensors": len(params)}
        roles = [self.roles.get(id(p), (False, False, False)) for p in params]
        return {
            "parameter_tensors": len(params),
            "replicated_parameter_bytes": float(unique_bytes([p for p, role in zip(params, roles) if role[0]])),
            "expert_parameter_bytes": float(unique_bytes([p for p, role in zip(params, roles) if role[1]])),
            "replicated_gradient_bytes": float(
                sum(recorder.gradient_bytes.get(id(p), 0) for p, role in zip(params, roles) if role[2])
            ),
        }

    def expert_gradient_bytes(self) -> float:
        """The routed experts' gradients alive in a MoE layer's backward, as profiler.estimate.analytic counts them
        (an allocator peak is not split by module)."""
        dims = self.dimensions
        return expert_gradient_bytes(
            self.tokens,
            dims.get("hidden", 0),
            dims.get("moe_ffn", 0),
            dims.get("experts_per_token", 0),
            self.dtype_bytes,
        )


def _tokens(micro_batch: dict[str, int]) -> int:
    return micro_batch.get("size", 0) * micro_batch.get("sequence", 0)


def _dtype_size(model: nn.Module) -> int:
    return next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)


def tied_parameters(
    model: nn.Module, slot_parameters: dict[object, list[nn.Parameter]], layers: dict[object, LayerProfile]
) -> tuple[TiedParameter, ...]:
    """Parameters used by more than one layer (a tied embedding and LM head): each layer counts them."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    holders: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for slot, slot_params in slot_parameters.items():
        if slot not in layers:
            continue
        for param in _unique(slot_params):
            holders.setdefault(id(param), []).append(layers[slot].name)
            params[id(param)] = param
    return tuple(
        TiedParameter(names=tuple(names.get(key, [])), layers=tuple(held), bytes=unique_bytes([params[key]]))
        for key, held in holders.items()
        if len(held) > 1
    )


# what wrappers add to a parameter's name: torch's checkpoint wrapper, torch.compile, DDP
_WRAPPER_NAMES = re.compile(r"(?:^|(?<=\.))(?:_checkpoint_wrapped_module|_orig_mod|module)\.")


def model_structure(model: nn.Module, blocks: Sequence[Block]) -> dict[str, list]:
    """What `model` (or the part of a model a pipeline rank holds) is made of, wherever a pipeline splits it:
    each block's kind and parameters (named within the block, with shape and dtype) in order, and the
    parameters outside the blocks; wrappers' names left out, so that checkpointing or compiling a layer
    changes nothing."""

    def described(named: Iterable[tuple[str, nn.Parameter]]) -> list[list[object]]:
        return [[_WRAPPER_NAMES.sub("", name), list(p.shape), str(p.dtype)] for name, p in named]

    inside = {id(p) for block in blocks for p in block.module.parameters()}
    return {
        "blocks": [[block.kind, described(block.module.named_parameters())] for block in blocks],
        "outside": described((name, p) for name, p in model.named_parameters() if id(p) not in inside),
    }


def fingerprint(structures: Sequence[Mapping[str, list]]) -> str:
    """A model's fingerprint from the `model_structure` of each pipeline rank's part of it, in pipeline order (one
    for a whole model): the same for any split of one model over the same ranks (a whole model holds a tied
    embedding once, where a split's first and last ranks each name it)."""
    blocks = [block for part in structures for block in part["blocks"]]
    outside = sorted(entry for part in structures for entry in part["outside"])
    return hashlib.sha256(json.dumps([blocks, outside]).encode()).hexdigest()[:16]


def split_cost_fields(split: SplitBackward | None, mode: str, kept: float) -> dict[str, float | None]:
    """A recompute mode's split-backward fields (`RecomputeCost`) from its layer kind's measured split;
    `kept`: the mode's activation bytes."""
    # the halves' working sets are measured without recompute; with it the whole backward's stands for both
    halves = split is not None and mode == NONE
    return {
        "pending_bytes": split.pending_bytes if split is not None else 0.0,
        "input_working_bytes": split.input_working_bytes if halves else None,
        "weight_working_bytes": split.weight_working_bytes if halves else None,
        "input_held_bytes": None if split is None else split.input_held_bytes,
        "output_gradient_freed_bytes": 0.0 if split is None else split.output_gradient_freed_bytes,
        "weight_freed_bytes": min(split.weight_freed_bytes, split.pending_bytes + kept) if halves else None,
    }


def _unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def device_name(device: torch.device) -> str:
    """`cpu`, or `cuda:` and the GPU's name: what a profile and a cached plan say they were measured on."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def parameters_dtype(model: nn.Module) -> str:
    """The dtype of the model's first floating-point parameter (`bfloat16`); "" where it has none."""
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return ""


def _micro_batch(shape: tuple[int, ...] | None) -> dict[str, int]:
    if not shape or len(shape) < 2:
        return {}
    return {"size": int(shape[0]), "sequence": int(shape[1])}
