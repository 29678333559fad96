"""`sapp-hook profile` on the job's own mesh: one rank of tensor parallel x FSDP2 measured on 2-4 gloo
processes. The rank profile's memory is the one-process profile's through `profile_for_mesh`, to the
byte; every layer states the collectives it ran, counted as eager DTensor and FSDP2 run them on torch
2.13; its times are the slowest rank's; planning divides nothing again. Counts and
formulas only: times on this machine are noise."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sapp_hook.cli import main
from sapp_hook.models import load_config, profile_example
from sapp_hook.validation.mesh_profile import MeshRun, mesh_profile, run_mesh
from simulator import InputError
from solver import PipelineSpec, evaluate_plan, load_profile
from solver.parallel.model_parallel import SPLIT_FIELDS, profile_for_mesh, rank_profile
from solver.vocabulary.profile import NONE, ModelProfile
from solver.vocabulary.profile_parts import Mesh

SHAPE = {"micro_batch_size": 1, "seq_len": 128}
HIDDEN = 128 * 256 * 4  # a rank's hidden state: tokens x hidden x fp32
LOGITS = 128 * 8192 * 4
TIMES = ("forward_ms", "backward_ms", "weight_ms", "input_ms", "spread", "collectives")


@pytest.fixture(scope="module")
def one_d() -> ModelProfile:
    return profile_example(load_config("tiny-llama"), steps=1, modes=("none", "full"), model_name="tiny-llama", **SHAPE)


def _measured(one_d: ModelProfile, **layout) -> tuple[MeshRun, list[dict], ModelProfile]:
    run = MeshRun(model="tiny-llama", steps=1, modes=("none", "full"), **SHAPE, **layout)
    ranks = run_mesh(run, one_d)
    return run, ranks, mesh_profile(profile_for_mesh(one_d, run.mesh), ranks, run.mesh)


def _phases(rows: list[dict]) -> dict[tuple[str, str, str], tuple[int, float]]:
    """(dimension, operation, phase) -> (calls, bytes) of one layer on one rank, per step."""
    return {(row["dimension"], row["operation"], row["phase"]): (row["calls"], row["bytes"]) for row in rows}


def _memory(profile: ModelProfile, leaving_out: tuple[str, ...] = ()) -> dict:
    """The profile without its times: every byte it states, per layer and mode (but `leaving_out`)."""
    data = profile.to_dict()
    for layer in data["layers"]:
        for name in TIMES:
            layer.pop(name, None)
        for cost in layer["recompute"].values():
            for name in ("extra_ms", *leaving_out):
                cost.pop(name, None)
    return data


def _measured_split(profile: ModelProfile, rule: ModelProfile, ranks: list[dict]) -> None:
    """Each body layer's split backward as the ranks measured it (the most any held), not the rule's."""
    for index, layer in enumerate(profile.layers):
        if not layer.is_body:
            assert layer.recompute == rule.layers[index].recompute
            continue
        splits = [rank["splits"][ModelProfile.from_dict(rank["profile"]).layers[index].kind] for rank in ranks]
        none, full = layer.recompute["none"], layer.recompute["full"]
        for name in ("pending_bytes", "input_working_bytes", "weight_working_bytes", "input_held_bytes"):
            assert getattr(none, name) == max(split[name] for split in splits), name
        assert none.weight_freed_bytes == min(
            max(split["weight_freed_bytes"] for split in splits), none.pending_bytes + none.activation_bytes
        )
        assert full.pending_bytes == none.pending_bytes and full.input_working_bytes is None  # halves: no recompute
        # a rank holds more than the one process's / t: some gradients stay whole
        assert none.pending_bytes > rule.layers[index].recompute["none"].pending_bytes


def _slowest_times(profile: ModelProfile, ranks: list[dict]) -> None:
    measured = [ModelProfile.from_dict(rank["profile"]) for rank in ranks]
    for index, layer in enumerate(profile.layers):
        assert layer.forward_ms == max(rank.layers[index].forward_ms for rank in measured)
        assert layer.backward_ms == max(rank.layers[index].backward_ms for rank in measured)
        full = [
            rank.layers[index].recompute["full"].extra_ms for rank in measured if "full" in rank.layers[index].recompute
        ]
        if full:
            assert layer.recompute["full"].extra_ms == max(full)
        for collective in layer.collectives:
            assert collective.exposed_ms == collective.ms  # gloo: the training thread waits every collective out


def test_a_tensor_parallel_rank_is_measured_on_its_mesh(one_d):
    _, ranks, profile = _measured(one_d, tensor_parallel=2)
    assert profile.mesh == Mesh(tensor_parallel=2)
    rule = profile_for_mesh(one_d, Mesh(tensor_parallel=2))
    assert _memory(profile, SPLIT_FIELDS) == _memory(rule, SPLIT_FIELDS)
    _measured_split(profile, rule, ranks)
    _slowest_times(profile, ranks)
    for rank in ranks:
        head, *blocks, tail = rank["collectives"]
        assert _phases(head) == {("tensor", "all-reduce", "forward"): (1, HIDDEN)}  # the embedding's partial sums
        for block in blocks:  # one all-reduce per row-parallel output forward, one per column-parallel input backward
            assert _phases(block) == {
                ("tensor", "all-reduce", "forward"): (2, 2 * HIDDEN),
                ("tensor", "all-reduce", "backward"): (5, 5 * HIDDEN),
            }
        assert _phases(tail) == {
            ("tensor", "all-gather", "forward"): (1, LOGITS),  # the whole logits
            ("tensor", "all-reduce", "backward"): (1, HIDDEN),
        }
        assert rank["optimizer_collectives"] == []
    body = [layer for layer in profile.layers if layer.is_body]
    assert len(body) == 8
    for layer in body:
        [collective] = layer.collectives
        assert (collective.dimension, collective.operation, collective.per, collective.calls, collective.bytes) == (
            "tensor",
            "all-reduce",
            "micro-batch",
            7,
            7 * HIDDEN,
        )


def test_the_measured_times_are_not_divided_again(one_d, tmp_path):
    """A profile per rank of tensor parallel 2 plans as it is under a spec of 2; dividing its times by 2
    again would halve the iteration."""
    _, _, profile = _measured(one_d, tensor_parallel=2)
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B", tensor_parallel=2)
    assert rank_profile(profile, spec) is profile
    counts = [len(profile.layers) // 2, len(profile.layers) - len(profile.layers) // 2]
    modes = [NONE] * len(profile.layers)
    planned = evaluate_plan(profile, spec, counts, modes)
    as_measured = evaluate_plan(
        dataclasses.replace(profile, mesh=Mesh()), dataclasses.replace(spec, tensor_parallel=1), counts, modes
    )
    assert planned.iteration_time_ms == as_measured.iteration_time_ms
    with pytest.raises(InputError, match="would divide them again"):
        rank_profile(profile, dataclasses.replace(spec, tensor_parallel=1))
    path = tmp_path / "rank.json"
    profile.save(path)
    assert (
        main(
            [
                "solve",
                "--profile",
                str(path),
                "--pipeline-parallel",
                "2",
                "--micro-batches",
                "4",
                "--schedule",
                "1F1B",
                "--tensor-parallel",
                "2",
                "--memory",
                "1GB",
                "--quiet",
            ]
        )
        == 0
    )
    with pytest.raises(SystemExit) as caught:
        main(
            [
                "solve",
                "--profile",
                str(path),
                "--pipeline-parallel",
                "2",
                "--micro-batches",
                "4",
                "--schedule",
                "1F1B",
                "--tensor-parallel",
                "4",
                "--memory",
                "1GB",
                "--quiet",
            ]
        )
    assert caught.value.code == 2


def test_sequence_parallel_gathers_and_scatters_the_sequence(one_d):
    _, ranks, profile = _measured(one_d, tensor_parallel=2, sequence_parallel=True)
    assert profile.mesh == Mesh(tensor_parallel=2, sequence_parallel=True)
    assert _memory(profile) == _memory(profile_for_mesh(one_d, profile.mesh))
    for rank in ranks:
        head, *blocks, tail = rank["collectives"]
        assert _phases(head) == {
            ("tensor", "reduce-scatter", "forward"): (1, HIDDEN),
            ("tensor", "all-gather", "backward"): (1, HIDDEN),
        }
        for block in blocks:
            assert _phases(block) == {
                ("tensor", "all-gather", "forward"): (2, 2 * HIDDEN),
                ("tensor", "reduce-scatter", "forward"): (2, 2 * HIDDEN),
                ("tensor", "all-gather", "backward"): (2, 2 * HIDDEN),
                ("tensor", "all-reduce", "backward"): (5, 5 * HIDDEN),
            }
        assert _phases(tail) == {
            ("tensor", "all-gather", "forward"): (2, HIDDEN + LOGITS),
            ("tensor", "reduce-scatter", "backward"): (1, HIDDEN),
        }
        # the norms' weight gradients stay partial sums until AdamW reads them: reduced at each of its 3 reads
        [optimizer] = rank["optimizer_collectives"]
        norms = 2 * 8 + 1
        assert (optimizer["operation"], optimizer["calls"], optimizer["bytes"]) == (
            "all-reduce",
            3 * norms,
            3 * norms * 256 * 4,
        )


def test_fsdp_gathers_once_a_step_and_reduces_once_a_step(one_d):
    _, ranks, profile = _measured(one_d, data_parallel=2, fsdp=True)
    assert profile.mesh == Mesh()  # the spec shards over data parallelism
    assert _memory(profile) == _memory(one_d)
    _slowest_times(profile, ranks)
    for layer in profile.layers:  # each FSDP unit: the embedding, each block, the final norm with the LM head
        assert {(c.dimension, c.operation, c.per, c.calls, c.bytes) for c in layer.collectives} == {
            ("data", "all-gather", "step", 1, layer.parameter_bytes),
            ("data", "reduce-scatter", "step", 1, layer.gradient_bytes),
        }
    for rank in ranks:
        assert all(
            set(_phases(rows)) == {("data", "all-gather", "forward"), ("data", "reduce-scatter", "backward")}
            for rows in rank["collectives"]
        )


def test_fsdp_that_reshards_after_forward_gathers_in_every_forward_and_backward(one_d):
    _, ranks, profile = _measured(one_d, data_parallel=2, fsdp=True, reshard_after_forward=True)
    head, first, *blocks, tail = profile.layers
    for rank in ranks:
        rows = [_phases(layer) for layer in rank["collectives"]]
        assert rows[0] == {
            ("data", "all-gather", "forward"): (1, head.parameter_bytes),
            ("data", "reduce-scatter", "backward"): (1, head.gradient_bytes),
        }
        # FSDP's hook on the embedding's output runs before the profiler's: its backward gather counts in block 0
        assert rows[1][("data", "all-gather", "backward")] == (2, first.parameter_bytes + head.parameter_bytes)
        for layer, row in zip(blocks, rows[2:-1]):
            assert row == {
                ("data", "all-gather", "forward"): (1, layer.parameter_bytes),
                ("data", "all-gather", "backward"): (1, layer.parameter_bytes),
                ("data", "reduce-scatter", "backward"): (1, layer.gradient_bytes),
            }
        # and its hook on the logits before the profiler sees the backward start: the tail's counts in its forward
        assert rows[-1] == {
            ("data", "all-gather", "forward"): (2, 2 * tail.parameter_bytes),
            ("data", "reduce-scatter", "backward"): (1, tail.gradient_bytes),
        }
    for layer in profile.layers:  # 2 gathers per micro-batch (the head's second in block 0's), 1 reduce a step
        calls = {(c.operation, c.per): c.calls for c in layer.collectives}
        assert calls == {
            ("all-gather", "micro-batch"): 1 if layer is head else 3 if layer is first else 2,
            ("reduce-scatter", "step"): 1,
        }


def test_tensor_parallel_times_fsdp_runs_both_dimensions(tmp_path, capsys):
    """2 x 2 processes through the CLI: each block's tensor all-reduces and its FSDP unit's collectives of
    its local (tensor-parallel) shard."""
    out = tmp_path / "rank.json"
    assert (
        main(
            [
                "profile",
                "--model",
                "tiny-llama",
                "--micro-batch-size",
                "1",
                "--seq-len",
                "128",
                "--steps",
                "1",
                "--modes",
                "none",
                "--tensor-parallel",
                "2",
                "--data-parallel",
                "2",
                "--fsdp",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    profile = load_profile(out)
    assert profile.mesh == Mesh(tensor_parallel=2)
    for layer in profile.layers[1:-1]:
        found = {(c.dimension, c.operation, c.per): (c.calls, c.bytes) for c in layer.collectives}
        assert found == {
            ("tensor", "all-reduce", "micro-batch"): (7, 7 * HIDDEN),
            ("data", "all-gather", "step"): (1, layer.parameter_bytes),
            ("data", "reduce-scatter", "step"): (1, layer.gradient_bytes),
        }
    assert json.loads(out.read_text())["mesh"]["tensor_parallel"] == 2


TIED = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel", "2", "--device", "cuda"], "--device: a mesh is measured on gloo processes on the CPU"),
        (["--tensor-parallel", "2", "--layers", "model.layers.*"], "--layers: a mesh run finds"),
        (["--data-parallel", "2"], "--data-parallel: measured replicas run FSDP2 (add --fsdp)"),
        (["--fsdp"], "--fsdp: needs --data-parallel 2 or more"),
        (["--tensor-parallel", "2", "--reshard-after-forward"], "--reshard-after-forward: needs --fsdp"),
        (["--sequence-parallel"], "--sequence-parallel: needs --tensor-parallel 2 or more"),
        (["--tensor-parallel", "3"], "--tensor-parallel: 3 does not divide the model's num_attention_heads (8)"),
        (["--tensor-parallel", "0"], "--tensor-parallel: expected an integer >= 1, got 0"),
        (
            ["--tensor-parallel", "2", "--sequence-parallel", "--seq-len", "127"],
            "--sequence-parallel: --seq-len 127 is not a multiple of --tensor-parallel 2",
        ),
        (["--tensor-parallel", "2", "--context-parallel", "2"], "--context-parallel: needs --estimate"),
        (["--data-parallel", "2", "--fsdp", "--zero-stage", "1"], "--zero-stage: needs --estimate"),
        (["--tensor-parallel", "2", "--model", "tiny-gpt2"], "--model: a mesh is measured for the Llama family"),
        (["--data-parallel", "2", "--fsdp", "--model", "TIED"], "--model: ties its embedding and LM head"),
    ],
)
def test_what_cannot_run_on_a_mesh_is_refused_before_anything_runs(flags, message, capsys, tmp_path):
    config = tmp_path / "tied.json"
    config.write_text(json.dumps(TIED))
    flags = [str(config) if flag == "TIED" else flag for flag in flags]
    model = [] if "--model" in flags else ["--model", "tiny-llama"]
    with pytest.raises(SystemExit) as caught:
        main(["profile", *model, *flags, "--out", str(tmp_path / "p.json")])
    _, stderr = capsys.readouterr()
    assert (
        caught.value.code == 2 and stderr.startswith(f"sapp-hook profile: error: {message}") and stderr.count("\n") == 1
    )
    assert not (tmp_path / "p.json").exists()
