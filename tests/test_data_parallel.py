"""Data parallelism's memory, term by term (no torch): what a layer holds at rest after sharding (FSDP,
ZeRO, DDP), what FSDP holds within a step under torch's pipelining as the simulator replays it, the walks
that size its gathering, and the program's rows against the replay. The runs that measured each rule are
in tests/test_validate_mesh.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_cases import MIB, small_profile
from test_solver_properties import problems

from simulator import ChunkCosts, InputError, PipelineCosts, schedule_kind, simulate
from simulator.actions import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from simulator.costs import ShardedCosts
from simulator.sharded import RESHARD, UNSHARD, memory_points, torch_unshard_events
from solver import ModelProfile, PipelineSpec, evaluate_plan
from solver.costs import pipeline_costs
from solver.parallel.sharding import Unit, _backward_walk, _forward_walk, sharded_costs, step_gradient_bytes
from solver.program.formulation import PATHS, IntegerProgram
from solver.program.groups import layer_groups
from solver.program.milp import Linear
from solver.vocabulary.spec import spec_from_dict, spec_to_dict, static_split

P, G, O, S = 1000.0, 1000.0, 2040.0, 40.0  # noqa: E741 - a layer: parameters, gradients, AdamW (2P + 4 B x 10 tensors)


def spec(**fields) -> PipelineSpec:
    return PipelineSpec(pipeline_parallel=2, micro_batches=4, data_parallel=4, **fields)


@pytest.mark.parametrize(
    ("fields", "parameter", "gradient", "optimizer", "buckets"),
    [
        ({}, P, G, O, 0),  # plain replicas
        ({"zero_stage": 1}, P, G, O / 4, 0),  # whole tensors' state per rank: the mean
        ({"zero_stage": 2}, P, G / 4, O / 4, 0),
        # every tensor sharded; AdamW's step counts (4 B per tensor) are not
        ({"fsdp": True}, P / 4, G / 4, (O - S) / 4 + S, 0),
        ({"zero_stage": 3}, P / 4, G / 4, (O - S) / 4 + S, 0),
        # gradients freed between steps (zero_grad's set_to_none): none at rest, they come within the step
        ({"fsdp": True, "gradients_persist": False}, P / 4, 0, (O - S) / 4 + S, 0),
        ({"gradients_persist": False}, P, 0, O, 0),
        # DDP's buckets copy the gradients for the whole run, unless the gradients are views into them
        ({"ddp": True}, P, G, O, G),
        ({"ddp": True, "zero_stage": 1}, P, G, O / 4, G),
        ({"ddp": True, "ddp_bucket_view": True}, P, 0, O, G),
        ({"ddp": True, "ddp_bucket_view": True, "gradients_persist": False}, P, 0, O, G),
    ],
)
def test_static_bytes_per_kind(fields, parameter, gradient, optimizer, buckets):
    split = static_split(spec(**fields), P, G, O, S)
    assert (split.parameter, split.gradient, split.optimizer, split.buckets) == (
        parameter,
        gradient,
        optimizer,
        buckets,
    )
    assert spec(**fields).static_bytes(P, G, O, S) == parameter + gradient + optimizer + buckets


@pytest.mark.parametrize(
    ("fields", "within_step", "after_reduce"),
    [
        ({"fsdp": True}, G, 0),  # whole from the first backward to the reduce; the shard is counted at rest
        ({"fsdp": True, "gradients_persist": False}, G, G / 4),  # the reduce leaves the shard
        ({"gradients_persist": False}, G, G),  # from the first backward to the step's end
        ({"zero_stage": 2, "gradients_persist": False}, G / 4, G / 4),
        ({}, 0, 0),
        ({"ddp": True, "ddp_bucket_view": True, "gradients_persist": False}, 0, 0),
    ],
)
def test_gradients_within_a_step(fields, within_step, after_reduce):
    assert step_gradient_bytes(spec(**fields), G) == (within_step, after_reduce)


def test_fsdps_gradient_shard_has_its_parameters_shape():
    """Under tensor parallelism torch leaves the embedding's gradient whole (twice its parameter's local
    shard, measured on 8 processes, PP2 x DP2 x TP2): FSDP reduces that whole gradient, and keeps the
    shard of its parameter's shape."""
    assert static_split(spec(fsdp=True), P, 2 * G, O, S).gradient == P / 4
    assert step_gradient_bytes(spec(fsdp=True, gradients_persist=False), 2 * G, P) == (2 * G, P / 4)
    assert static_split(spec(zero_stage=2), P, 2 * G, O, S).gradient == 2 * G / 4


