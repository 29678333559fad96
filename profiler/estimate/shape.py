"""What the analytic estimate needs to know about a decoder-only model and how it is trained, read
from a transformers config of the Llama family. Needs no torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from basics.errors import InputError
from solver.parallel.model_parallel import DTYPE_BYTES
from solver.vocabulary.profile_parts import BALANCED, Mesh

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
    # the layout one rank of which the estimate is for (solver.parallel.model_parallel's rules)
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tokens: str = BALANCED

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "vocab_size",
            "sequence",
            "ffn_size",
            "micro_batch_size",
            "tensor_parallel",
            "context_parallel",
            "expert_parallel",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(name, f"expected an integer >= 1, got {value!r}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise InputError(
                "head_dim", f"expected an integer >= 1, or 0 for hidden_size / num_heads, got {self.head_dim!r}"
            )
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
            raise InputError(
                "context_parallel",
                f"expected sequence {self.sequence} to be a multiple of 2 x "
                f"context_parallel, got context_parallel {self.context_parallel}",
            )
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise InputError("experts_per_token", f"expected 1..{self.num_experts}, got {self.experts_per_token}")
        try:
            _ = self.mesh  # the layout's own checks
        except InputError as error:
            raise InputError(error.field.removeprefix("mesh."), error.detail) from None

    @property
    def mesh(self) -> Mesh:
        return Mesh(
            tensor_parallel=self.tensor_parallel,
            sequence_parallel=self.sequence_parallel,
            context_parallel=self.context_parallel,
            expert_parallel=self.expert_parallel,
            expert_tokens=self.expert_tokens if self.expert_parallel > 1 else BALANCED,
        )


def shape_from_config(
    config: Mapping[str, object], *, sequence: int, micro_batch_size: int = 1, dtype: str = "bfloat16", **layout: object
) -> TransformerShape:
    """A `TransformerShape` from a transformers `config.json` of the Llama family (dict form);
    `layout`: its tensor_parallel, sequence_parallel, context_parallel, expert_parallel, expert_tokens."""
    model_type = config.get("model_type")
    if model_type not in LLAMA_FAMILY:
        raise InputError("model_type", f"analytic estimates cover {', '.join(LLAMA_FAMILY)}; got {model_type!r}")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in config:
            raise InputError(key, f"missing from the {model_type} config")
    try:
        return _shape(config, model_type, sequence=sequence, micro_batch_size=micro_batch_size, dtype=dtype, **layout)
    except InputError:
        raise
    except (TypeError, ValueError) as exc:  # a size that is not a number
        raise InputError("config", f"expected integers for the sizes of a {model_type} config: {exc}") from None


def _shape(
    config: Mapping[str, object], model_type: str, *, sequence: int, micro_batch_size: int, dtype: str, **layout: object
) -> TransformerShape:
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
        **layout,  # type: ignore[arg-type]
    )


def model_dimensions(config: Mapping[str, object]) -> dict[str, int]:
    """The sizes a parallel layout must divide (`solver.vocabulary.profile_parts.DIMENSIONS`), from a transformers
    config of the Llama family (dict form)."""
    heads = _integer(config, "num_attention_heads")
    hidden = _integer(config, "hidden_size")
    experts = _integer(config, "num_experts") or _integer(config, "num_local_experts")
    return {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": _integer(config, "num_key_value_heads") or heads,
        "head_dim": _integer(config, "head_dim") or (hidden // heads if heads else 0),
        "ffn": _integer(config, "intermediate_size"),
        "moe_ffn": (_integer(config, "moe_intermediate_size") or _integer(config, "intermediate_size"))
        if experts
        else 0,
        "vocab": _integer(config, "vocab_size"),
        "experts": experts,
        "experts_per_token": _integer(config, "num_experts_per_tok") if experts else 0,
    }


def shape_dimensions(s: TransformerShape) -> dict[str, int]:
    """`model_dimensions` of a shape."""
    return {
        "hidden": s.hidden_size,
        "heads": s.num_heads,
        "kv_heads": s.num_kv_heads or s.num_heads,
        "head_dim": s.head_dim or s.hidden_size // s.num_heads,
        "ffn": s.ffn_size,
        "moe_ffn": s.moe_ffn_size if s.num_experts else 0,
        "vocab": s.vocab_size,
        "experts": s.num_experts,
        "experts_per_token": s.experts_per_token if s.num_experts else 0,
    }


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
