"""`autotune`: a training run that balances its own pipeline.

    with sapp_hook.autotune(model, optimizer, pipeline_parallel=4, micro_batches=8, schedule="1F1B",
                            memory_budget="56GB", config="train.yaml", target="mindformers") as tuner:
        for batch in batches:
            ...                      # forward, backward, optimizer step, as always
            tuner.step()

The first steps are profiled (one warm-up step, then `profile_steps` per recompute mode); then the
plan is solved, checked in the simulator, written into the launch config and reported. Training goes
on (`on_plan="continue"`) or the process exits with status 75 (`on_plan="exit"`) so the launcher
restarts the job with the new config. A run whose model, micro-batch shape, parallel settings and
device match a cached plan skips profiling after its first step. Under torchrun every rank profiles
the stage it holds, rank 0 joins its pipeline's profiles (one replica's stages where the job is also
data or tensor parallel: `pipeline_group`, or the pipeline dimension outermost), solves and writes, and
every rank gets the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from basics.deprecation import renamed_keywords
from basics.errors import InputError, check_seconds
from basics.files import atomic_write_text
from basics.units import format_bytes, format_ms, parse_bytes
from profiler import LayerProfiler
from profiler.distributed import gather_profiles
from profiler.measure.build import fingerprint, model_structure
from profiler.parallel import Pipeline, pipeline_of, tensor_parallel_degree
from profiler.recompute import TORCH_MODES
from sapp_hook.hook import job
from sapp_hook.hook.arguments import check_arguments, check_out_dir, environment
from sapp_hook.hook.cache import PlanCache, cache_key
from sapp_hook.hook.check import RankCheck, StepMeasure, check_lines, compare
from sapp_hook.hook.relaunch import ENVIRONMENT, ON_PLAN, REPLAN_EXIT_CODE, installed_version
from sapp_hook.pipelining.engine_rules import no_recompute_reason, recompute_runs_under
from sapp_hook.pipelining.stages import loss_tail
from sapp_hook.report import against_even, plan_report
from sapp_hook.validation.predicted import predictions
from sapp_hook.writeback import Layout, WriteBack, check_destination, check_job, layout_from_dict, write_config
from solver import ModelProfile, PipelineSpec, Plan, plan_from_dict, solve
from solver.parallel.model_parallel import prediction_caveat
from solver.vocabulary.profile import NONE, Mesh
from solver.vocabulary.spec import spec_to_dict

log = logging.getLogger(__name__)
# The plan runs on torch.distributed.pipelining (this package's `apply`, TorchTitan), whose receive
# buffers it counts, unless it is written for these.
ENGINES_WITHOUT_RECEIVE_BUFFERS = ("mindformers", "megatron")


@dataclass
class TuneResult:
    """What autotune decided. `plan` (with its simulation) and `profile` exist on the rank that solved."""

    plan_data: dict[str, Any]
    layout: Layout
    from_cache: bool
    plan: Plan | None = None
    profile: ModelProfile | None = None
    writeback: WriteBack | None = None
    report: str = ""
    check: list[RankCheck] | None = None  # a reused plan's first step, measured against it (rank 0)


class AutoTuner:
    """Profiles the first steps, then solves, simulates, writes the config and reports. See the module doc.

    A context manager around the training loop (`step()` after each step) or a decorator of the step function.
    `sapp-hook run`'s SAPP_HOOK_CONFIG, _TARGET, _ON_PLAN, _CACHE_DIR, _FORCE override the arguments they name.

    Args:
        model: the model being trained (this rank's part of it under torchrun).
        optimizer: its optimizer, whose state is measured per layer; None: no optimizer state.
        pipeline_parallel: pipeline ranks to plan for (the deprecated keyword `stages` still names it).
        micro_batches: micro-batches per iteration.
        schedule: the schedule's name, as torch.distributed.pipelining gives it. Default "1F1B".
        chunks: virtual stages per rank; None: the schedule's own.
        memory_budget: what each device may hold: a size ("56GB", "52GiB") or bytes; None: no limit.
        config: the launch config to write the plan into, with `target`; None: nothing written.
        target: "mindformers", "megatron", "torchtitan" or "plan" (`write_config`). The plan counts
            torch's receive buffers (`PipelineSpec.receive_buffers`) unless it is "mindformers" or "megatron".
        profile_steps: measured steps per recompute mode (>= 1).
        warmup_steps: steps before those, untimed (>= 1).
        modes: recompute modes to profile and plan, "none" among them (only "none" under a split backward).
        layers: module-name patterns of the blocks; None: found in the model.
        on_plan: "continue" (training goes on) or "exit" (`step()` raises SystemExit(75) once the plan is
            written, for the launcher to restart the job with it).
        cache_dir: the folder of cached plans; None: $XDG_CACHE_HOME/sapp-hook or ~/.cache/sapp-hook.
        force: profile and solve again even where a cached plan matches.
        time_limit_s: the solver's time limit, seconds.
        data_parallel: data-parallel replicas of the pipeline (this and the next 14: `PipelineSpec`'s fields).
        zero_stage: ZeRO stage 0-3: 1 shards optimizer state over the replicas, 2 also gradients, 3 also parameters.
        fsdp: torch's FSDP2 on each stage, a `fully_shard` unit per layer (TorchTitan's way).
        fsdp_reshard_after_forward: FSDP re-shards each unit after its forward.
        gradients_persist: gradients stay allocated between steps (`zero_grad(set_to_none=False)`).
        ddp: torch's DistributedDataParallel on each stage.
        ddp_bucket_view: DDP's `gradient_as_bucket_view=True` (its buckets are the gradients).
        tensor_parallel: tensor-parallel degree: the ranks the model's DTensor parameters are split over.
        sequence_parallel: sequence parallelism beside tensor parallelism.
        context_parallel: context-parallel degree.
        expert_parallel: expert-parallel degree.
        expert_tokens: token copies an expert-parallel rank receives: "balanced", "dropless", "capacity:F".
        collective_backend: "nccl" or "gloo".
        p2p_ms: what an activation or gradient takes to reach another rank, ms.
        action_overhead_ms: the engine's own cost per action, ms, added to every action.
        pipeline_group: this rank's pipeline's ProcessGroup (or 1-D DeviceMesh); None: pipeline dimension outermost.
        out_dir: a folder for plan.json, report.txt, profile.json, plan.png (with matplotlib); None: none.

    Attributes:
        spec: the `PipelineSpec` planned for.
        profiler: the `LayerProfiler` measuring the steps.
        result: the `TuneResult` once decided (`plan_data`, `layout`, `from_cache`, `report`, and on the
            rank that solved `plan` and `profile`); None before. `done` says whether it is there.

    Raises:
        InputError: naming the argument (or the environment variable that set it): a wrong type or value,
            `config` or `target` without the other, a target or config that cannot be written, a config that cannot
            take any plan for this job (`check_job`), a model or optimizer already sharded.

    Example::

        with sapp_hook.autotune(model, optimizer, pipeline_parallel=4, micro_batches=8,
                                memory_budget="56GB", config="train.yaml", target="mindformers") as tuner:
            for batch in batches:
                train_step(batch)
                tuner.step()
        print(tuner.result.report)
    """

    @renamed_keywords(stages="pipeline_parallel")
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        pipeline_parallel: int,
        micro_batches: int,
        schedule: str = "1F1B",
        chunks: int | None = None,
        memory_budget: str | float | None = None,
        config: str | Path | None = None,
        target: str | None = None,
        profile_steps: int = 2,
        warmup_steps: int = 1,
        modes: Sequence[str] = TORCH_MODES,
        layers: Sequence[str] | None = None,
        on_plan: str = "continue",
        cache_dir: str | Path | None = None,
        force: bool = False,
        time_limit_s: float = 60.0,
        data_parallel: int = 1,
        zero_stage: int = 0,
        fsdp: bool = False,
        fsdp_reshard_after_forward: bool = False,
        gradients_persist: bool = True,
        ddp: bool = False,
        ddp_bucket_view: bool = False,
        tensor_parallel: int = 1,
        sequence_parallel: bool = False,
        context_parallel: int = 1,
        expert_parallel: int = 1,
        expert_tokens: str = "balanced",
        collective_backend: str = "nccl",
        pipeline_group: Any = None,
        p2p_ms: float = 0.0,
        action_overhead_ms: float = 0.0,
        out_dir: str | Path | None = None,
    ) -> None:
        check_arguments(
            model,
            optimizer,
            schedule=schedule,
            memory_budget=memory_budget,
            config=config,
            target=target,
            profile_steps=profile_steps,
            warmup_steps=warmup_steps,
            modes=modes,
            layers=layers,
            cache_dir=cache_dir,
            force=force,
            out_dir=out_dir,
        )
        given = environment()  # `sapp-hook run`'s settings override the script's; their errors name them
        field = {name: ENVIRONMENT[name] if name in given else name for name in ENVIRONMENT}
        config, target = given.get("config", config), given.get("target", target)
        on_plan, cache_dir = given.get("on_plan", on_plan), given.get("cache_dir", cache_dir)
        force = force or given.get("force") == "1"
        if on_plan not in ON_PLAN:
            raise InputError(field["on_plan"], f"expected one of {', '.join(ON_PLAN)}, got {on_plan!r}")
        if (config is None) != (target is None):
            missing, other = ("target", "config") if target is None else ("config", "target")
            raise InputError(
                ENVIRONMENT[missing] if other in given else missing,
                f"give config and target together ({field[other]} is set)",
            )
        check_seconds(time_limit_s, "time_limit_s")
        budget = parse_bytes(memory_budget, "memory_budget") if isinstance(memory_budget, str) else memory_budget
        self.spec = PipelineSpec(
            pipeline_parallel=pipeline_parallel,
            micro_batches=micro_batches,
            schedule=schedule,
            chunks=chunks,
            memory_budget_bytes=float("inf") if budget is None else budget,
            data_parallel=data_parallel,
            zero_stage=zero_stage,
            p2p_ms=p2p_ms,
            action_overhead_ms=action_overhead_ms,
            receive_buffers=target not in ENGINES_WITHOUT_RECEIVE_BUFFERS,
            fsdp=fsdp,
            fsdp_reshard_after_forward=fsdp_reshard_after_forward,
            gradients_persist=gradients_persist,
            ddp=ddp,
            ddp_bucket_view=ddp_bucket_view,
            tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel,
            context_parallel=context_parallel,
            expert_parallel=expert_parallel,
            expert_tokens=expert_tokens,
            collective_backend=collective_backend,
        )
        self.model, self.optimizer = model, optimizer
        self.config, self.target = (Path(config) if config else None), target
        self.on_plan, self.force, self.time_limit_s = on_plan, force, time_limit_s
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir is not None:
            check_out_dir(self.out_dir)
        try:
            self.cache = PlanCache(cache_dir)
        except InputError as exc:
            raise InputError(field["cache_dir"], exc.detail) from None
        if not recompute_runs_under(schedule) and set(modes) != {NONE}:
            modes = (NONE,)
            log.info("sapp-hook: no recompute is profiled or planned: %s", no_recompute_reason(schedule))
        self.measured_tensor_parallel = tensor_parallel_degree(model, optimizer)
        if self.measured_tensor_parallel > 1 and self.measured_tensor_parallel != tensor_parallel:
            raise InputError(
                "tensor_parallel",
                f"the model's parameters are split over {self.measured_tensor_parallel} ranks (DTensor): "
                f"expected {self.measured_tensor_parallel}, got {tensor_parallel!r}",
            )
        self._pipeline_group = pipeline_group
        self._pipeline: Pipeline | None = None
        self._solving_ranks: tuple[int, ...] = ()
        self.profiler = LayerProfiler(
            model,
            optimizer,
            steps=profile_steps,
            warmup_steps=warmup_steps,
            modes=modes,
            layers=layers,
            tail=loss_tail(model),
            on_step=self._progress,
        )
        if target is not None:  # now, not after the profiling steps
            check_destination(target, config, target_field=field["target"], config_field=field["config"])
        self._config_field = field["config"]  # the argument or the environment variable that gave the config
        if job.distributed() or os.environ.get("WORLD_SIZE", "1") == "1":  # not a torchrun rank before its group
            self._check_job()
        self.result: TuneResult | None = None
        self._measure: StepMeasure | None = None  # the first step under a reused plan, measured
        self._cached_profile: object = None
        self._key: str | None = None
        self._key_parts: dict[str, object] = {}

    # -- the user's side ---------------------------------------------------------------------------

    def __enter__(self) -> AutoTuner:
        if self.result is None:
            self.profiler.attach()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.profiler.detach()  # a crash or Ctrl-C while profiling: hooks gone, config untouched

    def step(self) -> None:
        """Call once after each training step: profiles it, and after the last profiled step (or the
        warm-up, where a cached plan matches) decides, writes and reports; nothing once `result` is set.

        Raises:
            RuntimeError: outside the profiling window (before `with` or after it ended).
            InputError: no plan fits (naming `memory_budget`); the config is left untouched.
            SystemExit: with status 75 once the plan is written, where `on_plan` is "exit".
        """
        if self._measure is not None:
            self._check_plan(self._measure.stop())
            return
        if self.result is not None:
            return
        if not self.profiler.attached:
            raise RuntimeError(
                "autotune's step() outside its profiling window: call it inside `with sapp_hook.autotune(...) "
                "as tuner:` (or decorate the step function with the tuner), before the block ends"
            )
        self.profiler.step()
        if self.profiler.steps_done == self.profiler.warmup_steps and self._cached():
            return
        if self.profiler.done:
            self._plan()

    def __call__(self, train_step: Callable[..., Any]) -> Callable[..., Any]:
        """As a decorator of a per-step training function: profiling starts with its first call, and
        `step()` runs after each.

        Example::

            @sapp_hook.autotune(model, optimizer, pipeline_parallel=2, micro_batches=4)
            def train_step(batch): ...
        """

        @functools.wraps(train_step)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.result is None and not self.profiler.steps_done:
                self.profiler.attach()
            try:
                value = train_step(*args, **kwargs)
            except BaseException:
                self.profiler.detach()
                raise
            self.step()
            return value

        return wrapped

    @property
    def done(self) -> bool:
        return self.result is not None

    def _check_job(self) -> None:
        """Refuse, on every rank, a job the plan cannot take: its pipeline's ranks, and a config for another
        layer count (each rank of a pipeline holds its stage's blocks, as the profiles join)."""
        pipeline = self.pipeline
        counts = job.everyone(str(len(self.profiler.blocks)).encode())
        if self.target is not None:
            blocks = sum(int(counts[rank]) for rank in pipeline.ranks)
            check_job(self.target, self.config, self.spec, blocks, config_field=self._config_field)

    @property
    def pipeline(self) -> Pipeline:
        """This rank's pipeline (found once the job's process group exists); rank 0's pipeline is profiled."""
        if self._pipeline is None:
            spec = self.spec
            replicas = spec.data_parallel * spec.tensor_parallel * spec.context_parallel
            self._pipeline = pipeline_of(self._pipeline_group, spec.pipeline_parallel, replicas)
            self._solving_ranks = tuple(json.loads(job.from_rank0(json.dumps(self._pipeline.ranks).encode())))
        return self._pipeline

    # -- deciding ----------------------------------------------------------------------------------

    def _cached(self) -> bool:
        """After the warm-up step: reuse a cached plan for this exact model and setting, if there is one."""
        recorder = self.profiler.recorder
        local = {
            "structure": model_structure(self.model, self.profiler.blocks),
            "input_shape": list(recorder.input_shape or ()),
        }
        parts = [json.loads(part) for part in job.everyone(json.dumps(local).encode())]
        pipeline = [parts[rank] for rank in self._solving_ranks] if job.distributed() else parts
        device = self.profiler.device
        self._key_parts = {
            # the model, whatever the split: a plan written for it must find itself again after the relaunch
            "model": fingerprint([part["structure"] for part in pipeline]),
            "input_shapes": [part["input_shape"] for part in pipeline],
            "spec": spec_to_dict(self.spec),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "dtype": str(next(self.model.parameters()).dtype),
            "modes": list(self.profiler.modes),
            # another release may measure or plan differently (its memory model gains what runs showed)
            "sapp_hook": installed_version(),
        }
        self._key = cache_key(self._key_parts)
        entry = None if self.force or job.rank() else self.cache.load(self._key)
        if entry is not None and not self._reusable(entry["plan"]):
            entry = None
        shared = job.from_rank0(json.dumps(entry["plan"]).encode() if entry else b"")
        if not shared:
            log.info("sapp-hook: no cached plan for this model and setting (key %s); profiling", self._key)
            return False
        self.profiler.detach()
        plan_data = json.loads(shared)
        log.info("sapp-hook: reusing the cached plan %s", self.cache.path(self._key))
        self._finish(plan_data, from_cache=True, plan=None, profile=None)
        # training goes on under the plan: its next step is measured against what the plan predicted
        self._cached_profile = entry.get("profile") if entry else None
        self._measure = StepMeasure(self.model)
        self._measure.start()
        return True

    def _check_plan(self, measured: dict[str, float]) -> None:
        """The first step under a reused plan against the plan's prediction, on rank 0 for every pipeline rank:
        said in the log and the report, kept in `result.check`."""
        self._measure = None
        ranks = [json.loads(part) for part in job.everyone(json.dumps(measured).encode())]
        if job.rank() != 0 or not isinstance(self._cached_profile, dict):
            return
        pipeline = [ranks[rank] for rank in self._solving_ranks] if job.distributed() else ranks
        profile = ModelProfile.from_dict(self._cached_profile)
        plan = plan_from_dict(profile, self.result.plan_data)
        predicted = predictions(plan, profile)
        checks = compare(pipeline, predicted["activation_peak_bytes"], predicted["step_ms"])
        self.result.check = checks
        lines = check_lines(checks)
        drifted = [check for check in checks if check.drifted]
        for line in lines:
            (log.warning if drifted else log.info)("sapp-hook: under the plan, %s", line)
        if self.out_dir is not None:
            atomic_write_text(
                self.out_dir / "check.json", json.dumps({"ranks": [c.to_dict() for c in checks]}, indent=1) + "\n"
            )

    def _reusable(self, plan_data: dict[str, Any]) -> bool:
        """Whether a cached plan reads back for this run's settings (the cache may be older than this
        version, or edited): one that does not is planned again, not a crash."""
        try:
            layout = layout_from_dict(plan_data)
        except InputError as exc:
            log.warning("sapp-hook: ignoring a cached plan that does not read back (%s); planning again", exc)
            return False
        if layout.pipeline_parallel != self.spec.pipeline_parallel or layout.micro_batches != self.spec.micro_batches:
            log.warning("sapp-hook: ignoring a cached plan made for other parallel settings; planning again")
            return False
        return True

    def _plan(self) -> None:
        local = self.profiler.profile()
        if self.measured_tensor_parallel > 1:  # measured on one rank of it: the solver divides no further
            mesh = Mesh(tensor_parallel=self.measured_tensor_parallel, sequence_parallel=self.spec.sequence_parallel)
            local = dataclasses.replace(local, mesh=mesh)
        if job.distributed():  # the stages of rank 0's pipeline, joined there
            profile = gather_profiles([(self.pipeline.rank, local)] if job.rank() in self._solving_ranks else [])
        else:
            profile = local
        error = ""
        plan = None
        if profile is not None:  # the rank that solves
            try:
                log.info("sapp-hook: solving %s ...", self.spec.pipeline_schedule.name)
                plan = solve(profile, self.spec, time_limit_s=self.time_limit_s)
                caveat = prediction_caveat(profile, self.spec)
                if caveat is not None:
                    log.warning("sapp-hook: %s", caveat)
            except InputError as exc:
                error = str(exc)
        payload = json.dumps({"error": error} if error else plan.to_dict()).encode() if profile is not None else b""
        plan_data = json.loads(job.from_rank0(payload))
        if "error" in plan_data:
            raise InputError("memory_budget", f"sapp-hook found no plan; the config is untouched. {plan_data['error']}")
        if plan is not None:
            self.cache.store(self._key or "unkeyed", self._key_parts, plan_data, profile.to_dict())
        self._finish(plan_data, from_cache=False, plan=plan, profile=profile)

    def _finish(
        self, plan_data: dict[str, Any], *, from_cache: bool, plan: Plan | None, profile: ModelProfile | None
    ) -> None:
        layout = layout_from_dict(plan_data)
        result = TuneResult(plan_data=plan_data, layout=layout, from_cache=from_cache, plan=plan, profile=profile)
        if job.rank() == 0:
            if self.config is not None:
                result.writeback = write_config(self.target, self.config, layout)
            result.report = self._report(result)
            log.info("%s", result.report)
            if self.out_dir is not None:
                self._write_outputs(result)
        self.result = result
        if self.on_plan != "exit":
            return
        # a config that already said the plan was not written: the job runs it now, so it trains on
        restart = (
            job.from_rank0(b"0" if result.writeback is not None and not result.writeback.written else b"1") == b"1"
        )
        planned_file = os.environ.get(ENVIRONMENT["planned_file"])
        if planned_file and job.rank() == 0:
            written = None if self.config is None else str(self.config)
            atomic_write_text(Path(planned_file), json.dumps({"config": written, "restart": restart}) + "\n")
        if not restart:
            log.warning("sapp-hook: %s already says the plan (nothing written); training goes on with it", self.config)
            return
        # torchrun stops every worker once one exits: none may leave before rank 0 has written
        job.everyone(b"")
        where = f" into {self.config}" if self.config else ""
        log.warning(
            "sapp-hook: wrote the plan%s; exiting with status %d so the launcher restarts with it",
            where,
            REPLAN_EXIT_CODE,
        )
        raise SystemExit(REPLAN_EXIT_CODE)

    def _report(self, result: TuneResult) -> str:
        lines = []
        if result.plan is not None and result.profile is not None:
            lines.append(plan_report(result.plan))
            lines.append(against_even(result.plan, result.profile)[0])
        else:
            data = result.plan_data
            lines.append(
                f"cached plan: iteration time {format_ms(data['iteration_time'])} ms, peak memory per rank "
                + ", ".join(format_bytes(b) for b in data["rank_peak_memory_bytes"])
            )
        if result.writeback is not None:
            lines += [f"wrote {path}" for path in result.writeback.written]
            lines += [f"note: {note}" for note in result.writeback.notes]
        return "\n".join(lines)

    def _write_outputs(self, result: TuneResult) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out_dir / "plan.json", json.dumps(result.plan_data, indent=1) + "\n")
        atomic_write_text(self.out_dir / "report.txt", result.report + "\n")
        if result.profile is not None:
            result.profile.save(self.out_dir / "profile.json")
        if result.plan is not None and result.plan.simulation is not None:
            try:
                from simulator.plot import draw_gantt

                draw_gantt(result.plan.simulation, self.out_dir / "plan.png")
                log.info("sapp-hook: the plan's schedule and memory: %s", self.out_dir / "plan.png")
            except ImportError:
                log.info("sapp-hook: matplotlib is not installed; no chart")

    def _progress(self, done: int, total: int, mode: str) -> None:
        if job.rank() == 0:
            log.info("sapp-hook: profiling step %d/%d done (%s)", done, total, self.profiler.describe_step(done - 1))


def autotune(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any) -> AutoTuner:
    """An `AutoTuner` for `model`: a context manager around the training loop (call `step()` after each
    step), or a decorator of the per-step training function.

    Args:
        model: the model being trained.
        optimizer: its optimizer; None: no optimizer state.
        **options: `AutoTuner`'s keyword arguments (`pipeline_parallel` and `micro_batches` required).

    Returns:
        The `AutoTuner` (examples: its docstring, and the module's).

    Raises:
        InputError: as `AutoTuner` does, naming the argument.
    """
    return AutoTuner(model, optimizer, **options)
