"""TorchTitan write-back on configs modelled on what its users have (tests/fixtures/torchtitan, each
naming the upstream file it imitates): TOML configs of every version up to v0.2.2 and Python config
functions of main. Every fixture is written through `write_config` and through `sapp-hook apply`, and
read back as TorchTitan reads it (`tomllib`; `ast` for the Python configs), value by value."""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import tomllib
from solver_cases import small_profile

from sapp_hook.cli import main
from sapp_hook.writeback import check_destination, layout_of, write_config
from sapp_hook.writeback.files import read_config
from sapp_hook.writeback.torchtitan.plan_fields import every_kth_block
from simulator import InputError
from solver import PipelineSpec, evaluate_plan

FIXTURES = Path(__file__).parent / "fixtures" / "torchtitan"
# head, 8 blocks, tail over 4 virtual stages: blocks [2, 2, 3, 1]
PARTS_OUTPUT = [
    ["tok_embeddings", "layers.0", "layers.1"],
    ["layers.2", "layers.3"],
    ["layers.4", "layers.5", "layers.6"],
    ["layers.7", "norm", "output"],
]
PARTS_LM_HEAD = [*PARTS_OUTPUT[:3], ["layers.7", "norm", "lm_head"]]
POINTS = ["layers.2", "layers.4", "layers.7"]
EVERY_SECOND = {2: "full", 4: "full", 6: "full"}  # blocks 1, 3, 5: the second of ranks 0, 1 and 2


def plan(
    modes: dict[int, str] | None = None,
    *,
    pipeline_parallel: int = 4,
    chunks: int = 1,
    schedule: str = "1F1B",
    counts: list[int] | None = None,
    micro_batches: int = 8,
):
    spec = PipelineSpec(
        pipeline_parallel=pipeline_parallel, chunks=chunks, micro_batches=micro_batches, schedule=schedule
    )
    layers = ["none"] * 10
    for index, mode in (modes or {}).items():
        layers[index] = mode
    return evaluate_plan(small_profile(8), spec, counts or [3, 2, 3, 2], layers)


