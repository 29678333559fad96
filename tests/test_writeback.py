"""Writing plans into MindFormers YAML, Megatron-LM launch scripts, TorchTitan TOML and plain files:
each round-trips, keeps what was there, and refuses what does not match."""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomlkit
import yaml
from solver_cases import layer, small_profile

import sapp_hook
from basics.documents import read_document
from sapp_hook.writeback import layout_from_dict, layout_of, write_config
from sapp_hook.writeback.megatron.writer import FIRST, LAST, LAYOUT, layout_string, parse_layout, split_flags
from simulator import InputError
from solver import ModelProfile, PipelineSpec, evaluate_plan
from solver.formats.mindformers import mindformers_keys
from solver.vocabulary.load import read_plan_json

CONFIGS = Path(__file__).parents[1] / "sapp_hook" / "templates"
FILES = {
    "mindformers": "mindformers_llama.yaml",
    "megatron": "megatron_llama.sh",
    "torchtitan": "torchtitan_llama.toml",
}
TEMPLATE_V2 = "mindformers_v2_llama.yaml"  # MindFormers' llm_template_v2 format
EVERY_FORMAT = pytest.mark.parametrize(
    ("target", "name"), [*FILES.items(), ("mindformers", TEMPLATE_V2)], ids=[*FILES, "mindformers-v2"]
)


def plan(
    modes_per_layer: dict[int, str] | None = None,
    *,
    pipeline_parallel: int = 4,
    chunks: int = 1,
    schedule: str = "1F1B",
    counts: list[int] | None = None,
):
    profile = small_profile(8)  # head, 8 body layers, tail
    spec = PipelineSpec(pipeline_parallel=pipeline_parallel, chunks=chunks, micro_batches=8, schedule=schedule)
    # virtual pipeline_parallel hold the head, 8 body layers and the tail: body [2, 2, 3, 1] with 4 virtual pipeline_parallel
    counts = counts or {2: [5, 5], 4: [3, 2, 3, 2], 8: [2, 1, 1, 1, 1, 1, 2, 1]}[pipeline_parallel * chunks]
    modes = ["none"] * 10
    for index, mode in (modes_per_layer or {}).items():
        modes[index] = mode
    return evaluate_plan(profile, spec, counts, modes)


@pytest.fixture
def config(tmp_path):
    def copy(target: str, name: str | None = None) -> Path:
        path = tmp_path / (name or FILES[target])
        shutil.copy(CONFIGS / path.name, path)
        return path

    return copy


def test_mindformers_round_trip_keeps_comments(config):
    path = config("mindformers")
    chosen = plan({1: "full", 2: "full", 4: "selective"})
    result = write_config("mindformers", path, layout_of(chosen))
    text = path.read_text()
    assert "# parallel settings: the pipeline split lives under model.model_config" in text
    assert "micro_batch_num: 8\n" in text and "offset: [0, 0, 1, -1]" in text
    before = yaml.safe_load((CONFIGS / FILES["mindformers"]).read_text())
    after = yaml.safe_load(text)
    assert after["parallel_config"] == before["parallel_config"] and after["seed"] == before["seed"]
    keys = mindformers_keys(read_document(path, "config"), "config")
    assert {k: keys[k] for k in ("offset", "recompute", "select_recompute")} == {
        k: chosen.mindformers()[k] for k in ("offset", "recompute", "select_recompute")
    }
    assert "pp_interleave_num" not in text  # one chunk: not written
    assert result.backup.read_text() == (CONFIGS / FILES["mindformers"]).read_text()
    assert result.written == [str(path)]


def test_the_backup_keeps_the_users_config_across_writes(config):
    path = config("mindformers")
    original = path.read_text()
    theirs = path.with_name(path.name + ".bak")
    theirs.write_text("the user's own backup")
    first = write_config("mindformers", path, layout_of(plan({1: "full"})))
    second = write_config("mindformers", path, layout_of(plan()))
    assert first.backup == second.backup == path.with_name(path.name + ".sapp-hook.bak")
    assert second.backup.read_text() == original and path.read_text() != original
    assert theirs.read_text() == "the user's own backup"


