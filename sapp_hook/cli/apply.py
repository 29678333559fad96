"""`sapp-hook apply`: write a plan into a training job's launch config."""

from __future__ import annotations

import argparse
import json
import sys

from sapp_hook.cli.common import command, file_errors
from sapp_hook.writeback import TARGETS, layout_from_dict, write_config
from solver.vocabulary.load import read_plan_json

PROG = "sapp-hook apply"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "apply",
        help="write a plan into a MindFormers, Megatron-LM or TorchTitan config",
        description=(
            "Write the stage split and recompute of a plan (sapp-hook solve --plan-out) into a launch "
            "config. Comments, key order and other keys stay; the config as it was before sapp-hook first "
            "changed it is kept as NAME.sapp-hook.bak; what a target cannot express is said, and the exact "
            "plan written next to it as NAME.sapp-hook.json."
        ),
    )
    parser.add_argument("--plan", required=True, metavar="FILE", help="plan JSON from sapp-hook solve --plan-out")
    parser.add_argument("--target", required=True, metavar="NAME", help=f"one of: {', '.join(TARGETS)}")
    parser.add_argument(
        "--config", required=True, metavar="FILE", help="the config to rewrite (created for --target plan)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.set_defaults(run=command(PROG, _run))


def _run(args: argparse.Namespace) -> int:
    with file_errors("--plan", args.plan):
        layout = layout_from_dict(read_plan_json(args.plan, "--plan"))
    result = write_config(args.target, args.config, layout, dry_run=args.dry_run)
    if args.json:
        print(
            json.dumps(
                {
                    "target": args.target,
                    "config": str(result.path),
                    "dry_run": args.dry_run,
                    "diff": result.diff,
                    "notes": result.notes,
                    "written": result.written,
                    "backup": str(result.backup) if result.backup else None,
                },
                indent=2,
            )
        )
        return 0
    if args.quiet:
        return 0
    if args.dry_run:
        print(result.diff or f"{result.path}: already says this plan", end="")
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    for path in result.written:
        print(f"wrote {path}")
    if result.backup:
        print(f"the config as it was before sapp-hook first changed it is in {result.backup}")
    return 0
