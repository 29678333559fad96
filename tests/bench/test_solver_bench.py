"""Solver speed on SAPP's fixtures (pytest-benchmark; `make bench`). Each case reports its status and
proven gap in extra_info: SAPP's own interleaved solves stop at 60-600 s with 5-21% gaps on a proxy."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from solver_cases import layer

from solver import InfeasibleError, ModelProfile, PipelineSpec, load_profile, solve

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
        pipeline_parallel=stages,
        chunks=chunks,
        micro_batches=micro_batches,
        schedule=schedule,
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
        modes = {
            "none": (0.0, keep_mib, 2.0),
            "selective": (0.3 * forward, 0.5 * keep_mib, 2.0),
            "full": (forward, 0.1 * keep_mib, keep_mib),
        }
        kind = "body:dense" if i < body_layers // 2 else "body:moe"
        layers.append(
            layer(f"block.{i}", kind, forward, 2 * forward, 0.0, parameter_mib=rng.uniform(10, 20), modes=modes)
        )
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
        pipeline_parallel=stages,
        chunks=chunks,
        micro_batches=micro_batches,
        schedule=schedule,
        memory_budget_bytes=budget_mib * MIB,
    )
    plan = benchmark.pedantic(
        solve, args=(uneven_profile(body_layers, seed), spec), kwargs={"time_limit_s": 60}, rounds=1, iterations=1
    )
    benchmark.extra_info.update(status=plan.status, gap=plan.gap, iteration_ms=plan.iteration_time_ms)
    assert plan.fits


# Public configs of real models, estimated by profiler.estimate.analytic (no weights needed): bf16, 4,096
# tokens per micro-batch, 400 TFLOP/s.
MODELS = {
    "llama3-8b": (
        dict(
            model_type="llama",
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
        ),
        1,
    ),
    "llama3-70b-tp8": (
        dict(
            model_type="llama",
            num_hidden_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=128256,
        ),
        8,
    ),
    "qwen3-30b-a3b": (
        dict(
            model_type="qwen3_moe",
            num_hidden_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
        ),
        1,
    ),
}
REAL = {
    # model, schedule, stages, chunks, micro-batches, budget: GB, or a multiple of the least that fits
    "llama3-8b-1F1B-8x1x32": ("llama3-8b", "1F1B", 8, 1, 32, "1.15x"),
    "llama3-70b-tp8-ZBH1-8x1x16": ("llama3-70b-tp8", "ZBH1", 8, 1, 16, "1.15x"),
    "llama3-8b-DualPipeV-8x2x32": ("llama3-8b", "DualPipeV", 8, 2, 32, "1.15x"),
    "llama3-70b-tp8-Interleaved-8x2x16": ("llama3-70b-tp8", "Interleaved1F1B", 8, 2, 16, 80),
    "qwen3-30b-a3b-ZBV-8x2x16": ("qwen3-30b-a3b", "ZBVZeroBubble", 8, 2, 16, 80),
}


@pytest.mark.parametrize("case", list(REAL))
def test_solve_real_model_shapes(benchmark, case):
    from profiler.estimate.analytic import analytic_profile, shape_from_config

    model, schedule, stages, chunks, micro_batches, budget = REAL[case]
    config, tensor_parallel = MODELS[model]
    profile = analytic_profile(
        shape_from_config(config, sequence=4096, tensor_parallel=tensor_parallel), flops_per_second=4e14
    )
    spec = PipelineSpec(
        pipeline_parallel=stages,
        chunks=chunks,
        micro_batches=micro_batches,
        schedule=schedule,
        memory_budget_bytes=1e6,
        tensor_parallel=tensor_parallel,
    )  # the rank the profile is for
    if isinstance(budget, str):  # the least that fits, from the infeasibility report, times the factor
        with pytest.raises(InfeasibleError) as nothing_fits:
            solve(profile, spec)
        budget_bytes = float(budget.rstrip("x")) * nothing_fits.value.smallest_budget_bytes
    else:
        budget_bytes = budget * 1e9
    spec = dataclasses.replace(spec, memory_budget_bytes=budget_bytes)
    plan = benchmark.pedantic(solve, args=(profile, spec), kwargs={"time_limit_s": 60}, rounds=1, iterations=1)
    benchmark.extra_info.update(
        status=plan.status, gap=plan.gap, iteration_ms=plan.iteration_time_ms, budget_gb=budget_bytes / 1e9
    )
    assert plan.fits
