"""One rank of a validation run: a plan's stages run by torch.distributed.pipelining on gloo, on a mesh of
pipeline x data x tensor-parallel processes (`sapp_hook.validation.parallelize`), measured.

Per rank: the step time (steps after warm-up), the peak bytes autograd holds for backward (saved-tensor
hooks), the most bytes allocated during a step above its lowest point and what is held at its end
(torch.profiler's memory events, in two more steps, collectives settled), what the rank holds for the
whole run per kind (its local shards), its receive buffers, FSDP's gathered parameters and whole
gradients at each reduce, and its collectives' times (one more step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# How torch's schedules name their actions to the profiler: the runtime schedules "PP:<action>",
# ScheduleGPipe "Forward i" and "Backward i"; Schedule1F1B does not
ACTION_NAMES = ("PP:", "Forward ", "Backward ")
MEASURED_STEP = "sapp-hook: measured step"


def run_ranks(setup: Any, plan_data: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """Run the plan on the setup's processes (stages x data x tensor parallel); what each rank measured."""
    return spawn_ranks(_rank_main, (setup, plan_data, str(folder)), mesh_shape(setup).world_size, folder)


def spawn_ranks(main: Callable[..., None], args: tuple, world: int, folder: Path) -> list[dict[str, Any]]:
    """`main(rank, *args)` on `world` processes, each writing `rank{rank}.json` into `folder`; their
    JSON in rank order. A failed rank, Ctrl-C or SIGTERM ends every rank."""
    from sapp_hook.validation.gloo import spawn

    ranks = spawn(main, args, world, join=False)
    try:
        while not ranks.join():
            pass
    except BaseException:  # no rank outlives the run
        _stop(ranks.processes)
        raise
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def mesh_shape(setup: Any) -> Any:
    from sapp_hook.validation.parallelize import MeshShape

    return MeshShape(
        pipeline_parallel=setup.pipeline_parallel,
        data_parallel=setup.data_parallel,
        tensor_parallel=setup.tensor_parallel,
        fsdp=setup.fsdp,
        reshard_after_forward=setup.reshard_after_forward,
        zero_stage=setup.zero_stage,
        ddp=setup.ddp,
        sequence_parallel=setup.sequence_parallel,
    )


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


def _rank_main(rank: int, setup: Any, plan_data: dict[str, Any], folder: str) -> None:
    from sapp_hook.validation.gloo import gloo_group

    with gloo_group(rank, mesh_shape(setup).world_size, Path(folder) / "store"):
        _measure_rank(rank, setup, plan_data, folder)


