"""GPipe: every forward, then every backward (torch's ScheduleGPipe order)."""

from __future__ import annotations

from simulator.actions import FORWARD, FULL_BACKWARD, Action


def gpipe_actions(ranks: int, micro_batches: int) -> list[list[Action]]:
    return [
        [Action(rank, FORWARD, m) for m in range(micro_batches)]
        + [Action(rank, FULL_BACKWARD, m) for m in range(micro_batches)]
        for rank in range(ranks)
    ]
