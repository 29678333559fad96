"""The `sapp-hook` command's parser and its run, once every command is loaded (`sapp_hook.cli.main`
loads them)."""

from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import NoReturn

from basics.errors import Terminated
from sapp_hook.cli import apply, calibrate, demo, profile, run, simulate, solve, validate
from sapp_hook.cli.common import (
    EXIT_HUNG_UP,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_NO_PLAN,
    EXIT_NOT_PLANNED,
    EXIT_OUTPUT,
    EXIT_TERMINATED,
    StdoutError,
    fail,
    say_error,
    say_warning,
)
from sapp_hook.cli.flags import translate_renamed
from sapp_hook.cli.terminal import guarded_stdout, signals_end_the_command, standard_streams, stop_printing
from sapp_hook.hook.relaunch import installed_version


class _Parser(argparse.ArgumentParser):
    """Errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        # argparse quotes the values it refuses whole: a page-long one is cut, so the line stays readable
        fail(self.prog, re.sub(r"\S{60,}", lambda word: word.group(0)[:40] + "...", message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sapp-hook",
        description="Balance pipeline-parallel training: profile layers, solve plans, simulate schedules, write configs.",
        epilog=f"Exit status: 0 done; {EXIT_OUTPUT} the result could not be printed (stdout closed or full); "
        f"{EXIT_INPUT} bad input; {EXIT_NO_PLAN} no plan fits the memory budget; {EXIT_NOT_PLANNED} `run`: the "
        f"command ended before its job planned; {EXIT_INTERRUPTED} interrupted (Ctrl-C); {EXIT_TERMINATED} terminated "
        f"(SIGTERM); {EXIT_HUNG_UP} hung up (SIGHUP). `run` passes on its command's status otherwise.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
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


def run_command(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (bad input raises SystemExit(2), no plan SystemExit(3))."""
    prog = "sapp-hook"
    # argv None: the process's own command line, which exits after the command
    ends = argv is None
    with standard_streams(), signals_end_the_command(lambda: prog, process_ends=ends) as stopping, guarded_stdout():
        try:
            given, renamed = translate_renamed(sys.argv[1:] if argv is None else list(argv))
            for warning in renamed:
                say_warning(prog, warning)
            args = build_parser().parse_args(given)
            prog = f"sapp-hook {args.command}"
            status = args.run(args)
            sys.stdout.flush()  # a full disk or a closed pipe shows here, not at exit
            return status
        except KeyboardInterrupt:
            return stopping(EXIT_INTERRUPTED)
        except Terminated as stop:  # SIGTERM or SIGHUP: the handler passes the signal's number
            return stopping(128 + (stop.args[0] if stop.args else signal.SIGTERM))
        except BrokenPipeError:  # `sapp-hook ... | head`: the reader left; no message, and none at exit
            stop_printing()
            return EXIT_OUTPUT
        except StdoutError as error:
            stop_printing()
            say_error(prog, f"stdout: cannot print the result ({error}); any files asked for were written before")
            return EXIT_OUTPUT
