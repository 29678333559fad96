"""The time limit holds at any size: a schedule too large to build within it is refused before it is built,
and what must run whatever the limit leaves the search no more than the time left."""

import subprocess
import sys
import time

import pytest
from solver_cases import SAPP

from basics.errors import InputError
from basics.units import MIB
from solver import PipelineSpec, load_profile, solve
from solver.program.size import check_time_limit


def test_a_schedule_too_large_for_the_time_limit_is_refused_naming_its_largest_count():
    with pytest.raises(InputError) as caught:
        check_time_limit("1F1B", 4, None, 1_000_000, 10)
    assert caught.value.field == "micro_batches"
    assert caught.value.detail == (
        "4 x 1 x 1,000,000 (ranks x chunks x micro-batches) make 8,000,000 1F1B actions, which take about "
        "128 s to build and replay (some 16 us each), more than the time limit of 10 s: at most 85,937 "
        "micro-batches fit it, or allow more time"
    )
    with pytest.raises(InputError) as caught:  # split backwards: three actions per micro-batch and chunk
        check_time_limit("ZBVZeroBubble", 4096, None, 8192, 60)
    assert caught.value.field == "micro_batches" and "make 201,326,592 ZBVZeroBubble actions" in caught.value.detail
    with pytest.raises(InputError) as caught:
        check_time_limit("1F1B", 50_000, None, 8, 1)
    assert caught.value.field == "pipeline_parallel" and caught.value.detail.endswith(
        "at most 7,812 ranks fit it, or allow more time"
    )
    check_time_limit("1F1B", 4, None, 85_937, 10)  # 687,496 actions: 11 s, the limit and a second's grace
    check_time_limit("Interleaved1F1B", 16, 3, 16, 0.01)  # a tiny limit still gets the plan found without search
    check_time_limit("1F1B", 4, None, 1_000_000, float("inf"))


def test_solve_refuses_a_micro_batch_count_it_cannot_build_in_time_before_building_it():
    """4 x 1,000,000 micro-batches under 1F1B: minutes and gigabytes to build; refused in under a second."""
    command = [sys.executable, "-m", "sapp_hook", "solve", "--profile", str(SAPP / "test.json")]
    command += ["--pipeline-parallel", "4", "--micro-batches", "1000000", "--schedule", "1F1B"]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--memory", "56000MiB", "--time-limit", "10"], capture_output=True, text=True, timeout=30
    )
    assert time.perf_counter() - started < 10
    assert done.returncode == 2
    assert done.stderr.startswith("sapp-hook solve: error: --micro-batches: 4 x 1 x 1,000,000 (ranks x chunks")
    assert "at most 85,937 micro-batches fit it, or allow more time" in done.stderr


def test_a_search_over_a_thousand_ranks_returns_a_fitting_plan_within_its_limit():
    """1,024 ranks (16,384 actions): a replay per rank for the start plan's paths, then the relaxation, ran
    past a 2 s limit for a minute; now each stops at the limit, and the plan found without search is taken."""
    profile = load_profile(SAPP / "test.json")
    spec = PipelineSpec(
        pipeline_parallel=1024,
        micro_batches=8,
        schedule="1F1B",
        memory_budget_bytes=56000 * MIB,
        allow_empty_chunks=True,
    )
    started = time.perf_counter()
    plan = solve(profile, spec, time_limit_s=2)
    assert time.perf_counter() - started < 2 + 3  # generous: the machine is noisy
    assert plan.status == "feasible" and plan.fits
    assert sum(plan.stage_layer_counts) == len(profile.layers)
    assert plan.lower_bound_ms > 0 and plan.gap < 1  # the average work per rank at least, where the LP runs out of time
