"""Schedules: complete, deadlock-free, the in-flight counts their papers give, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from simulator import SCHEDULES, Action, InputError, PipelineCosts, Schedule, ScheduleError, build_schedule, simulate
from simulator.schedules import schedule_kind
from simulator.schedules.interleaved import default_group_size, megatron_accepts, megatron_table


def chunk_counts(kind_name: str) -> list[int]:
    kind = SCHEDULES[kind_name]
    return [kind.min_chunks] if kind.max_chunks == kind.min_chunks else [2, 3, 4]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_is_complete_and_deadlock_free(name):
    kind = SCHEDULES[name]
    for ranks in range(1, 7):
        for chunks in chunk_counts(name):
            fewest = kind.min_micro_batches(ranks, chunks)
            for micro_batches in range(fewest, fewest + 13):
                schedule = build_schedule(name, ranks, micro_batches, chunks)
                per_microbatch = 3 if kind.splits_backward else 2  # F + B, or F + I + W
                assert schedule.num_actions >= 2 * ranks * chunks * micro_batches
                assert schedule.num_actions <= per_microbatch * ranks * chunks * micro_batches
                assert len(schedule.compiled.order) == schedule.num_actions


def peak_in_flight(name: str, ranks: int, micro_batches: int, chunks: int | None = None) -> tuple[int, ...]:
    schedule = build_schedule(name, ranks, micro_batches, chunks)
    costs = PipelineCosts.uniform(schedule.ranks, schedule.chunks, forward_ms=1.0, backward_ms=2.0)
    return simulate(schedule, costs).rank_peak_activations


def first_backward_in_flight(schedule: Schedule) -> list[list[int]]:
    """[chunk][rank]: forwards each rank has run on each chunk when its first backward starts."""
    held = [[0] * schedule.ranks for _ in range(schedule.chunks)]
    for rank, actions in enumerate(schedule.rank_actions):
        for action in actions:
            if action.op != "F":
                break
            held[schedule.chunk_of(action.stage_index)][rank] += 1
    return held


@pytest.mark.parametrize("ranks, micro_batches", [(4, 8), (4, 4), (4, 2), (8, 16), (5, 7), (1, 3)])
def test_1f1b_holds_s_minus_s_micro_batches(ranks, micro_batches):
    expected = tuple(min(ranks - s, micro_batches) for s in range(ranks))
    assert peak_in_flight("1F1B", ranks, micro_batches) == expected


def test_gpipe_holds_every_micro_batch():
    assert peak_in_flight("GPipe", 4, 6) == (6, 6, 6, 6)


def sapp_interleaved_multipliers(ranks: int, chunks: int, micro_batches: int) -> list[list[int]]:
    """SAPP.md section 1.4, interleaved ("big memory"): [chunk][stage]."""
    table = [[ranks] * ranks for _ in range(chunks)]
    for s in range(ranks):
        table[0][s] += max(0, ranks - 2 * s - 1)
        table[chunks - 1][s] += min(0, ranks - 2 * s - 1)
    return [[min(micro_batches, a) for a in row] for row in table]


@pytest.mark.parametrize("ranks, chunks, micro_batches", [(8, 2, 32), (16, 3, 16), (4, 2, 8), (4, 4, 12), (6, 3, 18)])
def test_interleaved_in_flight_matches_sapp(ranks, chunks, micro_batches):
    schedule = build_schedule("Interleaved1F1B", ranks, micro_batches, chunks)
    expected = sapp_interleaved_multipliers(ranks, chunks, micro_batches)
    assert first_backward_in_flight(schedule) == expected
    assert peak_in_flight("Interleaved1F1B", ranks, micro_batches, chunks) == tuple(
        sum(row[s] for row in expected) for s in range(ranks)
    )


def test_interleaved_in_flight_sapp_examples():
    # The two worked examples of SAPP.md section 1.4.
    s16 = first_backward_in_flight(build_schedule("Interleaved1F1B", 16, 16, 3))
    assert s16[0] == [16] * 16 and s16[1] == [16] * 16
    assert s16[2] == [16] * 8 + [15, 13, 11, 9, 7, 5, 3, 1]
    s8 = first_backward_in_flight(build_schedule("Interleaved1F1B", 8, 32, 2))
    assert s8 == [[15, 13, 11, 9, 8, 8, 8, 8], [8, 8, 8, 8, 7, 5, 3, 1]]


@pytest.mark.parametrize("ranks, chunks, micro_batches", [(8, 2, 32), (4, 3, 8), (4, 2, 4), (16, 3, 16)])
def test_less_memory_in_flight_matches_sapp(ranks, chunks, micro_batches):
    # SAPP.md 1.4, "less memory": S for every chunk but the last, S - s for the last.
    held = first_backward_in_flight(build_schedule("Interleaved1F1B-less-memory", ranks, micro_batches, chunks))
    assert held[:-1] == [[ranks] * ranks] * (chunks - 1)
    assert held[-1] == [ranks - s for s in range(ranks)]


def test_less_memory_leftover_micro_batches_join_the_first_group():
    held = first_backward_in_flight(build_schedule("Interleaved1F1B-less-memory", 4, 10, 3))
    assert held == [[6, 6, 6, 6], [6, 6, 6, 6], [4, 3, 2, 1]]


@pytest.mark.parametrize("ranks, micro_batches", [(4, 8), (4, 4), (6, 13), (2, 9)])
def test_zbh1_holds_rank_zeros_1f1b_peak_on_every_rank(ranks, micro_batches):
    # W deferred by r micro-batches on rank r: S in flight everywhere (ZB paper: 1F1B's peak).
    assert peak_in_flight("ZBH1", ranks, micro_batches) == (ranks,) * ranks


@pytest.mark.parametrize("ranks, micro_batches", [(4, 7), (4, 16), (3, 9), (2, 3)])
def test_zbv_holds_two_s_chunk_activations(ranks, micro_batches):
    # Each chunk is half a rank: 2S chunk activations = 1F1B's peak of S rank activations.
    assert peak_in_flight("ZBVZeroBubble", ranks, micro_batches) == (2 * ranks,) * ranks


@pytest.mark.parametrize("ranks, micro_batches", [(4, 8), (4, 16), (3, 20), (2, 4)])
def test_dualpipev_holds_pp_plus_one_chunk_activations(ranks, micro_batches):
    # DualPipe README: DualPipeV keeps PP + 1 activations per device (PP = 2S pipeline stages).
    assert peak_in_flight("DualPipeV", ranks, micro_batches) == (2 * ranks + 1,) * ranks


def test_stages_of_a_rank_in_loop_and_v_placement():
    loop = build_schedule("Interleaved1F1B", ranks=4, chunks=3, micro_batches=4)
    v = build_schedule("ZBVZeroBubble", ranks=4, chunks=2, micro_batches=4)
    assert [loop.virtual_stages_of(rank) for rank in range(4)] == [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]
    assert [v.virtual_stages_of(rank) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert all(v.rank_of(stage) == rank for rank in range(4) for stage in v.virtual_stages_of(rank))


def test_megatron_table_example():
    # Megatron's own example in forward_backward_pipelining_with_interleaving: PP2, N3, M5, VP2.
    table = megatron_table(micro_batches=5, chunks=2, group_size=3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [chunk for _, chunk in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "ranks, micro_batches, expected",
    [(4, 8, 4), (4, 10, 5), (4, 11, 6), (4, 4, 4), (3, 7, 4), (8, 12, 12)],
)
def test_default_group_size(ranks, micro_batches, expected):
    group = default_group_size(ranks, micro_batches)
    assert group == expected
    assert megatron_accepts(ranks, micro_batches, group)


def test_explicit_group_size_changes_the_order():
    default = build_schedule("Interleaved1F1B", 4, 12, 2)
    grouped = build_schedule("Interleaved1F1B", 4, 12, 2, microbatch_group_size=6)
    assert default.rank_actions != grouped.rank_actions
    assert len(grouped.compiled.order) == grouped.num_actions


@pytest.mark.parametrize("text", ["1f1b", "Schedule1F1B", " 1F1B ", "schedule1f1b"])
def test_names_match_like_torch(text):
    assert schedule_kind(text).name == "1F1B"


@pytest.mark.parametrize(
    "call, field, words",
    [
        (lambda: build_schedule("nope", 4, 8), "schedule", "expected one of"),
        (lambda: build_schedule("1F1B", 0, 8), "ranks", ">= 1"),
        (lambda: build_schedule("1F1B", -2, 8), "ranks", ">= 1"),
        (lambda: build_schedule("1F1B", 2.5, 8), "ranks", "integer"),
        (lambda: build_schedule("1F1B", True, 8), "ranks", "integer"),
        (lambda: build_schedule("1F1B", 4, 0), "micro_batches", ">= 1"),
        (lambda: build_schedule("1F1B", 4, 8, chunks=2), "chunks", "exactly 1"),
        (lambda: build_schedule("Interleaved1F1B", 4, 8, chunks=1), "chunks", "2 or more"),
        (lambda: build_schedule("ZBVZeroBubble", 4, 8, chunks=3), "chunks", "exactly 2"),
        (lambda: build_schedule("Interleaved1F1B", 4, 3, chunks=2), "micro_batches", "at least 4"),
        (lambda: build_schedule("Interleaved1F1B-less-memory", 4, 2, chunks=2), "micro_batches", "at least 4"),
        (lambda: build_schedule("DualPipeV", 4, 7), "micro_batches", "at least 8"),
        (
            lambda: build_schedule("Interleaved1F1B", 4, 10, 2, microbatch_group_size=3),
            "microbatch_group_size",
            "4 <= G",
        ),
        (
            lambda: build_schedule("Interleaved1F1B", 4, 10, 2, microbatch_group_size=7),
            "microbatch_group_size",
            "mod G",
        ),
        (
            lambda: build_schedule("1F1B", 4, 10, microbatch_group_size=4),
            "microbatch_group_size",
            "Interleaved1F1B only",
        ),
        (
            lambda: build_schedule("1F1B", 100_000, 100_000),
            "micro_batches",
            "make 20,000,000,000 actions; expected at most",
        ),
        (lambda: build_schedule("ZBH1", 2_000, 2_000), "micro_batches", "make 12,000,000 actions"),
    ],
)
def test_bad_input_names_the_field(call, field, words):
    with pytest.raises(InputError) as caught:
        call()
    assert caught.value.field == field
    assert words in str(caught.value)


def one_f_one_b(ranks: int = 2, micro_batches: int = 2) -> list[list[Action]]:
    return [list(actions) for actions in build_schedule("1F1B", ranks, micro_batches).rank_actions]


def make(rank_actions: list[list[Action]], micro_batches: int = 2) -> Schedule:
    return Schedule("custom", len(rank_actions), 1, micro_batches, "loop", tuple(map(tuple, rank_actions)))


def test_action_on_the_wrong_rank_is_refused():
    actions = one_f_one_b()
    actions[0][0] = Action(1, "F", 0)
    with pytest.raises(ScheduleError, match="runs on rank 1"):
        make(actions)


@pytest.mark.parametrize("stage", [0.0, "0", np.float64(0.0)])
def test_a_stage_index_that_is_not_an_integer_is_refused(stage):
    actions = one_f_one_b()
    actions[0][0] = Action(stage, "F", 0)
    with pytest.raises(ScheduleError, match=r"rank 0 action 0 \(0(\.0)?F0\): expected an integer stage index"):
        make(actions)
    actions[0][0] = Action(np.int64(0), "F", 0)  # numpy's integers are integers
    make(actions)


def test_repeated_action_is_refused():
    actions = one_f_one_b()
    actions[0].append(actions[0][0])
    with pytest.raises(ScheduleError, match="appears twice"):
        make(actions)


def test_missing_backward_is_refused():
    actions = one_f_one_b()
    actions[1] = [a for a in actions[1] if a != Action(1, "B", 1)]
    with pytest.raises(ScheduleError, match="stage 1 micro-batch 1: needs a full backward"):
        make(actions)


def test_mixed_full_and_split_backward_is_refused():
    actions = one_f_one_b()
    actions[1].append(Action(1, "W", 0))
    with pytest.raises(ScheduleError, match="both a full backward and a split"):
        make(actions)


def test_deadlock_is_found_and_explained():
    actions = one_f_one_b()
    # The last stage runs B1 before F1: it would wait for itself.
    actions[1] = [Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1), Action(1, "F", 1)]
    schedule = make(actions)
    with pytest.raises(ScheduleError, match=r"deadlock: .*rank 1 at 1B1 waits for 1F1"):
        _ = schedule.compiled
