"""The hook inside TorchTitan's own Trainer (torchtitan 0.2.2 from PyPI), on 2 CPU processes under torchrun with
gloo and pipeline degree 2, launched by `sapp-hook run` as a user would: the first launch profiles in TorchTitan's
own steps, plans and writes the job's TOML, the relaunch builds the plan's split and trains with it, and a change
to the job is planned again. The test-only patches that let TorchTitan run on a CPU are in torchtitan_cpu.py."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tokenizers
import tomllib

TESTS = Path(__file__).parent
TORCHTITAN = importlib.metadata.version("torchtitan")  # the test extras pin it: a missing one fails here
WORDS = [f"w{i}" for i in range(2000)]  # a vocabulary inside the debug model's 2048 ids

CONFIG = textwrap.dedent("""
    [job]
    dump_folder = "./outputs"
    description = "Llama 3 debug model, pipeline degree 2 on the CPU"

    [metrics]
    log_freq = 1

    [model]
    name = "llama3"
    flavor = "debugmodel"
    hf_assets_path = "./assets/tokenizer"

    [optimizer]
    name = "AdamW"
    lr = 8e-4

    [training]
    local_batch_size = 4
    seq_len = 256
    steps = 10
    dataset = "c4_test"
    dataset_path = "./assets/data"

    [parallelism]
    pipeline_parallel_degree = 2
    pipeline_parallel_schedule = "1F1B"
    pipeline_parallel_microbatch_size = 1

    [activation_checkpoint]
    mode = "none"
""")

TRAIN = textwrap.dedent("""
    import json
    import os

    import torchtitan_cpu  # noqa: F401  (test-only patches, before torchtitan)
    import torch.distributed as dist
    from torchtitan.train import Trainer, main

    from sapp_hook.frameworks.torchtitan import autotuned


    class Recording(Trainer):
        \"\"\"Records the modules TorchTitan built on this rank, in model order.\"\"\"

        def __init__(self, job_config):
            super().__init__(job_config)
            parts = []
            for part in self.model_parts:
                names = ["tok_embeddings"] if part.tok_embeddings is not None else []
                names += [f"layers.{key}" for key in part.layers]
                names += [name for name in ("norm", "output") if getattr(part, name) is not None]
                parts.append(names)
            with open("built.jsonl", "a") as log:
                log.write(json.dumps({"rank": dist.get_rank(), "parts": parts}) + "\\n")


    if __name__ == "__main__":
        main(autotuned(Recording, memory_budget="2GB", profile_steps=1, out_dir="out"))
""")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A folder TorchTitan's debug job runs in: a word-level tokenizer, a small JSONL data set, its TOML and
    the training script (no downloads)."""
    folder = tmp_path_factory.mktemp("torchtitan")
    tokenizer = folder / "assets" / "tokenizer"
    tokenizer.mkdir(parents=True)
    special = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    model = tokenizers.models.WordLevel(vocab={**special, **{w: i + 3 for i, w in enumerate(WORDS)}}, unk_token="<unk>")
    words = tokenizers.Tokenizer(model)
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True})
    )
    data = folder / "assets" / "data"
    data.mkdir()
    rng = random.Random(0)
    with open(data / "train.json", "w") as lines:
        for _ in range(200):
            lines.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(600))}) + "\n")
    (folder / "train.toml").write_text(CONFIG)
    (folder / "train.py").write_text(TRAIN)
    return folder


def run(folder: Path) -> subprocess.CompletedProcess[str]:
    """`sapp-hook run -- torchrun --nproc-per-node 2 train.py --job.config_file train.toml` in `folder`."""
    torchrun = Path(sys.executable).with_name("torchrun")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "sapp_hook", "run", "--cache-dir", str(folder / "cache"), "--"]
    command += [str(torchrun), "--nproc-per-node", "2", "train.py", "--job.config_file", "train.toml"]
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=600)


def built(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "built.jsonl").read_text().splitlines()]


def test_torchtitan_profiles_plans_writes_relaunches_and_trains_with_the_plan(job):
    done = run(job)
    assert done.returncode == 0, done.stderr[-3000:]
    config = tomllib.loads((job / "train.toml").read_text())
    plan = json.loads((job / "out" / "plan.json").read_text())
    planned = config["parallelism"]["module_fqns_per_model_part"]
    from sapp_hook import layout_from_dict, torchtitan_module_names

    assert planned == torchtitan_module_names(layout_from_dict(plan))
    launches = built(job)
    assert len(launches) == 4  # two ranks, launched twice: the relaunch built the plan's split
    relaunch = sorted(launches[2:], key=lambda line: line["rank"])
    assert [line["parts"][0] for line in relaunch] == planned
    assert (job / "train.toml.sapp-hook.bak").read_text() == CONFIG  # what was there, kept
    assert (job / "out" / "check.json").is_file(), done.stderr[-3000:]  # the relaunch checked the plan it reused
    checked = json.loads((job / "out" / "check.json").read_text())
    for rank in checked["ranks"]:
        assert (
            abs(rank["measured_activation_bytes"] - rank["predicted_activation_bytes"])
            <= 0.05 * rank["predicted_activation_bytes"]
        ), rank


def test_a_changed_job_is_planned_again(job):
    """After the plan above: the same job at another sequence length is another job (no plan reused)."""
    before = plan_entries(job)
    assert len(before) == 1, "runs after the test above, whose plan is cached"
    text = (job / "train.toml").read_text().replace("seq_len = 256", "seq_len = 128")
    (job / "train.toml").write_text(text)
    (job / "built.jsonl").unlink()
    done = run(job)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no cached plan" in done.stdout + done.stderr  # TorchTitan's logger prints on stdout
    (new,) = set(plan_entries(job)) - set(before)  # planned again, beside the first job's plan
    entry = json.loads(new.read_text())
    assert entry["profile"]["micro_batch"] == {"size": 1, "sequence": 128}  # profiled at the job's new length


def plan_entries(job: Path) -> list[Path]:
    return [path for path in (job / "cache").glob("*.json") if not path.name.endswith(".profile.json")]
