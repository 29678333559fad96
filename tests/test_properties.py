"""Properties of any replay, over random schedules and random stage costs (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import SCHEDULES, ChunkCosts, PipelineCosts, build_schedule, critical_path, simulate

times = st.floats(min_value=0.0, max_value=50.0, allow_nan=False, allow_infinity=False)
sizes = st.integers(min_value=0, max_value=2**34)


@st.composite
def built_schedules(draw):
    """Any schedule kind, 1-6 ranks, its chunks, up to 10 micro-batches past its fewest."""
    name = draw(st.sampled_from(list(SCHEDULES)))
    kind = SCHEDULES[name]
    ranks = draw(st.integers(1, 6))
    chunks = draw(st.integers(kind.min_chunks, kind.max_chunks or 4))
    fewest = kind.min_micro_batches(ranks, chunks)
    return build_schedule(name, ranks, draw(st.integers(fewest, fewest + 10)), chunks)


@st.composite
def replays(draw):
    schedule = draw(built_schedules())
    ranks, chunks = schedule.ranks, schedule.chunks

    def chunk_costs():
        forward = draw(st.floats(0.1, 50.0))
        backward = draw(st.floats(0.1, 50.0))
        weight = draw(st.one_of(st.none(), st.floats(0.0, 1.0).map(lambda share: share * backward)))
        return ChunkCosts(forward, backward, weight, draw(times), draw(sizes), draw(sizes), draw(sizes))

    costs = PipelineCosts(tuple(tuple(chunk_costs() for _ in range(chunks)) for _ in range(ranks)), p2p_ms=draw(times))
    return schedule, costs


def waits_for(action, schedule):
    """The (stage, kind, micro-batch) an action needs first, from the pipeline's meaning alone."""
    last = schedule.num_virtual_stages - 1
    if action.op == "F":
        return [(action.stage_index - 1, ("F",), action.microbatch)] if action.stage_index > 0 else []
    if action.op == "W":
        return [(action.stage_index, ("I",), action.microbatch)]
    needs = [(action.stage_index, ("F",), action.microbatch)]
    if action.stage_index < last:
        needs.append((action.stage_index + 1, ("B", "I"), action.microbatch))
    return needs


@settings(max_examples=150, deadline=None)
@given(replays())
def test_no_action_starts_before_what_it_needs_has_ended(replay):
    schedule, costs = replay
    result = simulate(schedule, costs)
    ended = {}
    for rank in range(schedule.ranks):
        for timed in result.rank_timeline(rank):
            ended[timed.action.stage_index, timed.action.op, timed.action.microbatch] = (timed.end_ms, rank)
    for rank in range(schedule.ranks):
        previous_end = 0.0
        for timed in result.rank_timeline(rank):
            assert timed.start_ms >= previous_end - 1e-9
            previous_end = timed.end_ms
            for stage, kinds, microbatch in waits_for(timed.action, schedule):
                end_ms, other_rank = next(ended[stage, k, microbatch] for k in kinds if (stage, k, microbatch) in ended)
                arrival = end_ms + (costs.p2p_ms if other_rank != rank else 0.0)
                assert timed.start_ms >= arrival - 1e-9


@settings(max_examples=150, deadline=None)
@given(replays())
def test_iteration_time_bounds_and_accounting(replay):
    schedule, costs = replay
    result = simulate(schedule, costs)
    assert result.iteration_time_ms >= max(result.rank_busy_ms) - 1e-9
    work = sum((c.forward_ms + c.backward_ms + c.recompute_ms) * schedule.micro_batches for c in costs.all_chunks())
    assert sum(result.rank_busy_ms) == pytest.approx(work, rel=1e-9)
    bubble = result.bubble
    assert bubble.real >= -1e-9
    assert bubble.real == pytest.approx(bubble.ideal + bubble.imbalance + bubble.recompute + bubble.comm, abs=1e-9)
    for rank in range(schedule.ranks):
        static = sum(c.static_bytes for c in costs.chunk_costs[rank])
        assert result.rank_peak_memory_bytes[rank] >= static
        assert max(b for _, b in result.memory_curve(rank)) == result.rank_peak_memory_bytes[rank]
        assert result.memory_curve(rank)[-1][1] == pytest.approx(static)


@settings(max_examples=150, deadline=None)
@given(replays())
def test_critical_path_is_a_chain_of_waits_as_long_as_the_iteration(replay):
    schedule, costs = replay
    result = simulate(schedule, costs)
    compiled = schedule.compiled
    chain = critical_path(schedule, costs)
    assert result.start_ms[chain[0]] == 0.0
    assert result.end_ms[chain[-1]] == result.iteration_time_ms
    length = 0.0
    for before, after in itertools.pairwise(chain):
        same_rank = compiled.rank[before] == compiled.rank[after]
        assert (same_rank and after == before + 1) or compiled.dependency[after] == before
        length += result.end_ms[before] - result.start_ms[before] + (0.0 if same_rank else costs.p2p_ms)
    length += result.end_ms[chain[-1]] - result.start_ms[chain[-1]]
    assert length == pytest.approx(result.iteration_time_ms, rel=1e-9, abs=1e-9)
