"""From a layer split and recompute choice to the simulator's per-(stage, chunk) costs: sums over
each chunk's layers, the working set its backward holds, and what the engine keeps besides.

[Note: what a rank holds at its peak]

The memory model (docs/design/memory-model.md) says what a rank holds at every point of its action
list, in bytes per device. `pipeline_costs` states its terms per chunk (`simulator.ChunkCosts`),
`simulator.replay` walks each rank's actions with them (the order alone sets the peak, not the times),
and the search's program states the same sums for every split at once. A rank's peak is the most,
over its actions, of::

      static                     for the whole run. Per layer, after data-parallel sharding
                                 (`layer_static`): parameters, gradients (where they persist between
                                 steps), optimizer state, DDP's bucket copies. Per chunk: the rank
                                 constant (on chunk 0), torch's receive buffers (`boundary_bytes`),
                                 the sends `Schedule1F1B` holds (`torch_1f1b_held_bytes`).
    + activations in flight      per (chunk, micro-batch) whose forward has run and whose freeing
                                 backward (B; W where it is split) has not: its layers' activation
                                 under their recompute modes, the stage output it sent until its
                                 gradient comes back (under torch's engine, the logits on the last
                                 stage instead), the rotary tables; less a first layer's saved input
                                 that is a receive buffer, already static (`buffered_input_bytes`).
    + pending, retained          split backward: what each I leaves for its W; what torch keeps from
                                 a micro-batch's last backward to the step's end: input gradients,
                                 sent outputs whose requests it keeps, the loss (`torch_engine_bytes`).
    + within the step            FSDP / ZeRO-3's gathered parameters, gradients that do not persist
                                 (`solver.parallel.sharding.sharded_costs`, replayed by `simulator.sharded`).
    + working set                only while a backward action runs, on top of what was held when it
                                 began: its gradients in flight and re-materialised activations, less
                                 what the layers whose backward ran before freed (`_working_bytes`;
                                 each half of a split backward: `_split_working_bytes`).

torch's engine (`spec.receive_buffers`) keeps, besides the layers' own: one receive buffer per
micro-batch for the input of every virtual stage but the first and one for the output gradient of
every one but the last (static: 2 x M stage outputs on a middle stage); the last stage's output (the
logits) per micro-batch in flight; every send under the schedules other than 1F1B, and the loss, to
the step's end (`solver.engine_memory`).

1F1B, rank 0 of 4, 8 micro-batches, one chunk: A is one micro-batch's activation, `w` the working set
of the backward running. Each F column shows what is held after it, each B column what is held while
it runs::

       held above
       static
               |             w     w     w     w     w
           4 A |          #  #  #  #  #  #  #  #  #  #  w
           3 A |       #  #  #  #  #  #  #  #  #  #  #  #  w
           2 A |    #  #  #  #  #  #  #  #  #  #  #  #  #  #  w
           1 A | #  #  #  #  #  #  #  #  #  #  #  #  #  #  #  #
               +-------------------------------------------------> rank 0's actions, in order
                 F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7

The peak, static + 4 A + w, comes at every backward of the steady state. Rank r of R holds at most
R - r micro-batches' activations (`SimulationResult.rank_peak_activations`: 4, 3, 2, 1), so under an
even split with no recompute rank 0 holds the most activations.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from simulator import ChunkCosts, PipelineCosts, schedule_kind
from solver.engine_memory import (
    boundary_bytes,
    handed_gradient_bytes,
    torch_1f1b_held_bytes,
    torch_engine_bytes,
    torch_hands_gradient_over,
    torch_reduce_held_bytes,
    torch_splits_backward,
    torch_unshard_lookahead,
)
from solver.parallel.sharding import Unit, layer_static, sharded_costs, tracks_step
from solver.vocabulary.profile import HEAD, TAIL, LayerProfile, ModelProfile
from solver.vocabulary.spec import PipelineSpec


def pipeline_costs(
    profile: ModelProfile, spec: PipelineSpec, counts: tuple[int, ...], modes: tuple[str, ...]
) -> PipelineCosts:
    """The simulator's per-(stage, chunk) costs of a split: sums over each chunk's layers, its
    working set the largest of theirs, each stage's constant memory on its first chunk, and what the
    engine keeps of the tensors stages pass (`boundary_bytes`, `torch_1f1b_held_bytes`) and of their
    backwards (`torch_engine_bytes`). The layers' retained bytes count where the backward is split only."""
    schedule = spec.pipeline_schedule
    constant = profile.rank_constant_bytes + spec.rank_constant_bytes
    kept_in_flight, kept_whole_run = boundary_bytes(profile, spec)
    in_buffers = buffered_input_bytes(profile, spec, counts)
    torch_retained, torch_pending = torch_engine_bytes(profile, spec)
    hands_over = torch_hands_gradient_over(spec)
    held_sends = torch_1f1b_held_bytes(profile, spec)
    reduce_held = torch_reduce_held_bytes(profile, spec)
    forward_overhead, backward_overhead, weight_overhead = spec.action_overheads_ms()
    splits, torch_split = schedule_kind(spec.schedule).splits_backward, torch_splits_backward(spec)
    grid: list[list[ChunkCosts]] = [[None] * schedule.chunks for _ in range(schedule.ranks)]  # type: ignore[list-item]
    start = 0
    for virtual, count in enumerate(counts):
        layers = [(profile.layers[i], modes[i]) for i in range(start, start + count)]
        start += count
        rank, chunk = schedule.rank_of(virtual), schedule.chunk_of(virtual)
        whole = torch_split and virtual == 0
        # what the stage computes for its blocks (the rotary tables), where it holds one
        shared = profile.stage_shared_bytes if any(layer.is_body for layer, _ in layers) else 0.0
        handed_gradient = (
            handed_gradient_bytes(layers[0][0], profile.stage_output_bytes) if hands_over[virtual] and layers else 0.0
        )
        # the loss's gradient, which the last stage's backward (its I) starts from: no layer's working set counts it
        seed = profile.loss_bytes if virtual == schedule.num_virtual_stages - 1 else 0.0
        grid[rank][chunk] = ChunkCosts(
            forward_ms=sum(layer.forward_ms for layer, _ in layers) + forward_overhead,
            backward_ms=sum(layer.backward_ms for layer, _ in layers) + backward_overhead,
            weight_ms=sum(layer.backward_ms if whole else layer.split_weight_ms() for layer, _ in layers)
            + weight_overhead,
            input_ms=(0.0 if whole else sum(layer.split_input_ms() for layer, _ in layers))
            + backward_overhead
            - weight_overhead,
            recompute_ms=sum(layer.recompute[mode].extra_ms for layer, mode in layers),
            activation_bytes=sum(layer.recompute[mode].activation_bytes for layer, mode in layers)
            + kept_in_flight[virtual]
            - in_buffers[virtual]
            + shared,
            retained_bytes=(sum(layer.recompute[mode].retained_bytes for layer, mode in layers) if splits else 0.0)
            + torch_retained[virtual],
            pending_bytes=(0.0 if whole else _pending_bytes(layers, splits)) + torch_pending[virtual] - handed_gradient,
            static_bytes=sum(layer_static(spec, layer).total for layer, _ in layers)
            + (constant if chunk == 0 else 0.0)
            + kept_whole_run[virtual]
            + held_sends[virtual],
            working_bytes=_working_bytes(
                layers, one_backward=whole or not splits, handed_bytes=profile.stage_output_bytes, shared_bytes=shared
            )
            + seed,
            **(
                _split_working_bytes(layers, tail_weight_last=torch_split, seed_bytes=seed)
                if splits and not whole
                else {}
            ),
            **({"input_working_bytes": 0.0} if whole else {}),  # torch's I does nothing there
            sharded=sharded_costs(
                spec,
                _units(spec, layers, profile.stage_output_bytes, shared, in_buffers[virtual]),
                start_bytes=shared,
                seed_bytes=seed,
                reduce_held_bytes=reduce_held[virtual],
            )
            if tracks_step(spec)
            else None,
        )
    return PipelineCosts(
        tuple(tuple(row) for row in grid), p2p_ms=spec.p2p_ms, unshard_lookahead=torch_unshard_lookahead(spec)
    )