@pytest.mark.parametrize(("schedule", "scheduler"), [("Interleaved1F1B", "1f1b"), ("ZBVZeroBubble", "zero_bubble_v")])
def test_mindformers_interleaved_writes_lists_of_lists_and_turns_interleave_on(config, schedule, scheduler):
    path = config("mindformers")
    chosen = plan(chunks=2, schedule=schedule)
    result = write_config("mindformers", path, layout_of(chosen))
    document = yaml.safe_load(path.read_text())
    model_config = document["model"]["model_config"]
    assert model_config["offset"] == chosen.mindformers()["offset"] and model_config["pp_interleave_num"] == 2
    # without pipeline_interleave MindFormers takes pp_interleave_num as 1
    assert document["parallel"]["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": scheduler}
    said = any("pipeline_scheduler 1f1b -> zero_bubble_v" in note for note in result.notes)
    assert said == (schedule == "ZBVZeroBubble")


@pytest.mark.parametrize(("schedule", "scheduler"), [("1F1B", "1f1b"), ("GPipe", "gpipe")])
def test_mindformers_one_chunk_schedules(config, schedule, scheduler):
    path = config("mindformers")
    result = write_config("mindformers", path, layout_of(plan(schedule=schedule)))
    pipeline = yaml.safe_load(path.read_text())["parallel"]["pipeline_config"]
    assert pipeline == {"pipeline_interleave": False, "pipeline_scheduler": scheduler}
    assert any("pipeline_scheduler 1f1b -> gpipe" in note for note in result.notes) == (schedule == "GPipe")
    # without a pipeline_config MindSpore runs 1f1b: a 1F1B plan adds none
    path.write_text("parallel_config:\n  pipeline_stage: 4\nmodel:\n  model_config:\n    num_layers: 8\n")
    write_config("mindformers", path, layout_of(plan(schedule=schedule)))
    assert ("parallel" in yaml.safe_load(path.read_text())) == (schedule != "1F1B")


def test_mindformers_micro_batches_are_the_plans_and_a_change_is_said(config):
    path = config("mindformers")  # micro_batch_num 8, as the plan
    assert not write_config("mindformers", path, layout_of(plan())).notes
    path.write_text(path.read_text().replace("  micro_batch_num: 8\n", ""))
    notes = write_config("mindformers", path, layout_of(plan())).notes
    assert yaml.safe_load(path.read_text())["parallel_config"]["micro_batch_num"] == 8
    assert any("micro_batch_num unset (1) -> 8" in note for note in notes)


def test_mindformers_template_v2_gets_the_plan_where_it_keeps_it(config):
    path = config("mindformers", TEMPLATE_V2)
    chosen = plan({1: "full", 2: "full", 4: "selective"})
    result = write_config("mindformers", path, layout_of(chosen))
    text = path.read_text()
    assert "# the pipeline split lives here" in text and "pipeline_stage_offset: [0, 0, 1, -1]" in text
    before = yaml.safe_load((CONFIGS / TEMPLATE_V2).read_text())
    after = yaml.safe_load(text)
    # no classic sections: llm_template_v2 refuses keys it does not know in its own sections
    assert set(after) == set(before) and after["model_config"] == before["model_config"]
    pipeline = after["distribute_parallel_config"]["pipeline_parallel_config"]
    assert pipeline == {
        "pipeline_interleave": False,
        "pipeline_scheduler": "1f1b",
        "virtual_pipeline_model_parallel_size": 1,
        "pipeline_stage_offset": [0, 0, 1, -1],
    }
    assert after["recompute_config"] == {
        "recompute": [2, 0, 0, 0],
        "select_recompute": [2, 1, 0, 0],
        "select_comm_recompute": False,
    }
    keys = mindformers_keys(read_document(path, "config"), "config")  # read back as `simulate --mindformers-plan` does
    assert {k: keys[k] for k in ("offset", "recompute", "select_recompute", "pp_interleave_num")} == {
        k: chosen.mindformers()[k] for k in ("offset", "recompute", "select_recompute", "pp_interleave_num")
    }
    assert not result.notes  # global_batch_size 8 = the plan's 8 micro-batches at data_parallel_size 1