def copy(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    shutil.copy(FIXTURES / name, path)
    return path


def apply(path: Path, function: str | None, chosen, via: str, capsys) -> list[str]:
    """Write `chosen` into `path` (through the API or the CLI); the notes."""
    target = f"{path}:{function}" if function else str(path)
    if via == "api":
        return write_config("torchtitan", target, layout_of(chosen)).notes
    plan_file = path.with_name("plan.json")
    plan_file.write_text(json.dumps(chosen.to_dict()))
    assert main(["apply", "--plan", str(plan_file), "--target", "torchtitan", "--config", target, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["notes"]


def settings(path: Path, function: str) -> tuple[dict[str, object], dict[str, object]]:
    """What a Python config function leaves in its parallelism and activation checkpointing, read with
    `ast` alone: the config call's keywords, then the assignments after it, in source order."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function)
    parallelism: dict[str, object] = {}
    checkpoint: dict[str, object] = {}
    nodes = sorted((node for node in ast.walk(body) if hasattr(node, "lineno")), key=lambda n: (n.lineno, n.col_offset))
    for node in nodes:
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ParallelismConfig":
            parallelism = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        elif isinstance(node, ast.keyword) and node.arg == "activation_checkpoint":
            checkpoint = {"expr": ast.unparse(node.value)}
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target = ast.unparse(node.targets[0]).split(".")
            if target[-2] == "parallelism":
                parallelism[target[-1]] = ast.literal_eval(node.value)
            elif target[-1] == "activation_checkpoint":
                checkpoint = {"expr": ast.unparse(node.value)}
            elif target[-2] == "activation_checkpoint":
                checkpoint[target[-1]] = ast.literal_eval(node.value)
    return parallelism, checkpoint


def removed_lines(before: str, after: str) -> list[str]:
    return [line[2:] for line in difflib.ndiff(before.splitlines(), after.splitlines()) if line.startswith("- ")]


# fixture, function, the pipeline keys read back, the checkpointing read back, keys that must be gone
TOML_CASES = [
    (
        "debug_model_v0_2.toml",
        "parallelism",
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 1,
            "module_fqns_per_model_part": PARTS_OUTPUT,
        },
        {"mode": "selective", "selective_ac_option": "2"},
        (),
    ),
    (
        "llama3_405b_2025_02.toml",
        "parallelism",  # training.batch_size 16 in 8 micro-batches
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 2,
            "pipeline_parallel_split_points": POINTS,
        },
        {"mode": "selective", "selective_ac_option": "2"},
        (),
    ),
    (
        "llama3_8b_2025_01_split_points.toml",
        "parallelism",
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatches": 8,
            "pipeline_parallel_split_points": POINTS,
        },
        {"mode": "selective", "selective_ac_option": "2"},
        (),
    ),
    (
        "llama3_8b_2024_experimental.toml",
        "experimental",  # the 2024 spelling of the schedule kept
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1f1b",
            "pipeline_parallel_microbatches": 8,
            "pipeline_parallel_split_points": POINTS,
        },
        {"mode": "selective", "selective_ac_option": "2"},
        (),
    ),
    (
        "deepseek_v3_16b_crlf.toml",
        "parallelism",  # local_batch_size 32 in 8
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 4,
            "module_fqns_per_model_part": PARTS_OUTPUT,
        },
        {"mode": "selective", "selective_ac_option": "2"},
        ("pipeline_parallel_layers_per_stage",),
    ),
    (
        "qwen3_pp_fqns.toml",
        "parallelism",
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 1,
            "module_fqns_per_model_part": PARTS_OUTPUT,
        },
        {"mode": "selective", "selective_ac_option": "2"},
        ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"),
    ),
]


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize(
    ("name", "table", "keys", "checkpoint", "gone"), TOML_CASES, ids=[case[0] for case in TOML_CASES]
)
def test_every_toml_fixture_takes_the_plan(tmp_path, capsys, via, name, table, keys, checkpoint, gone):
    path = copy(tmp_path, name)
    os.chmod(path, 0o640)
    before = path.read_bytes()
    notes = apply(path, None, plan(EVERY_SECOND), via, capsys)
    after = path.read_bytes()
    data = tomllib.loads(after.decode("utf-8"))  # as TorchTitan reads it
    assert {key: data[table][key] for key in keys} == keys
    assert {key: data["activation_checkpoint"][key] for key in checkpoint} == checkpoint
    assert not set(gone) & set(data[table])
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert Path(f"{path}.sapp-hook.bak").read_bytes() == before
    assert not Path(f"{path}.sapp-hook.json").exists()  # every second block of a rank: said exactly
    # only lines holding keys the plan sets or removes changed; every comment elsewhere is kept
    text, old = after.decode("utf-8"), before.decode("utf-8")
    for line in removed_lines(old, text):
        assert any(
            key in line for key in ("pipeline_parallel", "module_fqns", "mode", "selective_ac_option", '["', "]")
        ), line
    for line in old.splitlines():
        if line.lstrip().startswith("#"):
            assert line in text.splitlines()
    if b"\r\n" in before:  # the file's own line endings, not mixed
        assert after.count(b"\n") == after.count(b"\r\n") and "训练任务说明" in text
    said = (
        "pipeline_parallel_",
        "which TorchTitan",
        "predicted for that layout",
    )  # its TP and EP degrees: another layout
    assert notes == [note for note in notes if any(part in note for part in said)]


# ActivationCheckpointConfig (2026-02..06) keeps selective_ac_option: every second block of a rank, exactly
EVERY_SECOND_AC = "ActivationCheckpointConfig(mode='selective', selective_ac_option='2')"
# fixture, function, ParallelismConfig fields read back, checkpointing read back, fields that must be gone, side file
PYTHON_CASES = [
    (
        "llama3_config_registry_2026_03.py",
        "llama3_debugmodel",  # the head named in the file: filter_fqns=["output"]
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 1,
            "module_fqns_per_model_part": PARTS_OUTPUT,
        },
        {"expr": EVERY_SECOND_AC},
        (),
        False,
    ),
    (
        "llama3_config_registry_2026_03.py",
        "llama3_8b",  # no ParallelismConfig: one added; 16 in 8
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 2,
            "module_fqns_per_model_part": PARTS_OUTPUT,
        },
        {"expr": EVERY_SECOND_AC},
        (),
        False,
    ),
    (
        "llama3_config_registry_2026_03.py",
        "llama3_debugmodel_float8",  # changes llama3_debugmodel's config
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_microbatch_size": 1,
            "module_fqns_per_model_part": PARTS_OUTPUT,
        },
        {"mode": "selective", "selective_ac_option": "2"},
        (),
        False,
    ),
    (
        "qwen3_config_registry_main.py",
        "qwen3_debugmodel",
        {
            "data_parallel_shard_degree": -1,
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "num_pp_microbatches": 8,
            "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
        },
        {"expr": "FullAC.Config()"},
        ("pipeline_parallel_layers_per_stage",),
        True,
    ),
    (
        "qwen3_config_registry_main.py",
        "qwen3_debugmodel_long",
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "num_pp_microbatches": 8,
            "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
            "pipeline_parallel_layers_per_stage": None,
        },
        {"expr": "FullAC.Config()"},
        (),
        True,
    ),
    (
        "qwen3_config_registry_main.py",
        "qwen3_14b",
        {
            "tensor_parallel_degree": 2,
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "num_pp_microbatches": 8,
            "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
        },
        {"expr": "FullAC.Config()"},
        (),
        True,
    ),
    (
        "deepseek_v3_user_registry_crlf.py",
        "deepseek_v3_16b_pp",
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "num_pp_microbatches": 8,
            "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
        },
        {"expr": "FullAC.Config()"},
        (),
        True,
    ),
    (
        "deepseek_v3_user_registry_crlf.py",
        "deepseek_v3_small",
        {
            "pipeline_parallel_degree": 4,
            "pipeline_parallel_schedule": "1F1B",
            "num_pp_microbatches": 8,
            "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
        },
        {"expr": "FullAC.Config()"},
        (),
        True,
    ),
    (
        "my_llama_job.py",
        None,  # the file's only function
        {
            "pipeline_parallel_degree": 4,
            "num_pp_microbatches": 8,
            "pipeline_parallel_schedule": "1F1B",
            "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
        },
        {"expr": "FullAC.Config()"},
        (),
        True,
    ),
]


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize(
    ("name", "function", "fields", "checkpoint", "gone", "side_file"),
    PYTHON_CASES,
    ids=[f"{case[0]}:{case[1]}" for case in PYTHON_CASES],
)
def test_every_python_fixture_takes_the_plan(
    tmp_path, capsys, via, name, function, fields, checkpoint, gone, side_file
):
    path = copy(tmp_path, name)
    before = path.read_bytes()
    notes = apply(path, function, plan(EVERY_SECOND), via, capsys)
    after = path.read_bytes()
    text = after.decode("utf-8")
    compile(text, str(path), "exec")  # it parses as Python
    chosen = function or "llama3_pp"
    parallelism, said = settings(path, chosen)
    assert {key: parallelism.get(key) for key in fields} == fields
    assert not set(gone) & set(parallelism)
    assert said == checkpoint
    assert Path(f"{path}.sapp-hook.json").exists() == side_file
    if side_file:  # main's FullAC checkpoints every block; the plan only every second one of a rank
        assert any("checkpoints every block alike" in note for note in notes)
    # every other function is as it was
    functions = [
        {node.name: ast.dump(node) for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
        for source in (before.decode("utf-8"), text)
    ]
    assert {name: dump for name, dump in functions[0].items() if name != chosen} == {
        name: dump for name, dump in functions[1].items() if name != chosen
    }
    for line in before.decode("utf-8").splitlines():
        if line.lstrip().startswith("#"):
            assert line in text.splitlines()
    if b"\r\n" in before:
        assert after.count(b"\n") == after.count(b"\r\n") and "パイプライン並列" in text


def test_the_crlf_fixtures_have_crlf_endings():
    """(Else the tests above would not test what they say.)"""
    for name in ("deepseek_v3_16b_crlf.toml", "deepseek_v3_user_registry_crlf.py"):
        data = (FIXTURES / name).read_bytes()
        assert data.count(b"\n") == data.count(b"\r\n") > 10


def test_a_python_edit_is_minimal(tmp_path):
    """The keywords the plan sets change, nothing around them: a comment inside the call, the other
    fields and the other functions stay."""
    path = copy(tmp_path, "qwen3_config_registry_main.py")
    before = path.read_text()
    write_config("torchtitan", f"{path}:qwen3_debugmodel", layout_of(plan()))
    after = path.read_text()
    assert removed_lines(before, after) == [
        "            pipeline_parallel_degree=2,  # one node per stage",
        "            pipeline_parallel_layers_per_stage=4,",
        "            num_pp_microbatches=4,",
        "        activation_checkpoint=SelectiveAC.Config(),",
    ]
    assert "            pipeline_parallel_degree=4,  # one node per stage\n" in after
    assert "            # an even split, by layer count\n" in after
    assert "        activation_checkpoint=None,\n" in after  # the plan recomputes nothing


@pytest.mark.parametrize(
    ("modes", "chunks", "every"),
    [
        (EVERY_SECOND, 1, 2),
        ({2: "full", 4: "full"}, 1, None),  # rank 2's second block (5) is not recomputed
        ({index: "full" for index in range(1, 9)}, 1, None),  # all of them: mode "full", not this
        # interleaved: rank 0 holds blocks 0, 1, 4, 5, 6 and rank 1 holds 2, 3, 7, each counted on its rank
        ({2: "full", 6: "full", 4: "full"}, 2, 2),
        ({2: "full", 4: "full", 6: "full", 8: "full"}, 2, None),  # every second block in model order is not
    ],
)
def test_every_kth_block_counts_on_each_rank(modes, chunks, every):
    stages = 4 // chunks
    chosen = plan(modes, pipeline_parallel=stages, chunks=chunks, schedule="Interleaved1F1B" if chunks > 1 else "1F1B")
    assert every_kth_block(layout_of(chosen)) == every


def test_a_plan_torchtitan_cannot_say_per_layer_gets_the_heaviest_mode_and_a_side_file(tmp_path):
    path = copy(tmp_path, "debug_model_v0_2.toml")
    chosen = plan({2: "full", 4: "selective"})
    result = write_config("torchtitan", path, layout_of(chosen))
    checkpoint = tomllib.loads(path.read_text())["activation_checkpoint"]
    assert checkpoint == {"mode": "full", "selective_ac_option": "2"}  # the option is unused under "full"
    side = Path(f"{path}.sapp-hook.json")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()  # the config it belongs with, as written
    record = {"side_file_of": {"config": path.name, "config_sha256": digest}}
    assert json.loads(side.read_text()) == {**chosen.to_dict(), **record} and str(side) in result.written


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('pipeline_parallel_degree = "4"', "the string '4'"),  # not "is for 4 pipeline stages; ... has 4"
        ("pipeline_parallel_degree = 4.0", "float 4.0"),
        ("pipeline_parallel_degree = true", "bool True"),
    ],
)
def test_a_degree_that_is_not_a_number_is_one_error_saying_so(tmp_path, capsys, text, said):
    path = copy(tmp_path, "debug_model_v0_2.toml")
    path.write_text(path.read_text().replace("pipeline_parallel_degree = 1", text))
    before = path.read_bytes()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan().to_dict()))
    with pytest.raises(SystemExit) as caught:
        main(["apply", "--plan", str(plan_file), "--target", "torchtitan", "--config", str(path)])
    assert caught.value.code == 2
    assert capsys.readouterr().err == (
        f"sapp-hook apply: error: --config: {path}: parallelism.pipeline_parallel_degree "
        f"is {said}; TorchTitan expects a whole number of pipeline ranks\n"
    )
    assert path.read_bytes() == before


def test_a_python_degree_that_is_a_string_is_refused(tmp_path):
    path = copy(tmp_path, "my_llama_job.py")
    path.write_text(path.read_text().replace("pipeline_parallel_degree=4", 'pipeline_parallel_degree="4"'))
    before = path.read_bytes()
    with pytest.raises(
        InputError, match=r"llama3_pp: parallelism.pipeline_parallel_degree is the string '4'"
    ) as caught:
        write_config("torchtitan", path, layout_of(plan()))
    assert caught.value.field == "--config" and path.read_bytes() == before


def test_the_pipeline_degree_and_schedule_are_set_with_notes(tmp_path):
    path = copy(tmp_path, "qwen3_pp_fqns.toml")
    notes = write_config("torchtitan", path, layout_of(plan())).notes
    assert notes[:2] == [
        (
            "parallelism.pipeline_parallel_degree was 2; set to the plan's 4: the job runs 4 pipeline ranks for every rank "
            "of its other degrees (check data_parallel_shard_degree and the launcher's rank count)"
        ),
        "parallelism.pipeline_parallel_schedule was 'GPipe'; set to the plan's '1F1B'",
    ]
    assert "pipeline_parallel_degree = 4  # two nodes\n" in path.read_text()


def test_a_python_config_with_several_functions_needs_one_named(tmp_path, capsys):
    path = copy(tmp_path, "qwen3_config_registry_main.py")
    before = path.read_bytes()
    with pytest.raises(InputError) as caught:
        write_config("torchtitan", path, layout_of(plan()))
    assert caught.value.field == "--config"
    assert caught.value.detail == (
        f"{path} defines 3 config functions (qwen3_debugmodel, qwen3_debugmodel_long, "
        f"qwen3_14b): name the one the job runs as {path}:FUNCTION (TorchTitan's --config "
        "FUNCTION)"
    )
    with pytest.raises(InputError, match=r"has no config function 'qwen3_8b'; it defines qwen3_debugmodel, "):
        write_config("torchtitan", f"{path}:qwen3_8b", layout_of(plan()))
    with pytest.raises(InputError, match=r"does not exist or is not a file"):
        check_destination(
            "torchtitan", f"{tmp_path / 'missing.py'}:qwen3_14b", target_field="--target", config_field="--config"
        )
    check_destination("torchtitan", f"{path}:qwen3_14b", target_field="--target", config_field="--config")
    assert path.read_bytes() == before


def test_apply_dry_run_shows_the_python_diff_and_writes_nothing(tmp_path, capsys):
    path = copy(tmp_path, "llama3_config_registry_2026_03.py")
    before = path.read_bytes()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan().to_dict()))
    assert (
        main(
            ["apply", "--plan", str(plan_file), "--target", "torchtitan", "--config", f"{path}:llama3_8b", "--dry-run"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(f"--- {path} (before)\n+++ {path} (sapp-hook)\n")
    assert (
        "+        parallelism=ParallelismConfig(\n" in out
        and '+                ["layers.7", "norm", "output"],\n' in out
    )
    assert path.read_bytes() == before and not Path(f"{path}.sapp-hook.bak").exists()


OLD_PYTHON_CONFIG = (
    "from torchtitan.config import ActivationCheckpointConfig, TrainingConfig\n\n\n"
    "def llama3_8b() -> Trainer.Config:\n    return Trainer.Config(\n"
    "        training=TrainingConfig(local_batch_size=8),\n"
    '        activation_checkpoint=ActivationCheckpointConfig(mode="selective", selective_ac_option="op"),\n    )\n'
)


def _checkout(root: Path, head: str, fields: list[str]) -> None:
    """A TorchTitan source tree, as much of it as sapp-hook reads: its parallelism config class and
    its pipeline code."""
    (root / "torchtitan" / "distributed").mkdir(parents=True)
    (root / "torchtitan" / "config").mkdir()
    (root / "torchtitan" / "distributed" / "pipeline_parallel.py").write_text(
        f'def generate_llm_fqn_per_model_part():\n    return [["tok_embeddings"], ["norm", "{head}"]]\n'
    )
    (root / "torchtitan" / "config" / "configs.py").write_text(
        "class ParallelismConfig:\n" + "".join(f"    {name}: int = 1\n" for name in fields)
    )


@pytest.mark.parametrize("head", ["output", "lm_head"])
def test_an_old_python_config_takes_the_head_name_of_the_torchtitan_it_runs_on(tmp_path, head):
    """A config of 2026-02..06 (ActivationCheckpointConfig, local_batch_size) that names no module does
    not say whether its head is `output` or `lm_head` (renamed 2026-04): the checkout above it does."""
    _checkout(
        tmp_path / "titan",
        head,
        ["pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_microbatch_size"],
    )
    inside = tmp_path / "titan" / "torchtitan" / "models" / "llama3" / "config_registry.py"
    inside.parent.mkdir(parents=True)
    inside.write_text(OLD_PYTHON_CONFIG)
    write_config("torchtitan", inside, layout_of(plan()))
    parallelism, checkpoint = settings(inside, "llama3_8b")
    assert parallelism["module_fqns_per_model_part"][-1] == ["layers.7", "norm", head]
    assert parallelism["pipeline_parallel_microbatch_size"] == 1
    assert checkpoint == {"expr": "ActivationCheckpointConfig(mode='none', selective_ac_option='op')"}


@pytest.mark.parametrize("via", ["api", "cli"])
def test_an_old_python_config_alone_lists_both_head_names(tmp_path, capsys, via):
    """qwen3_config_registry_2026_05.py names no module and no TorchTitan is beside it: nothing says the head's
    name. The last part lists `output` and `lm_head`: TorchTitan's pipeline_module_split keeps the children a
    part names and passes over a name its model lacks, so the head stays in either version (it was refused).
    Its ActivationCheckpointConfig takes selective_ac_option: every second block of a rank, exactly."""
    path = copy(tmp_path, "qwen3_config_registry_2026_05.py")
    before = path.read_text()
    notes = apply(path, "qwen3_14b", plan(EVERY_SECOND), via, capsys)
    parallelism, checkpoint = settings(path, "qwen3_14b")
    assert parallelism["module_fqns_per_model_part"] == [*PARTS_OUTPUT[:3], ["layers.7", "norm", "output", "lm_head"]]
    assert parallelism["pipeline_parallel_degree"] == 4 and parallelism["pipeline_parallel_microbatch_size"] == 1
    assert checkpoint == {"expr": EVERY_SECOND_AC}
    assert not Path(f"{path}.sapp-hook.json").exists()  # said exactly
    assert any("the last model part lists both" in note for note in notes)
    after = path.read_text()
    assert [line for line in before.splitlines() if line.lstrip().startswith("#")] == [
        line for line in after.splitlines() if line.lstrip().startswith("#")
    ]
    untouched = {node.name: ast.dump(node) for node in ast.parse(before).body if isinstance(node, ast.FunctionDef)}
    changed = {node.name: ast.dump(node) for node in ast.parse(after).body if isinstance(node, ast.FunctionDef)}
    assert {name for name in untouched if untouched[name] != changed[name]} == {"qwen3_14b"}


def test_an_installed_torchtitan_answers_where_no_checkout_is_above_the_config(tmp_path, monkeypatch):
    _checkout(
        tmp_path / "site-packages",
        "lm_head",
        ["pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_microbatch_size"],
    )
    init = tmp_path / "site-packages" / "torchtitan" / "__init__.py"
    init.write_text("")
    init.with_name("trainer.py").write_text("")  # a TorchTitan of Python configs (Trainer.Config)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: (
            importlib.machinery.ModuleSpec(name, None, origin=str(init)) if name == "torchtitan" else None
        ),
    )
    path = tmp_path / "config_registry.py"
    path.write_text("def llama3_8b():\n    return Trainer.Config(training=TrainingConfig(local_batch_size=16))\n")
    write_config("torchtitan", path, layout_of(plan()))
    parallelism, _ = settings(path, "llama3_8b")
    assert parallelism["module_fqns_per_model_part"] == PARTS_LM_HEAD
    assert parallelism["pipeline_parallel_microbatch_size"] == 2


def test_a_toml_config_takes_the_keys_of_the_torchtitan_beside_it(tmp_path):
    """Without keys that date it, a TOML config is read as v0.2's (module lists); in a checkout whose
    config class still has split points, it gets split points."""
    text = "[training]\nlocal_batch_size = 8\n\n[parallelism]\npipeline_parallel_degree = 1\n"
    alone = tmp_path / "train.toml"
    alone.write_text(text)
    notes = write_config("torchtitan", alone, layout_of(plan())).notes
    assert tomllib.loads(alone.read_text())["parallelism"]["module_fqns_per_model_part"] == PARTS_OUTPUT
    assert any("does not say which TorchTitan it is for" in note for note in notes)
    _checkout(
        tmp_path / "titan",
        "output",
        ["pipeline_parallel_degree", "pipeline_parallel_split_points", "pipeline_parallel_microbatch_size"],
    )
    inside = tmp_path / "titan" / "train_configs" / "train.toml"
    inside.parent.mkdir()
    inside.write_text(text)
    notes = write_config("torchtitan", inside, layout_of(plan())).notes
    parallelism = tomllib.loads(inside.read_text())["parallelism"]
    assert parallelism["pipeline_parallel_split_points"] == POINTS and "module_fqns_per_model_part" not in parallelism
    assert not any("does not say which TorchTitan" in note for note in notes)


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        (
            "debug_model_v0_2.toml",
            ("pipeline_parallel_degree = 1", 'pipeline_parallel_degree = 1\npipeline_parallel_schedule_csv = "s.csv"'),
            "parallelism.pipeline_parallel_schedule_csv is 's.csv': TorchTitan runs that file's action order",
        ),
        (
            "debug_model_v0_2.toml",
            ("local_batch_size = 8", "local_batch_size = 12"),
            "is for 8 micro-batches; .* has training.local_batch_size 12, which does not split into 8",
        ),
        (
            "debug_model_v0_2.toml",
            ("local_batch_size = 8", 'local_batch_size = "8"'),
            "training.local_batch_size is the string '8'; TorchTitan expects a whole number",
        ),
        (
            "my_llama_job.py",
            ("num_pp_microbatches=8)", 'num_pp_microbatches=8, pipeline_parallel_schedule_csv="s.csv")'),
            "sets parallelism.pipeline_parallel_schedule_csv: TorchTitan runs that file's action order",
        ),
        (
            "llama3_config_registry_2026_03.py:llama3_405b",
            ("", ""),
            "is for 8 micro-batches; .* llama3_405b has training.local_batch_size 2, which does not split into 8",
        ),
        (
            "qwen3_config_registry_main.py:qwen3_debugmodel_long",
            ("    return config", "    config.parallelism = make_parallelism()\n    return config"),
            "qwen3_debugmodel_long would not set .* as written; it was left as it was",
        ),
    ],
)
def test_configs_that_cannot_take_the_plan_are_refused_and_left_byte_identical(tmp_path, name, edit, message):
    file, _, function = name.partition(":")
    path = copy(tmp_path, file)
    path.write_bytes(path.read_bytes().replace(edit[0].encode(), edit[1].encode(), 1))
    before = path.read_bytes()
    target = f"{path}:{function}" if function else path
    with pytest.raises(InputError, match=message):
        write_config("torchtitan", target, layout_of(plan()))
    assert path.read_bytes() == before and not Path(f"{path}.sapp-hook.bak").exists()


def test_the_2024_schedules_are_spelled_as_that_torchtitan_spells_them(tmp_path):
    path = copy(tmp_path, "llama3_8b_2024_experimental.toml")
    interleaved = plan(pipeline_parallel=2, chunks=2, schedule="Interleaved1F1B")
    write_config("torchtitan", path, layout_of(interleaved))
    assert tomllib.loads(path.read_text())["experimental"]["pipeline_parallel_schedule"] == "interleaved_1f1b"
    before = path.read_bytes()
    with pytest.raises(
        InputError,
        match=r"--plan: is for ZBVZeroBubble; this TorchTitan \(schedules spelled gpipe, 1f1b, "
        r"interleaved_1f1b\) runs only GPipe, 1F1B, Interleaved1F1B$",
    ):
        write_config("torchtitan", path, layout_of(plan(pipeline_parallel=2, chunks=2, schedule="ZBVZeroBubble")))
    assert path.read_bytes() == before


def test_split_points_cannot_say_a_stage_without_blocks(tmp_path):
    path = copy(tmp_path, "llama3_8b_2025_01_split_points.toml")
    before = path.read_bytes()
    tail_alone = plan(counts=[3, 3, 3, 1])  # head + 2, 3, 3 blocks, then the tail alone
    with pytest.raises(
        InputError,
        match="gives virtual stage 3 no decoder layer; this TorchTitan splits the model at "
        r"decoder layers \(pipeline_parallel_split_points\)",
    ):
        write_config("torchtitan", path, layout_of(tail_alone))
    assert path.read_bytes() == before
    fqns = copy(tmp_path, "qwen3_pp_fqns.toml")  # module lists can: the last part is the tail
    write_config("torchtitan", fqns, layout_of(tail_alone))
    assert tomllib.loads(fqns.read_text())["parallelism"]["module_fqns_per_model_part"][-1] == ["norm", "output"]


@pytest.mark.parametrize("name", ["debug_model_v0_2.toml", "llama3_config_registry_2026_03.py:llama3_debugmodel"])
def test_a_failure_between_write_and_rename_leaves_the_config_byte_identical(tmp_path, monkeypatch, name):
    file, _, function = name.partition(":")
    path = copy(tmp_path, file)
    before = path.read_bytes()

    def full_disk(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(InputError, match="left as it was"):
        write_config("torchtitan", f"{path}:{function}" if function else path, layout_of(plan()))
    assert path.read_bytes() == before
    assert read_config(path) == before.decode("utf-8")


def test_a_2024_config_without_pipeline_keys_gets_them_where_2024_read_them(tmp_path):
    """TorchTitan's 2024 configs had no [parallelism]: the degrees sat in [training], the pipeline keys
    in [experimental] (torchtitan/config_manager.py, --experimental.pipeline_parallel_degree)."""
    path = tmp_path / "llama3_8b.toml"
    path.write_text("[training]\nbatch_size = 8\ndata_parallel_degree = -1\ntensor_parallel_degree = 1\n")
    write_config("torchtitan", path, layout_of(plan()))
    assert tomllib.loads(path.read_text())["experimental"] == {
        "pipeline_parallel_degree": 4,
        "pipeline_parallel_schedule": "1f1b",  # what every 2024 TorchTitan reads (see the test below)
        "pipeline_parallel_microbatches": 8,
        "pipeline_parallel_split_points": POINTS,
    }


@pytest.mark.parametrize(("schedule", "spelled"), [("1F1B", "1f1b"), ("GPipe", "gpipe")])
def test_a_2024_config_that_spells_no_schedule_gets_the_lowercase_name_every_2024_torchtitan_reads(
    tmp_path, schedule, spelled
):
    """Until mid-2024 TorchTitan compared the name with "1f1b", "gpipe" and "interleaved_1f1b" (anything
    else: NotImplementedError at launch); later it looked names up in any case: the lowercase name runs in both."""
    path = tmp_path / "test_pp_split_points.toml"
    path.write_text(
        "[training]\nbatch_size = 8\n\n[experimental]\npipeline_parallel_degree = 1\n"
        'pipeline_parallel_split_points = "layers.2,layers.4,layers.6"\n'
    )
    write_config("torchtitan", path, layout_of(plan(schedule=schedule)))
    written = tomllib.loads(path.read_text())["experimental"]
    assert written["pipeline_parallel_schedule"] == spelled and written["pipeline_parallel_split_points"] == POINTS


def test_python_that_cannot_be_read_is_one_error(tmp_path):
    path = tmp_path / "config_registry.py"
    for text, said in [("def f(:\n", "is not valid Python: "), ("def f():\n    return 1\x00\n", "is not ")]:
        path.write_text(text)
        with pytest.raises(InputError, match=said) as caught:
            write_config("torchtitan", path, layout_of(plan()))
        assert caught.value.field == "--config" and path.read_text() == text


def test_the_local_batch_may_sit_in_a_batch_config(tmp_path):
    """TrainingConfig's batch fields moved to BatchConfig in 2026-07 (pytorch/torchtitan#3926)."""
    path = tmp_path / "config_registry.py"
    path.write_text(
        "def qwen3_debugmodel():\n    return Trainer.Config(\n        batch=BatchConfig(local_batch_size=16),\n"
        "        parallelism=ParallelismConfig(pipeline_parallel_microbatch_size=1),\n"
        "        activation_checkpoint=SelectiveAC.Config(),\n    )\n"
    )
    write_config("torchtitan", path, layout_of(plan()))
    parallelism, checkpoint = settings(path, "qwen3_debugmodel")
    assert parallelism["pipeline_parallel_microbatch_size"] == 2 and checkpoint == {"expr": "None"}
    assert parallelism["pipeline_parallel_module_fqns_per_model_part"] == PARTS_LM_HEAD


def test_a_parallelism_changed_through_a_variable_is_written_where_it_is_changed(tmp_path):
    """`p = ParallelismConfig(...)`, then `p.pipeline_parallel_degree = 2`: that assignment runs last."""
    path = tmp_path / "config_registry.py"
    path.write_text(
        "def llama3_pp():\n    p = ParallelismConfig(num_pp_microbatches=4)\n    p.pipeline_parallel_degree = 2\n"
        "    return Trainer.Config(parallelism=p, activation_checkpoint=None)\n"
    )
    write_config("torchtitan", path, layout_of(plan()))
    text = path.read_text()
    assert "    p.pipeline_parallel_degree = 4\n" in text
    call = next(
        node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ParallelismConfig"
    )
    assert {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords} == {
        "num_pp_microbatches": 8,
        "pipeline_parallel_schedule": "1F1B",
        "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
    }


def test_a_config_for_an_older_torchtitan_gets_the_names_of_the_one_it_runs_on(tmp_path):
    """A config of 2026-03 (module_fqns_per_model_part, ActivationCheckpointConfig, filter_fqns=["output"])
    inside a checkout of main: main's names, the old ones taken out, the new class imported."""
    root = tmp_path / "titan"
    _checkout(
        root,
        "lm_head",
        [
            "pipeline_parallel_degree",
            "pipeline_parallel_module_fqns_per_model_part",
            "num_pp_microbatches",
            "pipeline_parallel_schedule",
        ],
    )
    (root / "torchtitan" / "distributed" / "activation_checkpoint.py").write_text("class FullAC:\n    pass\n")
    path = root / "torchtitan" / "models" / "llama3" / "config_registry.py"
    path.parent.mkdir(parents=True)
    shutil.copy(FIXTURES / "llama3_config_registry_2026_03.py", path)
    text = path.read_text().replace(
        "    return config\n", "    config.parallelism.module_fqns_per_model_part = None\n    return config\n", 1
    )
    path.write_text(text)
    write_config("torchtitan", f"{path}:llama3_debugmodel_float8", layout_of(plan(EVERY_SECOND)))
    parallelism, checkpoint = settings(path, "llama3_debugmodel_float8")
    assert parallelism == {
        "pipeline_parallel_degree": 4,
        "pipeline_parallel_schedule": "1F1B",
        "num_pp_microbatches": 8,
        "pipeline_parallel_module_fqns_per_model_part": PARTS_LM_HEAD,
    }
    assert checkpoint == {"expr": "FullAC.Config()"}
    after = path.read_text()
    assert "module_fqns_per_model_part = None" not in after
    assert "\nfrom torchtitan.distributed.activation_checkpoint import FullAC\n" in after


def test_an_inline_parallelism_table_stays_on_one_line(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text("parallelism = { pipeline_parallel_degree = 1 }\n[training]\nlocal_batch_size = 8\n")
    write_config("torchtitan", path, layout_of(plan()))
    data = tomllib.loads(path.read_text())
    assert data["parallelism"]["module_fqns_per_model_part"] == PARTS_OUTPUT
    assert path.read_text().startswith("parallelism = { pipeline_parallel_degree = 4, ")


def test_the_transformers_backend_lists_its_rotary_embedding_in_every_model_part(tmp_path):
    """TorchTitan's transformers backend (experiments/transformers_backend) splits with
    generate_llm_fqn_per_model_part(..., include_rotary_emb=True): its HF model's shared `rotary_emb`
    sits in every part; a part that does not name it gets an Identity there (use_identity_for_missing_modules)."""
    path = tmp_path / "qwen3_fsdp2_tp2_pp2.toml"
    path.write_text(
        '[model]\nname = "transformers_backend"\nflavor = "debugmodel"\nhf_assets_path = "./assets"\n\n'
        "[training]\nlocal_batch_size = 8\n\n[parallelism]\npipeline_parallel_degree = 2\n"
        'pipeline_parallel_schedule = "1F1B"\n'
    )
    write_config("torchtitan", path, layout_of(plan()))
    parts = tomllib.loads(path.read_text())["parallelism"]["module_fqns_per_model_part"]
    assert parts == [[*part, "rotary_emb"] for part in PARTS_OUTPUT]


FLUX_TOML = '[model]\nname = "flux"\nflavor = "flux-dev"\n\n[training]\nbatch_size = 4\n\n[parallelism]\ndata_parallel_shard_degree = -1\n'


@pytest.mark.parametrize(
    ("name", "text", "function"),
    [
        ("flux_dev_model.toml", FLUX_TOML, None),
        (
            "config_registry.py",
            "def flux_debugmodel():\n    return Trainer.Config(model_spec=model_registry('flux-debug'))\n",
            "flux_debugmodel",
        ),
    ],
)
def test_a_model_torchtitan_runs_without_pipeline_parallelism_is_refused(tmp_path, name, text, function):
    """TorchTitan registers flux (and the VLM, llama3-siglip2) with pipelining_fn=None and refuses a pipeline
    degree above 1 for them: a pipeline plan written there would only stop the job at launch."""
    folder = tmp_path / "flux"
    folder.mkdir()
    path = folder / name
    path.write_text(text)
    before = path.read_bytes()
    with pytest.raises(InputError, match=r"trains TorchTitan's 'flux' model .* without a pipelining function"):
        write_config("torchtitan", f"{path}:{function}" if function else path, layout_of(plan()))
    assert path.read_bytes() == before


JOB_CONFIG_PY = """# a preset for 128 GPUs

from torchtitan.config import ActivationCheckpoint, JobConfig, Model, Parallelism, Training

default_config = JobConfig(
    model=Model(name="llama3", flavor="debugmodel"),
    training=Training(local_batch_size=8, seq_len=2048),  # the local batch
    parallelism=Parallelism(
        tensor_parallel_degree=2,
    ),
    activation_checkpoint=ActivationCheckpoint(mode="full"),
)
"""


def test_a_module_level_job_config_takes_the_plan(tmp_path):
    """TorchTitan's train_configs/*.py of late 2025 set `default_config = JobConfig(...)` at module level
    with Parallelism(...), Training(...) and ActivationCheckpoint(...): the plan goes into those calls."""
    path = tmp_path / "llama3_405b.py"
    path.write_text(JOB_CONFIG_PY)
    notes = write_config("torchtitan", path, layout_of(plan(EVERY_SECOND))).notes
    tree = ast.parse(path.read_text())
    call = tree.body[-1].value
    sections = {kw.arg: kw.value for kw in call.keywords}
    parallelism = {kw.arg: ast.literal_eval(kw.value) for kw in sections["parallelism"].keywords}
    assert parallelism == {
        "tensor_parallel_degree": 2,
        "pipeline_parallel_degree": 4,
        "pipeline_parallel_schedule": "1F1B",
        "pipeline_parallel_microbatch_size": 1,
        "module_fqns_per_model_part": PARTS_OUTPUT,
    }
    checkpoint = {kw.arg: ast.literal_eval(kw.value) for kw in sections["activation_checkpoint"].keywords}
    assert checkpoint == {"mode": "selective", "selective_ac_option": "2"}
    assert "# the local batch" in path.read_text() and any("default_config" in note for note in notes)


def test_a_module_level_job_config_gets_a_parallelism_of_its_own_classes(tmp_path):
    path = tmp_path / "debug_model.py"
    path.write_text(
        JOB_CONFIG_PY.replace("    parallelism=Parallelism(\n        tensor_parallel_degree=2,\n    ),\n", "")
    )
    write_config("torchtitan", path, layout_of(plan()))
    text = path.read_text()
    assert "parallelism=Parallelism(" in text and "ParallelismConfig" not in text
    sections = {kw.arg: kw.value for kw in ast.parse(text).body[-1].value.keywords}
    assert ast.literal_eval(sections["parallelism"].keywords[0].value) == 4


def _write_rounds(path: str, plans: list[dict], rounds: int, start: object) -> None:
    """One of two writers taking turns on one config (a process of its own)."""
    from sapp_hook.writeback import layout_from_dict

    layouts = [layout_from_dict(data) for data in plans]
    start.wait()
    for _ in range(rounds):
        for layout in layouts:
            write_config("torchtitan", path, layout)


def test_two_writers_on_one_config_never_leave_it_and_its_side_file_saying_two_plans(tmp_path):
    """Two jobs (or `apply` runs) writing plans into one config at once take turns: whenever a reader that takes
    the same lock looks, the config and its side file say one plan."""
    import multiprocessing

    from basics.files import folder_locked
    from sapp_hook import layout_from_dict, torchtitan_module_names

    path = copy(tmp_path, "debug_model_v0_2.toml")
    plans = [
        plan({2: "full", 4: "selective"}).to_dict(),
        plan({3: "full", 6: "selective"}, counts=[2, 3, 2, 3]).to_dict(),
    ]
    modules = [torchtitan_module_names(layout_from_dict(data)) for data in plans]
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    writers = [
        context.Process(target=_write_rounds, args=(str(path), order, 30, start)) for order in (plans, plans[::-1])
    ]
    for writer in writers:
        writer.start()
    start.wait()
    looks, differing = 0, 0
    while any(writer.is_alive() for writer in writers):
        with folder_locked(path):
            side = Path(f"{path}.sapp-hook.json")
            if side.exists():
                looks += 1
                said = tomllib.loads(path.read_text())["parallelism"]["module_fqns_per_model_part"]
                data = json.loads(side.read_text())
                record = data.pop("side_file_of")
                differing += said != modules[plans.index(data)]
                differing += record["config_sha256"] != hashlib.sha256(path.read_bytes()).hexdigest()
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0
    assert looks > 10 and differing == 0