def _units(
    spec: PipelineSpec,
    layers: list[tuple[LayerProfile, str]],
    handed_bytes: float,
    shared_bytes: float,
    buffered_bytes: float,
) -> list[Unit]:
    """A chunk's layers as FSDP units (`solver.parallel.sharding.Unit`), in model order. Its backward runs the
    layers last to first, each handed the gradient of its output by the one after it and freeing its
    activations; the head's, last, when the blocks have freed what the stage computed for them too
    (`shared_bytes`). The first layer's activation leaves out its input where that is one of torch's
    receive buffers (`buffered_bytes`)."""
    activations = [layer.recompute[mode].activation_bytes for layer, mode in layers]
    if activations:
        activations[0] -= buffered_bytes
    units = []
    for index, (layer, mode) in enumerate(layers):
        later = sum(cost for cost in activations[index + 1 :])
        units.append(
            Unit(
                parameter_bytes=layer.parameter_bytes,
                gradient_bytes=layer.gradient_bytes,
                activation_bytes=activations[index],
                working_bytes=layer.recompute[mode].working_bytes,
                handed_bytes=handed_bytes if index < len(layers) - 1 else 0.0,
                freed_bytes=later + (shared_bytes if layer.kind == HEAD else 0.0),
                reshards_after_forward=spec.fsdp_reshard_after_forward,
            )
        )
    return units


