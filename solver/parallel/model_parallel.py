"""What one rank of the job's mesh holds and spends: the profile of a rank, from a profile and the spec.

`rank_profile(profile, spec)` is applied where planning starts (`solve`, `evaluate_plan`), so the
integer program and the simulator see one rank's numbers and nothing else changes. It applies only
what the profile does not say it has applied already (`ModelProfile.mesh`), and refuses a spec that
would divide twice or that does not divide the model.

Tensor parallel (TorchTitan's plan for transformers' Llama family under DTensor, measured on torch 2.13
with 2 x 2 gloo ranks: docs/results/nd-validation.md): a layer keeps (A - W) / t + W of each recompute mode's activation,
W what stays whole on every rank (its `tp_whole_activation_bytes`, or `sp_whole_activation_bytes`
with sequence parallel); split weights / t, replicated ones whole (norms, row-parallel biases, the
router); the embedding's gradient whole; a block's backward gradients / t, the head's and the tail's
working sets whole (the embedding's whole gradient, the replicated logits); a split backward's fields
/ t (some of them stay whole on a rank: a profile measured on the mesh has each rank's); times / t.
With sequence parallel, what stages pass is each rank's sequence shard (/ t).
Context parallel (not measured: torch 2.13 has no CPU ring attention): every activation, working set,
what stages pass and the rotary tables / c, times / c; each block's backward also holds one remote
key-value chunk and its gradient.
Expert parallel (not measured: no expert-parallel engine for transformers' MoE in torch 2.13): expert
weights / e; the experts' activations scale with the token copies a rank receives (`token_copies_ratio`);
each MoE layer's backward holds its all-to-all buffers; times as balanced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from basics.errors import InputError, named
from solver.vocabulary.profile import NONE, LayerProfile, ModelProfile, RecomputeCost
from solver.vocabulary.profile_parts import BALANCED, Mesh
from solver.vocabulary.spec import PipelineSpec, capacity_factor

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# what to do when a profile lacks what a degree needs
REMEDY = "profile again with this sapp-hook (a Llama-family model), or estimate with `sapp-hook profile --estimate`"
# the recompute cost fields a split backward holds: gradients, split like the backward's
SPLIT_FIELDS = (
    "retained_bytes",
    "pending_bytes",
    "input_working_bytes",
    "weight_working_bytes",
    "input_held_bytes",
    "output_gradient_freed_bytes",
    "weight_freed_bytes",
)


def spec_mesh(spec: PipelineSpec) -> Mesh:
    """The layout `spec` plans one rank of."""
    return Mesh(
        tensor_parallel=spec.tensor_parallel,
        sequence_parallel=spec.sequence_parallel,
        context_parallel=spec.context_parallel,
        expert_parallel=spec.expert_parallel,
        expert_tokens=spec.expert_tokens if spec.expert_parallel > 1 else BALANCED,
    )


def rank_profile(profile: ModelProfile, spec: PipelineSpec) -> ModelProfile:
    """`profile` for one rank of `spec`'s mesh; `profile` itself where it already is."""
    return profile_for_mesh(profile, spec_mesh(spec))


def profile_for_mesh(profile: ModelProfile, target: Mesh) -> ModelProfile:
    """`profile` for one rank of `target`; `profile` itself where it already is."""
    have = profile.mesh
    if target == have:
        return profile
    tensor = _to_apply(have.tensor_parallel, target.tensor_parallel, "tensor_parallel")
    if not tensor and have.sequence_parallel != target.sequence_parallel:
        raise InputError(
            "sequence_parallel",
            f"the profile is per rank of tensor_parallel {have.tensor_parallel} "
            f"{'with' if have.sequence_parallel else 'without'} sequence parallel "
            f"(its mesh); expected the spec to say the same",
        )
    context = _to_apply(have.context_parallel, target.context_parallel, "context_parallel")
    expert = _to_apply(have.expert_parallel, target.expert_parallel, "expert_parallel")
    if not expert and have.expert_tokens != target.expert_tokens:
        raise InputError(
            "expert_tokens",
            f"the profile is per rank of expert_parallel {have.expert_parallel} with "
            f"{have.expert_tokens} expert tokens (its mesh); got {target.expert_tokens}",
        )
    _check_divides(profile, target, tensor=tensor, context=context, expert=expert)
    rank = profile
    if tensor:
        rank = _tensor_parallel(rank, target)
    if context:
        rank = _context_parallel(rank, target)
    if expert:
        rank = _expert_parallel(rank, target)
    return dataclasses.replace(rank, mesh=target)


