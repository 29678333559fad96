"""`sapp-hook validate` on a device mesh: 4 gloo processes, pipeline x data or tensor parallel. Each rank's
allocator peak, autograd's peak, static bytes and FSDP's gathered parameters and whole gradients at the
reduce are predicted to the byte (the rules: tests/test_data_parallel.py); a plan made without FSDP's
terms does not fit its budget in the run, the plan made with them does."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sapp_hook.validation.validate import Setup, profile_for, validate
from simulator.actions import FORWARD
from solver import PipelineSpec, solve

LLAMA = {"model": "tiny-llama", "pipeline_parallel": 2, "schedule": "1F1B", "micro_batches": 4, "steps": 1}
IDS_BYTES = 4 * 128 * 8  # the step's token ids, which the first and last stage hold as data


@pytest.fixture(scope="module")
def llama_profile():
    return profile_for(Setup(**LLAMA, profile_steps=1))


def _exact(report: dict, *, activations: bool = True) -> None:
    for row in report["ranks"]:
        assert row["measured_allocated_peak_bytes"] == row["predicted_peak_bytes"], row["rank"]
        if activations:
            assert row["measured_activation_peak_bytes"] == row["predicted_activation_peak_bytes"], row["rank"]
        assert row["measured_static_bytes"] == row["predicted_static_bytes"], row["rank"]
        assert row["measured_receive_buffer_bytes"] == row["predicted_receive_buffer_bytes"]
        for kind in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            assert row["measured_split"][kind] == row["predicted_split"][kind], (row["rank"], kind)
        assert row["measured_at_reduce"] == row["predicted_at_reduce"]  # gathered parameters, whole gradients


def _all_gathers(row: dict) -> dict[str, int]:
    return {c["layer"]: c["calls"] for c in row["collectives"] if c["name"] == "FSDP::all_gather"}


def test_pipeline_x_fsdp2_is_predicted_to_the_byte(llama_profile):
    """TorchTitan's layout under pipelining (no reshard after forward): every rank holds its chunk's
    whole parameters from the first forward and whole gradients from the first backward to the reduce."""
    report = validate(Setup(**LLAMA, plan="even", data_parallel=2, fsdp=True), profile=llama_profile)
    assert [row["pp_rank"] for row in report["ranks"]] == [0, 0, 1, 1]
    _exact(report)
    for row in report["ranks"]:
        assert row["measured_at_reduce"]  # FSDP's units were unsharded at the reduce
        units = len(row["layers"]) + 1  # the blocks, and the embedding or the final norm with the LM head
        assert len(_all_gathers(row)) == units and set(_all_gathers(row).values()) == {1}  # once a step
        assert {c["layer"] for c in row["collectives"] if c["name"] == "FSDP::post_backward_reduce"} == set(
            _all_gathers(row)
        )


def test_reshard_after_forward_is_predicted_to_the_byte(llama_profile):
    """Each forward re-shards; a backward after a forward gathers again (and keeps it): a unit is
    all-gathered at every action that finds it sharded."""
    report = validate(
        Setup(**LLAMA, plan="even", data_parallel=2, fsdp=True, reshard_after_forward=True), profile=llama_profile
    )
    _exact(report)
    schedule = PipelineSpec(pipeline_parallel=2, micro_batches=4).pipeline_schedule
    for row in report["ranks"]:
        ops = [action.op for action in schedule.rank_actions[row["pp_rank"]]]
        finds_sharded = 1 + sum(previous == FORWARD for previous in ops[:-1])  # the first action, any after a forward
        assert set(_all_gathers(row).values()) == {finds_sharded}


def test_every_block_recomputed_under_fsdp_the_reduce_frees_unit_by_unit(llama_profile):
    """With the activations small, the chunk's reduce comes near the peak: torch reduces unit by unit in
    model order, each freeing its parameters and gradients before the next, with the last logits held."""
    setup = Setup(**LLAMA, plan="even-full", data_parallel=2, fsdp=True, reshard_after_forward=True)
    report = validate(setup, profile=llama_profile)
    for row in report["ranks"]:
        assert row["measured_activation_peak_bytes"] == row["predicted_activation_peak_bytes"], row["rank"]
        assert row["measured_static_bytes"] == row["predicted_static_bytes"], row["rank"]
        under = row["measured_allocated_peak_bytes"] - row["predicted_peak_bytes"]
        # stage 0: three 4-byte scalars not yet placed (docs/results/nd-validation.md)
        assert under == 0 if row["pp_rank"] == 1 else 0 <= under <= 12, row["rank"]


def test_gpipe_x_fsdp2_makes_the_gradients_layer_by_layer(llama_profile):
    """GPipe's first backward holds every micro-batch's activations, and each layer's whole gradient
    arrives with its own backward: counted from the backward's start, they would over-predict the peak."""
    report = validate(
        Setup(**{**LLAMA, "schedule": "GPipe"}, plan="even", data_parallel=2, fsdp=True), profile=llama_profile
    )
    _exact(report)


