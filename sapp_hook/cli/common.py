"""What the CLI commands share: pipeline flags, output files, logging, error reporting."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from basics.errors import check_ms
from basics.files import MAX_FILE_BYTES, writable_target
from basics.units import format_bytes, parse_bytes
from sapp_hook.cli.flags import FIELD_FLAGS, PARALLEL_FLAGS, PIPELINE_FLAGS, spec_fields
from simulator import InputError, SimulationResult
from simulator.plot import check_plot_path
from solver import ModelProfile, load_profile
from solver.errors import InfeasibleError

# Library field names as the flags a CLI user typed.
FLAGS = {
    **FIELD_FLAGS,
    "ranks": "--pipeline-parallel",  # the simulator's name for the pipeline's size
    "memory_budget_bytes": "--memory",
    "time_limit_s": "--time-limit",
    "steps": "--steps",
    "micro_batch_size": "--micro-batch-size",
    "seq_len": "--seq-len",
    "action_overhead_ms": "--action-overhead",
    "rank_constant_bytes": "--rank-constant",
    "profile": "--profile",
    "target": "--target",
}


# Exit statuses; `run` passes on its training command's own.
EXIT_OUTPUT = 1  # the result could not be printed: stdout closed (silently, for a reader that left) or full
EXIT_INPUT = 2  # bad input: a flag, a file, a field in a file, or an output that cannot be written
EXIT_NO_PLAN = 3  # no plan fits the memory budget (solver.InfeasibleError)
EXIT_NOT_PLANNED = 4  # `run`: the training command ended (status 0) before its job planned
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + 2, as shells report it
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15
EXIT_HUNG_UP = 129  # SIGHUP (the terminal went away): 128 + 1


class StdoutError(Exception):
    """stdout refused the result (closed, or a full disk); a reader that left raises BrokenPipeError instead."""


def say_error(prog: str, message: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr full or closed: the exit status still says it
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def say_warning(prog: str, message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


def fail(prog: str, message: str, status: int = EXIT_INPUT) -> NoReturn:
    say_error(prog, message)
    raise SystemExit(status)


def fail_input(prog: str, error: InputError) -> NoReturn:
    flag = FLAGS.get(error.field)
    fail(
        prog,
        f"{flag}: {error.detail}" if flag else str(error),
        EXIT_NO_PLAN if isinstance(error, InfeasibleError) else EXIT_INPUT,
    )


def command(prog: str, body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`body` run as `prog`: bad input becomes one line on stderr naming the flag, exit status 2 (3 where
    no plan fits)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except InputError as exc:
            fail_input(prog, exc)

    return run


@contextlib.contextmanager
def file_errors(flag: str, path: str | Path) -> Iterator[None]:
    """Bad input found in the file `path` that `flag` names (a field of a profile or plan JSON) is said
    as `FLAG: PATH: FIELD: what was expected`, not as a flag of the same name."""
    try:
        yield
    except InputError as error:
        if error.field.startswith("--"):
            raise
        if error.field in ("profile", "plan"):  # the reader's own name for the file: its detail names it
            raise InputError(flag, error.detail) from None
        raise InputError(flag, f"{path}: {error.field}: {error.detail}") from None


def read_profile(path: str, flag: str = "--profile") -> ModelProfile:
    """The profile (sapp-hook's JSON or SAPP's layer JSON) at `path`, its errors naming `flag` and the file."""
    with file_errors(flag, path):
        return load_profile(path)


def add_pipeline_flags(parser: argparse.ArgumentParser, *, required: bool, auto: bool = False) -> None:
    """The schedule and its sizes (`flags.PIPELINE_FLAGS`); `required`: the schedule, ranks and micro-batches;
    `auto`: the command also takes `--schedule auto`."""
    for flag in PIPELINE_FLAGS:
        text = f"{flag.help}, or auto (the fastest)" if auto and flag.field == "schedule" else None
        flag.add_to(
            parser, required=required and flag.field in ("schedule", "pipeline_parallel", "micro_batches"), help=text
        )


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """The job's other parallel degrees, around the pipeline: what each rank holds depends on them."""
    group = parser.add_argument_group("parallel layout (per pipeline rank)")
    for flag in PARALLEL_FLAGS:
        flag.add_to(group)


def parallel_fields(args: argparse.Namespace) -> dict[str, object]:
    """The PipelineSpec fields of `add_parallel_flags`' flags."""
    return spec_fields(args, PARALLEL_FLAGS)


def add_overhead_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--action-overhead",
        type=float,
        default=0.0,
        metavar="MS",
        help="the engine's own ms per forward, backward and weight-gradient action (sapp-hook calibrate fits it)",
    )


def add_receive_buffers_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--receive-buffers",
        action="store_true",
        help="the job runs on torch.distributed.pipelining (or TorchTitan), which keeps a buffer per micro-batch "
        "for every stage's received input and output gradient, all run long (the profile's "
        "stage_output_bytes each), and the last stage's outputs (model_output_bytes) until their backward",
    )


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot", metavar="OUT", help="write a Gantt chart with memory curves (.png, .svg or .pdf)")
    parser.add_argument("--trace", metavar="OUT", help="write a Chrome/Perfetto trace (.json)")
    parser.add_argument("--csv", metavar="OUT", help="write the schedule in torch.distributed.pipelining's CSV format")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def check_milliseconds(flag: str, value: float | None) -> None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise InputError(flag, f"expected a number of milliseconds >= 0, got {value:g}")
    if value is not None:
        check_ms(value, flag)


def mode_list(text: str) -> tuple[str, ...]:
    """Recompute modes given as a comma-separated list (`none,full`)."""
    return tuple(mode.strip() for mode in text.split(",") if mode.strip())