def _working_bytes(
    layers: list[tuple[LayerProfile, str]], *, one_backward: bool, handed_bytes: float, shared_bytes: float
) -> float:
    """What a chunk holds above its activations while its backward runs: the largest working set of
    its layers. Where one backward runs the whole chunk (`one_backward`: not a split backward, which
    keeps the graph for the weight gradients) each layer's backward frees what it saved, so the tail
    layers, last in the model, go first and free their activations (the LM head's logits) before
    any other layer's backward, and the head layers go last, when every other layer of the chunk has
    freed its activations (the embedding's gradient, as large as the embedding, comes then). What
    went before them leaves them the gradient of their output (`handed_bytes`, as large as a stage's
    output), which their working sets, measured from its arrival, do not hold; the blocks have freed
    what the stage computed for them too (`shared_bytes`, the rotary tables, 0 where the chunk holds
    no block). A body layer's backward comes after the tail's and the later blocks', which have freed
    their activations (and handed on a gradient as large as the one each took)."""
    if not one_backward:
        return max([layer.recompute[mode].working_bytes for layer, mode in layers], default=0.0)
    kinds = {layer.kind for layer, _ in layers}
    freed_by_tail = sum(layer.recompute[mode].activation_bytes for layer, mode in layers if layer.kind == TAIL)
    freed_before_head = shared_bytes + sum(
        layer.recompute[mode].activation_bytes for layer, mode in layers if layer.kind != HEAD
    )
    freed = {TAIL: 0.0, HEAD: freed_before_head - (handed_bytes if kinds - {HEAD} else 0.0)}
    body_freed = freed_by_tail - (handed_bytes if TAIL in kinds else 0.0)
    working = []
    for layer, mode in reversed(layers):  # the backward's order
        cost = layer.recompute[mode]
        if layer.kind in freed:
            working.append(cost.working_bytes - freed[layer.kind])
        else:
            working.append(cost.working_bytes - body_freed)
            body_freed += cost.activation_bytes
    return max(working, default=0.0)


def buffered_input_bytes(profile: ModelProfile, spec: PipelineSpec, counts: Sequence[int]) -> list[float]:
    """Per virtual stage, what its first layer keeps of its input where that input is one of torch's
    receive buffers (`spec.receive_buffers`: every stage but the first, the V's turn on one rank
    included), which `boundary_bytes` counts for the whole run: the layer keeps that tensor, not a
    copy (fp32 blocks keep their input, bf16 Llama blocks an fp32 copy of it). Zeros elsewhere."""
    starts = list(itertools.accumulate(counts, initial=0))
    return [
        saved_input_bytes(profile.layers[start]) if spec.receive_buffers and virtual > 0 and count else 0.0
        for virtual, (start, count) in enumerate(zip(starts, counts))
    ]


