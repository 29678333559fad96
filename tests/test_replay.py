"""Replay: textbook makespans, exact timing and memory semantics, the bubble split, bad costs."""

from __future__ import annotations

import dataclasses

import pytest

from simulator import ChunkCosts, InputError, PipelineCosts, build_schedule, simulate


def iteration_ms(name, ranks, micro_batches, chunks=None, **costs):
    schedule = build_schedule(name, ranks, micro_batches, chunks)
    return simulate(schedule, PipelineCosts.uniform(schedule.ranks, schedule.chunks, **costs)).iteration_time_ms


CASES = [(s, m) for s in (1, 2, 3, 4, 8) for m in (1, 2, s, s + 1, 2 * s, 3 * s + 1)]
TIMES = [(1.0, 2.0), (1.5, 2.5), (3.0, 1.0)]


@pytest.mark.parametrize("name", ["1F1B", "GPipe"])
@pytest.mark.parametrize("ranks, micro_batches", CASES)
@pytest.mark.parametrize("forward, backward", TIMES)
def test_1f1b_and_gpipe_makespan(name, ranks, micro_batches, forward, backward):
    expected = (micro_batches + ranks - 1) * (forward + backward)
    assert iteration_ms(name, ranks, micro_batches, forward_ms=forward, backward_ms=backward) == pytest.approx(
        expected, rel=1e-12
    )


@pytest.mark.parametrize("name", ["Interleaved1F1B", "Interleaved1F1B-less-memory"])
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 3])
@pytest.mark.parametrize("forward, backward", TIMES)
def test_interleaved_makespan(name, ranks, chunks, extra, forward, backward):
    # F and B are a whole rank's times; each chunk runs F/V and B/V. Holds for M not a multiple of S too.
    micro_batches = 2 * ranks + extra
    expected = micro_batches * (forward + backward) + (ranks - 1) * (forward + backward) / chunks
    actual = iteration_ms(name, ranks, micro_batches, chunks, forward_ms=forward, backward_ms=backward)
    assert actual == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("ranks, micro_batches", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 8), (8, 17)])
@pytest.mark.parametrize(
    "forward, input_grad, weight", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.5, 2.0, 1.2)]
)
def test_zbh1_makespan(ranks, micro_batches, forward, input_grad, weight):
    # M(F+B) + (S-1)(F+B-2W), with B the full backward, while M >= S and W <= min(F, I):
    # the deferred weight gradients then fit the cool-down bubbles.
    backward = input_grad + weight
    expected = micro_batches * (forward + backward) + (ranks - 1) * (forward + backward - 2 * weight)
    actual = iteration_ms("ZBH1", ranks, micro_batches, forward_ms=forward, backward_ms=backward, weight_ms=weight)
    assert actual == pytest.approx(expected, rel=1e-12)


def test_p2p_time_is_paid_between_ranks_only():
    # 2 ranks, 1 micro-batch, F=1, B=2, P2P 0.5:
    # rank 0 F [0,1]; rank 1 F [1.5,2.5] then B [2.5,4.5] (same rank: no P2P); rank 0 B [5,7].
    schedule = build_schedule("1F1B", 2, 1)
    result = simulate(schedule, PipelineCosts.uniform(2, 1, forward_ms=1.0, backward_ms=2.0, p2p_ms=0.5))
    rank0, rank1 = result.rank_timeline(0), result.rank_timeline(1)
    assert [(t.start_ms, t.end_ms) for t in rank0] == [(0.0, 1.0), (5.0, 7.0)]
    assert [(t.start_ms, t.end_ms) for t in rank1] == [(1.5, 2.5), (2.5, 4.5)]
    assert result.iteration_time_ms == 7.0
    # useful work 6 ms; without P2P the iteration takes 6 ms.
    assert result.bubble.real == pytest.approx(8 / 6)
    assert result.bubble.comm == pytest.approx(2 * (7 - 6) / 6)
    assert result.bubble.ideal == pytest.approx(1.0)
    assert result.bubble.imbalance == pytest.approx(0.0, abs=1e-12)