def _row(**sharded) -> tuple[ChunkCosts, ...]:
    base = {
        "gathered_bytes": 50.0,
        "forward_kept_bytes": 50.0,
        "gradient_bytes": 40.0,
        "forward_gather_working_bytes": 70.0,
        "reduce_working_bytes": 60.0,
    }
    return (
        ChunkCosts(
            forward_ms=1.0,
            backward_ms=2.0,
            activation_bytes=10.0,
            static_bytes=100.0,
            working_bytes=3.0,
            sharded=ShardedCosts(**{**base, **sharded}),
        ),
    )


def _points(ops, row, lookahead=0):
    return [(p.during_bytes, p.held_bytes, p.sharded_bytes) for p in memory_points(ops, row, lookahead)]


def test_gathered_parameters_and_whole_gradients_stay_to_the_reduce():
    """FSDP without reshard after forward: the first forward gathers (its working set on top of what it
    began with), the parameters stay; the first backward brings the whole gradients (counted from its
    start), the last one's reduce holds its working set, then frees both."""
    ops = [(0, FORWARD), (0, FORWARD), (0, FULL_BACKWARD), (0, FULL_BACKWARD)]
    assert _points(ops, _row()) == [
        (170.0, 160.0, 50.0),  # 100 + gathering 70; then + 50 gathered + 10 activation
        (None, 170.0, 50.0),  # found gathered: nothing to gather
        (213.0, 200.0, 90.0),  # + 40 gradients, working set 3 on top; - 10 activation
        (250.0, 100.0, 0.0),  # working 203, the reduce 190 + 60; gathered and gradients freed
    ]


def test_reshard_after_forward_gathers_again_in_each_backward_after_a_forward():
    """A forward re-shards what it gathered; a backward that finds the chunk sharded gathers it again
    (its own working set in place of the chunk's) and keeps it; a forward after it finds it gathered."""
    ops = [(0, FORWARD), (0, FULL_BACKWARD), (0, FORWARD), (0, FULL_BACKWARD)]
    row = _row(forward_kept_bytes=0.0, backward_gather_working_bytes=80.0)
    assert _points(ops, row) == [
        (170.0, 110.0, 0.0),  # gathered, used, re-sharded: the activation stays
        (230.0, 190.0, 90.0),  # + 40 gradients; gathering again 80 on top; + 50 gathered - 10 activation
        (None, 150.0, 40.0),  # found gathered: re-shards it
        (250.0, 100.0, 0.0),  # gathers again (230), keeps it; the reduce (190 + 60) frees it all
    ]


def test_the_full_backward_that_makes_the_gradients_holds_them_within_its_working_set():
    """Where the walk with the gradients arriving is known, the first full backward peaks at it on top of
    what it began with (not gradients + working set), and holds the gradients after; a later backward,
    and the W of a split backward, count as before."""
    ops = [(0, FORWARD), (0, FORWARD), (0, FULL_BACKWARD), (0, FULL_BACKWARD)]
    assert _points(ops, _row(first_backward_working_bytes=25.0))[2:] == [
        (195.0, 200.0, 90.0),  # 170 + 25; then + 40 gradients - 10 activation
        (250.0, 100.0, 0.0),
    ]
    regather = _row(
        forward_kept_bytes=0.0, backward_gather_working_bytes=80.0, first_backward_gather_working_bytes=85.0
    )
    ops = [(0, FORWARD), (0, FULL_BACKWARD), (0, FORWARD), (0, FULL_BACKWARD)]
    assert _points(ops, regather)[1] == (195.0, 190.0, 90.0)  # 110 + 85; then + 50 gathered + 40 - 10
    split = [(0, FORWARD), (0, "I"), (0, BACKWARD_WEIGHT)]
    assert _points(split, _row(first_backward_working_bytes=1.0)) == _points(split, _row())


def test_the_first_backward_walk_makes_each_units_gradient_at_its_own_backward():
    """The blocks' gradients (3 each) are there by the head's backward, not its own (8): 3 + 5 = 8,
    where counting all 14 from the start makes 18; with the gathering walk, 19's moment (the head's copy
    out of its prefetch) holds the blocks' 6: 25, not 33."""
    arriving = [8.0, 3.0, 3.0]
    assert _backward_walk(_units(False), 0.0, gloo=True, arriving=arriving, gathers=False) == 8.0
    assert _backward_walk(_units(False), 0.0, gloo=True, gathers=False) + 14.0 == 18.0
    assert _backward_walk(_units(True), 0.0, gloo=False, arriving=arriving) == 25.0


