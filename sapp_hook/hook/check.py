"""The first step a job trains under a plan, measured against what the plan predicted of it: on each pipeline
rank, the most bytes autograd held for backward (saved-tensor hooks, the one reading every device has) and the
step's time from one `step()` to the next."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from profiler.measure.held import HeldActivations

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
    """Measures one step of this rank: `start()` before it, `stop()` after it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._held: HeldActivations | None = None
        self._started = 0.0

    def start(self) -> None:
        self._held = HeldActivations([*self.model.parameters(), *self.model.buffers()])
        self._held.__enter__()
        self._started = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """{"activation_bytes", "step_ms"} of the step since `start()`."""
        elapsed_ms = (time.perf_counter() - self._started) * 1e3
        held, self._held = self._held, None
        held.__exit__(None, None, None)
        return {"activation_bytes": held.peak_bytes, "step_ms": elapsed_ms}

    def cancel(self) -> None:
        if self._held is not None:
            self._held.__exit__(None, None, None)
            self._held = None


def compare(
    measured: Sequence[dict[str, float]], predicted_activation: Sequence[float], predicted_step_ms: Sequence[float]
) -> list[RankCheck]:
    """Each pipeline rank's measurement beside its prediction, in pipeline order."""
    return [
        RankCheck(rank, activation, int(values["activation_bytes"]), step_ms, values["step_ms"])
        for rank, (values, activation, step_ms) in enumerate(zip(measured, predicted_activation, predicted_step_ms))
    ]


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
