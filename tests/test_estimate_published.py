"""The traced estimate (`profiler.estimate.generic.traced_profile`) against the activation formulas
others publish, each term derived and each difference stated where transformers' CPU kernels keep
something other than the formula assumes; a check fails on any byte unaccounted for.

Sources:
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198), section 4.1: per layer s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations and
  1-byte dropout masks; selective recompute keeps 34*s*b*h, full recompute the layer input 2*s*b*h.
- Megatron-LM `megatron/training/theoretical_memory_usage.py`, `compute_activation_memory` (used
  with sequence parallelism and selective recompute): s*b*h*(18 + 4*ffn/h) per layer, 8*s*b (token
  ids) and s*b*h (embedding dropout mask) in the first stage, 4*s*b*h*(1 + v/h) for the output layer
  and loss when there is one stage.
- SAPP-ND (reference/SAPP-ND.md): a fully recomputed layer keeps s*b*h; the router
  s*b*(2E + k + h); MTP adds its own projection and counts the shared embedding and head again.
"""

from __future__ import annotations

import pytest
import torch

from profiler.estimate.generic import MTP_KIND, parameter_report, traced_profile
from solver.vocabulary.profile import FULL, NONE, SELECTIVE

torch.set_num_threads(1)
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def gpt2(h: int = 256, a: int = 4, ffn: int | None = None, **extra) -> dict:
    """GPT-2 with the paper's kernels: LayerNorm, one fused QKV matmul, exact GeLU (not GPT-2's tanh
    form), attention and hidden dropout 0.1, eager attention, learned positions, sequential residual."""
    fields = dict(
        model_type="gpt2", n_embd=h, n_head=a, n_layer=2, n_inner=ffn, vocab_size=1000, n_positions=128,
        activation_function="gelu", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return {**fields, **extra}


def test_gpt2_decoder_found_by_its_own_names_and_counted_exactly():
    # GPT-2 keeps its blocks in `transformer.h`, its final norm in `ln_f` and learned positions in `wpe`
    h, v, positions = 256, 1000, 128
    count = parameter_report(gpt2(h))
    assert [part.parameters for part in count.parts] == [
        (v + positions) * h,  # token and position embeddings
        12 * h * h + 13 * h,  # QKV, output, 4h MLP with biases, two LayerNorms
        12 * h * h + 13 * h,
        v * h + 2 * h,  # ln_f and the LM head
    ]
    tied = traced_profile(gpt2(h, tie_word_embeddings=True), sequence=32, micro_batch_size=1)
    assert [t.bytes for t in tied.tied_parameters] == [2.0 * v * h]  # the token embedding, not the positions
    assert tied.layers[-1].parameter_bytes == 2.0 * (v * h + 2 * h)
    # GPT-2 derives the head width from h / heads: halving the heads splits no weight, so TP is not stated
    assert tied.layers[1].replicated_parameter_bytes is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_korthikanti_per_layer_activations_with_the_kernels_differences(dtype):
    s, b, h, a = 128, 2, 256, 4
    p = BYTES[dtype]
    sbh, core = s * b * h, a * s * s * b
    layer = traced_profile(gpt2(h, a), sequence=s, micro_batch_size=b, dtype=dtype).layers[1]
    paper = {
        "attention: QKV input 2, Q and K 4, V 2, output projection input 2, dropout mask 1": 11 * sbh,
        "attention core: softmax output 2, dropout mask 1, dropout output 2": 5 * core,
        "MLP: input 2, GeLU input 8, second matmul input 8, dropout mask 1": 19 * sbh,
        "two LayerNorms' inputs": 4 * sbh,
    }
    assert sum(paper.values()) == sbh * (34 + 5 * a * s / h)
    cpu = {
        # torch's CPU dropout keeps a scaled mask in the activations' dtype; CUDA's fused one keeps bools
        "dropout masks of p bytes, not 1": (p - 1) * (core + 2 * sbh),
        # CPU LayerNorm keeps mean and 1/std in the input's dtype (CUDA: fp32, 16*s*b)
        "two LayerNorms' mean and rstd": 2 * 2 * s * b * p,
    }
    assert layer.recompute[NONE].activation_bytes == sum(paper.values()) + sum(cpu.values())
    # selective: the paper recomputes the attention core and keeps the rest (34 s b h); ours keeps the
    # layer input and every matmul's output, recomputing the elementwise ops (the scores QK^T included)
    ours_selective = {
        "layer input": 2 * sbh,
        "QKV output": 6 * sbh,
        "scores QK^T (a batched matmul)": 2 * core,
        "attention output (PV)": 2 * sbh,
        "output projection": 2 * sbh,
        "first MLP matmul (4h)": 8 * sbh,
        "second MLP matmul": 2 * sbh,
    }
    assert layer.recompute[SELECTIVE].activation_bytes == sum(ours_selective.values())
    assert layer.recompute[SELECTIVE].activation_bytes == 22 * sbh + 2 * core  # the paper's selective: 34sbh
    assert layer.recompute[FULL].activation_bytes == 2 * sbh  # the paper's full recompute: the input


def test_megatron_theoretical_activation_terms_for_a_gpt_with_ffn_2h():
    s, b, h, a, ffn, v, p = 128, 2, 256, 4, 512, 1000, 2
    sbh, core = s * b * h, a * s * s * b
    profile = traced_profile(gpt2(h, a, ffn), sequence=s, micro_batch_size=b, dtype="bfloat16")
    head, layer, tail = profile.layers[0], profile.layers[1], profile.layers[-1]
    megatron_layer = sbh * (18 + 4 * ffn / h)  # what selective recompute keeps: all but the attention core
    cpu_core = 2 * core + p * core + 2 * core  # softmax output, p-byte mask, dropout output
    cpu_extra = 2 * (p - 1) * sbh + 4 * s * b * p  # the two hidden dropouts' p-byte masks, LayerNorm stats
    assert layer.recompute[NONE].activation_bytes - cpu_core == megatron_layer + cpu_extra
    # ours selective: input, QKV, scores, PV, output projection, both MLP matmuls' outputs
    assert layer.recompute[SELECTIVE].activation_bytes == 14 * sbh + 2 * s * b * ffn + 2 * core
    # the first stage's embedding: token ids (8 s b) and the dropout mask (s b h, here p s b h); ours also
    # keeps the position ids, one row of int64 for the whole micro-batch
    assert head.recompute[NONE].activation_bytes == 8 * s * b + p * sbh + 8 * s
    # one stage: the final LayerNorm's and LM head's inputs and the fp32 log-probabilities; ours also keeps
    # the LayerNorm's stats, the shifted int64 labels and the loss's fp32 weight total
    megatron_output = 4 * sbh * (1 + v / h)
    assert tail.recompute[NONE].activation_bytes == megatron_output + 2 * s * b * p + 8 * s * b + 4


def test_sapp_nd_deepseek_v3_terms_against_the_traced_layers():
    from test_estimate_models import TINY

    fields = {"model_type": "deepseek_v3", "tie_word_embeddings": False, **TINY["deepseek_v3"]}
    s, b, p = 32, 2, 2
    h, v, f, fm, experts, k = 64, 512, 128, 32, 8, 2
    groups, top_groups, n = 2, 1, s * b
    profile = traced_profile(fields, sequence=s, micro_batch_size=b, dtype="bfloat16")
    dense, moe = profile.layers[1], profile.layers[2]
    assert (dense.kind, moe.kind) == ("body:dense", "body:moe")
    # SAPP-ND: a fully recomputed layer keeps only its input, s b h (t = 1): exact, dense and MoE alike
    assert dense.recompute[FULL].activation_bytes == moe.recompute[FULL].activation_bytes == p * n * h
    # The router keeps, per token: its fp32 input copy (4h), sigmoid scores (4E), the -inf mask (E bools),
    # the int64 indices of the top-2 per group (16 G), of the chosen groups (8) and experts (8k), the
    # renormalising sum (4) and the fp32 weights before it (4k); SAPP-ND's (2E + k + h) p leaves out the
    # fp32 upcast, the indices and the group-limited routing
    router = n * (4 * h + 4 * experts + experts + 16 * groups + 8 * top_groups + 8 * k + 4 + 4 * k)
    # the routed experts keep, per token copy (s b k of them, SAPP-ND's count), its int64 indices (3), the
    # copy and the output (2 p h), gate-up, SiLU and product (4 p f_moe), its fp32 routing weight; the
    # experts' int32 offsets once
    routed = n * k * (3 * 8 + 2 * p * h + 4 * p * fm + 4) + 4 * experts
    # the shared expert is a dense SwiGLU MLP of width f_moe (SAPP-ND's "shared experts as dense"): its
    # input, gate, up, SiLU and product, as the dense layer's MLP of width f; attention and norms equal
    shared_minus_dense = 4 * p * n * (fm - f)
    assert moe.recompute[NONE].activation_bytes - dense.recompute[NONE].activation_bytes == (
        router + routed + shared_minus_dense
    )
    # MTP: its own decoder layer (like the last), two RMSNorms, the 2h x h projection and the shared head's
    # norm, plus (the first module) its copy of the embedding, tied to the head's; not the output head:
    # it shares the stage's, which SAPP-ND counts again
    mtp = [layer for layer in profile.layers if layer.kind == MTP_KIND]
    counts = parameter_report(fields)
    last = counts.parts[-2 - len(mtp)].parameters
    assert [layer.name for layer in mtp] == ["mtp.0"]
    assert mtp[0].parameter_bytes == p * (last + 3 * h + 2 * h * h + v * h)
    assert [t.layers for t in profile.tied_parameters] == [("head", "mtp.0")]


def test_megatron_per_layer_term_against_a_llama_layer_with_selective_recompute():
    s, b, h, heads, kv_heads, ffn, p = 128, 2, 256, 8, 2, 704, 2
    kv = kv_heads * h // heads
    fields = dict(
        model_type="llama", hidden_size=h, intermediate_size=ffn, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    layer = traced_profile(fields, sequence=s, micro_batch_size=b, dtype="bfloat16").layers[1]
    megatron = s * b * h * (18 + 4 * ffn / h)  # GeLU kernels: LayerNorm inputs, dropout masks, a 2-matmul MLP
    # ours: the input, q k v (GQA: k and v kv wide), the attention output and its fp32 log-sum-exp, the
    # output projection, SwiGLU's gate and up (its third matmul's output), the down projection; no dropout
    ours = p * s * b * (h + (h + 2 * kv) + h + h + 2 * ffn + h) + 4 * s * b * heads
    assert (
        layer.recompute[SELECTIVE].activation_bytes
        == ours
        == 2 * s * b * (5 * h + 2 * kv) + 4 * s * b * ffn + 4 * s * b * heads
    )
    # Megatron's term less the excess its GeLU kernels assume: 2sb(4h - 2 kv) - 4sb heads
    assert layer.recompute[SELECTIVE].activation_bytes == megatron - (2 * s * b * (4 * h - 2 * kv) - 4 * s * b * heads)