@pytest.mark.parametrize(
    ("schedule", "chunks", "scheduler"),
    [("Interleaved1F1B", 2, "1f1b"), ("ZBVZeroBubble", 2, "zero_bubble_v"), ("GPipe", 1, "gpipe")],
)
def test_mindformers_template_v2_schedules(config, schedule, chunks, scheduler):
    path = config("mindformers", TEMPLATE_V2)
    chosen = plan(pipeline_parallel=4, chunks=chunks, schedule=schedule)
    result = write_config("mindformers", path, layout_of(chosen))
    pipeline = yaml.safe_load(path.read_text())["distribute_parallel_config"]["pipeline_parallel_config"]
    assert (
        pipeline["pipeline_interleave"] == (chunks > 1) and pipeline["virtual_pipeline_model_parallel_size"] == chunks
    )
    assert pipeline["pipeline_stage_offset"] == chosen.mindformers()["offset"]
    assert pipeline["pipeline_scheduler"] == scheduler
    assert any(f"pipeline_scheduler 1f1b -> {scheduler}" in note for note in result.notes) == (scheduler != "1f1b")


def comm_plan(modes: dict[int, str]):
    """Four stages of two body layers with MindFormers' five recompute types."""
    body = {
        "none": (0.0, 40.0, 4.0),
        "comm": (0.5, 30.0, 4.0),
        "selective": (1.0, 22.0, 4.0),
        "selective+comm": (1.5, 15.0, 4.0),
        "full": (3.0, 5.0, 30.0),
    }
    layers = [
        layer("embed", "head", 1.0, 2.0),
        *(layer(f"block.{i}", "body:decoder", 3.0, 6.0, modes=body) for i in range(8)),
        layer("lm_head", "tail", 5.0, 10.0),
    ]
    profile = ModelProfile(layers=tuple(layers), model="five-types")
    chosen = ["none"] * 10
    for index, mode in modes.items():
        chosen[index] = mode
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B")
    return evaluate_plan(profile, spec, [3, 2, 2, 3], chosen)


@pytest.mark.parametrize(
    ("modes", "comm", "side_file"),
    [
        ({1: "full", 8: "full"}, False, False),  # full recompute takes the communication with it
        ({i: "comm" for i in range(1, 9)} | {3: "selective+comm", 8: "full"}, True, False),  # all not fully recomputed
        ({1: "comm", 3: "selective+comm"}, True, True),  # some layers only: true for all, said, and the side file
    ],
)
def test_mindformers_template_v2_communication_recompute_is_one_bool(config, modes, comm, side_file):
    path = config("mindformers", TEMPLATE_V2)
    chosen = comm_plan(modes)
    result = write_config("mindformers", path, layout_of(chosen))
    recompute = yaml.safe_load(path.read_text())["recompute_config"]
    assert recompute["select_comm_recompute"] is comm
    full = chosen.mindformers()["recompute"]
    assert recompute["recompute"] == (full if any(full) else False)  # the template's false already says none
    side = path.with_name(path.name + ".sapp-hook.json")
    assert side.exists() == side_file
    assert any("true or false only" in note for note in result.notes) == side_file
    if side_file:
        assert layout_from_dict(json.loads(side.read_text())).layers == layout_of(chosen).layers


DATA_PARALLEL, GLOBAL_BATCH = "  data_parallel_size: 1\n", "  global_batch_size: 8 "


@pytest.mark.parametrize(
    ("edits", "outcome", "refused"),
    [
        ([(DATA_PARALLEL, "  data_parallel_size: 2\n")], "data_parallel_size 2, MindFormers runs 4", True),
        ([(DATA_PARALLEL, "")], "make the plan's 8 micro-batches per step at data-parallel size 1", False),
        ([(GLOBAL_BATCH, "  global_batch_size: 24 ")], "MindFormers runs 24", True),
        (
            [(DATA_PARALLEL, ""), (GLOBAL_BATCH, "  global_batch_size: 7 ")],
            "MindFormers runs 7 // data-parallel size: 8 at none",
            True,
        ),
        # left unset, MindFormers' defaults: 512 and 1
        (
            [(DATA_PARALLEL, ""), ("  micro_batch_size: 1\n", ""), (GLOBAL_BATCH, "  seed: 1 ")],
            (
                "training_args.global_batch_size 512 (unset: the default), training_args.micro_batch_size 1 (unset: the "
                "default) and distribute_parallel_config.micro_batch_interleave_num 1 make the plan's 8 micro-batches per step "
                "at data-parallel size 64"
            ),
            False,
        ),
    ],
)
def test_mindformers_template_v2_batch_sizes_make_the_plans_micro_batches(config, edits, outcome, refused):
    path = config("mindformers", TEMPLATE_V2)
    text = path.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    path.write_text(text)
    if refused:
        with pytest.raises(InputError, match=re.escape(outcome)) as caught:
            write_config("mindformers", path, layout_of(plan()))
        assert caught.value.field == "--plan" and path.read_text() == text
    else:
        assert any(outcome in note for note in write_config("mindformers", path, layout_of(plan())).notes)


