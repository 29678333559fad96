"""Predicted against measured: a plan run by torch.distributed.pipelining (gloo, one thread per process:
a process per pipeline rank, times the data- and tensor-parallel degrees), next to what the simulator
said of it from a profile taken beforehand.

Per rank: the step time (median over the steps after warm-up, and its spread), the peak bytes autograd
holds for backward over a step (saved-tensor hooks in the real run), the most bytes allocated during
a step above its lowest point and what is held at its end (torch.profiler's memory events, in two
more steps), the parameter, gradient and optimizer bytes (local shards), the bytes of torch's receive
buffers, FSDP's gathered parameters and whole gradients at each reduce, and the collectives' times;
beside each, the prediction (`sapp_hook.validation.predicted`). The run itself: `sapp_hook.validation.rank`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from basics.errors import InputError, shown
from basics.fields import Fields
from sapp_hook.pipelining.engine_rules import (
    check_no_recompute,
    check_torch_runs,
    no_recompute_reason,
    recompute_runs_under,
)
from sapp_hook.validation.predicted import predictions
from simulator import schedule_kind
from solver import (
    ModelProfile,
    PipelineSpec,
    Plan,
    evaluate_plan,
    even_plan,
    plan_from_dict,
    solve,
)
from solver.calibrate import Run
from solver.vocabulary.profile import FULL, NONE, SELECTIVE
from solver.vocabulary.spec import spec_from_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    """One validation run."""

    model: str
    pipeline_parallel: int
    schedule: str
    micro_batches: int
    chunks: int | None = None
    steps: int = 4
    warmup_steps: int = 1
    micro_batch_size: int = 1
    seq_len: int = 128
    memory_budget_bytes: float = float("inf")
    plan: str = "solve"  # "solve", "even", "even-full" or a plan JSON path
    profile_steps: int = 2
    data_parallel: int = 1
    fsdp: bool = False
    reshard_after_forward: bool = False
    zero_stage: int = 0  # 1: torch's ZeroRedundancyOptimizer
    ddp: bool = False
    tensor_parallel: int = 1
    sequence_parallel: bool = False

    def spec(self) -> PipelineSpec:
        """The run as the plan sees it: torch's engine on gloo, gradients kept between steps."""
        return PipelineSpec(
            pipeline_parallel=self.pipeline_parallel,
            chunks=self.chunks,
            micro_batches=self.micro_batches,
            schedule=self.schedule,
            memory_budget_bytes=self.memory_budget_bytes,
            receive_buffers=True,
            data_parallel=self.data_parallel,
            fsdp=self.fsdp,
            fsdp_reshard_after_forward=self.reshard_after_forward,
            zero_stage=self.zero_stage,
            ddp=self.ddp,
            tensor_parallel=self.tensor_parallel,
            sequence_parallel=self.sequence_parallel,
            collective_backend="gloo",
        )

    @property
    def processes(self) -> int:
        return self.pipeline_parallel * self.data_parallel * self.tensor_parallel


def validate(setup: Setup, *, profile: ModelProfile | None = None, workdir: str | Path | None = None) -> dict[str, Any]:
    """Profile (unless given), plan, run the plan on `setup.processes` processes, and compare. Under a
    schedule that splits the backward, a given profile's recompute modes are left out
    (`sapp_hook.pipelining.engine_rules`)."""
    from sapp_hook.models import load_config

    if profile is None:
        profile = profile_for(setup)  # checks the setup and the model first
    else:
        _check(setup)
        load_config(setup.model)  # a bad model fails here, not in every rank
        _check_profile_of(setup, profile)
        if not recompute_runs_under(setup.schedule):
            profile = profile.with_modes([NONE])
    from sapp_hook.validation.rank import run_ranks

    plan = choose_plan(profile, setup.spec(), setup.plan)
    log.info("validate: running the plan on %d processes, %d steps", setup.processes, setup.warmup_steps + setup.steps)
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        measured = run_ranks(setup, json.loads(json.dumps(plan.to_dict())), Path(folder))
    return compare(setup, profile, plan, measured)