def test_what_a_reduce_leaves_stays_to_the_steps_end():
    ops = [(0, FORWARD), (0, FULL_BACKWARD)]
    assert _points(ops, _row(reduced_gradient_bytes=10.0))[-1][1:] == (110.0, 10.0)  # static 100 + the shard 10


def test_a_split_backward_brings_the_gradients_at_w_and_reduces_after_the_last_w():
    ops = [(0, FORWARD), (0, "I"), (0, BACKWARD_WEIGHT)]
    points = _points(ops, _row())
    assert points[1][1:] == (160.0, 50.0)  # I: no weight gradients yet
    assert points[2][1:] == (100.0, 0.0)  # W brought them (40), the reduce after it freed all


def test_torch_runtime_schedules_gather_three_chunks_ahead():
    """torch's `_add_unshard_reshard`: before each action the next three chunks the rank runs are
    gathered, the others released (a chunk with no action left too); after the last action every one
    still gathered is."""
    assert torch_unshard_events([0, 1, 0, 1], 3) == [
        [(UNSHARD, 0), (UNSHARD, 1)],
        [],
        [],
        [(RESHARD, 0)],
        [(RESHARD, 1)],
    ]
    assert torch_unshard_events([0, 1, 2, 3, 0], 3) == [
        [(UNSHARD, 0), (UNSHARD, 1), (UNSHARD, 2)],
        [(RESHARD, 0), (UNSHARD, 3)],
        [(RESHARD, 1), (UNSHARD, 0)],
        [(RESHARD, 2)],
        [(RESHARD, 3)],
        [(RESHARD, 0)],
    ]
    assert torch_unshard_events([0, 1], 0) == [[], [], []]
    # gathered before the first action: the first forward finds it so
    ops = [(0, FORWARD), (0, FULL_BACKWARD)]
    assert _points(ops, _row(), lookahead=3)[0] == (150.0, 160.0, 50.0)  # gathered (150), then its activation


def _units(reshards: bool) -> list[Unit]:
    # an 8-byte head, two 3-byte blocks; each hands its input's gradient (1) to the one before it
    return [
        Unit(8.0, 8.0, 1.0, 5.0, 1.0, 4.0, reshards),
        Unit(3.0, 3.0, 2.0, 4.0, 1.0, 2.0, reshards),
        Unit(3.0, 3.0, 2.0, 4.0, 0.0, 0.0, reshards),
    ]


def test_the_forward_gathering_walk():
    """Per unit: its flat output with gloo's temporary (or the copy into its parameters), the flat
    output of the unit before it still there; kept (23.5) or re-sharded after its forward (16.5)."""
    assert _forward_walk(_units(False), 0.5, gloo=True) == 23.5  # 9.5 held + 8 (flat before) + 3 + 3
    assert _forward_walk(_units(True), 0.5, gloo=True) == 16.5  # the head's flat and copy over the tables
    assert _forward_walk(_units(True), 0.5, gloo=False) == 16.5


def test_the_backward_gathering_walk():
    """Last unit first, each gathered and kept, the one before it prefetched with gloo's temporary
    before its own backward: the most, 21, is the head's prefetch in the middle block's pre-backward
    (its gradient handed, the last block's activation freed, both blocks gathered); without gloo's
    temporary, 19, the head's copy out of its prefetched flat output (both blocks' activations freed)."""
    assert _backward_walk(_units(True), 0.0, gloo=True) == 21.0  # -1 + 6 + 8 + 8
    assert _backward_walk(_units(True), 0.0, gloo=False) == 19.0  # -3 + 14 + 8


def _fsdp_profile():
    profile = small_profile(4)
    return dataclasses.replace(
        profile,
        stage_output_bytes=2 * MIB,
        layers=tuple(
            dataclasses.replace(
                layer,
                gradient_bytes=layer.parameter_bytes,
                optimizer_bytes=2 * layer.parameter_bytes + 40,
                parameter_tensors=10,
            )
            for layer in profile.layers
        ),
    )


