"""Simulate one model under every schedule sapp-hook knows, and draw each (what `make demo` runs).

The model is Llama-3-8B-shaped (32 layers, hidden 4096, vocabulary 128,256, sequence 4,096) on
4 pipeline ranks with 16 micro-batches, split evenly: 8 layers per rank, the embedding on the
first stage and the final norm + LM head + loss on the last. Costs are derived, not measured:
times from matmul FLOPs at an assumed 400 TFLOP/s, activation memory from Korthikanti et al.
(34 bytes x sequence x hidden per layer with flash attention, bf16), static memory at 16 bytes
per parameter (bf16 weights and gradients, fp32 master weights and Adam). The heavy LM head
makes the even split uneven: the bubble split shows what that costs.

    python examples/simulate_schedules.py --out demo
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from basics.units import format_bytes
from simulator import ChunkCosts, PipelineCosts, SimulationResult, build_schedule, simulate
from simulator.plot import draw_gantt
from simulator.trace import write_chrome_trace

ASSUMED_FLOPS_PER_S = 400e12
BYTES_PER_PARAMETER = 16  # bf16 weight + bf16 gradient + fp32 master weight + fp32 Adam m and v
STAGES, MICRO_BATCHES = 4, 16
SCHEDULES = [
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("Interleaved1F1B-less-memory", 2),
    ("ZBH1", 1),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
]


@dataclass(frozen=True)
class LlamaShape:
    layers: int = 32
    hidden: int = 4096
    ffn: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128_256
    sequence: int = 4096
    micro_batch: int = 1

    @property
    def tokens(self) -> int:
        return self.sequence * self.micro_batch

    @property
    def layer_parameters(self) -> int:
        kv_width = self.hidden * self.kv_heads // self.heads
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv_width + 3 * self.hidden * self.ffn


def ms(flops: float) -> float:
    return flops / ASSUMED_FLOPS_PER_S * 1e3


def layer_costs(shape: LlamaShape) -> ChunkCosts:
    """One decoder layer: matmuls 2 FLOPs per parameter per token, causal attention 2*s*h per token."""
    matmul = 2.0 * shape.layer_parameters * shape.tokens
    attention = 2.0 * shape.sequence * shape.hidden * shape.tokens
    return ChunkCosts(
        forward_ms=ms(matmul + attention),
        backward_ms=ms(2 * matmul + 2 * attention),  # input and weight gradients of the matmuls
        weight_ms=ms(matmul),  # attention scores have no weights
        activation_bytes=34 * shape.tokens * shape.hidden,
        static_bytes=BYTES_PER_PARAMETER * shape.layer_parameters,
    )


def head_costs(shape: LlamaShape) -> ChunkCosts:
    """The embedding: a lookup (no FLOPs worth counting), its table and optimizer state."""
    return ChunkCosts(
        forward_ms=0.0, backward_ms=0.0, weight_ms=0.0, static_bytes=BYTES_PER_PARAMETER * shape.vocab * shape.hidden
    )


def tail_costs(shape: LlamaShape) -> ChunkCosts:
    """Final norm, LM head and loss: the logits matmul, and fp32 logits kept for the loss."""
    matmul = 2.0 * shape.vocab * shape.hidden * shape.tokens
    return ChunkCosts(
        forward_ms=ms(matmul),
        backward_ms=ms(2 * matmul),
        weight_ms=ms(matmul),
        activation_bytes=4 * shape.tokens * shape.vocab + 2 * shape.tokens * shape.hidden,
        static_bytes=BYTES_PER_PARAMETER * shape.vocab * shape.hidden,
    )


def add(parts: list[ChunkCosts]) -> ChunkCosts:
    return ChunkCosts(
        forward_ms=sum(p.forward_ms for p in parts),
        backward_ms=sum(p.backward_ms for p in parts),
        weight_ms=sum(p.split_weight_ms() for p in parts),
        activation_bytes=sum(p.activation_bytes for p in parts),
        static_bytes=sum(p.static_bytes for p in parts),
    )


def even_split(shape: LlamaShape, name: str, chunks: int) -> PipelineCosts:
    """Layers split evenly over the virtual stages; head on the first, tail on the last (rank 0 for V schedules)."""
    schedule = build_schedule(name, STAGES, MICRO_BATCHES, chunks)
    per_stage = shape.layers // schedule.num_virtual_stages
    grid = []
    for rank in range(STAGES):
        row = []
        for chunk in range(chunks):
            stage_index = schedule.stage_index(rank, chunk)
            parts = [layer_costs(shape)] * per_stage
            if stage_index == 0:
                parts.append(head_costs(shape))
            if stage_index == schedule.num_virtual_stages - 1:
                parts.append(tail_costs(shape))
            row.append(add(parts))
        grid.append(tuple(row))
    return PipelineCosts(tuple(grid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo", help="folder for the charts, a trace and summary.md")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    shape = LlamaShape()
    results: list[SimulationResult] = []
    for name, chunks in SCHEDULES:
        result = simulate(build_schedule(name, STAGES, MICRO_BATCHES, chunks), even_split(shape, name, chunks))
        chart = out / f"{name}.png"
        print(f"{name:<28} {result.iteration_time_ms:9.1f} ms   -> {chart}", file=sys.stderr)
        draw_gantt(result, chart)
        results.append(result)
    write_chrome_trace(results[1], out / "1F1B.trace.json")

    summary = render_summary(shape, results)
    (out / "summary.md").write_text(summary)
    print(summary)
    print(f"wrote {len(results)} charts, 1F1B.trace.json (open in https://ui.perfetto.dev) and summary.md to {out}/")
    return 0


def render_summary(shape: LlamaShape, results: list[SimulationResult]) -> str:
    lines = [
        (
            f"Llama-3-8B shape, {STAGES} ranks, {MICRO_BATCHES} micro-batches of {shape.sequence} tokens, even split "
            f"(times at an assumed {ASSUMED_FLOPS_PER_S / 1e12:.0f} TFLOP/s)"
        ),
        "",
        "| schedule | chunks | iteration ms | bubble | ideal | imbalance | peak memory (rank) |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        peak = max(result.rank_peak_memory_bytes)
        rank = result.rank_peak_memory_bytes.index(peak)
        bubble = result.bubble
        lines.append(
            f"| {result.schedule.name} | {result.schedule.chunks} | {result.iteration_time_ms:.1f} | {bubble.real:.3f} | "
            f"{bubble.ideal:.3f} | {bubble.imbalance:.3f} | {format_bytes(peak)} ({rank}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