def test_v_turn_pays_no_p2p():
    # On rank S-1 the V turns: stage S-1 hands its output to stage S on the same rank.
    schedule = build_schedule("ZBVZeroBubble", 2, 1)
    result = simulate(
        schedule, PipelineCosts.uniform(2, 2, forward_ms=2.0, backward_ms=4.0, weight_ms=2.0, p2p_ms=10.0)
    )
    timeline = {str(t.action): t for rank in range(2) for t in result.rank_timeline(rank)}
    assert timeline["2F0"].start_ms == timeline["1F0"].end_ms
    assert timeline["1F0"].start_ms == timeline["0F0"].end_ms + 10.0


def test_memory_follows_the_schedule_exactly():
    # 2 ranks, 1F1B, 3 micro-batches. Rank 0 runs F0 F1 B0 F2 B1 B2, rank 1 runs F0 B0 F1 B1 F2 B2.
    rank0 = ChunkCosts(forward_ms=1, backward_ms=2, activation_bytes=10, static_bytes=100, working_bytes=5)
    rank1 = ChunkCosts(forward_ms=1, backward_ms=2, activation_bytes=20, static_bytes=50, working_bytes=7)
    result = simulate(build_schedule("1F1B", 2, 3), PipelineCosts(((rank0,), (rank1,))))
    # Rank 0: 100 -> 110 -> 120 -> (125 during B0) 110 -> 120 -> (125) 110 -> (115) 100.
    assert result.rank_peak_memory_bytes == (125, 77)
    assert result.rank_peak_activations == (2, 1)
    levels = [bytes_ for _, bytes_ in result.memory_curve(1)]
    assert levels == [50, 70, 77, 50, 70, 77, 50, 70, 77, 50, 50]
    curve0 = result.memory_curve(0)
    assert curve0[0] == (0.0, 100) and curve0[-1] == (result.iteration_time_ms, 100)
    assert max(bytes_ for _, bytes_ in curve0) == 125


def test_split_backward_frees_activations_after_w():
    # ZBH1 on one stage: F0 I0 W0. The activation stays until W ends; the working set is held in I and W.
    cost = ChunkCosts(
        forward_ms=1, backward_ms=2, weight_ms=0.5, recompute_ms=0.25, activation_bytes=8, working_bytes=3
    )
    result = simulate(build_schedule("ZBH1", 1, 1), PipelineCosts(((cost,),)))
    timeline = result.rank_timeline(0)
    assert [str(t.action) for t in timeline] == ["0F0", "0I0", "0W0"]
    # Recompute runs before the input gradient: I = B - W + recompute, W = W.
    assert [t.end_ms - t.start_ms for t in timeline] == [1.0, 1.75, 0.5]
    assert [bytes_ for _, bytes_ in result.memory_curve(0)] == [0, 8, 11, 8, 11, 0, 0]


def test_each_half_of_a_split_backward_holds_its_own_working_set():
    """Where given, I holds `input_working_bytes` above what was held when it began, and W
    `weight_working_bytes`; a whole backward, and a half not given, hold `working_bytes`."""
    cost = ChunkCosts(
        forward_ms=1,
        backward_ms=2,
        weight_ms=0.5,
        activation_bytes=8,
        working_bytes=3,
        pending_bytes=2,
        input_working_bytes=5,
        weight_working_bytes=1,
    )
    split = simulate(build_schedule("ZBH1", 1, 1), PipelineCosts(((cost,),)))
    assert [bytes_ for _, bytes_ in split.memory_curve(0)] == [0, 8, 8 + 5, 10, 10 + 1, 0, 0]
    assert split.rank_peak_memory_bytes == (13,)
    only_input = simulate(
        build_schedule("ZBH1", 1, 1), PipelineCosts(((dataclasses.replace(cost, weight_working_bytes=None),),))
    )
    assert [bytes_ for _, bytes_ in only_input.memory_curve(0)] == [0, 8, 13, 10, 10 + 3, 0, 0]
    whole = simulate(build_schedule("1F1B", 1, 1), PipelineCosts(((cost,),)))
    assert [bytes_ for _, bytes_ in whole.memory_curve(0)] == [0, 8, 8 + 3, 0, 0]
    with pytest.raises(InputError, match="weight_working_bytes"):
        PipelineCosts(((dataclasses.replace(cost, weight_working_bytes=-1.0),),))