def test_pipeline_costs_state_each_chunks_fsdp_terms():
    profile = _fsdp_profile()
    fsdp = PipelineSpec(pipeline_parallel=2, micro_batches=4, data_parallel=2, fsdp=True, receive_buffers=True)
    costs = pipeline_costs(profile, fsdp, (3, 3), ("none",) * 6)
    for rank, layers in enumerate((profile.layers[:3], profile.layers[3:])):
        sharded = costs.chunk_costs[rank][0].sharded
        whole = sum(layer.parameter_bytes for layer in layers)
        assert (sharded.gathered_bytes, sharded.forward_kept_bytes, sharded.gradient_bytes) == (whole, whole, whole)
        # the reduce, unit by unit in model order: each unit's copy and shard (1.5 gradients) less its
        # parameters, freed first, and less the parameters and gradients of the units before it
        freed_before = [sum(2 * layer.parameter_bytes for layer in layers[:i]) for i in range(3)]
        walk = [1.5 * layer.gradient_bytes - layer.parameter_bytes - freed_before[i] for i, layer in enumerate(layers)]
        assert sharded.reduce_working_bytes == max(0.0, *walk)
    plain = PipelineSpec(pipeline_parallel=2, micro_batches=4, data_parallel=2, receive_buffers=True)
    assert pipeline_costs(profile, plain, (3, 3), ("none",) * 6).chunk_costs[0][0].sharded is None


@pytest.mark.parametrize(
    ("fields", "held", "expected"),
    [
        # each unit's flat input, its gradient still whole (on the safe side), its shard and gloo's temporary,
        # less its parameters: 15, 75 - 30 - 20 = 25 (the first two units freed 20), 50 - 20 - 80 = -50
        ({"collective_backend": "gloo"}, 0.0, 25.0),
        # what the gradients leave stays: 5 of the first unit's
        ({"collective_backend": "gloo", "gradients_persist": False}, 0.0, 30.0),
        ({"collective_backend": "nccl"}, 0.0, 5.0),  # no temporary: 5, 45 - 30 - 20 = -5
        ({"collective_backend": "gloo"}, 7.0, 32.0),  # what the engine holds through the reduce besides
    ],
)
def test_the_reduce_goes_unit_by_unit_in_model_order_freeing_as_it_goes(fields, held, expected):
    units = [
        Unit(size, size, 0.0, 0.0, 0.0, 0.0, reshards_after_forward=False)
        for size in (10.0 * MIB, 30.0 * MIB, 20.0 * MIB)
    ]
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, data_parallel=2, fsdp=True, **fields)
    costs = sharded_costs(spec, units, start_bytes=0.0, seed_bytes=0.0, reduce_held_bytes=held * MIB)
    assert costs.reduce_working_bytes == expected * MIB


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B"])
def test_the_program_states_the_reduce_where_it_sets_the_peak(schedule):
    """Activations of 1 MiB: each rank's peak is its first unit's reduce on gloo (the embedding's, on
    rank 0); under torch's 1F1B and GPipe the last stage holds its last logits through it."""
    profile = dataclasses.replace(
        _fsdp_profile(),
        model_output_bytes=4 * MIB,
        layers=tuple(
            dataclasses.replace(
                layer,
                recompute={
                    mode: dataclasses.replace(cost, activation_bytes=MIB) for mode, cost in layer.recompute.items()
                },
            )
            for layer in _fsdp_profile().layers
        ),
    )
    counts = (3, 3) if schedule != "Interleaved1F1B" else (2, 1, 1, 2)
    spec = PipelineSpec(
        pipeline_parallel=2,
        micro_batches=4,
        schedule=schedule,
        receive_buffers=True,
        data_parallel=2,
        fsdp=True,
        collective_backend="gloo",
    )
    _check_rows(spec, counts, exact=True, profile=profile)
    plan = evaluate_plan(profile, spec, counts, ("none",) * len(profile.layers))
    quiet = PipelineCosts(
        tuple(
            tuple(dataclasses.replace(c, sharded=dataclasses.replace(c.sharded, reduce_working_bytes=0.0)) for c in row)
            for row in plan.simulation.costs.chunk_costs
        ),
        unshard_lookahead=plan.simulation.costs.unshard_lookahead,
    )
    without_reduce = simulate(plan.simulation.schedule, quiet).rank_peak_memory_bytes
    assert all(peak > quiet_peak for peak, quiet_peak in zip(plan.rank_peak_memory_bytes, without_reduce))
    last = plan.simulation.costs.chunk_costs[-1][-1].sharded.reduce_working_bytes
    logits_held = 4 * MIB if schedule != "Interleaved1F1B" else 0.0
    first_block = profile.layers[-counts[-1]]  # the last stage's first unit: 2.5 gradients less its parameters
    assert last == 1.5 * first_block.gradient_bytes + logits_held


