"""How the job runs: the PipelineSpec a plan is made for."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from basics.deprecation import renamed_attributes, renamed_keywords
from basics.errors import InputError, check_bytes, check_ms, check_non_negative, shown
from basics.fields import Fields
from simulator import build_schedule
from simulator.schedule import Schedule
from simulator.schedules import schedule_kind

ZERO_STAGES = (0, 1, 2, 3)
# How many token copies an expert-parallel rank's experts receive: the even share T k / e, the most a
# dropless router can send (T min(k, E / e)), or a capacity factor over the even share ("capacity:1.25").
EXPERT_TOKENS = ("balanced", "dropless")
DEGREES = ("pipeline_parallel", "data_parallel", "tensor_parallel", "context_parallel", "expert_parallel")
FLAGS = (
    "allow_empty_chunks",
    "receive_buffers",
    "fsdp",
    "fsdp_reshard_after_forward",
    "sequence_parallel",
    "gradients_persist",
    "ddp",
    "ddp_bucket_view",
)
# gloo's all-gather allocates a temporary as large as its output while it runs; NCCL's does not
COLLECTIVE_BACKENDS = ("nccl", "gloo")


@renamed_attributes(stages="pipeline_parallel", stage_constant_bytes="rank_constant_bytes")
@dataclass(frozen=True)
class PipelineSpec:
    """How the job runs: pipeline ranks, chunks (virtual stages) per rank, micro-batches per iteration,
    the schedule, what memory each device has, and the other parallel dimensions.

    The profile's parameter, gradient and optimizer bytes are taken as unsharded; the fields below say
    how data parallelism shards them (`static_split`).

    Attributes:
        pipeline_parallel: pipeline ranks (the deprecated keyword `stages` still names it).
        micro_batches: micro-batches per iteration.
        schedule: the schedule's name, as `simulator.build_schedule` takes it. Default "1F1B".
        chunks: virtual stages per rank; None: the schedule's own.
        memory_budget_bytes: what each device may hold; inf (the default): no limit.
        rank_constant_bytes: added to the profile's `rank_constant_bytes` (held by every rank whatever
            its layers; the deprecated keyword `stage_constant_bytes` still names it).
        p2p_ms: what an activation or gradient takes to reach another rank (P2P).
        action_overhead_ms: added to every forward, backward, input- and weight-gradient action: the
            engine's own cost per action (Python, scheduling), which a calibration measures.
        data_parallel: data-parallel replicas of the pipeline.
        zero_stage: 0-3. With `data_parallel` replicas, ZeRO stage 1 shards optimizer state, 2 also
            gradients, 3 also parameters, each by `data_parallel`, and each layer's parameters are
            gathered whole while its own forward or backward runs. 0 or 3 with `fsdp`.
        allow_empty_chunks: whether a virtual stage may hold no layer.
        microbatch_group_size: Megatron's `microbatch_group_size_per_vp_stage` (Interleaved1F1B only);
            None: the schedule's default.
        receive_buffers: the engine is torch.distributed.pipelining (TorchTitan's too), which holds for
            the whole run, on every virtual stage, one buffer per micro-batch for the input it receives
            (all but the first) and one for the output gradient (all but the last).
        fsdp: torch's FSDP2 on each stage as TorchTitan applies it (a `fully_shard` unit per layer),
            which under torch's pipelining keeps every chunk's gradients whole from its first backward to
            the step's reduce and, unless `fsdp_reshard_after_forward`, its parameters whole from its
            first forward (`solver.parallel.sharding`).
        fsdp_reshard_after_forward: FSDP re-shards each unit after its forward (needs `fsdp`; not with a
            schedule that splits the backward).
        tensor_parallel: tensor-parallel degree.
        sequence_parallel: sequence parallelism beside tensor parallelism (needs `tensor_parallel` > 1).
        context_parallel: context-parallel degree.
        expert_parallel: expert-parallel degree, a divisor of data_parallel x tensor_parallel x
            context_parallel (the ranks it is carved from).
        expert_tokens: the token copies an expert-parallel rank's experts receive: "balanced" (the even
            share T k / e), "dropless" (the most a dropless router can send, T min(k, E / e)) or
            "capacity:FACTOR" (a factor >= 1 over the even share).
        gradients_persist: gradients stay allocated between steps (`zero_grad(set_to_none=False)`);
            else they come within each step.
        ddp: torch's DistributedDataParallel on each stage, whose buckets hold a copy of the gradients
            unless `ddp_bucket_view`. Not with `fsdp`, `zero_stage` >= 2 or a split backward.
        ddp_bucket_view: DDP's `gradient_as_bucket_view=True` (needs `ddp`).
        collective_backend: "nccl" or "gloo" (where FSDP's all-gathers hold a temporary of their
            output's size).

    Raises:
        InputError: naming the field: a degree that is not an integer >= 1, a flag that is not a bool, a
            time or size that is negative, not finite or beyond any real one, a `zero_stage` or
            `collective_backend` outside its choices, a schedule, chunk or micro-batch count
            `build_schedule` refuses, or a combination no engine runs.

    Example:
        >>> spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="Interleaved1F1B")
        >>> spec.num_chunks, spec.pipeline_schedule.describe()
        (2, 'Interleaved1F1B: 4 ranks x 2 chunks, 8 micro-batches')
        >>> PipelineSpec(pipeline_parallel=4, micro_batches=8, fsdp_reshard_after_forward=True)
        Traceback (most recent call last):
        ...
        basics.errors.InputError: fsdp_reshard_after_forward: needs fsdp
    """

    pipeline_parallel: int
    micro_batches: int
    schedule: str = "1F1B"
    chunks: int | None = None  # None: the schedule's own
    memory_budget_bytes: float = math.inf
    rank_constant_bytes: float = 0.0
    p2p_ms: float = 0.0
    action_overhead_ms: float = 0.0
    data_parallel: int = 1
    zero_stage: int = 0
    allow_empty_chunks: bool = False
    microbatch_group_size: int | None = None  # Interleaved1F1B only (Megatron's)
    receive_buffers: bool = False
    fsdp: bool = False
    fsdp_reshard_after_forward: bool = False
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tokens: str = "balanced"
    gradients_persist: bool = True
    ddp: bool = False
    ddp_bucket_view: bool = False
    collective_backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.memory_budget_bytes != math.inf:
            check_non_negative(self.memory_budget_bytes, "memory_budget_bytes")
        check_bytes(self.rank_constant_bytes, "rank_constant_bytes")
        check_ms(self.p2p_ms, "p2p_ms")
        check_ms(self.action_overhead_ms, "action_overhead_ms")
        for name in DEGREES:
            degree = getattr(self, name)
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise InputError(name, f"expected an integer >= 1, got {shown(degree)}")
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise InputError(name, f"expected true or false, got {shown(getattr(self, name))}")
        if self.zero_stage not in ZERO_STAGES:
            raise InputError("zero_stage", f"expected one of {ZERO_STAGES}, got {shown(self.zero_stage)}")
        self._check_layout()
        _ = self.pipeline_schedule  # ranks, chunks, micro-batches and the schedule name are checked here
        self._check_data_parallel()

    def _check_layout(self) -> None:
        """Combinations of the parallel degrees no engine runs."""
        if self.fsdp and self.zero_stage in (1, 2):
            raise InputError(
                "zero_stage",
                f"FSDP shards parameters, gradients and optimizer state; expected 0 or 3 "
                f"with fsdp, got {self.zero_stage}",
            )
        if self.fsdp_reshard_after_forward and not self.fsdp:
            raise InputError("fsdp_reshard_after_forward", "needs fsdp")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise InputError(
                "sequence_parallel", "needs tensor_parallel > 1 (it splits what tensor parallelism leaves whole)"
            )
        carved_from = self.data_parallel * self.tensor_parallel * self.context_parallel
        if self.expert_parallel > 1 and carved_from % self.expert_parallel:
            raise InputError(
                "expert_parallel",
                f"expected a divisor of data_parallel x tensor_parallel x "
                f"context_parallel ({carved_from}): expert-parallel ranks are carved "
                f"from those, got {self.expert_parallel}",
            )
        if self.expert_tokens not in EXPERT_TOKENS and capacity_factor(self.expert_tokens) is None:
            raise InputError(
                "expert_tokens",
                f"expected balanced, dropless or capacity:FACTOR (a number >= 1), got {shown(self.expert_tokens)}",
            )

    def _check_data_parallel(self) -> None:
        """Data-parallel engines and options torch does not run together (the schedule is known here)."""
        if self.collective_backend not in COLLECTIVE_BACKENDS:
            raise InputError(
                "collective_backend",
                f"expected one of {', '.join(COLLECTIVE_BACKENDS)}, got {shown(self.collective_backend)}",
            )
        if self.ddp_bucket_view and not self.ddp:
            raise InputError("ddp_bucket_view", "needs ddp")
        if self.ddp and (self.fsdp or self.zero_stage >= 2):
            raise InputError(
                "ddp", "DDP replicates parameters and gradients; expected no fsdp and zero_stage 0 or 1 with it"
            )
        splits = schedule_kind(self.schedule).splits_backward
        if splits and self.fsdp_reshard_after_forward:
            raise InputError(
                "fsdp_reshard_after_forward",
                f"{self.schedule} splits the backward, and torch's split "
                "backward under FSDP with reshard after forward drops "
                "gradients; use a schedule without a split backward or "
                "keep the parameters gathered",
            )
        if splits and self.ddp:
            raise InputError(
                "ddp",
                f"{self.schedule} splits the backward, which torch's DDP reducer refuses (every "
                "parameter is marked ready twice); use FSDP, or all-reduce the gradients after "
                "the step",
            )

    @cached_property
    def pipeline_schedule(self) -> Schedule:
        """The schedule's per-rank action lists."""
        return build_schedule(
            self.schedule,
            self.pipeline_parallel,
            self.micro_batches,
            self.chunks,
            microbatch_group_size=self.microbatch_group_size,
        )

    @property
    def num_chunks(self) -> int:
        return self.pipeline_schedule.chunks

    def action_overheads_ms(self) -> tuple[float, float, float]:
        """What `action_overhead_ms` adds to a chunk's forward, backward and weight times: the backward
        is one action, or two (input and weight gradients) where the schedule splits it."""
        overhead = self.action_overhead_ms
        splits = schedule_kind(self.schedule).splits_backward
        return overhead, overhead * (2 if splits else 1), overhead

    def static_bytes(
        self,
        parameter_bytes: float,
        gradient_bytes: float,
        optimizer_bytes: float,
        optimizer_tensor_bytes: float = 0.0,
        replicas: int | None = None,
    ) -> float:
        """A layer's resident bytes on one device after data-parallel sharding (`static_split`)."""
        return static_split(
            self, parameter_bytes, gradient_bytes, optimizer_bytes, optimizer_tensor_bytes, replicas
        ).total


