"""`sapp-hook run -- python train.py`: the job plans, exits 75, and is launched again to train with the plan."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from sapp_hook.cli import main

TEMPLATES = Path(__file__).parents[1] / "sapp_hook" / "templates"

TRAIN = textwrap.dedent("""
    import json, sys
    import torch, transformers
    from sapp_hook import autotune

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512)
    model = transformers.LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with autotune(model, optimizer, pipeline_parallel=4, micro_batches=8, schedule="1F1B", profile_steps=1) as tuner:
        for step in range(8):  # 7 profiling steps: a warm-up, one timed and one counting memory per mode
            ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tuner.step()
    with open(sys.argv[1], "a") as log:
        log.write(json.dumps({"from_cache": tuner.result.from_cache, "steps": 8}) + "\\n")
""")


def test_run_plans_writes_and_relaunches(tmp_path):
    script, log, config = tmp_path / "train.py", tmp_path / "runs.jsonl", tmp_path / "train.yaml"
    script.write_text(TRAIN)
    # the template's 8 layers made the 4 of the script's model; micro_batch_num 4, so that the plan's 8 is written
    # whatever split it measures (four blocks on four ranks split one way only, and no budget needs recompute)
    template = (TEMPLATES / "mindformers_llama.yaml").read_text()
    config.write_text(
        template.replace("num_layers: 8", "num_layers: 4").replace("micro_batch_num: 8", "micro_batch_num: 4")
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sapp_hook",
            "run",
            "--config",
            str(config),
            "--target",
            "mindformers",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--",
            sys.executable,
            str(script),
            str(log),
        ],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "sapp-hook run: planned; training" in done.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert runs == [{"from_cache": True, "steps": 8}]  # the planning launch exited before logging
    written = yaml.safe_load(config.read_text())
    assert written["parallel_config"]["micro_batch_num"] == 8
    assert sum(written["model"]["model_config"]["offset"] or [0]) == 0


def test_run_launches_once_where_the_config_already_says_the_plan(tmp_path):
    """A second `sapp-hook run` of the same job: its cached plan is already in the config, so the planning
    launch trains on with it and is the only launch."""
    script, log, config = tmp_path / "train.py", tmp_path / "runs.jsonl", tmp_path / "train.yaml"
    script.write_text(TRAIN)
    # micro_batch_num 4: the plan's 8 changes it, so the first run writes whatever split it measures
    template = (TEMPLATES / "mindformers_llama.yaml").read_text()
    config.write_text(
        template.replace("num_layers: 8", "num_layers: 4").replace("micro_batch_num: 8", "micro_batch_num: 4")
    )
    argv = [
        sys.executable,
        "-m",
        "sapp_hook",
        "run",
        "--config",
        str(config),
        "--target",
        "mindformers",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--",
        sys.executable,
        str(script),
        str(log),
    ]
    env = {
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    assert subprocess.run(argv, capture_output=True, text=True, env=env, check=False).returncode == 0  # plans, trains
    written = config.read_bytes()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert "sapp-hook run: the config already said the plan; the job trained with it" in done.stderr
    assert "planned; training" not in done.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert runs == [{"from_cache": True, "steps": 8}] * 2  # one per `sapp-hook run`: no second launch the second time
    assert config.read_bytes() == written


def test_run_needs_a_command(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--config", "x.yaml", "--target", "mindformers"])
    assert "COMMAND: give the training command after --" in capsys.readouterr().err


def test_run_refuses_a_config_it_could_not_write_before_launching(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["run", "--config", str(tmp_path / "none.yaml"), "--target", "mindformers", "--", "true"])
    assert f"--config: {tmp_path / 'none.yaml'} does not exist or is not a file" in capsys.readouterr().err


TRAIN_ON_TWO_RANKS = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed.nn.functional  # before the group is made: see docs/api.md on gloo
    import torch.distributed as dist
    from profiler_cases import llama
    from test_profiler_distributed import FirstStage, LastStage, train_stage
    from sapp_hook import autotune

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stage = (FirstStage if rank == 0 else LastStage)(llama())
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    with autotune(stage, optimizer, pipeline_parallel=2, micro_batches=4, schedule="1F1B", profile_steps=1,
                  modes=("none", "full")) as tuner:
        for step in range(tuner.profiler.total_steps):
            train_stage(stage, rank, step, optimizer)
            tuner.step()
    with open(f"{sys.argv[1]}.{rank}", "a") as log:
        log.write(json.dumps({"from_cache": tuner.result.from_cache}) + "\\n")
    dist.destroy_process_group()
""")


def test_run_under_torchrun_relaunches_though_torchrun_reports_status_1(tmp_path):
    # torchrun exits with 1 when its workers exit with 75: the file rank 0 leaves says it planned
    script, log, plan = tmp_path / "train.py", tmp_path / "runs.jsonl", tmp_path / "plan.json"
    script.write_text(TRAIN_ON_TWO_RANKS)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sapp_hook",
            "run",
            "--config",
            str(plan),
            "--target",
            "plan",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--",
            *torchrun,
            str(script),
            str(log),
        ],
        capture_output=True,
        text=True,
        env={
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(Path(__file__).parent),
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sapp-hook run: planned; training" in done.stderr
    for rank in (0, 1):  # the planning launch exited before logging; the second trained from the plan
        assert [json.loads(line) for line in Path(f"{log}.{rank}").read_text().splitlines()] == [{"from_cache": True}]
    assert json.loads(plan.read_text())["spec"]["pipeline_parallel"] == 2


def test_a_command_ended_by_a_signal_is_said_as_a_shell_says_it(capsys):
    # SIGKILL (9) before planning: the status a shell reports, 128 + 9, not Python's -9 (which exits as 247)
    status = main(["run", "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert status == 128 + 9
    assert "the planning launch failed with status 137" in capsys.readouterr().err


def test_a_command_that_ends_without_planning_is_not_a_success(capsys):
    assert main(["run", "--", sys.executable, "-c", "pass"]) == 4  # status 0, and nothing planned
    assert "the command finished without planning" in capsys.readouterr().err
