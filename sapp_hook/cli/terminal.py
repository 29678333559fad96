"""The process around a command: standard streams that may be closed or full, and Ctrl-C, SIGTERM or SIGHUP
ending any command promptly, with one line, its temp files removed."""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator

from basics.errors import Terminated
from basics.files import remove_pending
from sapp_hook.cli.common import StdoutError

# A command still running this long after Ctrl-C or SIGTERM (code that swallowed the exception, a C
# loop that never returns) is ended without waiting; so is one signalled a second time.
GRACE_S = 5.0
_STOPPING = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


def _raising_once() -> Callable[[int, object], None]:
    """The handler of Ctrl-C, SIGTERM and SIGHUP within a command: the first raises KeyboardInterrupt (or
    Terminated(number)); a later one raises nothing where the first is unwinding (inside a library's
    C++ code, an exception there aborts the process), and the watchdog ends the process for it."""
    raised: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if raised:
            return
        raised.append(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    return handler


@contextlib.contextmanager
def signals_end_the_command(prog: Callable[[], str], *, process_ends: bool = False) -> Iterator[Callable[[int], int]]:
    """Within the block, SIGTERM and SIGHUP raise Terminated(number) (Ctrl-C raises KeyboardInterrupt, as
    always), so that clean-up runs on the way out; yields `stopping(status)`, which the command's handler
    of either calls: it removes temp files, says `PROG: interrupted` (`terminated`, `hung up`) and returns
    `status`. A watchdog thread ends the process itself where the exception does not arrive in GRACE_S.
    `process_ends`: the process exits after the command, so once a signal stopped it, later ones stay
    ignored (a second Ctrl-C must not turn the exit status into a kill)."""
    stopped: list[int] = []

    def stopping(status: int) -> int:
        stopped.append(status)
        for number in _STOPPING:  # a second signal must not break the clean-up
            with contextlib.suppress(ValueError):
                signal.signal(number, signal.SIG_IGN)
        remove_pending()
        with contextlib.suppress(OSError, ValueError):  # a terminal that hung up takes no line
            print(f"{prog()}: {_STOPPING[signal.Signals(status - 128)]}", file=sys.stderr, flush=True)
        return status

    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield stopping
        return
    handlers = {number: signal.getsignal(number) for number in _STOPPING}
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    done = threading.Event()
    raising = _raising_once()
    for number in _STOPPING:
        if handlers[number] != signal.SIG_IGN:  # a shell's background job keeps ignoring Ctrl-C
            signal.signal(number, raising)
    wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    watchdog = threading.Thread(target=_watch, args=(reader, done, prog), name="sapp-hook signals", daemon=True)
    watchdog.start()
    try:
        yield stopping
    finally:
        done.set()
        signal.set_wakeup_fd(wakeup)
        for number, handler in handlers.items():
            # the process exits with the command's status: a signal as it exits must not turn it into a kill
            signal.signal(number, signal.SIG_IGN if process_ends else handler)
        writer.close()
        watchdog.join()
        reader.close()


def _watch(reader: socket.socket, done: threading.Event, prog: Callable[[], str]) -> None:
    """Wait for Ctrl-C or SIGTERM (their numbers arrive on `reader`); then for the command to stop within
    GRACE_S, or end the process: temp files removed, one line, 128 + the signal's number."""
    first: int | None = None
    while not done.is_set():
        timeout = None if first is None else GRACE_S
        ready, _, _ = select.select([reader], [], [], timeout)
        data = reader.recv(64) if ready else b""
        if ready and not data:
            return  # the command is over
        numbers = [number for number in data if number in _STOPPING]
        if first is None and numbers:
            first = numbers[0]
            continue
        if first is not None and not done.is_set() and (numbers or not ready):
            remove_pending()
            with contextlib.suppress(OSError):
                os.write(2, f"{prog()}: {_STOPPING[signal.Signals(first)]}\n".encode())
            os._exit(128 + first)


@contextlib.contextmanager
def standard_streams() -> Iterator[None]:
    """stdin, stdout and stderr open, on /dev/null where the caller closed them (else the first file
    opened would take a closed one's number); a closed stdout refuses output with StdoutError."""
    replaced = {}
    for number, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(number)
        except OSError:
            handle = os.open(os.devnull, os.O_RDWR)
            if handle != number:
                os.dup2(handle, number)
                os.close(handle)
            replaced[name] = getattr(sys, name)
    if "stdout" in replaced:
        sys.stdout = _Closed()
    if "stderr" in replaced:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - closed below
    else:
        replaced["stderr"] = sys.stderr
        sys.stderr = _Forgiving(sys.stderr)
    try:
        yield
    finally:
        if isinstance(sys.stderr, io.IOBase):
            sys.stderr.close()
        for name, stream in replaced.items():
            setattr(sys, name, stream)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    """stdout's failures, other than a reader that left (BrokenPipeError), raise StdoutError."""
    stream = sys.stdout
    sys.stdout = _Guarded(stream)
    try:
        yield
    finally:
        sys.stdout = stream


def stop_printing() -> None:
    """After stdout failed: what is left in its buffer goes to /dev/null, so that exiting does not fail again."""
    stream = getattr(sys.stdout, "stream", sys.stdout)
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


class _Guarded:
    """sys.stdout, whose write and flush raise StdoutError where the stream fails (a full disk)."""

    def __init__(self, stream: object) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self._call("write", text)

    def flush(self) -> None:
        self._call("flush")

    def _call(self, name: str, *args: object):  # type: ignore[no-untyped-def]
        try:
            return getattr(self.stream, name)(*args)
        except BrokenPipeError:
            raise
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed
            raise StdoutError(getattr(exc, "strerror", None) or str(exc)) from None

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


class _Forgiving:
    """sys.stderr, whose failures (a full disk, a terminal gone) are let go: what it says is a courtesy,
    and the exit status says how the command ended."""

    def __init__(self, stream: object) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            return self.stream.write(text)
        return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


class _Closed:
    """Where stdout was closed before the command started: output is refused, nothing else fails."""

    def write(self, text: str) -> int:
        if text:
            raise StdoutError("it was closed when the command started")
        return 0

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return 1

    def isatty(self) -> bool:
        return False
