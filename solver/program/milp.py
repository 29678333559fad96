"""A small mixed-integer linear program, built row by row and solved with HiGHS."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

INF = math.inf
Terms = Mapping[int, float]
PROGRESS_EVERY_S = 5.0
POLL_S = 0.05  # how often the waiting thread wakes, so that signals reach it at once
STOP_WAIT_S = 10.0  # the most an interrupted solve waits for HiGHS to reach its next interrupt check
ASYNC_SIGNALS = {
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGPIPE")
    if hasattr(signal, name)
}
# A search HiGHS ends in a solve error is run again with another random seed, up to this many times.
SOLVE_ERROR_RETRIES = 2
ROOT_HEURISTICS = (
    "mip_heuristic_run_feasibility_jump",
    "mip_heuristic_run_rens",
    "mip_heuristic_run_rins",
    "mip_heuristic_run_root_reduced_cost",
)


@dataclass
class Linear:
    """A linear expression over the program's variables: `constant` + sum(coefficient x variable)."""

    terms: dict[int, float] = field(default_factory=dict)
    constant: float = 0.0

    def add(self, variable: int, coefficient: float) -> None:
        if coefficient:
            self.terms[variable] = self.terms.get(variable, 0.0) + coefficient

    def add_expression(self, other: Linear, scale: float = 1.0) -> None:
        """Add `scale` x `other`."""
        self.constant += scale * other.constant
        for variable, coefficient in other.terms.items():
            self.add(variable, scale * coefficient)

    def value(self, values: list[float]) -> float:
        return self.constant + dot(self.terms, values)


def dot(terms: Mapping[int, float], values: list[float]) -> float:
    """The value of the linear expression `terms` (variable -> coefficient) at `values`."""
    return sum(coefficient * values[variable] for variable, coefficient in terms.items())


def within(value: float) -> float:
    """The most a quantity the program bounds by `value` may be: HiGHS holds rows to about 1e-6."""
    return value + 1e-6 * max(abs(value), 1.0)


@dataclass(frozen=True)
class MilpResult:
    status: str  # "optimal", "stopped" (by the time or node limit, with or without a solution), "infeasible"
    values: list[float] | None  # None when no solution was found
    objective: float | None
    bound: float  # proven lower bound on the objective (minimisation)
    nodes: int


