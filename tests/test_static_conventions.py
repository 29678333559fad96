"""`profile --estimate --framework NAME`: weights, gradients and optimizer state per parameter as each framework
keeps them (profiler.estimate.conventions), exact per layer, checked by hand against Megatron-LM's theoretical
memory formula, and the note that names the convention."""

from __future__ import annotations

import json

import pytest

from profiler.estimate.analytic import analytic_profile
from profiler.estimate.conventions import CONVENTIONS, convention
from profiler.estimate.shape import TransformerShape
from sapp_hook.cli import main
from solver import load_profile
from solver.vocabulary.spec import PipelineSpec, static_split

# h 64, 4 heads of 16, 2 KV heads, FFN 128: attention 64 x (64 + 2 x 32) + 64 x 64 = 12,288, MLP 3 x 64 x 128
# = 24,576, two RMSNorms 128: 36,992 parameters in 9 tensors (q, k, v, o, gate, up, down, two norms) a block
SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=1000, sequence=32, ffn_size=128)
BLOCK, TENSORS = 36_992, 9
CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}

# (weights, gradients, optimizer state) of one block, bytes: the convention's bytes a parameter x 36,992, and
# torch AdamW's 4-byte step count x 9 tensors where the framework runs torch's AdamW
BYTES = {
    "megatron": (73_984, 147_968, 443_904),  # 2, 4, 12
    "megatron-distributed-optimizer": (73_984, 147_968, 443_904),
    "mindspeed": (73_984, 147_968, 443_904),
    "mindformers": (147_968, 147_968, 295_936),  # 4, 4, 8
    "torchtitan": (147_968, 147_968, 295_972),  # 4, 4, 8 + 4 x 9
    "torchtitan-bf16": (73_984, 73_984, 148_004),  # 2, 2, 4 + 4 x 9
}


@pytest.mark.parametrize("name", sorted(BYTES))
def test_each_convention_gives_its_bytes_per_block_exactly(name):
    profile = analytic_profile(TransformerShape(**SMALL), static_memory=convention(name))
    block = profile.layers[1]
    assert (block.parameter_bytes, block.gradient_bytes, block.optimizer_bytes) == BYTES[name]
    assert block.parameter_tensors == TENSORS
    # the head (embedding 1000 x 64) in the same bytes a parameter
    weights, gradients, _ = BYTES[name]
    assert profile.layers[0].parameter_bytes == 64_000 * weights / BLOCK
    assert profile.layers[0].gradient_bytes == 64_000 * gradients / BLOCK


def test_the_table_names_every_convention_the_tests_check():
    assert sorted(CONVENTIONS) == sorted(BYTES)


def test_megatron_matches_its_theoretical_memory_formula_by_hand():
    # megatron/training/theoretical_memory_usage.py, compute_weight_and_optimizer_memory, for this block:
    # self_attn_term = 2 h^2 ((1 + groups / heads) x query_projection / h) = 2 x 64^2 x 1.5 = 12,288
    # dense layer = 2 h (ffn x 3/2 (swiglu) + 1 (RMSNorm)) + self_attn_term = 128 x 193 + 12,288 = 36,992
    # num_bytes_per_parameter = 18, or 6 + 12 / data_parallel_size with --use-distributed-optimizer
    h, ffn, groups, heads = 64, 128, 2, 4
    megatron_block = 2 * h * (ffn * 3 / 2 + 1) + 2 * h * h * (1 + groups / heads)
    assert megatron_block == BLOCK
    layer = analytic_profile(TransformerShape(**SMALL), static_memory=convention("megatron")).layers[1]
    assert layer.parameter_bytes + layer.gradient_bytes + layer.optimizer_bytes == 18 * megatron_block
    distributed = analytic_profile(
        TransformerShape(**SMALL), static_memory=convention("megatron-distributed-optimizer")
    ).layers[1]
    spec = PipelineSpec(pipeline_parallel=1, micro_batches=1, data_parallel=8, zero_stage=1)
    held = static_split(spec, distributed.parameter_bytes, distributed.gradient_bytes, distributed.optimizer_bytes)
    assert held.total == (6 + 12 / 8) * megatron_block == 277_440


@pytest.mark.parametrize(
    ("name", "formula", "data_parallel", "per_rank"),
    [
        ("megatron", "18", 8, 18.0),
        ("megatron-distributed-optimizer", "6 + 12/d", 8, 7.5),
        ("mindspeed", "6 + 12/d", 4, 9.0),
        ("mindformers", "8 + 8/d", 4, 10.0),
        ("torchtitan", "16/d", 4, 4.0),
        ("torchtitan-bf16", "8/d", 4, 2.0),
    ],
)
def test_each_convention_states_its_sharded_bytes_per_parameter(name, formula, data_parallel, per_rank):
    chosen = convention(name)
    assert (chosen.formula(), chosen.per_rank(data_parallel)) == (formula, per_rank)


