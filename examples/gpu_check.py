"""The profiler's CUDA path, checked on a GPU (the CI machines have none). One short script:

    python examples/gpu_check.py [--out DIR]

Profiles tiny-llama on cuda and on the CPU, and prints per layer the times (device events on cuda),
the activation bytes both measured (fused GPU attention keeps other tensors, so they differ a little)
and the working set from the allocator's peaks. Exits non-zero if the CUDA path is broken.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sapp_hook.models import load_config, profile_example


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for gpu_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    config = load_config("tiny-llama")
    profiles = {}
    for device in ("cuda", "cpu"):
        profiles[device] = profile_example(config, steps=2, micro_batch_size=2, seq_len=128, model_name=device,
                                           device=device)
    rows, problems = [], []
    for gpu, cpu in zip(profiles["cuda"].layers, profiles["cpu"].layers):
        row = {
            "layer": gpu.name,
            "cuda_forward_ms": gpu.forward_ms, "cuda_backward_ms": gpu.backward_ms, "cuda_weight_ms": gpu.weight_ms,
            "cuda_activation_bytes": gpu.recompute["none"].activation_bytes,
            "cpu_activation_bytes": cpu.recompute["none"].activation_bytes,
            "cuda_working_bytes": gpu.recompute["none"].working_bytes,
        }
        rows.append(row)
        if not gpu.forward_ms > 0 or not gpu.backward_ms > 0:
            problems.append(f"{gpu.name}: times not measured on cuda")
        if gpu.parameter_bytes != cpu.parameter_bytes:
            problems.append(f"{gpu.name}: parameter bytes differ ({gpu.parameter_bytes} on cuda, {cpu.parameter_bytes})")
        if gpu.is_body and not 0.5 < row["cuda_activation_bytes"] / row["cpu_activation_bytes"] < 1.5:
            problems.append(f"{gpu.name}: activation bytes far from the CPU's")
    report = {"device": profiles["cuda"].device, "layers": rows, "problems": problems}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
