"""`sapp-hook apply`: a solved plan written into launch configs, with a dry run and one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from solver_cases import SAPP, small_profile

from sapp_hook.cli import main

CONFIGS = Path(__file__).parents[1] / "sapp_hook" / "templates"


@pytest.fixture
def plan_file(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    small_profile(8).save(profile)
    plan = tmp_path / "plan.json"
    argv = [
        "solve",
        "--profile",
        str(profile),
        "--pipeline-parallel",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "1F1B",
        "--memory",
        "1TB",
        "--plan-out",
        str(plan),
        "--quiet",
    ]
    assert main(argv) == 0
    capsys.readouterr()
    return plan


def test_dry_run_then_apply(tmp_path, capsys, plan_file):
    config = tmp_path / "train.toml"
    shutil.copy(CONFIGS / "torchtitan_llama.toml", config)
    before = config.read_text()
    assert (
        main(["apply", "--plan", str(plan_file), "--target", "torchtitan", "--config", str(config), "--dry-run"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(f"--- {config} (before)") and "+module_fqns_per_model_part" in out
    assert config.read_text() == before
    assert main(["apply", "--plan", str(plan_file), "--target", "torchtitan", "--config", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["written"] == [str(config)] and report["backup"] == f"{config}.sapp-hook.bak"
    assert "module_fqns_per_model_part" in config.read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--target", "deepspeed"],
            "--target: unknown target 'deepspeed'; expected one of mindformers, megatron, torchtitan, plan",
        ),
        (["--config", "/no/such/train.yaml"], "--config: /no/such/train.yaml does not exist or is not a file"),
    ],
)
def test_bad_input_is_one_line(capsys, plan_file, flags, message):
    argv = ["apply", "--plan", str(plan_file), "--target", "mindformers", "--config", str(CONFIGS / "x.yaml")]
    for flag, value in zip(flags[::2], flags[1::2]):
        argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == f"sapp-hook apply: error: {message}\n"


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"spec": {"pipeline_parallel": 4}, "plan": {}}, ": missing; expected an integer >= 1"),
        ({"spec": {"pipeline_parallel": 4}}, "expected a plan JSON as sapp-hook solve --plan-out writes it"),
        ({"layers_description": []}, "expected a plan JSON as sapp-hook solve --plan-out writes it"),
        ([], "expected a plan JSON as sapp-hook solve --plan-out writes it"),
    ],
)
def test_a_plan_that_is_not_a_plan(tmp_path, capsys, document, message):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(document))
    for command in (
        ["apply", "--target", "plan", "--config", str(tmp_path / "out.json")],
        ["simulate", "--profile", str(SAPP / "test.json")],
    ):
        with pytest.raises(SystemExit):
            main([*command, "--plan", str(bad)])
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
