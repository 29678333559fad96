"""Whether a search can return within its time limit at all: what it must do whatever the limit (build
the schedule, the program, the plan found without search, and replay it) grows with the actions."""

import math

from basics.errors import InputError
from simulator.schedules import schedule_kind

# What any search must do took about 13 us an action at 0.4 M actions on the machine measured
# (docs/results/benchmarks.md): a search is refused where it cannot return within its limit.
SECONDS_PER_ACTION = 16e-6
GRACE_S = 1.0  # past the limit: however small the limit, a small schedule still gets its plan found without search


def check_time_limit(
    schedule: str | None, ranks: int, chunks: int | None, micro_batches: int, time_limit_s: float
) -> None:
    """Refuse a schedule whose actions take longer to build and replay than `time_limit_s` (inf: none)
    and GRACE_S, before any is built: an InputError naming the count that makes it large (`micro_batches`,
    `pipeline_parallel` or `chunks`, the largest) and how many would fit. `chunks` None: the schedule's default;
    `schedule` None: the one with the fewest actions (a forward and a backward per micro-batch)."""
    if math.isinf(time_limit_s):
        return
    kind = None if schedule is None else schedule_kind(schedule)
    chunks = (1 if kind is None else kind.default_chunks) if chunks is None else chunks
    per_micro_batch_per_stage = 3 if kind is not None and kind.splits_backward else 2
    actions = ranks * chunks * micro_batches * per_micro_batch_per_stage
    seconds = actions * SECONDS_PER_ACTION
    if seconds <= time_limit_s + GRACE_S:
        return
    counts = {"micro_batches": micro_batches, "pipeline_parallel": ranks, "chunks": chunks}
    largest = max(counts, key=counts.__getitem__)  # the count that went astray, most likely
    fitting = math.floor((time_limit_s + GRACE_S) / (seconds / counts[largest]))
    noun = {"micro_batches": "micro-batches", "pipeline_parallel": "ranks", "chunks": "chunks"}[largest]
    what_fits = f"at most {fitting:,} {noun} fit it, or allow more time" if fitting else "allow more time"
    raise InputError(
        largest,
        f"{ranks:,} x {chunks:,} x {micro_batches:,} (ranks x chunks x micro-batches) make {actions:,} "
        f"{'' if kind is None else kind.name + ' '}actions, which take about {seconds:,.0f} s to build and replay (some "
        f"{SECONDS_PER_ACTION * 1e6:g} us each), more than the time limit of {time_limit_s:.3g} s: {what_fits}",
    )
