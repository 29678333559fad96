"""1F1B: rank r runs S-r-1 warm-up forwards, then one forward and one backward in turn, then
the remaining backwards. At most S-r micro-batches are in flight on rank r."""

from __future__ import annotations

from simulator.actions import FORWARD, FULL_BACKWARD, Action


def one_f_one_b_actions(ranks: int, micro_batches: int) -> list[list[Action]]:
    schedule = []
    for rank in range(ranks):
        warmup = min(ranks - rank - 1, micro_batches)
        actions = [Action(rank, FORWARD, m) for m in range(warmup)]
        for backward_mb in range(micro_batches):
            forward_mb = warmup + backward_mb
            if forward_mb < micro_batches:
                actions.append(Action(rank, FORWARD, forward_mb))
            actions.append(Action(rank, FULL_BACKWARD, backward_mb))
        schedule.append(actions)
    return schedule
