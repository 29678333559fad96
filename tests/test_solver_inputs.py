"""Profiles, SAPP layer files, specs and plans: read faithfully, refused clearly when wrong."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
from solver_cases import MIB, SAPP, small_profile

from simulator import InputError
from solver import ModelProfile, PipelineSpec, evaluate_plan, load_profile, plan_from_dict, plan_from_mindformers, solve
from solver.formats.sapp import profile_from_sapp


def test_profile_json_round_trip(tmp_path):
    profile = small_profile(4, two_kinds=True)
    # a split backward's halves measured on one layer: written where given, absent (None) elsewhere
    halves = dataclasses.replace(
        profile.layers[1].recompute["none"],
        input_working_bytes=3.0 * MIB,
        weight_working_bytes=0.0,
        input_held_bytes=2.5 * MIB,
        output_gradient_freed_bytes=MIB,
        saved_input_bytes=MIB,
        weight_freed_bytes=1.5 * MIB,
    )
    profile = dataclasses.replace(
        profile,
        stage_shared_bytes=MIB / 4,
        checkpoint_state_bytes=5056.0,
        model_output_bytes=MIB,
        loss_bytes=4.0,
        layers=(
            profile.layers[0],
            dataclasses.replace(profile.layers[1], recompute={**profile.layers[1].recompute, "none": halves}),
            *profile.layers[2:],
        ),
    )
    path = tmp_path / "profile.json"
    profile.save(path)
    assert load_profile(path) == profile
    written = json.loads(path.read_text())["layers"]
    assert written[1]["recompute"]["none"]["weight_working_bytes"] == 0.0
    assert "input_working_bytes" not in written[2]["recompute"]["none"]
    assert "input_held_bytes" not in written[2]["recompute"]["none"]
    assert "output_gradient_freed_bytes" not in written[2]["recompute"]["none"]  # 0: nothing to say
    assert "saved_input_bytes" not in written[2]["recompute"]["none"]
    assert "weight_freed_bytes" not in written[2]["recompute"]["none"]  # None: its pending bytes


def test_a_profile_limited_to_some_recompute_modes():
    profile = small_profile(4)  # body layers: none, selective, full; head and tail: none
    limited = profile.with_modes(["full"])
    assert [tuple(layer.recompute) for layer in limited.layers] == [("none",), *[("none", "full")] * 4, ("none",)]
    assert limited.layers[1].recompute["full"] == profile.layers[1].recompute["full"]
    assert profile.with_modes([]).modes == ("none",)
    with pytest.raises(
        InputError, match="modes: expected modes among none, selective, comm, selective\\+comm, full, got fast"
    ):
        profile.with_modes(["full", "fast"])


def test_a_profile_with_its_times_scaled_keeps_every_size():
    profile = small_profile(4)
    body = profile.layers[1]
    retained = dataclasses.replace(body.recompute["none"], retained_bytes=body.recompute["none"].activation_bytes / 2)
    profile = dataclasses.replace(
        profile,
        stage_shared_bytes=MIB / 4,
        layers=(
            profile.layers[0],
            dataclasses.replace(body, recompute={**body.recompute, "none": retained}),
            *profile.layers[2:],
        ),
    )
    scaled = profile.with_times_scaled(4.0)
    for before, after in zip(profile.layers, scaled.layers):
        assert (after.forward_ms, after.backward_ms) == (4 * before.forward_ms, 4 * before.backward_ms)
        for mode, cost in before.recompute.items():  # calibrating dropped retained_bytes once
            assert after.recompute[mode] == dataclasses.replace(cost, extra_ms=4 * cost.extra_ms)
        assert dataclasses.replace(
            after, forward_ms=0, backward_ms=0, weight_ms=None, recompute={}
        ) == dataclasses.replace(before, forward_ms=0, backward_ms=0, weight_ms=None, recompute={})


def test_sapp_semantics():
    profile = load_profile(SAPP / "sim.json")
    heads = [layer for layer in profile.layers if layer.kind == "head"]
    body = [layer for layer in profile.layers if layer.is_body]
    tails = [layer for layer in profile.layers if layer.kind == "tail"]
    assert (len(heads), len(body), len(tails)) == (1, 192, 1)
    block = body[0]
    assert block.kind == "body:LLamaDecodeLayer"
    assert block.forward_ms == 180 and block.backward_ms == 360  # 2 x time x (1 + backward_coef 0)
    assert block.parameter_bytes == 1583 * MIB
    expected = {  # extra = 2 x time x coef; activation in MiB
        "none": (0, 826),
        "selective": (45, 614),
        "comm": (45, 426),
        "selective+comm": (59.4, 310),
        "full": (180, 32),
    }
    assert {m: (round(c.extra_ms, 6), c.activation_bytes / MIB) for m, c in block.recompute.items()} == expected
    assert heads[0].forward_ms == 30 and heads[0].backward_ms == 60 and heads[0].parameter_bytes == 11000 * MIB
    assert tails[0].forward_ms == 90 and tails[0].backward_ms == 180 and tails[0].parameter_bytes == 2473 * MIB
    assert load_profile(SAPP / "seq.json").rank_constant_bytes == 3422 * MIB


def test_sapp_defaults_and_explicit_times():
    data = json.loads((SAPP / "layers_template.json").read_text())
    body = data["layers_description"][1]
    body.update(time=10, memory_activation=100, memory_select_rec=60, memory_recompute=5, nb_layer=2)
    body["recompute_time "] = 40  # SAPP's own key has a trailing space (its bug B6); read it anyway
    profile = profile_from_sapp(data)
    block = profile.layers[1]
    assert block.recompute["selective"].extra_ms == pytest.approx(20 * 0.04)  # SAPP's default coefficient
    assert block.recompute["full"].extra_ms == pytest.approx(40 - 20)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d["layers_description"][1].update(memory_activation=0), "memory_activation"),
        (lambda d: d["layers_description"][1].update(memory_activation=-45), "memory_activation"),
        (lambda d: d["layers_description"][1].update(memory_recompute=900), "full.activation_bytes"),
        (lambda d: d["layers_description"][1].update(type="NECK"), "type"),
        (lambda d: d["layers_description"][1].update(colour="red"), "colour"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["layers_description"][1].update(time=-1), "time"),
        (lambda d: d["layers_description"][1].update(nb_layer=0), "nb_layer"),
        (lambda d: d["layers_description"][1].update(nb_layer=10**12), "nb_layer: expected at most 100,000"),
    ],
)
def test_bad_sapp_files_are_refused(change, field):
    data = json.loads((SAPP / "test.json").read_text())
    change(data)
    with pytest.raises(InputError) as caught:
        profile_from_sapp(data)
    assert field in str(caught.value)


def profile_dict():
    return small_profile(2).to_dict()


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d.update(schema_version=2), "schema_version: expected 1"),
        (lambda d: d.update(surprise=True), "surprise: unknown key"),
        (lambda d: d["layers"][1].update(parameter_bytes=-1), "layers[1].parameter_bytes"),
        (lambda d: d["layers"][1]["recompute"]["full"].update(activation_bytes=10**12), "keeps more"),
        (lambda d: d["layers"][1]["recompute"].pop("none"), 'the mode "none"'),
        (
            lambda d: d["layers"][1]["recompute"]["full"].update(retained_bytes=10**12),
            "retained_bytes: expected at most activation_bytes",
        ),
        (lambda d: d["layers"][1]["recompute"].update(magic={"extra_ms": 0, "activation_bytes": 0}), "unknown mode"),
        (lambda d: d["layers"][1].update(kind="decoder"), "expected head, tail or body:<type>"),
        (lambda d: d["layers"].reverse(), "must come before"),
        (lambda d: d["layers"][1].update(weight_ms=99), "weight_ms: expected at most backward_ms"),
        (lambda d: d["layers"][1].update(input_ms=-1), "layers[1].input_ms: expected a finite number >= 0"),
        (lambda d: d["layers"][1].update(forward_ms="fast"), "forward_ms: expected a finite number"),
        (lambda d: d["layers"][1].update(forward_ms=math.inf), "forward_ms: expected a finite number"),
        (lambda d: d.update(layers=[]), "layers: expected a non-empty list"),
        (lambda d: d["layers"][1].update(backward_ms=2**70), "backward_ms: expected at most 1e.09 ms, got 1.18"),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(working_bytes=2**70),
            "working_bytes: expected at most 2..50 bytes .1 PiB.",
        ),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(weight_working_bytes=-1),
            "layers[1].recompute.none.weight_working_bytes",
        ),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(input_working_bytes="lots"),
            "input_working_bytes: expected a finite number",
        ),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(output_gradient_freed_bytes=-1),
            "layers[1].recompute.none.output_gradient_freed_bytes: expected a finite number >= 0",
        ),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(saved_input_bytes=1e12),
            "layers[1] (block.0).recompute.none.saved_input_bytes: expected at most activation_bytes",
        ),
        (lambda d: d.update(stage_shared_bytes=-1), "stage_shared_bytes: expected a finite number >= 0"),
        (lambda d: d.update(checkpoint_state_bytes=-1), "checkpoint_state_bytes: expected a finite number >= 0"),
        (
            lambda d: d.update(model_output_bytes=8, loss_bytes=12),
            "loss_bytes: expected at most model_output_bytes (8), got 12",
        ),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(pending_bytes=8, input_held_bytes=4),
            "layers[1] (block.0).recompute.none.input_held_bytes: expected at least pending_bytes (8), got 4",
        ),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(pending_bytes=8, weight_freed_bytes=4),
            "layers[1] (block.0).recompute.none.weight_freed_bytes: expected pending_bytes (8) to pending_bytes",
        ),
        (
            lambda d: d["layers"][1]["recompute"]["none"].update(weight_freed_bytes=1e12),
            "weight_freed_bytes: expected pending",
        ),
        (
            lambda d: (
                d["layers"].__setitem__(1, copy.deepcopy(d["layers"][0]))
                or d["layers"].__setitem__(2, copy.deepcopy(d["layers"][0]))
            ),
            "body layer",
        ),
        (
            lambda d: d.update(tied_parameters=[{"names": ["w"], "layers": ["nowhere"], "bytes": 4}]),
            "tied_parameters[0].layers: 'nowhere' is not a layer",
        ),
        (
            lambda d: d.update(tied_parameters=[{"names": "w", "layers": [], "bytes": 4}]),
            "tied_parameters[0].names: expected a list of strings",
        ),
        (
            lambda d: d.update(tied_parameters=[{"names": [], "layers": [], "bytes": -4}]),
            "tied_parameters[0].bytes: expected a finite number",
        ),
    ],
)
def test_bad_profiles_are_refused(change, words):
    data = profile_dict()
    change(data)
    with pytest.raises(InputError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ModelProfile.from_dict(data)


@pytest.mark.parametrize("key", ["size", "sequence"])
@pytest.mark.parametrize("value", [-4, 0, 2**50 + 1, 1.5, True, "4096", None])
def test_every_micro_batch_amount_is_a_positive_integer(key, value):
    data = profile_dict()
    data["micro_batch"] = {"size": 2, "sequence": 4096, key: value}
    with pytest.raises(InputError) as caught:
        ModelProfile.from_dict(data)
    assert str(caught.value) == f"micro_batch.{key}: expected an integer from 1 to 2**50, got {value!r}"
    with pytest.raises(InputError) as built:  # a profile made in Python is held to the same
        dataclasses.replace(small_profile(2), micro_batch={key: value})
    assert str(built.value) == str(caught.value)


@pytest.mark.parametrize(
    "micro_batch, message",
    [
        ({"size": 1, "tokens": 128}, "micro_batch.tokens: unknown key; expected one of sequence, size"),
        ([1, 128], "micro_batch: expected an object, got list"),
    ],
)
def test_a_micro_batch_other_than_size_and_sequence_is_refused(micro_batch, message):
    data = profile_dict()
    data["micro_batch"] = micro_batch
    with pytest.raises(InputError) as caught:
        ModelProfile.from_dict(data)
    assert str(caught.value) == message


@pytest.mark.parametrize("micro_batch", [{}, {"size": 1}, {"size": 2**50, "sequence": 1}])
def test_a_micro_batch_of_positive_integers_is_read(micro_batch):
    data = profile_dict()
    data["micro_batch"] = micro_batch
    assert ModelProfile.from_dict(data).micro_batch == micro_batch


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("forward_ms", 2e9, "layers[1].spread.forward_ms: expected at most 1e+09 ms, got 2000000000.0"),
        ("activation_bytes", 2.0**51, "layers[1].spread.activation_bytes: expected at most 2**50 bytes (1 PiB), got "),
        ("backward_ms", -1, "layers[1].spread.backward_ms: expected a finite number >= 0, got -1"),
    ],
)
def test_a_spread_is_held_to_its_fields_bounds(key, value, message):
    data = profile_dict()
    data["layers"][1]["spread"] = {key: value}
    with pytest.raises(InputError) as caught:
        ModelProfile.from_dict(data)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("content", ["{", "[1, 2", "\xff\xfe", "[" * 100_000 + "]" * 100_000])
def test_broken_json_is_one_clear_error(tmp_path, content):
    path = tmp_path / "profile.json"
    path.write_bytes(content.encode("latin-1") if content.startswith("\xff") else content.encode())
    with pytest.raises(InputError, match="not valid JSON"):
        load_profile(path)


@pytest.mark.parametrize("content", ["[]", "null", '{"layers": []}', '"profile"'])
def test_json_that_is_no_profile_says_what_is_expected(tmp_path, content):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(InputError, match=r"profile: .* expected sapp-hook's profile .* or SAPP's layer JSON"):
        load_profile(path)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        load_profile(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"memory_budget_bytes": -1}, "memory_budget_bytes"),
        ({"data_parallel": 0}, "data_parallel"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"pipeline_parallel": 0}, "pipeline_parallel"),
        ({"schedule": "Wavy"}, "schedule"),
        ({"p2p_ms": math.nan}, "p2p_ms"),
        ({"p2p_ms": 1e308}, "p2p_ms"),  # HiGHS gave up on the program ("Empty")
        ({"action_overhead_ms": 2.0**70}, "action_overhead_ms"),
        ({"rank_constant_bytes": 2.0**70}, "rank_constant_bytes"),
        ({"receive_buffers": "yes"}, "receive_buffers"),
    ],
)
def test_bad_specs(kwargs, field):
    arguments = {"pipeline_parallel": 2, "micro_batches": 4, **kwargs}
    with pytest.raises(InputError) as caught:
        PipelineSpec(**arguments)
    assert caught.value.field == field


@pytest.mark.parametrize("limit", [0, -1.0, math.nan, "10", True, None])
def test_bad_time_limits(limit):
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B")
    with pytest.raises(InputError, match=r"time_limit_s: expected a number of seconds > 0 \(inf: no limit\)"):
        solve(small_profile(4), spec, time_limit_s=limit)


def test_no_time_limit():
    plan = solve(
        small_profile(4), PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B"), time_limit_s=math.inf
    )
    assert plan.status == "optimal"


def test_zero_sharding_divides_static_memory():
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, data_parallel=4, zero_stage=1)
    assert spec.static_bytes(100, 100, 800) == 100 + 100 + 200
    assert (
        PipelineSpec(pipeline_parallel=2, micro_batches=4, data_parallel=4, zero_stage=3).static_bytes(100, 100, 800)
        == 25 + 25 + 200
    )


def test_bad_plans_are_refused():
    profile = small_profile(6)
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4)
    with pytest.raises(InputError, match="sum to 7; the profile has 8"):
        evaluate_plan(profile, spec, [4, 3], ["none"] * 8)
    with pytest.raises(InputError, match="offers none, selective, full; got 'comm'"):
        evaluate_plan(profile, spec, [4, 4], ["none", "comm"] + ["none"] * 6)
    with pytest.raises(InputError, match=r"layer_modes\[1\]: block.0 offers none, selective, full; got \['full'\]"):
        evaluate_plan(profile, spec, [4, 4], ["none", ["full"]] + ["none"] * 6)  # was a TypeError
    with pytest.raises(InputError, match="offset: gives 5 body layers; the profile has 6"):
        plan_from_mindformers(profile, spec, {"offset": [0, -1]})
    with pytest.raises(InputError, match=r"select_recompute\[0\]\[1\]: is 0, below recompute"):
        plan_from_mindformers(profile, spec, {"recompute": [0, 1], "select_recompute": [0, 0]})
    with pytest.raises(InputError, match="pp_interleave_num"):
        plan_from_mindformers(profile, spec, {"offset": 0, "pp_interleave_num": 2})
    with pytest.raises(InputError, match="asks for comm recompute"):
        plan_from_mindformers(profile, spec, {"select_comm_recompute": [1, 0]})
    with pytest.raises(InputError, match="unknown key"):
        plan_from_mindformers(profile, spec, {"offsets": [0, 0]})


def test_mindformers_true_means_every_layer_of_the_stage():
    profile = small_profile(6)
    plan = plan_from_mindformers(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4), {"recompute": True})
    assert plan.layer_modes == ("none",) + ("full",) * 6 + ("none",)


def test_mindformers_lists_per_stage_with_chunks_read_as_mindformers_does():
    """MindFormers' LayerSetting with chunks: offsets per stage hold for every chunk; a recompute count per stage is
    handed out over the stage's chunks one layer at a time (_alloc_recompute_layer), capped at the layers held; a
    bool in such a list is all or none of the stage's layers."""
    profile = small_profile(12)
    spec = PipelineSpec(pipeline_parallel=2, chunks=2, micro_batches=4, schedule="Interleaved1F1B")
    plan = plan_from_mindformers(profile, spec, {"offset": [-1, 1], "recompute": [3, True], "pp_interleave_num": 2})
    # virtual stages in model order: chunk 0 of ranks 0, 1, then chunk 1; 2 + 4 + 2 + 4 body layers
    assert plan.stage_layer_counts == (3, 4, 2, 5)
    modes = plan.layer_modes[1:-1]
    assert modes == ("full", "full", "full", "full", "full", "full", "full", "none", "full", "full", "full", "full")
    capped = plan_from_mindformers(profile, spec, {"recompute": [[9, 0], [0, 1]], "pp_interleave_num": 2})
    assert capped.layer_modes[1:-1] == ("full",) * 3 + ("none",) * 6 + ("full", "none", "none")


