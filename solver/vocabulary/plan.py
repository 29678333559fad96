"""A Plan: which contiguous layers each virtual stage holds and each layer's recompute mode, with
what the simulator says of it, and its views as MindFormers keys, per-rank counts and per-layer lists."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from basics.deprecation import renamed_attributes
from simulator.result import BubbleSplit, SimulationResult
from solver.formats.mindformers import mindformers_view
from solver.vocabulary.spec import PipelineSpec, spec_to_dict


@renamed_attributes(stage_peak_memory_bytes="rank_peak_memory_bytes", stage_chunk_ranges="rank_chunk_ranges")
@dataclass(frozen=True)
class Plan:
    """A layer split and recompute choice, simulated. Virtual stage v holds layers
    [sum(counts[:v]), sum(counts[:v+1])) of the model.

    Made by `solve`, `evaluate_plan`, `even_plan`, `plan_from_dict` or `plan_from_mindformers`, which
    check it against the profile and simulate it; `to_dict` gives the plan JSON (`sapp-hook solve
    --plan-out`) that `plan_from_dict` and `sapp_hook.layout_from_dict` read back.

    Attributes:
        spec: the `PipelineSpec` it is for.
        layer_names: every layer of the profile, in model order.
        layer_kinds: each layer's kind ("head", "body:...", "tail").
        stage_layer_counts: layers per virtual stage, in model order (counts above).
        layer_modes: each layer's recompute mode ("none", "selective", "full", ...).
        iteration_time_ms: the simulated iteration time.
        bubble: where the idle time goes (`simulator.BubbleSplit`).
        rank_peak_memory_bytes: each rank's simulated peak.
        weight_split_assumed: some I/W action split a backward whose weight-gradient time was not
            measured (half of it assumed).
        status: "optimal" (proven), "feasible" (the time limit stopped the search; see `gap`),
            "interrupted" (see `gap`) or "given" (checked and simulated, not searched).
        gap: the proven relative gap to the best possible iteration time,
            (iteration_time_ms - lower_bound_ms) / iteration_time_ms; None where not searched.
        lower_bound_ms: a proven lower bound on any plan's iteration time; None where not searched.
        solve_seconds: how long the search took; None where not searched.
        simulation: the replay (`simulator.SimulationResult`: every action's times, memory curves);
            left out of comparisons and repr.

    Example:
        >>> from solver import LayerProfile, ModelProfile, PipelineSpec, RecomputeCost, even_plan
        >>> none = {"none": RecomputeCost(extra_ms=0.0, activation_bytes=8 * 2**20)}
        >>> kinds = ["head", *["body:block"] * 6, "tail"]
        >>> profile = ModelProfile(tuple(LayerProfile(f"layer{i}", k, 2.0, 4.0, none) for i, k in enumerate(kinds)))
        >>> plan = even_plan(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4))
        >>> plan.stage_layer_counts, plan.iteration_time_ms, plan.status, plan.fits
        ((4, 4), 120.0, 'given', True)
        >>> plan.rank_chunk_ranges()
        [[range(0, 4)], [range(4, 8)]]
        >>> plan.to_dict()["plan"]["virtual_stage_layers"]
        [4, 4]
    """

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
        """Whether every rank's peak is within `spec.memory_budget_bytes`."""
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