def test_pipeline_x_ddp_under_an_interleaved_schedule_runs_and_is_predicted_to_the_byte(llama_profile):
    """Two DDP chunks a rank: the warm-up step runs unsynced, or DDP's first bucket rebuild asserts."""
    setup = Setup(**{**LLAMA, "schedule": "Interleaved1F1B"}, plan="even", data_parallel=2, ddp=True)
    report = validate(setup, profile=llama_profile)
    assert report["chunks"] == 2
    _exact(report)


def _unsharded(profile, data_parallel: int):
    """The profile as the spec's ZeRO-3 division alone plans it: every layer's bytes / data_parallel."""
    return dataclasses.replace(
        profile,
        layers=tuple(
            dataclasses.replace(
                layer,
                parameter_bytes=layer.parameter_bytes / data_parallel,
                gradient_bytes=layer.gradient_bytes / data_parallel,
                optimizer_bytes=layer.optimizer_bytes / data_parallel,
                replicated_parameter_bytes=_divided(layer.replicated_parameter_bytes, data_parallel),
                replicated_gradient_bytes=_divided(layer.replicated_gradient_bytes, data_parallel),
            )
            for layer in profile.layers
        ),
    )


def _divided(value: float | None, by: int) -> float | None:
    return None if value is None else value / by


def _held_at_peak(row: dict) -> float:
    """A rank's most bytes during the measured step: its static shards, receive buffers and token ids, and
    the allocator's peak above them."""
    return (
        row["measured_static_bytes"]
        + row["measured_receive_buffer_bytes"]
        + IDS_BYTES
        + row["measured_allocated_peak_bytes"]
    )


def test_the_plan_made_without_fsdps_terms_does_not_fit_and_the_plan_made_with_them_does(llama_profile, tmp_path):
    budget = 100e6
    blind = solve(
        _unsharded(llama_profile, 2),
        PipelineSpec(
            pipeline_parallel=2, micro_batches=4, schedule="1F1B", receive_buffers=True, memory_budget_bytes=budget
        ),
    )
    assert max(blind.rank_peak_memory_bytes) <= budget  # fits on paper
    plan_file = tmp_path / "blind.json"
    plan_file.write_text(json.dumps(blind.to_dict()))
    fsdp = {**LLAMA, "data_parallel": 2, "fsdp": True, "memory_budget_bytes": budget}
    ran = validate(Setup(**fsdp, plan=str(plan_file)), profile=llama_profile)
    assert max(_held_at_peak(row) for row in ran["ranks"]) > budget  # not in the run
    assert (
        max(row["predicted_static_bytes"] + row["predicted_peak_bytes"] for row in ran["ranks"]) > budget
    )  # as predicted
    planned = validate(Setup(**fsdp, plan="solve"), profile=llama_profile)
    assert planned["stage_layer_counts"] != list(blind.stage_layer_counts) or planned["layer_modes"] != list(
        blind.layer_modes
    )
    # FSDP's terms are exact (test above); the plan's recompute mixes modes in a stage, where the 1-D model
    # itself is a few saved tensors off (on its own as under FSDP: 492,416 bytes over on tiny-llama's first stage)
    for row in planned["ranks"]:
        assert row["allocated_error"] <= 0.03 and row["measured_static_bytes"] == row["predicted_static_bytes"]
        assert row["measured_at_reduce"] == row["predicted_at_reduce"]
    assert max(_held_at_peak(row) for row in planned["ranks"]) <= budget


