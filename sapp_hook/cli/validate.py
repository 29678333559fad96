"""`sapp-hook validate`: run a plan on torch.distributed.pipelining and compare it with the prediction."""

from __future__ import annotations

import argparse
import json
import math
import sys

from basics.units import format_bytes
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
from sapp_hook.cli.flags import flag
from sapp_hook.pipelining.engine_rules import check_torch

PROG = "sapp-hook validate"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "validate",
        help="run a plan on torch.distributed.pipelining (gloo, CPU) and compare it with the prediction",
        description=(
            "Profile the model in one process, plan (the solver's plan, the even split, or a plan JSON), run "
            "the plan with torch.distributed.pipelining on one gloo process per pipeline rank (times --data-parallel and "
            "--tensor-parallel, on one device mesh), and print per rank the predicted and measured step time, peak "
            "activation bytes (saved-tensor hooks in the real run), peak bytes allocated during a step "
            "(torch.profiler's memory events, in two more steps) and static bytes (local shards)."
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
    layout = parser.add_argument_group("parallel layout (a process per pipeline x data x tensor-parallel rank)")
    flag("--data-parallel").add_to(layout, help="data-parallel replicas (default 1)")
    sharding = layout.add_mutually_exclusive_group()
    flag("--fsdp").add_to(
        sharding, help="FSDP2 over the replicas, a unit per layer and the stage module as root (TorchTitan's)"
    )
    flag("--zero-stage").add_to(sharding, choices=(0, 1), help="1: torch's ZeroRedundancyOptimizer")
    flag("--ddp").add_to(sharding, help="DistributedDataParallel on each stage module")
    flag("--reshard-after-forward").add_to(
        layout, help="with --fsdp: re-shard each unit after its forward (TorchTitan's PP default: not)"
    )
    flag("--tensor-parallel").add_to(layout, help="tensor-parallel degree: TorchTitan's Llama plan (default 1)")
    flag("--sequence-parallel").add_to(layout, help="with --tensor-parallel: split the norms too")
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

    from sapp_hook.validation.validate import Setup, profile_for, validate

    transformers.logging.set_verbosity_error()
    outputs = output_paths(args, ("profile_out",))
    plan = args.plan or ("even" if args.even else "even-full" if args.even_full else "solve")
    setup = Setup(
        model=args.model,
        pipeline_parallel=args.pipeline_parallel,
        chunks=args.chunks,
        schedule=args.schedule,
        micro_batches=args.micro_batches,
        steps=args.steps,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        memory_budget_bytes=budget,
        plan=plan,
        data_parallel=args.data_parallel,
        fsdp=args.fsdp,
        reshard_after_forward=args.reshard_after_forward,
        zero_stage=args.zero_stage,
        ddp=args.ddp,
        tensor_parallel=args.tensor_parallel,
        sequence_parallel=args.sequence_parallel,
    )
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
        (
            f"{report['model']}: {report['schedule']}, {report['pipeline_parallel']} x {report['chunks']} (ranks x chunks), "
            f"{report['micro_batches']} micro-batches, plan {report['plan']} (layers per virtual stage "
            f"{report['stage_layer_counts']}){_layout(report)}"
        ),
        (
            f"iteration       predicted {report['predicted_iteration_ms']:.1f} ms, measured "
            f"{report['measured_iteration_ms']:.1f} ms ({report['iteration_error']:.1%} apart); "
            f"P2P measured {report['p2p_ms']:.3f} ms per activation, in the prediction"
        ),
        (
            f"{'rank':>4}  {'step ms: predicted':>18} {'measured':>9} {'error':>6}  {'activations: predicted':>22} "
            f"{'measured':>10} {'error':>6}  {'allocator: predicted':>20} {'measured':>10} {'error':>6}"
        ),
    ]
    for row in report["ranks"]:
        lines.append(
            f"{row['rank']:>4}  {row['predicted_step_ms']:>18.1f} {row['measured_step_ms']:>9.1f} {row['step_error']:>6.1%}  "
            f"{format_bytes(row['predicted_activation_peak_bytes']):>22} {format_bytes(row['measured_activation_peak_bytes']):>10} "
            f"{row['activation_error']:>6.1%}  {format_bytes(row['predicted_peak_bytes']):>20} "
            f"{format_bytes(row['measured_allocated_peak_bytes']):>10} {row['allocated_error']:>6.1%}"
        )
    lines.append(
        "(activations: what autograd holds for backward; allocator: every byte allocated during a step "
        "above its lowest point, working sets and what the engine keeps included)"
    )
    lines += _split_lines(report)
    return "\n".join(lines)


def _layout(report: dict) -> str:
    """The data- and tensor-parallel layout, where the run had one."""
    parts = []
    if report.get("data_parallel", 1) > 1 or report.get("fsdp"):
        engine = (
            "FSDP2" + (", reshard after forward" if report.get("reshard_after_forward") else "")
            if report.get("fsdp")
            else "ZeRO-1"
            if report.get("zero_stage")
            else "DDP"
            if report.get("ddp")
            else "gradients all-reduced"
        )
        parts.append(f"data parallel {report['data_parallel']} ({engine})")
    if report.get("tensor_parallel", 1) > 1:
        parts.append(
            f"tensor parallel {report['tensor_parallel']}" + (" + SP" if report.get("sequence_parallel") else "")
        )
    return "; " + ", ".join(parts) if parts else ""


def _split_lines(report: dict) -> list[str]:
    """Each pipeline rank's memory split (its first process's), predicted and measured."""
    lines = [
        (
            f"{'rank':>4}  {'static: predicted':>17} {'measured':>10} {'error':>6}  "
            f"{'params / grads / optimizer (predicted)':>40}  {'buffers':>9}  {'at peak: DP-held':>16} {'working':>9}"
        )
    ]
    for row in report["ranks"]:
        split = row["predicted_split"]
        kinds = " / ".join(format_bytes(split[key]) for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"))
        lines.append(
            f"{row['rank']:>4}  {format_bytes(row['predicted_static_bytes']):>17} {format_bytes(row['measured_static_bytes']):>10} "
            f"{row['static_error']:>6.1%}  {kinds:>40}  {format_bytes(split['receive_buffer_bytes']):>9}  "
            f"{format_bytes(split['sharded_bytes']):>16} {format_bytes(split['working_bytes']):>9}"
        )
    lines.append(
        "(static: parameters, gradients and optimizer state held for the whole run, local shards; DP-held: "
        "gathered parameters and whole gradients within the step)"
    )
    return lines
