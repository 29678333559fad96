"""The fast replay against its plain form (`simulator.reference`), result for result, over random schedules and
costs of every kind, with and without the N-D memory terms; and a guard on the replay's work per action."""

from __future__ import annotations

import gc
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import built_schedules

from simulator import SCHEDULES, ChunkCosts, PipelineCosts, build_schedule, critical_path, simulate
from simulator.compiled import _travel_order
from simulator.costs import ShardedCosts
from simulator.reference import reference_critical_path, reference_order, reference_simulate
from simulator.schedule import Schedule
from simulator.trace import chrome_trace

times = st.floats(min_value=0.0, max_value=50.0, allow_nan=False, allow_infinity=False)
sizes = st.integers(min_value=0, max_value=2**34).map(float)
SIMULATOR = str(Path(__file__).resolve().parent.parent / "simulator")


@st.composite
def chunk_costs(draw, nd: bool, sharded: bool) -> ChunkCosts:
    forward = draw(st.floats(0.1, 50.0))
    backward = draw(st.floats(0.0, 50.0))
    weight = draw(st.one_of(st.none(), st.floats(0.0, 1.0).map(lambda share: share * backward)))
    activation = draw(sizes)
    terms = {}
    if nd:
        terms = {
            "retained_bytes": draw(sizes),
            "pending_bytes": draw(st.floats(-1.0, 1.0)) * activation,
            "input_ms": draw(st.one_of(st.none(), times)),
            "input_working_bytes": draw(st.one_of(st.none(), sizes)),
            "weight_working_bytes": draw(st.one_of(st.none(), sizes)),
        }
    if sharded and draw(st.booleans()):
        gathered = draw(sizes)
        terms["sharded"] = ShardedCosts(
            gathered_bytes=gathered,
            forward_kept_bytes=draw(st.floats(0.0, 1.0)) * gathered,
            gradient_bytes=draw(sizes),
            reduced_gradient_bytes=draw(sizes),
            backward_gather_working_bytes=draw(sizes),
            reduce_working_bytes=draw(sizes),
        )
    return ChunkCosts(forward, backward, weight, draw(times), activation, draw(sizes), draw(sizes), **terms)


@st.composite
def replays(draw):
    schedule = draw(built_schedules())
    ranks, chunks = schedule.ranks, schedule.chunks
    nd, sharded = draw(st.booleans()), draw(st.booleans())
    if draw(st.booleans()):  # every chunk alike: the balanced replay is the replay itself
        rows = ((draw(chunk_costs(nd, False)),) * chunks,) * ranks
    else:
        rows = tuple(tuple(draw(chunk_costs(nd, sharded)) for _ in range(chunks)) for _ in range(ranks))
    lookahead = draw(st.integers(0, 2)) if sharded else 0
    return schedule, PipelineCosts(rows, p2p_ms=draw(times), unshard_lookahead=lookahead)


def assert_same(schedule, costs):
    fast, plain = simulate(schedule, costs), reference_simulate(schedule, costs)
    assert fast == plain  # start, end, iteration time, busy, peaks, activations held, bubble split
    for rank in range(schedule.ranks):
        assert fast.memory_split(rank) == plain.memory_split(rank)
    assert chrome_trace(fast) == chrome_trace(plain)
    assert critical_path(schedule, costs) == reference_critical_path(schedule, costs)
    assert_runs_in_order(schedule.compiled)


def assert_runs_in_order(compiled):
    """`order` holds every action once, each after the one it depends on and after its rank predecessor."""
    assert sorted(compiled.order) == list(range(compiled.num_actions))
    place = {action: i for i, action in enumerate(compiled.order)}
    for action, dep in enumerate(compiled.dependency):
        assert dep < 0 or place[dep] < place[action]
    for first, last in itertools.pairwise(compiled.rank_offsets):
        assert [place[a] for a in range(first, last)] == sorted(place[a] for a in range(first, last))


@settings(max_examples=300, deadline=None)
@given(replays())
def test_fast_replay_equals_the_plain_one(replay):
    assert_same(*replay)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("nd", [False, True])
def test_every_schedule_kind_equals_the_plain_replay(name, nd):
    kind = SCHEDULES[name]
    ranks, chunks = 4, kind.max_chunks or 3
    schedule = build_schedule(name, ranks, 3 * kind.min_micro_batches(ranks, chunks) + 1, chunks)
    extra = {"retained_bytes": 7.0, "pending_bytes": -3.0, "input_working_bytes": 11.0} if nd else {}
    rows = tuple(
        tuple(
            ChunkCosts(1.0 + 0.1 * rank, 2.3 + chunk, 0.7, 0.2 * chunk, 100.0, 1000.0 + rank, 13.0, **extra)
            for chunk in range(chunks)
        )
        for rank in range(ranks)
    )
    assert_same(schedule, PipelineCosts(rows, p2p_ms=0.05))


