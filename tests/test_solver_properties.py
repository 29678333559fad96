"""Every plan the solver returns fits when simulated; when it says nothing fits, its smallest budget
does (hypothesis, random small profiles)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from solver_cases import MIB, layer

from simulator import SCHEDULES, simulate
from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from solver import InfeasibleError, ModelProfile, PipelineSpec, solve
from solver.costs import pipeline_costs
from solver.program import search, start
from solver.program.formulation import PATHS, START_TIMES, IntegerProgram
from solver.program.groups import layer_groups

SMALL = [
    ("1F1B", 1),
    ("GPipe", 1),
    ("ZBH1", 1),
    ("Interleaved1F1B", 2),
    ("Interleaved1F1B-less-memory", 2),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
]


@st.composite
def problems(draw):
    name, chunks = draw(st.sampled_from(SMALL))
    stages = draw(st.integers(1, 3))
    fewest = SCHEDULES[name].min_micro_batches(stages, chunks)
    micro_batches = draw(st.integers(fewest, fewest + 3))
    kinds = draw(
        st.lists(st.sampled_from(["body:a", "body:b"]), min_size=stages * chunks, max_size=stages * chunks + 4)
    )
    kinds.sort()  # one run per kind, in model order
    times = st.floats(0.5, 9.0)

    def body(i, kind):
        forward = draw(times)
        backward = 2 * forward
        keep = draw(st.floats(5, 50))
        weight = draw(st.floats(0, 1)) * backward
        made = layer(
            f"l{i}",
            kind,
            forward,
            backward,
            weight,
            parameter_mib=draw(st.floats(0, 40)),
            modes={
                "none": (0.0, keep, 2.0),
                "selective": (forward * 0.3, keep * 0.5, 2.0),
                "full": (forward, keep * 0.1, keep),
            },
        )
        # where the backward is split: I's own time (torch's two halves cost more than one backward),
        # what is kept after W, held from I to W, and what each half holds while it runs
        made = dataclasses.replace(made, input_ms=draw(st.sampled_from([None, 1.3 * (backward - weight)])))
        retained, pending_mib = draw(st.sampled_from([0.0, 0.5, 1.0])), draw(st.sampled_from([0.0, 0.6 * keep]))
        halves = draw(st.sampled_from([None, (pending_mib + 0.5, 3.0), (pending_mib + 4.0, 0.5)]))
        # in a stage: the graph on its output's side kept until W where a layer follows it, and the
        # gradient handed to it freed
        held_extra_mib, freed_mib = draw(st.sampled_from([(0.0, 0.0), (0.4, 0.0), (0.4, 0.3), (0.0, 0.2)]))
        saved_input_mib = draw(st.sampled_from([0.0, 0.4]))  # its input, which torch's receive buffers hold
        # what its W frees before its stage's W ends: its pending gradients, or part of what it saved too
        weight_freed_mib = draw(st.sampled_from([None, 0.0, 0.3 * keep]))
        return dataclasses.replace(
            made,
            recompute={
                mode: dataclasses.replace(
                    cost,
                    retained_bytes=retained * cost.activation_bytes,
                    pending_bytes=pending_mib * MIB,
                    input_working_bytes=None if halves is None else halves[0] * MIB,
                    weight_working_bytes=None if halves is None else halves[1] * MIB,
                    input_held_bytes=(pending_mib + held_extra_mib) * MIB if held_extra_mib else None,
                    output_gradient_freed_bytes=freed_mib * MIB,
                    saved_input_bytes=saved_input_mib * MIB,
                    weight_freed_bytes=None
                    if weight_freed_mib is None
                    else (pending_mib + min(weight_freed_mib, cost.activation_bytes / MIB)) * MIB,
                )
                for mode, cost in made.recompute.items()
            },
        )

    # head and tail working sets up to above any body layer's: the program once dropped the body
    # layers' working sets where a tail's was the largest
    layers = [
        layer(
            "head",
            "head",
            draw(times),
            draw(times),
            parameter_mib=draw(st.floats(0, 40)),
            modes={"none": (0.0, 0.0, draw(st.floats(0, 80)))},
        )
    ]
    layers += [body(i, kind) for i, kind in enumerate(kinds)]
    tail = layer(
        "tail",
        "tail",
        draw(times),
        draw(times),
        parameter_mib=draw(st.floats(0, 40)),
        modes={"none": (0.0, draw(st.floats(0, 30)), draw(st.floats(0, 80)))},
    )
    if draw(st.booleans()):  # its I holding far more than its W (the loss's gradient, then the LM head's weights'),
        # and the logits' gradient held until the chunk's I ends, under every other layer's I there
        held_mib = draw(st.one_of(st.none(), st.floats(0, 40)))
        tail = dataclasses.replace(
            tail,
            recompute={
                "none": dataclasses.replace(
                    tail.recompute["none"],
                    input_working_bytes=draw(st.floats(0, 80)) * MIB,
                    weight_working_bytes=draw(st.sampled_from([0.5, 60.0])) * MIB,  # the LM head's weight gradient
                    input_held_bytes=None if held_mib is None else held_mib * MIB,
                )
            },
        )
    layers.append(tail)
    spec = PipelineSpec(
        pipeline_parallel=stages,
        chunks=chunks,
        micro_batches=micro_batches,
        schedule=name,
        memory_budget_bytes=draw(st.floats(30, 600)) * MIB,
        p2p_ms=draw(st.sampled_from([0.0, 0.3])),
        receive_buffers=draw(st.booleans()),
    )
    output = draw(st.sampled_from([0.0, 3.0])) * MIB  # a stage's output, kept until its gradient returns
    logits = draw(st.sampled_from([0.0, 7.0])) * MIB  # the model's, which torch's engine keeps on the last stage
    shared = draw(st.sampled_from([0.0, 0.7])) * MIB  # what each stage computes for its blocks (rotary tables)
    loss = min(draw(st.sampled_from([0.0, 0.2])) * MIB, logits)  # of the model's output, kept to the step's end
    return ModelProfile(
        layers=tuple(layers),
        stage_output_bytes=output,
        model_output_bytes=logits,
        loss_bytes=loss,
        stage_shared_bytes=shared,
    ), spec


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plans_fit_and_infeasibility_is_exact(problem):
    profile, spec = problem
    try:
        plan = solve(profile, spec, time_limit_s=30)
    except InfeasibleError as error:
        assert error.smallest_budget_bytes > spec.memory_budget_bytes
        looser = dataclasses.replace(spec, memory_budget_bytes=error.smallest_budget_bytes * (1 + 1e-9))
        assert solve(profile, looser, time_limit_s=30).fits
        return
    assert plan.status == "optimal" and plan.fits
    replay = simulate(spec.pipeline_schedule, pipeline_costs(profile, spec, plan.stage_layer_counts, plan.layer_modes))
    assert replay.iteration_time_ms == pytest.approx(plan.iteration_time_ms)
    assert max(replay.rank_peak_memory_bytes) <= spec.memory_budget_bytes


def _solve_error_case(
    forwards: tuple[float, ...], weights: tuple[float, ...], tail_backward: float, budget_mib: float, p2p_ms: float
) -> tuple[ModelProfile, PipelineSpec]:
    """A 3-stage GPipe program on which HiGHS 1.16.0 ended a search in a solve error (a solution breaking
    a path row by exactly its feasibility tolerance) until the search was run again with another seed."""
    head = layer("head", "head", 1.1229761813946553, 1.4453265197763752)
    body = [
        layer(
            f"l{i}",
            "body:a",
            forward,
            2 * forward,
            weight * 2 * forward,
            modes={"none": (0.0, 5.0, 2.0), "selective": (0.3 * forward, 2.5, 2.0), "full": (forward, 0.5, 5.0)},
        )
        for i, (forward, weight) in enumerate(zip(forwards, weights))
    ]
    profile = ModelProfile(layers=(head, *body, layer("tail", "tail", 1.0, tail_backward)))
    return profile, PipelineSpec(
        pipeline_parallel=3, micro_batches=3, schedule="GPipe", memory_budget_bytes=budget_mib * MIB, p2p_ms=p2p_ms
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
@example(
    problem=_solve_error_case(
        (4.5, 4.547999165838229, 2.0, 1.966640451660458, 2.9080647529977286), (0, 0, 0, 0, 0), 1.0, 34, 0.0
    )
)
@example(
    problem=_solve_error_case(
        (7.228399142981768, 4.547999165838229, 6.6935370880810385, 1.966640451660458, 3.9080647529977286),
        (0, 0, 0, 0, 1),
        1.1,
        38,
        0.3,
    )
)
def test_both_ways_of_stating_the_iteration_time_find_the_same_optimum(problem):
    profile, spec = problem
    optimum = {}
    for timing in (START_TIMES, PATHS):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(search, "_timing_for", lambda schedule, timing=timing: timing)
            try:
                plan = solve(profile, spec, time_limit_s=30)
            except InfeasibleError as error:
                optimum[timing] = ("infeasible", error.smallest_budget_bytes)
                continue
        assert plan.status == "optimal"
        optimum[timing] = ("optimal", plan.iteration_time_ms)
    (status, start_times), (_, paths) = optimum[START_TIMES], optimum[PATHS]
    assert optimum[PATHS][0] == status
    assert paths == pytest.approx(start_times, rel=1e-9)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_the_balanced_plan_fits_and_the_busiest_rank_bound_is_below_the_optimum(problem):
    """What a stopped search falls back on: a plan that fits (when the balanced split can be made to),
    and a lower bound no plan beats."""
    profile, spec = problem
    schedule = spec.pipeline_schedule
    groups = layer_groups(profile, spec, schedule.num_virtual_stages)
    program = IntegerProgram(profile, spec, schedule, groups, with_budget=True, timing=PATHS)
    balanced = [start.balanced_plan(program, move_layers=moves) for moves in (False, True)]
    try:
        optimum = solve(profile, spec, time_limit_s=30).iteration_time_ms
    except InfeasibleError:
        assert balanced == [None, None]
        return
    assert search._busiest_rank_bound_ms(profile, spec, schedule, groups) <= optimum * (1 + 1e-9)
    if balanced[0] is not None:
        assert balanced[1] == balanced[0]  # layers move only where switching modes is not enough
    for values in filter(None, balanced):
        plan = program.plan(values)
        assert plan.fits
        assert plan.iteration_time_ms >= optimum * (1 - 1e-9)
        assert values[program.iteration] == pytest.approx(plan.iteration_time_ms)
        # What a search with start times falls back on: the balanced plan with layers moved.
        improved = start.improved_by_moves(program, values)
        moved = program.plan(improved)
        assert moved.fits
        assert optimum * (1 - 1e-9) <= moved.iteration_time_ms <= plan.iteration_time_ms * (1 + 1e-9)
        assert improved[program.iteration] == pytest.approx(moved.iteration_time_ms)


def _retained_case() -> tuple[ModelProfile, PipelineSpec]:
    """Under torch's engine, a last stage whose layers keep less for backward than torch keeps to the
    step's end (its input's gradient, its sends): its peak is the step's end."""
    layers = [
        layer("head", "head", 1.0, 2.0),
        *(layer(f"l{i}", "body:a", 2.0, 4.0, 2.0, modes={"none": (0.0, 1.0, 0.5)}) for i in range(4)),
        layer("tail", "tail", 1.0, 2.0, 1.0),
    ]
    spec = PipelineSpec(pipeline_parallel=3, micro_batches=1, schedule="ZBH1", receive_buffers=True)
    return ModelProfile(layers=tuple(layers), stage_output_bytes=3 * MIB), spec


