"""Plans from a split and recompute choice, checked and simulated: given, read back from JSON or
MindFormers' keys, or the even split people start from."""

from __future__ import annotations

import json
from collections.abc import Mapping

from basics.errors import InputError, check_instance, shown
from basics.fields import Fields
from simulator import simulate
from solver.costs import pipeline_costs
from solver.formats.mindformers import mindformers_split
from solver.parallel.model_parallel import rank_profile
from solver.vocabulary.plan import Plan
from solver.vocabulary.profile import HEAD, NONE, TAIL, ModelProfile
from solver.vocabulary.spec import PipelineSpec, spec_from_dict


def evaluate_plan(
    profile: ModelProfile, spec: PipelineSpec, counts: tuple[int, ...] | list[int], modes: tuple[str, ...] | list[str]
) -> Plan:
    """Check a split and recompute choice against the profile and spec, and simulate it (for one rank
    of the spec's mesh: `solver.parallel.model_parallel.rank_profile`).

    Args:
        profile: every layer's costs (`load_profile`, `LayerProfiler.profile()`, `analytic_profile`).
        spec: how the job runs; its schedule says how many virtual stages there are.
        counts: layers per virtual stage, in model order (integers >= 0 adding up to the profile's
            layers): the first holds every head layer, the last every tail layer; 0 only with
            `spec.allow_empty_chunks`.
        modes: one recompute mode per layer, among those the layer's profile offers.

    Returns:
        The `Plan`, status "given", with its simulation. It may not fit the budget (`Plan.fits`).

    Raises:
        InputError: `profile` or `spec` of the wrong type; a mesh the profile cannot be divided for
            (naming the spec's field); `stage_layer_counts` of the wrong length or sum, not integers
            >= 0, without the head or tail layers where they belong, or with an empty virtual stage;
            `layer_modes` of the wrong length or `layer_modes[i]` a mode that layer does not offer.

    Example:
        >>> from solver import LayerProfile, ModelProfile, PipelineSpec, RecomputeCost
        >>> none = {"none": RecomputeCost(extra_ms=0.0, activation_bytes=8 * 2**20)}
        >>> kinds = ["head", *["body:block"] * 6, "tail"]
        >>> profile = ModelProfile(tuple(LayerProfile(f"layer{i}", k, 2.0, 4.0, none) for i, k in enumerate(kinds)))
        >>> plan = evaluate_plan(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4), [3, 5], ["none"] * 8)
        >>> plan.iteration_time_ms  # the slower rank 1 sets the pace
        138.0
        >>> [peak / 2**20 for peak in plan.rank_peak_memory_bytes]  # MiB: 2 micro-batches of 3 layers; 1 of 5
        [48.0, 40.0]
        >>> evaluate_plan(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4), [4, 3], ["none"] * 8)
        Traceback (most recent call last):
        ...
        basics.errors.InputError: stage_layer_counts: sum to 7; the profile has 8 layers
    """
    check_instance(profile, ModelProfile, "profile", "a ModelProfile (solver.load_profile)")
    check_instance(spec, PipelineSpec, "spec", "a PipelineSpec")
    profile = rank_profile(profile, spec)
    counts, modes = tuple(counts), tuple(modes)
    schedule = spec.pipeline_schedule
    layers = profile.layers
    if len(counts) != schedule.num_virtual_stages:
        raise InputError(
            "stage_layer_counts", f"expected {schedule.num_virtual_stages} virtual stages, got {len(counts)}"
        )
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise InputError("stage_layer_counts", f"expected integers >= 0, got {shown(list(counts))}")
    if sum(counts) != len(layers):
        raise InputError("stage_layer_counts", f"sum to {shown(sum(counts))}; the profile has {len(layers)} layers")
    heads = sum(1 for layer in layers if layer.kind == HEAD)
    tails = sum(1 for layer in layers if layer.kind == TAIL)
    if counts[0] < heads:
        raise InputError("stage_layer_counts", f"the first virtual stage must hold all {heads} head layers")
    if counts[-1] < tails:
        raise InputError("stage_layer_counts", f"the last virtual stage must hold all {tails} tail layers")
    if not spec.allow_empty_chunks and 0 in counts:
        raise InputError(
            "stage_layer_counts", f"virtual stage {counts.index(0)} is empty (allow empty chunks to permit it)"
        )
    if len(modes) != len(layers):
        raise InputError("layer_modes", f"expected one recompute mode per layer ({len(layers)}), got {len(modes)}")
    for index, (layer, mode) in enumerate(zip(layers, modes)):
        if not isinstance(mode, str) or mode not in layer.recompute:
            raise InputError(f"layer_modes[{index}]", f"{layer.name} offers {', '.join(layer.modes)}; got {mode!r}")
    result = simulate(schedule, pipeline_costs(profile, spec, counts, modes))
    return Plan(
        spec=spec,
        layer_names=tuple(layer.name for layer in layers),
        layer_kinds=tuple(layer.kind for layer in layers),
        stage_layer_counts=counts,
        layer_modes=modes,
        iteration_time_ms=result.iteration_time_ms,
        bubble=result.bubble,
        rank_peak_memory_bytes=result.rank_peak_memory_bytes,
        weight_split_assumed=result.weight_split_assumed,
        simulation=result,
    )


