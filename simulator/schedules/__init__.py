"""The schedules sapp-hook knows, by the names torch.distributed.pipelining gives them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from basics.collector import without_collector
from basics.deprecation import renamed_keywords
from basics.errors import InputError, shown
from simulator.actions import Action
from simulator.schedule import Schedule
from simulator.schedules.dualpipev import dualpipev_actions
from simulator.schedules.gpipe import gpipe_actions
from simulator.schedules.interleaved import (
    default_group_size,
    less_memory_interleaved_actions,
    megatron_accepts,
    megatron_interleaved_actions,
)
from simulator.schedules.one_f_one_b import one_f_one_b_actions
from simulator.schedules.zero_bubble import zbh1_actions, zbv_actions

# a replay holds every action, some 400 bytes each: a typo must not exhaust memory before anything is said
MAX_ACTIONS = 10_000_000


@dataclass(frozen=True)
class ScheduleKind:
    """A named schedule: where its chunks sit, how many it takes, and how to build its actions."""

    name: str
    summary: str
    placement: str
    min_chunks: int
    max_chunks: int | None  # None: no upper bound
    min_micro_batches: Callable[[int, int], int]  # (ranks, chunks) -> fewest micro-batches
    build: Callable[[int, int, int], list[list[Action]]]  # (ranks, chunks, micro_batches)
    splits_backward: bool = False  # runs I and W actions, so the weight-gradient time matters

    @property
    def default_chunks(self) -> int:
        return self.min_chunks


SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind(
            "GPipe",
            "all forwards, then all backwards",
            "loop",
            1,
            1,
            lambda s, v: 1,
            lambda s, v, m: gpipe_actions(s, m),
        ),
        ScheduleKind(
            "1F1B",
            "warm-up forwards, then one forward and one backward in turn",
            "loop",
            1,
            1,
            lambda s, v: 1,
            lambda s, v, m: one_f_one_b_actions(s, m),
        ),
        ScheduleKind(
            "Interleaved1F1B",
            "Megatron's interleaved 1F1B over V chunks per rank",
            "loop",
            2,
            None,
            lambda s, v: s,
            lambda s, v, m: megatron_interleaved_actions(s, v, m, default_group_size(s, m)),
        ),
        ScheduleKind(
            "Interleaved1F1B-less-memory",
            "MindFormers' small-memory interleaved order: fewer forwards in flight",
            "loop",
            2,
            None,
            lambda s, v: s,
            lambda s, v, m: less_memory_interleaved_actions(s, v, m),
        ),
        ScheduleKind(
            "ZBH1",
            "1F1B with weight gradients deferred into the bubbles (zero bubble H1)",
            "loop",
            1,
            1,
            lambda s, v: 1,
            lambda s, v, m: zbh1_actions(s, m),
            splits_backward=True,
        ),
        ScheduleKind(
            "ZBVZeroBubble",
            "zero bubble V: two chunks per rank in a V, W deferred",
            "v",
            2,
            2,
            lambda s, v: 1,
            lambda s, v, m: zbv_actions(s, m),
            splits_backward=True,
        ),
        ScheduleKind(
            "DualPipeV",
            "DeepSeek's DualPipeV: two chunks in a V, forward and backward overlapped",
            "v",
            2,
            2,
            lambda s, v: 2 * s,
            lambda s, v, m: dualpipev_actions(s, m),
            splits_backward=True,
        ),
    )
}


def schedule_kind(name: str) -> ScheduleKind:
    """Look a schedule up by name, case-insensitive, with or without torch's `Schedule` prefix."""
    if not isinstance(name, str):
        raise InputError("schedule", f"expected a schedule's name (one of {', '.join(SCHEDULES)}), got {shown(name)}")
    wanted = name.strip().lower().removeprefix("schedule")
    for kind in SCHEDULES.values():
        if kind.name.lower() == wanted:
            return kind
    raise InputError("schedule", f"expected one of {', '.join(SCHEDULES)}, got {shown(name)}")


