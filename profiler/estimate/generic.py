"""A profile without running anything, for any decoder-only transformers config (DeepSeek-V2/V3,
Gemma-2/3, Phi-3, GLM-4, ...): parameters counted exactly on the meta device
(`profiler.estimate.meta_model`), activations and FLOPs traced on fake tensors
(`profiler.estimate.traced`), times from FLOPs and bytes over the throughputs given, as
`profiler.estimate.analytic` does for the Llama family.

The profile is of one process and says what tensor parallelism splits (as `analytic` does for the
Llama family), so `solver.parallel.model_parallel`'s rules make it any rank's of a tensor, context or
expert parallel mesh: what stays whole is found by tracing the model again with its heads and FFN
widths halved (a rank of tensor parallel 2: Megatron-LM's and TorchTitan's split, MLA's compressed
q and kv latents replicated), W = 2 A(t=2) - A(1). Sequence parallelism and expert token counts other
than balanced are not stated (their fields are left out, and `solve` refuses them by name).
MTP modules (DeepSeek-V3's `num_nextn_predict_layers`, MindFormers' `mtp_depth`, Megatron's
`mtp_num_layers`) are layers of kind "body:mtp" after the last decoder layer, as MindFormers and
Megatron-LM place them: a decoder layer like the last, the norms and 2h x h projection before it,
the shared head's logits and loss after it, and the first one a copy of the embedding.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from basics.errors import InputError
from profiler.estimate.analytic import check_rates
from profiler.estimate.conventions import StaticConvention, plain
from profiler.estimate.meta_model import (
    ModelCount,
    PartCount,
    build_config,
    build_meta_model,
    check_sizes,
    count_parameters,
    decoder_parts,
    text_config,
)
from profiler.estimate.traced import PartTrace, trace_model
from solver.parallel.model_parallel import DTYPE_BYTES
from solver.vocabulary.profile import (
    FULL,
    MTP_KIND,
    NONE,
    SELECTIVE,
    LayerProfile,
    ModelProfile,
    RecomputeCost,
    TiedParameter,
)

if TYPE_CHECKING:
    from torch import nn

LOSS_BYTES = 4  # the loss, an fp32 scalar
# the sizes tensor parallelism splits: attention heads (linear attention's too) and FFN widths (dense, routed,
# shared experts)
SPLIT_SIZES = (
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def traced_profile(
    fields: Mapping[str, object],
    *,
    sequence: int,
    micro_batch_size: int = 1,
    dtype: str = "bfloat16",
    flops_per_second: float = 1e14,
    bytes_per_second: float = 2e12,
    optimizer_bytes_per_parameter: float = 8.0,
    static_memory: StaticConvention | None = None,
) -> ModelProfile:
    """Every layer's estimated costs for the transformers config `fields` (a config.json's dict); the
    static bytes a parameter from `static_memory` (a framework's convention) where given, else from
    `dtype` and `optimizer_bytes_per_parameter`.

    Returns:
        The `ModelProfile`: a head, a "body:<kind>" layer per decoder layer (kind: "dense" or "moe",
        suffixed by the attention type where layers differ in it, e.g. "dense-sliding"), a tail; the
        none, selective and full recompute modes; source "traced".

    Raises:
        InputError: naming the field: a config transformers cannot build or whose forward does not run
            on fake tensors, a model that is not decoder-only, a size or dtype out of range.
    """
    for name, value in (("sequence", sequence), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(name, f"expected an integer >= 1, got {value!r}")
    check_rates(flops_per_second, bytes_per_second, optimizer_bytes_per_parameter)
    if dtype not in DTYPE_BYTES:
        raise InputError("dtype", f"expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if static_memory is None:
        static_memory = plain(dtype, optimizer_bytes_per_parameter)
    else:
        check_rates(flops_per_second, bytes_per_second, static_memory.optimizer_bytes)
    check_sizes(fields)
    config = build_config(fields)
    counts = count_parameters(config)
    body = [part for part in counts.parts if part.kind.startswith("body:")]
    first = {}
    for index, part in enumerate(body):
        first.setdefault(part.kind, index)
    shape = {"sequence": sequence, "micro_batch_size": micro_batch_size, "dtype": dtype}
    cut = _cut(config, max(first.values()) + 1)
    traces = trace_model(cut, **shape)
    head_trace, tail_trace = traces[0], traces[-1]
    by_kind = {kind: traces[1 + index] for kind, index in first.items()}
    p = DTYPE_BYTES[dtype]
    tokens = micro_batch_size * sequence
    text = text_config(config)
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    hidden_bytes = float(tokens * hidden * p)
    split = _tensor_split(cut, first, shape, hidden_bytes, by_kind)

    def ms(flops: float, moved_bytes: float = 0.0) -> float:
        return 1e3 * (flops / flops_per_second + moved_bytes / bytes_per_second)

    def static(part: PartCount, extra: int = 0, replicated: float | None = None, whole: float | None = None) -> dict:
        n = part.parameters + extra
        return {
            "parameter_bytes": float(n * static_memory.parameter_bytes),
            "gradient_bytes": float(n * static_memory.gradient_bytes),
            "parameter_tensors": part.tensors,
            "optimizer_bytes": n * static_memory.optimizer_bytes + static_memory.tensor_bytes * part.tensors,
            "expert_parameter_bytes": float(part.routed_parameters * static_memory.parameter_bytes),
            "replicated_parameter_bytes": None
            if replicated is None
            else float(replicated * static_memory.parameter_bytes),
            "replicated_gradient_bytes": None if whole is None else float(whole * static_memory.gradient_bytes),
        }

    head_part, tail_part = counts.parts[0], counts.parts[-1]
    tied = counts.output_parameters if counts.tied_embeddings else 0  # the token embedding's, not learned positions
    ids = head_trace.saved_bytes  # the token ids, whole on every rank
    layers = [
        LayerProfile(
            name="head",
            kind="head",
            forward_ms=ms(0, hidden_bytes),
            backward_ms=ms(0, 2 * head_part.parameters * p),
            weight_ms=ms(0, 2 * head_part.parameters * p),
            recompute={
                NONE: RecomputeCost(
                    0.0,
                    ids,
                    float(head_part.parameters * p),
                    tp_whole_activation_bytes=ids,
                    sp_whole_activation_bytes=ids,
                )
            },
            # the embedding's gradient stays whole under tensor parallelism (torch's DTensor embedding backward)
            **static(head_part, 0, 0, head_part.parameters),
        )
    ]
    for part in body:
        whole = split.get(part.kind)
        layer = _body_layer(part, by_kind[part.kind], hidden_bytes, ms, whole and whole[1])
        layers.append(dataclasses.replace(layer, **static(part, 0, whole and whole[0], whole and whole[0])))
    log_probs = tokens * vocab * 4.0
    labels = 8.0 * tokens + LOSS_BYTES
    # the fp32 gradients of log-probabilities and logits less the freed labels; with few tokens, the head's gradients
    working = max(2 * log_probs - labels, (tail_part.parameters + tied) * p + hidden_bytes)
    norm = tail_part.parameters - (0 if tied else counts.output_parameters)  # the final norm's, replicated
    tail = LayerProfile(
        name="tail",
        kind="tail",
        forward_ms=ms(tail_trace.forward_flops, 2 * log_probs),
        backward_ms=ms(2 * tail_trace.forward_flops, 2 * log_probs),
        weight_ms=ms(tail_trace.forward_flops),
        # the logits stay whole (no loss parallel)
        recompute={
            NONE: RecomputeCost(0.0, tail_trace.saved_bytes, working, tp_whole_activation_bytes=tail_trace.saved_bytes)
        },
        **static(tail_part, tied, norm, norm),
    )
    mtp = [part for part in counts.parts if part.kind == "mtp"]
    decoder = layers[-1]
    for index, part in enumerate(mtp):
        own = dataclasses.replace(
            part,
            parameters=part.parameters + (0 if index else head_part.parameters),
            tensors=part.tensors + (not index),
        )
        whole = split.get(body[-1].kind)
        # its three norms too; the embedding copy is split by vocabulary, its gradient too (Megatron-LM's)
        replicated = None if whole is None else whole[0] + 3 * hidden
        layer = _mtp_layer(decoder, tail, ids, hidden, tokens, p, ms)
        layers.append(dataclasses.replace(layer, name=part.name, **static(own, 0, replicated, replicated)))
    layers.append(tail)
    embedding = float(head_part.parameters * static_memory.parameter_bytes)
    ties = (
        (TiedParameter(("embedding", "lm_head"), ("head", "tail"), float(tied * static_memory.parameter_bytes)),)
        if tied
        else ()
    )
    if mtp:  # the first MTP layer's own copy of the embedding, kept equal to the head's
        ties += (TiedParameter(("embedding", "mtp embedding"), ("head", mtp[0].name), embedding),)
    return ModelProfile(
        layers=tuple(layers),
        model=f"traced {counts.model_type} {len(body)}x{hidden}" + (f" + {len(mtp)} MTP" if mtp else ""),
        source="traced",
        dtype=dtype,
        micro_batch={"size": micro_batch_size, "sequence": sequence},
        stage_output_bytes=hidden_bytes,
        model_output_bytes=tokens * vocab * p + LOSS_BYTES,
        loss_bytes=LOSS_BYTES,
        stage_shared_bytes=head_trace.shared_bytes,
        tied_parameters=ties,
        dimensions=_dimensions(text, counts),
    )


def _kept(trace: PartTrace, hidden_bytes: float) -> dict[str, float]:
    """What a decoder layer keeps per mode: none what autograd saved, selective the block's input and the
    matmul and attention outputs, full the input."""
    return {NONE: trace.saved_bytes, SELECTIVE: hidden_bytes + trace.selective_bytes, FULL: hidden_bytes}


def _body_layer(  # type: ignore[no-untyped-def]
    part: PartCount, trace: PartTrace, hidden_bytes: float, ms, whole: dict[str, float] | None
) -> LayerProfile:
    """A decoder layer from its kind's trace (`whole`: per mode, what tensor parallelism leaves whole);
    the backward's working set is the widest weighted output's gradient and its input's, plus what the
    mode rebuilds."""
    kept = _kept(trace, hidden_bytes)
    saved_input = {NONE: trace.saved_input_bytes, SELECTIVE: hidden_bytes, FULL: hidden_bytes}
    elementwise_ms = ms(0, 2 * max(kept[NONE] - kept[SELECTIVE], 0.0))  # read and write what is rebuilt
    forward_ms = ms(trace.forward_flops)
    extra = {NONE: 0.0, SELECTIVE: elementwise_ms, FULL: forward_ms + elementwise_ms}
    gradients = 2 * trace.widest_bytes
    recompute = {
        mode: RecomputeCost(
            extra[mode],
            kept[mode],
            gradients + max(kept[NONE] - kept[mode], 0.0),
            pending_bytes=trace.pending_bytes,
            saved_input_bytes=saved_input[mode],
            tp_whole_activation_bytes=None if whole is None else whole[mode],
        )
        for mode in (NONE, SELECTIVE, FULL)
    }
    return LayerProfile(
        name=part.name,
        kind=part.kind,
        forward_ms=forward_ms + elementwise_ms,
        backward_ms=2 * forward_ms + elementwise_ms,
        weight_ms=ms(trace.weight_flops),
        recompute=recompute,
        parameter_bytes=0.0,
        gradient_bytes=0.0,
        optimizer_bytes=0.0,
    )


def _mtp_layer(decoder: LayerProfile, tail: LayerProfile, ids: float, h: int, tokens: int, p: int, ms) -> LayerProfile:  # type: ignore[no-untyped-def]
    """One MTP module's costs (its static fields left to the caller): the embedding of the next tokens,
    RMSNorms of it and of the hidden state, their concatenation through the 2h x h projection, a
    decoder layer like the last, and the shared head's logits and loss (the tail's costs again). It
    keeps its activations: the frameworks' recompute flags do not reach MTP layers."""
    # the two norms' fp32 input and 1/rms and normalised input, the projection's 2h input; all whole
    extra = ids + 2 * tokens * (4 * h + 4 + p * h) + 2 * tokens * h * p
    projection = 2 * tokens * 2 * h * h
    none, end = decoder.recompute[NONE], tail.recompute[NONE]
    whole = none.tp_whole_activation_bytes
    cost = RecomputeCost(
        0.0,
        none.activation_bytes + extra + end.activation_bytes,
        max(none.working_bytes, end.working_bytes),
        pending_bytes=(none.pending_bytes or 0.0) + tokens * h * p,
        saved_input_bytes=float(tokens * h * p) if p == 4 else 0.0,  # the hidden state's norm keeps it as fp32
        tp_whole_activation_bytes=None if whole is None else whole + extra + end.activation_bytes,
    )
    return LayerProfile(
        name="mtp",
        kind=MTP_KIND,
        forward_ms=decoder.forward_ms + ms(projection) + tail.forward_ms,
        backward_ms=decoder.backward_ms + ms(2 * projection) + tail.backward_ms,
        weight_ms=(decoder.weight_ms or 0.0) + ms(projection) + (tail.weight_ms or 0.0),
        recompute={NONE: cost},
        parameter_bytes=0.0,
        gradient_bytes=0.0,
        optimizer_bytes=0.0,
    )