def plan_from_mindformers(
    profile: ModelProfile, spec: PipelineSpec, keys: Mapping[str, object], *, notes: list[str] | None = None
) -> Plan:
    """A user's hand-made plan from MindFormers' keys (offset and the three recompute counts).

    Args:
        profile: every layer's costs.
        spec: how the job runs.
        keys: MindFormers' keys, as its config states them: `offset` (per rank, or [chunk][rank], the
            body layers each holds beyond the even share floor(body layers / virtual stages)),
            `recompute`, `select_recompute`, `select_comm_recompute` (how many body layers of each
            virtual stage are recomputed so; full ones count in all three) and `pp_interleave_num`
            (chunks, as the spec's). A key left out means 0 (or, for the select lists, the full count).
        notes: where given, each recompute count above the layers its stage holds (MindFormers lowers
            it to them) is said there, naming the key, the stage, the count and the layers.

    Returns:
        The `Plan`, status "given", simulated as `evaluate_plan` does.

    Raises:
        InputError: `keys` not a mapping, an unknown key, counts that do not fit the profile's body
            layers or the spec's ranks and chunks (naming the key and its place), and what
            `evaluate_plan` raises.

    Example:
        >>> from solver import LayerProfile, ModelProfile, PipelineSpec, RecomputeCost
        >>> none = {"none": RecomputeCost(extra_ms=0.0, activation_bytes=8 * 2**20)}
        >>> kinds = ["head", *["body:block"] * 6, "tail"]
        >>> profile = ModelProfile(tuple(LayerProfile(f"layer{i}", k, 2.0, 4.0, none) for i, k in enumerate(kinds)))
        >>> spec = PipelineSpec(pipeline_parallel=2, micro_batches=4)
        >>> plan = plan_from_mindformers(profile, spec, {"offset": [1, -1]})
        >>> plan.stage_layer_counts
        (5, 3)
    """
    check_instance(keys, Mapping, "keys", "a mapping of MindFormers keys (offset, recompute, ...)")
    return evaluate_plan(profile, spec, *mindformers_split(profile, spec, keys, notes))


def plan_from_dict(profile: ModelProfile, data: object) -> Plan:
    """Read back a plan JSON (Plan.to_dict) and re-simulate it against `profile`.

    Args:
        profile: the profile the plan is checked and simulated against (the one it was made from, or
            a newer measurement of the same model: its layers must have the plan's names).
        data: the plan JSON as read (`sapp-hook solve --plan-out`, `Plan.to_dict()`): its `spec` and
            `plan` (`virtual_stage_layers` and `layers`, each layer's `name` and `recompute`).

    Returns:
        The `Plan`, status "given", simulated against `profile` (the outcome the JSON states is not
        read).

    Raises:
        InputError: naming the JSON field (`spec.micro_batches`, `plan.layers[3].name`, ...): a field
            missing or of the wrong type, a layer count or name other than the profile's, a view of the
            split (MindFormers' keys, `rank_chunk_layers`, a layer's `virtual_stage`, `rank`, `chunk`,
            `kind`) that says other than `plan.virtual_stage_layers` and the recompute modes, and what
            `evaluate_plan` raises.

    Example:
        >>> from solver import LayerProfile, ModelProfile, PipelineSpec, RecomputeCost
        >>> none = {"none": RecomputeCost(extra_ms=0.0, activation_bytes=8 * 2**20)}
        >>> kinds = ["head", *["body:block"] * 6, "tail"]
        >>> profile = ModelProfile(tuple(LayerProfile(f"layer{i}", k, 2.0, 4.0, none) for i, k in enumerate(kinds)))
        >>> plan = evaluate_plan(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4), [3, 5], ["none"] * 8)
        >>> plan_from_dict(profile, plan.to_dict()).stage_layer_counts
        (3, 5)
    """
    check_instance(profile, ModelProfile, "profile", "a ModelProfile (solver.load_profile)")
    fields = Fields(data, "")
    spec = spec_from_dict(fields.raw("spec"))
    plan = Fields(fields.raw("plan"), "plan")
    counts = plan.raw("virtual_stage_layers")
    layer_items = plan.raw("layers")
    if not isinstance(layer_items, list) or len(layer_items) != len(profile.layers):
        raise InputError("plan.layers", f"expected {len(profile.layers)} layers like the profile")
    modes = []
    for index, item in enumerate(layer_items):
        layer = Fields(item, f"plan.layers[{index}]")
        name = layer.text("name", required=True)
        if name != profile.layers[index].name:
            raise InputError(
                layer.at("name"),
                f"is {shown(name)}; the profile's layer {index} is {shown(profile.layers[index].name)}",
            )
        modes.append(layer.text("recompute", required=True))
    if not isinstance(counts, list):
        raise InputError("plan.virtual_stage_layers", f"expected a list of integers, got {shown(counts)}")
    try:
        evaluated = evaluate_plan(profile, spec, counts, modes)
    except InputError as exc:  # the file's name for the split, not the Python API's
        if exc.field != "stage_layer_counts":
            raise
        raise InputError("plan.virtual_stage_layers", exc.detail) from None
    _check_views(evaluated, plan)
    return evaluated


