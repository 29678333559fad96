"""`sapp-hook demo`: profile, solve and write back on a tiny Llama, into one folder."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from sapp_hook.cli.common import command, configure_logging
from sapp_hook.pipelining.engine_rules import check_torch
from simulator import InputError

PROG = "sapp-hook demo"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="train a tiny Llama under autotune on the CPU and write its plan into example configs",
        description=(
            "A tiny Llama built from a transformers config (random weights, CPU, no download) trains a few "
            "steps under autotune with 4 pipeline ranks and a memory budget no split fits without "
            "recompute. The plan goes into example MindFormers, Megatron-LM and TorchTitan configs; a "
            "chart and a report go next to them."
        ),
    )
    parser.add_argument("--out", default="demo", metavar="DIR", help="output folder (default: demo)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.set_defaults(run=command(PROG, _run))


def _run(args: argparse.Namespace) -> int:
    talk = not (args.json or args.quiet)
    configure_logging(talk)
    check_torch()
    _make_folder(Path(args.out))
    import transformers

    from sapp_hook.demo import run_demo

    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    try:
        outcome = run_demo(args.out)
    except OSError as exc:  # the folder filled up or changed under the demo
        raise InputError("--out", f"cannot write {exc.filename or args.out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps(outcome, indent=2))
    elif talk:
        print(f"demo done in {time.perf_counter() - started:.0f} s; read {args.out}/report.md", file=sys.stderr)
    return 0


def _make_folder(folder: Path) -> None:
    """The demo's folder, made now, before any work; InputError where it cannot be or is read-only."""
    existing = next((p for p in (folder, *folder.parents) if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        raise InputError("--out", f"{existing} is not a folder; expected a folder to write the demo into")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError("--out", f"cannot make the folder {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError("--out", f"folder {folder} is read-only")