class Milp:
    """Variables and rows; `minimize` solves a copy, so rows can be added between solves. `interrupted`:
    what the last solve an exception stopped had found (see `minimize`)."""

    def __init__(self) -> None:
        self.interrupted: MilpResult | None = None
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.row_start: list[int] = [0]
        self.row_index: list[int] = []
        self.row_value: list[float] = []

    @property
    def num_variables(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def variable(self, lower: float = 0.0, upper: float = INF, *, integer: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.lower) - 1

    def row(self, terms: Terms | Iterable[tuple[int, float]], lower: float = -INF, upper: float = INF) -> None:
        """lower <= sum(coefficient x variable) <= upper."""
        items = terms.items() if isinstance(terms, Mapping) else terms
        for index, value in items:
            if value:
                self.row_index.append(index)
                self.row_value.append(value)
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def remove_rows(self, rows: range) -> None:
        """Drop the consecutive rows `rows`; the rows after them move up."""
        begin, end = self.row_start[rows.start], self.row_start[rows.stop]
        del self.row_index[begin:end], self.row_value[begin:end]
        del self.row_lower[rows.start : rows.stop], self.row_upper[rows.start : rows.stop]
        self.row_start[rows.start :] = [start - (end - begin) for start in self.row_start[rows.stop :]]

    def minimize(
        self,
        objective: Terms,
        *,
        time_limit_s: float,
        hint: list[float] | Mapping[int, float] | None = None,
        relative_gap: float = 1e-9,
        relaxed: bool = False,
        heuristics: bool = True,
        incumbents: list[list[float]] | None = None,
        node_limit: int | None = None,
        progress: Callable[[float, float, float], None] | None = None,
        random_seed: int = 0,
    ) -> MilpResult:
        """Minimise. `hint` starts the search from a solution: a value for every variable, or for some
        (a mapping; HiGHS fixes those and solves for the rest). `relaxed` drops integrality (the LP
        relaxation); `heuristics=False` skips HiGHS's root heuristics, which cost more than they find
        when `hint` is already a good solution; `incumbents` collects every improving solution the
        search finds; `node_limit` stops the branch-and-bound after that many nodes (deterministic,
        unlike the time limit); `progress(seconds, best, bound)` is called every few seconds of a
        long search. `random_seed`: HiGHS's, which steers its choices among equals.

        Any exception raised while HiGHS runs (KeyboardInterrupt, a signal handler's, one a callback
        raises) stops HiGHS at its next interrupt check and propagates unchanged; `interrupted` then
        holds what the search had found."""
        import highspy
        import numpy as np

        started = time.perf_counter()
        lp = highspy.HighsLp()
        lp.num_col_ = self.num_variables
        lp.num_row_ = self.num_rows
        cost = np.zeros(self.num_variables)
        for index, value in objective.items():
            cost[index] = value
        lp.col_cost_ = cost
        lp.col_lower_ = np.array(self.lower, dtype=float)
        lp.col_upper_ = np.array(self.upper, dtype=float)
        lp.row_lower_ = np.array(self.row_lower, dtype=float)
        lp.row_upper_ = np.array(self.row_upper, dtype=float)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(self.row_start, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(self.row_index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(self.row_value, dtype=float)
        lp.a_matrix_.num_col_ = self.num_variables
        lp.a_matrix_.num_row_ = self.num_rows
        if not relaxed:
            lp.integrality_ = [
                highspy.HighsVarType.kInteger if integer else highspy.HighsVarType.kContinuous
                for integer in self.integer
            ]

        highs = _new_highs()
        highs.setOptionValue("output_flag", False)
        highs.setOptionValue("threads", 1)  # deterministic, and the machines this runs on are small
        # on these programs presolve slows the branch-and-bound more often than it helps
        highs.setOptionValue("presolve", "off")
        highs.setOptionValue("time_limit", max(time_limit_s, 0.01))
        highs.setOptionValue("mip_rel_gap", relative_gap)
        highs.setOptionValue("mip_abs_gap", 1e-9)
        highs.setOptionValue("random_seed", random_seed)
        if node_limit is not None:
            highs.setOptionValue("mip_max_nodes", node_limit)
        if not heuristics:
            for option in ROOT_HEURISTICS:
                highs.setOptionValue(option, False)
        highs.passModel(lp)
        if isinstance(hint, Mapping):  # some variables only: HiGHS fixes them and solves for the rest
            index = np.array(list(hint), dtype=np.int32)
            highs.setSolution(len(index), index, np.array(list(hint.values()), dtype=float))
        elif hint is not None:
            solution = highspy.HighsSolution()
            solution.col_value = list(hint)
            solution.value_valid = True
            highs.setSolution(solution)
        stopper = _Stopper(highs)
        if progress is not None:
            _report_progress(highs, progress, stopper)
        if incumbents is not None:

            def on_improving_solution(event) -> None:  # type: ignore[no-untyped-def]
                if len(event.data_out.mip_solution) == self.num_variables:
                    incumbents.append(list(event.data_out.mip_solution))

            highs.cbMipImprovingSolution.subscribe(stopper.guard(on_improving_solution))
        try:
            _run(highs, stopper)
        except BaseException:
            self.interrupted = _found_so_far(highs, relaxed) if stopper.stopped else None
            if stopper.stopped:  # an interrupted search's state, left to the interpreter's exit, aborts it
                highs.clearSolver()
            raise

        model_status = highs.getModelStatus()
        info = highs.getInfo()
        has_solution = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
        values = list(highs.getSolution().col_value) if has_solution else None
        objective_value = info.objective_function_value if has_solution else None
        if model_status == highspy.HighsModelStatus.kOptimal:
            status = "optimal"
            bound = objective_value if relaxed or info.mip_dual_bound in (None, -INF) else info.mip_dual_bound
        elif model_status == highspy.HighsModelStatus.kInfeasible:
            status, bound = "infeasible", INF
        elif model_status in (
            highspy.HighsModelStatus.kTimeLimit,
            highspy.HighsModelStatus.kInterrupt,
            highspy.HighsModelStatus.kSolutionLimit,
            highspy.HighsModelStatus.kIterationLimit,
        ):
            status, bound = "stopped", info.mip_dual_bound
        elif model_status == highspy.HighsModelStatus.kSolveError and (
            hint is not None or random_seed < SOLVE_ERROR_RETRIES
        ):
            # HiGHS 1.16 fails some partial starts, and some solutions on a row's tolerance: without the start, or another seed
            return self.minimize(
                objective,
                time_limit_s=time_limit_s - (time.perf_counter() - started),
                relative_gap=relative_gap,
                relaxed=relaxed,
                heuristics=heuristics,
                incumbents=incumbents,
                node_limit=node_limit,
                progress=progress,
                random_seed=random_seed if hint is not None else random_seed + 1,
            )
        else:
            raise RuntimeError(f"HiGHS ended with {highs.modelStatusToString(model_status)}")
        return MilpResult(status, values, objective_value, bound, max(int(info.mip_node_count), 0))


class _Stopper:
    """Stops a HiGHS run at its next interrupt check once `requested`, and keeps the first exception
    a callback raised (HiGHS, C++, cannot carry it) to raise once HiGHS has returned."""

    def __init__(self, highs) -> None:  # type: ignore[no-untyped-def]
        self.requested = False
        self.stopped = False  # HiGHS has returned
        self.error: BaseException | None = None
        for callback in (highs.cbSimplexInterrupt, highs.cbIpmInterrupt, highs.cbMipInterrupt):
            callback.subscribe(self.check)

    def check(self, event) -> None:  # type: ignore[no-untyped-def]
        if self.requested:
            event.interrupt()

    def guard(self, callback: Callable[[object], None]) -> Callable[[object], None]:
        """`callback`, an exception it raises kept and HiGHS stopped instead of the exception lost."""

        def guarded(event) -> None:  # type: ignore[no-untyped-def]
            if self.requested:
                return
            try:
                callback(event)
            except BaseException as error:
                self.error, self.requested = error, True
                event.interrupt()

        return guarded


def _run(highs, stopper: _Stopper) -> None:  # type: ignore[no-untyped-def]
    """`highs.run()` on a thread of its own, the calling thread waiting free to take signals. An
    exception it gets meanwhile (KeyboardInterrupt, a SIGTERM handler's), or one a callback raised,
    stops HiGHS at its next interrupt check and is raised once HiGHS has returned."""
    done = threading.Event()  # not Thread.join: an exception inside it marks a running thread stopped (bpo-45274)

    def work() -> None:
        try:
            if hasattr(signal, "pthread_sigmask"):  # signals go to the waiting thread, never into HiGHS's calls
                signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)
            highs.run()
        finally:
            done.set()

    threading.Thread(target=work, name="highs", daemon=True).start()
    try:
        while not done.wait(POLL_S):
            pass
    except BaseException:
        stopper.requested = True
        _wait_for_stop(done)
        stopper.stopped = done.is_set()
        raise
    stopper.stopped = True
    if stopper.error is not None:
        raise stopper.error


def _wait_for_stop(done: threading.Event) -> None:
    """Wait for HiGHS to stop, at most STOP_WAIT_S; a signal meanwhile (a second Ctrl-C) changes nothing."""
    give_up = time.perf_counter() + STOP_WAIT_S
    while not done.is_set() and time.perf_counter() < give_up:
        try:
            done.wait(POLL_S)
        except BaseException:  # the first exception is the one raised
            continue


def _found_so_far(highs, relaxed: bool) -> MilpResult | None:  # type: ignore[no-untyped-def]
    """What a stopped search had found: its best solution (None for none) and its bound."""
    import highspy

    try:
        info = highs.getInfo()
        has_solution = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
        values = list(highs.getSolution().col_value) if has_solution else None
        bound = -INF if relaxed or info.mip_dual_bound is None else info.mip_dual_bound
        return MilpResult(
            "stopped",
            values,
            info.objective_function_value if has_solution else None,
            bound,
            max(int(info.mip_node_count), 0),
        )
    except Exception:  # the search is lost, not the exception that stopped it
        return None


def _report_progress(highs, progress: Callable[[float, float, float], None], stopper: _Stopper) -> None:
    next_report = time.perf_counter() + PROGRESS_EVERY_S

    def on_interrupt_check(event) -> None:  # type: ignore[no-untyped-def]
        nonlocal next_report
        if time.perf_counter() >= next_report:
            next_report = time.perf_counter() + PROGRESS_EVERY_S
            data = event.data_out
            progress(data.running_time, data.mip_primal_bound, data.mip_dual_bound)

    highs.cbMipInterrupt.subscribe(stopper.guard(on_interrupt_check))


_banner_shown = False


def _new_highs():
    """A HiGHS instance. The first one in a process prints a copyright banner on the C-level stdout,
    where it would break `--json`; it goes to /dev/null instead."""
    import highspy

    global _banner_shown
    if _banner_shown:
        return highspy.Highs()
    _banner_shown = True
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
