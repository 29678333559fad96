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
from collections.abc import Mapping
from dataclasses import dataclass

from simulator.errors import InputError
from solver.profile import FULL, NONE, SELECTIVE, LayerProfile, ModelProfile, RecomputeCost

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What analytic_profile assumes unless told: a device's sustained FLOP/s and memory bytes/s, and
# Adam's two fp32 states per parameter.
FLOPS_PER_SECOND, BYTES_PER_SECOND, OPTIMIZER_BYTES_PER_PARAMETER = 1e14, 2e12, 8.0
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class TransformerShape:
    """What the estimate needs to know about a decoder-only model and how it is trained."""

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    sequence: int
    ffn_size: int
    num_kv_heads: int = 0  # 0: as many as num_heads
    micro_batch_size: int = 1
    dtype: str = "bfloat16"
    num_experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    moe_ffn_size: int = 0
    shared_expert_ffn_size: int = 0
    dense_layers: tuple[int, ...] = ()  # MoE models: the layers that keep a dense MLP
    tied_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 family: biases on the q, k and v projections
    head_dim: int = 0  # 0: hidden_size / num_heads (Qwen3 and Mistral-NeMo say another)
    qk_norm: bool = False  # Qwen3 family: an RMSNorm over each head of the queries and keys
    normalize_top_k: bool = False  # MoE: the chosen experts' weights rescaled to sum to 1 (Mixtral)
    tensor_parallel: int = 1  # with sequence parallelism: activations are split too
    context_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_size", "sequence", "ffn_size",
                     "micro_batch_size", "tensor_parallel", "context_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(name, f"expected an integer >= 1, got {value!r}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise InputError("head_dim", f"expected an integer >= 1, or 0 for hidden_size / num_heads, got {self.head_dim!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InputError("dtype", f"expected one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise InputError("num_heads", f"expected a divisor of hidden_size {self.hidden_size}, got {self.num_heads}")
        # Megatron-LM and TorchTitan split heads, not parts of heads, over the tensor-parallel ranks,
        # and the sequence into 2 x CP chunks (two per rank, to balance causal attention).
        for name, count in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads or self.num_heads)):
            if count % self.tensor_parallel:
                raise InputError("tensor_parallel", f"expected a divisor of {name} {count}, got {self.tensor_parallel}")
        if self.context_parallel > 1 and self.sequence % (2 * self.context_parallel):
            raise InputError("context_parallel", f"expected sequence {self.sequence} to be a multiple of 2 x "
                                                 f"context_parallel, got context_parallel {self.context_parallel}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise InputError("experts_per_token", f"expected 1..{self.num_experts}, got {self.experts_per_token}")


def shape_from_config(config: Mapping[str, object], *, sequence: int, micro_batch_size: int = 1,
                      dtype: str = "bfloat16", tensor_parallel: int = 1, context_parallel: int = 1) -> TransformerShape:
    """A `TransformerShape` from a transformers `config.json` of the Llama family (dict form)."""
    model_type = config.get("model_type")
    if model_type not in LLAMA_FAMILY:
        raise InputError("model_type", f"analytic estimates cover {', '.join(LLAMA_FAMILY)}; got {model_type!r}")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in config:
            raise InputError(key, f"missing from the {model_type} config")
    try:
        return _shape(config, model_type, sequence=sequence, micro_batch_size=micro_batch_size, dtype=dtype,
                      tensor_parallel=tensor_parallel, context_parallel=context_parallel)
    except InputError:
        raise
    except (TypeError, ValueError) as exc:  # a size that is not a number
        raise InputError("config", f"expected integers for the sizes of a {model_type} config: {exc}") from None


def _shape(config: Mapping[str, object], model_type: str, *, sequence: int, micro_batch_size: int, dtype: str,
           tensor_parallel: int, context_parallel: int) -> TransformerShape:
    num_layers = _integer(config, "num_hidden_layers")
    experts = _integer(config, "num_experts") or _integer(config, "num_local_experts")
    dense_layers: tuple[int, ...] = ()
    if experts:
        sparse_step = _integer(config, "decoder_sparse_step") or 1
        only_mlp = set(config.get("mlp_only_layers") or ())
        dense_layers = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % sparse_step)
    return TransformerShape(
        hidden_size=_integer(config, "hidden_size"),
        num_layers=num_layers,
        num_heads=_integer(config, "num_attention_heads"),
        num_kv_heads=_integer(config, "num_key_value_heads"),
        ffn_size=_integer(config, "intermediate_size"),
        vocab_size=_integer(config, "vocab_size"),
        sequence=sequence,
        micro_batch_size=micro_batch_size,
        dtype=dtype,
        num_experts=experts,
        experts_per_token=_integer(config, "num_experts_per_tok"),
        moe_ffn_size=_integer(config, "moe_intermediate_size") or _integer(config, "intermediate_size"),
        shared_expert_ffn_size=_integer(config, "shared_expert_intermediate_size"),
        dense_layers=dense_layers,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", str(model_type).startswith("qwen2"))),
        head_dim=_integer(config, "head_dim"),
        qk_norm=str(model_type).startswith("qwen3"),
        normalize_top_k=model_type == "mixtral" or bool(config.get("norm_topk_prob", False)),
        tensor_parallel=tensor_parallel,
        context_parallel=context_parallel,
    )