def _tail_weight_case() -> tuple[ModelProfile, PipelineSpec]:
    """Under torch's engine, a last stage whose tail's W (the LM head's weight gradient) holds the most:
    torch runs it after the blocks' W have freed their pending gradients."""

    def split(made, pending_mib: float, input_mib: float, weight_mib: float):
        return dataclasses.replace(
            made,
            recompute={
                "none": dataclasses.replace(
                    made.recompute["none"],
                    pending_bytes=pending_mib * MIB,
                    input_working_bytes=input_mib * MIB,
                    weight_working_bytes=weight_mib * MIB,
                )
            },
        )

    blocks = [
        split(layer(f"l{i}", "body:a", 2.0, 4.0, 2.0, modes={"none": (0.0, 20.0, 2.0)}), 10.0, 12.0, 3.0)
        for i in range(4)
    ]
    tail = split(layer("tail", "tail", 1.0, 2.0, 1.0, modes={"none": (0.0, 8.0, 9.0)}), 0.0, 9.0, 60.0)
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="ZBH1", receive_buffers=True)
    return ModelProfile(layers=(layer("head", "head", 1.0, 2.0), *blocks, tail)), spec


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.randoms(use_true_random=False))
@example(problem=_retained_case(), rng=random.Random(0))
def test_the_programs_memory_is_the_simulators_for_any_split_and_modes(problem, rng):
    """Per rank, the largest of the program's memory rows at a plan's layer counts is the peak the
    simulator replays for that plan: what the search may not exceed is what a plan will hold."""
    profile, spec = problem
    schedule = spec.pipeline_schedule
    groups = layer_groups(profile, spec, schedule.num_virtual_stages)
    program = IntegerProgram(profile, spec, schedule, groups, with_budget=False, timing=PATHS)
    body = [g for g, group in enumerate(groups) if group.pinned_virtual_stage is None]
    num_virtual_stages = schedule.num_virtual_stages
    # each body layer, in model order, to a non-decreasing virtual stage, every stage holding one
    sizes = [sum(groups[g].size for g in body)]
    cuts = sorted(rng.sample(range(1, sizes[0]), num_virtual_stages - 1))
    virtual_of = [sum(1 for cut in cuts if cut <= i) for i in range(sizes[0])]
    counts: dict[int, int] = {}
    index = 0
    for g in body:
        for _ in range(groups[g].size):
            key = (g, virtual_of[index], rng.choice(groups[g].modes))
            index += 1
            if key in program.count:
                counts[program.count[key]] = counts.get(program.count[key], 0) + 1
            else:  # a mode this stage cannot take (MindFormers' prefixes): keep none
                none = program.count[g, key[1], "none"]
                counts[none] = counts.get(none, 0) + 1
    values = program.point(counts)
    plan = program.plan(values)
    program_mib = [
        max((row.value(values) for r, row in program.memory_rows if r == rank), default=0.0)
        for rank in range(schedule.ranks)
    ]

    assert program_mib == pytest.approx([peak / MIB for peak in plan.rank_peak_memory_bytes], rel=1e-9, abs=1e-6)
    for virtual in range(num_virtual_stages):  # and its working sets and durations are the simulator's
        costs = plan.simulation.costs.chunk_costs[schedule.rank_of(virtual)][schedule.chunk_of(virtual)]
        for kind in (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            assert program.memory.working[virtual][kind].value(values) == pytest.approx(
                costs.working_bytes_during(kind) / MIB, rel=1e-9, abs=1e-6
            ), (virtual, kind)
        assert values[program.duration[virtual, FORWARD]] == pytest.approx(costs.forward_ms)
        assert values[program.duration[virtual, FULL_BACKWARD]] == pytest.approx(costs.backward_ms + costs.recompute_ms)
        assert values[program.duration[virtual, BACKWARD_INPUT]] == pytest.approx(
            costs.split_input_ms() + costs.recompute_ms
        )
        assert values[program.duration[virtual, BACKWARD_WEIGHT]] == pytest.approx(costs.split_weight_ms())
