"""1F1B: rank r runs S-r-1 warm-up forwards, then one forward and one backward in turn, then
the remaining backwards. At most S-r micro-batches are in flight on rank r."""

from __future__ import annotations

from simulator.actions import Action, one_f_one_b_order


def one_f_one_b_actions(ranks: int, micro_batches: int) -> list[list[Action]]:
    schedule = []
    for rank in range(ranks):
        every = [rank] * micro_batches, list(range(micro_batches))
        schedule.append(one_f_one_b_order(every, every, ranks - rank - 1))
    return schedule
