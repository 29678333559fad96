"""The runnable examples the README points to run as they are (CPU)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}


def run(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    # the plan cache in the test's own folder: a plan cached by an earlier run would be reused, not solved
    env = {**ENV, "XDG_CACHE_HOME": str(cwd / "cache")}
    done = subprocess.run([sys.executable, *arguments], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_simulate_schedules(tmp_path):
    run(str(ROOT / "examples" / "simulate_schedules.py"), "--out", str(tmp_path / "out"), cwd=tmp_path)
    written = {path.name for path in (tmp_path / "out").iterdir()}
    assert {"summary.md", "1F1B.trace.json", "DualPipeV.png"} <= written
    assert "| DualPipeV | 2 |" in (tmp_path / "out" / "summary.md").read_text()


def test_autotune_llama_writes_its_plan_into_the_config(tmp_path):
    config = tmp_path / "train.yaml"
    shutil.copy(ROOT / "sapp_hook" / "templates" / "mindformers_llama.yaml", config)
    before = yaml.safe_load(config.read_text())["model"]["model_config"]["offset"]
    # 10 profiling steps (1 warm-up, 2 timed and 1 counting memory per recompute mode), then training
    # goes on with the plan
    done = run(
        str(ROOT / "examples" / "autotune_llama.py"),
        "--config",
        str(config),
        "--target",
        "mindformers",
        "--steps",
        "11",
        cwd=tmp_path,
    )
    offset = yaml.safe_load(config.read_text())["model"]["model_config"]["offset"]
    assert "step 10: loss" in done.stdout + done.stderr
    assert len(list((tmp_path / "cache" / "sapp-hook").glob("*.json"))) == 1
    assert offset != before and len(offset) == 4 and sum(offset) == 0
