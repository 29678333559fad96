"""A profile without running anything: Llama-family costs estimated from a model config.

For planning before hardware is free. Times are FLOPs over a throughput you give (`flops_per_second`:
the device's peak times the utilisation you expect); memory counts the tensors transformers' Llama
block saves for backward (RMSNorm, rotary, grouped-query SDPA, SwiGLU; Qwen3's per-head norms of
queries and keys, and a `head_dim` other than hidden_size / num_heads; MoE experts and router),
which is what the profiler measures on the CPU, in fp32 and in bf16. Fused kernels on a GPU keep
less, so treat the activation figures as an upper bound there. Needs no torch.
"""

from __future__ import annotations

import math

from basics.errors import InputError
from profiler.estimate.blocks import (
    block_activation_bytes,
    block_parts,
    block_pending_bytes,
    block_weight_only_bytes,
    expert_gradient_bytes,
    norm_bytes,
)
from profiler.estimate.collectives import Network, with_collectives
from profiler.estimate.conventions import StaticConvention, plain
from profiler.estimate.shape import (
    LLAMA_FAMILY,
    TransformerShape,
    model_dimensions,
    shape_dimensions,
    shape_from_config,
)
from solver.parallel.model_parallel import DTYPE_BYTES, profile_for_mesh
from solver.vocabulary.profile import (
    FULL,
    NONE,
    SELECTIVE,
    LayerProfile,
    ModelProfile,
    RecomputeCost,
)

# What analytic_profile assumes unless told: a device's sustained FLOP/s and memory bytes/s, and
# Adam's two fp32 states per parameter.
FLOPS_PER_SECOND, BYTES_PER_SECOND, OPTIMIZER_BYTES_PER_PARAMETER = 1e14, 2e12, 8.0
LOSS_BYTES = 4  # the loss, an fp32 scalar


def analytic_profile(
    shape: TransformerShape,
    *,
    flops_per_second: float = FLOPS_PER_SECOND,
    bytes_per_second: float = BYTES_PER_SECOND,
    optimizer_bytes_per_parameter: float = OPTIMIZER_BYTES_PER_PARAMETER,
    network: Network | None = None,
    static_memory: StaticConvention | None = None,
) -> ModelProfile:
    """Every layer's estimated costs on one rank of the shape's mesh (`ModelProfile.mesh` says which):
    the 1-D estimate, then `solver.parallel.model_parallel`'s rules, then, given a `network`, each layer's
    collectives with their exposed time in its forward and backward. Adam keeps two fp32 states per
    parameter (8 bytes, plus 4 per parameter tensor for its step count); add 4 for an fp32 master copy
    of 16-bit weights.

    Args:
        shape: the model and how it is trained (`TransformerShape`, or `shape_from_config` of a
            transformers config.json), the tensor, sequence, context and expert parallel layout included.
        flops_per_second: the FLOP/s a rank sustains (the device's peak times the utilisation expected);
            times are FLOPs over it. Default 1e14.
        bytes_per_second: the memory bytes/s a rank sustains, for memory-bound work (embedding, element-wise
            ops, the loss). Default 2e12.
        optimizer_bytes_per_parameter: optimizer state per parameter, bytes. Default 8 (Adam, fp32).
        network: the links collectives run on (`profiler.estimate.collectives.Network`); None: no
            collective time.
        static_memory: a framework's bytes a parameter of weights, gradients and optimizer state
            (`profiler.estimate.conventions.CONVENTIONS`), in place of the shape's dtype and
            `optimizer_bytes_per_parameter`; None: those.

    Returns:
        The `ModelProfile`: a head (embedding), a "body:dense" or "body:moe" layer per block with the
        none, selective and full recompute modes, and a tail (final norm, LM head, loss); times in ms,
        memory in bytes, source "analytic".

    Raises:
        InputError: naming the argument: a throughput that is not a finite number > 0, a negative
            `optimizer_bytes_per_parameter`; a layout the model does not divide into.

    Example:
        >>> shape = TransformerShape(hidden_size=256, num_layers=4, num_heads=4, vocab_size=1000, sequence=128,
        ...                          ffn_size=1024)
        >>> profile = analytic_profile(shape)
        >>> [layer.kind for layer in profile.layers]
        ['head', 'body:dense', 'body:dense', 'body:dense', 'body:dense', 'tail']
        >>> profile.layers[1].parameter_bytes  # bf16: 2 x (4 h^2 attention + 3 h ffn MLP + 2 h norms)
        2098176
        >>> sorted(profile.layers[1].recompute)
        ['full', 'none', 'selective']
    """
    check_rates(flops_per_second, bytes_per_second, optimizer_bytes_per_parameter)
    if static_memory is None:
        static_memory = plain(shape.dtype, optimizer_bytes_per_parameter)
    else:
        check_rates(flops_per_second, bytes_per_second, static_memory.optimizer_bytes)
    one_d = _one_d_profile(shape, flops_per_second, bytes_per_second, static_memory)
    rank = profile_for_mesh(one_d, shape.mesh)
    return rank if network is None else with_collectives(rank, shape, network, flops_per_second)