def test_megatron_layout_round_trips(config):
    path = config("megatron")
    chosen = plan({1: "full", 3: "full", 5: "full", 8: "full"})  # the first body layer of every stage
    write_config("megatron", path, layout_of(chosen))
    text = path.read_text()
    assert '--pipeline-model-parallel-size 4 \\\n    --pipeline-model-parallel-layout "Ett|tt|t*3|tL" \\\n' in text
    assert parse_layout(_flag(text, "--pipeline-model-parallel-layout")) == [2, 2, 3, 1]
    assert "--decoder-first-pipeline-num-layers" not in text and "--recompute-activations" not in text
    assert "--recompute-granularity full \\" in text and "--recompute-num-layers 1 \\" in text
    assert os.access(path, os.X_OK)  # still a runnable script
    assert text.splitlines()[0] == "#!/bin/bash" and "--lr 3e-4" in text


@pytest.mark.parametrize(
    ("counts", "flags"),
    [
        ([3, 2, 2, 3], []),
        ([2, 3, 3, 2], [(FIRST, "1"), (LAST, "1")]),
        ([6, 1, 1, 2], [(FIRST, "5")]),
        ([2, 1, 1, 6], [(LAST, "5")]),
        ([3, 2, 3, 2], None),
        ([1, 4, 4, 1], None),
    ],
)
def test_megatron_first_and_last_stage_flags_where_they_say_the_split(counts, flags):
    # counts hold the head on the first virtual stage and the tail on the last
    assert split_flags(layout_of(plan(counts=counts))) == flags
    assert (
        split_flags(layout_of(plan(pipeline_parallel=2, chunks=2, schedule="Interleaved1F1B", counts=[3, 2, 2, 3])))
        is None
    )


def test_megatron_gets_first_and_last_stage_flags_in_place_of_a_layout(config):
    path = config("megatron")
    write_config("megatron", path, layout_of(plan(counts=[3, 2, 3, 2])))
    assert f"{LAYOUT} " in path.read_text()
    write_config("megatron", path, layout_of(plan(counts=[2, 3, 3, 2])))  # one layer fewer on the ends
    text = path.read_text()
    assert f"{FIRST} 1 \\\n    {LAST} 1 \\\n" in text and LAYOUT not in text
    write_config("megatron", path, layout_of(plan(counts=[3, 2, 3, 2])))  # and back: no flag of both ways left
    assert _flag(path.read_text(), LAYOUT) == '"Ett|tt|t*3|tL"' and FIRST not in path.read_text()


@pytest.mark.parametrize(
    ("global_batch", "outcome"),
    [("16", "at data-parallel size 1"), ("32", "at data-parallel size 2"), ("12", "8 at no data-parallel size")],
)
def test_megatron_batch_sizes_make_the_plans_micro_batches(config, global_batch, outcome):
    path = config("megatron")  # --micro-batch-size 2; the plan runs 8 micro-batches
    path.write_text(path.read_text().replace("--global-batch-size 16", f"--global-batch-size {global_batch}"))
    if global_batch == "12":
        with pytest.raises(InputError, match=outcome):
            write_config("megatron", path, layout_of(plan()))
    else:
        assert any(outcome in note for note in write_config("megatron", path, layout_of(plan())).notes)