def test_an_order_of_ones_own_that_travel_order_breaks_is_walked():
    # rank 1 takes micro-batch 2 first: its first action waits for rank 0's third, a later position
    text = "0F0,0F1,0F2,0B0,0B1,0B2\n1F2,1B2,1F0,1B0,1F1,1B1\n"
    schedule = Schedule.from_csv(text, name="own", chunks=1, micro_batches=3)
    compiled = schedule.compiled
    assert _travel_order(
        np.array(compiled.rank_offsets), np.array(compiled.rank), np.array(compiled.rank),  # one chunk: stage = rank
        np.array([op == "F" for op in compiled.op]), np.array(compiled.dependency),
    ) is None  # fmt: skip
    assert compiled.order == reference_order(compiled.rank_offsets, compiled.dependency)
    assert_same(schedule, PipelineCosts.uniform(2, 1, forward_ms=1.0, backward_ms=2.0, p2p_ms=0.5))


def test_every_schedule_built_runs_in_travel_order():
    """build_schedule's orders hold the order by position and direction of travel, so none is walked."""
    for name, kind in SCHEDULES.items():
        for ranks in range(1, 7):
            for chunks in range(kind.min_chunks, (kind.max_chunks or 3) + 1):
                fewest = kind.min_micro_batches(ranks, chunks)
                for micro_batches in range(fewest, fewest + 2 * ranks + 2):
                    schedule = build_schedule(name, ranks, micro_batches, chunks)
                    order = travel_order(schedule.action_table, schedule.compiled)
                    assert schedule.compiled.order == order, (name, ranks, chunks, micro_batches)


def travel_order(table, compiled):
    """The order by position in a rank's list; at one position, forwards by ascending stage, then backwards by
    descending stage."""
    position = [i - compiled.rank_offsets[rank] for i, rank in enumerate(compiled.rank)]
    stages = table.stage.tolist()
    key = [(p, 0, s) if op == "F" else (p, 1, -s) for p, s, op in zip(position, stages, compiled.op)]
    return sorted(range(len(key)), key=key.__getitem__)


def traced_work(call) -> tuple[int, int]:
    """Lines run and functions called inside simulator/ while `call()` runs."""
    counts = [0, 0]

    def tracer(frame, event, _arg):
        if not frame.f_code.co_filename.startswith(SIMULATOR):
            return None
        counts[1] += 1

        def lines(_frame, event, _arg):
            if event == "line":
                counts[0] += 1
            return lines

        return lines

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return counts[0], counts[1]


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "DualPipeV"])
def test_replay_work_per_action_stays_small(name):
    """Counts, not times: the lines the replay runs per action, and calls that do not grow with the actions."""
    kind = SCHEDULES[name]
    chunks = kind.default_chunks
    costs = PipelineCosts.uniform(
        8, chunks, forward_ms=1.0, backward_ms=2.0, p2p_ms=0.1, activation_bytes=100.0, working_bytes=10.0
    )
    uneven = PipelineCosts(  # the balanced replay and the one without P2P are replays of their own
        tuple(tuple(ChunkCosts(1.0 + rank, 2.0, recompute_ms=0.5) for _ in range(chunks)) for rank in range(8)), 0.1
    )
    small, large = (build_schedule(name, 8, micro_batches, chunks) for micro_batches in (64, 512))
    for schedule in (small, large):
        _ = schedule.compiled
    work = {}
    for schedule in (small, large):
        lines, calls = traced_work(lambda s=schedule: (simulate(s, costs), simulate(s, uneven)))
        path_lines, path_calls = traced_work(lambda s=schedule: critical_path(s, costs))
        work[schedule.num_actions] = (lines, calls, path_lines, path_calls)
    (n_small, small_work), (n_large, large_work) = sorted(work.items())
    lines_per_action = (large_work[0] - small_work[0]) / (n_large - n_small)
    path_lines_per_action = (large_work[2] - small_work[2]) / (n_large - n_small)
    # 5 replays (1 with even costs, 4 without) of some 10 lines an action, and the replay's steps made once
    assert lines_per_action <= 72, lines_per_action
    assert path_lines_per_action <= 11, path_lines_per_action
    assert large_work[1] == small_work[1] and large_work[3] == small_work[3]  # no call per action


def test_no_collector_pass_runs_while_a_schedule_is_built_and_replayed():
    """Counts, not times: the collector's passes over tens of thousands of action tuples cost a large share
    of the work, and none are needed (nothing made there is in a reference cycle). Each call leaves one pass, over
    what it made, to the first allocation after it."""
    passes = []

    def count(phase, _info):
        if phase == "start":
            passes.append(1)

    costs = PipelineCosts.uniform(8, 1, forward_ms=1.0, backward_ms=2.0, activation_bytes=100.0)
    gc.callbacks.append(count)
    try:
        schedule = build_schedule("1F1B", 8, 4096)
        simulate(schedule, costs)
        critical_path(schedule, costs)
    finally:
        gc.callbacks.remove(count)
    assert len(passes) <= 3
    assert gc.isenabled()
    gc.disable()
    try:
        build_schedule("1F1B", 2, 4)
        assert not gc.isenabled()  # as it was
    finally:
        gc.enable()
