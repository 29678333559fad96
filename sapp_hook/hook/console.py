"""The few lines a user of the hook must see, whatever logging is set up: what it is doing, what it planned and
wrote, where the report is. On stderr, from rank 0 only, none where `quiet`; the full report goes to the log and
the out folder."""

from __future__ import annotations

import contextlib
import sys

from sapp_hook.hook import job


class Console:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def say(self, line: str) -> None:
        """`sapp-hook: line` on stderr, from rank 0 (a closed or full stderr loses the line, not the job)."""
        if self.quiet or job.rank() != 0:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"sapp-hook: {line}\n")
            sys.stderr.flush()
