"""A pipeline schedule as data: each rank's ordered list of compute actions.

Virtual stages (torch's stages, numbered by `stage_index`) run 0..ranks*chunks-1 in model order.
Rank `r` holds chunk `c` of the model as one virtual stage; where that stage sits depends on the
placement: `loop` (interleaved schedules: stage c*R + r) or `v` (ZBV, DualPipeV: the model goes
down the ranks and back up, so rank 0 holds both the first and the last stage).

[Note: placement of virtual stages]

With R ranks and `chunks` chunks per rank there are R x chunks virtual stages. Chunk c of a rank is
the c-th stage it holds in model order, so `chunk_of(stage) = stage // R` under both placements; the
rank differs:

- `loop` (GPipe, 1F1B, ZBH1 with 1 chunk; Interleaved1F1B, Interleaved1F1B-less-memory with 2 or
  more): the model loops over the ranks once per chunk, stage = c*R + r. Between two chunks the
  activation goes from the last rank back to rank 0 (a P2P hop like any other).
- `v` (ZBVZeroBubble, DualPipeV: exactly 2 chunks): chunk 0 goes down the ranks and chunk 1 back up,
  stage = c*R + r for even c and c*R + (R-1-r) for odd c. Rank R-1 holds the turn (stages R-1 and R,
  handed over on the rank, no P2P); rank 0 holds the first and the last stage (embedding and loss).

4 ranks x 2 chunks (stage numbers; model order 0 -> 7)::

                 loop                      v
             chunk 0  chunk 1        chunk 0  chunk 1
    rank 0      0        4              0        7
    rank 1      1        5              1        6
    rank 2      2        6              2        5
    rank 3      3        7              3        4

    loop:  r0 -> r1 -> r2 -> r3 -> r0 -> r1 -> r2 -> r3
    v:     r0 -> r1 -> r2 -> r3 -> r3 -> r2 -> r1 -> r0

`stage_to_rank`, `rank_chunk_to_stage` and `Schedule.rank_of`, `chunk_of`, `stage_index`,
`virtual_stages_of` compute these.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from basics.collector import collector_paused
from basics.files import atomic_write_text
from simulator.actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OPS,
    Action,
    format_rank_cells,
    parse_rank_cells,
)
from simulator.compiled import ActionTable, CompiledSchedule, action_table, compile_schedule
from simulator.errors import ScheduleError

PLACEMENTS = ("loop", "v")
OP_CODE = {op: code for code, op in enumerate(OPS)}


def stage_to_rank(stage_index: int, ranks: int, placement: str) -> int:
    """The rank that runs virtual stage `stage_index` of a pipeline of `ranks` ranks.

    Example:
        >>> [stage_to_rank(stage, 4, "loop") for stage in range(8)]
        [0, 1, 2, 3, 0, 1, 2, 3]
        >>> [stage_to_rank(stage, 4, "v") for stage in range(8)]
        [0, 1, 2, 3, 3, 2, 1, 0]
    """
    chunk, offset = divmod(stage_index, ranks)
    if placement == "v" and chunk % 2 == 1:
        return ranks - 1 - offset
    return offset


def rank_chunk_to_stage(rank: int, chunk: int, ranks: int, placement: str) -> int:
    """The virtual stage index of chunk `chunk` on rank `rank` of a pipeline of `ranks` ranks."""
    if placement == "v" and chunk % 2 == 1:
        return chunk * ranks + ranks - 1 - rank
    return chunk * ranks + rank


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for `ranks` ranks x `chunks` chunks x `micro_batches` micro-batches.

    Made by `simulator.build_schedule` (or `Schedule.from_csv`); checked when made: every (virtual stage,
    micro-batch) has one forward and one full backward (B) or one I and one W, each on the rank that
    holds the stage under `placement` (see the note above).

    Attributes:
        name: the schedule's name as torch.distributed.pipelining gives it ("1F1B", "ZBVZeroBubble", ...).
        ranks: pipeline ranks (`pipeline_parallel`).
        chunks: virtual stages per rank.
        micro_batches: micro-batches per iteration.
        placement: "loop" or "v": which rank holds which virtual stage.
        rank_actions: per rank, its compute actions (`simulator.Action`: F, B, I or W of one virtual stage
            and micro-batch) in the order the rank runs them.

    Raises:
        ScheduleError: on construction, a count below 1, an unknown placement, a missing, repeated or
            misplaced action; `compiled` (and so `simulate`) on an order that deadlocks.

    Example:
        >>> from simulator import build_schedule
        >>> schedule = build_schedule("ZBVZeroBubble", ranks=4, micro_batches=8)
        >>> schedule.describe()
        'ZBVZeroBubble: 4 ranks x 2 chunks, 8 micro-batches'
        >>> schedule.virtual_stages_of(0), schedule.rank_of(7), schedule.chunk_of(7)
        ((0, 7), 0, 1)
        >>> [str(action) for action in schedule.rank_actions[3][:4]]
        ['3F0', '4F0', '3F1', '4F1']
    """

    name: str
    ranks: int
    chunks: int
    micro_batches: int
    placement: str
    rank_actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        _check_actions(self)

    @property
    def num_virtual_stages(self) -> int:
        """Virtual stages in the model: ranks x chunks."""
        return self.ranks * self.chunks

    def describe(self) -> str:
        """`1F1B: 4 ranks x 1 chunk, 8 micro-batches`."""
        chunk_word = "chunk" if self.chunks == 1 else "chunks"
        return f"{self.name}: {self.ranks} ranks x {self.chunks} {chunk_word}, {self.micro_batches} micro-batches"

    @property
    def num_actions(self) -> int:
        return sum(len(actions) for actions in self.rank_actions)

    def rank_of(self, stage_index: int) -> int:
        return stage_to_rank(stage_index, self.ranks, self.placement)

    def chunk_of(self, stage_index: int) -> int:
        return stage_index // self.ranks

    def stage_index(self, rank: int, chunk: int) -> int:
        return rank_chunk_to_stage(rank, chunk, self.ranks, self.placement)

    def virtual_stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages rank `rank` holds, in chunk order (also ascending)."""
        return tuple(self.stage_index(rank, chunk) for chunk in range(self.chunks))

    @cached_property
    def action_table(self) -> ActionTable | None:
        """Every action as arrays (None where one is not a plain Action: its check then says which)."""
        return action_table(self.rank_actions)

    @cached_property
    def compiled(self) -> CompiledSchedule:
        """The schedule compiled for replay (dependencies, a deadlock-free order); raises on deadlock."""
        with collector_paused():
            return compile_schedule(self.name, self.rank_actions, self.chunks, self.micro_batches, self.action_table)

    def to_csv(self) -> str:
        """torch.distributed.pipelining's compute-only CSV: one row per rank, one action per cell."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for actions in self.rank_actions:
            writer.writerow(format_rank_cells(actions))
        return buffer.getvalue()

    def write_csv(self, path: str | Path) -> None:
        atomic_write_text(path, self.to_csv())

    @classmethod
    def from_csv(
        cls,
        text: str,
        *,
        name: str,
        chunks: int,
        micro_batches: int,
        placement: str = "loop",
    ) -> Schedule:
        """Read a compute-only CSV (as torch's `_dump_csv` or `to_csv` writes it)."""
        rows = [row for row in csv.reader(io.StringIO(text)) if row]
        rank_actions = []
        for rank, row in enumerate(rows):
            try:
                rank_actions.append(tuple(parse_rank_cells(row)))
            except ValueError as exc:
                raise ScheduleError(f"csv row {rank}", str(exc)) from None
        return cls(name, len(rows), chunks, micro_batches, placement, tuple(rank_actions))


