"""The word said when a job ends before its plan: once, when the tuner is closed or the process exits, and
nothing after an error (the error says why nothing was planned)."""

from __future__ import annotations

import atexit
import json
import os
from collections.abc import Callable
from pathlib import Path

from basics.files import atomic_write_text
from sapp_hook.hook import job
from sapp_hook.hook.outputs import ended_early
from sapp_hook.hook.relaunch import ENVIRONMENT


class EndWatch:
    """Watches a tuner that has not decided yet. `start()` from its first step, `stop()` once it decides or
    fails; `end()` where the training ended first: says so, and leaves the reason for `sapp-hook run`."""

    def __init__(self, say: Callable[[str], None], progress: Callable[[], tuple[int, int]]) -> None:
        self._say, self._progress = say, progress
        self.watching = False

    def start(self) -> None:
        if not self.watching:
            atexit.register(self.end)
            self.watching = True

    def stop(self) -> None:
        if self.watching:
            atexit.unregister(self.end)
            self.watching = False

    def end(self) -> None:
        """The training ended before the plan (said once; nothing where the watch was stopped)."""
        if not self.watching:
            return
        self.stop()
        why = ended_early(*self._progress())
        self._say(why)
        planned_file = os.environ.get(ENVIRONMENT["planned_file"])
        if planned_file and job.rank() == 0:
            atomic_write_text(Path(planned_file), json.dumps({"incomplete": why}) + "\n")
