"""`solver.parallel.model_parallel`: one rank of a tensor-, sequence-, context- and expert-parallel job, from a profile.

The tensor-parallel numbers below were measured on real runs: tiny-llama (8 blocks, h 256, 1 x 128 tokens,
fp32), PP2 x TP2 on 4 gloo processes of torch 2.13 CPU, Schedule1F1B, 4 micro-batches, split [5, 5], the
TorchTitan plan under DTensor (`sapp-hook validate --model tiny-llama --pipeline-parallel 2 --micro-batches 4 --even
--tensor-parallel 2 [--sequence-parallel]`; docs/results/nd-validation.md has the per-rank figures). The profile they are planned from is sapp-hook's own, measured
on one process (`tests/fixtures/nd/tiny-llama.profile.json`: `sapp_hook.validation.validate.profile_for` of that setup).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from profiler.estimate.analytic import analytic_profile, shape_from_config
from sapp_hook.validation.validate import predictions
from simulator import InputError
from solver import PipelineSpec, evaluate_plan, load_profile, solve
from solver.parallel.model_parallel import (
    expert_replicas,
    profile_for_mesh,
    rank_profile,
    token_copies_ratio,
)
from solver.parallel.sharding import layer_static
from solver.vocabulary.profile import FULL, NONE
from solver.vocabulary.profile_parts import Mesh

PROFILE = Path(__file__).parent / "fixtures" / "nd" / "tiny-llama.profile.json"
T, H, P = 128, 256, 4  # tokens per micro-batch, hidden size, fp32
NORM = T * (4 * H + 4 + 2 * P * H)  # what an RMSNorm keeps
NORM_OUTPUT = T * H * P
STATE = 5056  # the CPU generator's state a checkpoint keeps

# per rank (pipeline stage 0, stage 1; TP rank 0, equal on TP rank 1): the peak of what autograd holds
# (`held_peak_bytes`), the allocator's peak above the step's floor, and the static bytes (floor + the norms'
# weights, made before the trace - token ids - receive buffers)
MEASURED = {
    ("no SP", NONE): ((13_590_528, 15_708_160, 44_204_180), (11_384_332, 23_966_228, 40_013_976)),
    ("SP", NONE): ((11_489_280, 14_460_928, 44_204_180), (10_202_380, 22_784_276, 40_013_976)),
    ("no SP", FULL): ((1_048_576, 9_490_176, 44_204_180), (5_113_356, 17_748_244, 40_013_976)),
    ("SP", FULL): ((524_288, 9_031_424, 44_728_468), (4_719_884, 17_354_772, 40_276_120)),
}
RECEIVE_BUFFERS = {"no SP": 524_288, "SP": 262_144}  # measured: `final.recv_buffer`


@pytest.fixture(scope="module")
def measured_profile():
    return load_profile(PROFILE)


def tp_spec(sp: bool, **more: object) -> PipelineSpec:
    return PipelineSpec(
        pipeline_parallel=2,
        micro_batches=4,
        schedule="1F1B",
        receive_buffers=True,
        tensor_parallel=2,
        sequence_parallel=sp,
        **more,
    )


@pytest.mark.parametrize(("layout", "mode"), list(MEASURED))
def test_tensor_parallel_ranks_hold_what_the_pp2_tp2_runs_measured(measured_profile, layout, mode):
    sp = layout == "SP"
    spec = tp_spec(sp)
    modes = [mode if layer.is_body else NONE for layer in measured_profile.layers]
    plan = evaluate_plan(measured_profile, spec, [5, 5], modes)
    predicted = predictions(plan, measured_profile, input_bytes=T * 8)  # for one rank of the plan's mesh
    for stage, (held, peak, static) in enumerate(MEASURED[layout, mode]):
        assert predicted["activation_peak_bytes"][stage] == held  # exact in all 8 rank-configs
        assert predicted["receive_buffer_bytes"][stage] == RECEIVE_BUFFERS[layout]
        rule_static = (44_204_180, 40_013_976)[stage]
        assert predicted["static_bytes"][stage] - predicted["receive_buffer_bytes"][stage] == rule_static
        if (layout, mode) != ("SP", FULL):
            assert rule_static == static
        else:  # gloo reduce-scatter temporaries freed on its worker thread, out of the trace's sight
            assert 0 < static - rule_static < 0.013 * static
        # the allocator: the LM head's and the SP all-gathers' working sets under TP are not refined
        assert abs(predicted["peak_bytes"][stage] - peak) <= 0.008 * peak


def test_a_block_keeps_what_tensor_parallelism_leaves_whole_plus_the_split_part_over_t(measured_profile):
    # per block and micro-batch (hooks on each block of the runs above): 1,690,624 without SP,
    # 1,427,968 with it; fully recomputed, the block input whole (131,072) or / t (65,536)
    block = measured_profile.layers[1]
    kept = block.recompute[NONE].activation_bytes
    assert block.recompute[NONE].tp_whole_activation_bytes == 2 * NORM  # the two norms, with their outputs
    assert block.recompute[NONE].sp_whole_activation_bytes == 2 * NORM_OUTPUT  # their gathered outputs
    assert block.recompute[FULL].tp_whole_activation_bytes == T * H * P + STATE
    assert block.recompute[FULL].sp_whole_activation_bytes == STATE
    for sp, none, full in ((False, 1_690_624, 131_072), (True, 1_427_968, 65_536)):
        rank = rank_profile(measured_profile, tp_spec(sp)).layers[1]
        assert (
            rank.recompute[NONE].activation_bytes
            == none
            == (kept - (2 * NORM_OUTPUT if sp else 2 * NORM)) / 2 + (2 * NORM_OUTPUT if sp else 2 * NORM)
        )
        assert rank.recompute[FULL].activation_bytes - STATE == full


def test_static_bytes_split_the_weights_not_the_norms_nor_the_embeddings_gradient(measured_profile):
    rank = rank_profile(measured_profile, tp_spec(False))
    head, block, tail = rank.layers[0], rank.layers[1], rank.layers[-1]
    vocab = 8192 * H * P
    assert (head.parameter_bytes, head.gradient_bytes, head.optimizer_bytes) == (vocab / 2, vocab, vocab + 4)
    norms = 2 * H * P
    split = (measured_profile.layers[1].parameter_bytes - norms) / 2 + norms
    assert (block.parameter_bytes, block.gradient_bytes, block.optimizer_bytes) == (split, split, 2 * split + 4 * 9)
    assert tail.parameter_bytes == vocab / 2 + H * P
    # measured `final` of the runs: stage 0's local parameters, gradients and AdamW state
    assert head.parameter_bytes + 4 * block.parameter_bytes == 10_002_432
    assert head.gradient_bytes + 4 * block.gradient_bytes == 14_196_736
    assert head.optimizer_bytes + 4 * block.optimizer_bytes == 20_005_012


def test_what_stages_pass_is_split_only_under_sequence_parallel(measured_profile):
    whole = measured_profile.stage_output_bytes
    assert rank_profile(measured_profile, tp_spec(False)).stage_output_bytes == whole
    assert rank_profile(measured_profile, tp_spec(True)).stage_output_bytes == whole / 2
    # the logits stay whole (the LM head gathers them: no loss parallel); so do the rotary tables
    rank = rank_profile(measured_profile, tp_spec(True))
    assert rank.model_output_bytes == measured_profile.model_output_bytes
    assert rank.stage_shared_bytes == measured_profile.stage_shared_bytes
    # a stage's first block keeps its input, which is then the received sequence shard
    for sp, divisor in ((False, 1), (True, 2)):
        block = rank_profile(measured_profile, tp_spec(sp)).layers[1]
        for mode, cost in measured_profile.layers[1].recompute.items():
            assert block.recompute[mode].saved_input_bytes == cost.saved_input_bytes / divisor, (sp, mode)


def test_backward_working_sets_split_in_blocks_and_stay_whole_in_the_head_and_tail(measured_profile):
    rank = rank_profile(measured_profile, tp_spec(False))
    one_d = measured_profile.layers
    assert rank.layers[0].recompute[NONE].working_bytes == one_d[0].recompute[NONE].working_bytes  # the whole gradient
    assert rank.layers[-1].recompute[NONE].working_bytes == one_d[-1].recompute[NONE].working_bytes
    assert rank.layers[1].recompute[NONE].working_bytes == one_d[1].recompute[NONE].working_bytes / 2
    # a full recompute rebuilds what the rank keeps without recompute
    none, full = one_d[1].recompute[NONE], one_d[1].recompute[FULL]
    gradients = full.working_bytes - (none.activation_bytes - full.activation_bytes)
    rebuilt = rank.layers[1].recompute[NONE].activation_bytes - rank.layers[1].recompute[FULL].activation_bytes
    assert rank.layers[1].recompute[FULL].working_bytes == gradients / 2 + rebuilt
    assert rank.layers[1].forward_ms == one_d[1].forward_ms / 2
    # a split backward's held gradients (not measured under DTensor: zero-bubble schedules were not run) / t
    # in blocks, whole in the tail
    for name in (
        "pending_bytes",
        "input_held_bytes",
        "input_working_bytes",
        "weight_working_bytes",
        "weight_freed_bytes",
    ):
        assert getattr(rank.layers[1].recompute[NONE], name) == getattr(one_d[1].recompute[NONE], name) / 2, name
        assert getattr(rank.layers[-1].recompute[NONE], name) == getattr(one_d[-1].recompute[NONE], name), name


def test_the_transform_applies_once(measured_profile):
    spec = tp_spec(True)
    rank = rank_profile(measured_profile, spec)
    assert rank.mesh == Mesh(tensor_parallel=2, sequence_parallel=True)
    assert rank_profile(rank, spec) is rank
    assert (
        evaluate_plan(rank, spec, [5, 5], ["none"] * 10).rank_peak_memory_bytes
        == evaluate_plan(measured_profile, spec, [5, 5], ["none"] * 10).rank_peak_memory_bytes
    )


@pytest.mark.parametrize(
    ("degree", "field", "words"),
    [
        (4, "tensor_parallel", "per rank of tensor_parallel 2 already"),
        (1, "tensor_parallel", "per rank of tensor_parallel 2 already"),
    ],
)
def test_a_spec_that_would_divide_twice_is_refused(measured_profile, degree, field, words):
    rank = rank_profile(measured_profile, tp_spec(False))
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B", tensor_parallel=degree)
    with pytest.raises(InputError, match=words) as caught:
        evaluate_plan(rank, spec, [5, 5], ["none"] * 10)
    assert caught.value.field == field


def test_a_different_sequence_parallel_setting_is_refused(measured_profile):
    with pytest.raises(InputError, match="without sequence parallel") as caught:
        rank_profile(rank_profile(measured_profile, tp_spec(False)), tp_spec(True))
    assert caught.value.field == "sequence_parallel"


@pytest.mark.parametrize(
    ("dimensions", "words"),
    [
        ({"heads": 9}, "a divisor of the model's heads \\(9\\)"),
        ({"kv_heads": 3}, "a divisor of the model's kv_heads \\(3\\)"),
        ({"ffn": 687}, "a divisor of the model's ffn \\(687\\)"),
        ({"vocab": 8191}, "a divisor of the model's vocab \\(8191\\)"),
    ],
)
def test_a_degree_that_does_not_divide_the_model_is_refused(measured_profile, dimensions, words):
    profile = dataclasses.replace(measured_profile, dimensions={**measured_profile.dimensions, **dimensions})
    with pytest.raises(InputError, match=words) as caught:
        rank_profile(profile, tp_spec(False))
    assert caught.value.field == "tensor_parallel"


def test_a_profile_without_the_parts_names_what_is_missing(measured_profile):
    old = measured_profile.layers[1]
    bare = dataclasses.replace(
        old, recompute={m: dataclasses.replace(c, tp_whole_activation_bytes=None) for m, c in old.recompute.items()}
    )
    profile = dataclasses.replace(
        measured_profile, layers=(measured_profile.layers[0], bare, *measured_profile.layers[2:])
    )
    with pytest.raises(InputError, match="not in the profile; tensor_parallel needs it") as caught:
        rank_profile(profile, tp_spec(False))
    assert caught.value.field == "layers[1] (model.layers.0).recompute.none.tp_whole_activation_bytes"
    with pytest.raises(InputError, match="tensor_parallel needs the model's sizes") as caught:
        rank_profile(dataclasses.replace(measured_profile, dimensions={}), tp_spec(False))
    assert caught.value.field == "dimensions.heads"


def test_context_parallel_divides_the_sequence_and_adds_a_remote_key_value_chunk(measured_profile):
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B", context_parallel=2)
    rank = rank_profile(measured_profile, spec)
    one_d, block = measured_profile.layers[1], rank.layers[1]
    kv = 2 * T * 4 * 32 * P / 2  # keys and values of a rank's half of the sequence (4 KV heads of 32)
    assert block.recompute[NONE].activation_bytes == one_d.recompute[NONE].activation_bytes / 2
    assert block.recompute[NONE].working_bytes == one_d.recompute[NONE].working_bytes / 2 + 2 * kv
    assert rank.layers[0].recompute[NONE].working_bytes == measured_profile.layers[0].recompute[NONE].working_bytes / 2
    assert rank.stage_output_bytes == measured_profile.stage_output_bytes / 2
    assert rank.stage_shared_bytes == measured_profile.stage_shared_bytes / 2
    assert rank.model_output_bytes == (measured_profile.model_output_bytes - 4) / 2 + 4
    assert block.parameter_bytes == one_d.parameter_bytes and block.forward_ms == one_d.forward_ms / 2
    short = dataclasses.replace(measured_profile, micro_batch={"size": 1, "sequence": 126})
    with pytest.raises(InputError, match="a multiple of 2 x 2") as caught:
        rank_profile(short, spec)
    assert caught.value.field == "context_parallel"


MOE = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
}


def moe_profile():
    return analytic_profile(shape_from_config(MOE, sequence=32, micro_batch_size=2, dtype="float32"))


def ep_spec(expert_tokens: str = "balanced", **more: object) -> PipelineSpec:
    return PipelineSpec(
        pipeline_parallel=2,
        micro_batches=4,
        schedule="1F1B",
        data_parallel=8,
        expert_parallel=8,
        expert_tokens=expert_tokens,
        **more,
    )


@pytest.mark.parametrize(
    ("tokens", "ratio"), [("balanced", 1.0), ("dropless", 4.0), ("capacity:1.25", 1.25), ("capacity:9", 4.0)]
)
def test_expert_ranks_receive_token_copies_up_to_the_dropless_bound(tokens, ratio):
    # 8 experts, top-2, one expert per rank: from each of 8 ranks each token at most once
    assert token_copies_ratio(tokens, 8, 2, 8) == ratio
    assert token_copies_ratio("dropless", 8, 2, 2) == 2 * min(2, 4) / 2  # two ranks of 4 experts: each token twice
    assert token_copies_ratio("dropless", 8, 2, 1) == 1.0


@pytest.mark.parametrize("tokens", ["balanced", "dropless", "capacity:1.5"])
def test_expert_parallel_splits_the_experts_and_scales_what_they_keep(tokens):
    one_d = moe_profile()
    rank = rank_profile(one_d, ep_spec(tokens))
    ratio = token_copies_ratio(tokens, 8, 2, 8)
    routed = 2 * 32 * 2 * 64 * 4  # a rank's tokens x 2 experts each x hidden x fp32: one all-to-all's
    for layer, was in zip(rank.layers[1:-1], one_d.layers[1:-1]):
        experts = was.expert_parameter_bytes
        assert layer.parameter_bytes == was.parameter_bytes - experts + experts / 8
        assert layer.expert_parameter_bytes == experts / 8
        for mode, cost in layer.recompute.items():
            before = was.recompute[mode]
            kept = before.expert_activation_bytes
            assert cost.activation_bytes == before.activation_bytes + (ratio - 1) * kept
            rebuilt = was.recompute[NONE].expert_activation_bytes - kept + before.expert_working_bytes
            assert cost.working_bytes == before.working_bytes + (ratio - 1) * rebuilt + (1 + ratio) * routed
        assert layer.forward_ms == was.forward_ms
    assert rank.layers[0] == one_d.layers[0] and rank.layers[-1] == one_d.layers[-1]


def test_routed_experts_shard_their_state_over_the_ranks_holding_them():
    spec = ep_spec(zero_stage=1)
    layer = rank_profile(moe_profile(), spec).layers[1]
    assert expert_replicas(spec) == 1  # 8 data-parallel ranks, each holding one expert of 8
    experts = layer.expert_parameter_bytes
    per_element = layer.optimizer_bytes - layer.optimizer_tensor_bytes()
    share = experts / layer.parameter_bytes
    expected = (
        layer.parameter_bytes
        + layer.gradient_bytes
        + per_element * (1 - share) / 8
        + layer.optimizer_tensor_bytes() / 8
        + per_element * share
    )
    assert layer_static(spec, layer).total == pytest.approx(expected, rel=1e-12)
    dense = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B", data_parallel=8, zero_stage=1)
    assert layer_static(dense, layer).total == dense.static_bytes(
        layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes
    )


def test_expert_parallel_is_refused_where_it_does_not_fit():
    with pytest.raises(InputError, match="no routed experts") as caught:
        rank_profile(load_profile(PROFILE), ep_spec())
    assert caught.value.field == "expert_parallel"
    with pytest.raises(InputError, match="a divisor of the model's experts \\(8\\)"):
        rank_profile(
            moe_profile(),
            PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B", data_parallel=3, expert_parallel=3),
        )
    with pytest.raises(InputError, match="carved from those") as caught:
        PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B", expert_parallel=8)
    assert caught.value.field == "expert_parallel"


def test_a_profile_estimated_for_the_mesh_plans_as_the_one_d_profile_transformed():
    config = {**MOE, "model_type": "llama"}
    one_d = analytic_profile(shape_from_config(config, sequence=32, dtype="float32"))
    estimated = analytic_profile(
        shape_from_config(
            config, sequence=32, dtype="float32", tensor_parallel=2, sequence_parallel=True, context_parallel=2
        )
    )
    mesh = Mesh(tensor_parallel=2, sequence_parallel=True, context_parallel=2)
    assert estimated == profile_for_mesh(one_d, mesh)
    spec = PipelineSpec(
        pipeline_parallel=2,
        micro_batches=4,
        schedule="1F1B",
        tensor_parallel=2,
        sequence_parallel=True,
        context_parallel=2,
    )
    assert solve(one_d, spec).rank_peak_memory_bytes == solve(estimated, spec).rank_peak_memory_bytes