PipelineSpec.__init__ = renamed_keywords(stages="pipeline_parallel", stage_constant_bytes="rank_constant_bytes")(  # type: ignore[method-assign]
    PipelineSpec.__init__
)


@dataclass(frozen=True)
class StaticBytes:
    """What one layer holds on one rank for the whole run, per kind, after sharding."""

    parameter: float
    gradient: float
    optimizer: float
    buckets: float = 0.0  # DDP's bucket copies of the gradients

    @property
    def total(self) -> float:
        return self.parameter + self.gradient + self.optimizer + self.buckets

    def __add__(self, other: StaticBytes) -> StaticBytes:
        return StaticBytes(
            self.parameter + other.parameter,
            self.gradient + other.gradient,
            self.optimizer + other.optimizer,
            self.buckets + other.buckets,
        )


def shards_parameters(spec: PipelineSpec) -> bool:
    """Parameters sharded at rest: FSDP, or ZeRO stage 3."""
    return spec.fsdp or spec.zero_stage == 3


def static_split(
    spec: PipelineSpec,
    parameter_bytes: float,
    gradient_bytes: float,
    optimizer_bytes: float,
    optimizer_tensor_bytes: float = 0.0,
    replicas: int | None = None,
) -> StaticBytes:
    """A layer's resident bytes on one rank, per kind, sharded over `replicas` (default: the data-parallel ranks;
    routed experts have their own: `solver.parallel.sharding.layer_static`). FSDP and ZeRO-3 shard every tensor:
    parameters, gradients and the optimizer's per-element state / `data_parallel`, its per-tensor scalars
    (AdamW's step counts) whole. ZeRO-1 and 2 give each rank whole tensors' state (and gradients): the mean,
    O / d (a rank's share is within one tensor's of it). FSDP's gradient shard has its parameter's shape (P / d),
    where the whole gradient it reduces may be larger (a tensor-parallel embedding's, which torch leaves whole:
    `step_gradient_bytes`). Gradients persist between steps where `spec.gradients_persist`
    (`zero_grad(set_to_none=False)`); else they come within a step (`step_gradient_bytes`). DDP keeps bucket
    copies of the gradients for the whole run unless its gradients are views into them (`ddp_bucket_view`)."""
    dp = spec.data_parallel if replicas is None else replicas
    sharded = shards_parameters(spec)
    gradient = gradient_bytes / dp if sharded or spec.zero_stage >= 2 else gradient_bytes
    if spec.fsdp:
        gradient = parameter_bytes / dp
    if spec.ddp and spec.ddp_bucket_view:
        gradient_kept, buckets = 0.0, gradient_bytes  # the gradients are the buckets, kept whatever zero_grad does
    else:
        gradient_kept, buckets = (gradient if spec.gradients_persist else 0.0), (gradient_bytes if spec.ddp else 0.0)
    if sharded:
        optimizer = (optimizer_bytes - optimizer_tensor_bytes) / dp + optimizer_tensor_bytes
    else:
        optimizer = optimizer_bytes / (dp if spec.zero_stage >= 1 else 1)
    return StaticBytes(parameter_bytes / dp if sharded else parameter_bytes, gradient_kept, optimizer, buckets)