@pytest.mark.parametrize("reshard", [False, True])
def test_the_first_backward_walk_never_exceeds_what_the_program_counts(reshard):
    """The program counts the step gradients from the first backward's start, over the backward's own
    working set: a bound from above only if the walk with them arriving stays within it."""
    profile = _fsdp_profile()
    spec = PipelineSpec(
        pipeline_parallel=2,
        micro_batches=4,
        data_parallel=2,
        fsdp=True,
        fsdp_reshard_after_forward=reshard,
        receive_buffers=True,
    )
    for counts in ((3, 3), (1, 5), (5, 1)):
        for chunk in (row[0] for row in pipeline_costs(profile, spec, counts, ("none",) * 6).chunk_costs):
            sharded = chunk.sharded
            assert (
                sharded.first_backward_working_bytes
                <= chunk.working_bytes_during(FULL_BACKWARD) + sharded.gradient_bytes
            )
            assert (
                sharded.first_backward_gather_working_bytes
                <= sharded.backward_gather_working_bytes + sharded.gradient_bytes
            )


@pytest.mark.parametrize(
    ("schedule", "counts"),
    [("1F1B", (3, 3)), ("GPipe", (3, 3)), ("Interleaved1F1B", (2, 1, 1, 2)), ("ZBVZeroBubble", (2, 1, 1, 2))],
)
def test_fsdp_under_pipelining_holds_whole_parameters_and_gradients_on_top_of_the_pipelines_peak(schedule, counts):
    """Measured on torch 2.13 (docs/results): without reshard after forward, a rank peaks at its sharded
    static bytes + what the pipeline alone holds above its static bytes + its chunks' whole parameters
    and gradients, where the gathering and the reduce (which these large layers' make) do not set it.
    Under GPipe the pipeline peaks in the first backward, which makes the gradients layer by layer: the
    peak is lower by what its layers had not made yet."""
    profile = _fsdp_profile()
    modes = ("none",) * len(profile.layers)
    base = {"pipeline_parallel": 2, "micro_batches": 4, "schedule": schedule, "receive_buffers": True}
    fsdp = evaluate_plan(profile, PipelineSpec(**base, data_parallel=2, fsdp=True), counts, modes)
    alone = evaluate_plan(profile, PipelineSpec(**base), counts, modes)
    costs = fsdp.simulation.costs
    quiet = PipelineCosts(
        tuple(
            tuple(
                dataclasses.replace(
                    c,
                    sharded=dataclasses.replace(c.sharded, forward_gather_working_bytes=0.0, reduce_working_bytes=0.0),
                )
                for c in row
            )
            for row in costs.chunk_costs
        ),
        unshard_lookahead=costs.unshard_lookahead,
    )
    without_transients = simulate(fsdp.simulation.schedule, quiet).rank_peak_memory_bytes
    for rank in range(2):
        row, plain_row = costs.chunk_costs[rank], alone.simulation.costs.chunk_costs[rank]
        whole = sum(c.sharded.gathered_bytes + c.sharded.gradient_bytes for c in row)
        above_static = alone.rank_peak_memory_bytes[rank] - sum(c.static_bytes for c in plain_row)
        every_gradient_first = sum(c.static_bytes for c in row) + above_static + whole
        if schedule == "GPipe":
            gradients = sum(c.sharded.gradient_bytes for c in row)
            assert every_gradient_first - gradients < without_transients[rank] < every_gradient_first
        else:
            assert without_transients[rank] == every_gradient_first
        assert fsdp.rank_peak_memory_bytes[rank] >= without_transients[rank]


@pytest.mark.parametrize(
    "fields",
    [
        {"fsdp": True},
        {"fsdp": True, "gradients_persist": False},
        {"gradients_persist": False},
        {"zero_stage": 3},
    ],
)
@pytest.mark.parametrize(
    ("schedule", "counts"),
    [("1F1B", (3, 3)), ("Interleaved1F1B", (2, 1, 1, 2)), ("ZBVZeroBubble", (2, 1, 1, 2)), ("DualPipeV", (2, 1, 1, 2))],
)
def test_the_programs_memory_is_the_replays(fields, schedule, counts):
    """Gathered parameters, step gradients and what reduces leave are stated exactly; here the bounds
    on gathering's working sets bind nowhere, so each rank's largest row is its replayed peak. Where a
    full backward that makes FSDP's step gradients sets the peak (DualPipeV's here), the program counts
    them from its start and the replay layer by layer: the rows bound the peak from above."""
    _check_rows(
        PipelineSpec(
            pipeline_parallel=2, micro_batches=4, schedule=schedule, receive_buffers=True, data_parallel=2, **fields
        ),
        counts,
        exact=not (schedule == "DualPipeV" and fields.get("fsdp")),
    )