@pytest.mark.parametrize("receive_buffers", [False, True])
def test_plan_json_round_trip(receive_buffers):
    profile = dataclasses.replace(small_profile(6), stage_output_bytes=2 * MIB)
    plan = solve(
        profile,
        PipelineSpec(
            pipeline_parallel=2,
            chunks=2,
            micro_batches=4,
            schedule="Interleaved1F1B",
            memory_budget_bytes=450 * MIB,
            receive_buffers=receive_buffers,
        ),
    )
    again = plan_from_dict(profile, json.loads(json.dumps(plan.to_dict())))
    assert (again.stage_layer_counts, again.layer_modes, again.iteration_time_ms) == (
        plan.stage_layer_counts,
        plan.layer_modes,
        plan.iteration_time_ms,
    )
    assert again.spec == plan.spec
    with pytest.raises(InputError, match=r"spec.receive_buffers: expected true or false, got 1"):
        plan_from_dict(profile, {**plan.to_dict(), "spec": {**plan.to_dict()["spec"], "receive_buffers": 1}})
    damaged = plan.to_dict()
    damaged["plan"]["virtual_stage_layers"] = [-1, *damaged["plan"]["virtual_stage_layers"][1:]]
    with pytest.raises(InputError, match=r"^plan\.virtual_stage_layers: expected integers >= 0, got \[-1, "):
        plan_from_dict(profile, damaged)  # the file's key, not the Python API's stage_layer_counts
