"""A schedule compiled for fast replay: one dependency per action and an order that respects all.

Each action waits for the end of the previous action on its rank and for at most one action on
another rank (or on its own rank, at the turn of a V):

- F(s, m) waits for F(s-1, m): the activation coming forward;
- B(s, m) or I(s, m) waits for the input-gradient action of stage s+1 on m, or, on the last
  stage, for its own F(s, m) (the loss);
- W(s, m) waits for I(s, m) on the same rank.

B or I also needs F(s, m) of its own stage; that is implied, since the gradient it waits for
comes back through the forward chain.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OPS, Action
from simulator.errors import ScheduleError

OP_INDEX = {op: i for i, op in enumerate(OPS)}
_OP_OF_LETTER = np.full(256, -1, dtype=np.int8)
_OP_OF_LETTER[[ord(op) for op in OPS]] = range(len(OPS))


@dataclass(frozen=True)
class ActionTable:
    """Every action of a schedule as arrays, rank by rank in schedule order."""

    offsets: np.ndarray  # action id of each rank's first action; last entry = total
    stage: np.ndarray
    op: np.ndarray  # index in OPS
    microbatch: np.ndarray
    ops: tuple[str, ...]


@dataclass(frozen=True)
class CompiledSchedule:
    """Flat arrays over all actions, numbered rank by rank in schedule order."""

    rank_offsets: tuple[int, ...]  # action id of each rank's first action; last entry = total
    rank: list[int]
    chunk: list[int]
    op: list[str]
    dependency: list[int]  # the action id waited for, -1 for none
    crosses_ranks: list[bool]  # the dependency is on another rank: its output travels by P2P
    order: list[int]  # every action id, each after the one it depends on and its rank predecessor
    # per action, where its duration sits in a flat table ordered rank, chunk, op (as OPS)
    cost_slot: np.ndarray = field(compare=False, repr=False)
    # along `order`: each action's rank, and the action it waits for where that one ran on another rank,
    # else -1 (one on its own rank ends before the action's rank predecessor does)
    replay_steps: tuple[list[int], list[int]] = field(compare=False, repr=False)

    @property
    def num_actions(self) -> int:
        return len(self.rank)


def compile_schedule(
    name: str,
    rank_actions: Sequence[Sequence[Action]],
    chunks: int,
    micro_batches: int,
    table: ActionTable | None = None,
) -> CompiledSchedule:
    """Flatten schedule `name`'s per-rank action lists (`table`: them as arrays, where already made), resolve
    dependencies and find a replay order; raise ScheduleError on deadlock."""
    table = table or action_table(rank_actions)
    if table is None:
        raise ScheduleError(f"schedule {name}", "expected Action lists with ops among F, B, I, W")
    num_ranks = len(rank_actions)
    num_stages = num_ranks * chunks
    offsets = table.offsets
    rank = np.repeat(np.arange(num_ranks), np.diff(offsets))
    stage, op = table.stage, table.op
    ids = np.arange(len(op))
    slot = stage * micro_batches + table.microbatch

    # Where each (stage, micro-batch) forward and input-gradient action lives.
    forward_id = np.full(num_stages * micro_batches, -1)
    input_grad_id = np.full(num_stages * micro_batches, -1)
    is_forward = op == OP_INDEX[FORWARD]
    makes_input_grad = (op == OP_INDEX[FULL_BACKWARD]) | (op == OP_INDEX[BACKWARD_INPUT])
    forward_id[slot[is_forward]] = ids[is_forward]
    input_grad_id[slot[makes_input_grad]] = ids[makes_input_grad]

    dependency = np.full(len(op), -1)
    waits_forward = is_forward & (stage > 0)
    dependency[waits_forward] = forward_id[slot[waits_forward] - micro_batches]
    is_weight = op == OP_INDEX[BACKWARD_WEIGHT]
    dependency[is_weight] = input_grad_id[slot[is_weight]]
    on_last = makes_input_grad & (stage == num_stages - 1)
    dependency[on_last] = forward_id[slot[on_last]]
    from_next = makes_input_grad & (stage < num_stages - 1)
    dependency[from_next] = input_grad_id[slot[from_next] + micro_batches]
    crosses = (dependency >= 0) & (rank[dependency] != rank)

    offset_list = offsets.tolist()
    dependency_list = dependency.tolist()
    order = _travel_order(offsets, rank, stage, is_forward, dependency)
    if order is None:
        walked = _dependency_order(offset_list, dependency_list)
        if len(walked) < len(op):
            raise ScheduleError(
                f"schedule {name}", _deadlock_report(rank_actions, offset_list, walked, dependency_list)
            )
        order = np.array(walked, dtype=np.int64)
    chunk = stage // num_ranks
    waits = np.where(crosses, dependency, -1)
    return CompiledSchedule(
        tuple(offset_list),
        rank.tolist(),
        chunk.tolist(),
        list(table.ops),
        dependency_list,
        crosses.tolist(),
        order.tolist(),
        cost_slot=(rank * chunks + chunk) * len(OPS) + op,
        replay_steps=(rank[order].tolist(), waits[order].tolist()),
    )


def action_table(rank_actions: Sequence[Sequence[Action]]) -> ActionTable | None:
    """The actions as arrays; None where one is not a plain Action (an op outside OPS, a stage or
    micro-batch that is not an integer)."""
    flat = [action for actions in rank_actions for action in actions]
    offsets = np.cumsum([0, *(len(actions) for actions in rank_actions)])
    if not flat:
        empty = np.zeros(0, dtype=np.int64)
        return ActionTable(offsets, empty, empty, empty, ())
    try:
        stages, ops, microbatches = (tuple(map(itemgetter(field), flat)) for field in range(3))
        letters = np.frombuffer("".join(ops).encode("ascii"), dtype=np.uint8)
        if len(letters) != len(flat):
            return None
        # an int64 array refuses what is not an integer (a float, a string) in one pass, where numpy would cast
        stage, microbatch = (np.frombuffer(array("q", numbers), dtype=np.int64) for numbers in (stages, microbatches))
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    op = _OP_OF_LETTER[letters]
    if (op < 0).any():
        return None
    return ActionTable(offsets, stage, op, microbatch, ops)


def _travel_order(
    offsets: np.ndarray, rank: np.ndarray, stage: np.ndarray, is_forward: np.ndarray, dependency: np.ndarray
) -> np.ndarray | None:
    """The actions by their position in their rank's list, those at one position ordered the way each
    travels: forwards by ascending stage, then backwards by descending stage. None where that order runs
    an action before the one it depends on (a schedule of one's own may); every schedule `build_schedule`
    makes holds it, and checking it takes a few array passes where finding an order takes a step per action."""
    count = len(rank)
    position = np.arange(count) - offsets[:-1][rank]
    stages = int(stage.max(initial=0)) + 1
    travel = np.where(is_forward, stage, 2 * stages - 1 - stage)
    order = np.argsort(position * (2 * stages) + travel, kind="stable")
    place = np.empty(count, dtype=np.int64)
    place[order] = np.arange(count)
    waits = dependency >= 0
    if not (place[dependency[waits]] < place[waits]).all():
        return None
    return order


def _dependency_order(offsets: list[int], dependency: list[int]) -> list[int]:
    """Run each rank as far as it can; a rank blocked on an action resumes when that action is done."""
    num_ranks = len(offsets) - 1
    next_id = offsets[:-1]
    done = bytearray(offsets[-1])
    waiting: list[list[int] | None] = [None] * offsets[-1]  # per action, the ranks blocked on it
    ready = list(range(num_ranks - 1, -1, -1))
    order: list[int] = []
    while ready:
        rank = ready.pop()
        first = action_id = next_id[rank]
        end = offsets[rank + 1]
        while action_id < end:
            dep = dependency[action_id]
            if dep >= 0 and not done[dep]:
                if waiting[dep] is None:
                    waiting[dep] = [rank]
                else:
                    waiting[dep].append(rank)
                break
            done[action_id] = 1
            woken = waiting[action_id]
            if woken is not None:
                ready.extend(woken)
            action_id += 1
        next_id[rank] = action_id
        order.extend(range(first, action_id))
    return order


def _deadlock_report(
    rank_actions: Sequence[Sequence[Action]], offsets: list[int], order: list[int], dependency: list[int]
) -> str:
    done = set(order)
    flat = [action for actions in rank_actions for action in actions]
    blocked = []
    for rank in range(len(rank_actions)):
        first_pending = next((i for i in range(offsets[rank], offsets[rank + 1]) if i not in done), None)
        if first_pending is not None:
            waits_for = flat[dependency[first_pending]]
            blocked.append(f"rank {rank} at {flat[first_pending]} waits for {waits_for}")
        if len(blocked) == 4:
            break
    return "deadlock: " + "; ".join(blocked)
