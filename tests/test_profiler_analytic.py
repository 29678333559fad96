"""`profiler.estimate.analytic` against the measured profile of the same transformers models."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from profiler_cases import (
    BATCH,
    LLAMA,
    MIXTRAL,
    MOE,
    QWEN3,
    QWEN3_MOE,
    SEQ,
    llama,
    mixtral,
    moe,
    profiled,
    qwen3,
    qwen3_moe,
)

from profiler.estimate.analytic import DTYPE_BYTES, TransformerShape, analytic_profile, shape_from_config
from simulator import InputError
from solver import PipelineSpec, even_plan, load_profile, solve


def estimate(config: dict, dtype: str = "float32", **options: float) -> object:
    return analytic_profile(shape_from_config(config, sequence=SEQ, micro_batch_size=BATCH, dtype=dtype), **options)


@pytest.fixture(scope="module")
def llama_pair():
    return profiled(llama(), steps=1).profile(), estimate({"model_type": "llama", **LLAMA})


def test_llama_memory_estimate_equals_the_measurement(llama_pair):
    assert_same_memory(*llama_pair)


@pytest.mark.parametrize(
    ("build", "config", "dtype"),
    [
        (llama, {"model_type": "llama", **LLAMA}, "bfloat16"),  # the norms keep fp32 copies of their inputs
        (qwen3, {"model_type": "qwen3", **QWEN3}, "float32"),  # its own head_dim; q and k normalised per head
        (qwen3, {"model_type": "qwen3", **QWEN3}, "bfloat16"),
        (partial(llama, head_dim=32), {"model_type": "llama", **LLAMA, "head_dim": 32}, "float32"),
        # MoE: what the experts keep adds up over tokens whichever experts the router picks
        (moe, {"model_type": "qwen2_moe", **MOE}, "float32"),  # a shared expert besides the routed ones
        (qwen3_moe, {"model_type": "qwen3_moe", **QWEN3_MOE}, "float32"),
        (qwen3_moe, {"model_type": "qwen3_moe", **QWEN3_MOE}, "bfloat16"),
        (mixtral, {"model_type": "mixtral", **MIXTRAL}, "float32"),
    ],
    ids=["llama-bf16", "qwen3", "qwen3-bf16", "llama-head_dim", "qwen2_moe", "qwen3_moe", "qwen3_moe-bf16", "mixtral"],
)
def test_memory_estimate_equals_the_measurement_across_attention_shapes_and_dtypes(build, config, dtype):
    torch_dtype = getattr(torch, dtype)
    measured = profiled(build().to(torch_dtype), steps=1).profile()
    # torch's AdamW keeps its two states in the parameters' dtype
    states = 2 * torch.empty((), dtype=torch_dtype).element_size()
    assert_same_memory(measured, estimate(config, dtype, optimizer_bytes_per_parameter=states))


def assert_same_memory(measured, estimated):
    assert [layer.kind.split(":")[0] for layer in estimated.layers] == [
        layer.kind.split(":")[0] for layer in measured.layers
    ]
    assert estimated.stage_shared_bytes == measured.stage_shared_bytes  # the rotary tables
    assert estimated.checkpoint_state_bytes == 0 < measured.checkpoint_state_bytes  # the CPU's
    assert estimated.dimensions == measured.dimensions
    hidden_fp32_bytes = estimated.stage_output_bytes * 4 / DTYPE_BYTES[estimated.dtype]
    for got, want in zip(estimated.layers, measured.layers):
        assert (got.parameter_bytes, got.gradient_bytes, got.optimizer_bytes) == (
            want.parameter_bytes,
            want.gradient_bytes,
            want.optimizer_bytes,
        )
        # what tensor and expert parallelism treat apart: the profiler tags it by module, the estimate counts it
        for name in (
            "parameter_tensors",
            "replicated_parameter_bytes",
            "replicated_gradient_bytes",
            "expert_parameter_bytes",
        ):
            assert getattr(got, name) == getattr(want, name), (got.name, name)
        for mode, cost in want.recompute.items():
            # an estimate is for an accelerator, where checkpointing keeps nothing beside the saved tensors
            state = 0 if mode == "none" else measured.checkpoint_state_bytes
            assert got.recompute[mode].activation_bytes == cost.activation_bytes - state, (got.name, mode)
            for name in ("tp_whole_activation_bytes", "sp_whole_activation_bytes"):
                assert getattr(got.recompute[mode], name) == getattr(cost, name) - state, (got.name, mode, name)
            assert got.recompute[mode].expert_activation_bytes == cost.expert_activation_bytes, (got.name, mode)
            assert got.recompute[mode].expert_working_bytes == cost.expert_working_bytes, (got.name, mode)
            assert got.recompute[mode].saved_input_bytes == cost.saved_input_bytes, (got.name, mode)
            # a split backward's pending gradients: exact for dense blocks; an upper bound for MoE blocks,
            # whose input gradients free part of what the routing saved (measured: 9-19% less held)
            if got.kind == "body:moe":
                assert cost.pending_bytes <= got.recompute[mode].pending_bytes <= 1.25 * cost.pending_bytes, got.name
            else:
                assert got.recompute[mode].pending_bytes == cost.pending_bytes, (got.name, mode)
            # what its backward holds while it runs: exact for the head (its weight gradient), the tail
            # (the loss's and the logits' gradients) and dense blocks without recompute, MoE blocks a
            # few bytes a token over; a recomputing block rebuilds up to one hidden-sized fp32 tensor
            # more than counted
            working, measured_working = got.recompute[mode].working_bytes, cost.working_bytes
            if got.kind in ("head", "tail") or (got.kind == "body:dense" and mode == "none"):
                assert working == measured_working, (got.name, mode)
            elif got.kind == "body:dense":
                assert 0 <= measured_working - working <= hidden_fp32_bytes, (got.name, mode)
            elif got.kind == "body:moe":
                assert -hidden_fp32_bytes <= working - measured_working < hidden_fp32_bytes, (got.name, mode)
                assert mode != "none" or working >= measured_working, got.name
            # what its W frees beyond its pending bytes while its stage's graph lives on (measured without
            # recompute): exact for dense blocks; for MoE blocks less than measured (the experts' left out)
            freed, measured_freed = got.recompute[mode].weight_freed_bytes, cost.weight_freed_bytes
            if mode != "none" or got.kind == "tail":
                assert freed is None and (measured_freed is None or got.kind == "tail"), (got.name, mode)
            elif got.kind == "body:moe":
                assert freed - got.recompute[mode].pending_bytes < measured_freed - cost.pending_bytes, got.name
            else:
                assert freed == measured_freed, got.name
    assert estimated.stage_output_bytes == measured.stage_output_bytes  # the hidden state a stage sends


@pytest.mark.parametrize(("schedule", "chunks"), [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("DualPipeV", 2)])
@pytest.mark.parametrize("receive_buffers", [False, True])
def test_an_estimate_plans_the_peaks_its_measurement_plans(llama_pair, schedule, chunks, receive_buffers):
    # without recompute (checkpoints keep the CPU generator's state, which an estimate leaves out) and
    # with the backward whole (zero-bubble schedules split it: the halves are not all estimated)
    measured, estimated = llama_pair
    spec = PipelineSpec(
        pipeline_parallel=2, chunks=chunks, micro_batches=4, schedule=schedule, receive_buffers=receive_buffers
    )
    assert (
        even_plan(estimated, spec, "none").rank_peak_memory_bytes
        == even_plan(measured, spec, "none").rank_peak_memory_bytes
    )


@pytest.mark.parametrize(
    "dtype, record",
    [("float32", "h200_llama-1024.profile.json"), ("bfloat16", "h200_llama-1024_bfloat16.profile.json")],
)
def test_the_tail_working_set_is_what_an_h200_measured(dtype, record):
    import importlib.util

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("gpu_check", root / "examples" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    measured = load_profile(root / "docs" / "gpu" / record)  # the model gpu_check profiled
    shape = shape_from_config(
        gpu_check.REPLAY_MODEL,
        sequence=gpu_check.REPLAY_SEQ_LEN,
        micro_batch_size=gpu_check.REPLAY_MICRO_BATCH_SIZE,
        dtype=dtype,
    )
    estimated = analytic_profile(shape).layers[-1].recompute["none"].working_bytes
    # the CUDA allocator rounds each block to 512 bytes: the loss, 4 bytes, takes one
    assert 0 <= estimated - measured.layers[-1].recompute["none"].working_bytes < 512


def test_moe_models_keep_their_dense_blocks_apart():
    estimated = estimate({"model_type": "qwen2_moe", **MOE})
    assert [layer.kind for layer in estimated.layers][1:5] == ["body:dense"] * 2 + ["body:moe"] * 2


def test_parallel_degrees_split_what_a_device_holds():
    # tensor parallel splits all but the norms' weights and (without sequence parallel) leaves the block
    # input a full recompute keeps whole; context parallel halves every activation; times / (t c)
    config = {"model_type": "llama", **LLAMA}
    one = analytic_profile(shape_from_config(config, sequence=64))
    split = analytic_profile(shape_from_config(config, sequence=64, tensor_parallel=2, context_parallel=2))
    body_one, body_split = one.layers[2], split.layers[2]
    norms = 2 * LLAMA["hidden_size"] * 2  # bfloat16
    assert body_split.parameter_bytes == (body_one.parameter_bytes - norms) / 2 + norms
    assert body_split.recompute["full"].activation_bytes == body_one.recompute["full"].activation_bytes / 2
    assert body_split.forward_ms == body_one.forward_ms / 4
    assert split.mesh.tensor_parallel == split.mesh.context_parallel == 2 and one.mesh.is_one_d


def test_an_estimate_plans_without_hardware():
    profile = estimate({"model_type": "llama", **LLAMA, "num_hidden_layers": 8})
    plan = solve(profile, PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B"), time_limit_s=10)
    assert plan.status == "optimal"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": "llama", **LLAMA, "num_attention_heads": 5}, "num_heads"),
        ({"model_type": "qwen3", **QWEN3, "head_dim": -8}, "head_dim"),
        ({"model_type": "llama", **LLAMA, "hidden_size": "wide"}, "hidden_size"),
        ({"model_type": "llama", **LLAMA, "hidden_size": 64.5}, "hidden_size"),  # was taken as 64
        ({"model_type": "llama", **LLAMA, "num_key_value_heads": [2]}, "num_key_value_heads"),
        ({"model_type": "llama", "hidden_size": 64}, "num_hidden_layers"),
    ],
)
def test_bad_configs_are_clear_errors(config, field):
    with pytest.raises(InputError) as caught:
        shape_from_config(config, sequence=16)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"tensor_parallel": 3}, "tensor_parallel: expected a divisor of num_heads 4, got 3"),
        ({"tensor_parallel": 4}, "tensor_parallel: expected a divisor of num_kv_heads 2, got 4"),
        ({"context_parallel": 3}, "context_parallel: expected sequence 16 to be a multiple of 2 x context_parallel"),
        ({"context_parallel": 16}, "context_parallel: expected sequence 16 to be a multiple of 2 x context_parallel"),
    ],
)
def test_parallel_sizes_that_split_a_head_or_the_sequence_unevenly(options, words):
    with pytest.raises(InputError, match=words):
        shape_from_config({"model_type": "llama", **LLAMA}, sequence=16, **options)
    shape_from_config({"model_type": "llama", **LLAMA}, sequence=16, tensor_parallel=2, context_parallel=8)


def test_bad_shape_values_name_the_field():
    with pytest.raises(InputError, match="dtype: expected one of float32, bfloat16, float16"):
        TransformerShape(hidden_size=8, num_layers=1, num_heads=1, vocab_size=8, sequence=8, ffn_size=8, dtype="int8")