def test_a_measured_input_half_times_the_i_action():
    """torch's two halves of a split backward cost more than one backward: I takes `input_ms` (plus
    recompute) where given, whatever backward_ms - weight_ms says; B keeps backward_ms."""
    cost = ChunkCosts(forward_ms=1, backward_ms=2, weight_ms=1, input_ms=1.5, recompute_ms=0.25)
    split = simulate(build_schedule("ZBH1", 1, 1), PipelineCosts(((cost,),)))
    assert [t.end_ms - t.start_ms for t in split.rank_timeline(0)] == [1.0, 1.75, 1.0]
    whole = simulate(build_schedule("1F1B", 1, 1), PipelineCosts(((cost,),)))
    assert [t.end_ms - t.start_ms for t in whole.rank_timeline(0)] == [1.0, 2.25]
    with pytest.raises(InputError, match="input_ms"):
        PipelineCosts(((dataclasses.replace(cost, input_ms=-1.0),),))


def test_weight_split_defaults_to_half_and_says_so():
    schedule = build_schedule("ZBH1", 1, 1)
    halved = simulate(schedule, PipelineCosts.uniform(1, 1, forward_ms=1.0, backward_ms=3.0))
    assert [t.end_ms - t.start_ms for t in halved.rank_timeline(0)] == [1.0, 1.5, 1.5]
    assert halved.weight_split_assumed
    given = simulate(schedule, PipelineCosts.uniform(1, 1, forward_ms=1.0, backward_ms=3.0, weight_ms=1.0))
    assert not given.weight_split_assumed
    one_f_one_b = simulate(build_schedule("1F1B", 1, 1), PipelineCosts.uniform(1, 1, forward_ms=1.0, backward_ms=3.0))
    assert not one_f_one_b.weight_split_assumed  # no W actions: the split does not matter


def test_bubble_split_of_balanced_stages_with_recompute():
    # 2 ranks, 4 micro-batches, F=1, B=2, recompute 1: iteration (M+S-1)(F+B+R) = 20 ms; useful 24 ms.
    result = simulate(
        build_schedule("1F1B", 2, 4), PipelineCosts.uniform(2, 1, forward_ms=1.0, backward_ms=2.0, recompute_ms=1.0)
    )
    assert result.iteration_time_ms == 20.0
    bubble = result.bubble
    assert bubble.real == pytest.approx((2 * 20 - 24) / 24)
    assert bubble.ideal == pytest.approx(1 / 4)  # (S-1)/M
    assert bubble.recompute == pytest.approx(2 * (20 - 15) / 24)  # balanced without recompute: 15 ms
    assert bubble.imbalance == pytest.approx(0.0, abs=1e-12)
    assert bubble.comm == 0.0


def test_bubble_split_charges_uneven_stages_to_imbalance():
    fast = ChunkCosts(forward_ms=1.0, backward_ms=2.0)
    slow = ChunkCosts(forward_ms=2.0, backward_ms=4.0)
    result = simulate(build_schedule("1F1B", 2, 4), PipelineCosts(((fast,), (slow,))))
    bubble = result.bubble
    # Useful 4 * (3 + 6) = 36 ms; the slow rank sets the pace: 3 + 4 * 6 = 27 ms.
    assert result.iteration_time_ms == 27.0
    assert bubble.real == pytest.approx((2 * 27 - 36) / 36)
    assert bubble.ideal == pytest.approx(1 / 4)
    assert bubble.imbalance == pytest.approx(bubble.real - 1 / 4)
    assert bubble.recompute == 0.0 and bubble.comm == 0.0


def test_ideal_bubble_is_sapps_for_interleaved():
    result = simulate(
        build_schedule("Interleaved1F1B", 4, 8, 2), PipelineCosts.uniform(4, 2, forward_ms=1, backward_ms=2)
    )
    assert result.bubble.ideal == pytest.approx((4 - 1) / (2 * 8))


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ChunkCosts(forward_ms=-1.0, backward_ms=1.0), "rank 0 chunk 0 forward_ms"),
        (lambda: ChunkCosts(forward_ms=1.0, backward_ms=float("nan")), "rank 0 chunk 0 backward_ms"),
        (lambda: ChunkCosts(forward_ms=1.0, backward_ms=1.0, weight_ms=2.0), "rank 0 chunk 0 weight_ms"),
        (lambda: ChunkCosts(forward_ms=1.0, backward_ms=1.0, activation_bytes=-5), "rank 0 chunk 0 activation_bytes"),
        (lambda: ChunkCosts(forward_ms="1", backward_ms=1.0), "rank 0 chunk 0 forward_ms"),
    ],
)
def test_bad_chunk_costs_name_the_field(make, field):
    with pytest.raises(InputError) as caught:
        PipelineCosts(((make(),),))
    assert caught.value.field == field