@pytest.mark.parametrize(("schedule", "counts"), [("1F1B", (3, 3)), ("Interleaved1F1B", (2, 1, 1, 2))])
def test_the_program_bounds_reshard_after_forward_from_above(schedule, counts):
    _check_rows(
        PipelineSpec(
            pipeline_parallel=2,
            micro_batches=4,
            schedule=schedule,
            receive_buffers=True,
            data_parallel=2,
            fsdp=True,
            fsdp_reshard_after_forward=True,
            collective_backend="gloo",
        ),
        counts,
        exact=False,
    )


def _check_rows(
    pipeline: PipelineSpec, counts: tuple[int, ...], *, exact: bool, profile: ModelProfile | None = None
) -> None:
    profile = profile or _fsdp_profile()
    schedule = pipeline.pipeline_schedule
    groups = layer_groups(profile, pipeline, schedule.num_virtual_stages)
    program = IntegerProgram(profile, pipeline, schedule, groups, with_budget=False, timing=PATHS)
    body = [g for g, group in enumerate(groups) if group.pinned_virtual_stage is None]
    held = {}
    virtual_of = [v for v, count in enumerate(counts) for _ in range(count - (v == 0) - (v == len(counts) - 1))]
    index = 0
    for g in body:
        for _ in range(groups[g].size):
            variable = program.count[g, virtual_of[index], "none"]
            held[variable] = held.get(variable, 0) + 1
            index += 1
    values = program.point(held)
    replayed = evaluate_plan(profile, pipeline, counts, ("none",) * len(profile.layers)).rank_peak_memory_bytes
    for rank in range(schedule.ranks):
        rows = max(row.value(values) for r, row in program.memory_rows if r == rank)
        if exact:
            assert rows == pytest.approx(replayed[rank] / MIB, rel=1e-9)
        else:
            assert rows >= replayed[rank] / MIB - 1e-9


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"schedule": "ZBVZeroBubble", "fsdp": True, "fsdp_reshard_after_forward": True},
            "fsdp_reshard_after_forward",
            "drops gradients",
        ),
        (
            {"schedule": "DualPipeV", "fsdp": True, "fsdp_reshard_after_forward": True},
            "fsdp_reshard_after_forward",
            "drops gradients",
        ),
        ({"schedule": "ZBH1", "ddp": True}, "ddp", "DDP reducer refuses"),
        ({"schedule": "ZBVZeroBubble", "ddp": True}, "ddp", "DDP reducer refuses"),
        ({"ddp": True, "fsdp": True}, "ddp", "expected no fsdp"),
        ({"ddp": True, "zero_stage": 2}, "ddp", "zero_stage 0 or 1"),
        ({"ddp_bucket_view": True}, "ddp_bucket_view", "needs ddp"),
        ({"collective_backend": "mpi"}, "collective_backend", "expected one of nccl, gloo"),
    ],
)
def test_layouts_torch_does_not_run_are_refused(fields, field, message):
    with pytest.raises(InputError, match=message) as caught:
        PipelineSpec(**{"pipeline_parallel": 2, "micro_batches": 4, **fields})
    assert caught.value.field == field


def test_the_new_fields_round_trip_and_default():
    made = PipelineSpec(
        pipeline_parallel=2,
        micro_batches=4,
        data_parallel=2,
        fsdp=True,
        gradients_persist=False,
        collective_backend="gloo",
    )
    assert spec_to_dict(spec_from_dict(spec_to_dict(made))) == spec_to_dict(made)
    old = {"stages": 2, "micro_batches": 4, "schedule": "1F1B"}  # a plan file from before these fields
    with pytest.warns(FutureWarning, match="spec.stages is the former name of spec.pipeline_parallel"):
        again = spec_from_dict(old)
    assert again.pipeline_parallel == 2
    assert (again.gradients_persist, again.ddp, again.ddp_bucket_view, again.collective_backend) == (
        True,
        False,
        False,
        "nccl",
    )


