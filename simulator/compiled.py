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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OPS, Action
from simulator.errors import ScheduleError


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

    @property
    def num_actions(self) -> int:
        return len(self.rank)

    @cached_property
    def cost_slot(self) -> list[int]:
        """Per action, where its duration sits in a flat table ordered rank, chunk, op (as OPS)."""
        chunks = max(self.chunk, default=0) + 1
        op_index = {op: i for i, op in enumerate(OPS)}
        return [
            (rank * chunks + chunk) * len(OPS) + op_index[op] for rank, chunk, op in zip(self.rank, self.chunk, self.op)
        ]


def compile_schedule(
    name: str, rank_actions: Sequence[Sequence[Action]], chunks: int, micro_batches: int
) -> CompiledSchedule:
    """Flatten schedule `name`'s per-rank action lists, resolve dependencies and find a replay order;
    raise ScheduleError on deadlock."""
    num_ranks = len(rank_actions)
    num_stages = num_ranks * chunks
    last_stage = num_stages - 1
    ranks: list[int] = []
    chunks: list[int] = []
    ops: list[str] = []
    stage_of: list[int] = []
    microbatch_of: list[int] = []
    offsets = [0]
    for rank, actions in enumerate(rank_actions):
        for action in actions:
            ranks.append(rank)
            chunks.append(action.stage_index // num_ranks)
            ops.append(action.op)
            stage_of.append(action.stage_index)
            microbatch_of.append(action.microbatch)
        offsets.append(len(ranks))

    # Where each (stage, micro-batch) forward and input-gradient action lives.
    forward_id = [-1] * (num_stages * micro_batches)
    input_grad_id = [-1] * (num_stages * micro_batches)
    for action_id, op in enumerate(ops):
        slot = stage_of[action_id] * micro_batches + microbatch_of[action_id]
        if op == FORWARD:
            forward_id[slot] = action_id
        elif op in (FULL_BACKWARD, BACKWARD_INPUT):
            input_grad_id[slot] = action_id

    dependency = [-1] * len(ops)
    for action_id, op in enumerate(ops):
        stage, microbatch = stage_of[action_id], microbatch_of[action_id]
        if op == FORWARD:
            if stage > 0:
                dependency[action_id] = forward_id[(stage - 1) * micro_batches + microbatch]
        elif op == BACKWARD_WEIGHT:
            dependency[action_id] = input_grad_id[stage * micro_batches + microbatch]
        elif stage == last_stage:
            dependency[action_id] = forward_id[stage * micro_batches + microbatch]
        else:
            dependency[action_id] = input_grad_id[(stage + 1) * micro_batches + microbatch]
    crosses = [dep >= 0 and ranks[dep] != ranks[i] for i, dep in enumerate(dependency)]

    order = _dependency_order(offsets, dependency)
    if len(order) < len(ops):
        raise ScheduleError(f"schedule {name}", _deadlock_report(rank_actions, offsets, order, dependency))
    return CompiledSchedule(tuple(offsets), ranks, chunks, ops, dependency, crosses, order)


def _dependency_order(offsets: list[int], dependency: list[int]) -> list[int]:
    """Run each rank as far as it can; a rank blocked on an action resumes when that action is done."""
    num_ranks = len(offsets) - 1
    next_id = offsets[:-1]
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
            woken = waiting.pop(action_id, None)
            if woken:
                ready.extend(woken)
            action_id += 1
        next_id[rank] = action_id
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