def _check_views(plan: Plan, given: Fields) -> None:
    """Every view of the split a plan JSON gives (MindFormers' keys, the per-stage counts, each layer's
    place and kind) says what its virtual_stage_layers and recompute modes do: `apply` reads the layers,
    `simulate` the split, and both must read one plan."""
    derived = plan.to_dict()["plan"]
    saying = "plan.virtual_stage_layers and the layers' recompute say"
    for key, value in derived.items():
        said = given.raw(key)
        if key not in ("virtual_stage_layers", "layers") and said is not None and json.dumps(said) != json.dumps(value):
            raise InputError(f"plan.{key}", f"is {shown(said)}; {saying} {shown(value)}")
    for index, (item, layer) in enumerate(zip(given.raw("layers"), derived["layers"])):
        for key, meaning in (("virtual_stage",) * 2, ("rank",) * 2, ("stage", "rank"), ("chunk",) * 2, ("kind",) * 2):
            said = item.get(key)  # "stage": the former name of "rank"
            if said is not None and json.dumps(said) != json.dumps(layer[meaning]):
                raise InputError(
                    f"plan.layers[{index}].{key}",
                    f"is {shown(said)}; plan.virtual_stage_layers and the profile say {shown(layer[meaning])}",
                )


def even_counts(layers: int, parts: int) -> list[int]:
    """`layers` spread evenly over `parts`, the first ones taking one more where they do not divide."""
    return [layers // parts + (1 if v < layers % parts else 0) for v in range(parts)]


def even_plan(profile: ModelProfile, spec: PipelineSpec, mode: str = NONE) -> Plan:
    """The split people start from: body layers spread evenly over the virtual stages (the first ones
    take one more where they do not divide), head layers on the first, tail layers on the last, every
    body layer under recompute `mode`. Simulated like any plan; it may not fit.

    Args:
        profile: every layer's costs.
        spec: how the job runs.
        mode: the recompute mode of every body layer that offers it ("none" for the others, and for
            head and tail layers). Default "none".

    Returns:
        The `Plan`, status "given".

    Raises:
        InputError: what `evaluate_plan` raises (an empty virtual stage where there are fewer body
            layers than virtual stages, unless `spec.allow_empty_chunks`).

    Example:
        >>> from solver import LayerProfile, ModelProfile, PipelineSpec, RecomputeCost
        >>> none = {"none": RecomputeCost(extra_ms=0.0, activation_bytes=8 * 2**20)}
        >>> kinds = ["head", *["body:block"] * 6, "tail"]
        >>> profile = ModelProfile(tuple(LayerProfile(f"layer{i}", k, 2.0, 4.0, none) for i, k in enumerate(kinds)))
        >>> spec = PipelineSpec(pipeline_parallel=3, micro_batches=6)
        >>> even_plan(profile, spec).stage_layer_counts  # 6 body layers: 2 each, the head and the tail
        (3, 2, 3)
    """
    heads = sum(1 for layer in profile.layers if layer.kind == HEAD)
    tails = sum(1 for layer in profile.layers if layer.kind == TAIL)
    body = len(profile.layers) - heads - tails
    counts = even_counts(body, spec.pipeline_schedule.num_virtual_stages)
    counts[0] += heads
    counts[-1] += tails
    modes = [mode if layer.is_body and mode in layer.recompute else NONE for layer in profile.layers]
    return evaluate_plan(profile, spec, counts, modes)
