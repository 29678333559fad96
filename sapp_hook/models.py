"""Models to profile without downloading anything: transformers architectures built from a config with
random weights. The built-in examples, or any `config.json` transformers knows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from basics.errors import InputError
from basics.files import read_json
from solver.vocabulary.profile import ModelProfile

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# Small enough to train a few steps on two CPU cores in seconds; shaped like the real families.
BUILTIN_MODELS: dict[str, dict[str, object]] = {
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    "tiny-gpt2": {
        "model_type": "gpt2",
        "n_embd": 256,
        "n_layer": 8,
        "n_head": 8,
        "n_positions": 1024,
        "vocab_size": 8192,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    # Dense blocks, then mixture-of-experts blocks: two body kinds in one model.
    "tiny-moe": {
        "model_type": "qwen2_moe",
        "hidden_size": 256,
        "intermediate_size": 688,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 512,
        "num_hidden_layers": 8,
        "mlp_only_layers": [0, 1],
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 8192,
        "max_position_embeddings": 1024,
    },
}


def load_config(model: str) -> PretrainedConfig:
    """A built-in model's config, or one read from a `config.json` (or a folder holding one)."""
    from profiler.estimate.meta_model import build_config

    data, where = config_data(model)
    return build_config(data, field="--model", where=where)


def config_data(model: str) -> tuple[dict[str, object], str]:
    """A built-in model's config, or a `config.json`'s (or a folder's), as a plain dict (no
    transformers needed), and where it came from."""
    if model in BUILTIN_MODELS:
        return dict(BUILTIN_MODELS[model]), model
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(
            "--model",
            f"{model!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a config.json or a folder holding one",
        )
    data = read_json(path, "--model")
    if not isinstance(data, Mapping):
        raise InputError("--model", f"{path} holds {type(data).__name__}; expected a transformers config object")
    return dict(data), str(path)


def build_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The causal language model of `config` with random weights, in training mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kind = getattr(config, "model_type", None) or repr(config)
    try:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except ValueError as exc:
        raise InputError("--model", f"{kind} has no causal language model in transformers: {exc}") from None
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
            raise
        raise InputError("--model", f"{kind}'s weights do not fit in this machine's memory: {_one_line(exc)}") from None
    return model.train()


PARAMETER_DTYPES = ("float32", "bfloat16", "float16")


def parameter_dtype(name: str) -> torch.dtype:
    """The torch dtype a model's parameters are trained in, by name."""
    import torch

    if name not in PARAMETER_DTYPES:
        raise InputError("--dtype", f"expected one of {', '.join(PARAMETER_DTYPES)}, got {name!r}")
    return getattr(torch, name)


def random_batch(config: PretrainedConfig, micro_batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """Token ids (and the same as labels) for one training step; no cache, as in training."""
    import torch

    check_sequence(config, seq_len)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.get_text_config().vocab_size, (micro_batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def check_sequence(config: PretrainedConfig, seq_len: int) -> None:
    """Refuse random tokens `config`'s model cannot take: no vocabulary, or past its positions."""
    text = config.get_text_config()
    if isinstance(text.vocab_size, bool) or not isinstance(text.vocab_size, int) or text.vocab_size < 1:
        raise InputError("--model", f"vocab_size: expected an integer >= 1, got {text.vocab_size!r}")
    positions = getattr(text, "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:
        raise InputError(
            "--seq-len", f"{seq_len} tokens; the model takes at most {positions} (max_position_embeddings)"
        )


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def profile_example(
    config: PretrainedConfig,
    *,
    steps: int = 2,
    warmup_steps: int = 1,
    micro_batch_size: int = 2,
    seq_len: int = 128,
    modes: tuple[str, ...] | None = None,
    layers: list[str] | None = None,
    model_name: str = "",
    on_step: Callable[[int, int, str], None] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> ModelProfile:
    """Build `config`'s model on `device` in `dtype` and profile it over a few AdamW training steps on
    random tokens. `on_step(done, total, what)`: progress after each step, `what` the step's purpose."""
    import torch

    from profiler import LayerProfiler
    from profiler.recompute import TORCH_MODES
    from sapp_hook.pipelining.stages import loss_tail

    if micro_batch_size < 1 or seq_len < 1:
        field, value = ("--micro-batch-size", micro_batch_size) if micro_batch_size < 1 else ("--seq-len", seq_len)
        raise InputError(field, f"expected an integer >= 1, got {value}")
    check_sequence(config, seq_len)  # before building what may be a large model
    model = build_model(config).to(device=device, dtype=parameter_dtype(dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    profiler = LayerProfiler(
        model,
        optimizer,
        steps=steps,
        warmup_steps=warmup_steps,
        modes=modes or TORCH_MODES,
        layers=layers,
        tail=loss_tail(model),
        model_name=model_name or config.model_type,
        on_step=None
        if on_step is None
        else lambda done, total, mode: on_step(done, total, profiler.describe_step(done - 1)),
        micro_batch={"size": micro_batch_size, "sequence": seq_len},
    )
    with profiler:
        while not profiler.done:
            batch = random_batch(config, micro_batch_size, seq_len, seed=profiler.steps_done)
            loss = model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            profiler.step()
    return profiler.profile()