def _check_actions(schedule: Schedule) -> None:
    """Every (stage, micro-batch) has one forward and either one full backward or one I and one W,
    each on the rank that holds the stage."""
    ranks, chunks, micro_batches = schedule.ranks, schedule.chunks, schedule.micro_batches
    for field, value in (("ranks", ranks), ("chunks", chunks), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(field, f"expected an integer >= 1, got {value!r}")
    if schedule.placement not in PLACEMENTS:
        raise ScheduleError("placement", f"expected one of {PLACEMENTS}, got {schedule.placement!r}")
    if len(schedule.rank_actions) != ranks:
        raise ScheduleError(
            "rank_actions", f"expected one action list per rank ({ranks}), got {len(schedule.rank_actions)}"
        )
    if not _actions_fit(schedule):
        _find_misfit(schedule)


def _actions_fit(schedule: Schedule) -> bool:
    """`_check_actions`' rules over arrays: True where every action fits them (False: look for which one
    does not, action by action)."""
    table = schedule.action_table
    if table is None:
        return False
    ranks, micro_batches = schedule.ranks, schedule.micro_batches
    num_virtual_stages = ranks * schedule.chunks
    stage, microbatch = table.stage, table.microbatch
    if not ((stage >= 0) & (stage < num_virtual_stages) & (microbatch >= 0) & (microbatch < micro_batches)).all():
        return False
    chunk, offset = np.divmod(stage, ranks)
    owner = np.where((chunk % 2 == 1) & (schedule.placement == "v"), ranks - 1 - offset, offset)
    if not (owner == np.repeat(np.arange(ranks), np.diff(table.offsets))).all():
        return False
    counts = np.bincount(
        (stage * micro_batches + microbatch) * 4 + table.op, minlength=num_virtual_stages * micro_batches * 4
    )
    if counts.max(initial=0) > 1:
        return False
    has_f, has_b, has_i, has_w = (
        counts.reshape(-1, 4)[:, OP_CODE[op]] == 1 for op in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    )
    return bool((has_f & ~(has_b & (has_i | has_w)) & (has_b | (has_i & has_w))).all())


def _find_misfit(schedule: Schedule) -> None:
    """Raise ScheduleError on the first action, or (stage, micro-batch), that breaks `_check_actions`' rules."""
    ranks, micro_batches = schedule.ranks, schedule.micro_batches
    num_virtual_stages = ranks * schedule.chunks
    counts = bytearray(num_virtual_stages * micro_batches * 4)
    for rank, actions in enumerate(schedule.rank_actions):
        for position, action in enumerate(actions):
            where = f"rank {rank} action {position} ({action})"
            if action.op not in OP_CODE:
                raise ScheduleError(where, f"unknown op {action.op!r}; expected one of {OPS}")
            if not all(hasattr(n, "__index__") for n in (action.stage_index, action.microbatch)):  # int, numpy ints
                raise ScheduleError(where, "expected an integer stage index and micro-batch")
            if not 0 <= action.stage_index < num_virtual_stages:
                raise ScheduleError(where, f"stage index outside 0..{num_virtual_stages - 1}")
            if not 0 <= action.microbatch < micro_batches:
                raise ScheduleError(where, f"micro-batch outside 0..{micro_batches - 1}")
            owner = stage_to_rank(action.stage_index, ranks, schedule.placement)
            if owner != rank:
                raise ScheduleError(
                    where, f"stage {action.stage_index} runs on rank {owner} ({schedule.placement} placement)"
                )
            slot = (action.stage_index * micro_batches + action.microbatch) * 4 + OP_CODE[action.op]
            if counts[slot]:
                raise ScheduleError(where, "appears twice")
            counts[slot] = 1
    f, b, i, w = (OP_CODE[k] for k in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
    for stage_index in range(num_virtual_stages):
        for microbatch in range(micro_batches):
            base = (stage_index * micro_batches + microbatch) * 4
            has_f, has_b, has_i, has_w = counts[base + f], counts[base + b], counts[base + i], counts[base + w]
            where = f"stage {stage_index} micro-batch {microbatch}"
            if not has_f:
                raise ScheduleError(where, "has no forward")
            if has_b and (has_i or has_w):
                raise ScheduleError(where, "has both a full backward and a split (I/W) backward")
            if not has_b and not (has_i and has_w):
                raise ScheduleError(where, "needs a full backward (B) or both I and W")
