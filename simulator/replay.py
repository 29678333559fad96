"""Replay a schedule with costs: when every action starts and ends, memory, and the bubble split.

An action starts when its rank is free and the action it depends on has ended (plus the P2P
time when that action ran on another rank). Sends are asynchronous: they never hold a rank.
Memory of a rank: its static bytes, plus the activation of every (chunk, micro-batch) whose
forward has ended and whose backward (B, or W when split) has not, plus, where the backward is
split, the pending gradients of every one whose I has run and W has not, plus the chunk's working
set while one of its backward actions runs (each half of a split backward may have its own), plus
what data parallelism holds within the step (`simulator.sharded`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from basics.collector import without_collector
from basics.errors import InputError, check_instance
from simulator.actions import BACKWARD_INPUT, FORWARD, OPS
from simulator.compiled import CompiledSchedule
from simulator.costs import ChunkCosts, PipelineCosts
from simulator.result import BubbleSplit, SimulationResult
from simulator.schedule import Schedule
from simulator.sharded import rank_memory_peaks


@without_collector
def simulate(schedule: Schedule, costs: PipelineCosts) -> SimulationResult:
    """Replay `schedule` with `costs`: when every action starts and ends, each rank's peak memory, the
    bubble split.

    Each action starts once its rank is free and the action it waits for has ended (plus `costs.p2p_ms`
    where that one ran on another rank); a rank's memory follows its action order alone (the module doc).

    Args:
        schedule: the action lists (`build_schedule`).
        costs: per-(rank, chunk) costs per micro-batch, `costs.chunk_costs[rank][chunk]`, as many ranks and
            chunks as the schedule has.

    Returns:
        A `SimulationResult`: start and end of every action (ms from the iteration's start),
        `iteration_time_ms`, `rank_busy_ms`, `rank_peak_memory_bytes`, `rank_peak_activations` (the most
        (chunk, micro-batch) activations a rank holds at once) and the `bubble` split.

    Raises:
        InputError: `schedule` or `costs` of the wrong type, their ranks x chunks differ, or every forward
            and backward time is zero.
        ScheduleError: the schedule's order deadlocks.

    Example:
        >>> from simulator import PipelineCosts, build_schedule
        >>> schedule = build_schedule("1F1B", ranks=4, micro_batches=8)
        >>> costs = PipelineCosts.uniform(
        ...     4, 1, forward_ms=1.0, backward_ms=2.0, activation_bytes=100, static_bytes=1000, working_bytes=10
        ... )
        >>> result = simulate(schedule, costs)
        >>> result.iteration_time_ms  # (M + R - 1) x (F + B)
        33.0
        >>> result.rank_peak_activations  # rank r holds R - r micro-batches' activations at most
        (4, 3, 2, 1)
        >>> result.rank_peak_memory_bytes  # static + 4 activations + a backward's working set on rank 0
        (1410.0, 1310.0, 1210.0, 1110.0)
    """
    _check_shape(schedule, costs)
    compiled = schedule.compiled
    action_ms = durations(compiled, costs)
    start, end = _replay(compiled, action_ms, costs.p2p_ms)
    iteration_ms = max(end)

    offsets = compiled.rank_offsets
    action_array = np.array(action_ms)
    # accumulate adds in order, as a running sum does
    busy = [float(np.add.accumulate(action_array[a:b])[-1]) if b > a else 0.0 for a, b in itertools.pairwise(offsets)]
    peaks, in_flight = _memory_peaks(compiled, costs)

    return SimulationResult(
        schedule=schedule,
        costs=costs,
        start_ms=start,
        end_ms=end,
        iteration_time_ms=iteration_ms,
        rank_busy_ms=tuple(busy),
        rank_peak_memory_bytes=peaks,
        rank_peak_activations=in_flight,
        bubble=_bubble_split(schedule, costs, iteration_ms),
    )


@without_collector
def critical_path(schedule: Schedule, costs: PipelineCosts) -> list[int]:
    """Action ids of a chain of waits that sets the iteration time, first to last: each action in
    it starts the moment the one before it ends (plus the P2P time where the chain changes rank),
    so the chain's durations and P2P times add up to the iteration time.

    Args:
        schedule: the action lists (`build_schedule`).
        costs: per-(rank, chunk) costs, shaped as the schedule (as `simulate` takes them).

    Returns:
        Action ids, numbered rank by rank in schedule order (`schedule.compiled`): id i is the i-th action
        of the rank lists laid end to end.

    Raises:
        InputError: `schedule` or `costs` of the wrong type, or their ranks x chunks differ.
        ScheduleError: the schedule's order deadlocks.

    Example:
        >>> from simulator import PipelineCosts, build_schedule
        >>> schedule = build_schedule("1F1B", ranks=4, micro_batches=8)
        >>> path = critical_path(schedule, PipelineCosts.uniform(4, 1, forward_ms=1.0, backward_ms=2.0))
        >>> actions = [action for rank in schedule.rank_actions for action in rank]
        >>> " ".join(str(actions[i]) for i in path)
        '0F0 1F0 2F0 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 2B7 1B7 0B7'
    """
    _check_shape(schedule, costs)
    compiled = schedule.compiled
    start, end = _replay(compiled, durations(compiled, costs), costs.p2p_ms)
    action = max(range(len(end)), key=end.__getitem__)
    chain = [action]
    while start[action] > 0:
        rank_first = compiled.rank_offsets[compiled.rank[action]]
        if action > rank_first and end[action - 1] == start[action]:
            action -= 1  # waited for its rank
        else:
            action = compiled.dependency[action]  # waited for its input or gradient
        chain.append(action)
    return chain[::-1]


def _check_shape(schedule: Schedule, costs: PipelineCosts) -> None:
    check_instance(schedule, Schedule, "schedule", "a Schedule (simulator.build_schedule)")
    check_instance(costs, PipelineCosts, "costs", "a PipelineCosts")
    if (costs.ranks, costs.chunks) != (schedule.ranks, schedule.chunks):
        raise InputError(
            "costs",
            f"expected {schedule.ranks} ranks x {schedule.chunks} chunks to match the schedule, "
            f"got {costs.ranks} x {costs.chunks}",
        )


def durations(compiled: CompiledSchedule, costs: PipelineCosts) -> list[float]:
    """Every action's duration in ms, by action id."""
    table = []  # ordered as CompiledSchedule.cost_slot reads it: rank, chunk, op
    for row in costs.chunk_costs:
        for cost in row:
            table += [
                cost.forward_ms,
                cost.backward_ms + cost.recompute_ms,
                cost.split_input_ms() + cost.recompute_ms,
                cost.split_weight_ms(),
            ]
    return np.array(table, dtype=float)[compiled.cost_slot].tolist()


def _replay(compiled: CompiledSchedule, action_ms: list[float], p2p_ms: float) -> tuple[list[float], list[float]]:
    """Start and end of every action, in `compiled.order`: what an action waits for on its own rank ended
    before its rank predecessor did, so only waits across ranks are looked at."""
    ranks, waits = compiled.replay_steps
    start = [0.0] * len(action_ms)
    end = [0.0] * len(action_ms)
    rank_free = [0.0] * (len(compiled.rank_offsets) - 1)
    for action_id, rank, dep in zip(compiled.order, ranks, waits):
        time = rank_free[rank]
        if dep >= 0:
            ready = end[dep] + p2p_ms
            if ready > time:
                time = ready
        start[action_id] = time
        time += action_ms[action_id]
        end[action_id] = time
        rank_free[rank] = time
    return start, end


def _memory_peaks(compiled: CompiledSchedule, costs: PipelineCosts) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Per rank, peak bytes and peak number of activations held (independent of timing). Running sums in
    action order, as `simulator.sharded.memory_points` adds; that walk itself where data parallelism holds
    memory within the step."""
    if any(chunk.sharded is not None for chunk in costs.all_chunks()):
        return tuple(zip(*(rank_memory_peaks(compiled, costs, rank) for rank in range(costs.ranks))))
    change, working = [], []  # ordered as CompiledSchedule.cost_slot reads them
    for row in costs.chunk_costs:
        for chunk in row:
            change += [chunk.held_change_bytes(op) for op in OPS]
            working += [chunk.working_bytes_during(op) for op in OPS]
    slot = compiled.cost_slot
    action_change = np.array(change, dtype=float)[slot]
    action_working = np.array(working, dtype=float)[slot]
    is_forward = slot % len(OPS) == OPS.index(FORWARD)
    activations = np.where(is_forward, 1, np.where(slot % len(OPS) == OPS.index(BACKWARD_INPUT), 0, -1))
    peaks, in_flight = [], []
    for rank, (first, last) in enumerate(itertools.pairwise(compiled.rank_offsets)):
        static = sum(chunk.static_bytes for chunk in costs.chunk_costs[rank])
        held = np.add.accumulate(np.concatenate(([static], action_change[first:last])))
        during = (held[:-1] + action_working[first:last])[~is_forward[first:last]]
        peak = max(static, float(held[1:].max(initial=-np.inf)), float(during.max(initial=-np.inf)))
        if is_forward[first:last].any():
            peak = max(peak, 0.0)
        peaks.append(peak)
        in_flight.append(max(0, int(np.cumsum(activations[first:last]).max(initial=0))))
    return tuple(peaks), tuple(in_flight)


def _bubble_split(
    schedule: Schedule,
    costs: PipelineCosts,
    iteration_ms: float,
    replay: Callable[[CompiledSchedule, list[float], float], tuple[list[float], list[float]]] = _replay,
) -> BubbleSplit:
    """Split the idle time by what a replay without each cause gives (see BubbleSplit); `iteration_ms`: that
    of `costs`."""
    chunks = costs.all_chunks()
    useful_ms = schedule.micro_batches * sum(c.forward_ms + c.backward_ms for c in chunks)
    if useful_ms <= 0:
        raise InputError("costs", "forward and backward times are all zero: there is no work to schedule")
    compiled = schedule.compiled

    replayed = [(costs.p2p_ms, durations(compiled, costs), iteration_ms)]  # a replay of the same durations is reused

    def makespan(chunk_costs: PipelineCosts) -> float:
        action_ms = durations(compiled, chunk_costs)
        for p2p_ms, same_ms, span_ms in replayed:
            if p2p_ms == chunk_costs.p2p_ms and same_ms == action_ms:
                return span_ms
        span_ms = max(replay(compiled, action_ms, chunk_costs.p2p_ms)[1])
        replayed.append((chunk_costs.p2p_ms, action_ms, span_ms))
        return span_ms

    def share(extra_ms: float) -> float:
        """Iteration time `extra_ms` as a fraction of the useful work per rank."""
        return schedule.ranks * extra_ms / useful_ms

    without_p2p_ms = makespan(PipelineCosts(costs.chunk_costs)) if costs.p2p_ms > 0 else iteration_ms
    count = len(chunks)
    mean = ChunkCosts(
        forward_ms=sum(c.forward_ms for c in chunks) / count,
        backward_ms=sum(c.backward_ms for c in chunks) / count,
        weight_ms=sum(c.split_weight_ms() for c in chunks) / count,
        input_ms=sum(c.split_input_ms() for c in chunks) / count,
    )
    balanced_ms = makespan(PipelineCosts(tuple((mean,) * schedule.chunks for _ in range(schedule.ranks))))
    mean_recompute_ms = sum(c.recompute_ms for c in chunks) / count
    balanced_recompute_ms = balanced_ms
    if mean_recompute_ms > 0:
        with_recompute = dataclasses.replace(mean, recompute_ms=mean_recompute_ms)
        balanced_recompute_ms = makespan(
            PipelineCosts(tuple((with_recompute,) * schedule.chunks for _ in range(schedule.ranks)))
        )

    real = share(iteration_ms) - 1.0
    ideal = share(balanced_ms) - 1.0
    recompute = share(balanced_recompute_ms - balanced_ms)
    comm = share(iteration_ms - without_p2p_ms)
    return BubbleSplit(
        real=real, ideal=ideal, imbalance=real - ideal - recompute - comm, recompute=recompute, comm=comm
    )
