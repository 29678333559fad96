"""`sapp-hook run -- python train.py`: the job plans, exits 75, and is launched again to train with the plan."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from sapp_hook.cli import main

TEMPLATES = Path(__file__).parents[1] / "sapp_hook" / "templates"

TRAIN = textwrap.dedent('''
    import json, sys
    import torch, transformers
    from sapp_hook import autotune

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512)
    model = transformers.LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with autotune(model, optimizer, stages=4, micro_batches=8, schedule="1F1B", profile_steps=1) as tuner:
        for step in range(6):
            ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tuner.step()
    with open(sys.argv[1], "a") as log:
        log.write(json.dumps({"from_cache": tuner.result.from_cache, "steps": 6}) + "\\n")
''')


def test_run_plans_writes_and_relaunches(tmp_path):
    script, log, config = tmp_path / "train.py", tmp_path / "runs.jsonl", tmp_path / "train.yaml"
    script.write_text(TRAIN)
    shutil.copy(TEMPLATES / "mindformers_llama.yaml", config)
    done = subprocess.run(
        [sys.executable, "-m", "sapp_hook", "run", "--config", str(config), "--target", "mindformers",
         "--cache-dir", str(tmp_path / "cache"), "--", sys.executable, str(script), str(log)],
        capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "sapp-hook run: planned; training" in done.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert runs == [{"from_cache": True, "steps": 6}]  # the planning launch exited before logging
    offset = yaml.safe_load(config.read_text())["model"]["model_config"]["offset"]
    assert isinstance(offset, list) and sum(offset) == 0


def test_run_needs_a_command(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--config", "x.yaml", "--target", "mindformers"])
    assert "COMMAND: give the training command after --" in capsys.readouterr().err
