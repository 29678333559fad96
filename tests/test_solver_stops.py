"""A search stopped early returns what it knows or stops at once: the balanced split at any time limit,
and an interrupt (Ctrl-C, a signal handler's exception, one a callback raises) ends HiGHS promptly
and propagates unchanged, unless the caller asked for the best plan so far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from solver_cases import SAPP, integer_program

from sapp_hook.cli import main
from solver import PipelineSpec, Plan, load_profile, solve
from solver.program import milp as milp_module
from solver.program.formulation import START_TIMES
from solver.program.milp import STOP_WAIT_S
from solver.program.start import balanced_plan

MIB = 2**20
# Sixteen stages of three chunks: the search's first LP alone takes seconds, its proof minutes.
LONG = dict(pipeline_parallel=16, chunks=3, micro_batches=16, memory_budget_bytes=56000 * MIB)
LONG_FLAGS = [
    "--profile",
    str(SAPP / "sim.json"),
    "--pipeline-parallel",
    "16",
    "--chunks",
    "3",
    "--micro-batches",
    "16",
    "--memory",
    "56000MiB",
]


class Stop(BaseException):
    """What a signal handler raises (a BaseException, as KeyboardInterrupt is)."""


@pytest.fixture(scope="module")
def sim():
    return load_profile(SAPP / "sim.json")


def test_a_tiny_time_limit_returns_the_balanced_split_with_its_gap(sim, capsys):
    spec = PipelineSpec(schedule="Interleaved1F1B-less-memory", **LONG)
    balanced = balanced_plan(integer_program(sim, spec, START_TIMES), move_layers=False)
    assert balanced is not None  # the budget is one the balanced split fits
    balanced_ms = integer_program(sim, spec, START_TIMES).plan(balanced).iteration_time_ms
    plan = solve(sim, spec, time_limit_s=0.01)
    assert plan.status == "feasible" and plan.fits
    assert 0 < plan.gap < 1 and plan.lower_bound_ms < plan.iteration_time_ms <= balanced_ms
    code = main(["solve", *LONG_FLAGS, "--schedule", "Interleaved1F1B-less-memory", "--time-limit", "0.01", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["status"] == "feasible" and report["fits"] and report["gap"] > 0


def test_an_exception_raised_in_a_callback_stops_highs_and_propagates(sim, monkeypatch):
    """HiGHS, in C++, cannot carry a Python exception out of a callback: it used to be lost and the
    search ran on to its limit."""
    program = integer_program(sim, PipelineSpec(schedule="Interleaved1F1B", **LONG), START_TIMES)
    monkeypatch.setattr(milp_module, "PROGRESS_EVERY_S", 0.0)
    raised = Stop()
    calls = []

    def progress(seconds, best, bound):
        calls.append(seconds)
        raise raised

    started = time.perf_counter()
    with pytest.raises(Stop) as caught:
        program.milp.minimize({program.iteration: 1.0}, time_limit_s=30, progress=progress)
    assert caught.value is raised and len(calls) == 1
    assert time.perf_counter() - started < 10  # stopped, not searched to the limit
    assert program.milp.interrupted is not None


def _stop_after(seconds: float) -> threading.Timer:
    """SIGUSR1 to this process after `seconds`, its handler raising Stop in the main thread."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    return timer


@pytest.fixture
def stop_on_sigusr1():
    signalled = []

    def handler(signum, frame):
        signalled.append(time.perf_counter())
        raise Stop()

    previous = signal.signal(signal.SIGUSR1, handler)
    yield signalled
    signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("on_interrupt", ["raise", "best", "function"])
def test_a_signal_stops_the_search_at_once_and_returns_the_best_plan_only_if_asked(sim, stop_on_sigusr1, on_interrupt):
    spec = PipelineSpec(schedule="Interleaved1F1B", **LONG)
    kept: list[Plan] = []
    argument = kept.append if on_interrupt == "function" else on_interrupt
    timer = _stop_after(8.0)  # the balanced split and its moves take about 5 s here; then HiGHS searches
    try:
        if on_interrupt == "best":  # a limit far past the signal, so that a search that runs on fails here
            plans = [solve(sim, spec, time_limit_s=60, on_interrupt=argument)]
        else:
            with pytest.raises(Stop):
                solve(sim, spec, time_limit_s=60, on_interrupt=argument)
            plans = kept
    finally:
        timer.cancel()
    [signalled] = stop_on_sigusr1
    # HiGHS returned (its sub-MIP heuristics take no interrupt: seconds here), before the wait gives up
    for highs in [thread for thread in threading.enumerate() if thread.name == "highs"]:
        highs.join(1.0)  # it has set its done event and is ending
        assert not highs.is_alive()
    assert time.perf_counter() - signalled < STOP_WAIT_S
    if on_interrupt == "raise":
        assert plans == []
        return
    [plan] = plans
    assert plan.status == "interrupted" and plan.fits and 0 < plan.gap < 1
    assert plan.lower_bound_ms == pytest.approx(plan.iteration_time_ms * (1 - plan.gap))


def test_on_interrupt_takes_raise_best_or_a_function(sim):
    from simulator import InputError

    with pytest.raises(InputError, match="on_interrupt: expected one of raise, best or a function"):
        solve(sim, PipelineSpec(schedule="1F1B", pipeline_parallel=4, micro_batches=8), on_interrupt="keep")


def _interrupted_cli(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float, Path]:
    """`sapp-hook solve --time-limit inf` sent SIGINT once it reports progress: how it ended, how
    long after the signal, and its --plan-out path."""
    plan_out = tmp_path / "plan.json"
    argv = [
        sys.executable,
        "-m",
        "sapp_hook",
        "solve",
        *LONG_FLAGS,
        "--schedule",
        "Interleaved1F1B",
        "--time-limit",
        "inf",
        "--plan-out",
        str(plan_out),
        *flags,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    try:
        for line in process.stderr:
            if line.startswith("searching:"):
                break
        signalled = time.perf_counter()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    return subprocess.CompletedProcess(argv, process.returncode, out, err), time.perf_counter() - signalled, plan_out


def test_ctrl_c_ends_the_search_promptly_and_writes_no_plan(tmp_path):
    ended, seconds, plan_out = _interrupted_cli(tmp_path)
    assert ended.returncode != 0 and seconds < 5.0
    assert not plan_out.exists()


def test_ctrl_c_with_keep_best_on_interrupt_writes_the_best_plan_so_far(tmp_path):
    ended, seconds, plan_out = _interrupted_cli(tmp_path, "--keep-best-on-interrupt")
    assert ended.returncode != 0 and seconds < 5.0
    plan = json.loads(plan_out.read_text())
    assert plan["status"] == "interrupted" and plan["fits"] and 0 < plan["gap"] < 1
