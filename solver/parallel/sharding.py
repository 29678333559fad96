"""Data parallelism's memory per rank: what each layer holds at rest after sharding (ZeRO, FSDP, DDP),
and what a chunk holds while a step runs where its parameters are sharded: FSDP2 under torch's pipelining
(`fully_shard` per layer, the stage module as root), measured on torch 2.13, or per-layer gathering.

torch's pipeline stage runs every micro-batch's backward without reduce-scatter or resharding
(`set_requires_gradient_sync(False)`, `set_reshard_after_backward(False)`) and reduces once, after the
chunk's last backward (`perform_reduce_grad`). So a rank holds its chunks' whole (unsharded) gradients from
their first backward to that reduce, and, where forwards do not re-shard (TorchTitan's default under
pipelining), their whole parameters from the first forward to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from simulator.costs import ShardedCosts
from solver.parallel.model_parallel import expert_replicas
from solver.vocabulary.profile import LayerProfile
from solver.vocabulary.spec import PipelineSpec, StaticBytes, shards_parameters, static_split


def layer_static(spec: PipelineSpec, layer: LayerProfile) -> StaticBytes:
    """What a layer of a rank profile (`solver.parallel.model_parallel.rank_profile`) holds at rest on its rank, per kind:
    its routed experts' share sharded over `expert_replicas`, the rest over the data-parallel ranks."""
    per_tensor = layer.optimizer_tensor_bytes()
    experts = layer.expert_parameter_bytes or 0.0
    if not experts or spec.expert_parallel == 1:
        return static_split(spec, layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes, per_tensor)
    share = experts / layer.parameter_bytes
    expert_gradient, expert_optimizer = layer.gradient_bytes * share, (layer.optimizer_bytes - per_tensor) * share
    rest = static_split(
        spec,
        layer.parameter_bytes - experts,
        layer.gradient_bytes - expert_gradient,
        layer.optimizer_bytes - expert_optimizer,
        per_tensor,
    )
    return rest + static_split(spec, experts, expert_gradient, expert_optimizer, replicas=expert_replicas(spec))


def tracks_step(spec: PipelineSpec) -> bool:
    """Whether data parallelism holds anything that comes and goes within a step (`sharded_costs`)."""
    return spec.fsdp or spec.zero_stage == 3 or not spec.gradients_persist


def step_gradient_bytes(
    spec: PipelineSpec, gradient_bytes: float, parameter_bytes: float | None = None
) -> tuple[float, float]:
    """(what a layer's gradients add at its chunk's first weight-gradient action of a step, what
    stays of them after the chunk's reduce to the step's end), above its static bytes. FSDP: the
    whole gradient, then its shard, shaped as its parameter's (`parameter_bytes`, default the
    gradient's), where gradients do not persist (else counted at rest). Without FSDP, where gradients
    do not persist: the gradient a rank keeps (its shard under ZeRO 2 and 3), from its first backward on."""
    if spec.ddp and spec.ddp_bucket_view:
        return 0.0, 0.0
    dp = spec.data_parallel
    kept = gradient_bytes / dp if shards_parameters(spec) or spec.zero_stage >= 2 else gradient_bytes
    if spec.fsdp:
        shard = (gradient_bytes if parameter_bytes is None else parameter_bytes) / dp
        return gradient_bytes, 0.0 if spec.gradients_persist else shard
    return (0.0, 0.0) if spec.gradients_persist else (kept, kept)


@dataclass(frozen=True)
class Unit:
    """One layer of a chunk as FSDP runs it (one `fully_shard` unit each): its whole parameter and
    gradient bytes, the activation its forward adds, its backward's working set (measured from the
    arrival of its output's gradient), that gradient where the chunk's backward makes it (from the
    layer after it; 0 for the last), what the chunk's backward has freed before its own (the later
    layers' activations), and whether a forward re-shards it."""

    parameter_bytes: float
    gradient_bytes: float
    activation_bytes: float
    working_bytes: float
    handed_bytes: float
    freed_bytes: float
    reshards_after_forward: bool


