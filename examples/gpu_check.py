"""The profiler's CUDA path and the memory model, checked on a GPU (the CI machines have none):

    python examples/gpu_check.py [--out DIR] [--dtype bfloat16]

1. Profiles tiny-llama on cuda and on the CPU: per layer the times (device events on cuda), the
   activation bytes both measured (fused GPU attention keeps other tensors: 25% more on an H200)
   and the working set from the allocator's peaks.
2. Profiles a 1024-wide Llama on cuda, plans it on 4 pipeline ranks, and runs each rank's actions on the
   GPU (`sapp_hook.validation.one_device`): the activations autograd held, the allocator's peak and the compute time,
   each beside the simulator's prediction for that rank.

Prints one JSON report; exits non-zero if the CUDA path is broken.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from sapp_hook.models import build_model, load_config, parameter_dtype, profile_example
from sapp_hook.validation.one_device import run_on_one_device
from sapp_hook.validation.validate import predictions
from solver import ModelProfile, PipelineSpec, even_plan, solve
from solver.vocabulary.profile import FULL, NONE, SELECTIVE

# Wide enough that activations dwarf the allocator's 512-byte rounding; untied, as tiny-llama.
REPLAY_MODEL = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
REPLAY_MICRO_BATCH_SIZE, REPLAY_SEQ_LEN = 2, 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the report (gpu_check.json) and the one-device Llama's profile")
    parser.add_argument(
        "--dtype", default="float32", help="the one-device Llama's parameters: float32 (default), bfloat16 or float16"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    layers, problems = check_layers()
    plans, profile, one_device_problems = check_one_device_runs(dtype=args.dtype)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "layers": layers,
        "plans": plans,
        "problems": problems + one_device_problems,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
        (Path(args.out) / f"gpu_check{suffix}.json").write_text(json.dumps(report, indent=1))
        (Path(args.out) / f"llama-1024{suffix}.profile.json").write_text(json.dumps(profile.to_dict(), indent=1))
    return 1 if report["problems"] else 0


def check_layers() -> tuple[list[dict], list[str]]:
    """Part 1: tiny-llama's layers profiled on cuda next to the CPU."""
    config = load_config("tiny-llama")
    profiles = {}
    for device in ("cuda", "cpu"):
        profiles[device] = profile_example(
            config, steps=2, micro_batch_size=2, seq_len=128, model_name=device, device=device
        )
    rows, problems = [], []
    for gpu, cpu in zip(profiles["cuda"].layers, profiles["cpu"].layers):
        row = {
            "layer": gpu.name,
            "cuda_forward_ms": gpu.forward_ms,
            "cuda_backward_ms": gpu.backward_ms,
            "cuda_weight_ms": gpu.weight_ms,
            "cuda_activation_bytes": gpu.recompute["none"].activation_bytes,
            "cpu_activation_bytes": cpu.recompute["none"].activation_bytes,
            "cuda_working_bytes": gpu.recompute["none"].working_bytes,
            # a split backward on the device: I's time, and what waits for W (the CPU's is exact)
            "cuda_input_ms": gpu.input_ms,
            "cuda_pending_bytes": gpu.recompute["none"].pending_bytes,
            "cpu_pending_bytes": cpu.recompute["none"].pending_bytes,
            # what each half holds at its peak (the CPU's counted op by op)
            **{
                f"{device}_{half}": getattr(layer.recompute["none"], half)
                for device, layer in (("cuda", gpu), ("cpu", cpu))
                for half in ("input_working_bytes", "weight_working_bytes")
            },
        }
        rows.append(row)
        if not gpu.forward_ms > 0 or not gpu.backward_ms > 0:
            problems.append(f"{gpu.name}: times not measured on cuda")
        if gpu.parameter_bytes != cpu.parameter_bytes:
            problems.append(
                f"{gpu.name}: parameter bytes differ ({gpu.parameter_bytes} on cuda, {cpu.parameter_bytes})"
            )
        if gpu.is_body and not 0.5 < row["cuda_activation_bytes"] / row["cpu_activation_bytes"] < 1.5:
            problems.append(f"{gpu.name}: activation bytes far from the CPU's")
        if gpu.is_body and not 0.5 < row["cuda_pending_bytes"] / max(row["cpu_pending_bytes"], 1) < 1.5:
            problems.append(f"{gpu.name}: a split backward's pending bytes far from the CPU's")
    return rows, problems


def check_one_device_runs(device: str = "cuda", dtype: str = "float32") -> tuple[list[dict], ModelProfile, list[str]]:
    """Part 2: each rank of four 4-stage 1F1B plans run on the GPU, beside the simulator's prediction."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{k: v for k, v in REPLAY_MODEL.items() if k != "model_type"})
    profile = profile_example(
        config,
        steps=3,
        micro_batch_size=REPLAY_MICRO_BATCH_SIZE,
        seq_len=REPLAY_SEQ_LEN,
        modes=(NONE, SELECTIVE, FULL),
        model_name="llama-1024",
        device=device,
        dtype=dtype,
    )
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B")
    unbounded = even_plan(profile, spec, NONE)
    # a budget the plain split overruns, so that the solver mixes recompute modes
    budget = 0.75 * max(unbounded.rank_peak_memory_bytes)
    plans = {
        "even-none": unbounded,
        "solved-75%": solve(profile, dataclasses.replace(spec, memory_budget_bytes=budget), time_limit_s=30),
        "even-selective": even_plan(profile, spec, SELECTIVE),
        "even-full": even_plan(profile, spec, FULL),
    }
    rows, problems = [], []
    for name, plan in plans.items():
        # fresh: apply leaves each block under its plan's recompute
        model = build_model(config).to(device=device, dtype=parameter_dtype(dtype))
        predicted = predictions(plan, profile, input_bytes=REPLAY_MICRO_BATCH_SIZE * REPLAY_SEQ_LEN * 8)
        ranks = []
        for rank in range(spec.pipeline_parallel):
            measured = run_on_one_device(
                model, plan, rank, micro_batch_size=REPLAY_MICRO_BATCH_SIZE, seq_len=REPLAY_SEQ_LEN, steps=3
            )
            costs = plan.simulation.costs.chunk_costs[rank]
            row = {
                "rank": rank,
                "predicted_forward_ms": spec.micro_batches * sum(c.forward_ms for c in costs),
                "measured_forward_ms": measured.forward_ms,
                "predicted_backward_ms": spec.micro_batches * sum(c.backward_ms + c.recompute_ms for c in costs),
                "measured_backward_ms": measured.backward_ms,
                "predicted_activation_peak_bytes": predicted["activation_peak_bytes"][rank],
                "held_peak_bytes": measured.held_peak_bytes,
                "predicted_peak_bytes": predicted["peak_bytes"][rank],
                "allocated_peak_bytes": measured.allocated_peak_bytes,
            }
            ranks.append(row)
            if not measured.allocated_peak_bytes or not measured.forward_ms > 0:
                problems.append(f"{name} rank {rank}: nothing measured")
        rows.append(
            {
                "plan": name,
                "stage_layer_counts": list(plan.stage_layer_counts),
                "layer_modes": list(plan.layer_modes),
                "ranks": ranks,
            }
        )
    return rows, profile, problems


if __name__ == "__main__":
    sys.exit(main())