def test_pipeline_x_zero1_under_a_v_schedule_is_predicted(tmp_path):
    """tiny-moe under ZBVZeroBubble (2 chunks a rank), gradients all-reduced after the step and AdamW's
    state split by torch's ZeroRedundancyOptimizer: by whole tensors, so a rank's share is the mean but
    for the 4-byte step counts of the tensors it holds more or fewer of."""
    report = validate(
        Setup(
            model="tiny-moe",
            pipeline_parallel=2,
            schedule="ZBVZeroBubble",
            micro_batches=4,
            steps=1,
            plan="even",
            data_parallel=2,
            zero_stage=1,
            profile_steps=1,
        )
    )
    for row in report["ranks"]:
        assert row["measured_allocated_peak_bytes"] == row["predicted_peak_bytes"]
        assert row["measured_activation_peak_bytes"] == row["predicted_activation_peak_bytes"]
        assert row["measured_step_end_bytes"] == row["predicted_step_end_bytes"]
        assert abs(row["measured_static_bytes"] - row["predicted_static_bytes"]) <= 4
    replicas = [row["measured_static_bytes"] for row in report["ranks"][:2]]
    assert sum(replicas) / 2 == report["ranks"][0]["predicted_static_bytes"]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pipeline_x_tensor_parallel_is_predicted(llama_profile, sequence_parallel):
    """TorchTitan's Llama plan on 2 tensor-parallel ranks per stage, the 1-D profile turned into one
    rank's (`solver.parallel.model_parallel.rank_profile`): what autograd holds and the static shards to the byte; the
    allocator's peak within 1.5% (a collective's output, one hidden state, at the peak on either side)."""
    report = validate(
        Setup(**LLAMA, plan="even", tensor_parallel=2, sequence_parallel=sequence_parallel), profile=llama_profile
    )
    assert [(row["pp_rank"], row["tp_rank"]) for row in report["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    hidden = 128 * 256 * 4  # one micro-batch's hidden state
    for row in report["ranks"]:
        assert row["measured_activation_peak_bytes"] == row["predicted_activation_peak_bytes"], row["rank"]
        assert row["measured_static_bytes"] == row["predicted_static_bytes"], row["rank"]
        assert row["measured_receive_buffer_bytes"] == row["predicted_receive_buffer_bytes"]
        over = row["predicted_peak_bytes"] - row["measured_allocated_peak_bytes"]
        assert -hidden <= over <= 7 * hidden, row["rank"]
        assert row["allocated_error"] <= 0.015
    # the static shards: the split weights / 2, the norms whole, the embedding's gradient whole
    assert [row["measured_static_bytes"] for row in report["ranks"]] == [44_204_180] * 2 + [40_013_976] * 2
    assert report["losses"] and all(len(step) == 4 for step in report["losses"])


def test_zero_bubble_v_x_tensor_parallel_is_predicted_from_a_profile_measured_on_the_mesh():
    """Under a schedule that splits the backward, what the input-gradient half leaves for the weight-gradient
    half keeps some gradients whole on each tensor-parallel rank: `validate` measures the split on the
    mesh. What autograd holds and the static shards are then exact, and the allocator's peak mostly
    too: from run to run gloo frees a collective's output late in the run (one hidden state under) or in
    the split's measurement (one over per micro-batch pending at the peak, 6 here). The one-process
    profile's fields divided by t put the middle rank 10.7 hidden states under."""
    setup = Setup(**{**LLAMA, "schedule": "ZBVZeroBubble"}, plan="even", tensor_parallel=2, profile_steps=1)
    profile = profile_for(setup)
    assert profile.mesh.tensor_parallel == 2  # measured on the mesh
    report = validate(setup, profile=profile)
    hidden = 128 * 256 * 4  # one micro-batch's hidden state
    for row in report["ranks"]:
        assert row["measured_activation_peak_bytes"] == row["predicted_activation_peak_bytes"], row["rank"]
        assert row["measured_static_bytes"] == row["predicted_static_bytes"], row["rank"]
        over = row["predicted_peak_bytes"] - row["measured_allocated_peak_bytes"]
        assert -hidden <= over <= 7 * hidden, row["rank"]
