"""Solver speed on SAPP's fixtures (pytest-benchmark; `make bench`). Each case reports its status and
proven gap in extra_info: SAPP's own interleaved solves stop at 60-600 s with 5-28% gaps on a proxy."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from solver_cases import layer

from solver import ModelProfile, PipelineSpec, load_profile, solve

SAPP = Path(__file__).parents[1] / "fixtures" / "sapp"
MIB = 2**20
CASES = {
    # fixture, schedule, stages, chunks, micro-batches, budget MiB, time limit s
    "test.json-1F1B-4x1x8": ("test.json", "1F1B", 4, 1, 8, 53000, 60),
    "test.json-Interleaved-4x2x8": ("test.json", "Interleaved1F1B", 4, 2, 8, 53000, 60),
    "test.json-1F1B-16x1x16": ("test.json", "1F1B", 16, 1, 16, 56000, 60),
    "sim.json-1F1B-16x1x16": ("sim.json", "1F1B", 16, 1, 16, 56000, 60),
    "test.json-1F1B-16x1x64": ("test.json", "1F1B", 16, 1, 64, 56000, 60),
    "sim.json-1F1B-16x1x64": ("sim.json", "1F1B", 16, 1, 64, 56000, 60),
    "test.json-1F1B-32x1x128": ("test.json", "1F1B", 32, 1, 128, 40000, 60),
    "sim.json-GPipe-16x1x16": ("sim.json", "GPipe", 16, 1, 16, 56000, 60),
    "sim.json-GPipe-16x1x48": ("sim.json", "GPipe", 16, 1, 48, 44600, 60),  # 1.1x the least that fits
    "sim.json-ZBH1-16x1x16": ("sim.json", "ZBH1", 16, 1, 16, 56000, 60),
    "test.json-ZBH1-16x1x48": ("test.json", "ZBH1", 16, 1, 48, 22000, 60),  # 1.5x the least that fits
    "test.json-DualPipeV-8x2x16": ("test.json", "DualPipeV", 8, 2, 16, 70000, 60),
    "sim.json-ZBV-8x2x16": ("sim.json", "ZBVZeroBubble", 8, 2, 16, 70000, 60),
    "test.json-Interleaved-16x3x16": ("test.json", "Interleaved1F1B", 16, 3, 16, 56000, 30),
    "sim.json-Interleaved-16x3x16": ("sim.json", "Interleaved1F1B", 16, 3, 16, 56000, 30),
    # 16,384 actions: the search's first LP alone outlasts the limit; the balanced split answers
    "sim.json-Interleaved-16x4x128": ("sim.json", "Interleaved1F1B", 16, 4, 128, 56000, 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_solve(benchmark, case):
    fixture, schedule, stages, chunks, micro_batches, budget_mib, limit = CASES[case]
    profile = load_profile(SAPP / fixture)
    spec = PipelineSpec(
        stages=stages, chunks=chunks, micro_batches=micro_batches, schedule=schedule,
        memory_budget_bytes=budget_mib * MIB,
    )
    plan = benchmark.pedantic(solve, args=(profile, spec), kwargs={"time_limit_s": limit}, rounds=1, iterations=1)
    benchmark.extra_info.update(status=plan.status, gap=plan.gap, iteration_ms=plan.iteration_time_ms)
    assert plan.fits


def uneven_profile(body_layers: int, seed: int) -> ModelProfile:
    """Layers that all cost differently (a profile taken without pooling), two body kinds in order."""
    rng = random.Random(seed)
    layers = [layer("embed", "head", 3.0, 3.0, parameter_mib=30)]
    for i in range(body_layers):
        forward, keep_mib = rng.uniform(4, 6), rng.uniform(20, 30)
        modes = {"none": (0.0, keep_mib, 2.0), "selective": (0.3 * forward, 0.5 * keep_mib, 2.0),
                 "full": (forward, 0.1 * keep_mib, keep_mib)}
        kind = "body:dense" if i < body_layers // 2 else "body:moe"
        layers.append(layer(f"block.{i}", kind, forward, 2 * forward, 0.0, parameter_mib=rng.uniform(10, 20), modes=modes))
    layers.append(layer("lm_head", "tail", 6.0, 6.0, parameter_mib=30, modes={"none": (0.0, 5.0, 0.0)}))
    return ModelProfile(layers=tuple(layers), model="uneven")


UNEVEN = {
    # seed, body layers, schedule, stages, chunks, micro-batches, budget MiB
    "uneven-24-Interleaved-4x2x8": (1, 24, "Interleaved1F1B", 4, 2, 8, 1500),
    "uneven-32-1F1B-8x1x16": (2, 32, "1F1B", 8, 1, 16, 1500),
}


@pytest.mark.parametrize("case", list(UNEVEN))
def test_solve_uneven_layers(benchmark, case):
    seed, body_layers, schedule, stages, chunks, micro_batches, budget_mib = UNEVEN[case]
    spec = PipelineSpec(
        stages=stages, chunks=chunks, micro_batches=micro_batches, schedule=schedule,
        memory_budget_bytes=budget_mib * MIB,
    )
    plan = benchmark.pedantic(solve, args=(uneven_profile(body_layers, seed), spec), kwargs={"time_limit_s": 60},
                              rounds=1, iterations=1)
    benchmark.extra_info.update(status=plan.status, gap=plan.gap, iteration_ms=plan.iteration_time_ms)
    assert plan.fits