def check_rates(flops_per_second: float, bytes_per_second: float, optimizer_bytes_per_parameter: float) -> None:
    """The device's rates (> 0) and the optimizer's bytes a parameter (>= 0), each refused by name."""
    for name, value in (("flops_per_second", flops_per_second), ("bytes_per_second", bytes_per_second)):
        if not _finite(value) or not value > 0:
            raise InputError(name, f"expected a number > 0, got {value!r}")
    if not _finite(optimizer_bytes_per_parameter) or optimizer_bytes_per_parameter < 0:
        raise InputError(
            "optimizer_bytes_per_parameter", f"expected a number >= 0, got {optimizer_bytes_per_parameter!r}"
        )


def _one_d_profile(
    s: TransformerShape, flops_per_second: float, bytes_per_second: float, static_memory: StaticConvention
) -> ModelProfile:
    """The estimate on one process, with what each parallel dimension treats apart stated."""
    p = DTYPE_BYTES[s.dtype]
    tokens = s.micro_batch_size * s.sequence
    head_dim = s.head_dim or s.hidden_size // s.num_heads
    q_width, kv_width = s.num_heads * head_dim, (s.num_kv_heads or s.num_heads) * head_dim
    h = s.hidden_size

    def seconds_ms(flops: float, moved_bytes: float = 0.0) -> float:
        return 1e3 * (flops / flops_per_second + moved_bytes / bytes_per_second)

    weight, gradient = static_memory.parameter_bytes, static_memory.gradient_bytes

    def static(elements: float, tensors: int, replicated: float, whole_gradient: float, experts: float = 0.0) -> dict:
        return {
            "parameter_bytes": elements * weight,
            "gradient_bytes": elements * gradient,
            "parameter_tensors": tensors,
            "optimizer_bytes": elements * static_memory.optimizer_bytes + static_memory.tensor_bytes * tensors,
            "replicated_parameter_bytes": replicated * weight,
            "replicated_gradient_bytes": whole_gradient * gradient,
            "expert_parameter_bytes": float(experts * weight),
        }

    layers = []
    vocab_elements = s.vocab_size * h
    hidden_bytes = tokens * h * p  # a block's input, the hidden state a stage receives
    # what a block keeps of its input's own storage (plan.saved_input_bytes): its first RMSNorm saves
    # the input cast to fp32, which is the input itself only in an fp32 model; a checkpoint keeps the
    # input whatever its dtype
    normed_input = hidden_bytes if p == 4 else 0.0
    ids = 8.0 * tokens
    layers.append(
        LayerProfile(
            name="head",
            kind="head",
            forward_ms=seconds_ms(0, tokens * h * p),
            backward_ms=seconds_ms(0, 2 * vocab_elements * p),
            weight_ms=seconds_ms(0, 2 * vocab_elements * p),
            # keeps the token ids; its working set is the dense weight gradient each later micro-batch adds into .grad
            recompute={
                NONE: RecomputeCost(
                    0.0,
                    ids,
                    vocab_elements * p,
                    tp_whole_activation_bytes=ids,
                    sp_whole_activation_bytes=ids,
                    expert_activation_bytes=0.0,
                    expert_working_bytes=0.0,
                )
            },
            # the embedding's gradient stays whole under tensor parallelism (torch's DTensor embedding backward)
            **static(vocab_elements, 1, 0, vocab_elements),
        )
    )
    attention_elements = h * (q_width + 2 * kv_width) + q_width * h
    bias_elements, bias_tensors = (q_width + 2 * kv_width, 3) if s.qkv_bias else (0, 0)
    norm_elements, norm_tensors = (2 * head_dim, 2) if s.qk_norm else (0, 0)
    for index in range(s.num_layers):
        moe = s.num_experts > 0 and index not in s.dense_layers
        expert_elements = router_elements = 0
        if moe:
            expert_elements = s.num_experts * 3 * h * s.moe_ffn_size
            router_elements = h * s.num_experts + (h if s.shared_expert_ffn_size else 0)
            mlp_elements = expert_elements + router_elements + 3 * h * s.shared_expert_ffn_size
            active_ffn = s.experts_per_token * s.moe_ffn_size + s.shared_expert_ffn_size
            # transformers v5 keeps the experts as two stacked tensors (gate+up, down) and a router
            tensors = 2 + 1 + (4 if s.shared_expert_ffn_size else 0)
        else:
            mlp_elements, active_ffn, tensors = 3 * h * s.ffn_size, s.ffn_size, 3
        elements = attention_elements + bias_elements + norm_elements + mlp_elements + 2 * h
        tensors += 4 + bias_tensors + norm_tensors + 2
        replicated = 2 * h + norm_elements + router_elements  # the norms' weights and the router
        matmul_flops = 2 * tokens * (attention_elements + 3 * h * active_ffn)
        attention_flops = 2 * tokens * s.sequence * q_width  # causal: half of 4*b*s^2*h
        forward_ms = seconds_ms(matmul_flops + attention_flops)
        kept = block_activation_bytes(tokens, s, head_dim, p, moe=moe)
        parts = block_parts(tokens, s, head_dim, p, moe=moe)
        pending = block_pending_bytes(tokens, s, head_dim, p, moe=moe)
        weight_freed = pending + block_weight_only_bytes(tokens, s, q_width, kv_width, p, moe=moe)
        elementwise_ms = seconds_ms(0, (kept[NONE] - kept[SELECTIVE]) * 2)  # read and write what is rebuilt
        # working set beyond what a mode rebuilds: the MLP gradients alive together (MoE: per token and expert)
        expert_gradients = expert_gradient_bytes(tokens, h, s.moe_ffn_size, s.experts_per_token, p) if moe else 0.0
        gradients = expert_gradients + tokens * p * (
            (h if s.shared_expert_ffn_size else 0) if moe else 2 * max(h, s.ffn_size)
        )

        common = {"pending_bytes": pending, "expert_working_bytes": expert_gradients}
        extra_ms = {NONE: 0.0, SELECTIVE: elementwise_ms, FULL: forward_ms + elementwise_ms}
        saved_input = {NONE: normed_input, SELECTIVE: hidden_bytes, FULL: hidden_bytes}
        recompute = {
            mode: RecomputeCost(
                extra_ms[mode],
                kept[mode],
                gradients + kept[NONE] - kept[mode],
                saved_input_bytes=saved_input[mode],
                tp_whole_activation_bytes=parts[mode][0],
                sp_whole_activation_bytes=parts[mode][1],
                expert_activation_bytes=parts[mode][2],
                **common,
                **({"weight_freed_bytes": weight_freed} if mode == NONE else {}),
            )
            for mode in (NONE, SELECTIVE, FULL)
        }
        layers.append(
            LayerProfile(
                name=f"layers.{index}",
                kind="body:moe" if moe else "body:dense",
                forward_ms=forward_ms + elementwise_ms,
                backward_ms=2 * forward_ms + elementwise_ms,
                weight_ms=seconds_ms(matmul_flops),
                recompute=recompute,
                **static(elements, tensors, replicated, replicated, expert_elements),
            )
        )
    layers.append(_tail(s, tokens, p, seconds_ms, static, normed_input))
    return ModelProfile(
        layers=tuple(layers),
        model=f"analytic {s.num_layers}x{h}",
        source="analytic",
        dtype=s.dtype,
        micro_batch={"size": s.micro_batch_size, "sequence": s.sequence},
        stage_output_bytes=hidden_bytes,
        # what the model returns: the logits (whole on every tensor-parallel rank: no loss parallel), the loss (fp32)
        model_output_bytes=tokens * s.vocab_size * p + LOSS_BYTES,
        loss_bytes=LOSS_BYTES,
        # cos and sin, computed by every stage for its blocks
        stage_shared_bytes=2 * s.sequence * head_dim * p,
        dimensions=shape_dimensions(s),
    )


