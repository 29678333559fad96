"""What each training framework keeps per parameter for the whole run: weights, gradients, optimizer state.

An estimate's static bytes follow one of these (`sapp-hook profile --estimate --framework NAME`). Each number
is the framework's own, cited where it is set; the profile holds them unsharded, and `solve` shards them over
data parallelism as the convention's `solve_flags` say (ZeRO stage 1 for Megatron-LM's distributed optimizer
and MindSpore's optimizer parallel, FSDP for TorchTitan).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from basics.errors import InputError
from solver.parallel.model_parallel import DTYPE_BYTES

ADAM_STEP_BYTES = 4  # torch.optim.Adam(W)'s `step`, an fp32 scalar tensor per parameter tensor
KINDS = ("parameter", "gradient", "optimizer")


@dataclass(frozen=True)
class StaticConvention:
    """Bytes a framework keeps per parameter at rest, per kind, and which kinds its data-parallel sharding divides.

    Attributes:
        name: the `--framework` name.
        describes: the framework and its setting, in words.
        parameter_bytes: the weights a rank computes with (bf16 weights; fp32 where they are also the master copy).
        gradient_bytes: the gradients kept to the step (Megatron's fp32 `main_grad`).
        optimizer_bytes: the optimizer's state per element: an fp32 master copy where the weights are 16-bit,
            and Adam's two moments.
        tensor_bytes: optimizer state per parameter tensor, whatever its size (torch AdamW's step count).
        sharded: the kinds the framework's data-parallel sharding divides by the data-parallel size.
        solve_flags: the `solve` flags that shard as the framework does, beside `--data-parallel D`.
        source: where the numbers are stated.
        compute_dtype: what the framework computes in, the estimate's activations' dtype unless --dtype.
    """

    name: str
    describes: str
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    tensor_bytes: float = 0
    sharded: tuple[str, ...] = ()
    solve_flags: str = ""
    source: str = ""
    compute_dtype: str = "bfloat16"

    @property
    def bytes_per_parameter(self) -> float:
        """All three kinds, unsharded (per element; the per-tensor bytes apart)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def per_rank(self, data_parallel: int) -> float:
        """Bytes a parameter costs one rank once `sharded` is divided over `data_parallel` ranks."""
        return sum(getattr(self, f"{kind}_bytes") / (data_parallel if kind in self.sharded else 1) for kind in KINDS)

    def formula(self, ranks: str = "d") -> str:
        """The bytes per parameter as the framework's docs write them, over `ranks` data-parallel ranks:
        `18`, `6 + 12/d`, `16/d`."""
        whole = sum(getattr(self, f"{kind}_bytes") for kind in KINDS if kind not in self.sharded)
        split = sum(getattr(self, f"{kind}_bytes") for kind in KINDS if kind in self.sharded)
        if not split:
            return f"{whole:g}"
        return f"{split:g}/{ranks}" if not whole else f"{whole:g} + {split:g}/{ranks}"

    def with_optimizer_bytes(self, optimizer_bytes: float) -> StaticConvention:
        """The convention with `--optimizer-bytes` in place of its optimizer state per element."""
        return replace(self, optimizer_bytes=optimizer_bytes)

    def note(self) -> str:
        """One line naming the convention and its bytes a parameter, for the CLI's report."""
        parts = (
            f"weights {self.parameter_bytes:g} + gradients {self.gradient_bytes:g} + "
            f"optimizer {self.optimizer_bytes:g} = {self.bytes_per_parameter:g} bytes a parameter"
        )
        step = f" (+ {self.tensor_bytes:g} a tensor)" if self.tensor_bytes else ""
        shard = (
            f"; solve with --data-parallel D {self.solve_flags} for the framework's {self.formula('D')}"
            if self.sharded
            else ""
        )
        return f"static memory: {self.name} ({self.describes}): {parts}{step}{shard}"


def plain(dtype: str, optimizer_bytes: float) -> StaticConvention:
    """No framework's convention: weights and gradients in `dtype`, `optimizer_bytes` a parameter of optimizer
    state and torch Adam's step count a tensor (the estimate's default)."""
    if dtype not in DTYPE_BYTES:
        raise InputError("dtype", f"expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    p = DTYPE_BYTES[dtype]
    return StaticConvention(
        "plain",
        f"{dtype} weights and gradients, torch AdamW",
        p,
        p,
        optimizer_bytes,
        ADAM_STEP_BYTES,
        source="--dtype and --optimizer-bytes",
        compute_dtype=dtype,
    )


# Megatron-LM, bf16: bf16 weights (2), fp32 main gradients (4), an fp32 master copy and Adam's two fp32 moments
# (12): 18 bytes, or 6 + 12/d with --use-distributed-optimizer, which shards the master copy and moments only
# (megatron/training/theoretical_memory_usage.py `num_bytes_per_parameter`; docs/source/api-guide/
# dist_optimizer.md's table, "bf16 param, fp32 grads: 18 | 6 + 12/d"). Its fused Adam keeps no per-tensor step.
_MEGATRON = {"parameter_bytes": 2, "gradient_bytes": 4, "optimizer_bytes": 12}
_MEGATRON_SOURCE = "Megatron-LM megatron/training/theoretical_memory_usage.py; docs dist_optimizer.md"

CONVENTIONS: dict[str, StaticConvention] = {
    convention.name: convention
    for convention in (
        StaticConvention(
            "megatron",
            "Megatron-LM, bf16, no distributed optimizer",
            **_MEGATRON,
            source=_MEGATRON_SOURCE,
        ),
        StaticConvention(
            "megatron-distributed-optimizer",
            "Megatron-LM, bf16, --use-distributed-optimizer",
            **_MEGATRON,
            sharded=("optimizer",),
            solve_flags="--zero-stage 1",
            source=_MEGATRON_SOURCE,
        ),
        # MindSpeed-LLM runs Megatron-core's optimizer (its docs repeat the table: "fp16/bf16 param, fp32 grads:
        # 18 | 6 + 12/d") and its example scripts pass --use-distributed-optimizer
        StaticConvention(
            "mindspeed",
            "MindSpeed-LLM, bf16, --use-distributed-optimizer",
            **_MEGATRON,
            sharded=("optimizer",),
            solve_flags="--zero-stage 1",
            source="MindSpeed-LLM docs (features, high availability: bytes per parameter); Megatron-LM's table",
        ),
        # MindFormers: param_init_type float32 with compute_dtype bfloat16 (its LLM training YAMLs), so fp32
        # weights (4) that are their own master copy, fp32 gradients (4) and AdamW's moments cloned in fp32
        # (`clone_param32(prefix="adam_m")`, 8): 16 bytes, as Megatron's "fp32 param, fp32 grads: 16 | 8 + 8/d";
        # parallel.enable_parallel_optimizer shards the optimizer state (sapp-hook writes it as ZeRO stage 1;
        # MindSpore shards the weights too, so stage 1 counts more than it holds)
        StaticConvention(
            "mindformers",
            "MindFormers, fp32 param_init_type, bf16 compute, enable_parallel_optimizer",
            4,
            4,
            8,
            sharded=("optimizer",),
            solve_flags="--zero-stage 1",
            source="MindFormers YAML model_config (param_init_type, compute_dtype); mindformers AdamW; "
            "MindSpore docs optimizer_parallel.md",
        ),
        # TorchTitan: training.dtype float32 (its default) keeps fp32 weights, which are their own master copy,
        # fp32 gradients (mixed_precision_reduce float32) and torch AdamW's fp32 moments; FSDP2 shards all three
        # (torchtitan/config/job_config.py Training.dtype, mixed_precision_param, mixed_precision_reduce)
        StaticConvention(
            "torchtitan",
            "TorchTitan, FSDP2, training.dtype float32, bf16 compute",
            4,
            4,
            8,
            ADAM_STEP_BYTES,
            sharded=KINDS,
            solve_flags="--fsdp",
            source="TorchTitan torchtitan/config/job_config.py (Training.dtype, mixed_precision_param)",
        ),
        # training.dtype bfloat16: "all parameters, gradients, and optimizer states in bfloat16, without an extra
        # copy of fp32 weights" (job_config.py); torch AdamW's moments take the parameter's dtype
        StaticConvention(
            "torchtitan-bf16",
            "TorchTitan, FSDP2, training.dtype bfloat16",
            2,
            2,
            4,
            ADAM_STEP_BYTES,
            sharded=KINDS,
            solve_flags="--fsdp",
            source="TorchTitan torchtitan/config/job_config.py (Training.dtype)",
        ),
    )
}


def convention(name: str) -> StaticConvention:
    """The framework convention of that name; InputError("framework") naming the choices otherwise."""
    if name not in CONVENTIONS:
        raise InputError("framework", f"expected one of {', '.join(CONVENTIONS)}, got {name!r}")
    return CONVENTIONS[name]
