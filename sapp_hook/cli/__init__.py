"""The `sapp-hook` command. The CLI owns the terminal: tables and progress on stderr, `--json` on stdout."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from sapp_hook.cli import apply, calibrate, demo, profile, run, simulate, solve, validate
from sapp_hook.cli.common import fail


class _Parser(argparse.ArgumentParser):
    """Errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sapp-hook", description="Balance pipeline-parallel training: profile layers, solve plans, simulate schedules, write configs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    profile.add_parser(commands)
    solve.add_parser(commands)
    simulate.add_parser(commands)
    apply.add_parser(commands)
    run.add_parser(commands)
    validate.add_parser(commands)
    calibrate.add_parser(commands)
    demo.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `sapp-hook ... | head`: the reader left; no traceback, and none at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
