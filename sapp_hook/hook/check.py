"""The first step a job trains under a plan, measured against what the plan predicted of it: on each pipeline
rank, the most bytes autograd held for backward (saved-tensor hooks, the one reading every device has) and the
step's time from one `step()` to the next."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from basics.files import append_lines, atomic_write_text
from profiler.measure.held import HeldActivations
from sapp_hook.validation.predicted import predictions
from solver import ModelProfile, plan_from_dict

log = logging.getLogger(__name__)
# Saved-tensor bytes are exact, step to step: a prediction further off than this is not noise but a change the
# plan did not see (another attention kernel, dtype or wrapper), or a model the profile was not taken of.
ACTIVATION_TOLERANCE = 0.05


@dataclass(frozen=True)
class RankCheck:
    """One pipeline rank's first step under the plan, beside the plan's prediction."""

    rank: int
    predicted_activation_bytes: float
    measured_activation_bytes: int
    predicted_step_ms: float
    measured_step_ms: float

    @property
    def activation_error(self) -> float:
        """(measured - predicted) / predicted; 0 where both are 0."""
        if not self.predicted_activation_bytes:
            return 0.0 if not self.measured_activation_bytes else float("inf")
        return (self.measured_activation_bytes - self.predicted_activation_bytes) / self.predicted_activation_bytes

    @property
    def drifted(self) -> bool:
        return abs(self.activation_error) > ACTIVATION_TOLERANCE

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "rank": self.rank,
            "predicted_activation_bytes": self.predicted_activation_bytes,
            "measured_activation_bytes": self.measured_activation_bytes,
            "activation_error": self.activation_error,
            "predicted_step_ms": self.predicted_step_ms,
            "measured_step_ms": self.measured_step_ms,
            "drifted": self.drifted,
        }


class StepMeasure:
    """Measures one step of this rank: `start()` before it, `stop()` after it. Counts the model's forwards too:
    a step that does not run the plan's micro-batches is no test of the plan."""

    def __init__(self, model: nn.Module, blocks: int) -> None:
        self.model, self.blocks = model, blocks
        self._held: HeldActivations | None = None
        self._started = 0.0
        self._forwards = 0
        self._handle: Any = None

    def start(self) -> None:
        self._held = HeldActivations([*self.model.parameters(), *self.model.buffers()])
        self._held.__enter__()
        self._handle = self.model.register_forward_pre_hook(self._forward)
        self._started = time.perf_counter()

    def _forward(self, module: nn.Module, args: tuple) -> None:
        self._forwards += torch.is_grad_enabled()  # evaluation forwards are not the plan's

    def stop(self) -> dict[str, float]:
        """{"activation_bytes", "step_ms", "forwards", "blocks"} of the step since `start()`."""
        elapsed_ms = (time.perf_counter() - self._started) * 1e3
        held = self._held
        self.cancel()
        return {
            "activation_bytes": held.peak_bytes,
            "step_ms": elapsed_ms,
            "forwards": self._forwards,
            "blocks": self.blocks,
        }

    def cancel(self) -> None:
        if self._held is not None:
            self._held.__exit__(None, None, None)
            self._held = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def compare(
    measured: Sequence[dict[str, float]], predicted_activation: Sequence[float], predicted_step_ms: Sequence[float]
) -> list[RankCheck]:
    """Each pipeline rank's measurement beside its prediction, in pipeline order."""
    return [
        RankCheck(rank, activation, int(values["activation_bytes"]), step_ms, values["step_ms"])
        for rank, (values, activation, step_ms) in enumerate(
            zip(measured, predicted_activation, predicted_step_ms, strict=True)
        )
    ]


def not_the_plan(measured: Sequence[Mapping[str, float]], plan_data: Mapping[str, Any]) -> str | None:
    """Why the measured step ran something else than the plan (another split, other micro-batches), or None."""
    layers = plan_data["plan"]["layers"]
    spec = plan_data["spec"]
    for rank, values in enumerate(measured):
        blocks = sum(1 for layer in layers if layer["rank"] == rank and layer["kind"] not in ("head", "tail"))
        forwards = spec["micro_batches"] * spec["chunks"]
        if (values.get("blocks"), values.get("forwards")) != (blocks, forwards):
            return (
                f"rank {rank} ran {values.get('blocks')} layers and {values.get('forwards')} forwards a step where "
                f"the plan has {blocks} and {forwards}"
            )
    return None


def against_plan(
    measured: Sequence[dict[str, float]], profile: ModelProfile, plan_data: Mapping[str, Any]
) -> list[RankCheck]:
    """Each pipeline rank's measurement (in pipeline order) beside what the plan made from `profile` predicts of it,
    in the terms a run measures (`sapp_hook.validation.predicted`)."""
    predicted = predictions(plan_from_dict(profile, plan_data), profile)
    return compare(measured, predicted["activation_peak_bytes"], predicted["step_ms"])


def check_lines(checks: Sequence[RankCheck]) -> list[str]:
    """The report's lines for a check."""
    from basics.units import format_bytes, format_ms

    lines = []
    for check in checks:
        lines.append(
            f"rank {check.rank}: held {format_bytes(check.measured_activation_bytes)} for backward at its peak, "
            f"predicted {format_bytes(check.predicted_activation_bytes)} ({check.activation_error:+.1%}); step "
            f"{format_ms(check.measured_step_ms)} ms, the pipeline's predicted {format_ms(check.predicted_step_ms)} ms"
        )
    return lines


def verdict(
    measured: Sequence[dict[str, float]],
    entry: Mapping[str, Any],
    plan_data: Mapping[str, Any],
    out_dir: Path | None,
    say: Callable[[str], None],
) -> tuple[list[RankCheck] | None, str | None]:
    """A reused plan's first step on each pipeline rank (`measured`, in pipeline order) against the plan of the
    cache `entry`: (the checks, or None where the step did not run the plan; why to plan again, or None). Said,
    logged, and kept in `out_dir` (check.json, and the report's end)."""
    other = not_the_plan(measured, plan_data)
    if other is not None:
        say(f"not checking the plan: {other} (does the job read the config written?)")
        return None, None
    checks = against_plan(measured, ModelProfile.from_dict(entry["profile"]), plan_data)
    lines = check_lines(checks)
    for line in lines:
        log.info("sapp-hook: under the plan, %s", line)
    if out_dir is not None:
        atomic_write_text(out_dir / "check.json", json.dumps({"ranks": [c.to_dict() for c in checks]}, indent=1) + "\n")
        append_lines(out_dir / "report.txt", ["under the plan, its first step:", *lines])
    worst = max(checks, key=lambda check: abs(check.activation_error))
    said = f"rank {worst.rank} held {worst.activation_error:+.1%} of the activations the plan predicted"
    if not worst.drifted:
        say(f"under the plan, each rank held what it predicted ({said})")
        return checks, None
    if entry.get("replanned_after_drift"):
        say(f"under the plan, {said}, and it was planned again for that already: keeping it")
        return checks, None
    empty = [rank for rank, values in enumerate(measured) if not values.get("blocks")]
    if empty:  # a profile under this split cannot say what a layer costs there
        say(
            f"under the plan, {said}, but rank {empty[0]} holds no layer under it, so profiling it again cannot "
            "measure one there: keeping it (plan afresh under an even split with SAPP_HOOK_FORCE=1 or force=True)"
        )
        return checks, None
    return checks, f"under the plan, {said} (more than {ACTIVATION_TOLERANCE:.0%} off)"
