"""Small transformers models (random weights, no download) and a training loop for profiler tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from profiler import LayerProfiler

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

BATCH, SEQ = 2, 32
LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
QWEN3 = dict(LLAMA, head_dim=32)  # 4 heads of 32 on a hidden size of 64
GPT2 = dict(n_embd=64, n_layer=4, n_head=4, n_positions=128, vocab_size=512, bos_token_id=0, eos_token_id=0)
MOE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_hidden_layers=4,
    mlp_only_layers=[0, 1],
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=128,
)

# Qwen3's attention, experts without a shared one, their weights renormalised; Mixtral: every block MoE
QWEN3_MOE = {
    **{k: v for k, v in MOE.items() if k != "shared_expert_intermediate_size"},
    "head_dim": 32,
    "norm_topk_prob": True,
}
MIXTRAL = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=128,
)


def _causal_lm(name: str, config: dict, seed: int, overrides: dict) -> torch.nn.Module:
    """transformers' `<name>ForCausalLM` (or GPT-2's LM head model) with random weights from `seed`."""
    torch.manual_seed(seed)
    model_class = getattr(transformers, "GPT2LMHeadModel" if name == "GPT2" else f"{name}ForCausalLM")
    return model_class(getattr(transformers, f"{name}Config")(**{**config, **overrides})).train()


def llama(seed: int = 0, **overrides: object) -> torch.nn.Module:
    return _causal_lm("Llama", LLAMA, seed, overrides)


def qwen3(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Llama's shape with Qwen3's attention: heads wider than hidden_size / num_heads, each normalised."""
    return _causal_lm("Qwen3", QWEN3, seed, overrides)


def qwen3_moe(seed: int = 0) -> torch.nn.Module:
    return _causal_lm("Qwen3Moe", QWEN3_MOE, seed, {})


def mixtral(seed: int = 0) -> torch.nn.Module:
    return _causal_lm("Mixtral", MIXTRAL, seed, {})


def gpt2(seed: int = 0, **overrides: object) -> torch.nn.Module:
    return _causal_lm("GPT2", GPT2, seed, overrides)


def moe(seed: int = 0) -> torch.nn.Module:
    return _causal_lm("Qwen2Moe", MOE, seed, {})


def batch(step: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    ids = batch(step)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def profiled(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: object
) -> LayerProfiler:
    """Profile `model` over its own short training run; the profiler, done."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
    with LayerProfiler(model, optimizer, **options) as profiler:
        while not profiler.done:
            train_step(model, optimizer, profiler.steps_done)
            profiler.step()
    return profiler
