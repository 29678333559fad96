"""A profile without running anything, for any decoder-only transformers config (DeepSeek-V2/V3,
Gemma-2/3, Phi-3, GLM-4, ...): parameters counted exactly on the meta device
(`profiler.estimate.meta_model`), activations and FLOPs traced on fake tensors
(`profiler.estimate.traced`), times from FLOPs and bytes over the throughputs given, as
`profiler.estimate.analytic` does for the Llama family.

One rank of no model parallelism (tensor, context and expert parallel degrees 1); data parallelism
and ZeRO shard it in `solve` as any profile. MTP modules (DeepSeek-V3's `num_nextn_predict_layers`)
are counted in `parameter_report` but are not layers of the profile.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from basics.errors import InputError
from profiler.estimate.analytic import check_rates
from profiler.estimate.conventions import StaticConvention, plain
from profiler.estimate.meta_model import ModelCount, PartCount, build_config, count_parameters
from profiler.estimate.traced import PartTrace, trace_model
from solver.parallel.model_parallel import DTYPE_BYTES
from solver.vocabulary.profile import FULL, NONE, SELECTIVE, LayerProfile, ModelProfile, RecomputeCost, TiedParameter

LOSS_BYTES = 4  # the loss, an fp32 scalar


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
    config = build_config(fields)
    counts = count_parameters(config)
    body = [part for part in counts.parts if part.kind.startswith("body:")]
    first = {}
    for index, part in enumerate(body):
        first.setdefault(part.kind, index)
    traces = trace_model(
        _cut(config, max(first.values()) + 1), sequence=sequence, micro_batch_size=micro_batch_size, dtype=dtype
    )
    head_trace, tail_trace = traces[0], traces[-1]
    by_kind = {kind: traces[1 + index] for kind, index in first.items()}
    p = DTYPE_BYTES[dtype]
    tokens = micro_batch_size * sequence
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    hidden_bytes = float(tokens * hidden * p)

    def ms(flops: float, moved_bytes: float = 0.0) -> float:
        return 1e3 * (flops / flops_per_second + moved_bytes / bytes_per_second)

    def static(part: PartCount, extra: int = 0) -> dict:
        n = part.parameters + extra
        return {
            "parameter_bytes": float(n * static_memory.parameter_bytes),
            "gradient_bytes": float(n * static_memory.gradient_bytes),
            "parameter_tensors": part.tensors,
            "optimizer_bytes": n * static_memory.optimizer_bytes + static_memory.tensor_bytes * part.tensors,
            "expert_parameter_bytes": float(part.routed_parameters * static_memory.parameter_bytes),
        }

    head_part, tail_part = counts.parts[0], counts.parts[-1]
    tied = head_part.parameters if counts.tied_embeddings else 0
    layers = [
        LayerProfile(
            name="head",
            kind="head",
            forward_ms=ms(0, hidden_bytes),
            backward_ms=ms(0, 2 * head_part.parameters * p),
            weight_ms=ms(0, 2 * head_part.parameters * p),
            recompute={NONE: RecomputeCost(0.0, head_trace.saved_bytes, float(head_part.parameters * p))},
            **static(head_part),
        )
    ]
    layers += [_body_layer(part, by_kind[part.kind], hidden_bytes, ms, static(part)) for part in body]
    log_probs = tokens * vocab * 4.0
    labels = 8.0 * tokens + LOSS_BYTES
    # the fp32 gradients of log-probabilities and logits less the freed labels; with few tokens, the head's gradients
    working = max(2 * log_probs - labels, (tail_part.parameters + tied) * p + hidden_bytes)
    layers.append(
        LayerProfile(
            name="tail",
            kind="tail",
            forward_ms=ms(tail_trace.forward_flops, 2 * log_probs),
            backward_ms=ms(2 * tail_trace.forward_flops, 2 * log_probs),
            weight_ms=ms(tail_trace.forward_flops),
            recompute={NONE: RecomputeCost(0.0, tail_trace.saved_bytes, working)},
            **static(tail_part, tied),
        )
    )
    return ModelProfile(
        layers=tuple(layers),
        model=f"traced {counts.model_type} {len(body)}x{hidden}",
        source="traced",
        dtype=dtype,
        micro_batch={"size": micro_batch_size, "sequence": sequence},
        stage_output_bytes=hidden_bytes,
        model_output_bytes=tokens * vocab * p + LOSS_BYTES,
        loss_bytes=LOSS_BYTES,
        stage_shared_bytes=head_trace.shared_bytes,
        tied_parameters=(
            TiedParameter(("embedding", "lm_head"), ("head", "tail"), float(tied * static_memory.parameter_bytes)),
        )
        if tied
        else (),
        dimensions=_dimensions(text, counts),
    )


def _body_layer(part: PartCount, trace: PartTrace, hidden_bytes: float, ms, static: dict) -> LayerProfile:  # type: ignore[no-untyped-def]
    """A decoder layer from its kind's trace: none keeps what autograd saved, selective the block's input
    and the matmul and attention outputs, full the input; the backward's working set is the widest
    weighted output's gradient and its input's, plus what the mode rebuilds."""
    kept = {NONE: trace.saved_bytes, SELECTIVE: hidden_bytes + trace.selective_bytes, FULL: hidden_bytes}
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
        **static,
    )


def _cut(config: object, layers: int) -> object:
    """`config` with its first `layers` decoder layers only (per-layer lists cut to match)."""
    cut = copy.deepcopy(config)
    text = cut.get_text_config() if hasattr(cut, "get_text_config") else cut
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:layers]
    for key in ("num_nextn_predict_layers", "mtp_depth", "mtp_num_layers"):
        if hasattr(text, key):
            setattr(text, key, 0)
    return cut


def _dimensions(text: object, counts: ModelCount) -> dict[str, int]:
    """The sizes a parallel layout must divide, where the config names them."""
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    hidden = int(text.hidden_size)
    head_dim = getattr(text, "head_dim", None) or getattr(text, "v_head_dim", None) or (hidden // heads if heads else 0)
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
    return count_parameters(build_config(fields))
