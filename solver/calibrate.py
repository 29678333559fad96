"""Calibration: fit what the profile cannot know from measured pipeline runs, then plan again.

A profile times each layer alone, in one process. A real pipeline adds its own cost per action (the
engine's Python, sends and receives) and runs the stages on shared cores. Two numbers capture most of
it: a factor on every layer time and an overhead per action. They are fitted by least squares on the
relative error of each rank's step time over the runs given (Gauss-Newton over the simulator itself,
which is piecewise linear in both); the constant memory per stage is the mean of what the measured
peaks exceed the predicted ones by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from basics.deprecation import renamed_attributes
from basics.errors import InputError
from solver.evaluate import evaluate_plan
from solver.vocabulary.profile import ModelProfile
from solver.vocabulary.spec import PipelineSpec

MIN_SCALE = 0.05  # a floor on the time factor, so that a stray step cannot make times vanish


@dataclass(frozen=True)
class Run:
    """One measured run of a plan: what each rank measured."""

    profile: ModelProfile
    spec: PipelineSpec
    stage_layer_counts: tuple[int, ...]
    layer_modes: tuple[str, ...]
    measured_step_ms: tuple[float, ...]  # per rank
    measured_peak_bytes: tuple[float, ...] = ()  # per rank, when measured; compared with the predicted peak


@renamed_attributes(apply="adjust")
@dataclass(frozen=True)
class Calibration:
    time_scale: float
    action_overhead_ms: float
    rank_constant_bytes: float
    error_before: float  # root mean square of the relative step-time errors, before and after
    error_after: float

    def adjust(self, profile: ModelProfile, spec: PipelineSpec) -> tuple[ModelProfile, PipelineSpec]:
        """The profile with its times scaled and the spec with the overhead and constant memory added."""
        spec = dataclasses.replace(
            spec,
            action_overhead_ms=spec.action_overhead_ms + self.action_overhead_ms,
            rank_constant_bytes=spec.rank_constant_bytes + max(0.0, self.rank_constant_bytes),
        )
        return profile.with_times_scaled(self.time_scale), spec


def rank_end_ms(run: Run, time_scale: float = 1.0, action_overhead_ms: float = 0.0) -> list[float]:
    """When each rank's last action ends, simulated with the given calibration."""
    spec = dataclasses.replace(run.spec, action_overhead_ms=action_overhead_ms)
    plan = evaluate_plan(run.profile.with_times_scaled(time_scale), spec, run.stage_layer_counts, run.layer_modes)
    return [plan.simulation.rank_finish_ms(rank) for rank in range(spec.pipeline_parallel)]


def calibrate(runs: Sequence[Run], iterations: int = 12) -> Calibration:
    """The time factor (>= MIN_SCALE) and per-action overhead (>= 0) that predict the runs' step times
    best; never a worse fit than none (factor 1, no overhead)."""
    if not runs:
        raise InputError("runs", "expected at least one measured run")

    def residuals(scale: float, overhead: float) -> list[float]:
        out = []
        for run in runs:
            for predicted, measured in zip(rank_end_ms(run, scale, overhead), run.measured_step_ms):
                out.append((predicted - measured) / measured)
        return out

    scale, overhead = 1.0, 0.0
    r = residuals(scale, overhead)
    before = _rms(r)
    for _ in range(iterations):
        d_scale = [(a - b) / 1e-3 for a, b in zip(residuals(scale + 1e-3, overhead), r)]
        d_overhead = [(a - b) / 1e-2 for a, b in zip(residuals(scale, overhead + 1e-2), r)]
        step_scale, step_overhead = _bounded_step(r, d_scale, d_overhead, scale, overhead)
        if step_scale == step_overhead == 0.0:
            break
        # the replay is piecewise linear: a step across a kink can raise the error, so halve it until the error falls
        for _ in range(8):
            tried = residuals(scale + step_scale, overhead + step_overhead)
            if _rms(tried) < _rms(r):
                break
            step_scale, step_overhead = step_scale / 2, step_overhead / 2
        else:
            break
        scale, overhead, r = scale + step_scale, overhead + step_overhead, tried
        if abs(step_scale) < 1e-6 and abs(step_overhead) < 1e-5:
            break
    memory_gaps = []
    for run in runs:
        if run.measured_peak_bytes:
            spec = run.spec
            predicted = evaluate_plan(run.profile, spec, run.stage_layer_counts, run.layer_modes).rank_peak_memory_bytes
            memory_gaps += [m - p for m, p in zip(run.measured_peak_bytes, predicted)]
    constant = sum(memory_gaps) / len(memory_gaps) if memory_gaps else 0.0
    return Calibration(
        time_scale=scale,
        action_overhead_ms=overhead,
        rank_constant_bytes=constant,
        error_before=before,
        error_after=_rms(r),
    )


def _bounded_step(
    errors: list[float], d_scale: list[float], d_overhead: list[float], scale: float, overhead: float
) -> tuple[float, float]:
    """The Gauss-Newton step on (scale, overhead) that keeps scale >= MIN_SCALE and overhead >= 0: the
    joint step where it stays within them, else the best of the steps with one of the two on its bound
    (a run whose engine is faster than the profile wants a negative overhead; zero is what it gets)."""
    a11 = sum(x * x for x in d_scale)
    a12 = sum(x * y for x, y in zip(d_scale, d_overhead))
    a22 = sum(y * y for y in d_overhead)
    b1 = -sum(x * e for x, e in zip(d_scale, errors))
    b2 = -sum(y * e for y, e in zip(d_overhead, errors))
    low_scale, low_overhead = MIN_SCALE - scale, -overhead  # the steps that reach the bounds

    def predicted(step: tuple[float, float]) -> float:  # the squared error the linear model predicts
        return sum((e + x * step[0] + y * step[1]) ** 2 for e, x, y in zip(errors, d_scale, d_overhead))

    candidates = [(0.0, 0.0)]
    determinant = a11 * a22 - a12 * a12
    if determinant > 1e-12 * a11 * a22:
        candidates.append(((b1 * a22 - b2 * a12) / determinant, (a11 * b2 - a12 * b1) / determinant))
    for fixed_overhead in (0.0, low_overhead):
        if a11 > 0:
            candidates.append((max((b1 - a12 * fixed_overhead) / a11, low_scale), fixed_overhead))
    if a22 > 0:
        candidates.append((low_scale, max((b2 - a12 * low_scale) / a22, low_overhead)))
    feasible = [step for step in candidates if step[0] >= low_scale - 1e-12 and step[1] >= low_overhead - 1e-12]
    return min(feasible, key=predicted)


def _rms(values: list[float]) -> float:
    return (sum(v * v for v in values) / len(values)) ** 0.5 if values else 0.0
