"""What a plan predicts of each pipeline rank in a validation run, in the terms a run measures: step time,
autograd's peak, the allocator's peak above the static bytes, the static bytes per kind, torch's receive
buffers, what is held at the step's end, and how the peak splits (data parallelism's gathered parameters
and whole gradients, the working set on top, the rest)."""

from __future__ import annotations

import dataclasses
import itertools

from simulator import ChunkCosts, PipelineCosts, simulate
from simulator.schedule import Schedule
from simulator.sharded import memory_points
from solver import ModelProfile, Plan
from solver.costs import buffered_input_bytes
from solver.engine_memory import boundary_bytes, torch_1f1b_held_bytes
from solver.parallel.model_parallel import rank_profile
from solver.parallel.sharding import layer_static
from solver.vocabulary.profile import NONE


def predictions(plan: Plan, profile: ModelProfile, input_bytes: float = 0.0) -> dict[str, list]:
    """Per rank of a plan for `profile`: when its last action ends; the peak of what autograd holds for
    backward (less `input_bytes` per micro-batch on the first stage: the token ids, which the engine
    holds for the whole step as data; and less the outputs the engine keeps per micro-batch in flight,
    `boundary_bytes`, which autograd does not hold; FSDP's gathered parameters neither); the peak of all
    the plan counts but static bytes, working bytes included (what an allocator sees above the static
    bytes; the sends `Schedule1F1B` holds, which the plan counts with the static bytes, come after a
    step starts: counted in), and how it splits (`peak_split`); the static bytes (without those sends),
    and per kind (`static_split`); the part of them that is the engine's receive buffers
    (`spec.receive_buffers`); and what is held above the static bytes once the last action has run
    (what the engine keeps to the step's end)."""
    profile = rank_profile(profile, plan.spec)  # the numbers of one rank of the plan's mesh, as the plan's
    result = plan.simulation
    schedule = result.schedule
    ends = [result.rank_finish_ms(rank) for rank in range(schedule.ranks)]
    costs = result.costs
    kept_in_flight, kept_whole_run = boundary_bytes(profile, plan.spec)
    in_buffers = buffered_input_bytes(profile, plan.spec, plan.stage_layer_counts)  # autograd holds them too
    # checkpointing keeps what a stage computes for its blocks (the rotary tables) through its own frame,
    # out of the saved-tensor hook's sight: not in the autograd view where every block of the stage is
    # recomputed, in any mode (the allocator holds them all the same); nor is each checkpoint's state
    starts = list(itertools.accumulate(plan.stage_layer_counts, initial=0))
    unseen = []
    for start, count in zip(starts, plan.stage_layer_counts):
        modes = [
            mode
            for layer, mode in zip(profile.layers[start : start + count], plan.layer_modes[start : start + count])
            if layer.is_body
        ]
        shared = profile.stage_shared_bytes if modes and all(mode != NONE for mode in modes) else 0.0
        unseen.append(shared + profile.checkpoint_state_bytes * sum(mode != NONE for mode in modes))
    held_sends = torch_1f1b_held_bytes(profile, plan.spec)  # counted with the static bytes, not there at a step's start

    def bare_costs(autograd_only: bool) -> PipelineCosts:
        def bare(rank: int, chunk: int, costs_of: ChunkCosts) -> ChunkCosts:
            virtual = schedule.stage_index(rank, chunk)
            ids = input_bytes if virtual == 0 else 0.0
            if not autograd_only:
                return dataclasses.replace(
                    costs_of, static_bytes=held_sends[virtual], activation_bytes=costs_of.activation_bytes - ids
                )
            # gradients (working sets, a split backward's pending and retained ones) are not what it saved
            return dataclasses.replace(
                costs_of,
                static_bytes=0.0,
                working_bytes=0.0,
                input_working_bytes=None,
                weight_working_bytes=None,
                pending_bytes=0.0,
                retained_bytes=0.0,
                sharded=None,
                activation_bytes=costs_of.activation_bytes
                - ids
                - kept_in_flight[virtual]
                + in_buffers[virtual]
                - unseen[virtual],
            )

        return PipelineCosts(
            tuple(
                tuple(bare(rank, chunk, c) for chunk, c in enumerate(row)) for rank, row in enumerate(costs.chunk_costs)
            ),
            p2p_ms=costs.p2p_ms,
            unshard_lookahead=costs.unshard_lookahead,
        )

    above_static = bare_costs(False)
    static = [
        sum(c.static_bytes for c in row) - sum(held_sends[virtual] for virtual in schedule.virtual_stages_of(rank))
        for rank, row in enumerate(costs.chunk_costs)
    ]
    step_end = [result.memory_curve(rank)[-1][1] - static[rank] for rank in range(schedule.ranks)]
    buffers = [
        sum(kept_whole_run[virtual] for virtual in schedule.virtual_stages_of(rank)) for rank in range(schedule.ranks)
    ]
    return {
        "step_ms": ends,
        "activation_peak_bytes": list(simulate(schedule, bare_costs(True)).rank_peak_memory_bytes),
        "peak_bytes": list(simulate(schedule, above_static).rank_peak_memory_bytes),
        "static_bytes": static,
        "receive_buffer_bytes": buffers,
        "step_end_bytes": step_end,
        "static_split": static_split(plan, profile),
        "peak_split": peak_split(schedule, above_static),
    }


def static_split(plan: Plan, profile: ModelProfile) -> list[dict[str, float]]:
    """Per rank, its layers' static bytes per kind after sharding (`solver.parallel.sharding.layer_static`)."""
    schedule = plan.spec.pipeline_schedule
    starts = list(itertools.accumulate(plan.stage_layer_counts, initial=0))
    split = []
    for rank in range(schedule.ranks):
        held = [
            layer_static(plan.spec, layer)
            for virtual in schedule.virtual_stages_of(rank)
            for layer in profile.layers[starts[virtual] : starts[virtual + 1]]
        ]
        split.append(
            {
                "parameter_bytes": sum(s.parameter for s in held),
                "gradient_bytes": sum(s.gradient for s in held),
                "optimizer_bytes": sum(s.optimizer for s in held),
                "bucket_bytes": sum(s.buckets for s in held),
            }
        )
    return split


def peak_split(schedule: Schedule, costs: PipelineCosts) -> list[dict[str, float]]:
    """Per rank, at its peak (of `costs`, counted from 0): the bytes, of them what data parallelism
    holds within the step (gathered parameters, whole gradients), the working set on top of what was
    held, and the rest (activations and what the engine keeps of the tensors stages pass)."""
    compiled = schedule.compiled
    split = []
    for rank in range(schedule.ranks):
        row = costs.chunk_costs[rank]
        first, last = compiled.rank_offsets[rank], compiled.rank_offsets[rank + 1]
        ops = list(zip(compiled.chunk[first:last], compiled.op[first:last]))
        most = (sum(c.static_bytes for c in row), 0.0, 0.0)  # bytes, data parallelism's, working set
        for point in memory_points(ops, row, costs.unshard_lookahead):
            if point.during_bytes is not None and point.during_bytes > most[0]:
                most = (point.during_bytes, point.during_sharded_bytes, point.during_bytes - point.during_base_bytes)
            if point.held_bytes > most[0]:
                most = (point.held_bytes, point.sharded_bytes, 0.0)
        peak, sharded, working = most
        split.append(
            {
                "peak_bytes": peak,
                "sharded_bytes": sharded,
                "working_bytes": working,
                "activation_bytes": peak - sharded - working,
            }
        )
    return split
