"""A plan's other parallel degrees against the config it is written into (`sapp_hook.writeback.degrees`), on
the shipped templates and the real configs of tests/fixtures: a config that shards less than the plan assumed
(a smaller tensor, context, expert or FSDP degree, no ZeRO where the plan had it) is refused naming the key and
both values, with the file byte-identical and no backup; one that shards more, or runs another data-parallel
size, is written with a note naming both; a degree left to launch says nothing or, where a launch may change
it, a note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapp_hook.cli import main
from sapp_hook.writeback import check_job, write_config
from sapp_hook.writeback.layout import even_layout
from simulator import InputError
from solver import PipelineSpec

ROOT = Path(__file__).parent.parent
TEMPLATES = ROOT / "sapp_hook" / "templates"
FIXTURES = Path(__file__).parent / "fixtures"
PREDICTED = "the plan's times and memory were predicted for that layout, not this one"
LESS = "which shards less: each device would hold more than the plan's memory check counted."


def config(tmp_path: Path, source: Path, *edits: tuple[str, str]) -> Path:
    """A copy of `source`, each (old, new) of `edits` replaced once (the old text must be there)."""
    text = source.read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / source.name
    path.write_text(text, encoding="utf-8")
    return path


def layout(body_layers: int = 8, pipeline_parallel: int = 4, micro_batches: int = 8, **degrees):
    return even_layout(
        PipelineSpec(pipeline_parallel=pipeline_parallel, micro_batches=micro_batches, **degrees), body_layers
    )


def refused(target: str, path: Path | str, plan) -> str:
    """The error writing `plan` raises; the config and its backup as they were."""
    file = Path(str(path).split(":")[0])
    backup = Path(f"{file}.sapp-hook.bak")
    before, backed_up = file.read_bytes(), backup.read_bytes() if backup.exists() else None
    with pytest.raises(InputError) as caught:
        write_config(target, path, plan)
    assert file.read_bytes() == before
    assert (backup.read_bytes() if backup.exists() else None) == backed_up
    return str(caught.value)


def written(target: str, path: Path | str, plan) -> list[str]:
    """The notes of writing `plan` (the config then says it: a second write changes nothing)."""
    notes = write_config(target, path, plan).notes
    assert write_config(target, path, plan, dry_run=True).diff == ""
    return notes


# -- Megatron-LM ---------------------------------------------------------------------------------

MEGATRON = TEMPLATES / "megatron_llama.sh"


def test_megatron_refuses_a_tensor_parallel_2_plan_for_a_script_at_1(tmp_path):
    path = config(tmp_path, MEGATRON)
    assert refused("megatron", path, layout(tensor_parallel=2)) == (
        f"--plan: is for tensor parallel 2 (solved with --tensor-parallel 2); {path}'s "
        f"--tensor-model-parallel-size is 1, {LESS} Solve again with --tensor-parallel 1, or set "
        "--tensor-model-parallel-size to 2"
    )


def test_megatron_writes_a_tensor_parallel_1_plan_into_a_script_at_2_with_a_note(tmp_path):
    path = config(tmp_path, MEGATRON, ("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 2"))
    notes = written("megatron", path, layout())
    assert (
        f"{path}'s --tensor-model-parallel-size is 2; the plan is for tensor parallel 1 (solved with "
        f"--tensor-parallel 1): {PREDICTED}"
    ) in notes
    assert "--tensor-model-parallel-size 2" in path.read_text()  # the config's degree stays


def test_megatron_context_and_expert_sizes_below_the_plans_are_refused(tmp_path):
    path = config(
        tmp_path,
        MEGATRON,
        ("--tensor-model-parallel-size 1 \\", "--tensor-model-parallel-size 1 \\\n    --context-parallel-size 2 \\"),
    )
    assert refused("megatron", path, layout(context_parallel=4)).startswith(
        f"--plan: is for context parallel 4 (solved with --context-parallel 4); {path}'s --context-parallel-size "
        f"is 2, {LESS} Solve again with --context-parallel 2, or set --context-parallel-size to 4"
    )
    path = config(
        tmp_path,
        MEGATRON,
        (
            "--tensor-model-parallel-size 1 \\",
            "--tensor-model-parallel-size 1 \\\n    --expert-model-parallel-size 2 \\",
        ),
    )
    assert "--expert-model-parallel-size is 2, which shards less" in refused(
        "megatron", path, layout(data_parallel=4, expert_parallel=4)
    )


def test_megatron_zero_plan_needs_the_distributed_optimizer(tmp_path):
    path = config(tmp_path, MEGATRON)
    assert refused("megatron", path, layout(data_parallel=2, zero_stage=1)) == (
        f"--plan: is for ZeRO stage 1 over 2 data-parallel ranks; {path}'s --use-distributed-optimizer is not "
        f"passed (no ZeRO sharding), {LESS} Solve again with --zero-stage 0, or pass --use-distributed-optimizer"
    )
    path = config(tmp_path, MEGATRON, ("    --bf16 \\", "    --use-distributed-optimizer \\\n    --bf16 \\"))
    assert written("megatron", path, layout(data_parallel=2, zero_stage=1)) == [
        "--global-batch-size 16 and --micro-batch-size 2 make the plan's 8 micro-batches per step at data-parallel size 1"
    ]
    notes = written("megatron", path, layout(data_parallel=2))
    assert (
        f"{path}'s --use-distributed-optimizer is passed (ZeRO stage 1: optimizer state only); the plan is for no "
        f"ZeRO sharding (optimizer state whole on every rank): {PREDICTED}"
    ) in notes
    # the distributed optimizer shards optimizer state only: a ZeRO-3 plan holds less than the job
    assert refused("megatron", path, layout(data_parallel=2, zero_stage=3)).endswith(
        f"{path}'s --use-distributed-optimizer is passed (ZeRO stage 1: optimizer state only), {LESS} "
        "Solve again with --zero-stage 1"
    )


def test_megatron_degrees_a_launch_may_change_get_a_note_not_a_refusal(tmp_path):
    path = config(
        tmp_path,
        MEGATRON,
        ("GPUS_PER_NODE=4", 'GPUS_PER_NODE=4\nTP="${TP:-1}"'),
        ("--tensor-model-parallel-size 1", "--tensor-model-parallel-size $TP"),
    )
    notes = written("megatron", path, layout(tensor_parallel=2))
    assert (
        f"{path}'s --tensor-model-parallel-size is $TP (= 1) (unless TP is set where the script is launched); the "
        "plan is for tensor parallel 2 (solved with --tensor-parallel 2); launch it with the plan's or solve again "
        "for the config's"
    ) in notes
    # flags known only at launch may pass the distributed optimizer: its absence states nothing
    path = config(tmp_path, MEGATRON, ("    --lr 3e-4", "    --lr 3e-4 \\\n    $EXTRA_ARGS"))
    notes = written("megatron", path, layout(data_parallel=2, zero_stage=1))
    assert not [note for note in notes if "distributed-optimizer" in note]


def test_megatron_fixture_at_expert_parallel_2_with_the_distributed_optimizer(tmp_path):
    """mixtral_moe.sh (bash arrays) passes --expert-model-parallel-size 2 and --use-distributed-optimizer."""
    path = config(tmp_path, FIXTURES / "megatron" / "mixtral_moe.sh")
    assert refused("megatron", path, layout(data_parallel=4, expert_parallel=4)) == (
        f"--plan: is for expert parallel 4 (solved with --expert-parallel 4); {path}'s --expert-model-parallel-size "
        f"is 2, {LESS} Solve again with --expert-parallel 2, or set --expert-model-parallel-size to 4"
    )
    notes = written("megatron", path, layout(data_parallel=2, zero_stage=1, expert_parallel=2))
    assert not [note for note in notes if "expert" in note or "distributed-optimizer" in note]


# -- TorchTitan ----------------------------------------------------------------------------------

TITAN = FIXTURES / "torchtitan"


def test_torchtitan_refuses_a_tensor_parallel_2_plan_for_a_config_at_1(tmp_path):
    path = config(tmp_path, TITAN / "debug_model_v0_2.toml")
    assert refused("torchtitan", path, layout(tensor_parallel=2)) == (
        f"--plan: is for tensor parallel 2 (solved with --tensor-parallel 2); {path}'s "
        f"parallelism.tensor_parallel_degree is 1, {LESS} Solve again with --tensor-parallel 1, or set "
        "parallelism.tensor_parallel_degree to 2"
    )
    assert "parallelism.context_parallel_degree is 1, which shards less" in refused(
        "torchtitan", path, layout(context_parallel=2)
    )


def test_torchtitan_writes_a_tensor_parallel_1_plan_into_a_config_at_8_with_a_note(tmp_path):
    path = config(tmp_path, TITAN / "llama3_405b_2025_02.toml")
    notes = written("torchtitan", path, layout())
    assert (
        f"{path}'s parallelism.tensor_parallel_degree is 8; the plan is for tensor parallel 1 (solved with "
        f"--tensor-parallel 1): {PREDICTED}"
    ) in notes
    notes = written("torchtitan", path, layout(tensor_parallel=8))
    assert not [note for note in notes if "tensor_parallel_degree" in note]


def test_torchtitan_data_parallel_is_a_note_and_fsdp_over_fewer_ranks_a_refusal(tmp_path):
    path = config(tmp_path, TEMPLATES / "torchtitan_llama.toml")
    notes = written("torchtitan", path, layout(data_parallel=2))
    assert (
        f"{path}'s parallelism.data_parallel_shard_degree is 1; the plan is for data parallel 2 (solved with "
        f"--data-parallel 2): {PREDICTED}"
    ) in notes
    path = config(tmp_path, TEMPLATES / "torchtitan_llama.toml")
    assert refused("torchtitan", path, layout(data_parallel=2, fsdp=True)) == (
        f"--plan: is for FSDP over 2 ranks (solved with --fsdp --data-parallel 2); {path}'s "
        f"parallelism.data_parallel_shard_degree is 1, {LESS} Solve again with no --fsdp, or set "
        "parallelism.data_parallel_shard_degree to 2"
    )


def test_torchtitan_leaves_a_degree_set_at_launch_unsaid(tmp_path):
    """data_parallel_shard_degree -1 is the ranks left at launch: neither FSDP nor data parallel is stated."""
    path = config(tmp_path, TITAN / "debug_model_v0_2.toml")
    notes = written("torchtitan", path, layout(data_parallel=4, fsdp=True))
    assert not [note for note in notes if "predicted for" in note or "FSDP" in note]


def test_torchtitan_python_config_refuses_a_tensor_parallel_2_plan(tmp_path):
    path = config(tmp_path, TITAN / "qwen3_config_registry_2026_05.py")
    target = f"{path}:qwen3_14b"
    assert refused("torchtitan", target, layout(tensor_parallel=2)) == (
        f"--plan: is for tensor parallel 2 (solved with --tensor-parallel 2); {path}: qwen3_14b's "
        f"parallelism.tensor_parallel_degree is 1, {LESS} Solve again with --tensor-parallel 1, or set "
        "parallelism.tensor_parallel_degree to 2"
    )


# -- MindFormers ---------------------------------------------------------------------------------

MINDFORMERS = FIXTURES / "mindformers"


def test_mindformers_refuses_a_tensor_parallel_2_plan_for_a_config_at_1(tmp_path):
    path = config(tmp_path, TEMPLATES / "mindformers_llama.yaml")
    assert refused("mindformers", path, layout(tensor_parallel=2)) == (
        f"--plan: is for tensor parallel 2 (solved with --tensor-parallel 2); {path}'s "
        f"parallel_config.model_parallel is 1, {LESS} Solve again with --tensor-parallel 1, or set "
        "parallel_config.model_parallel to 2"
    )
    path = config(tmp_path, TEMPLATES / "mindformers_v2_llama.yaml")
    assert "distribute_parallel_config.tensor_model_parallel_size is 1, which shards less" in refused(
        "mindformers", path, layout(tensor_parallel=2)
    )


def test_mindformers_writes_a_tensor_parallel_1_plan_into_a_config_at_4_with_a_note(tmp_path):
    path = config(tmp_path, MINDFORMERS / "qwen3_32b_pretrain.yaml")
    notes = written("mindformers", path, layout(body_layers=64, micro_batches=4))
    assert (
        f"{path}'s parallel_config.model_parallel is 4; the plan is for tensor parallel 1 (solved with "
        f"--tensor-parallel 1): {PREDICTED}"
    ) in notes
    assert "parallel_config.model_parallel is 4, which shards less" in refused(
        "mindformers", path, layout(body_layers=64, micro_batches=4, tensor_parallel=8)
    )


def test_mindformers_data_parallel_is_a_note_unless_zero_shards_over_it(tmp_path):
    path = config(tmp_path, MINDFORMERS / "llama2_13b_select_ops.yaml")
    notes = written("mindformers", path, layout(body_layers=40, pipeline_parallel=2, micro_batches=128))
    assert (
        f"{path}'s parallel_config.data_parallel is 8; the plan is for data parallel 1 (solved with "
        f"--data-parallel 1): {PREDICTED}"
    ) in notes
    plan = layout(body_layers=40, pipeline_parallel=2, micro_batches=128, data_parallel=16, zero_stage=1)
    assert refused("mindformers", path, plan) == (
        f"--plan: is for data parallel 16 with ZeRO stage 1 (solved with --data-parallel 16); {path}'s "
        f"parallel_config.data_parallel is 8, {LESS} Solve again with --data-parallel 8, or set "
        "parallel_config.data_parallel to 16"
    )


def test_mindformers_zero_plan_needs_the_parallel_optimizer(tmp_path):
    path = config(
        tmp_path,
        TEMPLATES / "mindformers_llama.yaml",
        ("  data_parallel: 1", "  data_parallel: 2"),
        ("  full_batch: True", "  full_batch: True\n  enable_parallel_optimizer: False"),
    )
    assert refused("mindformers", path, layout(data_parallel=2, zero_stage=1)) == (
        f"--plan: is for ZeRO stage 1 over 2 data-parallel ranks; {path}'s parallel.enable_parallel_optimizer is "
        f"False, {LESS} Solve again with --zero-stage 0, or set parallel.enable_parallel_optimizer to True"
    )
    assert written("mindformers", path, layout(data_parallel=2)) == []  # shards as the plan does: nothing to say


def test_the_hook_check_names_the_config_that_does_not_fit(tmp_path):
    path = config(tmp_path, TEMPLATES / "mindformers_llama.yaml")
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, tensor_parallel=2)
    with pytest.raises(InputError) as caught:
        check_job("mindformers", path, spec, 8, config_field="SAPP_HOOK_CONFIG")
    assert str(caught.value).startswith(
        f"SAPP_HOOK_CONFIG: {path} does not fit this job: the plan is for tensor parallel 2 (solved with "
        f"--tensor-parallel 2); {path}'s parallel_config.model_parallel is 1"
    )
    check_job("mindformers", path, PipelineSpec(pipeline_parallel=4, micro_batches=8), 8, config_field="X")


@pytest.mark.parametrize(
    ("target", "source"),
    [
        ("megatron", MEGATRON),
        ("torchtitan", TITAN / "debug_model_v0_2.toml"),
        ("mindformers", TEMPLATES / "mindformers_llama.yaml"),
    ],
)
def test_apply_exits_2_on_a_plan_for_more_tensor_parallel_ranks(tmp_path, capsys, target, source):
    path = config(tmp_path, source)
    before = path.read_bytes()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(dict(layout(tensor_parallel=2).plan_data)))
    with pytest.raises(SystemExit) as caught:
        main(["apply", "--plan", str(plan_file), "--target", target, "--config", str(path)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1
    assert err.startswith("sapp-hook apply: error: --plan: is for tensor parallel 2 (solved with --tensor-parallel 2)")
    assert path.read_bytes() == before and not (tmp_path / f"{path.name}.sapp-hook.bak").exists()
