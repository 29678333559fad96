"""`sapp-hook solve`: the fastest layer split and recompute that fit the memory budget."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from basics.errors import check_seconds
from basics.files import atomic_write_text
from sapp_hook.cli.common import (
    add_output_flags,
    add_overhead_flag,
    add_parallel_flags,
    add_pipeline_flags,
    add_receive_buffers_flag,
    check_milliseconds,
    command,
    configure_logging,
    finish,
    mode_list,
    output_paths,
    parallel_fields,
    read_profile,
    say,
    size_flag,
    write_output,
    write_replay_outputs,
)
from sapp_hook.report import against_even, plan_report
from simulator import SCHEDULES, InputError
from solver import PipelineSpec, Plan, solve
from solver.compare import candidates, describe, fastest
from solver.parallel.model_parallel import prediction_caveat
from solver.program.size import check_time_limit

PROG = "sapp-hook solve"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "solve",
        help="find the fastest layer split and per-layer recompute that fit the memory budget",
        description=(
            "Find the layer-to-stage split and per-layer recompute with the least simulated iteration "
            "time whose per-device peak memory fits --memory. Proven optimal, or the gap when "
            "--time-limit stops the search. SAPP layer JSON files work as profiles (their memory is "
            "in MiB: say --memory 53000MiB)."
        ),
    )
    parser.add_argument("--profile", required=True, metavar="FILE", help="sapp-hook profile JSON or SAPP layer JSON")
    add_pipeline_flags(parser, required=True, auto=True)
    parser.add_argument("--memory", required=True, metavar="SIZE", help="memory per device, e.g. 56GB or 52GiB")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="SEC", help="default 60; inf for none")
    add_parallel_flags(parser)
    add_overhead_flag(parser)
    parser.add_argument("--rank-constant", default="0", metavar="SIZE", help="memory every rank holds regardless")
    parser.add_argument("--allow-empty-chunks", action="store_true", help="let a chunk hold no layer")
    add_receive_buffers_flag(parser)
    parser.add_argument(
        "--modes",
        metavar="LIST",
        help="recompute modes the plan may use, e.g. none,full (default: all the profile offers)",
    )
    parser.add_argument("--mindformers-yaml", metavar="OUT", help="write the plan's MindFormers keys to a YAML file")
    parser.add_argument("--plan-out", metavar="OUT", help="write the plan as JSON (sapp-hook simulate --plan reads it)")
    parser.add_argument(
        "--keep-best-on-interrupt",
        action="store_true",
        help="on Ctrl-C or SIGTERM during the search, write the best plan found so far (status "
        "interrupted) to the outputs before stopping",
    )
    add_output_flags(parser)
    parser.set_defaults(run=command(PROG, _run))


def _run(args: argparse.Namespace) -> int:
    talk = not (args.json or args.quiet)
    check_milliseconds("--p2p", args.p2p)
    check_milliseconds("--action-overhead", args.action_overhead)
    notes: list[str] = []
    budget = size_flag(args, "memory", notes)
    constant = size_flag(args, "rank_constant", notes)
    outputs = output_paths(args, ("plot", "trace", "csv", "mindformers_yaml", "plan_out"))
    profile = read_profile(args.profile)
    if args.modes is not None:
        try:
            profile = profile.with_modes(mode_list(args.modes))
        except InputError as exc:
            raise InputError("--modes", exc.detail) from None
    auto = args.schedule == "auto"  # the fastest of every schedule sapp-hook plans
    if auto and args.chunks is not None:
        raise InputError("--chunks", "--schedule auto chooses the chunks with the schedule: leave --chunks out")
    check_seconds(args.time_limit, "--time-limit")
    # before the spec builds the schedule: a schedule too large for the limit takes minutes to build
    options = candidates(SCHEDULES) if auto else None
    check_time_limit(
        None if auto else args.schedule,  # under auto, the fewest actions of any
        args.pipeline_parallel,
        None if auto else args.chunks,
        args.micro_batches,
        args.time_limit / len(options) if options else args.time_limit,
    )
    spec = PipelineSpec(
        pipeline_parallel=args.pipeline_parallel,
        micro_batches=args.micro_batches,
        schedule=next(iter(SCHEDULES)) if auto else args.schedule,
        chunks=args.chunks,
        memory_budget_bytes=budget,
        rank_constant_bytes=constant,
        p2p_ms=args.p2p,
        action_overhead_ms=args.action_overhead,
        allow_empty_chunks=args.allow_empty_chunks,
        microbatch_group_size=args.microbatch_group_size,
        receive_buffers=args.receive_buffers,
        **parallel_fields(args),
    )
    caveat = prediction_caveat(profile, spec)
    if caveat:
        notes.append(f"note: {caveat}")
    say(notes, talk)
    configure_logging(talk)
    keep = (lambda best: _write_plan(best, outputs, talk)) if args.keep_best_on_interrupt else "raise"
    if auto:
        plans = fastest(profile, spec, options, args.time_limit / len(options), on_interrupt=keep)
        if talk:
            for each in plans:
                print(f"{describe(each)}: {each.iteration_time_ms:.6g} ms", file=sys.stderr)
        plan = plans[0]
    else:
        plan = solve(profile, spec, time_limit_s=args.time_limit, on_interrupt=keep)
    written = _write_plan(plan, outputs, talk)
    comparison, even_split = against_even(plan, profile)
    return finish(args, {**plan.to_dict(), "even_split": even_split}, f"{plan_report(plan)}\n{comparison}", written)


def _write_plan(plan: Plan, outputs: dict[str, Path], talk: bool) -> list[str]:
    """Write the plan to the output files asked for; what was written."""
    written = write_replay_outputs(plan.simulation, outputs, talk)
    for name, text in (
        ("mindformers_yaml", lambda: yaml.safe_dump(plan.mindformers(), sort_keys=False, default_flow_style=None)),
        ("plan_out", lambda: json.dumps(plan.to_dict(), indent=1) + "\n"),
    ):
        if name in outputs:
            written.append(write_output(outputs, name, lambda path, text=text: atomic_write_text(path, text())))
    return written
