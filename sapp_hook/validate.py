"""Predicted against measured: a plan run by torch.distributed.pipelining (gloo, one process per stage,
one thread each), next to what the simulator said of it from a profile taken beforehand.

Per rank: the step time (median over the steps after warm-up, and its spread), the peak bytes autograd
holds for backward over a step (saved-tensor hooks in the real run), the most bytes allocated during
a step above its lowest point and what is held at its end (torch.profiler's memory events, in two
more steps), the parameter, gradient and optimizer bytes, and the bytes of torch's receive buffers;
beside each, the prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sapp_hook.torch_engine import check_no_recompute, check_torch_runs, no_recompute_reason, recompute_runs_under
from simulator import ChunkCosts, PipelineCosts, schedule_kind, simulate
from simulator.errors import InputError
from solver import ModelProfile, PipelineSpec, Plan, evaluate_plan, even_plan, plan_from_dict, solve
from solver.calibrate import Run
from solver.costs import buffered_input_bytes
from solver.engine_memory import boundary_bytes, torch_1f1b_held_bytes
from solver.fields import Fields
from solver.mesh import rank_profile
from solver.profile import FULL, NONE, SELECTIVE
from solver.spec import spec_from_dict

log = logging.getLogger(__name__)

# How torch's schedules name their actions to the profiler: the runtime schedules "PP:<action>",
# ScheduleGPipe "Forward i" and "Backward i"; Schedule1F1B does not
ACTION_NAMES = ("PP:", "Forward ", "Backward ")
MEASURED_STEP = "sapp-hook: measured step"


@dataclass(frozen=True)
class Setup:
    """One validation run."""

    model: str
    stages: int
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


def validate(setup: Setup, *, profile: ModelProfile | None = None, workdir: str | Path | None = None) -> dict[str, Any]:
    """Profile (unless given), plan, run the plan on `setup.stages` processes, and compare. Under a
    schedule that splits the backward, a given profile's recompute modes are left out
    (`sapp_hook.torch_engine`)."""
    from sapp_hook.models import load_config

    if profile is None:
        profile = profile_for(setup)  # checks the setup and the model first
    else:
        _check(setup)
        load_config(setup.model)  # a bad model fails here, not in every rank
        _check_profile_of(setup, profile)
        if not recompute_runs_under(setup.schedule):
            profile = profile.with_modes([NONE])
    spec = PipelineSpec(stages=setup.stages, chunks=setup.chunks, micro_batches=setup.micro_batches,
                        schedule=setup.schedule, memory_budget_bytes=setup.memory_budget_bytes, receive_buffers=True)
    plan = choose_plan(profile, spec, setup.plan)
    log.info("validate: running the plan on %d processes, %d steps", setup.stages, setup.warmup_steps + setup.steps)
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        measured = run_pipeline(setup, json.loads(json.dumps(plan.to_dict())), Path(folder))
    return compare(setup, profile, plan, measured)


def profile_for(setup: Setup) -> ModelProfile:
    """The setup's model profiled in this process, in the recompute modes its schedule can run."""
    from sapp_hook.models import load_config, profile_example

    _check(setup)
    config = load_config(setup.model)
    modes = (NONE, SELECTIVE, FULL) if recompute_runs_under(setup.schedule) else (NONE,)
    log.info("validate: profiling %s (%d x %d tokens per micro-batch)", setup.model, setup.micro_batch_size, setup.seq_len)
    return profile_example(config, steps=setup.profile_steps, micro_batch_size=setup.micro_batch_size,
                           seq_len=setup.seq_len, modes=modes, model_name=setup.model)


def _check(setup: Setup) -> None:
    for name in ("stages", "micro_batches", "steps", "warmup_steps", "micro_batch_size", "seq_len"):
        value = getattr(setup, name)
        if not isinstance(value, int) or value < 1:
            raise InputError(name, f"expected an integer >= 1, got {value!r}")
    check_torch_runs(setup.schedule, "--schedule")
    if setup.plan == "even-full" and not recompute_runs_under(setup.schedule):
        raise InputError("--even-full", no_recompute_reason(setup.schedule))
    if setup.plan not in ("solve", "even", "even-full"):
        _check_plan_file(setup)


