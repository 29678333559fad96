"""A training script that balances its own pipeline: a small Llama (random weights) under autotune.

    python examples/autotune_llama.py --config train.yaml --target mindformers
    sapp-hook run --config train.yaml --target mindformers -- python examples/autotune_llama.py

The plan goes into the config (copy sapp_hook/templates/mindformers_llama.yaml to try it); the second
form lets the job exit once planned and launches it again to train with the plan.
"""

from __future__ import annotations

import argparse
import logging

import torch
import transformers

import sapp_hook
from sapp_hook.models import build_model, load_config, parameter_dtype, random_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="launch config to write the plan into")
    parser.add_argument("--target", help="mindformers, megatron, torchtitan or plan")
    parser.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    parser.add_argument("--memory", default="80MiB", help="memory budget per device (default 80MiB)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    config = load_config("tiny-llama")
    model = build_model(config).to(device=args.device, dtype=parameter_dtype(args.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with sapp_hook.autotune(
        model,
        optimizer,
        pipeline_parallel=4,
        micro_batches=8,
        schedule="1F1B",
        memory_budget=args.memory,
        config=args.config,
        target=args.target,
    ) as tuner:
        for step in range(args.steps):
            batch = random_batch(config, 2, 128, seed=step)
            ids = batch["input_ids"].to(args.device)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tuner.step()
            logging.info("step %d: loss %.4f", step, loss.item())


if __name__ == "__main__":
    main()
