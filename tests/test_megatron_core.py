"""The hook inside Megatron-core's own pipeline schedule (megatron-core 0.16.1 from PyPI, its 1F1B over gloo, 2 CPU
processes, pipeline size 2), launched by `sapp-hook run -- bash train.sh` as a user would: the first launch
profiles in the schedule's own steps, plans and writes the launch script's flags, the relaunch builds the plan's
split from them and trains with it. The test-only patches that let Megatron-core run on a CPU are in
megatron_cpu.py; the training script reads Megatron-LM's flag names, as Megatron-LM's arguments do."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
MEGATRON_CORE = importlib.metadata.version("megatron-core")  # the test extras pin it: a missing one fails here

TRAIN = textwrap.dedent("""
    import argparse
    import json

    import megatron_cpu  # noqa: F401  (test-only patches, before megatron)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--pipeline-model-parallel-size", "--num-layers", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers", "--hidden-size", "--num-attention-heads", "--vocab-size",
                 "--seq-length", "--micro-batch-size", "--global-batch-size", "--train-iters"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--pipeline-model-parallel-layout")
    args = parser.parse_args()
    dist.init_process_group("gloo")

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sapp_hook.frameworks.megatron_core import autotuned

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    with open("built.jsonl", "a") as log:
        log.write(json.dumps({"rank": dist.get_rank(), "layers": [l.layer_number for l in model.decoder.layers]}) + "\\n")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    size, length = args.micro_batch_size, args.seq_length

    def batches():
        generator = torch.Generator().manual_seed(0)
        while True:
            tokens = torch.randint(0, args.vocab_size, (size, length), generator=generator)
            yield tokens, torch.arange(length).expand(size, length), torch.ones(size, 1, length, length, dtype=torch.bool)

    def forward_step(data, chunk):
        tokens, positions, mask = next(data)
        losses = chunk(tokens, positions, mask, labels=tokens)
        return losses, lambda output: (output.float().mean(), {"lm loss": output.float().mean().detach()})

    forward_backward = autotuned(
        get_forward_backward_func(), model, optimizer, memory_budget="1GB", config="train.sh", profile_steps=1,
        out_dir="out",
    )
    data = batches()
    for iteration in range(args.train_iters):
        forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                         num_microbatches=args.global_batch_size // size, seq_length=length, micro_batch_size=size)
        optimizer.step()
        optimizer.zero_grad()
""")

# The split written by hand puts the heavy end (the 8,192-word output layer and its loss) with three layers
LAUNCH = textwrap.dedent("""
    #!/bin/bash
    GPT_ARGS=(
        --pipeline-model-parallel-size 2
        --num-layers 4
        --decoder-first-pipeline-num-layers 1
        --decoder-last-pipeline-num-layers 3
        --hidden-size 64
        --num-attention-heads 4
        --vocab-size 8192
        --seq-length 32
        --micro-batch-size 2
        --global-batch-size 8
        --train-iters 10
    )
    torchrun --nproc-per-node 2 train.py "${GPT_ARGS[@]}"
""").lstrip()


def test_megatron_core_profiles_plans_writes_relaunches_and_trains_with_the_plan(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "train.sh").write_text(LAUNCH)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),  # torchrun
    }
    command = [
        sys.executable,
        "-m",
        "sapp_hook",
        "run",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--",
        "bash",
        "train.sh",
    ]
    done = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sapp-hook run: planned; training" in done.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    counts = [[count for count in rank] for rank in plan["plan"]["rank_chunk_layers"]]
    body = [counts[0][0] - 1, counts[1][0] - 1]  # less the embedding on the first rank, the output layer on the last
    assert body != [1, 3] and sum(body) == 4
    written = (tmp_path / "train.sh").read_text()
    # the first rank's count, or the layout string where the last rank holds no decoder layer
    said = (
        f"--decoder-first-pipeline-num-layers {body[0]}"
        if body[1]
        else f"--pipeline-model-parallel-layout 'Et*{body[0]}|L'"
    )
    assert said in written.replace('"', "'"), written  # the layout quoted either way: bash passes it alike
    assert (tmp_path / "train.sh.sapp-hook.bak").read_text() == LAUNCH
    launches = [json.loads(line) for line in (tmp_path / "built.jsonl").read_text().splitlines()]
    relaunch = sorted(launches[2:], key=lambda line: line["rank"])
    assert [len(line["layers"]) for line in relaunch] == body  # Megatron built the plan's split from the flags
    assert [layer for line in relaunch for layer in line["layers"]] == [1, 2, 3, 4]
    for rank in json.loads((tmp_path / "out" / "check.json").read_text())["ranks"]:
        assert rank["measured_activation_bytes"] == rank["predicted_activation_bytes"], rank


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_step_ends_with_the_optimizers_so_the_last_needs_no_call_after_it(monkeypatch, with_optimizer):
    """A job that trains exactly the steps profiling needs gets its plan: the wrapper ends a step at the optimizer's
    step, not at the next call (without an optimizer to watch, the next call ends it, as before)."""
    from profiler_cases import batch, llama

    from sapp_hook.frameworks import megatron_core
    from sapp_hook.hook.tune import AutoTuner

    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plain_tuner(chunk, optimizer, micro_batches, **options):  # Megatron's parallel_state left out
        tuner = AutoTuner(chunk, optimizer, pipeline_parallel=2, micro_batches=micro_batches, **options)
        tuner.profiler.attach()
        return tuner

    def forward_backward(*, step, num_microbatches, forward_only=False):
        loss = model(input_ids=batch(step), labels=batch(step), use_cache=False).loss
        if not forward_only:
            loss.backward()

    monkeypatch.setattr(megatron_core, "tuner_for", plain_tuner)
    monkeypatch.setattr(megatron_core, "_unwrapped", lambda chunk: chunk)
    wrapped = megatron_core.autotuned(forward_backward, model, optimizer if with_optimizer else None, quiet=True,
                                      profile_steps=1)  # fmt: skip
    wrapped(step=-1, num_microbatches=4, forward_only=True)  # evaluation: passes through, no tuner
    assert wrapped.tuner is None
    steps = 0
    while steps < 20 and (wrapped.tuner is None or wrapped.tuner.result is None):
        wrapped(step=steps, num_microbatches=4)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
    needed = wrapped.tuner.profiler.total_steps  # a warm-up, then none and full: one timed, one counting memory
    assert (needed, steps) == (5, 5 if with_optimizer else 6)
