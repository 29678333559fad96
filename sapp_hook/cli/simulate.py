"""`sapp-hook simulate`: replay a schedule for uniform ranks, or a plan for a profile."""

from __future__ import annotations

import argparse
import dataclasses
import math

from basics.documents import read_document
from basics.errors import check_bytes
from basics.units import parse_bytes
from sapp_hook.cli.common import (
    FLAGS,
    add_output_flags,
    add_overhead_flag,
    add_parallel_flags,
    add_pipeline_flags,
    add_receive_buffers_flag,
    check_milliseconds,
    command,
    fail,
    file_errors,
    finish,
    output_paths,
    parallel_fields,
    read_profile,
    say,
    say_warning,
    size_flag,
    write_replay_outputs,
)
from sapp_hook.report import plan_report, replay_report
from simulator import InputError, PipelineCosts, build_schedule, schedule_kind, simulate
from solver import PipelineSpec, plan_from_dict, plan_from_mindformers
from solver.formats.mindformers import mindformers_keys
from solver.parallel.model_parallel import prediction_caveat
from solver.vocabulary.load import read_plan_json

PROG = "sapp-hook simulate"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "simulate",
        help="replay a pipeline schedule: iteration time, bubble split, memory per rank",
        description=(
            "Replay a pipeline schedule. Either identical ranks: F, B and W are a whole rank's times "
            "for one micro-batch (split evenly over its chunks), B the full backward and W the part "
            "of it that computes weight gradients, which zero-bubble schedules defer; times in "
            "milliseconds. Or a plan for a profile: --profile with --mindformers-plan or --plan."
        ),
    )
    add_pipeline_flags(parser, required=False)
    parser.add_argument("--forward", type=float, metavar="F", help="forward ms per micro-batch")
    parser.add_argument("--backward", type=float, metavar="B", help="full backward ms per micro-batch")
    parser.add_argument(
        "--weight", type=float, metavar="W", help="weight-gradient ms within B (default for I/W schedules: B/2)"
    )
    parser.add_argument("--recompute", type=float, default=0.0, metavar="R", help="recompute ms added to each backward")
    parser.add_argument("--activation", default="0", metavar="SIZE", help="activation kept per micro-batch, e.g. 2GiB")
    parser.add_argument(
        "--static", default="0", metavar="SIZE", help="parameters, gradients, optimizer state, e.g. 20GB"
    )
    parser.add_argument("--working", default="0", metavar="SIZE", help="held while a backward runs, e.g. 1GiB")
    parser.add_argument("--profile", metavar="FILE", help="a profile (sapp-hook JSON or SAPP layer JSON)")
    parser.add_argument(
        "--mindformers-plan", metavar="FILE", help="with --profile: a plan as MindFormers keys (YAML or JSON)"
    )
    parser.add_argument("--plan", metavar="FILE", help="with --profile: a plan JSON written by sapp-hook solve")
    parser.add_argument("--memory", default="0", metavar="SIZE", help="with --mindformers-plan: the budget to check")
    add_receive_buffers_flag(parser)
    add_overhead_flag(parser)
    add_parallel_flags(parser)
    add_output_flags(parser)
    parser.set_defaults(run=command(PROG, _run))


_PARALLEL_DEFAULTS = {field.name: field.default for field in dataclasses.fields(PipelineSpec)}


def _run(args: argparse.Namespace) -> int:
    if args.profile:
        return _replay_plan(args)
    return _replay_uniform(args)


