"""Memory as the program states it: per virtual stage, what its layers and the engine keep (static,
per micro-batch in flight, retained, pending) and what each backward action holds while it runs, as
expressions in the layer counts; and one row per distinct point of each rank's action list."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from basics.units import MIB
from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from simulator.schedules import schedule_kind
from solver.costs import last_layer_bytes, saved_input_bytes
from solver.engine_memory import (
    boundary_bytes,
    handed_gradient_bytes,
    torch_1f1b_held_bytes,
    torch_engine_bytes,
    torch_hands_gradient_over,
    torch_splits_backward,
)
from solver.program.milp import INF, Linear
from solver.program.placement import LayerPlacement
from solver.program.sharded_rows import (
    BACKWARD_EXTRA,
    GATHER_FIRST,
    REDUCE,
    REGATHER_GATHER,
    SHARDED_SETS,
    ShardedMemory,
    ShardedStates,
    sharded_memory,
)
from solver.vocabulary.profile import HEAD, NONE, TAIL

# A memory point's working set: (chunk, op) of the backward action running there (or GATHER, REDUCE), None for none.
WorkingAt = tuple[int, str] | None


@dataclass
class StageMemory:
    """Per virtual stage, in MiB, as expressions in the layer counts."""

    activation: list[Linear]  # per micro-batch from its forward to its backward
    static: list[Linear]  # for the whole step
    retained: list[Linear]  # per micro-batch from its last backward action to the step's end
    pending: list[Linear]  # per micro-batch from its I to its W
    working: list[dict[str, Linear]]  # per backward op (B, I, W): what it holds while it runs
    sharded: ShardedMemory | None = None  # data parallelism within a step


def stage_memory(placement: LayerPlacement) -> StageMemory:
    """What each virtual stage keeps, as `costs.pipeline_costs` counts it."""
    profile, spec, groups = placement.profile, placement.spec, placement.groups
    num_virtual_stages = placement.schedule.num_virtual_stages
    splits = schedule_kind(spec.schedule).splits_backward  # the layers' retained bytes count only then
    activation, static, retained, pending = (
        placement.virtual_stage_sums(f)
        for f in (
            lambda g, m: g.activation_mib[m],
            lambda g, m: g.static_mib,
            lambda g, m: g.retained_mib[m] if splits else 0.0,
            lambda g, m: g.kept_by_input_mib(m) if splits else g.pending_mib[m],
        )
    )
    last_layer = _last_layers(placement) if splits else None
    if spec.receive_buffers:  # a stage's input is one of torch's buffers: its first layer keeps that
        saved = [saved_input_bytes(profile.layers[group.first]) / MIB for group in groups]
        for virtual in range(1, num_virtual_stages):  # costs.buffered_input_bytes
            activation[virtual].add_expression(placement.at_end(virtual, saved, first=True), -1.0)
    if last_layer is not None:  # all but the chunk's last layer keep their inner extra (costs._pending_bytes)
        for expression, (last_extra, _) in zip(pending, last_layer):
            expression.add_expression(last_extra, -1.0)
    if torch_splits_backward(spec):  # stage 0's W runs its whole backward, as costs.pipeline_costs states it
        pending[0] = Linear()
    for virtual, (torch_retained, torch_pending) in enumerate(zip(*torch_engine_bytes(profile, spec))):
        retained[virtual].constant += torch_retained / MIB
        pending[virtual].constant += torch_pending / MIB
    handed = [handed_gradient_bytes(profile.layers[group.first], profile.stage_output_bytes) / MIB for group in groups]
    for virtual, hands_over in enumerate(torch_hands_gradient_over(spec)):  # costs.pipeline_costs
        if hands_over:
            pending[virtual].add_expression(placement.at_end(virtual, handed, first=True), -1.0)
    for virtual, (in_flight, whole_run, held) in enumerate(
        zip(*boundary_bytes(profile, spec), torch_1f1b_held_bytes(profile, spec))
    ):
        activation[virtual].constant += in_flight / MIB
        static[virtual].constant += (whole_run + held) / MIB
    working = _working_sets(placement, last_layer)
    if profile.stage_shared_bytes:  # what each stage computes for its blocks, where it holds one
        for virtual in range(num_virtual_stages):
            activation[virtual].add_expression(placement.holds_body(virtual), profile.stage_shared_bytes / MIB)
    return StageMemory(activation, static, retained, pending, working, sharded_memory(placement, working))


def _last_layers(placement: LayerPlacement) -> list[tuple[Linear, Linear]]:
    """Per virtual stage, `costs.last_layer_bytes` of its last layer in model order, in MiB."""
    values = [last_layer_bytes(placement.profile.layers[group.first]) for group in placement.groups]
    last_layers = []
    for c in range(placement.schedule.num_virtual_stages):
        if c == 0 and torch_splits_backward(placement.spec):  # its whole backward runs at W: nothing pends
            last_layers.append((Linear(), Linear()))
            continue
        last_layers.append(
            (
                placement.at_end(c, [extra / MIB for extra, _ in values], first=False),
                placement.at_end(c, [freed / MIB for _, freed in values], first=False),
            )
        )
    return last_layers


def _working_sets(placement: LayerPlacement, last_layer: list[tuple[Linear, Linear]] | None) -> list[dict[str, Linear]]:
    """Per virtual stage and backward op, the most its layers hold while it runs (as
    `costs.pipeline_costs` counts it). Where one backward runs the whole chunk: the largest working
    set less what the layers whose backward ran before have freed: the tail's activations, before
    any other layer's, and a block's, the later blocks' (linear rows in the counts); the head's less
    every other layer's activations. Where it is split: I, the tail's (its I runs first), or what the
    chunk's layers' I leave held until it ends (`input_held_mib`) plus the most any other layer's I
    holds above that; W, the most any layer's W holds, the tail's less what every other layer's W freed where
    torch's engine runs its W last. The last stage's backward (its I where split) holds the loss's
    gradient besides."""
    num_virtual_stages = placement.schedule.num_virtual_stages
    splits = schedule_kind(placement.spec.schedule).splits_backward
    one_backward = [not splits or (c == 0 and torch_splits_backward(placement.spec)) for c in range(num_virtual_stages)]
    freed = [0.0] * num_virtual_stages
    for group in placement.groups:
        if group.kind == TAIL and one_backward[group.pinned_virtual_stage]:
            freed[group.pinned_virtual_stage] += group.size * group.activation_mib[NONE]
    # what each layer's I keeps to its end, less what it frees of the gradient handed to it (the last's added back)
    held = placement.virtual_stage_sums(lambda g, m: g.kept_by_input_mib(m))
    for expression, (_, last_freed) in zip(held, last_layer or []):
        expression.add_expression(last_freed)
    freed_by_weights = placement.virtual_stage_sums(lambda g, m: g.weight_freed_mib[m])
    tail_weight_last = torch_splits_backward(placement.spec)
    handed = placement.profile.stage_output_bytes / MIB
    # halves that hold what the whole backward does need no rows of their own (SAPP's files)
    halves_differ = any(
        g.input_working_mib != g.working_mib
        or g.weight_working_mib != g.working_mib
        or any(g.input_held_mib.values())
        or any(g.output_gradient_freed_mib.values())
        or any(g.weight_freed_mib.values())
        for g in placement.groups
    )
    working = []
    for c in range(num_virtual_stages):
        pinned_groups = [g for g in placement.groups if g.pinned_virtual_stage == c]
        if one_backward[c]:
            # the tail hands the layer before it its input's gradient, which that layer's working set does not count
            tail_here = any(g.kind == TAIL for g in pinned_groups)
            after_tail = freed[c] - (handed if tail_here else 0.0)
            pinned = max([g.working_mib[NONE] for g in pinned_groups if g.kind == TAIL], default=0.0)
            head = max([g.working_mib[NONE] - after_tail for g in pinned_groups if g.kind == HEAD], default=-INF)
            handed_to_head = 0.0 if tail_here else handed  # where the virtual stage holds a body layer
            head_rows = []
            # the head's backward runs last, after every other layer here has freed
            if head + handed_to_head > pinned:
                terms = {count: -placement.groups[g].activation_mib[mode] for g, mode, count in placement.counts_at[c]}
                # with a body layer here: the head's handed gradient less the tables the blocks freed (negative is safe)
                body_coefficient = handed_to_head - placement.profile.stage_shared_bytes / MIB
                if body_coefficient:
                    terms.update({variable: body_coefficient for variable in placement.holds_body(c).terms})
                head_rows = [(head, terms)]
            whole = placement.largest(
                c,
                pinned,
                lambda g, m, shift=after_tail: g.working_mib[m] - shift,
                head_rows,
                freed=lambda g, m: g.activation_mib[m],  # a block's backward frees its activations
            )
            working.append(dict.fromkeys((FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT), whole))
            if splits:  # torch's first stage: its I does nothing, its W runs the whole backward
                working[-1][BACKWARD_INPUT] = Linear()
            continue
        # a split backward frees nothing before the head's
        whole = placement.largest(
            c, max([g.working_mib[NONE] for g in pinned_groups], default=0.0), lambda g, m: g.working_mib[m]
        )
        if not halves_differ:
            working.append(dict.fromkeys((FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT), whole))
            continue
        above_held = placement.largest(
            c,
            max([0.0] + [g.input_working_mib[NONE] - g.input_held_mib[NONE] for g in pinned_groups if g.kind == HEAD]),
            lambda g, m: g.input_working_mib[m] - g.input_held_mib[m],
        )
        above_held.add_expression(held[c])
        tails = [g.input_working_mib[NONE] for g in pinned_groups if g.kind == TAIL]
        if tails:  # the larger of the tail's and the rest's
            above_held = placement.largest(c, max(tails), None, [(above_held.constant, above_held.terms)])
        tail_weights = [g.weight_working_mib[NONE] for g in pinned_groups if g.kind == TAIL]
        weight_rows = []
        if tail_weights and tail_weight_last:  # after every other layer's W has freed (costs._split_working_bytes)
            tail_freed = sum(g.size * g.weight_freed_mib[NONE] for g in pinned_groups if g.kind == TAIL)
            freed_by_others = freed_by_weights[c].constant - tail_freed  # and the terms: the body layers'
            weight_rows = [(max(tail_weights) - freed_by_others, {v: -k for v, k in freed_by_weights[c].terms.items()})]
            tail_weights = []
        weight = placement.largest(
            c,
            max([g.weight_working_mib[NONE] for g in pinned_groups if g.kind != TAIL] + tail_weights, default=0.0),
            lambda g, m: g.weight_working_mib[m],
            weight_rows,
        )
        working.append({FULL_BACKWARD: whole, BACKWARD_INPUT: above_held, BACKWARD_WEIGHT: weight})
    seed = placement.profile.loss_bytes / MIB  # costs.pipeline_costs: the loss's gradient, on the last stage
    if seed:  # held by its whole backward, or by its I where split (torch's first stage: none at I)
        holding = {FULL_BACKWARD} | ({BACKWARD_WEIGHT} if one_backward[-1] else {BACKWARD_INPUT})
        if not splits:
            holding.add(BACKWARD_INPUT)
        working[-1] = {
            op: Linear(dict(e.terms), e.constant + seed) if op in holding else e for op, e in working[-1].items()
        }
    return working


def memory_rows(placement: LayerPlacement, memory: StageMemory) -> list[tuple[int, Linear]]:
    """(rank, memory in MiB) at each point of each rank's action list that no other point bounds."""
    schedule = placement.schedule
    compiled = schedule.compiled
    constant_mib = (placement.profile.rank_constant_bytes + placement.spec.rank_constant_bytes) / MIB
    retains = any(row.terms or row.constant for row in memory.retained)
    pends = any(row.terms or row.constant for row in memory.pending)
    past_input = [Linear(dict(a.terms), a.constant) for a in memory.activation]  # activations and pending gradients
    for expression, pending in zip(past_input, memory.pending):
        expression.add_expression(pending)
    rows = []
    for rank in range(schedule.ranks):
        rank_stages = schedule.virtual_stages_of(rank)
        # per chunk, micro-batches past F and before B or W; past I and before W; past B or W (those last two only where needed)
        chunks = schedule.chunks
        held = [0] * (3 * chunks)
        points: set[tuple[tuple[int, ...], WorkingAt]] = set()
        first = compiled.rank_offsets[rank]
        ops = list(
            zip(
                compiled.chunk[first : compiled.rank_offsets[rank + 1]],
                compiled.op[first : compiled.rank_offsets[rank + 1]],
            )
        )
        states = ShardedStates(placement, memory.sharded, ops)  # held counts, then these states' flags
        point = functools.partial(_add_point, points, held, states.flags)
        for index, (chunk, op) in enumerate(ops):
            regathers = states.before(index, chunk, op)
            if op == FORWARD:
                if memory.sharded is not None and memory.sharded.regathers and states.gathers(chunk):
                    point((chunk, GATHER_FIRST))
                held[chunk] += 1
                gathering = states.after(index, chunk, op)
                point(None)
                if gathering is not None:
                    point((chunk, gathering))
                continue
            # the working sets of a chunk's actions, one where they are the same (a whole backward)
            same = memory.working[rank_stages[chunk]][op] is memory.working[rank_stages[chunk]][FULL_BACKWARD]
            point((chunk, regathers or (FULL_BACKWARD if same else op)))
            if regathers:
                point((chunk, REGATHER_GATHER))
            if op == BACKWARD_INPUT:
                if pends:
                    held[chunk] -= 1
                    held[2 * chunks + chunk] += 1
                continue
            held[2 * chunks + chunk if op == BACKWARD_WEIGHT and pends else chunk] -= 1
            if retains:
                held[chunks + chunk] += 1
            if states.after(index, chunk, op) == REDUCE:
                point((chunk, REDUCE))
                states.reduce(chunk)
        # the step's end: what is retained (torch's input gradients and sends) can outweigh the activations it was part of
        point(None)
        for counts, working in _undominated(points):
            row = Linear(constant=constant_mib)
            for chunk, virtual in enumerate(rank_stages):
                for part, scale in (
                    (memory.static[virtual], 1),
                    (memory.activation[virtual], counts[chunk]),
                    (memory.retained[virtual], counts[chunks + chunk]),
                    (past_input[virtual], counts[2 * chunks + chunk]),
                ):
                    if scale:
                        row.add_expression(part, scale)
            states.add_to(row, counts[3 * chunks :], rank_stages)
            if working is not None:
                working_chunk, op = working
                virtual = rank_stages[working_chunk]
                if op in SHARDED_SETS:
                    row.add_expression(memory.sharded.working[virtual][op])
                else:
                    row.add_expression(memory.working[virtual][op])
                    if memory.sharded is not None:
                        row.add_expression(memory.sharded.working[virtual][BACKWARD_EXTRA])
            rows.append((rank, row))
    return rows


def _add_point(
    points: set[tuple[tuple[int, ...], WorkingAt]], held: list[int], flags: list[int], working: WorkingAt
) -> None:
    points.add((tuple(held + flags), working))


def _undominated(points: set[tuple[tuple[int, ...], WorkingAt]]) -> list[tuple[tuple[int, ...], WorkingAt]]:
    """Drop memory points another point of the rank bounds from above (more held, same working set)."""
    ordered = sorted(points, key=lambda p: (-sum(p[0]), p[0], p[1] or (-1, "")))
    kept: list[tuple[tuple[int, ...], WorkingAt]] = []
    for held, working in ordered:
        if not any(
            all(a <= b for a, b in zip(held, other)) and (working is None or working == other_working)
            for other, other_working in kept
        ):
            kept.append((held, working))
    return kept