def _tail(s: TransformerShape, tokens: int, p: int, seconds_ms, static, normed_input: float) -> LayerProfile:  # type: ignore[no-untyped-def]
    """The final RMSNorm, the LM head and the loss."""
    h = s.hidden_size
    vocab_elements = s.vocab_size * h
    logits_flops = 2 * tokens * vocab_elements
    log_probs_bytes = tokens * s.vocab_size * 4  # log-softmax output, fp32
    labels_bytes = 8 * tokens + LOSS_BYTES  # int64 labels, and the loss
    # the fp32 gradients of log-probabilities and logits less the freed labels; with few tokens, the LM head's gradients
    working = max(2 * log_probs_bytes - labels_bytes, vocab_elements * p + tokens * h * p)
    kept = norm_bytes(tokens, h, p) + log_probs_bytes + labels_bytes
    norm_inner = tokens * (4 * h + 4 + p * h)  # what sequence parallelism splits: all but the norm's output
    return LayerProfile(
        name="tail",
        kind="tail",
        forward_ms=seconds_ms(logits_flops, 2 * log_probs_bytes),
        backward_ms=seconds_ms(2 * logits_flops, 2 * log_probs_bytes),
        weight_ms=seconds_ms(logits_flops),
        # the final RMSNorm as a block's (its output is the LM head's input), the loss, the labels
        recompute={
            NONE: RecomputeCost(
                0.0,
                kept,
                working,
                saved_input_bytes=normed_input,
                tp_whole_activation_bytes=kept,
                sp_whole_activation_bytes=kept - norm_inner,
                expert_activation_bytes=0.0,
                expert_working_bytes=0.0,
            )
        },
        **static(h + vocab_elements, 2, h, h),
    )


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


__all__ = [
    "DTYPE_BYTES",
    "LLAMA_FAMILY",
    "TransformerShape",
    "analytic_profile",
    "model_dimensions",
    "shape_from_config",
]