def _check_plan_file(setup: Setup) -> None:
    """A plan JSON runs as it was planned: its stages, schedule, chunks and micro-batches must be the
    run's, checked before anything is profiled or launched."""
    from sapp_hook.inputs import read_plan_json

    data = read_plan_json(setup.plan, "--plan")
    try:
        planned = spec_from_dict(data["spec"])
    except InputError as exc:
        raise InputError("--plan", f"{setup.plan}: {exc}") from None
    run = PipelineSpec(stages=setup.stages, chunks=setup.chunks, micro_batches=setup.micro_batches,
                       schedule=setup.schedule)
    for flag, theirs, ours in (
        ("--stages", planned.stages, run.stages),
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
        raise InputError("profile", f"was measured at {shape[0]} x {shape[1]} tokens per micro-batch; this run uses "
                                    f"{setup.micro_batch_size} x {setup.seq_len} (--micro-batch-size, --seq-len)")


def choose_plan(profile: ModelProfile, spec: PipelineSpec, which: str) -> Plan:
    if which == "solve":
        return solve(profile, spec, time_limit_s=60)
    if which in ("even", "even-full"):
        return even_plan(profile, spec, FULL if which == "even-full" else NONE)
    from sapp_hook.inputs import read_plan_json
    from sapp_hook.writeback import layout_from_dict

    data = read_plan_json(which, "--plan")
    check_no_recompute(spec.schedule, layout_from_dict(data).body_modes(), "--plan")
    return plan_from_dict(profile, data)


def predictions(plan: Plan, profile: ModelProfile, input_bytes: float = 0.0) -> dict[str, list[float]]:
    """Per rank of a plan for `profile`: when its last action ends; the peak of what autograd holds for
    backward (less `input_bytes` per micro-batch on the first stage: the token ids, which the engine
    holds for the whole step as data; and less the outputs the engine keeps per micro-batch in flight,
    `boundary_bytes`, which autograd does not hold); the peak of all the plan counts but static
    bytes, working bytes included (what an allocator sees above the static bytes; the sends
    `Schedule1F1B` holds, which the plan counts with the static bytes, come after a step starts:
    counted in); the static bytes (without those sends);
    the part of them that is the engine's receive buffers (`spec.receive_buffers`); and what is held
    above the static bytes once the last action has run (what the engine keeps to the step's end)."""
    profile = rank_profile(profile, plan.spec)  # the numbers of one rank of the plan's mesh, as the plan's
    result = plan.simulation
    schedule = result.schedule
    ends = [result.rank_finish_ms(rank) for rank in range(schedule.ranks)]
    costs = result.costs
    kept_in_flight, kept_whole_run = boundary_bytes(profile, plan.spec)
    in_buffers = buffered_input_bytes(profile, plan.spec, plan.stage_layer_counts)  # autograd holds them too
    # checkpointing keeps what a stage computes for its blocks (the rotary tables) through its own
    # frame, out of the saved-tensor hook's sight: not in the autograd view where every block of the
    # stage is fully recomputed (the allocator holds them all the same); nor is each checkpoint's state
    starts = list(itertools.accumulate(plan.stage_layer_counts, initial=0))
    unseen = []
    for start, count in zip(starts, plan.stage_layer_counts):
        modes = [mode for layer, mode in zip(profile.layers[start:start + count], plan.layer_modes[start:start + count])
                 if layer.is_body]
        shared = profile.stage_shared_bytes if modes and all(mode == FULL for mode in modes) else 0.0
        unseen.append(shared + profile.checkpoint_state_bytes * sum(mode != NONE for mode in modes))
    held_sends = torch_1f1b_held_bytes(profile, plan.spec)  # counted with the static bytes, not there at a step's start

    def peaks(autograd_only: bool) -> list[float]:
        def bare(rank: int, chunk: int, costs_of: ChunkCosts) -> ChunkCosts:
            virtual = schedule.stage_index(rank, chunk)
            ids = input_bytes if virtual == 0 else 0.0
            if not autograd_only:
                return dataclasses.replace(costs_of, static_bytes=held_sends[virtual],
                                           activation_bytes=costs_of.activation_bytes - ids)
            # gradients (working sets, a split backward's pending and retained ones) are not what it saved
            return dataclasses.replace(costs_of, static_bytes=0.0, working_bytes=0.0, input_working_bytes=None,
                                       weight_working_bytes=None, pending_bytes=0.0, retained_bytes=0.0,
                                       activation_bytes=costs_of.activation_bytes - ids - kept_in_flight[virtual]
                                       + in_buffers[virtual] - unseen[virtual])

        bare_costs = PipelineCosts(
            tuple(tuple(bare(rank, chunk, c) for chunk, c in enumerate(row)) for rank, row in enumerate(costs.chunk_costs)),
            p2p_ms=costs.p2p_ms,
        )
        return list(simulate(schedule, bare_costs).stage_peak_memory_bytes)

    static = [sum(c.static_bytes for c in row) - sum(held_sends[virtual] for virtual in schedule.virtual_stages_of(rank))
              for rank, row in enumerate(costs.chunk_costs)]
    step_end = [result.memory_curve(rank)[-1][1] - static[rank] for rank in range(schedule.ranks)]
    buffers = [sum(kept_whole_run[virtual] for virtual in schedule.virtual_stages_of(rank)) for rank in range(schedule.ranks)]
    return {"step_ms": ends, "activation_peak_bytes": peaks(True), "peak_bytes": peaks(False), "static_bytes": static,
            "receive_buffer_bytes": buffers, "step_end_bytes": step_end}


def run_pipeline(setup: Setup, plan_data: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """Run the plan on `setup.stages` gloo processes; what each rank measured."""
    import torch.multiprocessing as mp

    ranks = mp.spawn(_rank_main, args=(setup, plan_data, str(folder)), nprocs=setup.stages, join=False)
    try:
        while not ranks.join():
            pass
    except BaseException:  # a failed rank, Ctrl-C or SIGTERM: no rank outlives the run
        _stop(ranks.processes)
        raise
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(setup.stages)]


def _stop(processes: list[Any], grace_s: float = 2.0) -> None:
    """End `processes`: SIGTERM, then SIGKILL for any still there after `grace_s`."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.0))
        if process.is_alive():
            process.kill()
            process.join()


def _rank_main(rank: int, setup: Setup, plan_data: dict[str, Any], folder: str) -> None:
    from sapp_hook.gloo import gloo_group

    with gloo_group(rank, setup.stages, Path(folder) / "store"):
        _measure_rank(rank, setup, plan_data, folder)


def _measure_rank(rank: int, setup: Setup, plan_data: dict[str, Any], folder: str) -> None:
    """Run the plan's stages of this rank for the set-up's steps; write what was measured to `rank{rank}.json`."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.pipelining import PipelineStage

    from profiler.held import HeldActivations
    from profiler.recorder import unique_bytes
    from sapp_hook.models import build_model, load_config, random_batch
    from sapp_hook.stages import TiedGradients, apply, schedule_class

    transformers.logging.set_verbosity_error()
    config = load_config(setup.model)
    model = build_model(config)
    logging.getLogger("sapp_hook.stages").setLevel(logging.ERROR)  # its tied-weight warning: TiedGradients below
    step_held: list[HeldActivations] = []  # the step's counter: selective recompute's own cache reports to it too

    def kept_by_checkpointing(tensor: torch.Tensor) -> None:
        if step_held:
            step_held[0].keep(tensor)

    modules = apply(model, plan_data, rank, on_kept=kept_by_checkpointing)
    tied = TiedGradients(model, plan_data, rank)
    num_stages = setup.stages * len(modules)
    stages = [PipelineStage(module, index, num_stages, torch.device("cpu")) for index, module in modules]
    parameters = [p for _, module in modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=config.get_text_config().vocab_size)

    runner = schedule_class(plan_data)
    schedule = runner(stages[0], setup.micro_batches, loss_fn=loss_fn) if len(stages) == 1 else runner(
        stages, setup.micro_batches, loss_fn=loss_fn)
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)
    p2p_ms = _p2p_ms(rank, (setup.micro_batch_size, setup.seq_len, config.get_text_config().hidden_size))
    step_ms, peaks, losses = [], [], []
    for step in range(setup.warmup_steps + setup.steps):
        batch = random_batch(config, setup.micro_batch_size * setup.micro_batches, setup.seq_len, seed=step)["input_ids"]
        step_losses: list[torch.Tensor] = []
        dist.barrier()
        # the token ids are data the schedule holds for the whole step, in one storage: not activations
        with HeldActivations([*model.parameters(), *model.buffers(), batch]) as held:
            step_held[:] = [held]
            started = time.perf_counter()
            # return_outputs=False: else torch keeps every micro-batch's logits on the last rank to the end
            schedule.step(*((batch,) if first else ()), target=batch if last else None, losses=step_losses,
                          return_outputs=False)
            elapsed = (time.perf_counter() - started) * 1e3
        step_held.clear()
        tied()  # outside the timed step, like the optimizer: the simulator does not model it
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if step >= setup.warmup_steps:
            step_ms.append(elapsed)
            peaks.append(held.peak_bytes)
        losses.append([loss.item() for loss in step_losses])

    # two more steps, untimed, for what the allocator holds above a step's lowest point: the profiler that
    # counts it slows every allocation
    allocated, held_at_end = _allocated_bytes(lambda: schedule.step(*((batch,) if first else ()),
                                                                    target=batch if last else None, return_outputs=False))
    measured = {
        "rank": rank,
        "step_ms": step_ms,
        "allocated_peak_bytes": allocated,
        "step_end_bytes": held_at_end,
        "activation_peak_bytes": peaks,
        "parameter_bytes": unique_bytes(parameters),
        "gradient_bytes": unique_bytes([p.grad for p in parameters if p.grad is not None]),
        "optimizer_bytes": unique_bytes([t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]),
        "receive_buffer_bytes": unique_bytes(_receive_buffers(stages)),
        "losses": losses,
        "p2p_ms": p2p_ms,
        "layers": sorted(id_ for _, module in modules for id_ in _layer_names(model, module)),
    }
    Path(folder, f"rank{rank}.json").write_text(json.dumps(measured))


