"""What transformers' Llama-family blocks keep for backward, counted by hand (profiler.estimate.analytic's memory).

Each count is what the profiler measures on the CPU; `block_parts` splits it the way tensor parallelism
does (`profiler.tp_roles`): what stays whole on every rank without and with sequence parallelism, and
what the routed experts keep. Needs no torch.
"""

from __future__ import annotations

from profiler.estimate.shape import TransformerShape
from solver.vocabulary.profile import FULL, NONE, SELECTIVE


def norm_bytes(rows: int, width: int, p: int) -> int:
    """What an RMSNorm over `rows` vectors of `width` keeps: its input in fp32, 1/rms (fp32), the
    normalised input and the output in the model's dtype."""
    return rows * (4 * width + 4 + 2 * p * width)


def expert_gradient_bytes(tokens: int, hidden: int, moe_ffn: int, experts_per_token: int, p: int) -> float:
    """The routed experts' gradients alive together in a MoE block's backward: per token and expert it
    goes to, three of the wider of hidden and FFN width."""
    return float(tokens * experts_per_token * 3 * max(hidden, moe_ffn) * p)


def block_pending_bytes(tokens: int, s: TransformerShape, head_dim: int, p: int, *, moe: bool) -> float:
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


def block_weight_only_bytes(
    tokens: int, s: TransformerShape, q_width: int, kv_width: int, p: int, *, moe: bool
) -> float:
    """What a block saved that only its weight gradients use, which its W frees while the rest of its
    stage's graph lives on (`RecomputeCost.weight_freed_bytes` less the pending bytes): each RMSNorm's
    normalised input and output (the projections' input), the down projection's input, and where q
    and k are normalised per head, their normalised values. Exact for dense blocks; for MoE blocks the
    experts' part is left out, so their W is counted as freeing less than it does, never more."""
    per_token = 4 * s.hidden_size + (q_width + kv_width if s.qk_norm else 0) + (0 if moe else s.ffn_size)
    return tokens * per_token * p


def block_activation_bytes(tokens: int, s: TransformerShape, head_dim: int, p: int, *, moe: bool) -> dict[str, float]:
    """What a block keeps for backward, per recompute mode (a hand count of transformers' blocks)."""
    h = s.hidden_size
    kv_heads = s.num_kv_heads or s.num_heads
    q_width, kv_width = s.num_heads * head_dim, kv_heads * head_dim
    logsumexp = 4 * tokens * s.num_heads  # fp32, from the attention kernel
    # Attention: the norms, q, k and v, and what SDPA keeps; selective keeps the block's input, the
    # projections' outputs and the attention output.
    none = 2 * norm_bytes(tokens, h, p) + p * tokens * (2 * q_width + 2 * kv_width)
    if s.qk_norm:  # norms over each head of q and k, whose outputs the rotary embedding keeps instead of the inputs
        none += norm_bytes(tokens * s.num_heads, head_dim, p) + norm_bytes(tokens * kv_heads, head_dim, p)
        none -= p * tokens * (q_width + kv_width)
    selective = p * tokens * (h + q_width + 2 * kv_width + q_width + h)
    if moe:
        none += expert_pair_bytes(tokens, s, p) + router_bytes(tokens, s)
        selective += p * (tokens * s.num_experts + tokens * s.experts_per_token * (2 * s.moe_ffn_size + h))
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


def expert_pair_bytes(tokens: int, s: TransformerShape, p: int) -> int:
    """What the routed experts keep: per token copy (token and expert it goes to) the copy, the
    gate-up output, activation, product and output, its routing weight and three int64 indices;
    once, the experts' int32 offsets."""
    return tokens * s.experts_per_token * (2 * p * s.hidden_size + 4 * p * s.moe_ffn_size + p + 24) + 4 * s.num_experts


def router_bytes(tokens: int, s: TransformerShape) -> int:
    """What the router keeps: per token its fp32 probabilities and chosen experts (and, renormalising
    the chosen weights, them and their sum, fp32)."""
    kept = tokens * (4 * s.num_experts + 8 * s.experts_per_token)
    if s.normalize_top_k:
        kept += tokens * (4 * s.experts_per_token + 4)
    return kept


def block_parts(
    tokens: int, s: TransformerShape, head_dim: int, p: int, *, moe: bool
) -> dict[str, tuple[float, float, float]]:
    """Per recompute mode, of `block_activation_bytes`: (whole on every tensor-parallel rank, whole with
    sequence parallelism too, the routed experts'). Whole: the norms' inner tensors and the block's
    input (split by sequence parallelism), the norms' outputs the column-parallel projections keep (all-
    gathered under sequence parallelism), the row-parallel projections' and the router's outputs."""
    h = s.hidden_size
    norms_inner = 2 * tokens * (4 * h + 4 + p * h)
    norm_outputs = 2 * p * tokens * h
    projected = p * tokens * h * (2 if not moe or s.shared_expert_ffn_size else 1)  # o_proj's and down_proj's outputs
    none_whole, selective_whole, experts_none, experts_selective = norm_outputs, projected, 0.0, 0.0
    if moe:
        none_whole += router_bytes(tokens, s) + (p * tokens * h if s.shared_expert_ffn_size else 0)
        selective_whole += p * tokens * s.num_experts + (p * tokens if s.shared_expert_ffn_size else 0)
        experts_none = expert_pair_bytes(tokens, s, p)
        experts_selective = p * tokens * s.experts_per_token * (2 * s.moe_ffn_size + h)
    block_input = p * tokens * h
    return {
        NONE: (norms_inner + none_whole, none_whole, experts_none),
        SELECTIVE: (block_input + selective_whole, selective_whole, experts_selective),
        FULL: (block_input, 0.0, 0.0),
    }
