"""`sapp-hook profile`: built-in models and any transformers config.json, a table, JSON, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_args import with_flags
from profiler_cases import LLAMA

from profiler.estimate.analytic import analytic_profile, shape_from_config
from profiler.estimate.collectives import Network
from sapp_hook.cli import main
from solver import load_profile
from solver.vocabulary.profile_parts import Mesh

FAST = ["--steps", "1", "--micro-batch-size", "1", "--seq-len", "16"]


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LLAMA}))
    return path


def test_a_config_json_is_profiled_with_a_table_and_progress(capsys, tmp_path, config_json):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(config_json), *FAST, "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert "profiling: step 4/7 done (recompute full)" in stderr  # the last timed step
    assert "profiling: step 7/7 done (recompute full, counting memory)" in stderr
    # block 0 no longer differs: the rotary tables it kept are counted per stage
    assert "model.layers.0..model.layers.3 (x4)" in stdout and f"wrote {out}" in stdout
    profile = load_profile(out)
    assert [layer.kind for layer in profile.layers] == ["head", *["body:LlamaDecoderLayer"] * 4, "tail"]
    assert profile.micro_batch == {"size": 1, "sequence": 16}


def test_a_folder_holding_a_config_and_json_output(capsys, tmp_path, config_json):
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", str(config_json.parent), *FAST, "--modes", "none,full", "--out", str(out), "--json"]
    assert main(argv) == 0
    stdout, stderr = capsys.readouterr()
    report = json.loads(stdout)
    assert stderr == ""
    assert report["written"] == [str(out)]
    assert set(report["layers"][1]["recompute"]) == {"none", "full"}
    assert report["schema_version"] == 1


def test_bfloat16_parameters_keep_half_the_bytes(tmp_path, config_json):
    profiles = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        argv = ["profile", "--model", str(config_json), *FAST, "--modes", "none", "--dtype", dtype, "--out", str(out)]
        assert main([*argv, "--quiet"]) == 0
        profiles[dtype] = load_profile(out)
    half, full = profiles["bfloat16"], profiles["float32"]
    assert (half.dtype, full.dtype) == ("bfloat16", "float32")
    for narrow, wide in zip(half.layers, full.layers):
        assert 2 * narrow.parameter_bytes == wide.parameter_bytes
    for narrow, wide in zip(half.layers[1:-1], full.layers[1:-1]):
        # bf16 but for what stays fp32: the RMSNorms' upcast inputs and rsqrt, the attention's logsumexp
        assert 0.5 < narrow.recompute["none"].activation_bytes / wide.recompute["none"].activation_bytes < 0.6


def test_a_built_in_model(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny-gpt2", *FAST, "--modes", "none", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    profile = load_profile(out)
    assert len(profile.layers) == 10
    assert profile.tied_parameters[0].layers == ("head", "tail")
    # estimated as well: GPT-2's blocks are `transformer.h`, its learned positions the head's
    estimate = tmp_path / "e.json"
    assert main(["profile", "--model", "tiny-gpt2", "--estimate", "--out", str(estimate), "--quiet"]) == 0
    estimated = load_profile(estimate)
    assert [layer.parameter_bytes for layer in estimated.layers] == [layer.parameter_bytes for layer in profile.layers]


ESTIMATE = ["--estimate"]


@pytest.mark.parametrize(
    ("base", "flags", "message"),
    [
        (FAST, ["--model", "no-such-model"], "--model: 'no-such-model' is neither a built-in model"),
        (FAST, ["--modes", "none,fast"], "--modes: expected distinct modes among none, selective, full"),
        (FAST, ["--layers", "decoder.*"], "--layers: pattern 'decoder.*' matches no module"),
        (FAST, ["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
        (FAST, ["--seq-len", "0"], "--seq-len: expected an integer >= 1, got 0"),
        (FAST, ["--out", "/no/such/folder/p.json"], "--out: folder /no/such/folder does not exist"),
        (FAST, ["--device", "cuda"], "--device: no cuda device here"),
        (FAST, ["--device", "toaster"], "--device: expected cpu, cuda or cuda:N, got 'toaster'"),
        (FAST, ["--dtype", "int8"], "--dtype: expected one of float32, bfloat16, float16, got 'int8'"),
        (FAST, ["--flops", "1e15"], "--flops: needs --estimate"),
        (ESTIMATE, ["--steps", "3"], "--steps: is for measuring; --estimate runs nothing"),
        (ESTIMATE, ["--device", "cpu"], "--device: is for measuring; --estimate runs nothing"),
        (ESTIMATE, ["--flops", "0"], "--flops: expected a number > 0, got 0.0"),
        (ESTIMATE, ["--bandwidth", "inf"], "--bandwidth: expected a number > 0, got inf"),
        (ESTIMATE, ["--tensor-parallel", "0"], "--tensor-parallel: expected an integer >= 1, got 0"),
        (ESTIMATE, ["--tensor-parallel", "3"], "--tensor-parallel: expected a divisor of num_heads 4, got 3"),
        (ESTIMATE, ["--optimizer-bytes", "-4"], "--optimizer-bytes: expected a number >= 0, got -4.0"),
        (ESTIMATE, ["--dtype", "int8"], "--dtype: expected one of float32, bfloat16, float16, got 'int8'"),
        (FAST, ["--link-bandwidth", "1e9"], "--link-bandwidth: needs --estimate"),
        (FAST, ["--expert-parallel", "2"], "--expert-parallel: needs --estimate"),
        (
            ESTIMATE,
            ["--expert-parallel", "2", "--data-parallel", "2"],
            "--expert-parallel: the model has no routed experts; expected 1, got 2",
        ),
        (
            ESTIMATE,
            ["--expert-parallel", "2", "--expert-tokens", "most"],
            "--expert-tokens: expected balanced, dropless",
        ),
        (ESTIMATE, ["--zero-stage", "2", "--data-parallel", "0"], "--data-parallel: expected an integer >= 1, got 0"),
        (ESTIMATE, ["--link-bandwidth", "-1"], "--link-bandwidth: expected a finite number >= 0, got -1.0"),
        (ESTIMATE, ["--link-latency", "nan"], "--link-latency: expected a finite number >= 0, got nan"),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, config_json, base, flags, message):
    argv = with_flags(["profile", "--model", str(config_json), *base, "--out", str(tmp_path / "p.json")], flags)
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sapp-hook profile: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 5}, "transformers cannot build model_type 'llama': Class validation error"),
        (
            {"hidden_size": "wide"},
            "transformers cannot build model_type 'llama': Validation error for field 'hidden_size'",
        ),
        ({"vocab_size": 0}, "--model: vocab_size: expected an integer >= 1, got 0"),
        ({"max_position_embeddings": 8}, "--seq-len: 16 tokens; the model takes at most 8 (max_position_embeddings)"),
        (
            {"hidden_size": 2**38},
            "--model: llama's weights do not fit in this machine's memory",
        ),  # past any address space
    ],
)
def test_configs_that_cannot_train_are_one_line(capsys, config_json, tmp_path, change, message):
    """Each of these was a traceback from transformers or torch."""
    config_json.write_text(json.dumps({"model_type": "llama", **LLAMA, **change}))
    with pytest.raises(SystemExit) as caught:
        main(["profile", "--model", str(config_json), *FAST, "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("\n") == 1


def test_a_config_transformers_cannot_build(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(SystemExit):
        main(["profile", "--model", str(bad), "--out", str(tmp_path / "p.json")])
    assert "--model: " in capsys.readouterr().err


def test_an_estimate_runs_nothing_and_writes_the_analytic_profile(tmp_path, config_json):
    out = tmp_path / "estimate.json"
    argv = [
        "profile",
        "--model",
        str(config_json),
        "--estimate",
        "--dtype",
        "bfloat16",
        "--seq-len",
        "64",
        "--micro-batch-size",
        "1",
        "--flops",
        "4e14",
        "--tensor-parallel",
        "2",
        "--out",
        str(out),
        "--quiet",
    ]
    # In a process of its own, to see what it imports: neither torch nor transformers.
    code = (
        f"import sys; from sapp_hook.cli import main; assert main({argv!r}) == 0; "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    shape = shape_from_config(
        {"model_type": "llama", **LLAMA}, sequence=64, micro_batch_size=1, dtype="bfloat16", tensor_parallel=2
    )
    estimated = load_profile(out)
    assert estimated.layers == analytic_profile(shape, flops_per_second=4e14).layers
    assert estimated.model == f"{config_json} (estimated)" and estimated.source == "analytic"


@pytest.mark.parametrize(
    ("switches", "message"),
    [
        (["--sequence-parallel"], "--sequence-parallel: needs tensor_parallel > 1"),
        (["--fsdp", "--zero-stage", "1"], "--zero-stage: FSDP shards parameters, gradients and optimizer state"),
        (["--reshard-after-forward"], "--reshard-after-forward: needs fsdp"),
    ],
)
def test_a_layout_no_engine_runs_is_one_line(capsys, tmp_path, config_json, switches, message):
    with pytest.raises(SystemExit) as caught:
        main(["profile", "--model", str(config_json), *ESTIMATE, *switches, "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.startswith(f"sapp-hook profile: error: {message}") and err.count("\n") == 1


def test_an_estimate_for_one_rank_of_a_mesh_says_so_and_states_its_collectives(capsys, tmp_path, config_json):
    out = tmp_path / "estimate.json"
    argv = [
        "profile",
        "--model",
        str(config_json),
        "--estimate",
        "--dtype",
        "float32",
        "--seq-len",
        "64",
        "--tensor-parallel",
        "2",
        "--sequence-parallel",
        "--data-parallel",
        "4",
        "--fsdp",
        "--link-bandwidth",
        "1e11",
        "--data-link-bandwidth",
        "2.5e10",
        "--link-latency",
        "1e-5",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "one rank of tensor_parallel 2 (sequence parallel)" in report
    assert "collectives (in the forward and backward times): tensor all-reduce x" in report
    assert "collectives (once a step, in no layer time): data reduce-scatter x" in report
    shape = shape_from_config(
        {"model_type": "llama", **LLAMA},
        sequence=64,
        micro_batch_size=2,
        dtype="float32",
        tensor_parallel=2,
        sequence_parallel=True,
    )
    network = Network(
        link_bytes_per_second=1e11, data_link_bytes_per_second=2.5e10, latency_s=1e-5, data_parallel=4, fsdp=True
    )
    estimated = load_profile(out)
    assert estimated.layers == analytic_profile(shape, network=network).layers
    assert estimated.mesh == Mesh(tensor_parallel=2, sequence_parallel=True)


def test_an_estimate_names_a_size_the_config_lacks(capsys, tmp_path, config_json):
    config_json.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(SystemExit):
        main(["profile", "--model", str(config_json), "--estimate", "--out", str(tmp_path / "p.json")])
    assert f"error: --model: {config_json}: num_hidden_layers: missing from the llama config" in capsys.readouterr().err