def prediction_caveat(profile: ModelProfile, spec: PipelineSpec) -> str | None:
    """A line for the plans of `spec` from `profile` whose peak a run is known to exceed, None for none:
    ZBVZeroBubble x tensor parallel with the split backward's fields one process's / t (a one-process
    profile, or sequence parallel, which the mesh run does not measure), a middle rank measured up to
    8% above its prediction (docs/results/nd-validation.md)."""
    if spec.schedule != "ZBVZeroBubble" or spec.tensor_parallel == 1:
        return None
    if spec.sequence_parallel:
        return (
            "under ZBVZeroBubble x tensor x sequence parallel a middle rank's peak was measured up to 8% above "
            "its prediction (docs/results/nd-validation.md): leave it that margin in the memory budget"
        )
    if profile.mesh.tensor_parallel == 1:
        return (
            "under ZBVZeroBubble x tensor parallel a middle rank's peak was measured up to 8% above its "
            "prediction from a one-process profile (docs/results/nd-validation.md): profile with "
            "--tensor-parallel to measure it on the mesh, or leave that margin in the memory budget"
        )
    return None


def token_copies_ratio(expert_tokens: str, experts: int, per_token: int, expert_parallel: int) -> float:
    """The token copies an expert-parallel rank's experts receive over the balanced share (which equals
    what a rank routes, its tokens x experts per token): 1 balanced; a capacity factor, at most the
    dropless bound; dropless, the most a router can send: from each of the e ranks, each token at most
    once to each of the rank's E / e experts, e x min(k, E / e) / k (an untrained router reaches it:
    docs/results/sapp-nd-mixtral.md)."""
    dropless = expert_parallel * min(per_token, experts // expert_parallel) / per_token
    if expert_tokens == BALANCED:
        return 1.0
    if expert_tokens == "dropless":
        return dropless
    return min(capacity_factor(expert_tokens), dropless)


def expert_replicas(spec: PipelineSpec) -> int:
    """The ranks of one pipeline stage holding the same experts, over which ZeRO and FSDP shard their
    state: expert-parallel ranks are carved from the data x tensor x context ranks."""
    if spec.expert_parallel == 1:
        return spec.data_parallel
    return spec.data_parallel * spec.tensor_parallel * spec.context_parallel // spec.expert_parallel


def _to_apply(have: int, want: int, name: str) -> bool:
    if have == want:
        return False
    if have == 1:
        return True
    raise InputError(
        name,
        f"the profile's numbers are per rank of {name} {have} already (its mesh); planning for "
        f"{want} would divide them again: give {have}, or a profile measured on one process",
    )


def _check_divides(profile: ModelProfile, mesh: Mesh, *, tensor: bool, context: bool, expert: bool) -> None:
    """`check_dimensions` of the profile's sizes (each one needed must be stated), and the sequence into 2c
    chunks: refused where they do not divide."""
    needed = _needed_dimensions(mesh, tensor=tensor, expert=expert)
    check_dimensions(
        {name: _dimension(profile, name, flag) for name, _, flag in needed}, mesh, tensor=tensor, expert=expert
    )
    if context:
        sequence = profile.micro_batch.get("sequence", 0)
        if not sequence or sequence % (2 * mesh.context_parallel):
            raise InputError(
                "context_parallel",
                f"expected the profile's sequence ({sequence or 'not stated'}) to be "
                f"a multiple of 2 x {mesh.context_parallel} (two chunks per rank)",
            )


def check_dimensions(dimensions: Mapping[str, int], mesh: Mesh, *, tensor: bool, expert: bool) -> None:
    """Heads, key-value heads, FFN widths and the vocabulary split over the mesh's t, routed experts over its
    e (`tensor`, `expert`: whether each is split here): InputError naming the degree where a size does not
    divide, or expert parallel over a model without routed experts. A size `dimensions` lacks is not checked."""
    for name, degree, flag in _needed_dimensions(mesh, tensor=tensor, expert=expert):
        if name not in dimensions:
            continue
        size = dimensions[name]
        if name == "experts" and not size:
            raise InputError(flag, f"the model has no routed experts; expected 1, got {degree}")
        if size % degree:
            raise InputError(flag, f"expected a divisor of the model's {name} ({size}), got {degree}")


def _needed_dimensions(mesh: Mesh, *, tensor: bool, expert: bool) -> list[tuple[str, int, str]]:
    """(size, the degree that splits it, the degree's name) for each size the split needs divided."""
    needs = []
    if tensor:
        needs += [(name, mesh.tensor_parallel, "tensor_parallel") for name in ("heads", "kv_heads", "ffn", "vocab")]
        # routed experts split their FFN width over t where expert parallel does not split them
        needs.append(("moe_ffn", 1 if mesh.expert_parallel > 1 else mesh.tensor_parallel, "tensor_parallel"))
    if expert:
        needs.append(("experts", mesh.expert_parallel, "expert_parallel"))
    return needs


def _dimension(profile: ModelProfile, name: str, flag: str) -> int:
    if name not in profile.dimensions:
        raise InputError(f"dimensions.{name}", f"not in the profile; {flag} needs the model's sizes: {REMEDY}")
    return profile.dimensions[name]


def _needed(value: float | None, where: str, flag: str) -> float:
    if value is None:
        raise InputError(where, f"not in the profile; {flag} needs it: {REMEDY}")
    return value


def _layers(profile: ModelProfile, change: Callable[[LayerProfile, str], LayerProfile]) -> tuple[LayerProfile, ...]:
    return tuple(change(layer, f"layers[{index}] ({named(layer.name)})") for index, layer in enumerate(profile.layers))


def _static(layer: LayerProfile, parameter_bytes: float, gradient_bytes: float, expert_bytes: float | None) -> dict:
    """A layer's static fields at new parameter and gradient bytes: its optimizer state per element
    follows the parameters, the per-tensor step counts stay."""
    per_tensor = layer.optimizer_tensor_bytes()
    scale = parameter_bytes / layer.parameter_bytes if layer.parameter_bytes else 1.0
    return {
        "parameter_bytes": parameter_bytes,
        "gradient_bytes": gradient_bytes,
        "optimizer_bytes": (layer.optimizer_bytes - per_tensor) * scale + per_tensor,
        "expert_parameter_bytes": expert_bytes,
    }


def _times(layer: LayerProfile, divisor: int) -> dict:
    return {
        "forward_ms": layer.forward_ms / divisor,
        "backward_ms": layer.backward_ms / divisor,
        "weight_ms": None if layer.weight_ms is None else layer.weight_ms / divisor,
        "input_ms": None if layer.input_ms is None else layer.input_ms / divisor,
    }


def _divided(cost: RecomputeCost, names: tuple[str, ...], divisor: float) -> dict:
    return {name: None if getattr(cost, name) is None else getattr(cost, name) / divisor for name in names}


def _tensor_parallel(profile: ModelProfile, mesh: Mesh) -> ModelProfile:
    t, sp = mesh.tensor_parallel, mesh.sequence_parallel
    experts_divisor = t if mesh.expert_parallel == 1 else 1  # with expert parallel, experts split over e instead

    def change(layer: LayerProfile, where: str) -> LayerProfile:
        replicated = _needed(layer.replicated_parameter_bytes, f"{where}.replicated_parameter_bytes", "tensor_parallel")
        whole_gradient = _needed(
            layer.replicated_gradient_bytes, f"{where}.replicated_gradient_bytes", "tensor_parallel"
        )
        experts = _needed(layer.expert_parameter_bytes, f"{where}.expert_parameter_bytes", "tensor_parallel")
        _needed(layer.parameter_tensors, f"{where}.parameter_tensors", "tensor_parallel")
        expert_gradient = experts * layer.gradient_bytes / layer.parameter_bytes if layer.parameter_bytes else 0.0
        split = layer.parameter_bytes - replicated - experts
        split_gradient = max(layer.gradient_bytes - whole_gradient - expert_gradient, 0.0)
        static = _static(
            layer,
            split / t + replicated + experts / experts_divisor,
            split_gradient / t + whole_gradient + expert_gradient / experts_divisor,
            experts / experts_divisor,
        )
        kept = {
            mode: _tp_activation(cost, t, sp, f"{where}.recompute.{mode}") for mode, cost in layer.recompute.items()
        }
        none = layer.recompute[NONE]
        recompute = {}
        for mode, cost in layer.recompute.items():
            gradients = max(cost.working_bytes - (none.activation_bytes - cost.activation_bytes), 0.0)
            working = (gradients / t if layer.is_body else gradients) + kept[NONE][0] - kept[mode][0]
            activation, whole = kept[mode]
            recompute[mode] = dataclasses.replace(
                cost,
                extra_ms=cost.extra_ms / t,
                activation_bytes=activation,
                working_bytes=working,
                tp_whole_activation_bytes=whole,
                sp_whole_activation_bytes=whole,
                saved_input_bytes=min(cost.saved_input_bytes / (t if sp else 1), activation),
                **_divided(cost, ("expert_activation_bytes", "expert_working_bytes"), t),
                **(_divided(cost, SPLIT_FIELDS, t) if layer.is_body else {}),
            )
        return dataclasses.replace(layer, recompute=recompute, **static, **_times(layer, t))

    return dataclasses.replace(
        profile, layers=_layers(profile, change), stage_output_bytes=profile.stage_output_bytes / (t if sp else 1)
    )


def _tp_activation(cost: RecomputeCost, t: int, sp: bool, where: str) -> tuple[float, float]:
    """(what a rank keeps, what of it stayed whole): (A - W) / t + W."""
    name = "sp_whole_activation_bytes" if sp else "tp_whole_activation_bytes"
    whole = _needed(getattr(cost, name), f"{where}.{name}", "sequence_parallel" if sp else "tensor_parallel")
    return (cost.activation_bytes - whole) / t + whole, whole


def _context_parallel(profile: ModelProfile, mesh: Mesh) -> ModelProfile:
    c = mesh.context_parallel
    # one remote key-value chunk in flight and its gradient, per block's backward (ring attention)
    ring = 0.0
    if any(layer.is_body for layer in profile.layers):
        kv_width = _dimension(profile, "kv_heads", "context_parallel") * _dimension(
            profile, "head_dim", "context_parallel"
        )
        ring = (
            2
            * 2
            * _tokens(profile, "context_parallel")
            * kv_width
            * _dtype_bytes(profile, "context_parallel")
            / (mesh.tensor_parallel * c)
        )
    names = (
        "activation_bytes",
        "working_bytes",
        "saved_input_bytes",
        "tp_whole_activation_bytes",
        "sp_whole_activation_bytes",
        "expert_activation_bytes",
        "expert_working_bytes",
        *SPLIT_FIELDS,
    )

    def change(layer: LayerProfile, where: str) -> LayerProfile:
        recompute = {}
        for mode, cost in layer.recompute.items():
            divided = _divided(cost, names, c)
            if layer.is_body:
                divided["working_bytes"] += ring
                if divided["input_working_bytes"] is not None:
                    divided["input_working_bytes"] += ring
            recompute[mode] = dataclasses.replace(cost, extra_ms=cost.extra_ms / c, **divided)
        return dataclasses.replace(layer, recompute=recompute, **_times(layer, c))

    loss = profile.loss_bytes
    return dataclasses.replace(
        profile,
        layers=_layers(profile, change),
        stage_output_bytes=profile.stage_output_bytes / c,
        model_output_bytes=(profile.model_output_bytes - loss) / c + loss,
        stage_shared_bytes=profile.stage_shared_bytes / c,
    )


def _expert_parallel(profile: ModelProfile, mesh: Mesh) -> ModelProfile:
    e = mesh.expert_parallel
    experts, per_token = (
        _dimension(profile, "experts", "expert_parallel"),
        _dimension(profile, "experts_per_token", "expert_parallel"),
    )
    ratio = token_copies_ratio(mesh.expert_tokens, experts, per_token, e)
    # the all-to-all buffers of one MoE layer's work: what it sends (its tokens' copies) and receives
    routed = _tokens(profile, "expert_parallel") * per_token / (mesh.tensor_parallel * mesh.context_parallel)
    all_to_all = (
        (1 + ratio)
        * routed
        * _dimension(profile, "hidden", "expert_parallel")
        * _dtype_bytes(profile, "expert_parallel")
    )

    def change(layer: LayerProfile, where: str) -> LayerProfile:
        expert_bytes = _needed(layer.expert_parameter_bytes, f"{where}.expert_parameter_bytes", "expert_parallel")
        if not expert_bytes:
            return layer
        expert_gradient = expert_bytes * layer.gradient_bytes / layer.parameter_bytes
        static = _static(
            layer,
            layer.parameter_bytes - expert_bytes + expert_bytes / e,
            layer.gradient_bytes - expert_gradient + expert_gradient / e,
            expert_bytes / e,
        )
        recompute = {}
        none = layer.recompute[NONE]
        for mode, cost in layer.recompute.items():
            extra = {}
            if ratio != 1:
                token = f"{where}.recompute.{mode}"
                kept = _needed(cost.expert_activation_bytes, f"{token}.expert_activation_bytes", "expert_tokens")
                kept_none = _needed(
                    none.expert_activation_bytes, f"{where}.recompute.none.expert_activation_bytes", "expert_tokens"
                )
                gradients = _needed(cost.expert_working_bytes, f"{token}.expert_working_bytes", "expert_tokens")
                extra = {
                    "activation_bytes": cost.activation_bytes + (ratio - 1) * kept,
                    "expert_activation_bytes": ratio * kept,
                    "expert_working_bytes": ratio * gradients,
                    "working_bytes": cost.working_bytes + (ratio - 1) * (kept_none - kept + gradients),
                }
            working = extra.get("working_bytes", cost.working_bytes) + all_to_all
            input_working = None if cost.input_working_bytes is None else cost.input_working_bytes + all_to_all
            recompute[mode] = dataclasses.replace(
                cost, **{**extra, "working_bytes": working, "input_working_bytes": input_working}
            )
        return dataclasses.replace(layer, recompute=recompute, **static)

    return dataclasses.replace(profile, layers=_layers(profile, change))


def _tokens(profile: ModelProfile, flag: str) -> int:
    tokens = profile.micro_batch.get("size", 0) * profile.micro_batch.get("sequence", 0)
    if not tokens:
        raise InputError(
            "micro_batch", f"the profile states no micro-batch size and sequence; {flag} needs them: {REMEDY}"
        )
    return tokens


def _dtype_bytes(profile: ModelProfile, flag: str) -> int:
    if profile.dtype not in DTYPE_BYTES:
        raise InputError(
            "dtype",
            f"the profile's dtype {profile.dtype!r} is not one of {', '.join(DTYPE_BYTES)}; {flag} needs its size",
        )
    return DTYPE_BYTES[profile.dtype]
