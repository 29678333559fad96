"""`sapp-hook simulate`: replay a schedule for uniform stages; print the iteration time, bubble and memory."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from simulator import SCHEDULES, InputError, PipelineCosts, SimulationResult, build_schedule, simulate
from simulator.plot import check_plot_path
from simulator.units import format_bytes, parse_bytes

PROG = "sapp-hook simulate"
# Library field names as the flags a CLI user typed.
FLAGS = {
    "schedule": "--schedule",
    "stages": "--stages",
    "chunks": "--chunks",
    "micro_batches": "--micro-batches",
    "microbatch_group_size": "--microbatch-group-size",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "simulate",
        help="replay a pipeline schedule: iteration time, bubble split, memory per rank",
        description=(
            "Replay a pipeline schedule for uniform stages. F, B and W are a whole rank's times for one "
            "micro-batch (split evenly over its chunks); B is the full backward and W the part of it that "
            "computes weight gradients, which zero-bubble schedules defer. Times in milliseconds."
        ),
    )
    parser.add_argument("--schedule", required=True, metavar="NAME", help=f"one of: {', '.join(SCHEDULES)}")
    parser.add_argument("--stages", required=True, type=int, metavar="S", help="pipeline ranks")
    parser.add_argument("--chunks", type=int, metavar="V", help="chunks (virtual stages) per rank; default: the schedule's")
    parser.add_argument("--micro-batches", required=True, type=int, metavar="M")
    parser.add_argument("--forward", required=True, type=float, metavar="F", help="forward ms per micro-batch")
    parser.add_argument("--backward", required=True, type=float, metavar="B", help="full backward ms per micro-batch")
    parser.add_argument(
        "--weight", type=float, metavar="W", help="weight-gradient ms within B (default for I/W schedules: B/2)"
    )
    parser.add_argument("--recompute", type=float, default=0.0, metavar="R", help="recompute ms added to each backward")
    parser.add_argument("--p2p", type=float, default=0.0, metavar="T", help="ms to send one activation or gradient")
    parser.add_argument("--activation", default="0", metavar="SIZE", help="activation kept per micro-batch, e.g. 2GiB")
    parser.add_argument("--static", default="0", metavar="SIZE", help="parameters, gradients, optimizer state, e.g. 20GB")
    parser.add_argument("--working", default="0", metavar="SIZE", help="held while a backward runs, e.g. 1GiB")
    parser.add_argument(
        "--microbatch-group-size",
        type=int,
        metavar="G",
        help="Interleaved1F1B: Megatron's microbatch_group_size_per_vp_stage (default S, or what fits M)",
    )
    parser.add_argument("--plot", metavar="OUT", help="write a Gantt chart with memory curves (.png, .svg or .pdf)")
    parser.add_argument("--trace", metavar="OUT", help="write a Chrome/Perfetto trace (.json)")
    parser.add_argument("--csv", metavar="OUT", help="write the schedule in torch.distributed.pipelining's CSV format")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sapp_hook.cli import fail

    try:
        return _run(args)
    except InputError as exc:
        fail(PROG, f"{FLAGS[exc.field]}: {exc.detail}" if exc.field in FLAGS else str(exc))


def _run(args: argparse.Namespace) -> int:
    talk = not (args.json or args.quiet)
    for flag in ("forward", "backward", "weight", "recompute", "p2p"):
        value = getattr(args, flag)
        if value is not None and (not math.isfinite(value) or value < 0):
            raise InputError(f"--{flag}", f"expected a number of milliseconds >= 0, got {value:g}")
    if args.weight is not None and args.weight > args.backward:
        raise InputError("--weight", f"expected at most --backward ({args.backward:g}), got {args.weight:g}")
    sizes = {flag: parse_bytes(getattr(args, flag), f"--{flag}") for flag in ("activation", "static", "working")}
    outputs = {flag: Path(getattr(args, flag)) for flag in ("plot", "trace", "csv") if getattr(args, flag)}
    for flag, path in outputs.items():
        _check_output(f"--{flag}", path)
    if "plot" in outputs:
        check_plot_path(outputs["plot"], "--plot")

    schedule = build_schedule(
        args.schedule,
        stages=args.stages,
        micro_batches=args.micro_batches,
        chunks=args.chunks,
        microbatch_group_size=args.microbatch_group_size,
    )
    costs = PipelineCosts.uniform(
        schedule.stages,
        schedule.chunks,
        forward_ms=args.forward,
        backward_ms=args.backward,
        weight_ms=args.weight,
        recompute_ms=args.recompute,
        activation_bytes=sizes["activation"],
        static_bytes=sizes["static"],
        working_bytes=sizes["working"],
        p2p_ms=args.p2p,
    )
    if talk:
        for flag, size in sizes.items():
            if size:
                print(f"--{flag} {getattr(args, flag)} = {size:,} bytes ({format_bytes(size)})", file=sys.stderr)
        print(f"simulating {schedule.num_actions:,} actions ...", file=sys.stderr)
    result = simulate(schedule, costs)

    written = []
    for flag, path in outputs.items():
        if talk:
            print(f"writing {path} ...", file=sys.stderr)
        try:
            _write(flag, result, path)
        except OSError as exc:
            raise InputError(f"--{flag}", f"cannot write {path}: {exc.strerror or exc}") from None
        written.append(str(path))

    if args.json:
        print(json.dumps({**result.to_dict(), "written": written}, indent=2))
    elif not args.quiet:
        print(_report(result))
        for path in written:
            print(f"wrote {path}")
    return 0


def _check_output(flag: str, path: Path) -> None:
    folder = path.parent
    if not folder.is_dir():
        raise InputError(flag, f"folder {folder} does not exist")
    if path.is_dir():
        raise InputError(flag, f"{path} is a folder; expected a file name")


def _write(flag: str, result: SimulationResult, path: Path) -> None:
    if flag == "plot":
        from simulator.plot import draw_gantt

        draw_gantt(result, path)
    elif flag == "trace":
        from simulator.trace import write_chrome_trace

        write_chrome_trace(result, path)
    else:
        result.schedule.write_csv(path)


def _report(result: SimulationResult) -> str:
    schedule, bubble = result.schedule, result.bubble
    chunk_word = "chunk" if schedule.chunks == 1 else "chunks"
    lines = [
        f"{schedule.name}: {schedule.stages} stages x {schedule.chunks} {chunk_word}, "
        f"{schedule.micro_batches} micro-batches ({schedule.num_actions:,} actions)",
        f"iteration time  {result.iteration_time_ms:,.6g} ms",
        f"bubble          {bubble.real:.4f} = ideal {bubble.ideal:.4f} + imbalance {bubble.imbalance:.4f}"
        f" + recompute {bubble.recompute:.4f} + comm {bubble.comm:.4f}",
    ]
    if result.weight_split_assumed:
        lines.append("note            weight-gradient time not given (--weight): I and W each took half of B")
    lines.append(f"{'rank':>4}  {'busy ms':>10}  {'peak memory':>12}  {'peak activations':>16}")
    for rank in range(schedule.stages):
        lines.append(
            f"{rank:>4}  {result.stage_busy_ms[rank]:>10,.6g}  "
            f"{format_bytes(result.stage_peak_memory_bytes[rank]):>12}  {result.stage_peak_activations[rank]:>16}"
        )
    return "\n".join(lines)
