"""The hook in real jobs: 2 processes under torchrun, launched by `sapp-hook run` as a user would, each training its
pipeline stage of a transformers Llama with torch.distributed.pipelining (the stages `build_stages` makes of the
plan the job wrote). One rank writes and speaks, the planning launch ends without a launcher's traceback, a launch
without a process group is one clear error, and a change the cache key does not name (the attention kernel) is
found in the first step under the plan and planned again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TRAIN = textwrap.dedent("""
    import json
    import os
    import sys

    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.pipelining import PipelineStage

    from sapp_hook import autotune, build_stages, schedule_class

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    attention, plan_file, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if os.environ.get("NO_GROUP") != "1":
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation=attention,
    )
    model = transformers.LlamaForCausalLM(config).train()
    if os.path.exists(plan_file):
        with open(plan_file) as file:
            plan = json.load(file)
    else:  # before any plan: the blocks halved between the two ranks
        names = ["head", *[f"model.layers.{i}" for i in range(4)], "tail"]
        kinds = ["head", *["body:LlamaDecoderLayer"] * 4, "tail"]
        layers = [{"name": n, "kind": k, "virtual_stage": int(i >= 3), "recompute": "none"}
                  for i, (n, k) in enumerate(zip(names, kinds))]
        plan = {"spec": {"pipeline_parallel": 2, "micro_batches": 4, "schedule": "1F1B"}, "plan": {"layers": layers}}
    [(index, module)] = build_stages(model, plan, rank)
    loss = lambda logits, target: torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    stage = PipelineStage(module, index, 2, torch.device("cpu")) if dist.is_initialized() else None
    pipeline = schedule_class(plan)(stage, 4, loss_fn=loss) if stage is not None else None
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    with autotune(module, optimizer, pipeline_parallel=2, micro_batches=4, schedule="1F1B", config=plan_file,
                  layers=["layers.*"],
                  target="plan", profile_steps=1, out_dir="out") as tuner:
        for step in range(steps):
            ids = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(step))
            if pipeline is None:
                module(ids).sum().backward() if rank == 0 else None
            elif rank == 0:
                pipeline.step(ids)
            else:
                pipeline.step(target=ids)
            optimizer.step()
            optimizer.zero_grad()
            tuner.step()
    if dist.is_initialized():
        dist.destroy_process_group()
""")


def launch(folder: Path, *job: str, group: bool = True) -> subprocess.CompletedProcess[str]:
    """`sapp-hook run -- torchrun --nproc-per-node 2 train.py ATTENTION plan.json STEPS` in `folder`."""
    torchrun = Path(sys.executable).with_name("torchrun")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "NO_GROUP": "0" if group else "1"}
    command = [sys.executable, "-m", "sapp_hook", "run", "--cache-dir", str(folder / "cache"), "--"]
    command += [str(torchrun), "--nproc-per-node", "2", "train.py", *job]
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=600)


def said(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The hook's own lines a user sees."""
    return [line for line in done.stderr.splitlines() if line.startswith("sapp-hook: ")]


def test_one_rank_writes_and_speaks_the_launch_ends_cleanly_and_a_changed_kernel_is_planned_again(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    first = launch(tmp_path, "sdpa", "plan.json", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    lines = said(first)
    assert sum(line.startswith("sapp-hook: wrote ") for line in lines) == 1  # rank 0 alone writes and says so
    assert any(line.startswith("sapp-hook: plan: 1F1B on 2 ranks") for line in lines)
    assert "Traceback" not in first.stderr and "ChildFailedError" not in first.stderr  # the planning launch ended
    assert "sapp-hook run: planned; training" in first.stderr
    assert "sapp-hook: under the plan, each rank held what it predicted" in lines[-1]  # the relaunch, measured
    report = (tmp_path / "out" / "report.txt").read_text()
    assert report.startswith("1F1B: 2 ranks") and "under the plan, its first step:" in report  # kept, then added to

    # the same job with another attention kernel: the same parameters, so the same key; more activations
    changed = launch(tmp_path, "eager", "plan.json", "10")
    assert changed.returncode == 0, changed.stderr[-3000:]
    lines = said(changed)
    assert any("of the activations the plan predicted (more than 5% off)" in line for line in lines), lines
    assert any("profiling and planning again" in line for line in lines)
    (entry,) = [path for path in (tmp_path / "cache").glob("*.json") if not path.name.endswith(".profile.json")]
    assert json.loads(entry.read_text()).get("replanned_after_drift") is True
    again = launch(tmp_path, "eager", "plan.json", "4")  # the plan made for the eager kernel holds
    assert again.returncode == 0, again.stderr[-3000:]
    assert any("each rank held what it predicted" in line for line in said(again)), said(again)


def test_processes_no_group_joins_are_refused_before_anything_is_written(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    done = launch(tmp_path, "sdpa", "plan.json", "3", group=False)
    assert done.returncode != 0
    assert "no torch.distributed process group joins them" in done.stderr
    assert "call torch.distributed.init_process_group()" in done.stderr
    assert not (tmp_path / "plan.json").exists() and not list((tmp_path / "cache").glob("*.json"))