def _p2p_ms(rank: int, shape: tuple[int, ...], repeats: int = 20) -> float:
    """One activation's trip between ranks 0 and 1: half the median round trip (0 on other ranks, and
    where one rank runs every stage: nothing crosses ranks)."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size() < 2:
        return 0.0
    tensor = torch.zeros(shape)
    trips = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        trips.append((time.perf_counter() - started) * 1e3)
    dist.barrier()
    return statistics.median(trips[2:]) / 2 if rank == 0 else 0.0


def _allocated_bytes(step: Callable[[], object]) -> tuple[int, int | None]:
    """The most bytes this process holds during `step` above the step's lowest point (where what the
    step before kept has been freed), and what it holds above that once the schedule's last action
    has run, before torch waits on its sends (None where the schedule does not name its actions:
    torch's Schedule1F1B): the running sum of the allocations and frees torch.profiler records (a
    CPU allocator keeps no peak). The profiler records no free of a block allocated before it
    started, such as what the step before kept and this one frees, so it watches that step too and
    measures the second."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function(MEASURED_STEP):
            step()
    events = prof.profiler.kineto_results.events()
    measured_start = next(event.start_ns() for event in events if event.name() == MEASURED_STEP)
    changes = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    last_action_end = max((event.end_ns() for event in events if event.name().startswith(ACTION_NAMES)
                           and event.start_ns() >= measured_start), default=None)
    start = sum(nbytes for time_ns, nbytes in changes if time_ns < measured_start)
    live = floor = peak = start
    held = None if last_action_end is None else start
    for time_ns, nbytes in changes:
        if time_ns < measured_start:
            continue
        live += nbytes
        floor, peak = min(floor, live), max(peak, live)
        if held is not None and time_ns <= last_action_end:
            held = live
    return peak - floor, None if held is None else held - floor


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    """File descriptor 2 to /dev/null meanwhile: torch's profiler writes its start and stop to it from C++,
    which no setting turns off (the terminal is the CLI's)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _receive_buffers(stages: list[Any]) -> list[Any]:
    """The tensors torch's stages keep to receive inputs and output gradients into, one per micro-batch
    (after a step: a stage fed by another on its rank keeps that stage's outputs there)."""
    return [info.buffer for stage in stages for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
            for info in infos if info.buffer is not None]


def _layer_names(model: Any, module: Any) -> list[str]:
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(layer)] for layer in module.layers]