def _measure_rank(rank: int, setup: Any, plan_data: dict[str, Any], folder: str) -> None:
    """Run this rank's stages for the set-up's steps; write what was measured to `rank{rank}.json`."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.pipelining import PipelineStage

    from profiler.measure.held import HeldActivations
    from profiler.measure.recorder import unique_bytes
    from sapp_hook.models import build_model, load_config, random_batch
    from sapp_hook.pipelining.stages import TiedGradients, build_stages, schedule_class
    from sapp_hook.validation.measure import ddp_bucket_bytes, held_bytes, settled_collectives
    from sapp_hook.validation.parallelize import (
        average_gradients,
        device_mesh,
        moving_storages,
        optimizer_for,
        optimizer_state,
        parallelize,
    )

    transformers.logging.set_verbosity_error()
    # FSDP over tensor-parallel stages warns of views it returns; nothing here writes into them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    shape = mesh_shape(setup)
    pp, dp, tp = shape.coordinates(rank)
    mesh = None if shape.plain and not shape.ddp and shape.zero_stage == 0 else device_mesh(shape)
    pp_group = None if mesh is None else mesh["pp"].get_group()
    config = load_config(setup.model)
    model = build_model(config)
    logging.getLogger("sapp_hook.pipelining.stages").setLevel(
        logging.ERROR
    )  # its tied-weight warning: TiedGradients below
    step_held: list[HeldActivations] = []  # the step's counter: selective recompute's own cache reports to it too

    def kept_by_checkpointing(tensor: torch.Tensor) -> None:
        if step_held:
            step_held[0].keep(tensor)

    modules = build_stages(model, plan_data, pp, on_kept=kept_by_checkpointing)
    tied = TiedGradients(model, plan_data, pp, group=pp_group)
    stage_modules = [module for _, module in modules]
    run = stage_modules if mesh is None else parallelize(stage_modules, shape, mesh)
    num_stages = setup.pipeline_parallel * len(modules)
    stages = [
        PipelineStage(module, index, num_stages, torch.device("cpu"), group=pp_group)
        for (index, _), module in zip(modules, run)
    ]
    parameters = [p for module in stage_modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4) if mesh is None else optimizer_for(parameters, shape, mesh)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=config.get_text_config().vocab_size)

    runner = schedule_class(plan_data)
    schedule = (
        runner(stages[0], setup.micro_batches, loss_fn=loss_fn)
        if len(stages) == 1
        else runner(stages, setup.micro_batches, loss_fn=loss_fn)
    )
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)
    peer = shape.rank_of(1) if setup.pipeline_parallel > 1 else None
    p2p_ms = _p2p_ms(rank, peer, (setup.micro_batch_size, setup.seq_len, config.get_text_config().hidden_size))
    moving = moving_storages(stage_modules) if shape.fsdp else None
    step_ms, peaks, losses = [], [], []
    for step in range(setup.warmup_steps + setup.steps):
        # replicas train on their own data; tensor-parallel ranks on the same
        batch = random_batch(
            config, setup.micro_batch_size * setup.micro_batches, setup.seq_len, seed=step + 1000 * dp
        )["input_ids"]
        step_losses: list[torch.Tensor] = []
        dist.barrier()
        # the token ids are data the schedule holds for the whole step, in one storage: not activations
        with (
            _unsynced(run) if step == 0 and shape.ddp else contextlib.nullcontext(),
            HeldActivations([*model.parameters(), *model.buffers(), batch], moving=moving) as held,
        ):
            step_held[:] = [held]
            started = time.perf_counter()
            # return_outputs=False: else torch keeps every micro-batch's logits on the last rank to the end
            schedule.step(
                *((batch,) if first else ()), target=batch if last else None, losses=step_losses, return_outputs=False
            )
            elapsed = (time.perf_counter() - started) * 1e3
        step_held.clear()
        tied()  # outside the timed step, like the optimizer: the simulator does not model them
        if mesh is not None:
            average_gradients(parameters, shape, mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if step >= setup.warmup_steps:
            step_ms.append(elapsed)
            peaks.append(held.peak_bytes)
        losses.append([loss.item() for loss in step_losses])

    def step() -> None:
        schedule.step(*((batch,) if first else ()), target=batch if last else None, return_outputs=False)

    collectives = [] if mesh is None else _collective_times(step)
    at_reduce = _at_reduce(stages, stage_modules) if shape.fsdp else contextlib.nullcontext({})
    # two more steps, untimed, for what the allocator holds above a step's lowest point: the profiler that
    # counts it slows every allocation
    with contextlib.nullcontext() if mesh is None else settled_collectives(), at_reduce as reduced:
        allocated, held_at_end = _allocated_bytes(step)
    measured = {
        "rank": rank,
        "pp_rank": pp,
        "dp_rank": dp,
        "tp_rank": tp,
        "step_ms": step_ms,
        "allocated_peak_bytes": allocated,
        "step_end_bytes": held_at_end,
        "activation_peak_bytes": peaks,
        **held_bytes(parameters, optimizer_state(optimizer)),
        "bucket_bytes": ddp_bucket_bytes(run),
        "receive_buffer_bytes": unique_bytes(_receive_buffers(stages)),
        "fsdp_at_reduce": reduced,
        "collectives": collectives,
        "losses": losses,
        "p2p_ms": p2p_ms,
        "layers": sorted(id_ for module in stage_modules for id_ in _layer_names(model, module)),
    }
    Path(folder, f"rank{rank}.json").write_text(json.dumps(measured))


@contextlib.contextmanager
def _unsynced(modules: list[Any]) -> Iterator[None]:
    """Every DDP module under no_sync, for the first step: torch's pipelining infers each stage's shapes
    then with a forward outside no_sync, which leaves DDP's reducer expecting a backward, and under
    Interleaved1F1B its first bucket rebuild then finds every parameter counted twice and asserts."""
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(module.no_sync())
        yield


@contextlib.contextmanager
def _at_reduce(stages: list[Any], modules: list[Any]) -> Iterator[dict[str, list[int]]]:
    """Per stage index, FSDP's gathered parameter and whole gradient bytes as each reduce begins
    (the last step's, meanwhile)."""
    from sapp_hook.validation.parallelize import unsharded_bytes

    seen: dict[str, list[int]] = {}
    originals = []
    for stage, module in zip(stages, modules):
        original = stage.perform_reduce_grad

        def reduce(
            scale: int,
            *,
            _original: Callable[[int], None] = original,
            _index: int = stage.stage_index,
            _module: Any = module,
        ) -> None:
            seen[str(_index)] = list(unsharded_bytes([_module]))
            _original(scale)

        originals.append((stage, original))
        stage.perform_reduce_grad = reduce
    try:
        yield seen
    finally:
        for stage, original in originals:
            stage.perform_reduce_grad = original


def _collective_times(step: Callable[[], object]) -> list[dict[str, Any]]:
    """The collectives of one step and their times (`sapp_hook.validation.measure.collective_times`)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from sapp_hook.validation.measure import collective_times

    with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU]) as prof, record_function(MEASURED_STEP):
        step()
    events = prof.profiler.kineto_results.events()
    measured = next(event for event in events if event.name() == MEASURED_STEP)
    return collective_times(events, measured.start_ns(), measured.end_ns(), measured.start_thread_id())


def _p2p_ms(rank: int, peer: int | None, shape: tuple[int, ...], repeats: int = 20) -> float:
    """One activation's trip between rank 0 and `peer`, the next pipeline rank: half the median round
    trip (0 on other ranks, and where one pipeline rank runs every stage: nothing crosses ranks)."""
    import torch
    import torch.distributed as dist

    if peer is None:
        return 0.0
    tensor = torch.zeros(shape)
    trips = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        if rank == 0:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        elif rank == peer:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        trips.append((time.perf_counter() - started) * 1e3)
    dist.barrier()
    return statistics.median(trips[2:]) / 2 if rank == 0 else 0.0


def _allocated_bytes(step: Callable[[], object], repeats: int = 3) -> tuple[int, int | None]:
    """The most bytes this process holds during a step above the step's lowest point (where what the
    step before kept has been freed), and what it holds above that once the schedule's last action
    has run, before torch waits on its sends (None where the schedule does not name its actions:
    torch's Schedule1F1B): the running sum of the allocations and frees torch.profiler records (a
    CPU allocator keeps no peak). The profiler records no free of a block allocated before it
    started, such as what the step before kept and this one frees, so it watches a step before the
    measured ones. Of `repeats` steps, the one with the least peak: gloo's worker threads free some
    buffers late when the CPU is busy, and a late free only raises a peak."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        for _ in range(repeats):
            with record_function(MEASURED_STEP):
                step()
    events = prof.profiler.kineto_results.events()
    starts = sorted(event.start_ns() for event in events if event.name() == MEASURED_STEP)
    changes = memory_changes(prof.profiler.kineto_results.experimental_event_tree())
    action_ends = [event.end_ns() for event in events if event.name().startswith(ACTION_NAMES)]
    windows = zip(starts, [*starts[1:], math.inf])
    return min((_step_peak(changes, action_ends, begin, end) for begin, end in windows), key=lambda peak: peak[0])


