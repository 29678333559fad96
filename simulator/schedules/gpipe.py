"""GPipe: every forward, then every backward (torch's ScheduleGPipe order)."""

from __future__ import annotations

from simulator.actions import FORWARD, FULL_BACKWARD, Action, make_actions


def gpipe_actions(ranks: int, micro_batches: int) -> list[list[Action]]:
    every = list(range(micro_batches))
    ops = [FORWARD] * micro_batches + [FULL_BACKWARD] * micro_batches
    return [make_actions([rank] * 2 * micro_batches, ops, every + every) for rank in range(ranks)]
