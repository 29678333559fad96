"""The parts of a profile that say which rank of a parallel job its numbers are for: the mesh it was
measured or estimated under, the model's dimensions the mesh must divide, and the collectives a layer runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from basics.errors import InputError, check_bytes, check_ms, check_non_negative, shown
from basics.fields import Fields
from solver.vocabulary.spec import EXPERT_TOKENS, capacity_factor

BALANCED = "balanced"
# The model's sizes a profile states (transformers' config names in brackets): hidden (hidden_size), heads
# (num_attention_heads), kv_heads (num_key_value_heads), head_dim, ffn (intermediate_size), moe_ffn
# (moe_intermediate_size), vocab (vocab_size), experts (num_experts / num_local_experts), experts_per_token
# (num_experts_per_tok).
DIMENSIONS = ("hidden", "heads", "kv_heads", "head_dim", "ffn", "moe_ffn", "vocab", "experts", "experts_per_token")
COLLECTIVE_DIMENSIONS = ("tensor", "context", "expert", "data")
COLLECTIVE_PER = ("micro-batch", "step")
MICRO_BATCH = ("sequence", "size")  # samples per micro-batch, tokens per sample
MAX_COUNT = 2**50  # beyond any real batch or sequence, and where an integer still converts to a float exactly


@dataclass(frozen=True)
class Mesh:
    """The layout a profile's numbers are per rank of. A profile measured on one process is 1-D (the
    default); `sapp-hook profile --estimate --tensor-parallel 2` states `tensor_parallel` 2. Data
    parallelism is not here: the spec shards static bytes over it at planning time.
    `expert_tokens`: the token copies an expert-parallel rank's experts receive (spec.EXPERT_TOKENS or
    "capacity:F"); "balanced" where `expert_parallel` is 1."""

    tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tokens: str = BALANCED

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "context_parallel", "expert_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"mesh.{name}", f"expected an integer >= 1, got {shown(value)}")
        if not isinstance(self.sequence_parallel, bool):
            raise InputError("mesh.sequence_parallel", f"expected true or false, got {shown(self.sequence_parallel)}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise InputError("mesh.sequence_parallel", "needs tensor_parallel > 1")
        if self.expert_tokens not in EXPERT_TOKENS and capacity_factor(self.expert_tokens) is None:
            raise InputError(
                "mesh.expert_tokens", f"expected balanced, dropless or capacity:FACTOR, got {shown(self.expert_tokens)}"
            )
        if self.expert_parallel == 1 and self.expert_tokens != BALANCED:
            raise InputError("mesh.expert_tokens", "is for expert_parallel > 1; expected balanced")

    @property
    def is_one_d(self) -> bool:
        return self == Mesh()

    def describe(self) -> str:
        """`tensor_parallel 2 (sequence parallel), expert_parallel 8 (dropless)`, or `1-D`."""
        parts = []
        if self.tensor_parallel > 1:
            parts.append(
                f"tensor_parallel {self.tensor_parallel}" + (" (sequence parallel)" if self.sequence_parallel else "")
            )
        if self.context_parallel > 1:
            parts.append(f"context_parallel {self.context_parallel}")
        if self.expert_parallel > 1:
            parts.append(f"expert_parallel {self.expert_parallel} ({self.expert_tokens})")
        return ", ".join(parts) or "1-D"

    def to_dict(self) -> dict[str, object]:
        return {
            "tensor_parallel": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel,
            "context_parallel": self.context_parallel,
            "expert_parallel": self.expert_parallel,
            "expert_tokens": self.expert_tokens,
        }

    @classmethod
    def from_dict(cls, data: object) -> Mesh:
        fields = Fields(data, "mesh")
        flag = fields.raw("sequence_parallel", False)
        if not isinstance(flag, bool):
            raise InputError("mesh.sequence_parallel", f"expected true or false, got {shown(flag)}")
        mesh = cls(
            tensor_parallel=fields.integer("tensor_parallel", 1, least=1),
            sequence_parallel=flag,
            context_parallel=fields.integer("context_parallel", 1, least=1),
            expert_parallel=fields.integer("expert_parallel", 1, least=1),
            expert_tokens=fields.text("expert_tokens", BALANCED),
        )
        fields.done()
        return mesh


@dataclass(frozen=True)
class Collective:
    """One kind of collective a layer runs on one mesh dimension ("tensor", "context", "expert", "data"):
    `calls` of them moving `bytes` in all (each collective's whole tensor, summed), per micro-batch or
    per step, taking `ms` on the link, of which `exposed_ms` is not hidden behind compute. Per
    micro-batch, the exposed part is inside the layer's forward and backward times; per step, it is not
    in any layer time."""

    dimension: str
    operation: str  # all-reduce, all-gather, reduce-scatter, all-to-all, send-receive
    per: str
    calls: int
    bytes: float
    ms: float
    exposed_ms: float

    def __post_init__(self) -> None:
        where = f"collectives.{self.dimension}.{self.operation}"
        if self.dimension not in COLLECTIVE_DIMENSIONS:
            raise InputError(
                "collectives.dimension",
                f"expected one of {', '.join(COLLECTIVE_DIMENSIONS)}, got {shown(self.dimension)}",
            )
        if self.per not in COLLECTIVE_PER:
            raise InputError(f"{where}.per", f"expected one of {', '.join(COLLECTIVE_PER)}, got {shown(self.per)}")
        if isinstance(self.calls, bool) or not isinstance(self.calls, int) or self.calls < 0:
            raise InputError(f"{where}.calls", f"expected an integer >= 0, got {shown(self.calls)}")
        check_bytes(self.bytes, f"{where}.bytes")
        check_ms(self.ms, f"{where}.ms")
        check_ms(self.exposed_ms, f"{where}.exposed_ms")
        if self.exposed_ms > self.ms:
            raise InputError(f"{where}.exposed_ms", f"expected at most ms ({self.ms:g}), got {self.exposed_ms:g}")

    def to_dict(self) -> dict[str, object]:
        return {
            "dimension": self.dimension,
            "operation": self.operation,
            "per": self.per,
            "calls": self.calls,
            "bytes": self.bytes,
            "ms": self.ms,
            "exposed_ms": self.exposed_ms,
        }


def collectives_from_list(data: object, where: str) -> tuple[Collective, ...]:
    if not isinstance(data, list):
        raise InputError(where, f"expected a list, got {type(data).__name__}")
    collectives = []
    for index, item in enumerate(data):
        fields = Fields(item, f"{where}[{index}]")
        collectives.append(
            Collective(
                dimension=fields.text("dimension", required=True),
                operation=fields.text("operation", required=True),
                per=fields.text("per", required=True),
                calls=fields.integer("calls", required=True),
                bytes=fields.number("bytes", required=True),
                ms=fields.number("ms", required=True),
                exposed_ms=fields.number("exposed_ms", required=True),
            )
        )
        fields.done()
    return tuple(collectives)


def dimensions_from_dict(data: object) -> dict[str, int]:
    """The `dimensions` object of a profile: integers >= 0 under the names of DIMENSIONS."""
    if not isinstance(data, Mapping):
        raise InputError("dimensions", f"expected an object, got {type(data).__name__}")
    check_dimensions(data)
    return dict(data)


def check_dimensions(dimensions: Mapping[str, object]) -> None:
    for name, value in dimensions.items():
        if name not in DIMENSIONS:
            raise InputError(f"dimensions.{name}", f"unknown; expected one of {', '.join(DIMENSIONS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"dimensions.{name}", f"expected an integer >= 0, got {shown(value)}")


def micro_batch_from_dict(data: object) -> dict[str, int]:
    """The `micro_batch` object of a profile: `size` and `sequence`, each an integer from 1 to MAX_COUNT."""
    if not isinstance(data, Mapping):
        raise InputError("micro_batch", f"expected an object, got {type(data).__name__}")
    check_micro_batch(data)
    return dict(data)


def check_micro_batch(micro_batch: Mapping[object, object]) -> None:
    """InputError naming `micro_batch.KEY` for a key other than size and sequence or an amount outside 1..2**50."""
    for name, value in micro_batch.items():
        if name not in MICRO_BATCH:
            raise InputError(f"micro_batch.{name}", f"unknown key; expected one of {', '.join(MICRO_BATCH)}")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise InputError(f"micro_batch.{name}", f"expected an integer from 1 to 2**50, got {shown(value)}")


def spread_from_dict(data: object, where: str) -> dict[str, float]:
    """A layer's `spread`: per field, its spread over the measured steps, in the field's unit (a time in ms
    at most MAX_MS, a size in bytes at most MAX_BYTES)."""
    if not isinstance(data, Mapping):
        raise InputError(where, f"expected an object, got {shown(data)}")
    spread = {}
    for key, value in data.items():
        number = check_non_negative(value, f"{where}.{key}")
        if str(key).endswith("_ms"):
            check_ms(value, f"{where}.{key}")
        elif str(key).endswith("_bytes"):
            check_bytes(value, f"{where}.{key}")
        spread[str(key)] = number
    return spread
