"""What a launch config needs from a plan: the schedule, and which layers each virtual stage holds with
their recompute mode. Read from a `Plan` or from the plan JSON `sapp-hook solve --plan-out` writes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from simulator.errors import InputError
from solver import Plan
from solver.fields import Fields
from solver.profile import FULL, HEAD, NONE, RECOMPUTE_MODES, SELECTIVE, TAIL


@dataclass(frozen=True)
class PlacedLayer:
    name: str
    kind: str
    virtual_stage: int  # in model order: virtual stage v = chunk x stages + rank for loop placement
    recompute: str

    @property
    def is_body(self) -> bool:
        return self.kind not in (HEAD, TAIL)


@dataclass(frozen=True)
class Layout:
    schedule: str
    stages: int
    chunks: int
    micro_batches: int
    layers: tuple[PlacedLayer, ...]
    mindformers: Mapping[str, object]

    @property
    def num_virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stages(self) -> list[list[PlacedLayer]]:
        """The layers of each virtual stage, in model order."""
        cells: list[list[PlacedLayer]] = [[] for _ in range(self.num_virtual_stages)]
        for layer in self.layers:
            cells[layer.virtual_stage].append(layer)
        return cells

    @property
    def body_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.is_body)

    def body_modes(self) -> set[str]:
        return {layer.recompute for layer in self.layers if layer.is_body}

    def uniform_full_count(self) -> int | None:
        """k when every virtual stage fully recomputes exactly k body layers and nothing else recomputes."""
        if self.body_modes() - {NONE, FULL}:
            return None
        counts = {sum(1 for layer in cell if layer.recompute == FULL) for cell in self.virtual_stages()}
        return counts.pop() if len(counts) == 1 else None

    def heaviest_mode(self) -> str:
        """The body mode that saves the most memory among those used: what a config that cannot
        choose per layer sets for all of them, so that every stage fits."""
        modes = self.body_modes()
        for mode in (FULL, SELECTIVE):
            if mode in modes:
                return mode
        return NONE if modes <= {NONE} else FULL

    def per_layer(self) -> dict[str, object]:
        """The exact plan, for the side file the applying code reads where a config cannot say it."""
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            "chunks": self.chunks,
            "layers": [
                {"name": layer.name, "kind": layer.kind, "virtual_stage": layer.virtual_stage, "recompute": layer.recompute}
                for layer in self.layers
            ],
        }


def layout_of(plan: Plan) -> Layout:
    return layout_from_dict(plan.to_dict())


def layout_from_dict(data: object) -> Layout:
    """A Layout from a plan JSON (`Plan.to_dict()`)."""
    fields = Fields(data, "")
    spec = Fields(fields.raw("spec"), "spec")
    stages = spec.integer("stages", required=True, least=1)
    chunks = spec.integer("chunks", required=True, least=1)
    micro_batches = spec.integer("micro_batches", required=True, least=1)
    schedule = spec.text("schedule", required=True)
    plan = Fields(fields.raw("plan"), "plan")
    items = plan.raw("layers")
    if not isinstance(items, list) or not items:
        raise InputError("plan.layers", "expected a non-empty list of layers")
    layers = []
    for index, item in enumerate(items):
        layer = Fields(item, f"plan.layers[{index}]")
        placed = PlacedLayer(
            name=layer.text("name", required=True),
            kind=layer.text("kind", required=True),
            virtual_stage=layer.integer("virtual_stage", required=True),
            recompute=layer.text("recompute", required=True),
        )
        if placed.virtual_stage >= stages * chunks:
            raise InputError(layer.at("virtual_stage"), f"expected < {stages * chunks} (stages x chunks)")
        if placed.recompute not in RECOMPUTE_MODES:
            raise InputError(layer.at("recompute"), f"expected one of {', '.join(RECOMPUTE_MODES)}")
        if layers and placed.virtual_stage < layers[-1].virtual_stage:
            raise InputError(layer.at("virtual_stage"), "layers must go through the virtual stages in model order")
        layers.append(placed)
    mindformers = {key: plan.raw(key) for key in ("offset", "recompute", "select_recompute", "select_comm_recompute",
                                                  "pp_interleave_num")}
    return Layout(schedule=schedule, stages=stages, chunks=chunks, micro_batches=micro_batches,
                  layers=tuple(layers), mindformers=mindformers)