@renamed_keywords(stages="ranks")
@without_collector
def build_schedule(
    name: str,
    ranks: int,
    micro_batches: int,
    chunks: int | None = None,
    *,
    microbatch_group_size: int | None = None,
) -> Schedule:
    """Build the action lists of schedule `name` for `ranks` ranks, `chunks` chunks per rank
    (the schedule's own count when None) and `micro_batches` micro-batches.

    Args:
        name: a schedule of `SCHEDULES` (GPipe, 1F1B, Interleaved1F1B, Interleaved1F1B-less-memory, ZBH1,
            ZBVZeroBubble, DualPipeV), case-insensitive, with or without torch's `Schedule` prefix.
        ranks: pipeline ranks (`pipeline_parallel`), at least 1.
        micro_batches: micro-batches per iteration, at least the schedule's fewest (1; `ranks` for the
            interleaved schedules; 2 x `ranks` for DualPipeV).
        chunks: virtual stages per rank; None: the schedule's own (1; 2 for the interleaved and V
            schedules). 1F1B, GPipe and ZBH1 take exactly 1, the V schedules exactly 2, the
            interleaved ones 2 or more.
        microbatch_group_size: Megatron's `microbatch_group_size_per_vp_stage` (Interleaved1F1B only):
            `ranks` <= G <= `micro_batches` with `micro_batches` mod G = 0 or >= `ranks`; None: `ranks`
            where it divides `micro_batches`, else torch's choice or the smallest group Megatron accepts.

    Returns:
        The `Schedule`: every rank's action list, with the schedule's placement of virtual stages.

    Raises:
        InputError: naming the field: an unknown `name`; a count that is not an integer >= 1; `chunks` the
            schedule does not run; too few `micro_batches`; more than `MAX_ACTIONS` actions (naming the
            largest count); a `microbatch_group_size` for another schedule or one Megatron refuses.

    Example:
        >>> schedule = build_schedule("Interleaved1F1B", ranks=4, micro_batches=8)
        >>> schedule.describe(), schedule.placement, schedule.num_actions
        ('Interleaved1F1B: 4 ranks x 2 chunks, 8 micro-batches', 'loop', 128)
        >>> " ".join(str(action) for action in build_schedule("1F1B", 2, 3).rank_actions[0])
        '0F0 0F1 0B0 0F2 0B1 0B2'
    """
    kind = schedule_kind(name)
    _check_count("ranks", ranks, 1)
    _check_count("micro_batches", micro_batches, 1)
    if chunks is None:
        chunks = kind.default_chunks
    _check_count("chunks", chunks, 1)
    if chunks < kind.min_chunks or (kind.max_chunks is not None and chunks > kind.max_chunks):
        if kind.min_chunks == kind.max_chunks:
            allowed = f"exactly {kind.min_chunks} chunk{'s' if kind.min_chunks > 1 else ''}"
        else:
            allowed = f"{kind.min_chunks} or more chunks"
        raise InputError("chunks", f"{kind.name} runs {allowed} per rank, got {chunks}")
    actions = ranks * chunks * micro_batches * (3 if kind.splits_backward else 2)
    if actions > MAX_ACTIONS:
        counts = {"micro_batches": micro_batches, "ranks": ranks, "chunks": chunks}
        largest = max(counts, key=counts.__getitem__)  # the count that went astray, most likely
        raise InputError(
            largest,
            f"{_count(ranks)} x {_count(chunks)} x {_count(micro_batches)} (ranks x chunks x micro-batches) make "
            f"{_count(actions)} actions; expected at most {MAX_ACTIONS:,} (a million take about 2 s and 0.5 GB to build and replay)",
        )
    fewest = kind.min_micro_batches(ranks, chunks)
    if micro_batches < fewest:
        raise InputError(
            "micro_batches",
            f"{kind.name} on {ranks} ranks needs at least {fewest} micro-batches, got {micro_batches}",
        )

    if microbatch_group_size is not None:
        if kind.name != "Interleaved1F1B":
            raise InputError("microbatch_group_size", f"applies to Interleaved1F1B only, not {kind.name}")
        _check_count("microbatch_group_size", microbatch_group_size, 1)
        if not megatron_accepts(ranks, micro_batches, microbatch_group_size):
            raise InputError(
                "microbatch_group_size",
                f"expected {ranks} <= G <= {micro_batches} with {micro_batches} mod G = 0 or >= {ranks} "
                f"(Megatron's rule), got {microbatch_group_size}",
            )
        rank_actions = megatron_interleaved_actions(ranks, chunks, micro_batches, microbatch_group_size)
    else:
        rank_actions = kind.build(ranks, chunks, micro_batches)

    return Schedule(
        name=kind.name,
        ranks=ranks,
        chunks=chunks,
        micro_batches=micro_batches,
        placement=kind.placement,
        rank_actions=tuple(tuple(actions) for actions in rank_actions),
    )


def _check_count(field: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(field, f"expected an integer >= {least}, got {shown(value)}")


def _count(number: int) -> str:
    """A count in an error line: with thousands separators, a number past any real one cut short."""
    return f"{number:,}" if number < 10**30 else shown(number)