def profile_for(setup: Setup) -> ModelProfile:
    """The setup's model profiled in this process, in the recompute modes its schedule can run; under a
    schedule that splits the backward with tensor parallel, one rank of it measured on its mesh as
    `sapp-hook profile --tensor-parallel` does (`mesh_profile.measures_split_backward`)."""
    from sapp_hook.models import load_config, profile_example

    _check(setup)
    config = load_config(setup.model)
    modes = (NONE, SELECTIVE, FULL) if recompute_runs_under(setup.schedule) else (NONE,)
    log.info(
        "validate: profiling %s (%d x %d tokens per micro-batch)", setup.model, setup.micro_batch_size, setup.seq_len
    )
    profile = profile_example(
        config,
        steps=setup.profile_steps,
        micro_batch_size=setup.micro_batch_size,
        seq_len=setup.seq_len,
        modes=modes,
        model_name=setup.model,
    )
    from sapp_hook.validation.mesh_profile import MeshRun, measures_split_backward, profile_on_mesh

    run = MeshRun(
        model=setup.model,
        tensor_parallel=setup.tensor_parallel,
        sequence_parallel=setup.sequence_parallel,
        micro_batch_size=setup.micro_batch_size,
        seq_len=setup.seq_len,
        steps=setup.profile_steps,
        modes=modes,
    )
    if recompute_runs_under(setup.schedule) or not measures_split_backward(run):
        return profile
    return profile_on_mesh(run, profile)


def _check(setup: Setup) -> None:
    for name in (
        "pipeline_parallel",
        "micro_batches",
        "steps",
        "warmup_steps",
        "micro_batch_size",
        "seq_len",
        "data_parallel",
        "tensor_parallel",
    ):
        value = getattr(setup, name)
        if not isinstance(value, int) or value < 1:
            raise InputError(name, f"expected an integer >= 1, got {value!r}")
    check_torch_runs(setup.schedule, "--schedule")
    _check_layout(setup)
    if setup.plan == "even-full" and not recompute_runs_under(setup.schedule):
        raise InputError("--even-full", no_recompute_reason(setup.schedule))
    if setup.plan not in ("solve", "even", "even-full"):
        _check_plan_file(setup)


def _check_layout(setup: Setup) -> None:
    """What the mesh runner runs: FSDP, ZeRO-1 or DDP over the data-parallel ranks, the Llama family's
    tensor-parallel plan, an untied embedding where either splits it (checked here, before profiling)."""
    from sapp_hook.models import load_config
    from sapp_hook.validation.parallelize import check_layout

    if setup.zero_stage not in (0, 1):
        raise InputError(
            "--zero-stage",
            f"torch runs ZeRO-1 here (ZeroRedundancyOptimizer); for gradients and "
            f"parameters sharded use --fsdp; got {setup.zero_stage}",
        )
    virtual_stages = setup.spec().pipeline_schedule.num_virtual_stages  # the combinations no engine runs
    config = load_config(setup.model)
    layers = config.get_text_config().num_hidden_layers + 2  # the blocks, the embedding, the head
    if virtual_stages > layers:
        raise InputError(
            "--pipeline-parallel",
            f"{setup.pipeline_parallel} x {virtual_stages // setup.pipeline_parallel} (ranks x chunks) make "
            f"{virtual_stages} virtual stages, more than {setup.model}'s {layers} layers (the blocks, the embedding, "
            "the head); use fewer ranks or chunks",
        )
    if setup.processes == setup.pipeline_parallel and not (setup.fsdp or setup.ddp or setup.zero_stage):
        return
    check_layout(config, setup.tensor_parallel, setup.sequence_parallel, setup.fsdp, setup.seq_len)


def _check_plan_file(setup: Setup) -> None:
    """A plan JSON runs as it was planned: its pipeline size, schedule, chunks and micro-batches must be the
    run's, checked before anything is profiled or launched."""
    from solver.vocabulary.load import read_plan_json

    data = read_plan_json(setup.plan, "--plan")
    try:
        planned = spec_from_dict(data["spec"])
    except InputError as exc:
        raise InputError("--plan", f"{setup.plan}: {exc}") from None
    run = PipelineSpec(
        pipeline_parallel=setup.pipeline_parallel,
        chunks=setup.chunks,
        micro_batches=setup.micro_batches,
        schedule=setup.schedule,
    )
    for flag, theirs, ours in (
        ("--pipeline-parallel", planned.pipeline_parallel, run.pipeline_parallel),
        ("--schedule", schedule_kind(planned.schedule).name, schedule_kind(run.schedule).name),
        ("--chunks", planned.num_chunks, run.num_chunks),
        ("--micro-batches", planned.micro_batches, run.micro_batches),
    ):
        if theirs != ours:
            raise InputError("--plan", f"{setup.plan} was planned for {flag} {theirs}; this run has {flag} {ours}")


