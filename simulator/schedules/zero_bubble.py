"""Zero-bubble schedules (Qi et al., arXiv 2401.10241): the backward splits into I (input
gradient, on the critical path) and W (weight gradient, deferred to fill bubbles).

- ZB-H1: 1F1B's warm-up; then F, I and, once r backwards are pending, the oldest W. Rank r
  defers r weight gradients, so every rank holds up to S micro-batches (rank 0's 1F1B peak).
  The same order as torch's ScheduleInterleavedZeroBubble with one stage per rank.
- ZB-V: two chunks per rank in a V, so rank 0 holds the first and the last stage (torch's
  ScheduleZBVZeroBubble order).
"""

from __future__ import annotations

from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, as_actions


def zbh1_actions(ranks: int, micro_batches: int) -> list[list[Action]]:
    schedule = []
    for rank in range(ranks):
        warmup = min(ranks - rank - 1, micro_batches)
        rows = [(rank, FORWARD, m, False) for m in range(warmup)]  # made Actions at once, at the end
        next_weight = 0
        for backward_mb in range(micro_batches):
            if warmup + backward_mb < micro_batches:
                rows.append((rank, FORWARD, warmup + backward_mb, False))
            rows.append((rank, BACKWARD_INPUT, backward_mb, False))
            if backward_mb >= rank:
                rows.append((rank, BACKWARD_WEIGHT, next_weight, False))
                next_weight += 1
        rows.extend((rank, BACKWARD_WEIGHT, m, False) for m in range(next_weight, micro_batches))
        schedule.append(as_actions(rows))
    return schedule


def zbv_actions(ranks: int, micro_batches: int) -> list[list[Action]]:
    return [_zbv_rank(ranks, micro_batches, rank) for rank in range(ranks)]


def _zbv_rank(ranks: int, micro_batches: int, rank: int) -> list[Action]:
    # built for at least 2S-1 micro-batches, then those past M dropped: each action waits on its own micro-batch only
    planned = max(2 * ranks - 1, micro_batches)
    down, up = rank, 2 * ranks - 1 - rank  # chunk 0 going down the ranks, chunk 1 coming back
    count = {(down, FORWARD): 0, (up, FORWARD): 0, (down, BACKWARD_INPUT): 0, (up, BACKWARD_INPUT): 0}
    count.update({(down, BACKWARD_WEIGHT): 0, (up, BACKWARD_WEIGHT): 0})
    rows: list[tuple[int, str, int, bool]] = []  # made Actions at once, at the end

    def run(stage: int, op: str) -> None:
        rows.append((stage, op, count[stage, op], False))
        count[stage, op] += 1

    # Warm-up: fill the V down to this rank, then alternate the way back up with the way down.
    for _ in range(2 * (ranks - rank) - 1):
        run(down, FORWARD)
    for _ in range(rank):
        run(up, FORWARD)
        run(down, FORWARD)
    for _ in range(ranks - rank):
        run(up, FORWARD)
        run(up, BACKWARD_INPUT)
        run(up, BACKWARD_WEIGHT)
    # Steady state: F, I, W on each chunk in turn.
    while count[up, FORWARD] < count[down, FORWARD] or count[down, FORWARD] < planned:
        if count[down, FORWARD] < planned:
            run(down, FORWARD)
        run(down, BACKWARD_INPUT)
        run(down, BACKWARD_WEIGHT)
        run(up, FORWARD)
        run(up, BACKWARD_INPUT)
        run(up, BACKWARD_WEIGHT)
    # Cool-down: input gradients first; weight gradients fill in behind them.
    for _ in range(rank):
        run(down, BACKWARD_INPUT)
        run(up, BACKWARD_INPUT)
    for _ in range(ranks - rank):
        run(down, BACKWARD_INPUT)
        run(down, BACKWARD_WEIGHT)
    while count[up, BACKWARD_WEIGHT] < count[up, BACKWARD_INPUT]:
        run(up, BACKWARD_WEIGHT)
    while count[down, BACKWARD_WEIGHT] < count[down, BACKWARD_INPUT]:
        run(down, BACKWARD_WEIGHT)
    return as_actions(row for row in rows if row[2] < micro_batches)