def test_megatron_arguments_file(tmp_path):
    path = tmp_path / "args.txt"
    path.write_text("--num-layers 8\n--pipeline-model-parallel-size 4\n--bf16\n")
    write_config("megatron", path, layout_of(plan()))
    assert (
        path.read_text()
        == "--num-layers 8\n--pipeline-model-parallel-size 4\n--pipeline-model-parallel-layout Ett|tt|t*3|tL\n--bf16\n"
    )


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        # a bash array, one flag per line, some with "="
        (
            "ARGS=(\n    --pipeline-model-parallel-size=4\n    --recompute-granularity full --recompute-method uniform\n)\n",
            'ARGS=(\n    --pipeline-model-parallel-size=4\n    --pipeline-model-parallel-layout "Ett|tt|t*3|tL"\n)\n',
        ),
        # everything on one line, the stage count in a variable: written, and said
        (
            "#!/bin/sh\ntorchrun train.py --pipeline-model-parallel-size $PP --lr 1\n",
            '#!/bin/sh\ntorchrun train.py --pipeline-model-parallel-size $PP --pipeline-model-parallel-layout "Ett|tt|t*3|tL" --lr 1\n',
        ),
    ],
)
def test_megatron_scripts_of_other_shapes(tmp_path, script, expected):
    path = tmp_path / "launch.sh"
    path.write_text(script)
    result = write_config("megatron", path, layout_of(plan()))
    assert path.read_text() == expected
    assert ("$PP" in script) == any("is $PP" in note for note in result.notes)


@pytest.mark.parametrize(
    "script",
    [
        (CONFIGS / "megatron_llama.sh").read_text(),
        # Megatron's older examples: the flags in a double-quoted string, expanded unquoted
        (
            '#!/bin/bash\nGPT_ARGS="\n    --num-layers 8 \\\n    --pipeline-model-parallel-size 4 \\\n    --lr 1\n"\n'
            "torchrun pretrain_gpt.py $GPT_ARGS\n"
        ),
        # one line, in a variable (the layout went after its closing quote: a broken script)
        '#!/bin/bash\nPARALLEL="--pipeline-model-parallel-size 4"  # the pipeline\ntorchrun pretrain_gpt.py $PARALLEL --lr 1\n',
        "#!/bin/bash\nPARALLEL='--pipeline-model-parallel-size 4'\ntorchrun pretrain_gpt.py $PARALLEL --lr 1\n",
        # a bash array, as Megatron's current examples
        "#!/bin/bash\nARGS=(\n    --pipeline-model-parallel-size 4\n)\ntorchrun pretrain_gpt.py ${ARGS[@]} --lr 1\n",
    ],
)
def test_megatron_gets_the_layout_as_one_argument_from_any_script_shape(tmp_path, script):
    """Run the rewritten script in bash, with torchrun printing the arguments Megatron would get."""
    path = tmp_path / "launch.sh"
    path.write_text(script)
    write_config("megatron", path, layout_of(plan({1: "full", 3: "full", 5: "full", 8: "full"})))
    done = subprocess.run(
        ["bash", "-c", 'torchrun() { printf "%s\\n" "$@"; }; . "$0"', str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    arguments = done.stdout.splitlines()
    assert arguments[arguments.index("--pipeline-model-parallel-layout") + 1] == "Ett|tt|t*3|tL"
    assert arguments[arguments.index("--recompute-num-layers") + 1] == "1"
    assert arguments.count("--pipeline-model-parallel-size") == 1 and "--lr" in arguments


def test_megatron_cannot_vary_recompute_per_stage_and_says_so(config):
    path = config("megatron")
    chosen = layout_of(plan({1: "full", 2: "full"}))
    result = write_config("megatron", path, chosen)
    assert "--recompute-num-layers 2" in path.read_text()
    assert any("same number of layers on every stage" in note for note in result.notes)
    side = path.with_name(path.name + ".sapp-hook.json")
    assert str(side) in result.written
    assert layout_from_dict(read_plan_json(side, "plan")) == chosen  # the plan JSON, as apply --plan reads it


def test_selective_recompute_is_the_profiles_where_a_target_can_say_it_and_said_where_not(config):
    every = {layer: "selective" for layer in range(1, 9)}
    path = config("torchtitan")
    notes = write_config("torchtitan", path, layout_of(plan(every))).notes
    checkpoint = tomlkit.parse(path.read_text())["activation_checkpoint"]
    assert checkpoint["mode"] == "selective" and checkpoint["selective_ac_option"] == "op"  # not every 2nd block
    assert any("recomputes every second matmul" in note for note in notes)
    path = config("megatron")
    notes = write_config("megatron", path, layout_of(plan(every))).notes
    assert "--recompute-granularity selective" in path.read_text()
    assert any("is not the selective recompute the profile measured" in note for note in notes)


def test_megatron_interleaved_layout_is_vpp_major():
    chosen = plan(chunks=2, schedule="Interleaved1F1B")
    assert layout_string(layout_of(chosen)) == "Et|t|t|t|t|t|tt|L"
    assert parse_layout("Et*3|(tt|)*2,t|L") == [3, 2, 2, 1, 0]


def test_torchtitan_module_names_schedule_and_checkpointing(config):
    path = config("torchtitan")
    result = write_config("torchtitan", path, layout_of(plan({1: "selective", 5: "full"})))
    document = tomlkit.parse(path.read_text())
    parallelism = document["parallelism"]
    assert parallelism["module_fqns_per_model_part"] == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "layers.5", "layers.6"],
        ["layers.7", "norm", "output"],
    ]
    # local_batch_size 16 in 8 micro-batches; no num_pp_microbatches, a key TorchTitan's TOML reader refuses
    assert parallelism["pipeline_parallel_microbatch_size"] == 2 and "num_pp_microbatches" not in parallelism
    assert "pipeline_parallel_first_stage_less_layers" not in parallelism
    assert document["activation_checkpoint"]["mode"] == "full"
    assert "# applied to every block" in path.read_text() and "[training]" in path.read_text()
    assert any("checkpoints every block alike" in note for note in result.notes)


