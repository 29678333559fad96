"""Simulator speed (pytest-benchmark; `make bench`): build, replay and critical path at 2k, 65k and 1M actions,
and the cases of docs/results/benchmarks.md. SAPP's `PipelineSimulator.run` took 0.69 s at 65,536 blocks
(issue 44's side-by-side) and raises RecursionError from about 4,000 micro-batches per chunk chain, so it
cannot run the first case (SAPP.md section 3)."""

from __future__ import annotations

import pytest

from simulator import PipelineCosts, build_schedule, critical_path, simulate
from simulator.reference import reference_simulate

CASES = {
    "1F1B-8x1x4096": ("1F1B", 8, 1, 4096),  # 65,536 actions
    "Interleaved1F1B-32x4x512": ("Interleaved1F1B", 32, 4, 512),  # 131,072 actions
    "DualPipeV-16x2x512": ("DualPipeV", 16, 2, 512),  # 49,152 actions, F/B/I/W
}


def costs(ranks: int, chunks: int) -> PipelineCosts:
    return PipelineCosts.uniform(
        ranks,
        chunks,
        forward_ms=1.0,
        backward_ms=2.0,
        weight_ms=0.8,
        p2p_ms=0.05,
        activation_bytes=2**30,
        static_bytes=2**34,
        working_bytes=2**28,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_build_and_simulate(benchmark, case):
    name, ranks, chunks, micro_batches = CASES[case]
    pipeline_costs = costs(ranks, chunks)

    def run():
        return simulate(build_schedule(name, ranks, micro_batches, chunks), pipeline_costs)

    result = benchmark.pedantic(run, rounds=5, iterations=1)
    assert len(result.end_ms) == result.schedule.num_actions


@pytest.mark.parametrize("case", list(CASES))
def test_resimulate_built_schedule(benchmark, case):
    """What a solver pays per candidate plan: the schedule is built and compiled once."""
    name, ranks, chunks, micro_batches = CASES[case]
    schedule = build_schedule(name, ranks, micro_batches, chunks)
    _ = schedule.compiled  # built outside the timed replay
    pipeline_costs = costs(ranks, chunks)
    result = benchmark.pedantic(simulate, args=(schedule, pipeline_costs), rounds=5, iterations=1)
    assert result.iteration_time_ms > 0


SIZES = {  # 1F1B at 2k, 65k and 1M actions
    "2k": (16, 64),
    "65k": (32, 1024),
    "1M": (32, 16384),
}


@pytest.mark.parametrize("size", list(SIZES))
def test_build(benchmark, size):
    """Action lists, their check and the compiled dependencies and order."""
    ranks, micro_batches = SIZES[size]
    schedule = benchmark.pedantic(lambda: build_schedule("1F1B", ranks, micro_batches).compiled, rounds=3, iterations=1)
    assert schedule.num_actions == 2 * ranks * micro_batches


@pytest.mark.parametrize("size", list(SIZES))
def test_replay(benchmark, size):
    ranks, micro_batches = SIZES[size]
    schedule = build_schedule("1F1B", ranks, micro_batches)
    _ = schedule.compiled
    result = benchmark.pedantic(simulate, args=(schedule, costs(ranks, 1)), rounds=3, iterations=1)
    assert result.iteration_time_ms > 0


@pytest.mark.parametrize("size", list(SIZES))
def test_critical_path(benchmark, size):
    ranks, micro_batches = SIZES[size]
    schedule = build_schedule("1F1B", ranks, micro_batches)
    _ = schedule.compiled
    path = benchmark.pedantic(critical_path, args=(schedule, costs(ranks, 1)), rounds=3, iterations=1)
    assert len(path) >= 2 * micro_batches


def test_reference_replay_65k(benchmark):
    """The plain replay the fast one is tested against, for the ratio."""
    ranks, micro_batches = SIZES["65k"]
    schedule = build_schedule("1F1B", ranks, micro_batches)
    _ = schedule.compiled
    result = benchmark.pedantic(reference_simulate, args=(schedule, costs(ranks, 1)), rounds=3, iterations=1)
    assert result.iteration_time_ms > 0


def test_draw_64_ranks_256_micro_batches(benchmark, tmp_path):
    from simulator.plot import draw_gantt

    result = simulate(build_schedule("Interleaved1F1B", 64, 256, 2), costs(64, 2))
    benchmark.pedantic(draw_gantt, args=(result, tmp_path / "gantt.png"), rounds=1, iterations=1)
    assert (tmp_path / "gantt.png").stat().st_size > 0