def size_flag(args: argparse.Namespace, name: str, notes: list[str]) -> int:
    """A size flag in bytes; what it took goes to `notes`, said once every input has been checked."""
    text = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    size = parse_bytes(text, flag)
    if size:
        notes.append(f"{flag} {text} = {size:,} bytes ({format_bytes(size)})")
    return size


def say(notes: list[str], talk: bool) -> None:
    if talk:
        for note in notes:
            print(note, file=sys.stderr)


def output_paths(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Path]:
    """The output files asked for, checked before any work: the folder exists, the name is a regular
    file or a new one (a symbolic link is written through; a device, a pipe or a folder is refused)."""
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for name, text in given.items():
        if not text:  # `--plan-out "$OUT"` with OUT unset: not a request for no file
            raise InputError("--" + name.replace("_", "-"), "expected a file name, got an empty one")
    outputs = {name: Path(text) for name, text in given.items()}
    taken: dict[Path, str] = {}
    for name, path in outputs.items():
        flag = "--" + name.replace("_", "-")
        try:
            target = writable_target(path)
        except OSError as exc:
            raise InputError(
                flag, f"{exc.strerror}; expected a regular file or a new path, in a writable folder"
            ) from None
        if target in taken:
            raise InputError(flag, f"{path} is {taken[target]}'s file too; expected a file of its own")
        _check_replaceable(flag, name, path, target)
        taken[target] = flag
    if "plot" in outputs:
        check_plot_path(outputs["plot"], "--plot")
    return outputs


# What each JSON output is and the keys that mark its earlier file: only such a file, or a new path, is replaced
_JSON_OUTPUTS = {
    "plan_out": ("a plan JSON", ("plan", "spec")),
    "profile_out": ("a profile JSON", ("layers",)),
    "out": ("a profile JSON", ("layers",)),
    "trace": ("a trace JSON", ("traceEvents",)),
}


def _check_replaceable(flag: str, name: str, path: Path, target: Path) -> None:
    """InputError naming `flag` where `target` (`path` as given) exists and holds something other than
    what `name` writes: a launch config named by mistake is never replaced."""
    if name not in (*_JSON_OUTPUTS, "csv", "mindformers_yaml") or not target.is_file():
        return
    shown = str(path) if Path(path) == target else f"{path} (-> {target})"
    try:
        if name in _JSON_OUTPUTS and target.stat().st_size > MAX_FILE_BYTES:
            return  # no config is that large: an earlier trace
        with target.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise InputError(flag, f"cannot read {shown}: {exc.strerror or exc}; expected a new path") from None
    text = data.decode("utf-8-sig", errors="replace")
    if not text.strip():
        return
    if name in _JSON_OUTPUTS:
        kind, keys = _JSON_OUTPUTS[name]
        same = _holds_keys(text, keys)
    elif name == "csv":
        kind, same = "a schedule CSV", _is_schedule_csv(text)
    else:
        kind, same = "the plan's MindFormers keys alone", _holds_only_mindformers_keys(text, flag, shown)
    if not same:
        raise InputError(
            flag,
            f"{shown} exists and is not {kind} (a launch config?); expected a new path or this flag's earlier "
            "output (sapp-hook apply writes a plan into a launch config)",
        )


def _holds_keys(text: str, keys: tuple[str, ...]) -> bool:
    """Whether `text` is a JSON object with every key of `keys`."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and all(key in document for key in keys)


def _is_schedule_csv(text: str) -> bool:
    """Whether every row of `text` is torch's schedule CSV: action cells, overlapped pairs, empty cells."""
    from simulator.actions import parse_rank_cells

    try:
        for row in csv.reader(io.StringIO(text)):
            parse_rank_cells(row)
    except (ValueError, csv.Error):
        return False
    return True


def _holds_only_mindformers_keys(text: str, flag: str, shown: str) -> bool:
    """Whether `text` is a YAML mapping of the plan's MindFormers keys and nothing else."""
    from basics.documents import parse_yaml
    from solver.formats.mindformers import MINDFORMERS_KEYS

    try:
        document = parse_yaml(text, flag, shown)
    except InputError:
        return False
    return isinstance(document, dict) and set(document) <= set(MINDFORMERS_KEYS)


def write_replay_outputs(result: SimulationResult, outputs: dict[str, Path], talk: bool) -> list[str]:
    """Chart, trace and CSV of a replay, as asked."""
    written = []
    for name, path in outputs.items():
        if name not in ("plot", "trace", "csv"):
            continue
        if talk:
            print(f"writing {path} ...", file=sys.stderr)
        if name == "plot":
            from simulator.plot import draw_gantt

            written.append(write_output(outputs, name, lambda out: draw_gantt(result, out)))
        elif name == "trace":
            from simulator.trace import write_chrome_trace

            written.append(write_output(outputs, name, lambda out: write_chrome_trace(result, out)))
        else:
            written.append(write_output(outputs, name, result.schedule.write_csv))
    return written


def write_output(outputs: dict[str, Path], name: str, write: Callable[[Path], object]) -> str:
    """`write(path)` for the output file `name` asked for; a failure is one error naming its flag."""
    path = outputs[name]
    try:
        write(path)
    except OSError as exc:
        raise InputError("--" + name.replace("_", "-"), f"cannot write {path}: {exc.strerror or exc}") from None
    return str(path)


def finish(args: argparse.Namespace, data: dict[str, object], report: str, written: list[str]) -> int:
    """The command's result: one JSON object with `--json`, else the report and the files written."""
    if args.json:
        print(json.dumps({**data, "written": written}, indent=2))
    elif not args.quiet:
        print(report)
        for path in written:
            print(f"wrote {path}")
    return 0


def configure_logging(talk: bool) -> None:
    """Library progress (logging) on stderr while the command talks."""
    if talk:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