def _tensor_split(
    cut: object, first: dict[str, int], shape: dict, hidden_bytes: float, by_kind: dict[str, PartTrace]
) -> dict[str, tuple[int, dict[str, float]]]:
    """Per decoder layer kind: (the parameters tensor parallelism replicates, what of each mode's
    activations it leaves whole), from `cut` built and traced again with its heads and FFN widths
    halved. A kind is left out where halving them widens one of its heads (a model that derives a head's
    width from hidden / heads), neither halves nor keeps one of its weights, or halves none; {} where a
    size is odd or the halved forward breaks: tensor parallelism is then not stated."""
    halved = copy.deepcopy(cut)
    text = text_config(halved)
    if not getattr(text, "head_dim", None):  # keep each head's width: it is not split
        text.head_dim = int(text.hidden_size) // int(text.num_attention_heads)
    for key in SPLIT_SIZES:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if value % 2:
                return {}
            setattr(text, key, value // 2)
    _, whole_layers, _ = decoder_parts(build_meta_model(cut))
    _, half_layers, _ = decoder_parts(build_meta_model(halved))
    replicated = {}
    for kind, index in first.items():
        widths, half_widths = _head_widths(whole_layers[index]), _head_widths(half_layers[index])
        if any(half_widths.get(name, width) > width for name, width in widths.items()):
            continue
        whole = {name: p.numel() for name, p in whole_layers[index].named_parameters()}
        half = {name: p.numel() for name, p in half_layers[index].named_parameters()}
        if whole.keys() != half.keys() or any(half[n] not in (whole[n], whole[n] / 2) for n in whole):
            continue
        if any(half[n] < whole[n] for n in whole):
            replicated[kind] = sum(n for name, n in whole.items() if half[name] == n)
    if not replicated:
        return {}
    try:
        traces = trace_model(halved, **shape)
    except InputError:  # its forward breaks with the sizes halved (one derived from another): not stated
        return {}
    split = {}
    for kind, replicated_parameters in replicated.items():
        one, two = _kept(by_kind[kind], hidden_bytes), _kept(traces[1 + first[kind]], hidden_bytes)
        # a rank of t keeps (A - W) / t + W: W = 2 A(2) - A(1)
        kept = {mode: min(max(2 * two[mode] - one[mode], 0.0), one[mode]) for mode in one}
        split[kind] = (replicated_parameters, kept)
    return split


def _head_widths(layer: nn.Module) -> dict[str, int]:
    """Each attention module's head width (`head_dim` or `head_size`), by module name."""
    widths = {}
    for name, module in layer.named_modules():
        for attribute in ("head_dim", "head_size"):
            width = getattr(module, attribute, None)
            if isinstance(width, int) and not isinstance(width, bool):
                widths[f"{name}.{attribute}"] = width
    return widths


def _cut(config: object, layers: int) -> object:
    """`config` with its first `layers` decoder layers only (per-layer lists cut to match)."""
    cut = copy.deepcopy(config)
    text = text_config(cut)
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        with contextlib.suppress(AttributeError):  # a property of the layer count (Jamba's): cut with it
            text.layer_types = text.layer_types[:layers]
    for key in ("num_nextn_predict_layers", "mtp_depth", "mtp_num_layers"):
        if hasattr(text, key):
            setattr(text, key, 0)
    return cut


def _dimensions(text: object, counts: ModelCount) -> dict[str, int]:
    """The sizes a parallel layout must divide, where the config names them."""
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    hidden = int(text.hidden_size)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    if getattr(text, "kv_lora_rank", None):  # MLA: keys (nope + rope) and values differ; their mean, for K + V
        head_dim = (text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim) // 2
    return {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "ffn": int(getattr(text, "intermediate_size", 0) or 0),
        "moe_ffn": int(getattr(text, "moe_intermediate_size", 0) or 0) if counts.num_experts else 0,
        "vocab": int(text.vocab_size),
        "experts": counts.num_experts,
        "experts_per_token": counts.experts_per_token,
    }


def parameter_report(fields: Mapping[str, object]) -> ModelCount:
    """The exact parameter count of every part of the config's model, MTP modules included."""
    check_sizes(fields)
    return count_parameters(build_config(fields))
