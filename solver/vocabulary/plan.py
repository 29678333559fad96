"""A Plan: which contiguous layers each virtual stage holds and each layer's recompute mode, with
what the simulator says of it, and its views as MindFormers keys, per-rank counts and per-layer lists."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from simulator.result import BubbleSplit, SimulationResult
from solver.formats.mindformers import mindformers_view
from solver.vocabulary.spec import PipelineSpec, spec_to_dict


@dataclass(frozen=True)
class Plan:
    """A layer split and recompute choice, simulated. Virtual stage v holds layers
    [sum(counts[:v]), sum(counts[:v+1])) of the model."""

    spec: PipelineSpec
    layer_names: tuple[str, ...]
    layer_kinds: tuple[str, ...]
    stage_layer_counts: tuple[int, ...]  # per virtual stage, in model order
    layer_modes: tuple[str, ...]
    iteration_time_ms: float
    bubble: BubbleSplit
    rank_peak_memory_bytes: tuple[float, ...]
    weight_split_assumed: bool
    status: str = "given"  # "optimal", "feasible" (time limit; see gap), "interrupted" (see gap) or "given"
    gap: float | None = None  # proven relative gap to the best possible iteration time
    lower_bound_ms: float | None = None
    solve_seconds: float | None = None
    simulation: SimulationResult | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return all(peak <= self.spec.memory_budget_bytes for peak in self.rank_peak_memory_bytes)

    def with_search(self, *, status: str, gap: float, lower_bound_ms: float, solve_seconds: float) -> Plan:
        return dataclasses.replace(
            self, status=status, gap=gap, lower_bound_ms=lower_bound_ms, solve_seconds=solve_seconds
        )

    def virtual_stage_ranges(self) -> list[range]:
        """The layers each virtual stage holds, in model order."""
        ranges, start = [], 0
        for count in self.stage_layer_counts:
            ranges.append(range(start, start + count))
            start += count
        return ranges

    def rank_chunk_ranges(self) -> list[list[range]]:
        """[rank][chunk]: the layers chunk `chunk` of pipeline rank `rank` holds."""
        schedule = self.spec.pipeline_schedule
        ranges = self.virtual_stage_ranges()
        return [[ranges[virtual] for virtual in schedule.virtual_stages_of(rank)] for rank in range(schedule.ranks)]

    def mindformers(self) -> dict[str, object]:
        """MindFormers' keys (see `mindformers_view`)."""
        return mindformers_view(
            self.spec.pipeline_schedule, self.layer_kinds, self.layer_modes, self.stage_layer_counts
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: the outcome, the spec, and the plan in every view."""
        schedule = self.spec.pipeline_schedule
        stage_of = {}
        for virtual, layers in enumerate(self.virtual_stage_ranges()):
            for index in layers:
                stage_of[index] = virtual
        return {
            "status": self.status,
            "iteration_time": self.iteration_time_ms,
            "time_unit": "ms",
            "gap": self.gap,
            "lower_bound_ms": self.lower_bound_ms,
            "solve_seconds": self.solve_seconds,
            "bubble": self.bubble.to_dict(),
            "rank_peak_memory_bytes": [round(b) for b in self.rank_peak_memory_bytes],
            "memory_budget_bytes": None if math.isinf(self.spec.memory_budget_bytes) else self.spec.memory_budget_bytes,
            "fits": self.fits,
            "weight_split_assumed": self.weight_split_assumed,
            "spec": spec_to_dict(self.spec),
            "plan": {
                **self.mindformers(),
                "virtual_stage_layers": list(self.stage_layer_counts),
                "rank_chunk_layers": [[len(r) for r in row] for row in self.rank_chunk_ranges()],
                "layers": [
                    {
                        "name": name,
                        "kind": kind,
                        "virtual_stage": stage_of[index],
                        "rank": schedule.rank_of(stage_of[index]),
                        "chunk": schedule.chunk_of(stage_of[index]),
                        "recompute": mode,
                    }
                    for index, (name, kind, mode) in enumerate(
                        zip(self.layer_names, self.layer_kinds, self.layer_modes)
                    )
                ],
            },
        }
