"""Whatever a profile file holds and whatever scale its figures have, reading and solving it ends in a
plan that fits, or in one clear error (InputError, InfeasibleError): never a traceback. Hypothesis
versions of the fuzzing that found HiGHS giving up on 2**70-byte layers, wrong plans for microsecond
layers, and a TypeError on a list where a mode belongs."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from solver_cases import small_profile

from simulator import InputError
from solver import InfeasibleError, ModelProfile, PipelineSpec, solve

SCHEDULES = [("1F1B", 1), ("ZBH1", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)]
ODD_VALUES = [None, -1, 0, 0.5, 3, 1e308, math.nan, math.inf, 2**70, 1e-300, True, "x", [], {}, [1], {"a": 1}]


def _places(data, prefix=()):
    """Every key and list index in `data` (the first three items of a list), as paths."""
    items = data.items() if isinstance(data, dict) else enumerate(data[:3]) if isinstance(data, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _places(value, (*prefix, key))


def _solved_or_refused(profile: ModelProfile, schedule: str, chunks: int, budget: float) -> None:
    spec = PipelineSpec(
        pipeline_parallel=2, chunks=chunks, micro_batches=4, schedule=schedule, memory_budget_bytes=budget
    )
    try:
        plan = solve(profile, spec, time_limit_s=10)
    except InfeasibleError:
        return
    assert plan.fits


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_damaged_profile_is_read_and_solved_or_refused_in_one_error(data):
    document = small_profile(3).to_dict()
    places = list(_places(document))
    for _ in range(data.draw(st.integers(1, 3))):
        *parents, last = data.draw(st.sampled_from(places))
        node = document
        try:
            for key in parents:
                node = node[key]
            if isinstance(node, dict) and data.draw(st.booleans()):
                node.pop(last, None)
            else:
                node[last] = copy.deepcopy(data.draw(st.sampled_from(ODD_VALUES)))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier change took that place away
    try:
        profile = ModelProfile.from_dict(document)
    except InputError:
        return
    schedule, chunks = data.draw(st.sampled_from(SCHEDULES))
    with contextlib.suppress(InputError):
        _solved_or_refused(profile, schedule, chunks, math.inf)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(-12, 8), st.floats(-6, 9), st.sampled_from(SCHEDULES), st.floats(0.3, 3.0))
@example(8.0, 0.0, ("1F1B", 1), 1.0)  # layers within the limits whose stage sums were not: an InputError inside
@example(5.291015625, 0.0, ("1F1B", 1), 1.0)  # layers of 1e5-1e6 ms: "HiGHS ended with Solve error"
@example(7.8, 0.0, ("ZBH1", 1), 1.0)  # and "the formulation and the simulator disagree"
def test_any_scale_of_times_and_sizes_is_solved_or_refused_in_one_error(time_exponent, size_exponent, schedule, share):
    base = small_profile(4)
    document = base.to_dict()
    for layer in document["layers"]:
        for key in ("forward_ms", "backward_ms", "weight_ms", "input_ms"):
            if layer.get(key) is not None:
                layer[key] *= 10**time_exponent
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            layer[key] *= 10**size_exponent
        for cost in layer["recompute"].values():
            cost["extra_ms"] *= 10**time_exponent
            for key in ("activation_bytes", "working_bytes", "retained_bytes", "pending_bytes"):
                cost[key] = cost.get(key, 0.0) * 10**size_exponent
    try:
        profile = ModelProfile.from_dict(document)
    except InputError as error:  # beyond 1e9 ms or 2**50 bytes: refused, by name
        assert "expected at most" in str(error)
        return
    static = sum(layer.parameter_bytes for layer in profile.layers)
    _solved_or_refused(profile, *schedule, share * static * 4)


def test_the_figures_beyond_the_limits_are_named():
    document = small_profile(2).to_dict()
    document["layers"][1]["backward_ms"] = 2e9
    with pytest.raises(InputError, match=r"layers\[1\] \(block.0\).backward_ms: expected at most 1e\+09 ms"):
        ModelProfile.from_dict(document)
