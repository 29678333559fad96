"""What a launch config needs from a plan: the schedule, and which layers each virtual stage holds with
their recompute mode. Read from a `Plan` or from the plan JSON `sapp-hook solve --plan-out` writes."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from basics.deprecation import renamed_attributes
from basics.errors import InputError, shown
from basics.fields import Fields
from solver import PipelineSpec, Plan
from solver.evaluate import even_counts
from solver.formats.mindformers import mindformers_view
from solver.vocabulary.load import read_plan_json
from solver.vocabulary.profile import FULL, HEAD, NONE, RECOMPUTE_MODES, SELECTIVE, TAIL, check_kinds
from solver.vocabulary.spec import spec_from_dict, spec_to_dict


@dataclass(frozen=True)
class PlacedLayer:
    """One layer of a plan, where it runs and how.

    Attributes:
        name: the layer's module name as profiled ("layers.3"; "head" and "tail" stand for what runs
            before and after the blocks).
        kind: "head", "tail", or "body:TYPE" for a block ("body:block", "body:moe", ...).
        virtual_stage: the virtual stage holding it, in model order: stage = chunk x pipeline_parallel +
            rank under loop placement; V schedules run chunk 1 back up the ranks (`simulator.schedule`).
        recompute: its recompute mode ("none", "selective", "full", ...).
    """

    name: str
    kind: str
    virtual_stage: int  # in model order: virtual stage v = chunk x pipeline_parallel + rank for loop placement
    recompute: str

    @property
    def is_body(self) -> bool:
        """Whether it is a block, neither head nor tail."""
        return self.kind not in (HEAD, TAIL)


@renamed_attributes(stages="pipeline_parallel")
@dataclass(frozen=True)
class Layout:
    """What a launch config needs from a plan: the schedule, and which layers each virtual stage holds
    with their recompute mode. Made by `layout_of` (a `Plan`), `layout_from_dict` (the plan JSON) or
    `even_layout`; `write_config` writes it, `build_stages` runs it.

    Attributes:
        schedule: the schedule's name, as torch.distributed.pipelining gives it ("1F1B", ...).
        pipeline_parallel: pipeline ranks (the deprecated property `stages` still reads it).
        chunks: virtual stages per rank.
        micro_batches: micro-batches per iteration.
        layers: every layer of the model in model order (`PlacedLayer`), going through the virtual
            stages in order: the head layers on the first, the tail layers on the last.
        mindformers: the plan as MindFormers' keys (`offset`, `recompute`, `select_recompute`,
            `select_comm_recompute`, `pp_interleave_num`).
        plan_data: the plan JSON (`Plan.to_dict`) it was read from.
        microbatch_group_size: Interleaved1F1B's group size (Megatron's `microbatch_group_size_per_vp_stage`)
            as the spec states it; None: the schedule's default.
        spec: the `PipelineSpec` the plan was solved for (its other parallel degrees are checked against
            the config's); None where the layout was built without one.

    Example:
        >>> from solver import PipelineSpec
        >>> spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="Interleaved1F1B")
        >>> layout = even_layout(spec, body_layers=8)
        >>> layout.num_virtual_stages, [len(layers) for layers in layout.virtual_stages()]
        (4, [3, 2, 2, 3])
        >>> layout.mindformers["offset"], layout.body_modes()
        ([[0, 0], [0, 0]], {'none'})
    """

    schedule: str
    pipeline_parallel: int
    chunks: int
    micro_batches: int
    layers: tuple[PlacedLayer, ...]
    mindformers: Mapping[str, object]
    plan_data: Mapping[str, object]  # the plan JSON (Plan.to_dict) it was read from
    microbatch_group_size: int | None = None  # Interleaved1F1B: the spec's, None for the schedule's default
    spec: PipelineSpec | None = None

    @property
    def num_virtual_stages(self) -> int:
        """pipeline_parallel x chunks."""
        return self.pipeline_parallel * self.chunks

    def virtual_stages(self) -> list[list[PlacedLayer]]:
        """The layers of each virtual stage, in model order."""
        cells: list[list[PlacedLayer]] = [[] for _ in range(self.num_virtual_stages)]
        for layer in self.layers:
            cells[layer.virtual_stage].append(layer)
        return cells

    @property
    def body_layers(self) -> int:
        """How many blocks (body layers) the plan places."""
        return sum(1 for layer in self.layers if layer.is_body)

    def body_modes(self) -> set[str]:
        """The recompute modes the blocks use."""
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

    def plan_json(self) -> str:
        """The plan JSON this layout was read from: the exact plan, for a side file that `sapp_hook.apply`,
        `sapp-hook apply --plan` and `simulate --plan` read where a config cannot say it."""
        return json.dumps(self.plan_data, indent=1) + "\n"


def even_layout(spec: PipelineSpec, body_layers: int) -> Layout:
    """A head, `body_layers` blocks and a tail split evenly over the virtual stages, without recompute:
    a stand-in plan for checking a config before any plan exists.

    Args:
        spec: the job's pipeline: its schedule, ranks, chunks and micro-batches.
        body_layers: the model's blocks, at least 1; the first virtual stages take one more where they
            do not divide evenly (a stage may be left empty). The layers are named "head", "layers.0",
            ..., "tail".

    Returns:
        The `Layout`, its `plan_data` holding only the spec and the layers.

    Raises:
        InputError: `body_layers` below 1 (naming `layers`: no body layer).

    Example:
        >>> from solver import PipelineSpec
        >>> layout = even_layout(PipelineSpec(pipeline_parallel=2, micro_batches=4), body_layers=5)
        >>> [(layer.name, layer.virtual_stage) for layer in layout.layers]
        [('head', 0), ('layers.0', 0), ('layers.1', 0), ('layers.2', 0), ('layers.3', 1), ('layers.4', 1), ('tail', 1)]
    """
    virtual_stages = spec.pipeline_schedule.num_virtual_stages
    virtual = [v for v, count in enumerate(even_counts(body_layers, virtual_stages)) for _ in range(count)]
    layers = [{"name": "head", "kind": HEAD, "virtual_stage": 0, "recompute": NONE}]
    layers += [
        {"name": f"layers.{i}", "kind": "body:block", "virtual_stage": v, "recompute": NONE}
        for i, v in enumerate(virtual)
    ]
    layers.append({"name": "tail", "kind": TAIL, "virtual_stage": virtual_stages - 1, "recompute": NONE})
    return layout_from_dict({"spec": spec_to_dict(spec), "plan": {"layers": layers}})


def layout_of(plan: Plan) -> Layout:
    """The `Layout` of a `Plan` (`solve`, `evaluate_plan`, ...): `layout_from_dict(plan.to_dict())`.

    Example::

        plan = solver.solve(profile, spec)
        sapp_hook.write_config("mindformers", "train.yaml", sapp_hook.layout_of(plan))
    """
    return layout_from_dict(plan.to_dict())


def as_layout(plan: Plan | Layout | Mapping[str, object] | str | os.PathLike) -> Layout:
    """A Layout from a Plan, a Layout, a plan JSON as read, or the path of a plan JSON (read as `apply --plan`
    reads it: a config's side file checked against the config beside it)."""
    if isinstance(plan, Layout):
        return plan
    if isinstance(plan, Plan):
        return layout_of(plan)
    if isinstance(plan, (str, os.PathLike)):
        return layout_from_dict(read_plan_json(plan, "plan"))
    if not isinstance(plan, Mapping):
        raise InputError(
            "plan", f"expected a Plan, a Layout, a plan JSON as read or its path, got {type(plan).__name__}"
        )
    return layout_from_dict(plan)


def layout_from_dict(data: object) -> Layout:
    """A Layout from a plan JSON (`Plan.to_dict()`); its MindFormers keys, where given, must say what
    its layers say.

    Args:
        data: the plan JSON as read (`sapp-hook solve --plan-out`, a cached plan): its `spec` and its
            `plan.layers` (each layer's `name`, `kind`, `virtual_stage`, `recompute`). The other views
            of the split it may give (MindFormers' keys, `virtual_stage_layers`, `rank_chunk_layers`,
            each layer's `rank` and `chunk`) are checked against the layers.

    Returns:
        The `Layout`.

    Raises:
        InputError: naming the JSON field (`spec.schedule`, `plan.layers[2].virtual_stage`, ...): a field
            missing or of the wrong type, a spec `PipelineSpec` refuses, no layers or no body layer, a
            virtual stage outside ranks x chunks or out of model order, an unknown recompute mode, a head
            layer off the first virtual stage or a tail layer off the last, or a view of the split that
            says other than the layers.

    Example:
        >>> from solver import PipelineSpec
        >>> data = dict(even_layout(PipelineSpec(pipeline_parallel=2, micro_batches=4), body_layers=2).plan_data)
        >>> layout_from_dict(data).layers[1]
        PlacedLayer(name='layers.0', kind='body:block', virtual_stage=0, recompute='none')
        >>> layout_from_dict({**data, "plan": {**data["plan"], "virtual_stage_layers": [3, 1]}})
        Traceback (most recent call last):
        ...
        basics.errors.InputError: plan.virtual_stage_layers: is [3, 1]; the plan's layers say [2, 2]
    """
    fields = Fields(data, "")
    spec = spec_from_dict(fields.raw("spec"))
    schedule = spec.pipeline_schedule
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
            virtual_stage=layer.integer("virtual_stage", required=True, least=0),
            recompute=layer.text("recompute", required=True),
        )
        if placed.virtual_stage >= schedule.num_virtual_stages:
            raise InputError(layer.at("virtual_stage"), f"expected < {schedule.num_virtual_stages} (ranks x chunks)")
        if placed.recompute not in RECOMPUTE_MODES:
            raise InputError(layer.at("recompute"), f"expected one of {', '.join(RECOMPUTE_MODES)}")
        if layers and placed.virtual_stage < layers[-1].virtual_stage:
            raise InputError(layer.at("virtual_stage"), "layers must go through the virtual stages in model order")
        layers.append(placed)
    kinds = [layer.kind for layer in layers]
    check_kinds(kinds, [f"plan.layers[{index}].kind" for index in range(len(layers))])
    last = schedule.num_virtual_stages - 1
    for index, layer in enumerate(layers):
        if (layer.kind == HEAD and layer.virtual_stage != 0) or (layer.kind == TAIL and layer.virtual_stage != last):
            where = "first" if layer.kind == HEAD else "last"
            raise InputError(
                f"plan.layers[{index}].virtual_stage", f"a {layer.kind} layer belongs on the {where} virtual stage"
            )
    for index, (item, layer) in enumerate(zip(items, layers)):  # the rank and chunk each layer says, as simulate reads
        for key, derived in (
            ("rank", schedule.rank_of(layer.virtual_stage)),
            ("stage", schedule.rank_of(layer.virtual_stage)),  # the former name of rank
            ("chunk", schedule.chunk_of(layer.virtual_stage)),
        ):
            given = item.get(key)
            if given is not None and json.dumps(given) != json.dumps(derived):
                raise InputError(
                    f"plan.layers[{index}].{key}",
                    f"is {shown(given)}; its virtual_stage {layer.virtual_stage} says {derived}",
                )
    counts = [
        sum(1 for layer in layers if layer.virtual_stage == virtual) for virtual in range(schedule.num_virtual_stages)
    ]
    mindformers = mindformers_view(schedule, kinds, [layer.recompute for layer in layers], counts)
    per_rank = [[counts[virtual] for virtual in schedule.virtual_stages_of(rank)] for rank in range(schedule.ranks)]
    views = {**mindformers, "virtual_stage_layers": counts, "rank_chunk_layers": per_rank}  # simulate reads one
    for key, derived in views.items():
        given = plan.raw(key)
        if given is not None and json.dumps(given) != json.dumps(derived):  # true is not 1 here
            raise InputError(f"plan.{key}", f"is {shown(given)}; the plan's layers say {derived!r}")
    return Layout(
        schedule=schedule.name,
        pipeline_parallel=schedule.ranks,
        chunks=schedule.chunks,
        micro_batches=spec.micro_batches,
        layers=tuple(layers),
        mindformers=mindformers,
        plan_data=data,
        microbatch_group_size=spec.microbatch_group_size,
        spec=spec,
    )
