"""Measured values per layer and recompute mode, gathered over the profiled steps."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

PARTS = ("tp_whole_bytes", "sp_whole_bytes", "expert_bytes")


@dataclass
class LayerSamples:
    """Everything measured for one layer (slot): per recompute mode, one value per micro-batch pass."""

    forward_ms: dict[str, list[float]] = field(default_factory=dict)
    backward_ms: dict[str, list[float]] = field(default_factory=dict)
    kept_bytes: dict[str, list[int]] = field(default_factory=dict)
    input_bytes: list[int] = field(default_factory=list)
    saved_input_bytes: dict[str, list[int]] = field(default_factory=dict)  # of kept_bytes, the layer's input
    shared_bytes: dict[str, list[int]] = field(default_factory=dict)  # kept of what a stage computes for its blocks
    backward_peak_bytes: dict[str, list[int]] = field(default_factory=dict)  # allocator peaks over the backward
    # of kept_bytes, per tp_roles: what tensor parallelism leaves whole, without and with sequence
    # parallelism, and the routed experts' (only for the models tp_roles tags)
    tp_whole_bytes: dict[str, list[int]] = field(default_factory=dict)
    sp_whole_bytes: dict[str, list[int]] = field(default_factory=dict)
    expert_bytes: dict[str, list[int]] = field(default_factory=dict)

    def add(
        self,
        mode: str,
        forward_ms: float,
        backward_ms: float,
        kept_bytes: int,
        input_bytes: int,
        backward_peak_bytes: int | None,
        saved_input_bytes: int = 0,
        shared_bytes: int = 0,
        parts: tuple[int, int, int] | None = None,
    ) -> None:
        self.forward_ms.setdefault(mode, []).append(forward_ms)
        self.backward_ms.setdefault(mode, []).append(backward_ms)
        self.kept_bytes.setdefault(mode, []).append(kept_bytes)
        self.saved_input_bytes.setdefault(mode, []).append(saved_input_bytes)
        self.shared_bytes.setdefault(mode, []).append(shared_bytes)
        self.input_bytes.append(input_bytes)
        if parts is not None:
            for name, value in zip(PARTS, parts):
                getattr(self, name).setdefault(mode, []).append(value)
        if backward_peak_bytes is not None:
            self.add_working_set(mode, backward_peak_bytes)

    def add_working_set(self, mode: str, backward_peak_bytes: int) -> None:
        self.backward_peak_bytes.setdefault(mode, []).append(backward_peak_bytes)

    def merged(self, other: LayerSamples) -> LayerSamples:
        """This layer's samples and another's together (pooling the layers of one kind)."""
        out = LayerSamples()
        for name in (
            "forward_ms",
            "backward_ms",
            "kept_bytes",
            "saved_input_bytes",
            "shared_bytes",
            "backward_peak_bytes",
            *PARTS,
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(out, name, {m: mine.get(m, []) + theirs.get(m, []) for m in {*mine, *theirs}})
        out.input_bytes = self.input_bytes + other.input_bytes
        return out


def median(values: Iterable[float]) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else 0.0


def spread(values: Iterable[float]) -> float:
    """Max minus min: how far the measured steps disagree."""
    values = list(values)
    return float(max(values) - min(values)) if values else 0.0