@pytest.mark.parametrize(
    ("edit", "outcome"),
    [
        (("local_batch_size = 16", "local_batch_size = 12"), "local_batch_size 12, which does not split into 8"),
        (("local_batch_size = 16\n", ""), "has no training.local_batch_size"),
        (("pipeline_parallel_degree = 4", "pipeline_parallel_degree = 4\nnum_pp_microbatches = 2"), 8),
    ],
)
def test_torchtitan_micro_batches(config, edit, outcome):
    path = config("torchtitan")
    path.write_text(path.read_text().replace(*edit))
    before = path.read_text()
    if isinstance(outcome, str):
        with pytest.raises(InputError, match=outcome):
            write_config("torchtitan", path, layout_of(plan()))
        assert path.read_text() == before
    else:  # a config that already counts them keeps counting them
        write_config("torchtitan", path, layout_of(plan()))
        parallelism = tomlkit.parse(path.read_text())["parallelism"]
        assert parallelism["num_pp_microbatches"] == outcome and "pipeline_parallel_microbatch_size" not in parallelism


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_torchtitan_refuses_recompute_where_the_schedule_splits_the_backward(config, mode):
    path = config("torchtitan")
    before = path.read_bytes()
    recomputing = plan({layer: mode for layer in range(1, 9)}, pipeline_parallel=4, chunks=2, schedule="ZBVZeroBubble")
    with pytest.raises(
        InputError,
        match=r"recomputes layers; TorchTitan runs torch.distributed.pipelining: "
        r"ZBVZeroBubble splits each backward in two",
    ) as caught:
        write_config("torchtitan", path, layout_of(recomputing))
    assert caught.value.field == "--plan" and path.read_bytes() == before
    write_config("torchtitan", path, layout_of(plan(pipeline_parallel=4, chunks=2, schedule="ZBVZeroBubble")))
    document = tomlkit.parse(path.read_text())
    assert document["parallelism"]["pipeline_parallel_schedule"] == "ZBVZeroBubble"
    assert document["activation_checkpoint"]["mode"] == "none"


def test_a_torchtitan_python_config_takes_the_names_the_toml_writer_writes(tmp_path, config):
    """(tests/test_writeback_torchtitan.py covers the Python configs of every era.)"""
    recipe = tmp_path / "llama3_recipe.py"
    recipe.write_text("def llama3_debug():\n    return Trainer.Config()\n")
    chosen = plan({1: "full", 4: "selective"})
    write_config("torchtitan", recipe, layout_of(chosen))
    written = next(
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(recipe.read_text()))
        if isinstance(node, ast.keyword) and node.arg == "pipeline_parallel_module_fqns_per_model_part"
    )
    assert written == sapp_hook.torchtitan_module_names(chosen, head="lm_head")  # current main's head name
    path = config("torchtitan")
    write_config("torchtitan", path, layout_of(chosen))
    written = tomlkit.parse(path.read_text())["parallelism"]["module_fqns_per_model_part"]
    assert sapp_hook.torchtitan_module_names(chosen) == sapp_hook.torchtitan_module_names(chosen.to_dict()) == written