def compare(setup: Setup, profile: ModelProfile, plan: Plan, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The report: each rank's measurements next to the plan's prediction (with the P2P time measured)."""
    p2p_ms = measured[0]["p2p_ms"]  # measured in the run: the prediction includes it
    spec = dataclasses.replace(plan.spec, p2p_ms=p2p_ms)
    plan = evaluate_plan(profile, spec, plan.stage_layer_counts, plan.layer_modes)
    predicted = predictions(plan, profile, input_bytes=setup.micro_batch_size * setup.seq_len * 8)
    ranks = []
    for rank, row in enumerate(measured):
        step = statistics.median(row["step_ms"])
        activation = max(row["activation_peak_bytes"])
        ranks.append({
            "rank": rank,
            "predicted_step_ms": predicted["step_ms"][rank],
            "measured_step_ms": step,
            "measured_step_spread_ms": max(row["step_ms"]) - min(row["step_ms"]),
            "step_error": _error(predicted["step_ms"][rank], step),
            "predicted_activation_peak_bytes": predicted["activation_peak_bytes"][rank],
            "measured_activation_peak_bytes": activation,
            "activation_error": _error(predicted["activation_peak_bytes"][rank], activation),
            "predicted_peak_bytes": predicted["peak_bytes"][rank],
            "measured_allocated_peak_bytes": row["allocated_peak_bytes"],
            "allocated_error": _error(predicted["peak_bytes"][rank], row["allocated_peak_bytes"]),
            "predicted_step_end_bytes": predicted["step_end_bytes"][rank],
            "measured_step_end_bytes": row["step_end_bytes"],
            "predicted_static_bytes": predicted["static_bytes"][rank] - predicted["receive_buffer_bytes"][rank],
            "measured_static_bytes": row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"],
            "predicted_receive_buffer_bytes": predicted["receive_buffer_bytes"][rank],
            "measured_receive_buffer_bytes": row["receive_buffer_bytes"],
            "layers": row["layers"],
        })
    iteration = max(r["measured_step_ms"] for r in ranks)
    return {
        "model": setup.model,
        "schedule": plan.spec.pipeline_schedule.name,
        "stages": setup.stages,
        "chunks": plan.spec.pipeline_schedule.chunks,
        "micro_batches": setup.micro_batches,
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
    spec = PipelineSpec(
        stages=fields.integer("stages", required=True, least=1),
        chunks=fields.integer("chunks", required=True, least=1),
        micro_batches=fields.integer("micro_batches", required=True, least=1),
        schedule=fields.text("schedule", required=True),
        p2p_ms=fields.number("p2p_ms", 0.0),
    )
    counts, modes, ranks = (fields.raw(key) for key in ("stage_layer_counts", "layer_modes", "ranks"))
    if not isinstance(ranks, list) or len(ranks) != spec.stages:
        raise InputError(fields.at("ranks"), f"expected a list of {spec.stages} ranks, got {ranks!r:.80}")
    steps = tuple(Fields(row, f"{fields.at('ranks')}[{i}]").number("measured_step_ms", required=True)
                  for i, row in enumerate(ranks))
    if not all(steps):
        raise InputError(fields.at("ranks"), "expected every measured_step_ms > 0")
    if not isinstance(counts, list) or not isinstance(modes, list):
        raise InputError(fields.at("stage_layer_counts"), "expected the plan's stage_layer_counts and layer_modes as lists")
    if len(modes) != len(profile.layers):
        raise InputError(fields.at("layer_modes"), f"{len(modes)} layers, but the profile has {len(profile.layers)}: "
                                                   "calibrate with the profile the run was planned from")
    plan = evaluate_plan(profile, spec, tuple(counts), tuple(modes))  # checks the plan against the profile
    return Run(profile, spec, plan.stage_layer_counts, plan.layer_modes, steps)


def _error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    return abs(predicted - measured) / measured if measured else 0.0
