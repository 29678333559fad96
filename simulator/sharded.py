"""A rank's memory action by action, data parallelism's state within the step included: the chunks'
gathered parameters, their gradients between the first weight-gradient action and the reduce after the
last, and the working sets of gathering and reducing (`ShardedCosts`).

Each chunk's parameters are gathered whole by its first forward (or, with `unshard_lookahead`, by
torch's runtime schedules ahead of their actions: `torch_unshard_events`), stay so where forwards do
not re-shard, and are released by the reduce. Where forwards re-shard, a forward leaves only
`forward_kept_bytes` gathered and the next backward gathers the rest again (a backward never re-shards).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from simulator.compiled import CompiledSchedule
from simulator.costs import ChunkCosts, PipelineCosts, ShardedCosts

UNSHARD, RESHARD = "UNSHARD", "RESHARD"


@dataclass(frozen=True)
class MemoryPoint:
    """One action of a rank: what is held once it (and the reduce it ends with) is done, and of that what
    data parallelism holds within the step (gathered parameters, step gradients); and the moment it held
    the most: those bytes (None: no more than before or after it), what was held then beneath the working
    set on top, and of that what data parallelism held."""

    held_bytes: float
    sharded_bytes: float
    during_bytes: float | None = None
    during_base_bytes: float = 0.0
    during_sharded_bytes: float = 0.0


@dataclass
class _ChunkState:
    gathered: float = 0.0
    gradients: bool = False


def torch_unshard_events(chunks: Sequence[int], lookahead: int) -> list[list[tuple[str, int]]]:
    """Per action of a rank (the chunk of each, in order), the (UNSHARD or RESHARD, chunk) events torch's
    runtime schedules run before it (`_add_unshard_reshard`): the next `lookahead` distinct chunks the
    rank will run are gathered, the others it holds gathered released; one list more for after the
    last action. Empty lists for `lookahead` 0."""
    events: list[list[tuple[str, int]]] = [[] for _ in range(len(chunks) + 1)]
    if not lookahead:
        return events
    active: list[int] = []
    for index in range(len(chunks)):
        upcoming = list(dict.fromkeys(chunks[index:]))[:lookahead]
        for chunk in [c for c in active if c not in upcoming]:
            active.remove(chunk)
            events[index].append((RESHARD, chunk))
        for chunk in [c for c in upcoming if c not in active]:
            active.append(chunk)
            events[index].append((UNSHARD, chunk))
    events[-1] = [(RESHARD, chunk) for chunk in active]
    return events


def memory_points(
    ops: Sequence[tuple[int, str]], row: Sequence[ChunkCosts], unshard_lookahead: int = 0
) -> Iterator[MemoryPoint]:
    """The rank's memory at each of its actions (`ops`: (chunk, op) in order; `row`: its chunks' costs),
    from its static bytes."""
    memory = sum(chunk.static_bytes for chunk in row)
    if all(chunk.sharded is None for chunk in row):
        for chunk_index, op in ops:
            chunk = row[chunk_index]
            base = memory
            memory += chunk.held_change_bytes(op)
            yield MemoryPoint(
                memory, 0.0, *((None,) if op == FORWARD else (base + chunk.working_bytes_during(op), base))
            )
        return
    last_weight = {chunk: index for index, (chunk, op) in enumerate(ops) if op in (FULL_BACKWARD, BACKWARD_WEIGHT)}
    events = torch_unshard_events([chunk for chunk, _ in ops], unshard_lookahead)
    states = [_ChunkState() for _ in row]
    sharded = 0.0
    for index, (chunk_index, op) in enumerate(ops):
        chunk, state, costs = row[chunk_index], states[chunk_index], row[chunk_index].sharded
        moved = _unshard_events(events[index], row, states)
        memory += moved
        sharded += moved
        most: list[float] = [memory, memory, sharded] if moved > 0 else []  # (bytes, beneath the working set, sharded)
        if costs is None:
            if op != FORWARD:
                _see(most, memory, chunk.working_bytes_during(op), sharded)
            memory += chunk.held_change_bytes(op)
            yield MemoryPoint(memory, sharded, *most)
            continue
        if op == FORWARD:
            working = _forward_working(costs, state.gathered)
            if working:
                _see(most, memory, working, sharded)
            change = costs.forward_kept_bytes - state.gathered
            state.gathered = costs.forward_kept_bytes
        else:
            working, arriving = _backward_working(chunk, op, state)
            if arriving is None:
                memory += costs.gradient_bytes
                sharded += costs.gradient_bytes
            _see(most, memory, working + costs.layer_gather_bytes, sharded)
            change = costs.gathered_bytes - state.gathered + (arriving or 0.0)
            state.gathered = costs.gathered_bytes
        memory += change + chunk.held_change_bytes(op)
        sharded += change
        if last_weight.get(chunk_index) == index:  # the chunk's reduce
            _see(most, memory, costs.reduce_working_bytes, sharded)
            released = (
                state.gathered + (costs.gradient_bytes if state.gradients else 0.0) - costs.reduced_gradient_bytes
            )
            memory -= released
            sharded -= released
            state.gathered, state.gradients = 0.0, False
        yield MemoryPoint(memory, sharded, *most)


def rank_memory_peaks(compiled: CompiledSchedule, costs: PipelineCosts, rank: int) -> tuple[float, int]:
    """Peak bytes and peak number of activations held on `rank`, walking its `memory_points`."""
    row = costs.chunk_costs[rank]
    peak = sum(chunk.static_bytes for chunk in row)
    held = peak_held = 0
    first, last = compiled.rank_offsets[rank], compiled.rank_offsets[rank + 1]
    ops = list(zip(compiled.chunk[first:last], compiled.op[first:last]))
    for (_, op), point in zip(ops, memory_points(ops, row, costs.unshard_lookahead)):
        if op == FORWARD:
            held += 1
            peak_held = max(peak_held, held)
        elif op != BACKWARD_INPUT:
            held -= 1
        peak = max(peak, point.held_bytes, point.during_bytes or 0.0)
    return peak, peak_held


def _backward_working(chunk: ChunkCosts, op: str, state: _ChunkState) -> tuple[float, float | None]:
    """A backward action's working set, and the step gradients it makes (marking them made in `state`):
    0 where it makes none, their bytes where they arrive layer by layer within the working set given,
    None where the working set does not count them and they are held from the action's start. Arriving
    ones count in the working set at its peak, not in `MemoryPoint.during_sharded_bytes`: the total is
    exact, its split is not."""
    costs = chunk.sharded
    assert costs is not None
    regathers = state.gathered < costs.gathered_bytes
    working = costs.backward_gather_working_bytes if regathers else chunk.working_bytes_during(op)
    if op == BACKWARD_INPUT or state.gradients:
        return working, 0.0
    state.gradients = True
    first = costs.first_backward_gather_working_bytes if regathers else costs.first_backward_working_bytes
    if op != FULL_BACKWARD or first is None:
        return working, None
    return first, costs.gradient_bytes


def _see(most: list[float], memory: float, working: float, sharded: float) -> None:
    """Keep in `most` the moment holding the most: (bytes, beneath the working set, of them sharded)."""
    if not most or memory + working > most[0]:
        most[:] = [memory + working, memory, sharded]


def _forward_working(costs: ShardedCosts, gathered: float) -> float:
    """What a forward holds above its start for gathering, given what it finds gathered."""
    if not costs.gathered_bytes:  # nothing stays gathered: every forward gathers each layer (ZeRO-3)
        return costs.forward_gather_working_bytes
    return 0.0 if gathered >= costs.gathered_bytes else costs.forward_gather_working_bytes


def _unshard_events(events: list[tuple[str, int]], row: Sequence[ChunkCosts], states: list[_ChunkState]) -> float:
    """Apply torch's UNSHARD and RESHARD events; what they add to the held bytes."""
    moved = 0.0
    for event, chunk_index in events:
        costs, state = row[chunk_index].sharded, states[chunk_index]
        if costs is None:
            continue
        target = costs.gathered_bytes if event == UNSHARD else 0.0
        moved += target - state.gathered
        state.gathered = target
    return moved