def _check_profile_of(setup: Setup, profile: ModelProfile) -> None:
    """A given profile must be of the setup's model at its micro-batch shape (where it says so)."""
    if profile.model and profile.model != setup.model:
        raise InputError("profile", f"is a profile of {profile.model!r}; this run trains {setup.model!r}")
    shape = (profile.micro_batch.get("size"), profile.micro_batch.get("sequence"))
    if None not in shape and shape != (setup.micro_batch_size, setup.seq_len):
        raise InputError(
            "profile",
            f"was measured at {shape[0]} x {shape[1]} tokens per micro-batch; this run uses "
            f"{setup.micro_batch_size} x {setup.seq_len} (--micro-batch-size, --seq-len)",
        )


def choose_plan(profile: ModelProfile, spec: PipelineSpec, which: str) -> Plan:
    """The plan to run: solved, the even split, or a plan JSON's split and recompute modes, each predicted
    for the run's layout (`spec`)."""
    if which == "solve":
        return solve(profile, spec, time_limit_s=60)
    if which in ("even", "even-full"):
        return even_plan(profile, spec, FULL if which == "even-full" else NONE)
    from sapp_hook.writeback import layout_from_dict
    from solver.vocabulary.load import read_plan_json

    data = read_plan_json(which, "--plan")
    check_no_recompute(spec.schedule, layout_from_dict(data).body_modes(), "--plan")
    planned = plan_from_dict(profile, data)
    return evaluate_plan(profile, spec, planned.stage_layer_counts, planned.layer_modes)