def saved_input_bytes(layer: LayerProfile) -> float:
    """What of its input `layer` keeps for its backward, the least over its recompute modes (as the
    search's program counts a stage's first layer)."""
    return min(cost.saved_input_bytes for cost in layer.recompute.values())


def last_layer_bytes(layer: LayerProfile) -> tuple[float, float]:
    """Where `layer` comes last in its stage (model order) under a split backward: the least it would
    keep beyond its pending bytes were another layer to follow it (`RecomputeCost.inner_extra_bytes`),
    which it does not keep, and the most it frees of the gradient handed to it, which no layer after
    it hands back; over its recompute modes, as the search's program counts them."""
    costs = layer.recompute.values()
    return min(cost.inner_extra_bytes() for cost in costs), max(cost.output_gradient_freed_bytes for cost in costs)


def _pending_bytes(layers: list[tuple[LayerProfile, str]], splits: bool) -> float:
    """What a chunk's split backward holds from its I to its W: every layer's pending bytes, and the
    extra each but the last keeps where another follows it (pending and extra together: all its I
    holds but what it frees)."""
    if not splits or not layers:
        return sum(layer.recompute[mode].pending_bytes for layer, mode in layers)
    return _kept_by_inputs(layers) - last_layer_bytes(layers[-1][0])[0]


def _kept_by_inputs(layers: list[tuple[LayerProfile, str]]) -> float:
    """The sum over a chunk's layers of what each one's I holds less what it frees of the gradient
    handed to it."""
    return sum(
        layer.recompute[mode].split_input_held_bytes() - layer.recompute[mode].output_gradient_freed_bytes
        for layer, mode in layers
    )


def _split_working_bytes(
    layers: list[tuple[LayerProfile, str]], *, tail_weight_last: bool, seed_bytes: float = 0.0
) -> dict[str, float]:
    """What each half of a chunk's split backward holds above what was held when it began. The I
    half runs the layers last to first, each forming its pending gradients, which stay for W: the
    tail's first, with nothing pending yet; then what every layer's I leaves held until the chunk's
    I ends (its `input_held_bytes`, less what the layer before it frees of the gradient it hands that
    layer: the sum takes each layer's own freed bytes but the last's, to which no layer hands one,
    `last_layer_bytes`) plus the most any other layer's I holds above its own (exact where that layer
    comes first in the chunk, more otherwise). The W half starts with the pending gradients held:
    the most any layer's W holds, but the tail's less what every other layer's W has freed where
    its W runs last (`tail_weight_last`: torch's engine; `RecomputeCost.weight_freed_bytes`). I holds
    `seed_bytes` besides (the loss's gradient, on the last stage)."""
    held = _kept_by_inputs(layers) + (last_layer_bytes(layers[-1][0])[1] if layers else 0.0)
    tail = [layer.recompute[mode].split_input_working_bytes() for layer, mode in layers if layer.kind == TAIL]
    others = [
        layer.recompute[mode].split_input_working_bytes() - layer.recompute[mode].split_input_held_bytes()
        for layer, mode in layers
        if layer.kind != TAIL
    ]
    freed_by_others = sum(
        layer.recompute[mode].split_weight_freed_bytes() for layer, mode in layers if layer.kind != TAIL
    )
    return {
        "input_working_bytes": max(tail + ([held + max(0.0, *others)] if others else []), default=0.0) + seed_bytes,
        "weight_working_bytes": max(
            [
                layer.recompute[mode].split_weight_working_bytes()
                - (freed_by_others if layer.kind == TAIL and tail_weight_last else 0.0)
                for layer, mode in layers
            ],
            default=0.0,
        ),
    }
