"""`sapp-hook validate`: run a plan on torch.distributed.pipelining and compare it with the prediction."""

from __future__ import annotations

import argparse
import json
import math
import sys

from sapp_hook.cli.common import (
    add_pipeline_flags,
    command,
    configure_logging,
    output_paths,
    read_profile,
    say,
    size_flag,
    write_output,
)
from sapp_hook.torch_engine import check_torch
from simulator.units import format_bytes

PROG = "sapp-hook validate"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "validate",
        help="run a plan on torch.distributed.pipelining (gloo, CPU) and compare it with the prediction",
        description=(
            "Profile the model in one process, plan (the solver's plan, the even split, or a plan JSON), run "
            "the plan with torch.distributed.pipelining on one gloo process per stage, and print per rank the "
            "predicted and measured step time, peak activation bytes (saved-tensor hooks in the real run) and "
            "peak bytes allocated during a step (torch.profiler's memory events, in two more steps)."
        ),
    )
    parser.add_argument("--model", required=True, metavar="NAME", help="a built-in model or a transformers config.json")
    add_pipeline_flags(parser, required=True)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--plan", metavar="FILE", help="a plan JSON (sapp-hook solve --plan-out); default: solve")
    which.add_argument("--even", action="store_true", help="the even split without recompute")
    which.add_argument("--even-full", action="store_true", help="the even split with full recompute")
    parser.add_argument("--memory", default=None, metavar="SIZE", help="memory budget per device for the solver")
    parser.add_argument("--profile", metavar="FILE", help="plan from this profile instead of profiling first")
    parser.add_argument("--profile-out", metavar="OUT", help="write the profile planned from (for sapp-hook calibrate)")
    parser.add_argument("--steps", type=int, default=4, metavar="N", help="measured steps (default 4)")
    parser.add_argument("--micro-batch-size", type=int, default=1, metavar="B", help="default 1")
    parser.add_argument("--seq-len", type=int, default=128, metavar="L", help="default 128")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.set_defaults(run=command(PROG, _run))


def _run(args: argparse.Namespace) -> int:
    talk = not (args.json or args.quiet)
    notes: list[str] = []
    budget = size_flag(args, "memory", notes) if args.memory else math.inf
    say(notes, talk)
    configure_logging(talk)
    check_torch()
    import transformers

    from sapp_hook.validate import Setup, profile_for, validate

    transformers.logging.set_verbosity_error()
    outputs = output_paths(args, ("profile_out",))
    plan = args.plan or ("even" if args.even else "even-full" if args.even_full else "solve")
    setup = Setup(model=args.model, stages=args.stages, chunks=args.chunks, schedule=args.schedule,
                  micro_batches=args.micro_batches, steps=args.steps, micro_batch_size=args.micro_batch_size,
                  seq_len=args.seq_len, memory_budget_bytes=budget, plan=plan)
    profile = read_profile(args.profile) if args.profile else profile_for(setup)
    if "profile_out" in outputs:
        written = write_output(outputs, "profile_out", profile.save)
        if talk:
            print(f"wrote {written}", file=sys.stderr)
    report = validate(setup, profile=profile)
    if args.json:
        print(json.dumps(report, indent=2))
    elif talk:
        print(validation_report(report))
    return 0


def validation_report(report: dict) -> str:
    lines = [
        f"{report['model']}: {report['schedule']}, {report['stages']} x {report['chunks']} (stages x chunks), "
        f"{report['micro_batches']} micro-batches, plan {report['plan']} (layers per virtual stage "
        f"{report['stage_layer_counts']})",
        f"iteration       predicted {report['predicted_iteration_ms']:.1f} ms, measured "
        f"{report['measured_iteration_ms']:.1f} ms ({report['iteration_error']:.1%} apart); "
        f"P2P measured {report['p2p_ms']:.3f} ms per activation, in the prediction",
        f"{'rank':>4}  {'step ms: predicted':>18} {'measured':>9} {'error':>6}  {'activations: predicted':>22} "
        f"{'measured':>10} {'error':>6}  {'allocator: predicted':>20} {'measured':>10} {'error':>6}",
    ]
    for row in report["ranks"]:
        lines.append(
            f"{row['rank']:>4}  {row['predicted_step_ms']:>18.1f} {row['measured_step_ms']:>9.1f} {row['step_error']:>6.1%}  "
            f"{format_bytes(row['predicted_activation_peak_bytes']):>22} {format_bytes(row['measured_activation_peak_bytes']):>10} "
            f"{row['activation_error']:>6.1%}  {format_bytes(row['predicted_peak_bytes']):>20} "
            f"{format_bytes(row['measured_allocated_peak_bytes']):>10} {row['allocated_error']:>6.1%}"
        )
    lines.append("(activations: what autograd holds for backward; allocator: every byte allocated during a step "
                 "above its lowest point, working sets and what the engine keeps included)")
    return "\n".join(lines)
