"""`sapp-hook run -- COMMAND`: launch a training job that uses `autotune`, let it plan, relaunch it.

The first launch runs with `on_plan="exit"`: the job profiles its first steps, writes the plan into
the config, leaves a file saying so and exits with status 0 (so that a launcher such as torchrun reports no
failure). The second launch finds the plan in the cache after one step, and trains with it. A job whose config
already said the plan writes nothing and trains on: there is no second launch. A job that ends before its plan
says why in the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from basics.errors import InputError
from sapp_hook.cli.common import EXIT_NOT_PLANNED, command
from sapp_hook.hook.relaunch import ENVIRONMENT, REPLAN_EXIT_CODE
from sapp_hook.writeback import TARGETS, check_destination

PROG = "sapp-hook run"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run",
        help="launch a training command that uses autotune: plan, write the config, relaunch",
        description=(
            "Launch COMMAND (e.g. torchrun ... train.py ...) whose script wraps its loop in "
            "sapp_hook.autotune. The first launch profiles, solves, writes --config and exits; sapp-hook "
            "then launches COMMAND again to train with the plan."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="the launch config to write the plan into")
    parser.add_argument("--target", metavar="NAME", help=f"its kind: {', '.join(TARGETS)}")
    parser.add_argument("--cache-dir", metavar="DIR", help="where plans are cached (default ~/.cache/sapp-hook)")
    parser.add_argument("--force", action="store_true", help="profile again even if a plan is cached")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the training command")
    parser.set_defaults(run=command(PROG, _run))


def _run(args: argparse.Namespace) -> int:
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        raise InputError("COMMAND", "give the training command after --, e.g. sapp-hook run -- torchrun train.py")
    if (args.config is None) != (args.target is None):
        raise InputError("--target" if args.target is None else "--config", "give --config and --target together")
    if args.target is not None:
        check_destination(args.target, args.config, target_field="--target", config_field="--config")
    if args.cache_dir is not None:
        _check_cache_dir(Path(args.cache_dir))
    environment = dict(os.environ)
    for name in ("config", "cache_dir"):  # the job may run in another folder than this command
        if getattr(args, name):
            environment[ENVIRONMENT[name]] = os.path.abspath(getattr(args, name))
    if args.target:
        environment[ENVIRONMENT["target"]] = args.target
    print(f"{PROG}: planning: {' '.join(argv)}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="sapp-hook-run-") as folder:
        planned_file = Path(folder) / "planned.json"
        planning = {
            **environment,
            ENVIRONMENT["on_plan"]: "exit",
            ENVIRONMENT["force"]: "1" if args.force else "0",
            ENVIRONMENT["planned_file"]: str(planned_file),
        }
        first = _launch(argv, planning)
        said = _said(planned_file)
    if "incomplete" in said:  # the job ended before its plan, and says why
        print(f"{PROG}: the job ended before planning: {said['incomplete']}", file=sys.stderr)
        return first or EXIT_NOT_PLANNED
    planned = first == REPLAN_EXIT_CODE or bool(said)
    trained = bool(said) and said.get("restart", True) is False
    if trained:  # the config already said the plan: the job went on training with it
        print(f"{PROG}: the config already said the plan; the job trained with it", file=sys.stderr)
        return first
    if not planned:
        if first == 0:
            print(
                f"{PROG}: the command finished without planning (did its script call sapp_hook.autotune?)",
                file=sys.stderr,
            )
            return EXIT_NOT_PLANNED
        print(f"{PROG}: the planning launch failed with status {first}; the config is as it was", file=sys.stderr)
        return first
    if first not in (0, REPLAN_EXIT_CODE):  # a launcher may report its workers' exit as its own failure
        print(f"{PROG}: the launcher exited with status {first}, but the job had written its plan", file=sys.stderr)
    print(f"{PROG}: planned; training: {' '.join(argv)}", file=sys.stderr, flush=True)
    return _launch(argv, {**environment, ENVIRONMENT["on_plan"]: "continue", ENVIRONMENT["force"]: "0"})


def _check_cache_dir(folder: Path) -> None:
    """The plan cache's folder, made now (the job would fail on it only after profiling)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError("--cache-dir", f"cannot make the folder {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError("--cache-dir", f"folder {folder} is read-only")


def _said(planned_file: Path) -> dict:
    """What the job that planned left in `planned_file`: {"config", "restart"} (whether it asks to be launched
    again: its config changed; an older sapp-hook's file, without the answer, does), {"incomplete": why} where
    it ended before its plan, {} where it left nothing."""
    try:
        said = json.loads(planned_file.read_text())
    except OSError:
        return {}
    except ValueError:
        return {"restart": True}
    return said if isinstance(said, dict) else {"restart": True}


def _launch(argv: list[str], environment: dict[str, str]) -> int:
    try:
        job = subprocess.Popen(argv, env=environment)
    except FileNotFoundError:
        raise InputError("COMMAND", f"{argv[0]!r} not found") from None
    except OSError as exc:
        raise InputError("COMMAND", f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
    try:
        status = job.wait()
    except BaseException:  # Ctrl-C or SIGTERM: the job is asked to end too, and waited for a while
        _stop(job)
        raise
    return 128 - status if status < 0 else status  # ended by signal N: 128 + N, as a shell says it


def _stop(job: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM to `job` (torchrun passes it on to its workers), SIGKILL if it is still there after `grace_s`."""
    if job.poll() is None:
        job.terminate()
    try:
        job.wait(grace_s)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
