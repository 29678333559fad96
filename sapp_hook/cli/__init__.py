"""The `sapp-hook` command. The CLI owns the terminal: tables and progress on stderr, `--json` on stdout.

Exit statuses (`sapp_hook.cli.common`): 0 done, 1 the result could not be printed (stdout closed or
full), 2 bad input, 3 no plan fits, 4 `run`'s command ended before its job planned, 129 hung up (SIGHUP), 130
interrupted (Ctrl-C), 143 terminated (SIGTERM); `run` passes on its training command's own status otherwise.

This module loads nothing of sapp-hook itself: a signal while the commands and the libraries under
them load (half a second) ends the command with its one line too, not with a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

# While loading, what each signal ends the command with: nothing has been read or written yet.
_LOADING = {signal.SIGHUP: (129, "hung up"), signal.SIGINT: (130, "interrupted"), signal.SIGTERM: (143, "terminated")}


class _Stopped(BaseException):
    """A signal arrived while the commands loaded."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signum)


@contextlib.contextmanager
def _signals_while_loading() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    handlers = {number: signal.getsignal(number) for number in _LOADING}
    for number, handler in handlers.items():
        if handler != signal.SIG_IGN:  # a shell's background job keeps ignoring Ctrl-C; nohup, SIGHUP
            signal.signal(number, _stop)
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (bad input raises SystemExit(2), no plan SystemExit(3))."""
    try:
        with _signals_while_loading():
            from sapp_hook.cli.app import run_command
    except _Stopped as stop:
        status, word = _LOADING[signal.Signals(stop.args[0])]
        with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr may be closed
            print(f"sapp-hook: {word}", file=sys.stderr, flush=True)
        return status
    return run_command(argv)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (for `--help` and the docs' checks)."""
    from sapp_hook.cli.app import build_parser as build

    return build()
