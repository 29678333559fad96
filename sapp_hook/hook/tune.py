"""`autotune`: a training run that balances its own pipeline.

    with sapp_hook.autotune(model, optimizer, pipeline_parallel=4, micro_batches=8, schedule="1F1B",
                            memory_budget="56GB", config="train.yaml", target="mindformers") as tuner:
        for batch in batches:
            ...                      # forward, backward, optimizer step, as always
            tuner.step()

The first steps are profiled (one warm-up step, then `profile_steps` per recompute mode); then the
plan is solved, checked in the simulator, written into the launch config and reported. Training goes
on (`on_plan="continue"`) or the process exits (`on_plan="exit"`: status 75, or 0 under `sapp-hook run`) so
the launcher restarts the job with the new config; where the config already said the plan, training goes on.
A run whose model, micro-batch shape, parallel settings and device match a cached plan skips profiling after
its warm-up steps. Under torchrun every rank profiles
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
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from basics.deprecation import renamed_keywords
from basics.errors import InputError, check_seconds
from basics.files import atomic_write_text
from basics.units import parse_bytes
from profiler import LayerProfiler
from profiler.distributed import gather_profiles
from profiler.measure.build import model_structure
from profiler.parallel import Pipeline, pipeline_of, tensor_parallel_degree
from profiler.recompute import TORCH_MODES
from sapp_hook.hook import job
from sapp_hook.hook.arguments import check_arguments, check_layout, check_out_dir, settings
from sapp_hook.hook.cache import PlanCache, cache_key
from sapp_hook.hook.check import StepMeasure, verdict
from sapp_hook.hook.console import Console
from sapp_hook.hook.decide import plan_for, runnable_options
from sapp_hook.hook.outputs import report_text, solve_command, summary, write_outputs, written_lines
from sapp_hook.hook.relaunch import ENVIRONMENT, REPLAN_EXIT_CODE
from sapp_hook.hook.result import TuneResult
from sapp_hook.hook.reuse import job_key, unusable
from sapp_hook.hook.watch import EndWatch
from sapp_hook.pipelining.engine_rules import no_recompute_reason, recompute_runs_under
from sapp_hook.pipelining.stages import loss_tail
from sapp_hook.writeback import check_destination, layout_from_dict, runnable_schedules, write_config
from solver import InfeasibleError, ModelProfile, PipelineSpec, Plan
from solver.compare import candidates
from solver.vocabulary.profile import NONE, Mesh

log = logging.getLogger(__name__)
# The plan runs on torch.distributed.pipelining (this package's `apply`, TorchTitan), whose receive
# buffers it counts, unless it is written for these.
ENGINES_WITHOUT_RECEIVE_BUFFERS = ("mindformers", "megatron")


class AutoTuner:
    """Profiles the first steps, then solves, simulates, writes the config and reports. See the module doc.

    A context manager around the training loop (`step()` after each step) or a decorator of the step function.
    `sapp-hook run`'s SAPP_HOOK_CONFIG, _TARGET, _ON_PLAN, _CACHE_DIR, _FORCE override the arguments they name.

    Args:
        model: the model being trained (this rank's part of it under torchrun).
        optimizer: its optimizer, whose state is measured per layer; None: no optimizer state.
        pipeline_parallel: pipeline ranks to plan for (the deprecated keyword `stages` still names it).
        micro_batches: micro-batches per iteration.
        schedule: the schedule's name, as torch.distributed.pipelining gives it (default "1F1B"), or "auto": the
            fastest of those the target runs (`runnable_schedules`). Another predicted faster is said either way.
        chunks: virtual stages per rank; None: the schedule's own.
        memory_budget: what each device may hold: a size ("56GB", "52GiB") or bytes; None: no limit.
        config: the launch config to write the plan into, with `target`; None: nothing written.
        target: "mindformers", "megatron", "torchtitan" or "plan" (`write_config`). The plan counts
            torch's receive buffers (`PipelineSpec.receive_buffers`) unless it is "mindformers" or "megatron".
        profile_steps: measured steps per recompute mode (>= 1).
        warmup_steps: steps before those, untimed (>= 1).
        modes: recompute modes to profile and plan, "none" among them (only "none" under a split backward).
        layers: module-name patterns of the blocks; None: found in the model.
        mtp_layers: module-name patterns of multi-token-prediction modules, planned as layers of kind "body:mtp"
            after the blocks, never recomputed; None: the outermost modules named `mtp*`; (): none.
        on_plan: "continue" (training goes on) or "exit" (`step()` raises SystemExit once the plan is written,
            for the launcher to restart the job with it: status 75, 0 under `sapp-hook run`; none where the
            config already said the plan).
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
        quiet: say nothing on stderr (the few lines from rank 0 of what was planned and written); the log and
            `result.report` still have it all.

    Attributes:
        spec: the `PipelineSpec` planned for.
        profiler: the `LayerProfiler` measuring the steps.
        result: the `TuneResult` once decided (`plan_data`, `layout`, `from_cache`, `report`, and on the
            rank that solved `plan` and `profile`); None before. While a drift is profiled again, the plan in
            use (`done` is False until the new decision).

    Raises:
        InputError: naming the argument (or the environment variable that set it): a wrong type or value,
            `config` or `target` without the other, a target or config that cannot be written, a config that cannot
            take any plan for this job (`check_job`), a model or optimizer already sharded, a tensor_parallel or
            expert_parallel the model's sizes cannot be split by (`check_layout`).

    Example::

        with sapp_hook.autotune(model, optimizer, pipeline_parallel=4, micro_batches=8,
                                memory_budget="56GB", config="train.yaml", target="mindformers") as tuner:
            for batch in batches:
                train_step(batch)
                tuner.step()
        report = tuner.result.report  # the plan, the even split beside it, what was written
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
        mtp_layers: Sequence[str] | None = None,
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
        quiet: bool = False,
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
            mtp_layers=mtp_layers,
            cache_dir=cache_dir,
            force=force,
            out_dir=out_dir,
        )
        # `sapp-hook run`'s settings override the script's; their errors name them
        field, (config, target, on_plan, cache_dir, force) = settings(config, target, on_plan, cache_dir, force)
        check_seconds(time_limit_s, "time_limit_s")
        budget = parse_bytes(memory_budget, "memory_budget") if isinstance(memory_budget, str) else memory_budget
        self.auto = schedule == "auto"  # the fastest the target runs, chosen once profiled
        if self.auto and chunks is not None:
            raise InputError("chunks", "schedule='auto' chooses the chunks with the schedule: leave chunks unset")
        self._options = candidates(runnable_schedules(target))  # the schedules compared (auto: chosen among)
        self.spec = PipelineSpec(
            pipeline_parallel=pipeline_parallel,
            micro_batches=micro_batches,
            schedule=runnable_schedules(target)[0] if self.auto else schedule,
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
        self.console = Console(quiet)
        self.config, self.target = (Path(config) if config else None), target
        self.on_plan, self.force, self.time_limit_s = on_plan, force, time_limit_s
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir is not None:
            check_out_dir(self.out_dir)
        try:
            self.cache = PlanCache(cache_dir)
        except InputError as exc:
            raise InputError(field["cache_dir"], exc.detail) from None
        if not self.auto and not recompute_runs_under(schedule) and set(modes) != {NONE}:
            modes = (NONE,)
            log.info("sapp-hook: no recompute is profiled or planned: %s", no_recompute_reason(schedule))
        self.measured_tensor_parallel = tensor_parallel_degree(model, optimizer)
        if self.measured_tensor_parallel > 1 and self.measured_tensor_parallel != tensor_parallel:
            raise InputError(
                "tensor_parallel",
                f"the model's parameters are split over {self.measured_tensor_parallel} ranks (DTensor): "
                f"expected {self.measured_tensor_parallel}, got {tensor_parallel!r}",
            )
        check_layout(model, self.spec, self.measured_tensor_parallel)
        self._pipeline_group = pipeline_group
        self._pipeline: Pipeline | None = None
        self._solving_ranks: tuple[int, ...] = ()
        self._profiling = dict(steps=profile_steps, warmup_steps=warmup_steps, modes=modes)
        self._profiling |= dict(layers=layers, mtp_layers=mtp_layers)
        self.profiler = self._new_profiler()
        if target is not None:  # now, not after the profiling steps
            check_destination(target, config, target_field=field["target"], config_field=field["config"])
        self._config_field = field["config"]  # the argument or the environment variable that gave the config
        self._watch = EndWatch(self.console.say, lambda: (self.profiler.steps_done, self.profiler.total_steps))
        if job.distributed() or job.launched() == 1:  # not a torchrun rank before its group
            self._check_job()
        self.result: TuneResult | None = None
        self._replanned = False  # profiled again because a reused plan's first step drifted from it
        self._cached_entry: dict[str, Any] | None = None
        self._measure: StepMeasure | None = None  # the first step under a reused plan, measured
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
        self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        """The training is over (`error`: it stopped on that): the tuner's hooks are removed, and where it had
        not decided, the job's end before the plan is said now (nothing after an error, which says why). Called
        by the `with` block's end, the decorator and the framework integrations; a second call does nothing."""
        self.profiler.detach()  # a crash or Ctrl-C while profiling: hooks gone, config untouched
        if self._measure is not None:
            self._measure.cancel()
            self._measure = None
        if error is None:
            self._watch.end()
        else:
            self._watch.stop()

    def _first_step(self) -> None:
        """After the first step of the job: every rank is one of a job the hook can coordinate, the job's check
        made where its process group came after the tuner, and a job that ends too soon is said at exit."""
        job.check_coordinated()
        if self._pipeline is None:
            self._check_job()
        self._watch.start()

    def _new_profiler(self) -> LayerProfiler:
        part = job.launched() > 1  # a pipeline rank's part, which a plan may leave without a block
        return LayerProfiler(
            self.model, self.optimizer, **self._profiling, part=part, tail=loss_tail(self.model), on_step=self._progress
        )

    def step(self) -> None:
        """Call once after each training step: profiles it, and after the last profiled step (or the
        warm-up, where a cached plan matches) decides, writes and reports; nothing once `result` is set.

        Raises:
            RuntimeError: outside the profiling window (before `with` or after it ended), or called twice in one
                training step (no forward, or no optimizer step, since the last call).
            InputError: no plan fits (naming `memory_budget`), or the profile cannot be split as the layout says
                (naming that argument); the config is left untouched.
            SystemExit: once the plan is written where `on_plan` is "exit" (as that argument says).
        """
        if self._measure is not None:
            self._check_plan(self._measure.stop())
            return
        if self.done:
            return
        if not self.profiler.attached:
            raise RuntimeError(
                "autotune's step() outside its profiling window: call it inside `with sapp_hook.autotune(...) "
                "as tuner:` (or decorate the step function with the tuner), before the block ends"
            )
        try:
            if self.profiler.steps_done == 0:
                self._first_step()
            self.profiler.step()
            if self.profiler.steps_done == self.profiler.warmup_steps and not self._replanned and self._cached():
                return
            if self.profiler.done:
                self._plan()
        except Exception:
            self._watch.stop()  # the error says why nothing was planned; no second word at exit
            raise

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
            except BaseException as error:
                self.close(error)
                raise
            self.step()
            return value

        return wrapped

    @property
    def done(self) -> bool:
        """Whether the tuner has decided: a plan in `result`, and no profiling for a new one under way."""
        return self.result is not None and not self._replanned

    def _check_job(self) -> None:
        """Refuse, on every rank, a job the plan cannot take: its pipeline's ranks, and a config for another
        layer count (each rank of a pipeline holds its stage's blocks, as the profiles join)."""
        pipeline = self.pipeline
        counts = job.everyone(str(len(self.profiler.blocks)).encode())
        if self.target is None:
            return
        blocks = sum(int(counts[rank]) for rank in pipeline.ranks)
        options = self._options if self.auto else [(self.spec.pipeline_schedule.name, self.spec.num_chunks)]
        self._options = runnable_options(
            self.target, self.config, self.spec, blocks, options, config_field=self._config_field
        )

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
        local = {
            "structure": model_structure(self.model, self.profiler.blocks),
            "input_shape": list(self.profiler.recorder.input_shape or ()),
        }
        parts = [json.loads(part) for part in job.everyone(json.dumps(local).encode())]
        pipeline = [parts[rank] for rank in self._solving_ranks] if job.distributed() else parts
        self._key_parts = job_key(pipeline, self.spec, self.profiler.device, self.model, self.profiler.modes)
        self._key_parts["schedule"] = "auto" if self.auto else self.spec.pipeline_schedule.name
        self._key = cache_key(self._key_parts)
        plan_data = job.by_rank0(self._cache_entry)
        if plan_data is None:
            if any(not part["structure"]["blocks"] for part in pipeline):
                raise InputError(
                    "layers",
                    "a rank holds no block, so the profile cannot say what one costs there: profile under a split "
                    "that gives every rank one (the plan may then leave a rank none)",
                )
            log.info("sapp-hook: no cached plan for this model and setting (key %s); profiling", self._key)
            left = self.profiler.total_steps - self.profiler.steps_done
            self.console.say(
                f"no plan cached for this job: profiling its {len(self.profiler.blocks)} layers a rank over the next "
                f"{left} steps (recompute {', '.join(self.profiler.modes)})"
            )
            return False
        self.profiler.detach()
        self.console.say(f"reusing the plan cached for this job: {self.cache.path(self._key)}")
        self._finish(plan_data, from_cache=True, plan=None, profile=None)
        if not self.pipeline.whole_model:  # each rank runs its part of the plan: its next step is measured against it
            self._measure = StepMeasure(self.model, len(self.profiler.blocks))
            self._measure.start()
        return True

    def _cache_entry(self) -> dict[str, Any] | None:
        """On rank 0: the plan of the cache entry for this job (kept whole in `_cached_entry`), None where there is
        none to reuse."""
        entry = None if self.force else self.cache.load(self._key)
        why = None if entry is None else unusable(entry, self._key_parts, self.spec, auto=self.auto)
        if why is not None:
            self.console.say(f"not reusing the cached plan {self.cache.path(self._key)}: {why}; planning again")
            entry = None
        self._cached_entry = entry
        return None if entry is None else entry["plan"]

    def _check_plan(self, measured: dict[str, float]) -> None:
        """The first step under a reused plan against the plan's prediction, for every pipeline rank (on rank 0,
        which holds the plan's profile): said, kept in `result.check`, `check.json` and the report. Where a
        rank's activations are off the prediction by more than ACTIVATION_TOLERANCE, something changed that the
        cache key does not name (a kernel, a dtype, a wrapper, a library): the job is profiled and planned again,
        once a plan."""
        self._measure = None
        ranks = [json.loads(part) for part in job.everyone(json.dumps(measured).encode())]
        why = job.by_rank0(lambda: self._compare(ranks))
        if why is not None:
            self._replan(why)

    def _compare(self, ranks: list[dict[str, float]]) -> str | None:
        """`_check_plan` on rank 0: why to plan again, or None."""
        pipeline = [ranks[rank] for rank in self._solving_ranks] if job.distributed() else ranks
        checks, why = verdict(pipeline, self._cached_entry, self.result.plan_data, self.out_dir, self.console.say)
        self.result.check = checks
        return why

    def _replan(self, why: str) -> None:
        """Profile the next steps afresh and plan again, keeping the current plan unless the new one is faster by
        more than the profile's noise."""
        self.console.say(f"{why}: something changed that the cache key does not name; profiling and planning again")
        self._replanned = True  # `result` stays the plan in use until the new one is made
        self.profiler = self._new_profiler()
        self.profiler.attach()
        self._watch.start()

    def _plan(self) -> None:
        local = self.profiler.profile()
        if self.measured_tensor_parallel > 1:  # measured on one rank of it: the solver divides no further
            mesh = Mesh(tensor_parallel=self.measured_tensor_parallel, sequence_parallel=self.spec.sequence_parallel)
            local = dataclasses.replace(local, mesh=mesh)
        if job.distributed():  # the stages of rank 0's pipeline, joined there
            profile = gather_profiles([(self.pipeline.rank, local)] if job.rank() in self._solving_ranks else [])
        else:
            profile = local
        solved: list[Plan] = []  # on rank 0, which solves
        plan_data = job.by_rank0(lambda: self._decide(profile, solved))
        self._finish(plan_data, from_cache=False, plan=solved[0] if solved else None, profile=profile)

    def _decide(self, profile: ModelProfile, solved: list[Plan]) -> dict[str, Any]:
        """On rank 0: the plan for the joined `profile` (appended to `solved`), cached; InputError naming
        memory_budget where none is found, the profile kept for `sapp-hook solve`."""
        kept = self._keep(profile)  # before solving: a failed solve keeps what was measured
        try:
            plan = self._solve(profile)
        except InfeasibleError as exc:
            again = (
                solve_command(self.spec, kept, exc.smallest_budget_bytes, auto=self.auto) if kept else "sapp-hook solve"
            )
            why = f"{exc}. The profile is kept: plan again without profiling with `{again}`"
            raise InputError("memory_budget", f"sapp-hook found no plan; the config is untouched. {why}") from None
        except InputError as exc:  # the argument or profile field at fault, as named
            raise InputError(exc.field, f"sapp-hook found no plan; the config is untouched. {exc.detail}") from None
        solved.append(plan)
        plan_data = plan.to_dict()
        stored = self.cache.store(
            self._key, self._key_parts, plan_data, profile.to_dict(), replanned_after_drift=self._replanned
        )
        if stored is not None:  # the entry holds the profile now
            self.cache.forget_profile(self._key)
        return plan_data

    def _keep(self, profile: ModelProfile) -> Path | None:
        """The joined profile saved where a user finds it (the out folder, else the plan cache)."""
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            profile.save(self.out_dir / "profile.json")
            return self.out_dir / "profile.json"
        return self.cache.store_profile(self._key, profile.to_dict())

    def _solve(self, profile: ModelProfile) -> Plan:
        previous = self.result.plan_data if self._replanned and self.result is not None else None
        return plan_for(
            profile, self.spec, self.time_limit_s, previous, self.console.say, options=self._options, auto=self.auto
        )

    def _finish(
        self, plan_data: dict[str, Any], *, from_cache: bool, plan: Plan | None, profile: ModelProfile | None
    ) -> None:
        """Rank 0 writes the plan into the config, reports it and says so (`_deliver`); then, with
        `on_plan="exit"`, every rank ends its process for the relaunch where the config changed."""
        self._watch.stop()
        self._replanned = False
        layout = layout_from_dict(plan_data)
        result = TuneResult(plan_data=plan_data, layout=layout, from_cache=from_cache, plan=plan, profile=profile)
        # once rank 0 has written (the config, and the file `sapp-hook run` reads), every rank goes on
        restart = job.by_rank0(lambda: self._deliver(result))
        self.result = result
        if self.on_plan != "exit" or not restart:
            if self.config is not None and not from_cache:
                self.console.say("training goes on" + ("" if restart else " with it: the config already said it"))
            return
        if os.environ.get(ENVIRONMENT["planned_file"]):  # `sapp-hook run` reads it: a clean exit, no failure told
            self.console.say("exiting for the relaunch with the plan")
            status = 0
        else:
            self.console.say(
                f"exiting with status {REPLAN_EXIT_CODE} so that the launcher restarts the job with the plan"
            )
            status = REPLAN_EXIT_CODE
        job.leave_groups_at_exit(status)
        raise SystemExit(status)

    def _deliver(self, result: TuneResult) -> bool:
        """On rank 0: the plan written, reported, said and left for `sapp-hook run`; whether the job must be
        launched again for it (not where the config already said it)."""
        if self.config is not None:
            result.writeback = write_config(self.target, self.config, result.layout)
        result.report = report_text(result)
        log.info("%s", result.report)
        if self.out_dir is not None:
            write_outputs(self.out_dir, result)
        if not result.from_cache:
            for line in summary(result):
                self.console.say(line)
        for line in written_lines(result, self.out_dir):
            self.console.say(line)
        restart = result.writeback is None or bool(result.writeback.written)
        planned_file = os.environ.get(ENVIRONMENT["planned_file"]) if self.on_plan == "exit" else None
        if planned_file:
            config = None if self.config is None else str(self.config)
            atomic_write_text(Path(planned_file), json.dumps({"config": config, "restart": restart}) + "\n")
        return restart

    def _progress(self, done: int, total: int, mode: str) -> None:
        if job.rank() == 0:
            log.info("sapp-hook: profiling step %d/%d done (%s)", done, total, self.profiler.describe_step(done - 1))


@renamed_keywords(stages="pipeline_parallel")  # here too: the warning then points at the user's call
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