def _replay_uniform(args: argparse.Namespace) -> int:
    talk = not (args.json or args.quiet)
    for name in ("schedule", "pipeline_parallel", "micro_batches", "forward", "backward"):
        if getattr(args, name) is None:
            fail(PROG, f"--{name.replace('_', '-')} is required (or --profile with a plan)")
    if args.mindformers_plan or args.plan:
        fail(PROG, "--mindformers-plan and --plan need --profile")
    if args.receive_buffers:
        fail(
            PROG,
            "--receive-buffers needs --profile (the buffers' size is its stage_output_bytes); "
            "with --forward and --backward, add them to --static",
        )
    if args.action_overhead:
        fail(
            PROG,
            "--action-overhead needs --profile and --mindformers-plan (with --forward and --backward, add it to them)",
        )
    for name, value in parallel_fields(args).items():
        if value != _PARALLEL_DEFAULTS[name]:
            fail(
                PROG,
                f"{FLAGS[name]} needs --profile and --mindformers-plan (with --forward and --backward, give "
                "one rank's sizes as they are)",
            )
    for flag in ("forward", "backward", "weight", "recompute", "p2p"):
        check_milliseconds(f"--{flag}", getattr(args, flag))
    if args.weight is not None and args.weight > args.backward:
        raise InputError("--weight", f"expected at most --backward ({args.backward:g}), got {args.weight:g}")
    notes: list[str] = []
    sizes = {name: size_flag(args, name, notes) for name in ("activation", "static", "working")}
    for name, size in sizes.items():
        check_bytes(size, f"--{name}")
    outputs = output_paths(args, ("plot", "trace", "csv"))
    schedule = build_schedule(
        args.schedule,
        ranks=args.pipeline_parallel,
        micro_batches=args.micro_batches,
        chunks=args.chunks,
        microbatch_group_size=args.microbatch_group_size,
    )
    costs = PipelineCosts.uniform(
        schedule.ranks,
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
    say([*notes, f"simulating {schedule.num_actions:,} actions ..."], talk)
    result = simulate(schedule, costs)
    written = write_replay_outputs(result, outputs, talk)
    return finish(args, result.to_dict(), replay_report(result), written)


def _check_flags_agree(args: argparse.Namespace, spec: PipelineSpec) -> None:
    """A plan JSON states how it runs (its spec): a pipeline flag given beside it must say the same,
    rather than be ignored."""
    given = {
        "schedule": schedule_kind(args.schedule).name if args.schedule is not None else None,
        "pipeline_parallel": args.pipeline_parallel,
        "chunks": args.chunks,
        "micro_batches": args.micro_batches,
        "microbatch_group_size": args.microbatch_group_size,
        "p2p_ms": args.p2p or None,
        "memory_budget_bytes": parse_bytes(args.memory, "--memory") or None,
        "receive_buffers": args.receive_buffers or None,
        **{name: value for name, value in parallel_fields(args).items() if value != _PARALLEL_DEFAULTS[name]},
    }
    flags = {"p2p_ms": "--p2p", "memory_budget_bytes": "--memory", **FLAGS}
    resolved = {"schedule": schedule_kind(spec.schedule).name, "chunks": spec.pipeline_schedule.chunks}
    for name, value in given.items():
        stated = resolved[name] if name in resolved else getattr(spec, name)
        if value is not None and value != stated:
            flag = flags.get(name, "--" + name.replace("_", "-"))
            raise InputError(
                flag,
                f"{_shown(value)} differs from the plan's spec.{name} ({_shown(stated)}); leave "
                f"{flag} out, or replay the plan's MindFormers keys (--mindformers-plan) under "
                "other settings",
            )


def _shown(value: object) -> str:
    if value is None:
        return "the schedule's default"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}" if isinstance(value, float) else str(value)


def _replay_plan(args: argparse.Namespace) -> int:
    talk = not (args.json or args.quiet)
    if bool(args.mindformers_plan) == bool(args.plan):
        fail(PROG, "--profile needs one of --mindformers-plan FILE or --plan FILE")
    outputs = output_paths(args, ("plot", "trace", "csv"))
    profile = read_profile(args.profile)
    notes: list[str] = []
    if args.plan:
        if args.action_overhead:
            raise InputError(
                "--action-overhead",
                "a plan JSON states its own (spec.action_overhead_ms); give it with --mindformers-plan",
            )
        with file_errors("--plan", args.plan):
            plan = plan_from_dict(profile, read_plan_json(args.plan, "--plan"))
        _check_flags_agree(args, plan.spec)
    else:
        for name in ("schedule", "pipeline_parallel", "micro_batches"):
            if getattr(args, name) is None:
                fail(PROG, f"--mindformers-plan needs --{name.replace('_', '-')}")
        check_milliseconds("--p2p", args.p2p)
        check_milliseconds("--action-overhead", args.action_overhead)
        budget = size_flag(args, "memory", notes) or math.inf
        spec = PipelineSpec(
            pipeline_parallel=args.pipeline_parallel,
            micro_batches=args.micro_batches,
            schedule=args.schedule,
            chunks=args.chunks,
            memory_budget_bytes=budget,
            p2p_ms=args.p2p,
            action_overhead_ms=args.action_overhead,
            microbatch_group_size=args.microbatch_group_size,
            receive_buffers=args.receive_buffers,
            **parallel_fields(args),
        )
        keys = mindformers_keys(read_document(args.mindformers_plan, "--mindformers-plan"), "--mindformers-plan")
        capped: list[str] = []
        try:
            plan = plan_from_mindformers(profile, spec, keys, notes=capped)
        except InputError as error:
            if error.field.startswith("--"):
                raise
            raise InputError("--mindformers-plan", f"{args.mindformers_plan}: {error}") from None
        for note in capped:  # the replay is of what MindFormers runs, not of the count written
            say_warning(PROG, f"{args.mindformers_plan}: {note}")
    caveat = prediction_caveat(profile, plan.spec)
    if caveat:
        notes.append(f"note: {caveat}")
    say(notes, talk)
    written = write_replay_outputs(plan.simulation, outputs, talk)
    return finish(args, plan.to_dict(), plan_report(plan), written)
