"""The `sapp-hook` command. The CLI owns the terminal: tables and progress on stderr, `--json` on stdout."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from sapp_hook.cli import simulate


class _Parser(argparse.ArgumentParser):
    """Errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sapp-hook", description="Balance pipeline-parallel training: simulate schedules.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    simulate.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)