def test_bad_pipeline_costs():
    good = ChunkCosts(forward_ms=1.0, backward_ms=2.0)
    with pytest.raises(InputError, match=r"chunk_costs\[1\]: expected 2 chunks"):
        PipelineCosts(((good, good), (good,)))
    with pytest.raises(InputError, match="p2p_ms"):
        PipelineCosts(((good,),), p2p_ms=-1.0)
    with pytest.raises(InputError, match="expected 4 ranks x 1 chunks"):
        simulate(build_schedule("1F1B", 4, 4), PipelineCosts.uniform(2, 1, forward_ms=1.0, backward_ms=1.0))
    with pytest.raises(InputError, match="all zero"):
        simulate(build_schedule("1F1B", 2, 2), PipelineCosts.uniform(2, 1, forward_ms=0.0, backward_ms=0.0))


@pytest.mark.parametrize("pending", [40, -30])
@pytest.mark.parametrize("name, chunks", [("ZBH1", 1), ("ZBVZeroBubble", 2), ("DualPipeV", 2), ("1F1B", 1)])
def test_pending_gradients_are_held_from_i_to_w(name, chunks, pending):
    """A split backward holds `pending_bytes` per micro-batch from its I action to its W (or frees that
    much of the activation there, where negative): the peak is the most that the counts of F, I and W
    run so far give, working sets included."""
    ranks, micro_batches = 2, 6
    chunk = ChunkCosts(
        forward_ms=1,
        backward_ms=2,
        weight_ms=1,
        activation_bytes=100,
        static_bytes=1000,
        working_bytes=7,
        pending_bytes=pending,
    )
    costs = PipelineCosts(tuple(tuple(chunk for _ in range(chunks)) for _ in range(ranks)))
    schedule = build_schedule(name, ranks, micro_batches, chunks)
    result = simulate(schedule, costs)
    for rank in range(ranks):
        done = dict.fromkeys("FBIW", 0)
        peak = held = 1000 * chunks
        for action in schedule.rank_actions[rank]:
            if action.op != "F":
                peak = max(peak, held + 7)
            done[action.op] += 1
            held = 1000 * chunks + 100 * (done["F"] - done["B"] - done["W"]) + pending * (done["I"] - done["W"])
            peak = max(peak, held)
        assert result.rank_peak_memory_bytes[rank] == peak
        assert max(memory for _, memory in result.memory_curve(rank)) == peak
        assert done["I"] == done["W"] and (done["I"] > 0) == (name != "1F1B")
    with pytest.raises(InputError, match="pending_bytes"):  # an I action frees at most the activation
        PipelineCosts(((dataclasses.replace(chunk, pending_bytes=-101),),))


@pytest.mark.parametrize("name, chunks", [("ZBH1", 1), ("ZBVZeroBubble", 2), ("1F1B", 1)])
def test_retained_activations_stay_until_the_step_ends(name, chunks):
    """After a micro-batch's last backward action (W, or B where the backward is whole) the retained
    part of an activation stays: every micro-batch's, by the end."""
    ranks, micro_batches = 2, 4
    chunk = ChunkCosts(
        forward_ms=1, backward_ms=2, weight_ms=1, activation_bytes=100, static_bytes=1000, retained_bytes=30
    )
    costs = PipelineCosts(tuple(tuple(chunk for _ in range(chunks)) for _ in range(ranks)))
    result = simulate(build_schedule(name, ranks, micro_batches, chunks), costs)
    for rank in range(ranks):
        curve = result.memory_curve(rank)
        assert curve[-1][1] == 1000 * chunks + 30 * micro_batches * chunks
        assert max(memory for _, memory in curve) == result.rank_peak_memory_bytes[rank]
    with pytest.raises(InputError, match="retained_bytes"):
        PipelineCosts(((dataclasses.replace(chunk, retained_bytes=-1),),))