def _step_peak(
    changes: list[tuple[int, int]], action_ends: list[int], begin: float, end: float
) -> tuple[int, int | None]:
    """`_allocated_bytes` of the step between `begin` and `end` (ns)."""
    last_action_end = max((ns for ns in action_ends if begin <= ns < end), default=None)
    live = sum(nbytes for time_ns, nbytes in changes if time_ns < begin)
    floor = peak = live
    held = None if last_action_end is None else live
    for time_ns, nbytes in changes:
        if not begin <= time_ns < end:
            continue
        live += nbytes
        floor, peak = min(floor, live), max(peak, live)
        if held is not None and time_ns <= last_action_end:
            held = live
    return peak - floor, None if held is None else held - floor


def memory_changes(tree: list[Any]) -> list[tuple[int, int]]:
    """(time, bytes) of every allocation (+) and free (-) in torch.profiler's event `tree`, in order. A
    block allocated again at an address the trace holds live was freed where the profiler did not see
    it (on a thread it does not watch: gloo's, which may drop a collective's last reference): its free
    is counted there, when its address is taken again, at the latest."""
    allocations = []
    nodes = list(tree)
    while nodes:
        node = nodes.pop()
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        nodes.extend(node.children)
    live: dict[int, int] = {}
    changes = []
    for time_ns, size, address in sorted(allocations):
        if size > 0:
            if address in live:
                changes.append((time_ns, -live[address]))
            live[address] = size
        else:
            live.pop(address, None)
        changes.append((time_ns, size))
    return changes


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
    return [
        info.buffer
        for stage in stages
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        for info in infos
        if info.buffer is not None
    ]


def _layer_names(model: Any, module: Any) -> list[str]:
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(layer)] for layer in module.layers]