def compare(setup: Setup, profile: ModelProfile, plan: Plan, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The report: each process's measurements next to the plan's prediction for its pipeline rank (with
    the P2P time measured)."""
    p2p_ms = measured[0]["p2p_ms"]  # measured in the run: the prediction includes it
    spec = dataclasses.replace(plan.spec, p2p_ms=p2p_ms)
    plan = evaluate_plan(profile, spec, plan.stage_layer_counts, plan.layer_modes)
    predicted = predictions(plan, profile, input_bytes=setup.micro_batch_size * setup.seq_len * 8)
    ranks = [_rank_row(rank, row, predicted, plan) for rank, row in enumerate(measured)]
    iteration = max(r["measured_step_ms"] for r in ranks)
    return {
        "model": setup.model,
        "schedule": plan.spec.pipeline_schedule.name,
        "pipeline_parallel": setup.pipeline_parallel,
        "chunks": plan.spec.pipeline_schedule.chunks,
        "micro_batches": setup.micro_batches,
        "data_parallel": setup.data_parallel,
        "fsdp": setup.fsdp,
        "reshard_after_forward": setup.reshard_after_forward,
        "zero_stage": setup.zero_stage,
        "ddp": setup.ddp,
        "tensor_parallel": setup.tensor_parallel,
        "sequence_parallel": setup.sequence_parallel,
        "plan": setup.plan,
        "stage_layer_counts": list(plan.stage_layer_counts),
        "layer_modes": list(plan.layer_modes),
        "p2p_ms": p2p_ms,
        "predicted_iteration_ms": plan.iteration_time_ms,
        "measured_iteration_ms": iteration,
        "iteration_error": _error(plan.iteration_time_ms, iteration),
        "ranks": ranks,
        "losses": next((r["losses"] for r in measured if any(r["losses"])), []),
    }


def _rank_row(rank: int, row: dict[str, Any], predicted: dict[str, list], plan: Plan) -> dict[str, Any]:
    """One process's row of the report: its measurements beside its pipeline rank's prediction."""
    pp_rank = row.get("pp_rank", rank)
    step = statistics.median(row["step_ms"])
    activation = max(row["activation_peak_bytes"])
    static_split = predicted["static_split"][pp_rank]
    measured_static = (
        row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"] + row.get("bucket_bytes", 0)
    )
    schedule = plan.spec.pipeline_schedule
    sharded = [plan.simulation.costs.chunk_costs[pp_rank][chunk].sharded for chunk in range(schedule.chunks)]
    return {
        "rank": rank,
        "pp_rank": pp_rank,
        "dp_rank": row.get("dp_rank", 0),
        "tp_rank": row.get("tp_rank", 0),
        "predicted_step_ms": predicted["step_ms"][pp_rank],
        "measured_step_ms": step,
        "measured_step_spread_ms": max(row["step_ms"]) - min(row["step_ms"]),
        "step_error": _error(predicted["step_ms"][pp_rank], step),
        "predicted_activation_peak_bytes": predicted["activation_peak_bytes"][pp_rank],
        "measured_activation_peak_bytes": activation,
        "activation_error": _error(predicted["activation_peak_bytes"][pp_rank], activation),
        "predicted_peak_bytes": predicted["peak_bytes"][pp_rank],
        "measured_allocated_peak_bytes": row["allocated_peak_bytes"],
        "allocated_error": _error(predicted["peak_bytes"][pp_rank], row["allocated_peak_bytes"]),
        "predicted_step_end_bytes": predicted["step_end_bytes"][pp_rank],
        "measured_step_end_bytes": row["step_end_bytes"],
        "predicted_static_bytes": predicted["static_bytes"][pp_rank] - predicted["receive_buffer_bytes"][pp_rank],
        "measured_static_bytes": measured_static,
        "static_error": _error(
            predicted["static_bytes"][pp_rank] - predicted["receive_buffer_bytes"][pp_rank], measured_static
        ),
        "predicted_receive_buffer_bytes": predicted["receive_buffer_bytes"][pp_rank],
        "measured_receive_buffer_bytes": row["receive_buffer_bytes"],
        "predicted_split": {
            **static_split,
            "receive_buffer_bytes": predicted["receive_buffer_bytes"][pp_rank],
            **predicted["peak_split"][pp_rank],
        },
        "measured_split": {
            "parameter_bytes": row["parameter_bytes"],
            "gradient_bytes": row["gradient_bytes"],
            "optimizer_bytes": row["optimizer_bytes"],
            "bucket_bytes": row.get("bucket_bytes", 0),
            "receive_buffer_bytes": row["receive_buffer_bytes"],
            "activation_peak_bytes": activation,
            "peak_bytes": row["allocated_peak_bytes"],
        },
        "predicted_at_reduce": {
            str(schedule.stage_index(pp_rank, chunk)): [costs.gathered_bytes, costs.gradient_bytes]
            for chunk, costs in enumerate(sharded)
            if costs is not None and costs.gathered_bytes
        },
        "measured_at_reduce": row.get("fsdp_at_reduce", {}),
        "collectives": row.get("collectives", []),
        "layers": row["layers"],
    }


def measured_run(report: object, profile: ModelProfile, where: str = "report") -> Run:
    """A `validate` report (its JSON) as a calibration `Run` of `profile`: the plan it ran, with the P2P
    time it measured, and each rank's measured step time. The profile must be the one the run was
    planned from (`sapp-hook validate --profile-out`)."""
    fields = Fields(report, where)
    try:
        return _measured_run(fields, profile)
    except InputError as exc:
        if exc.field.startswith(where):
            raise
        raise InputError(fields.at(exc.field), exc.detail) from None


def _measured_run(fields: Fields, profile: ModelProfile) -> Run:
    fields.renamed("stages", "pipeline_parallel")
    spec = PipelineSpec(
        pipeline_parallel=fields.integer("pipeline_parallel", required=True, least=1),
        chunks=fields.integer("chunks", required=True, least=1),
        micro_batches=fields.integer("micro_batches", required=True, least=1),
        schedule=fields.text("schedule", required=True),
        p2p_ms=fields.number("p2p_ms", 0.0),
    )
    for name in ("data_parallel", "tensor_parallel"):  # the layer times it fits are those of one pipeline
        if fields.integer(name, 1, least=1) > 1:
            raise InputError(fields.at(name), f"is {fields.raw(name)}: calibrate fits runs of the pipeline alone")
    counts, modes, ranks = (fields.raw(key) for key in ("stage_layer_counts", "layer_modes", "ranks"))
    if not isinstance(ranks, list) or len(ranks) != spec.pipeline_parallel:
        got = f"{len(ranks)} rows" if isinstance(ranks, list) else shown(ranks)
        raise InputError(
            fields.at("ranks"),
            f"expected one row per rank of its {spec.pipeline_parallel} (pipeline_parallel), got {got}",
        )
    steps = tuple(
        Fields(row, f"{fields.at('ranks')}[{i}]").number("measured_step_ms", required=True)
        for i, row in enumerate(ranks)
    )
    if not all(steps):
        raise InputError(fields.at("ranks"), "expected every measured_step_ms > 0")
    if not isinstance(counts, list) or not isinstance(modes, list):
        raise InputError(
            fields.at("stage_layer_counts"), "expected the plan's stage_layer_counts and layer_modes as lists"
        )
    if len(modes) != len(profile.layers):
        raise InputError(
            fields.at("layer_modes"),
            f"{len(modes)} layers, but the profile has {len(profile.layers)}: "
            "calibrate with the profile the run was planned from",
        )
    plan = evaluate_plan(profile, spec, tuple(counts), tuple(modes))  # checks the plan against the profile
    return Run(profile, spec, plan.stage_layer_counts, plan.layer_modes, steps)


def _error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    return abs(predicted - measured) / measured if measured else 0.0