def analytic_profile(shape: TransformerShape, *, flops_per_second: float = FLOPS_PER_SECOND,
                     bytes_per_second: float = BYTES_PER_SECOND,
                     optimizer_bytes_per_parameter: float = OPTIMIZER_BYTES_PER_PARAMETER) -> ModelProfile:
    """Every layer's estimated costs. Adam keeps two fp32 states per parameter (8 bytes, plus 4 per
    parameter tensor for its step count); add 4 for an fp32 master copy of 16-bit weights."""
    for name, value in (("flops_per_second", flops_per_second), ("bytes_per_second", bytes_per_second)):
        if not _finite(value) or not value > 0:
            raise InputError(name, f"expected a number > 0, got {value!r}")
    if not _finite(optimizer_bytes_per_parameter) or optimizer_bytes_per_parameter < 0:
        raise InputError("optimizer_bytes_per_parameter", f"expected a number >= 0, got {optimizer_bytes_per_parameter!r}")
    s = shape
    p = DTYPE_BYTES[s.dtype]
    tokens = s.micro_batch_size * s.sequence // s.context_parallel  # per device, before tensor parallelism
    tp = s.tensor_parallel
    head_dim = s.head_dim or s.hidden_size // s.num_heads
    q_width, kv_width = s.num_heads * head_dim, (s.num_kv_heads or s.num_heads) * head_dim

    def seconds_ms(flops: float, moved_bytes: float = 0.0) -> float:
        return 1e3 * (flops / tp / flops_per_second + moved_bytes / tp / bytes_per_second)

    def optimizer_bytes(elements: float, tensors: int) -> float:
        return elements * optimizer_bytes_per_parameter / tp + 4 * tensors

    layers = []
    vocab_elements = s.vocab_size * s.hidden_size
    hidden_bytes = tokens * s.hidden_size * p / tp  # a block's input, the hidden state a stage receives
    # what a block keeps of its input's own storage (plan.saved_input_bytes): its first RMSNorm saves
    # the input cast to fp32, which is the input itself only in an fp32 model; a checkpoint keeps the
    # input whatever its dtype
    normed_input = hidden_bytes if p == 4 else 0.0
    layers.append(LayerProfile(
        name="head", kind="head", forward_ms=seconds_ms(0, tokens * s.hidden_size * p),
        backward_ms=seconds_ms(0, 2 * vocab_elements * p), weight_ms=seconds_ms(0, 2 * vocab_elements * p),
        # keeps the token ids; its working set is the dense weight gradient each later micro-batch adds into .grad
        recompute={NONE: RecomputeCost(0.0, 8.0 * tokens, vocab_elements * p / tp)},
        parameter_bytes=vocab_elements * p / tp, gradient_bytes=vocab_elements * p / tp,
        optimizer_bytes=optimizer_bytes(vocab_elements, 1), optimizer_scalar_bytes=4.0,
    ))
    attention_elements = s.hidden_size * (q_width + 2 * kv_width) + q_width * s.hidden_size
    bias_elements, bias_tensors = (q_width + 2 * kv_width, 3) if s.qkv_bias else (0, 0)
    norm_elements, norm_tensors = (2 * head_dim, 2) if s.qk_norm else (0, 0)
    for index in range(s.num_layers):
        moe = s.num_experts > 0 and index not in s.dense_layers
        if moe:
            mlp_elements = s.num_experts * 3 * s.hidden_size * s.moe_ffn_size + s.hidden_size * s.num_experts
            mlp_elements += 3 * s.hidden_size * s.shared_expert_ffn_size + (s.hidden_size if s.shared_expert_ffn_size else 0)
            active_ffn = s.experts_per_token * s.moe_ffn_size + s.shared_expert_ffn_size
            # transformers v5 keeps the experts as two stacked tensors (gate+up, down) and a router
            tensors = 2 + 1 + (4 if s.shared_expert_ffn_size else 0)
        else:
            mlp_elements, active_ffn, tensors = 3 * s.hidden_size * s.ffn_size, s.ffn_size, 3
        elements = attention_elements + bias_elements + norm_elements + mlp_elements + 2 * s.hidden_size
        tensors += 4 + bias_tensors + norm_tensors + 2
        matmul_flops = 2 * tokens * (attention_elements + 3 * s.hidden_size * active_ffn)
        attention_flops = 2 * tokens * s.sequence // s.context_parallel * q_width  # causal: half of 4*b*s^2*h
        forward_ms = seconds_ms(matmul_flops + attention_flops)
        kept = _block_activation_bytes(tokens, s, head_dim, p, moe=moe)
        pending = _block_pending_bytes(tokens, s, head_dim, p, moe=moe) / tp
        weight_freed = pending + _block_weight_only_bytes(tokens, s, q_width, kv_width, p, moe=moe) / tp
        elementwise_ms = seconds_ms(0, (kept[NONE] - kept[SELECTIVE]) * 2)  # read and write what is rebuilt
        # working set beyond what a mode rebuilds: the MLP gradients alive together (MoE: per token and expert)
        if moe:
            per_token = s.experts_per_token * 3 * max(s.hidden_size, s.moe_ffn_size)
            per_token += s.hidden_size if s.shared_expert_ffn_size else 0
        else:
            per_token = 2 * max(s.hidden_size, s.ffn_size)
        gradients = tokens * per_token * p / tp
        layers.append(LayerProfile(
            name=f"layers.{index}", kind="body:moe" if moe else "body:dense",
            forward_ms=forward_ms + elementwise_ms, backward_ms=2 * forward_ms + elementwise_ms,
            weight_ms=seconds_ms(matmul_flops),
            recompute={
                NONE: RecomputeCost(0.0, kept[NONE] / tp, gradients, pending_bytes=pending,
                                    saved_input_bytes=normed_input, weight_freed_bytes=weight_freed),
                SELECTIVE: RecomputeCost(elementwise_ms, kept[SELECTIVE] / tp,
                                         gradients + (kept[NONE] - kept[SELECTIVE]) / tp,
                                         pending_bytes=pending, saved_input_bytes=hidden_bytes),
                FULL: RecomputeCost(forward_ms + elementwise_ms, kept[FULL] / tp,
                                    gradients + (kept[NONE] - kept[FULL]) / tp,
                                    pending_bytes=pending, saved_input_bytes=hidden_bytes),
            },
            parameter_bytes=elements * p / tp, gradient_bytes=elements * p / tp,
            optimizer_bytes=optimizer_bytes(elements, tensors), optimizer_scalar_bytes=4.0 * tensors,
        ))
    tail_elements = s.hidden_size + vocab_elements
    logits_flops = 2 * tokens * vocab_elements
    log_probs_bytes = tokens * s.vocab_size * 4  # log-softmax output, fp32
    loss_bytes = 4  # the loss, an fp32 scalar
    labels_bytes = 8 * tokens + loss_bytes  # int64 labels, and the loss
    # the fp32 gradients of log-probabilities and logits less the freed labels; with few tokens, the LM head's gradients
    tail_working = max(2 * log_probs_bytes / tp - labels_bytes, vocab_elements * p / tp + hidden_bytes)
    layers.append(LayerProfile(
        name="tail", kind="tail",
        forward_ms=seconds_ms(logits_flops, 2 * log_probs_bytes),
        backward_ms=seconds_ms(2 * logits_flops, 2 * log_probs_bytes),
        weight_ms=seconds_ms(logits_flops),
        # the final RMSNorm as a block's (its output is the LM head's input), the loss, the labels
        recompute={NONE: RecomputeCost(
            0.0, _norm_bytes(tokens, s.hidden_size, p) / tp + log_probs_bytes / tp + labels_bytes, tail_working,
            saved_input_bytes=normed_input)},
        parameter_bytes=tail_elements * p / tp, gradient_bytes=tail_elements * p / tp,
        optimizer_bytes=optimizer_bytes(tail_elements, 2), optimizer_scalar_bytes=8.0,
    ))
    return ModelProfile(
        layers=tuple(layers), model=f"analytic {s.num_layers}x{s.hidden_size}", source="analytic", dtype=s.dtype,
        micro_batch={"size": s.micro_batch_size, "sequence": s.sequence},
        stage_output_bytes=hidden_bytes,
        # what the model returns: the logits, split over the vocabulary, and the loss (fp32)
        model_output_bytes=tokens * s.vocab_size * p / tp + loss_bytes, loss_bytes=loss_bytes,
        # cos and sin, computed by every stage for its blocks
        stage_shared_bytes=2 * (s.sequence // s.context_parallel) * head_dim * p,
    )


def _block_pending_bytes(tokens: int, s: TransformerShape, head_dim: int, p: int, *, moe: bool) -> float:
    """What a split backward holds of a block from its input gradients to its weight gradients: the
    gradient of every weighted op's output (the projections, the norms' scaled outputs, the router).
    Exact for dense blocks; an upper bound for MoE blocks, whose input gradients also free some of
    what the routing saved."""
    q_width, kv_width = s.num_heads * head_dim, (s.num_kv_heads or s.num_heads) * head_dim
    attention = q_width + 2 * kv_width + s.hidden_size + (q_width + kv_width if s.qk_norm else 0)
    if moe:
        mlp = s.experts_per_token * (2 * s.moe_ffn_size + s.hidden_size) + s.num_experts
        if s.shared_expert_ffn_size:
            mlp += 2 * s.shared_expert_ffn_size + s.hidden_size + 1  # and its gate, one per token
    else:
        mlp = 2 * s.ffn_size + s.hidden_size
    return tokens * (attention + 2 * s.hidden_size + mlp) * p  # the two norms


def _block_weight_only_bytes(tokens: int, s: TransformerShape, q_width: int, kv_width: int, p: int, *,
                             moe: bool) -> float:
    """What a block saved that only its weight gradients use, which its W frees while the rest of its
    stage's graph lives on (`RecomputeCost.weight_freed_bytes` less the pending bytes): each RMSNorm's
    normalised input and output (the projections' input), the down projection's input, and where q
    and k are normalised per head, their normalised values. Exact for dense blocks; for MoE blocks the
    experts' part is left out, so their W is counted as freeing less than it does, never more."""
    per_token = 4 * s.hidden_size + (q_width + kv_width if s.qk_norm else 0) + (0 if moe else s.ffn_size)
    return tokens * per_token * p


def _block_activation_bytes(tokens: int, s: TransformerShape, head_dim: int, p: int, *,
                            moe: bool) -> dict[str, float]:
    """What a block keeps for backward, per recompute mode (a hand count of transformers' blocks)."""
    h = s.hidden_size
    kv_heads = s.num_kv_heads or s.num_heads
    q_width, kv_width = s.num_heads * head_dim, kv_heads * head_dim
    logsumexp = 4 * tokens * s.num_heads  # fp32, from the attention kernel
    # Attention: the norms, q, k and v, and what SDPA keeps; selective keeps the block's input, the
    # projections' outputs and the attention output.
    none = 2 * _norm_bytes(tokens, h, p) + p * tokens * (2 * q_width + 2 * kv_width)
    if s.qk_norm:  # norms over each head of q and k, whose outputs the rotary embedding keeps instead of the inputs
        none += _norm_bytes(tokens * s.num_heads, head_dim, p) + _norm_bytes(tokens * kv_heads, head_dim, p)
        none -= p * tokens * (q_width + kv_width)
    selective = p * tokens * (h + q_width + 2 * kv_width + q_width + h)
    if moe:
        # Each token's copy for each of its experts, the experts' gate-up, activation, product and
        # output, its routing weight and three int64 indices; per token the router's fp32
        # probabilities and chosen experts; once, the experts' int32 offsets.
        pairs = tokens * s.experts_per_token
        none += pairs * (2 * p * h + 4 * p * s.moe_ffn_size + p + 24)
        none += tokens * (4 * s.num_experts + 8 * s.experts_per_token) + 4 * s.num_experts
        if s.normalize_top_k:  # the chosen probabilities and their sum, fp32
            none += tokens * (4 * s.experts_per_token + 4)
        selective += p * (tokens * s.num_experts + pairs * (2 * s.moe_ffn_size + h))  # router logits, expert matmuls
        if s.shared_expert_ffn_size:  # a dense MLP, its output and sigmoid gate kept for their product
            none += p * tokens * (4 * s.shared_expert_ffn_size + h + 1)
            selective += p * tokens * (2 * s.shared_expert_ffn_size + h + 1)
    else:  # SwiGLU: gate, up, activation and product; selective keeps the three matmuls' outputs
        none += 4 * p * tokens * s.ffn_size
        selective += p * tokens * (2 * s.ffn_size + h)
    return {
        NONE: none + logsumexp,
        SELECTIVE: selective + logsumexp,
        FULL: float(p * tokens * h),
    }


def _norm_bytes(rows: int, width: int, p: int) -> int:
    """What an RMSNorm over `rows` vectors of `width` keeps: its input in fp32, 1/rms (fp32), the
    normalised input and the output in the model's dtype."""
    return rows * (4 * width + 4 + 2 * p * width)


def _integer(config: Mapping[str, object], key: str) -> int:
    """config[key] as an integer, 0 when absent or null; a fraction or a text is refused."""
    value = config.get(key)
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(key, f"expected an integer, got {value!r}")
    return value


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