def capacity_factor(expert_tokens: object) -> float | None:
    """FACTOR of "capacity:FACTOR" (at least 1), else None."""
    if not isinstance(expert_tokens, str) or not expert_tokens.startswith("capacity:"):
        return None
    try:
        factor = float(expert_tokens.partition(":")[2])
    except ValueError:
        return None
    return factor if math.isfinite(factor) and factor >= 1 else None


def spec_to_dict(spec: PipelineSpec) -> dict[str, object]:
    return {
        "pipeline_parallel": spec.pipeline_parallel,
        "chunks": spec.num_chunks,
        "micro_batches": spec.micro_batches,
        "schedule": spec.pipeline_schedule.name,
        "memory_budget_bytes": None if spec.memory_budget_bytes == math.inf else spec.memory_budget_bytes,
        "rank_constant_bytes": spec.rank_constant_bytes,
        "p2p_ms": spec.p2p_ms,
        "action_overhead_ms": spec.action_overhead_ms,
        "data_parallel": spec.data_parallel,
        "zero_stage": spec.zero_stage,
        "allow_empty_chunks": spec.allow_empty_chunks,
        "microbatch_group_size": spec.microbatch_group_size,
        "receive_buffers": spec.receive_buffers,
        "fsdp": spec.fsdp,
        "fsdp_reshard_after_forward": spec.fsdp_reshard_after_forward,
        "tensor_parallel": spec.tensor_parallel,
        "sequence_parallel": spec.sequence_parallel,
        "context_parallel": spec.context_parallel,
        "expert_parallel": spec.expert_parallel,
        "expert_tokens": spec.expert_tokens,
        "gradients_persist": spec.gradients_persist,
        "ddp": spec.ddp,
        "ddp_bucket_view": spec.ddp_bucket_view,
        "collective_backend": spec.collective_backend,
    }


