"""Interleaved 1F1B: V chunks per rank in loop placement (chunk c of rank r is stage c*S + r).

Both orders walk a table of (micro-batch, chunk) pairs: micro-batches go in groups, and each
group runs through chunk 0, then chunk 1, and so on. Rank r runs `warmup(r)` forwards, then one
forward and one backward in turn, then the remaining backwards. Backwards walk the same table
with the chunk reversed (the last chunk's gradient comes first).

- Megatron's order (`Interleaved1F1B`): groups of `microbatch_group_size_per_vp_stage` G (S by
  default) with a shorter last group; warm-up 2(S-r-1) + (V-1)G. Megatron requires
  S <= G <= M and M mod G = 0 or >= S.
- MindFormers' small-memory order (`Interleaved1F1B-less-memory`): groups of S, the M mod S
  leftover micro-batches joining the first group; warm-up (V-1)(S + M mod S) + S-r-1. In flight
  on rank r: S micro-batches of each chunk but the last, S-r of the last.
"""

from __future__ import annotations

import itertools

from simulator.actions import Action, one_f_one_b_order

Table = list[tuple[int, int]]  # (micro-batch, chunk), in the order forwards run


def megatron_table(micro_batches: int, chunks: int, group_size: int) -> Table:
    """Megatron's `get_schedule_table`: full groups of `group_size`, then the remainder."""
    table: Table = []
    for first in range(0, micro_batches, group_size):
        last = micro_batches if first + group_size >= micro_batches else first + group_size
        table.extend((mb, chunk) for chunk in range(chunks) for mb in range(first, last))
    return table


def leftover_first_table(micro_batches: int, chunks: int, ranks: int) -> Table:
    """MindFormers' table: groups of S (one micro-batch per rank), the first one holding the M mod S
    leftovers too."""
    leftover = micro_batches % ranks
    bounds = [0, *list(range(ranks + leftover, micro_batches + 1, ranks))]
    table: Table = []
    for first, last in itertools.pairwise(bounds):
        table.extend((mb, chunk) for chunk in range(chunks) for mb in range(first, last))
    return table


def default_group_size(ranks: int, micro_batches: int) -> int:
    """S where it divides M; else torch's choice (M over max(1, M // S) rounds) where that divides
    M; else the smallest group Megatron accepts."""
    if micro_batches % ranks == 0:
        return ranks
    rounds = max(1, micro_batches // ranks)
    if micro_batches % rounds == 0:
        return micro_batches // rounds
    return next(g for g in range(ranks, micro_batches + 1) if megatron_accepts(ranks, micro_batches, g))


def megatron_accepts(ranks: int, micro_batches: int, group_size: int) -> bool:
    """Megatron's check on `microbatch_group_size_per_vp_stage`."""
    remainder = micro_batches % group_size
    return ranks <= group_size <= micro_batches and (remainder == 0 or remainder >= ranks)


def megatron_interleaved_actions(ranks: int, chunks: int, micro_batches: int, group_size: int) -> list[list[Action]]:
    table = megatron_table(micro_batches, chunks, group_size)
    return [
        _one_f_one_b_over_table(table, ranks, chunks, rank, 2 * (ranks - rank - 1) + (chunks - 1) * group_size)
        for rank in range(ranks)
    ]


def less_memory_interleaved_actions(ranks: int, chunks: int, micro_batches: int) -> list[list[Action]]:
    table = leftover_first_table(micro_batches, chunks, ranks)
    first_group = ranks + micro_batches % ranks
    # not SAPP's V*S - r - 1, which deadlocks the last rank where S does not divide M
    return [
        _one_f_one_b_over_table(table, ranks, chunks, rank, (chunks - 1) * first_group + ranks - rank - 1)
        for rank in range(ranks)
    ]


def _one_f_one_b_over_table(table: Table, ranks: int, chunks: int, rank: int, warmup: int) -> list[Action]:
    microbatches = [mb for mb, _ in table]
    forward_stages = [chunk * ranks + rank for _, chunk in table]
    backward_stages = [(chunks - 1 - chunk) * ranks + rank for _, chunk in table]
    return one_f_one_b_order((forward_stages, microbatches), (backward_stages, microbatches), warmup)