def test_tensor_parallel_keeps_the_conventions_gradient_to_weight_ratio():
    shape = TransformerShape(**SMALL, tensor_parallel=2)
    block = analytic_profile(shape, static_memory=convention("megatron")).layers[1]
    # the norms (128) whole, the rest halved: 128 + 36,864 / 2 = 18,560 parameters on the rank
    assert (block.parameter_bytes, block.gradient_bytes) == (2 * 18_560, 4 * 18_560)


def test_the_traced_estimate_keeps_the_convention_too():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from profiler.estimate.generic import traced_profile

    fields = {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "sliding_window": 16,
        "query_pre_attn_scalar": 16,
        "max_position_embeddings": 128,
    }
    fp32 = traced_profile(fields, sequence=16, dtype="float32")
    megatron = traced_profile(fields, sequence=16, static_memory=convention("megatron"))
    for plain, ours in zip(fp32.layers, megatron.layers, strict=True):
        parameters = plain.parameter_bytes / 4
        assert (ours.parameter_bytes, ours.gradient_bytes, ours.optimizer_bytes) == (
            2 * parameters,
            4 * parameters,
            12 * parameters,
        )
    assert [t.bytes for t in megatron.tied_parameters] == [512 * 64 * 2]


def _estimate(tmp_path, capsys, *flags: str) -> tuple[object, str]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    out = tmp_path / "p.json"
    argv = ["profile", "--estimate", "--model", str(config), "--seq-len", "32", "--out", str(out), *flags]
    assert main(argv) == 0
    return load_profile(out), capsys.readouterr().out


def test_the_cli_note_names_the_convention_and_its_bytes(tmp_path, capsys):
    profile, out = _estimate(tmp_path, capsys, "--framework", "megatron-distributed-optimizer")
    assert profile.dtype == "bfloat16"  # the framework computes in bf16
    assert (profile.layers[1].parameter_bytes, profile.layers[1].optimizer_bytes) == (73_984, 443_904)
    assert (
        "static memory: megatron-distributed-optimizer (Megatron-LM, bf16, --use-distributed-optimizer): "
        "weights 2 + gradients 4 + optimizer 12 = 18 bytes a parameter; "
        "solve with --data-parallel D --zero-stage 1 for the framework's 6 + 12/D\n"
    ) in out


def test_the_cli_note_of_torchtitan_names_its_step_count_and_fsdp(tmp_path, capsys):
    _, out = _estimate(tmp_path, capsys, "--framework", "torchtitan")
    assert (
        "static memory: torchtitan (TorchTitan, FSDP2, training.dtype float32, bf16 compute): "
        "weights 4 + gradients 4 + optimizer 8 = 16 bytes a parameter (+ 4 a tensor); "
        "solve with --data-parallel D --fsdp for the framework's 16/D\n"
    ) in out


def test_optimizer_bytes_override_the_conventions(tmp_path, capsys):
    profile, out = _estimate(
        tmp_path, capsys, "--framework", "megatron", "--optimizer-bytes", "8", "--dtype", "float32"
    )
    assert profile.dtype == "float32"
    assert (profile.layers[1].parameter_bytes, profile.layers[1].optimizer_bytes) == (73_984, 8 * BLOCK)
    assert "weights 2 + gradients 4 + optimizer 8 = 14 bytes a parameter\n" in out


def test_without_a_framework_the_estimate_is_as_before_and_says_nothing(tmp_path, capsys):
    profile, out = _estimate(tmp_path, capsys)
    assert profile.dtype == "float32"
    assert (profile.layers[1].parameter_bytes, profile.layers[1].optimizer_bytes) == (
        4 * BLOCK,
        8 * BLOCK + 4 * TENSORS,
    )
    assert "static memory" not in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--estimate", "--framework", "deepspeed"],
            (
                "--framework: expected one of megatron, megatron-distributed-optimizer, mindspeed, mindformers, "
                "torchtitan, torchtitan-bf16, got 'deepspeed'"
            ),
        ),
        (["--framework", "megatron"], "--framework: needs --estimate"),
    ],
)
def test_a_framework_refused_by_name(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as caught:
        main(["profile", "--model", "tiny-llama", "--out", str(tmp_path / "p.json"), *flags])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err