def test_plain_plan_files(tmp_path):
    chosen = layout_of(plan({3: "full"}))
    for name in ("plan.json", "plan.yaml"):
        write_config("plan", tmp_path / name, chosen)
        data = read_document(tmp_path / name, "plan")
        assert [layer["recompute"] for layer in data["plan"]["layers"]][3] == "full"
        assert layout_from_dict(data) == chosen  # the plan JSON again: apply --plan and sapp_hook.apply read it


def test_a_plan_json_says_one_plan():
    data = plan({3: "full"}, pipeline_parallel=2, chunks=2, schedule="Interleaved1F1B").to_dict()
    assert layout_from_dict(data).mindformers == {key: data["plan"][key] for key in layout_from_dict(data).mindformers}
    for key in ("offset", "recompute"):  # the keys are optional; the layers say them
        del data["plan"][key]
    assert layout_from_dict(data).mindformers["recompute"] == [[0, 1], [0, 0]]
    data["plan"]["select_recompute"] = [[0, 0], [0, 0]]  # edited by hand, the layers not
    said = r"plan.select_recompute: is \[\[0, 0\], \[0, 0\]\]; the plan's layers say \[\[0, 1\]"
    with pytest.raises(InputError, match=said):
        layout_from_dict(data)
    del data["plan"]["select_recompute"]
    for edits, field, message in [  # layers 0-2 on virtual stage 0 (the head first), 3-4, 5-7, 8-9 (the tail last)
        ({4: {"kind": "decoder"}}, "plan.layers[4].kind", "expected head, tail or body:<type>, got 'decoder'"),
        ({4: {"kind": "tail"}}, "plan.layers[5].kind", "a body layer must come before every tail layer"),
        (
            {i: {"virtual_stage": 1} for i in range(3)},
            "plan.layers[0].virtual_stage",
            "a head layer belongs on the first virtual stage",
        ),
    ]:
        damaged = copy.deepcopy(data)
        for index, edit in edits.items():
            damaged["plan"]["layers"][index].update(edit)
        with pytest.raises(InputError, match=re.escape(f"{field}: {message}")):
            layout_from_dict(damaged)
    data["spec"]["schedule"] = "Interleaved2F2B"
    with pytest.raises(InputError, match=r"spec.schedule: expected one of GPipe"):
        layout_from_dict(data)


def test_dry_run_prints_the_diff_and_writes_nothing(config):
    path = config("torchtitan")
    before = path.read_text()
    result = write_config("torchtitan", path, layout_of(plan()), dry_run=True)
    assert path.read_text() == before and result.written == [] and result.backup is None
    assert "+module_fqns_per_model_part" in result.diff and "-pipeline_parallel_first_stage_less_layers" in result.diff


@EVERY_FORMAT
def test_a_failure_between_write_and_rename_leaves_the_old_file(config, target, name, monkeypatch):
    path = config(target, name)
    before = path.read_bytes()

    def broken_rename(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_rename)
    with pytest.raises(InputError, match="left as it was"):
        write_config(target, path, layout_of(plan()))
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".bak")) == [path.name]


@pytest.mark.parametrize(
    ("target", "name", "said"),
    [
        (
            "mindformers",
            FILES["mindformers"],
            (
                "parallel_config.pipeline_stage was 4; set to the plan's 2: the job then "
                "takes data_parallel x model_parallel x 2 = 2 devices (was 4); for 4 set data_parallel to 2"
            ),
        ),
        (
            "mindformers",
            TEMPLATE_V2,
            "distribute_parallel_config.pipeline_model_parallel_size was 4; set to the plan's 2",
        ),
    ],
    ids=["mindformers", "mindformers-v2"],
)
def test_a_plan_for_another_stage_count_sets_the_configs(config, target, name, said):
    """As TorchTitan's and Megatron's configs do (their own test files): the plan's pipeline size, with the
    device count it then takes."""
    path = config(target, name)
    result = write_config(target, path, layout_of(plan(pipeline_parallel=2, chunks=2, schedule="Interleaved1F1B")))
    assert any(note.startswith(said) for note in result.notes), result.notes
    data = yaml.safe_load(path.read_text())
    stages = (
        data["parallel_config"]["pipeline_stage"]
        if name != TEMPLATE_V2
        else data["distribute_parallel_config"]["pipeline_model_parallel_size"]
    )
    assert stages == 2