def test_profile_keeps_its_optimizer_scalars():
    profile = _fsdp_profile()
    again = ModelProfile.from_dict(profile.to_dict())
    assert [layer.optimizer_tensor_bytes() for layer in again.layers] == [40.0] * len(profile.layers)
    bad = profile.to_dict()
    bad["layers"][0]["parameter_tensors"] = -1
    with pytest.raises(InputError, match=r"layers\[0\].*parameter_tensors: expected an integer >= 0"):
        ModelProfile.from_dict(bad)


def test_uniform_costs_still_replay_without_sharding():
    result = simulate(
        PipelineSpec(pipeline_parallel=2, micro_batches=4).pipeline_schedule,
        PipelineCosts.uniform(2, 1, forward_ms=1.0, backward_ms=2.0, activation_bytes=5.0),
    )
    assert result.rank_peak_memory_bytes == (10.0, 5.0) and not math.isnan(result.iteration_time_ms)


def test_units_hand_each_layer_its_output_gradient_and_free_the_later_activations():
    """A chunk's backward, last layer first: each layer but the last is handed its output's gradient (a
    stage output's size); before its backward the later layers' activations are freed, and before the
    head's the rotary tables the blocks used."""
    from solver.costs import _units

    profile = _fsdp_profile()
    layers = [(layer, "none") for layer in profile.layers[:3]]  # the head and two blocks
    units = _units(spec(fsdp=True, fsdp_reshard_after_forward=True), layers, 2 * MIB, 0.5 * MIB, 1 * MIB)
    activation = [layer.recompute["none"].activation_bytes for layer, _ in layers]
    assert [u.handed_bytes for u in units] == [2 * MIB, 2 * MIB, 0.0]
    assert [u.freed_bytes for u in units] == [activation[1] + activation[2] + 0.5 * MIB, activation[2], 0.0]
    assert [u.activation_bytes for u in units] == [activation[0] - 1 * MIB, *activation[1:]]  # the buffer it saved
    assert all(u.reshards_after_forward for u in units)


def test_torch_runtime_schedules_gather_every_chunk_before_the_first_action():
    """Interleaved1F1B runs on torch's runtime, which unshards a rank's chunks ahead of their actions:
    both are gathered when the step starts; Schedule1F1B gathers a chunk at its first forward."""
    profile = _fsdp_profile()
    for schedule, counts, lookahead in (("Interleaved1F1B", (2, 1, 1, 2), 3), ("1F1B", (3, 3), 0)):
        pipeline = PipelineSpec(
            pipeline_parallel=2, micro_batches=4, schedule=schedule, receive_buffers=True, data_parallel=2, fsdp=True
        )
        plan = evaluate_plan(profile, pipeline, counts, ("none",) * len(profile.layers))
        assert plan.simulation.costs.unshard_lookahead == lookahead
        first = plan.simulation.memory_split(0)[1]  # the point after the first action
        gathered = sum(c.sharded.gathered_bytes for c in plan.simulation.costs.chunk_costs[0])
        assert (first[2] == gathered) == (lookahead > 0)


