"""The replay in its plain form, action by action in one dependency order: the oracle that the fast replay
(`simulator.replay`) is tested against, result for result. Slow; not for use outside tests and benchmarks."""

from __future__ import annotations

from simulator.compiled import CompiledSchedule
from simulator.costs import PipelineCosts
from simulator.replay import _bubble_split, _check_shape, durations
from simulator.result import SimulationResult
from simulator.schedule import Schedule
from simulator.sharded import rank_memory_peaks


def reference_simulate(schedule: Schedule, costs: PipelineCosts) -> SimulationResult:
    """What `simulate` returns, each figure computed the plain way."""
    _check_shape(schedule, costs)
    compiled = schedule.compiled
    action_ms = durations(compiled, costs)
    start, end = reference_replay(compiled, action_ms, costs.p2p_ms)
    iteration_ms = max(end)
    busy = [0.0] * schedule.ranks
    for action_id, duration in enumerate(action_ms):
        busy[compiled.rank[action_id]] += duration
    peaks, in_flight = zip(*(rank_memory_peaks(compiled, costs, rank) for rank in range(schedule.ranks)))
    return SimulationResult(
        schedule=schedule,
        costs=costs,
        start_ms=start,
        end_ms=end,
        iteration_time_ms=iteration_ms,
        rank_busy_ms=tuple(busy),
        rank_peak_memory_bytes=peaks,
        rank_peak_activations=in_flight,
        bubble=_bubble_split(schedule, costs, iteration_ms, replay=reference_replay),
    )


def reference_critical_path(schedule: Schedule, costs: PipelineCosts) -> list[int]:
    """What `critical_path` returns, from the plain replay."""
    _check_shape(schedule, costs)
    compiled = schedule.compiled
    start, end = reference_replay(compiled, durations(compiled, costs), costs.p2p_ms)
    action = max(range(len(end)), key=end.__getitem__)
    chain = [action]
    while start[action] > 0:
        rank_first = compiled.rank_offsets[compiled.rank[action]]
        if action > rank_first and end[action - 1] == start[action]:
            action -= 1
        else:
            action = compiled.dependency[action]
        chain.append(action)
    return chain[::-1]


def reference_replay(
    compiled: CompiledSchedule, action_ms: list[float], p2p_ms: float
) -> tuple[list[float], list[float]]:
    """Start and end of every action, visiting them in `reference_order`'s order and honouring every dependency."""
    rank, dependency, crosses = compiled.rank, compiled.dependency, compiled.crosses_ranks
    start = [0.0] * len(action_ms)
    end = [0.0] * len(action_ms)
    rank_free = [0.0] * (len(compiled.rank_offsets) - 1)
    for action_id in reference_order(compiled.rank_offsets, compiled.dependency):
        r = rank[action_id]
        begin = rank_free[r]
        dep = dependency[action_id]
        if dep >= 0:
            ready = end[dep] + p2p_ms if crosses[action_id] else end[dep]
            if ready > begin:
                begin = ready
        finish = begin + action_ms[action_id]
        start[action_id] = begin
        end[action_id] = finish
        rank_free[r] = finish
    return start, end


def reference_order(offsets: tuple[int, ...], dependency: list[int]) -> list[int]:
    """An order of every action, each after the one it depends on and its rank predecessor, found action
    by action: each rank runs as far as it can; a rank blocked on an action resumes when that action is done."""
    num_ranks = len(offsets) - 1
    next_id = list(offsets[:-1])
    done = bytearray(offsets[-1])
    waiting: dict[int, list[int]] = {}
    ready = list(range(num_ranks - 1, -1, -1))
    order: list[int] = []
    while ready:
        rank = ready.pop()
        action_id, end = next_id[rank], offsets[rank + 1]
        while action_id < end:
            dep = dependency[action_id]
            if dep >= 0 and not done[dep]:
                waiting.setdefault(dep, []).append(rank)
                break
            done[action_id] = 1
            order.append(action_id)
            ready.extend(waiting.pop(action_id, ()))
            action_id += 1
        next_id[rank] = action_id
    return order