def spec_from_dict(data: object, where: str = "spec") -> PipelineSpec:
    fields = Fields(data, where)
    budget = fields.raw("memory_budget_bytes")
    flags = {}
    for name in FLAGS:
        flags[name] = fields.raw(name, name == "gradients_persist")
        if not isinstance(flags[name], bool):
            raise InputError(fields.at(name), f"expected true or false, got {flags[name]!r}")
    fields.renamed("stages", "pipeline_parallel")
    fields.renamed("stage_constant_bytes", "rank_constant_bytes")
    values = dict(
        pipeline_parallel=fields.integer("pipeline_parallel", required=True, least=1),
        micro_batches=fields.integer("micro_batches", required=True, least=1),
        schedule=fields.text("schedule", required=True),
        chunks=fields.integer("chunks", least=1),
        memory_budget_bytes=math.inf
        if budget is None
        else check_non_negative(budget, fields.at("memory_budget_bytes")),
        rank_constant_bytes=fields.number("rank_constant_bytes", 0.0),
        p2p_ms=fields.number("p2p_ms", 0.0),
        action_overhead_ms=fields.number("action_overhead_ms", 0.0),
        data_parallel=fields.integer("data_parallel", 1, least=1),
        tensor_parallel=fields.integer("tensor_parallel", 1, least=1),
        context_parallel=fields.integer("context_parallel", 1, least=1),
        expert_parallel=fields.integer("expert_parallel", 1, least=1),
        expert_tokens=fields.text("expert_tokens", "balanced"),
        collective_backend=fields.text("collective_backend", "nccl"),
        zero_stage=fields.integer("zero_stage", 0),
        microbatch_group_size=fields.raw("microbatch_group_size"),
        **flags,
    )
    fields.done()
    try:
        spec = PipelineSpec(**values)
    except InputError as error:
        if error.field not in values:
            raise
        raise InputError(fields.at(error.field), error.detail) from None  # the field as the file names it
    return spec
