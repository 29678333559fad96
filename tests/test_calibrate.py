"""Calibration recovers a time factor and a per-action overhead from runs that have them."""

from __future__ import annotations

import pytest
from solver_cases import small_profile

from solver import PipelineSpec, evaluate_plan
from solver.calibrate import Run, calibrate, rank_end_ms


def measured_like(profile, spec, counts, modes, scale, overhead):
    """What an engine with that factor and overhead measures: the simulator's own answer."""
    run = Run(profile, spec, counts, modes, ())
    return Run(profile, spec, counts, modes, tuple(rank_end_ms(run, scale, overhead)))


def test_the_factor_and_overhead_are_found():
    profile = small_profile(8)
    runs = []
    for schedule, chunks, counts in (
        ("1F1B", 1, (3, 2, 3, 2)),
        ("Interleaved1F1B", 2, (2, 1, 1, 1, 1, 1, 2, 1)),
        ("ZBH1", 1, (2, 3, 3, 2)),
        ("1F1B", 1, (4, 2, 2, 2)),
    ):
        spec = PipelineSpec(pipeline_parallel=4, chunks=chunks, micro_batches=8, schedule=schedule)
        runs.append(measured_like(profile, spec, counts, ["none"] * 10, scale=1.3, overhead=0.4))
    found = calibrate(runs)
    assert found.time_scale == pytest.approx(1.3, rel=1e-3)
    assert found.action_overhead_ms == pytest.approx(0.4, abs=1e-3)
    assert found.error_before > 0.2 and found.error_after < 1e-3


def test_applying_a_calibration_predicts_the_runs():
    profile = small_profile(8)
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B")
    run = measured_like(profile, spec, (3, 2, 3, 2), ["none"] * 10, scale=0.8, overhead=1.0)
    found = calibrate([run])
    calibrated_profile, calibrated_spec = found.adjust(profile, spec)
    plan = evaluate_plan(calibrated_profile, calibrated_spec, (3, 2, 3, 2), ["none"] * 10)
    assert plan.iteration_time_ms == pytest.approx(max(run.measured_step_ms), rel=1e-3)


def test_the_constant_memory_per_stage_is_the_mean_excess():
    profile = small_profile(8)
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B")
    counts, modes = (3, 2, 3, 2), ["none"] * 10
    predicted = evaluate_plan(profile, spec, counts, modes).rank_peak_memory_bytes
    run = measured_like(profile, spec, counts, modes, scale=1.0, overhead=0.0)
    found = calibrate(
        [Run(profile, spec, counts, modes, run.measured_step_ms, tuple(peak + 5 * 2**20 for peak in predicted))]
    )
    assert found.rank_constant_bytes == pytest.approx(5 * 2**20)
    _, calibrated_spec = found.adjust(profile, spec)
    again = evaluate_plan(profile, calibrated_spec, counts, modes).rank_peak_memory_bytes
    assert again == pytest.approx([peak + 5 * 2**20 for peak in predicted])


def test_a_negative_overhead_is_held_at_zero_and_the_fit_never_worsens():
    """Runs whose recompute costs more than the profile says (the gloo runs do): the free optimum has a
    negative overhead. The fit holds it at 0 and finds the best factor there, better than none."""
    profile = small_profile(8)
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B")
    runs = []
    for mode, slower in (("none", 1.09), ("full", 1.19)):
        modes = ["none"] + [mode] * 8 + ["none"]
        exact = measured_like(profile, spec, (3, 2, 3, 2), modes, scale=1.0, overhead=0.0)
        runs.append(
            Run(
                profile,
                spec,
                exact.stage_layer_counts,
                exact.layer_modes,
                tuple(ms * slower for ms in exact.measured_step_ms),
            )
        )
    found = calibrate(runs)
    assert found.action_overhead_ms == 0.0
    assert found.error_after < found.error_before

    def rms(scale, overhead):
        errors = [(p - m) / m for run in runs for p, m in zip(rank_end_ms(run, scale, overhead), run.measured_step_ms)]
        return (sum(e * e for e in errors) / len(errors)) ** 0.5

    assert found.error_after == pytest.approx(rms(found.time_scale, 0.0))
    for scale, overhead in ((found.time_scale * 0.99, 0.0), (found.time_scale * 1.01, 0.0), (found.time_scale, 0.5)):
        assert rms(scale, overhead) > found.error_after