def sharded_costs(
    spec: PipelineSpec,
    units: Sequence[Unit],
    *,
    start_bytes: float,
    seed_bytes: float,
    reduce_held_bytes: float = 0.0,
) -> ShardedCosts | None:
    """What the chunk of `units` (model order) holds for its data parallelism while a step runs, as
    `simulator.sharded` replays it; None where nothing. `start_bytes`: what its forward holds before the
    first layer (the rotary tables); `seed_bytes`: what its backward holds throughout (the loss's
    gradient, on the last stage); `reduce_held_bytes`: what the engine holds through its reduce besides."""
    gradient, reduced = (
        zip(*(step_gradient_bytes(spec, unit.gradient_bytes, unit.parameter_bytes) for unit in units))
        if units
        else ((), ())
    )
    if spec.fsdp:
        gloo = spec.collective_backend == "gloo"
        whole = sum(unit.parameter_bytes for unit in units)
        return ShardedCosts(
            gathered_bytes=whole,
            forward_kept_bytes=sum(unit.parameter_bytes for unit in units if not unit.reshards_after_forward),
            gradient_bytes=sum(gradient),
            reduced_gradient_bytes=sum(reduced),
            forward_gather_working_bytes=_forward_walk(units, start_bytes, gloo),
            backward_gather_working_bytes=_backward_walk(units, seed_bytes, gloo),
            first_backward_working_bytes=_backward_walk(units, seed_bytes, gloo, arriving=gradient, gathers=False),
            first_backward_gather_working_bytes=_backward_walk(units, seed_bytes, gloo, arriving=gradient),
            reduce_working_bytes=_reduce_walk(units, reduced, spec.data_parallel, gloo) + reduce_held_bytes,
        )
    if spec.zero_stage == 3:  # each layer's parameters gathered for its own forward and backward, freed after
        held, forward = start_bytes, 0.0
        for unit in units:
            forward = max(forward, held + unit.parameter_bytes)
            held += unit.activation_bytes
        return ShardedCosts(
            gradient_bytes=sum(gradient),
            reduced_gradient_bytes=sum(reduced),
            forward_gather_working_bytes=forward,
            layer_gather_bytes=max((u.parameter_bytes + u.gradient_bytes for u in units), default=0.0),
        )
    if any(gradient):
        return ShardedCosts(gradient_bytes=sum(gradient), reduced_gradient_bytes=sum(reduced))
    return None


def _reduce_walk(units: Sequence[Unit], reduced: Sequence[float], dp: int, gloo: bool) -> float:
    """The most the chunk's reduce holds above its start, where every unit's parameters are gathered
    and its whole gradients made. FSDP2 reduces unit by unit in model order: each frees its gathered
    parameters, copies its gradients into the reduce-scatter's flat input and frees them (but its last
    parameter's, which `foreach_reduce` holds to its end: counted whole, on the safe side), allocates
    the output shard and, on gloo, a temporary as large as the input; the input goes as the next unit
    begins, and what the gradients leave (`reduced`) stays."""
    released, most = 0.0, 0.0
    for unit, kept in zip(units, reduced):
        most = max(most, reduce_peak(unit.parameter_bytes, unit.gradient_bytes, dp, gloo) - released)
        released += unit.parameter_bytes + unit.gradient_bytes - kept
    return most


def reduce_peak(parameter: float, gradient: float, dp: int, gloo: bool) -> float:
    """A unit's reduce at its most, above what was held as it began (`_reduce_walk`): its gathered
    parameters freed; the flat input, the gradient kept, the shard and gloo's temporary added."""
    return gradient * (1 + 1 / dp + (1 if gloo else 0)) - parameter


def _forward_walk(units: Sequence[Unit], start_bytes: float, gloo: bool) -> float:
    """The most a forward holds above its start where it finds the chunk sharded. Per unit: the
    all-gather's flat output and, on gloo, a temporary of the same size while it runs; then the copy
    into the unsharded parameters, with the flat output of the unit before still there (it goes at
    this copy). A unit that re-shards after its forward frees its parameters then; its activations stay."""
    held, previous_flat, most = start_bytes, 0.0, 0.0
    for unit in units:
        size = unit.parameter_bytes
        most = max(most, held + previous_flat + size + (size if gloo else 0.0), held + previous_flat + 2 * size)
        held += size
        previous_flat = size
        held += unit.activation_bytes
        if unit.reshards_after_forward:
            held -= size
    return most


def _backward_walk(
    units: Sequence[Unit],
    seed_bytes: float,
    gloo: bool,
    *,
    arriving: Sequence[float] | None = None,
    gathers: bool = True,
) -> float:
    """The most a backward holds above its start where it finds the units forwards re-shard sharded
    (reshard after forward, after a forward; `gathers`): last unit first, each such unit is all-gathered
    at its pre-backward (or taken from the prefetch), copied out and kept (a backward never re-shards),
    and the unit before it is prefetched (its flat output held, with gloo's temporary while it runs)
    before its own backward computes. Gradients are counted from the backward's start
    (`ShardedCosts.gradient_bytes`), or, given per unit (`arriving`: the backward that makes the step's
    gradients), from each unit's own backward on: the gradient it computes is kept, not added."""
    gathered, prefetched, most, made = 0.0, -1, 0.0, 0.0
    for index in reversed(range(len(units))):
        unit = units[index]
        before = seed_bytes + unit.handed_bytes - unit.freed_bytes + made  # at its pre-backward
        if arriving is not None:
            made += arriving[index]
        if not gathers:
            most = max(most, before + unit.working_bytes)
            continue
        size = unit.parameter_bytes
        if unit.reshards_after_forward:
            if prefetched == index:
                most = max(most, before + gathered + size)
            else:
                most = max(most, before + gathered + size + (size if gloo else 0.0), before + gathered + 2 * size)
                gathered += size
        if index and units[index - 1].reshards_after_forward:
            flat = units[index - 1].parameter_bytes
            most = max(most, before + gathered + flat + (flat if gloo else 0.0))
            gathered += flat
            prefetched = index - 1
        most = max(most, before + gathered + unit.working_bytes)
    return most
