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

from simulator.errors import InputError
from solver.plan import evaluate_plan
from solver.profile import ModelProfile, RecomputeCost
from solver.spec import PipelineSpec


@dataclass(frozen=True)
class Run:
    """One measured run of a plan: what each rank measured."""

    profile: ModelProfile
    spec: PipelineSpec
    stage_layer_counts: tuple[int, ...]
    layer_modes: tuple[str, ...]
    measured_step_ms: tuple[float, ...]  # per rank
    measured_peak_bytes: tuple[float, ...] = ()  # per rank, when measured; compared with the predicted peak


@dataclass(frozen=True)
class Calibration:
    time_scale: float
    action_overhead_ms: float
    stage_constant_bytes: float
    error_before: float  # root mean square of the relative step-time errors, before and after
    error_after: float

    def apply(self, profile: ModelProfile, spec: PipelineSpec) -> tuple[ModelProfile, PipelineSpec]:
        """The profile with its times scaled and the spec with the overhead and constant memory added."""
        spec = dataclasses.replace(
            spec,
            action_overhead_ms=spec.action_overhead_ms + self.action_overhead_ms,
            stage_constant_bytes=spec.stage_constant_bytes + max(0.0, self.stage_constant_bytes),
        )
        return scale_times(profile, self.time_scale), spec


def scale_times(profile: ModelProfile, factor: float) -> ModelProfile:
    """Every layer time of `profile` times `factor`."""
    layers = tuple(
        dataclasses.replace(
            layer,
            forward_ms=layer.forward_ms * factor,
            backward_ms=layer.backward_ms * factor,
            weight_ms=None if layer.weight_ms is None else layer.weight_ms * factor,
            recompute={m: RecomputeCost(c.extra_ms * factor, c.activation_bytes, c.working_bytes)
                       for m, c in layer.recompute.items()},
        )
        for layer in profile.layers
    )
    return dataclasses.replace(profile, layers=layers)


def rank_end_ms(run: Run, time_scale: float = 1.0, action_overhead_ms: float = 0.0) -> list[float]:
    """When each rank's last action ends, simulated with the given calibration."""
    spec = dataclasses.replace(run.spec, action_overhead_ms=action_overhead_ms)
    plan = evaluate_plan(scale_times(run.profile, time_scale), spec, run.stage_layer_counts, run.layer_modes)
    return [plan.simulation.rank_finish_ms(rank) for rank in range(spec.stages)]


def calibrate(runs: Sequence[Run], iterations: int = 12) -> Calibration:
    if not runs:
        raise InputError("runs", "expected at least one measured run")

    def residuals(scale: float, overhead: float) -> list[float]:
        out = []
        for run in runs:
            for predicted, measured in zip(rank_end_ms(run, scale, overhead), run.measured_step_ms):
                out.append((predicted - measured) / measured)
        return out

    scale, overhead = 1.0, 0.0
    before = _rms(residuals(scale, overhead))
    for _ in range(iterations):
        r = residuals(scale, overhead)
        d_scale = [(a - b) / 1e-3 for a, b in zip(residuals(scale + 1e-3, overhead), r)]
        d_overhead = [(a - b) / 1e-2 for a, b in zip(residuals(scale, overhead + 1e-2), r)]
        # normal equations of the 2-parameter linear least squares step
        a11 = sum(x * x for x in d_scale)
        a12 = sum(x * y for x, y in zip(d_scale, d_overhead))
        a22 = sum(y * y for y in d_overhead)
        b1 = -sum(x * e for x, e in zip(d_scale, r))
        b2 = -sum(y * e for y, e in zip(d_overhead, r))
        determinant = a11 * a22 - a12 * a12
        if abs(determinant) < 1e-12:
            break
        step_scale = (b1 * a22 - b2 * a12) / determinant
        step_overhead = (a11 * b2 - a12 * b1) / determinant
        scale, overhead = max(0.05, scale + step_scale), max(0.0, overhead + step_overhead)
        if abs(step_scale) < 1e-6 and abs(step_overhead) < 1e-5:
            break
    memory_gaps = []
    for run in runs:
        if run.measured_peak_bytes:
            spec = run.spec
            predicted = evaluate_plan(run.profile, spec, run.stage_layer_counts, run.layer_modes).stage_peak_memory_bytes
            memory_gaps += [m - p for m, p in zip(run.measured_peak_bytes, predicted)]
    constant = sum(memory_gaps) / len(memory_gaps) if memory_gaps else 0.0
    return Calibration(time_scale=scale, action_overhead_ms=overhead, stage_constant_bytes=constant,
                       error_before=before, error_after=_rms(residuals(scale, overhead)))


def _rms(values: list[float]) -> float:
    return (sum(v * v for v in values) / len(values)) ** 0.5 if values else 0.0
