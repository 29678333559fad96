"""`sapp-hook demo` (what `make demo` runs): the whole loop, into one folder."""

from __future__ import annotations

import json

import pytest
import tomlkit
import yaml

from sapp_hook.cli import main


def test_demo_writes_every_target_a_chart_and_a_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--json"]) == 0
    outcome = json.loads(capsys.readouterr().out)
    plan = outcome["plan"]
    assert plan["fits"] and max(plan["rank_peak_memory_bytes"]) <= outcome["budget_bytes"]
    recomputed = [
        sum(1 for layer in plan["plan"]["layers"] if layer["rank"] == s and layer["recompute"] != "none")
        for s in range(4)
    ]
    assert any(recomputed) and not all(recomputed)  # the budget forces recompute on some stages only
    configs = out / "configs"
    mindformers = yaml.safe_load((configs / "mindformers_llama.yaml").read_text())
    assert mindformers["model"]["model_config"]["offset"] == plan["plan"]["offset"]
    template_v2 = yaml.safe_load((configs / "mindformers_v2_llama.yaml").read_text())
    assert (
        template_v2["distribute_parallel_config"]["pipeline_parallel_config"]["pipeline_stage_offset"]
        == plan["plan"]["offset"]
    )
    assert "--pipeline-model-parallel-layout" in (configs / "megatron_llama.sh").read_text()
    titan = tomlkit.parse((configs / "torchtitan_llama.toml").read_text())
    assert len(titan["parallelism"]["module_fqns_per_model_part"]) == 4
    for name in ("plan.png", "plan.json", "plan.yaml", "profile.json", "report.md"):
        assert (out / name).stat().st_size > 0
    assert "even split" in (out / "report.md").read_text()


def test_demo_into_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    for out in ("taken", "taken/demo"):
        with pytest.raises(SystemExit):
            main(["demo", "--out", str(tmp_path / out)])
        assert (
            capsys.readouterr().err
            == f"sapp-hook demo: error: --out: {tmp_path / 'taken'} is not a folder; expected a folder to write the demo into\n"
        )