@pytest.mark.parametrize(
    ("target", "name", "declared", "said"),
    [
        ("mindformers", None, "num_layers: 9", "num_layers 9"),
        ("mindformers", TEMPLATE_V2, "num_hidden_layers: 9", "num_hidden_layers 9"),
        # MindFormers spreads the multi-token-prediction layers with the decoder layers
        (
            "mindformers",
            TEMPLATE_V2,
            "num_hidden_layers: 8\n  mtp_num_layers: 1",
            "num_hidden_layers 8 + mtp_num_layers 1",
        ),
        # classic: research/deepseek3's mtp_depth (LayerSetting(num_layers + mtp_depth, ...)), parallel_core's key
        ("mindformers", None, "num_layers: 8\n    mtp_depth: 1", "num_layers 8 + mtp_depth 1"),
        ("mindformers", None, "num_layers: 8\n    mtp_num_layers: 1", "num_layers 8 + mtp_num_layers 1"),
        ("megatron", None, "--num-layers 9", "--num-layers 9"),
    ],
)
def test_a_plan_for_another_layer_count_is_refused(config, target, name, declared, said):
    path = config(target, name)
    text = path.read_text()
    place = declared.split("\n")[0].replace("9", "8")
    assert place in text
    path.write_text(text.replace(place, declared))
    before = path.read_bytes()
    with pytest.raises(InputError, match=f"places 8 decoder layers; .*{re.escape(said)}$") as caught:
        write_config(target, path, layout_of(plan()))
    assert caught.value.field == "--plan" and path.read_bytes() == before
    if "mtp" in declared:  # 7 decoder layers and an MTP layer: the plan's 8
        path.write_text(text.replace(place, declared.replace(": 8", ": 7")))
        assert write_config(target, path, layout_of(plan())).written == [str(path)]


@pytest.mark.parametrize(
    ("target", "content", "message"),
    [
        ("megatron", "python train.py --num-layers 8\n", "has no --pipeline-model-parallel-size"),
        ("torchtitan", "[training]\nsteps = 1\n", "has no [parallelism] table"),
        ("torchtitan", "[parallelism\n", "is not valid TOML"),
        (
            "mindformers",
            "model:\n  arch: {type: X}\nparallel_config: {pipeline_stage: 4}\n",
            "lacks the section model.model_config",
        ),
        (
            "mindformers",
            "distribute_parallel_config: 4\n",
            "distribute_parallel_config is the int 4; expected a mapping",
        ),
        ("mindformers", "model_config: {}\nrecompute_config: [1]\n", "recompute_config is a list; expected a mapping"),
        ("mindformers", "model_config: {}\nmodel_config: {}\n", "line 2: key 'model_config' repeats the one on line 1"),
        ("mindformers", '{"name": "llama", "layers_description": []}\n', "has none of parallel_config, model"),
    ],
)
def test_configs_without_the_expected_sections(tmp_path, target, content, message):
    path = tmp_path / "config"
    path.write_text(content)
    with pytest.raises(InputError, match=message.replace("[", r"\[")):
        write_config(target, path, layout_of(plan()))
    assert path.read_text() == content


def test_read_only_config_and_unknown_target(config, monkeypatch):
    path = config("mindformers")
    before = path.read_bytes()
    # what os.access says of a read-only file to anyone but root (CI may run as root)
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != path)
    with pytest.raises(InputError, match="read-only"):
        write_config("mindformers", path, layout_of(plan()))
    assert path.read_bytes() == before
    with pytest.raises(InputError, match="unknown target 'deepspeed'"):
        write_config("deepspeed", path, layout_of(plan()))


@pytest.mark.parametrize(("schedule", "chunks"), [("ZBVZeroBubble", 2), ("GPipe", 1)])
def test_schedules_a_target_cannot_run(config, schedule, chunks):
    path = config("megatron")
    before = path.read_bytes()
    with pytest.raises(InputError, match=f"Megatron-LM runs 1F1B, Interleaved1F1B; this plan is for {schedule}"):
        write_config("megatron", path, layout_of(plan(pipeline_parallel=4, chunks=chunks, schedule=schedule)))
    assert path.read_bytes() == before


def _flag(text: str, flag: str) -> str:
    return text.split(flag, 1)[1].split()[0]