def test_the_programs_states_follow_a_rank_through_its_step():
    """Per chunk: gathered from its first forward, step gradients from its first backward, and after its
    reduce what the reduce leaves in their place (gradients freed between steps: the shards)."""
    from solver.program.sharded_rows import GATHER, REDUCE, ShardedStates

    pipeline = PipelineSpec(
        pipeline_parallel=1, micro_batches=2, receive_buffers=True, data_parallel=2, fsdp=True, gradients_persist=False
    )
    profile = _fsdp_profile()
    program = IntegerProgram(
        profile,
        pipeline,
        pipeline.pipeline_schedule,
        layer_groups(profile, pipeline, 1),
        with_budget=False,
        timing=PATHS,
    )
    ops = [(0, FORWARD), (0, FORWARD), (0, FULL_BACKWARD), (0, FULL_BACKWARD)]
    states = ShardedStates(program, program.memory.sharded, ops)
    seen = []
    for index, (chunk, op) in enumerate(ops):
        states.before(index, chunk, op)
        key = states.after(index, chunk, op)
        seen.append((tuple(states.flags), key))
        if key == REDUCE:
            states.reduce(chunk)
    assert seen == [((1, 0, 0), GATHER), ((1, 0, 0), None), ((1, 1, 0), None), ((1, 1, 0), REDUCE)]
    row = Linear()
    states.add_to(row, tuple(states.flags), [0])
    whole = sum(layer.gradient_bytes for layer in profile.layers)
    every_layer = program.point({variable: 4 for (_, _, mode), variable in program.count.items() if mode == "none"})
    assert tuple(states.flags) == (0, 0, 1) and row.value(every_layer) == pytest.approx(whole / 2 / MIB)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    problems(),
    st.sampled_from(
        [
            {"fsdp": True},
            {"fsdp": True, "fsdp_reshard_after_forward": True},
            {"fsdp": True, "gradients_persist": False, "collective_backend": "gloo"},
            {"zero_stage": 3},
            {"gradients_persist": False},
        ]
    ),
    st.randoms(use_true_random=False),
)
def test_no_plan_the_program_allows_holds_more_than_it_says(problem, layout, rng):
    """For any split and modes, each rank's largest row is at least the replay's peak (exactly it but
    for gathering's working sets): a plan the program fits within a budget fits in the replay."""
    profile, base = problem
    if layout.get("fsdp_reshard_after_forward") and schedule_kind(base.schedule).splits_backward:
        return  # refused: torch drops gradients there
    profile = dataclasses.replace(
        profile,
        layers=tuple(
            dataclasses.replace(layer, gradient_bytes=layer.parameter_bytes, optimizer_bytes=2 * layer.parameter_bytes)
            for layer in profile.layers
        ),
    )
    pipeline = dataclasses.replace(base, data_parallel=2, **layout)
    schedule = pipeline.pipeline_schedule
    groups = layer_groups(profile, pipeline, schedule.num_virtual_stages)
    program = IntegerProgram(profile, pipeline, schedule, groups, with_budget=False, timing=PATHS)
    body = sum(g.size for g in groups if g.pinned_virtual_stage is None)
    cuts = sorted(rng.sample(range(1, body), schedule.num_virtual_stages - 1))
    virtual_of = [sum(1 for cut in cuts if cut <= i) for i in range(body)]
    counts, index = {}, 0
    for g, group in enumerate(groups):
        for _ in range(group.size if group.pinned_virtual_stage is None else 0):
            key = (g, virtual_of[index], rng.choice(group.modes))
            key = key if key in program.count else (*key[:2], "none")  # a mode this stage cannot take
            counts[program.count[key]] = counts.get(program.count[key], 0) + 1
            index += 1
    values = program.point(counts)
    plan = program.plan(values)
    for rank in range(schedule.ranks):
        rows = max(row.value(values) for r, row in program.memory_rows if r == rank)
        assert rows >= plan.rank_peak_memory_bytes[rank] / MIB - 1e-6


def test_a_forwards_gathering_can_set_the_peak_and_the_program_states_it():
    """Three 100 MiB blocks without gradients (frozen) and small activations: the first forward's
    gathering of the last block (the two before it gathered, the middle one's flat output still there,
    its own flat output and copy) is the rank's peak; the program's bound is exact for identical blocks."""
    from solver import LayerProfile, ModelProfile, RecomputeCost

    def block(name, kind, parameter_mib, activation_mib):
        return LayerProfile(
            name=name,
            kind=kind,
            forward_ms=1.0,
            backward_ms=2.0,
            parameter_bytes=parameter_mib * MIB,
            recompute={"none": RecomputeCost(0.0, activation_mib * MIB, 1 * MIB)},
        )

    profile = ModelProfile(
        layers=(
            block("embed", "head", 0, 0),
            *(block(f"b{i}", "body:a", 100, 1) for i in range(3)),
            block("tail", "tail", 0, 0),
        )
    )
    pipeline = PipelineSpec(pipeline_parallel=1, micro_batches=1, data_parallel=2, fsdp=True)
    plan = evaluate_plan(profile, pipeline, (5,), ("none",) * 5)
    static = plan.simulation.costs.chunk_costs[0][0].static_bytes
    assert (
        plan.rank_peak_memory_bytes[0] == static + (200 + 2) * MIB + 100 * MIB + 200 * MIB
    )  # 2 blocks kept, flat, copy
    _check_one(profile, pipeline, (5,))


def _check_one(profile, pipeline, counts):
    program = IntegerProgram(
        profile,
        pipeline,
        pipeline.pipeline_schedule,
        layer_groups(profile, pipeline, 1),
        with_budget=False,
        timing=PATHS,
    )
    values = program.point(
        {variable: counts[0] - 2 for (_, _, mode), variable in program.count.items() if mode == "none"}
    )
    rows = max(row.value(values) for _, row in program.memory_rows)
    assert rows == pytest.approx(
        evaluate_plan(profile, pipeline, counts, ("none",) * 5).rank_peak_memory_bytes[0] / MIB
    )
