"""The search: the layer split and recompute modes with the least simulated iteration time that fit.

One mixed-integer program states the simulator itself for the schedule at hand: durations linear
in how many layers of each kind and recompute mode each virtual stage holds, the iteration time as
the replay makes it (a start time for every action, or a row for every critical path that matters:
see START_TIMES, PATHS), and memory at every point of every rank's action list within the budget.
Its optimum is the simulated optimum; HiGHS proves it, or reports the gap at the time limit. Ties
are broken in two more solves: least recompute time for the fastest plan's split, then least peak
memory. A balanced split found without search starts 1-chunk searches, and is returned by a search
the time limit stops if faster; with start times, the plan a stopped search returns then has its
recompute chosen again, its split fixed.

Consecutive layers of one kind with identical costs form a group whose layers are interchangeable,
so the program counts layers per group instead of placing each one: the more a profile's layers of
one kind agree, the smaller the program. Head layers sit on the first virtual stage and tail layers
on the last, where the schedule puts them (rank 0 for both in a V).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, KINDS
from simulator.costs import ChunkCosts, PipelineCosts
from simulator.errors import MAX_MS, InputError, check_seconds
from simulator.replay import critical_path
from simulator.schedule import Schedule
from simulator.schedules import schedule_kind
from simulator.units import MIB, format_bytes, format_ms
from solver.errors import InfeasibleError
from solver.milp import INF, Milp, MilpResult
from solver.plan import (
    Plan,
    boundary_bytes,
    evaluate_plan,
    handed_gradient_bytes,
    last_layer_bytes,
    ordered_modes,
    saved_input_bytes,
    torch_1f1b_held_bytes,
    torch_engine_bytes,
    torch_hands_gradient_over,
    torch_splits_backward,
)
from solver.profile import COMM, HEAD, NONE, SELECTIVE, TAIL, LayerProfile, ModelProfile
from solver.spec import PipelineSpec
from solver.start import balanced_plan, improved_by_moves

log = logging.getLogger("solver")
TIME_SLACK = 1e-7  # relative: later solves keep the iteration time within this of the best
# The most a stopped search spends after its limit on a bound of its own (measured 0.1-0.7 s, up to
# 65,536 actions).
BOUND_LIMIT_S = 5.0
# How the program states the iteration time. START_TIMES: every action's start as a variable, the
# simulator's replay as rows. PATHS: one row per critical path met so far (the time is at least each
# path's length), adding the path of any solution the rows let run faster than the simulator does.
# Measured on SAPP's fixtures, 1F1B: with one chunk per rank some 50-100 paths settle it and PATHS
# solves 2-6x faster at 16 stages x 16 micro-batches, 35-60x at 64, and 32 x 1 x 128 in 3 s where
# START_TIMES stops at 60 s with a 14% gap; with two or more chunks the integer solutions keep
# finding paths the rows miss, and START_TIMES is faster.
START_TIMES, PATHS = "start-times", "paths"
# Tie-breaks stop after this many branch-and-bound nodes, by how the program states the iteration
# time (a node count, unlike a time, keeps the answer deterministic). Measured on SAPP's fixtures:
# they find their plan within it and prove it (1-136 nodes) or spend the rest of the time limit on
# the bound of a min-max peak, up to 40 s on 8 x 2 x 16 schedules, which no user waits for. With one
# chunk (PATHS) 50 nodes found the same peaks as 200 on 34 searches (1F1B, ZBH1 and GPipe at 4-32
# stages), the peak's tie-break 0.11-0.30 s instead of 0.27-0.58 s where the cap stops it; with two
# chunks 50 left DualPipeV 8 x 2 x 16 1% higher (69,900 MiB against 69,165).
TIE_BREAK_NODES = {START_TIMES: 200, PATHS: 50}
# PATHS timing also adds, for the relaxation's solution and for each solution found to miss a
# path, the critical path with each virtual stage in turn this much slower: integer plans near a
# solution differ from it most in which stage is heavier, and these are the paths they run along.
# Measured on SAPP's fixtures, 1-chunk 1F1B, ZBH1 and GPipe at 8 and 16 stages and 16 or 48
# micro-batches, budgets 1.1x and 1.5x the least that fits, whole solves: 111 s -> 40 s in all;
# GPipe at 16 stages 4.6-19 s -> 0.2-1.4 s (0.20x, geometric mean), ZBH1 0.66x, 1F1B 0.97x (some
# slower: sim.json 1F1B 16 x 1 x 16 at 56000 MiB 1.7 s -> 2.8 s). 5%, 10% and 20% measured alike.
# With these paths PATHS still loses to START_TIMES at two chunks (6-8 stages: 1-5x slower, and
# two searches START_TIMES proves in 12-15 s not proven in 20 s).
SLOWER_STAGE = 0.1
# The share of a start-times search's limit kept for the plan a stopped search ends with: its
# recompute is chosen again by the program with its layer split fixed, which HiGHS solves far
# faster, and where the whole search leaves it well short of the best. Interleaved1F1B 16 x 3 x 16
# on SAPP's fixtures, stopped at 30 s: sim.json 163,868 ms -> 159,611 ms, test.json 79,470 ->
# 79,290 ms (a plan the whole program had not found after 9.5 minutes); a fifth gave the same.
POLISH_SHARE = 0.1
# HiGHS holds rows to about 1e-6, in the program's unit (ms), and fails on programs whose times run
# to 1e7 ms and more ("Solve error", seen with layers of 1e5-1e6 ms): a profile whose median layer
# takes less than LEAST or more than MOST milliseconds (tiny models on fast devices; typos) is
# searched with every time scaled by a power of ten into that range, and its plan simulated again
# at its true times. SAPP's fixtures (540 ms) and measured profiles (1-100 ms) are searched as they are.
LEAST_SEARCH_MS, MOST_SEARCH_MS = 1.0, 1e4

# A memory point's working set: (chunk, kind) of the backward action running there, None for none.
WorkingAt = tuple[int, str] | None
# A working-set variable: (the variable, its least value, (count variable, working set) of each layer
# that may raise it, rows (constant, terms) it is at least).
WorkingChoice = tuple[int, float, list[tuple[int, float]], list[tuple[float, dict[int, float]]]]


@dataclass
class _Group:
    """Consecutive layers of one kind, planned as interchangeable copies of their mean."""

    kind: str
    first: int
    size: int
    modes: tuple[str, ...]
    forward_ms: float
    backward_ms: float
    weight_ms: float
    input_ms: float
    static_mib: float
    extra_ms: dict[str, float]
    activation_mib: dict[str, float]
    working_mib: dict[str, float]
    input_working_mib: dict[str, float]  # where the backward is split: its I half's, and its W half's
    weight_working_mib: dict[str, float]
    retained_mib: dict[str, float]
    pending_mib: dict[str, float]
    input_held_mib: dict[str, float]  # what its I leaves held until its stage's I ends
    output_gradient_freed_mib: dict[str, float]  # what its I frees of the gradient handed to it
    weight_freed_mib: dict[str, float]  # what its W frees before its stage's W ends
    pinned_cell: int | None = None  # heads and tails do not move

    def kept_by_input_mib(self, mode: str) -> float:
        """What its I holds less what it frees of the gradient handed to it: where a layer follows it
        in its chunk, what it keeps until W (its pending bytes and its inner extra)."""
        return self.input_held_mib[mode] - self.output_gradient_freed_mib[mode]


@dataclass
class _Linear:
    terms: dict[int, float] = field(default_factory=dict)
    constant: float = 0.0

    def add(self, variable: int, coefficient: float) -> None:
        if coefficient:
            self.terms[variable] = self.terms.get(variable, 0.0) + coefficient

    def add_expression(self, other: _Linear, scale: float = 1.0) -> None:
        """Add `scale` x `other`."""
        self.constant += scale * other.constant
        for variable, coefficient in other.terms.items():
            self.add(variable, scale * coefficient)

    def value(self, values: list[float]) -> float:
        return self.constant + _dot(self.terms, values)


def solve(profile: ModelProfile, spec: PipelineSpec, *, time_limit_s: float = 60.0) -> Plan:
    """The fastest plan that fits `spec.memory_budget_bytes`; raises InfeasibleError when none fits.

    Status "optimal" when the search proved it, "feasible" with the proven gap when the time limit
    stopped it. Deterministic unless the time limit stops a search.
    """
    check_seconds(time_limit_s, "time_limit_s")
    scale = _search_time_scale(profile, spec)
    if scale != 1.0:
        log.info("searching with every time x %g (the median layer's forward and backward take %s ms)", scale,
                 format_ms(_median_layer_ms(profile)))
        scaled_spec = dataclasses.replace(spec, p2p_ms=spec.p2p_ms * scale,
                                          action_overhead_ms=spec.action_overhead_ms * scale)
        found = solve(profile.with_times_scaled(scale), scaled_spec, time_limit_s=time_limit_s)
        plan = evaluate_plan(profile, spec, found.stage_layer_counts, found.layer_modes)
        proven = found.status == "optimal"
        lower_bound = plan.iteration_time_ms if proven else min(found.lower_bound_ms / scale, plan.iteration_time_ms)
        return plan.with_search(status=found.status, gap=found.gap, lower_bound_ms=lower_bound,
                                solve_seconds=found.solve_seconds)
    started = time.perf_counter()
    deadline = started + time_limit_s
    schedule = spec.pipeline_schedule
    groups = _groups(profile, spec, schedule.num_stages)
    _check_room(schedule, groups, spec)
    log.info("solving %s, %d layers (%d actions)", schedule.describe(), len(profile.layers), schedule.num_actions)

    model = _Formulation(profile, spec, schedule, groups, with_budget=True, timing=_timing_for(schedule))
    if model.timing == PATHS:
        _paths_of_relaxation(model, deadline)
    # A plan that fits without search, for a search the time limit stops to fall back on (large
    # schedules: the first LP alone can take minutes), computed first so that it cannot overrun.
    # With start times, where such stops are common, it is improved by moving layers (with half the
    # time at most): sim.json's Interleaved1F1B 16 x 3 x 16 stopped at 30 s then runs 163,868 ms,
    # where the search's best ran 166,500; with one chunk the search proves its plan within seconds,
    # and starting it from the improved plan was no faster (48 searches, see "Measured").
    balanced = balanced_plan(model, move_layers=False)
    fallback = balanced if balanced is not None else balanced_plan(model, move_layers=True)
    if fallback is not None and model.timing == START_TIMES:
        fallback = improved_by_moves(model, fallback, started + time_limit_s / 2)
    # With critical-path rows most of a search is HiGHS's root heuristics looking for a first plan;
    # started from the balanced split it skips them. Measured on the benchmark's 1-chunk cases:
    # 32 x 1 x 128 4.0 s -> 1.7 s, test.json 16 x 1 x 16 1.5 s -> 0.8 s, none slower; on 36
    # searches at budgets 1.1x and 1.5x the least that fits 0.92x (GPipe 0.82x, 1F1B alike). Not
    # from plans that had to move layers to fit (further from the optimum: those 36 searches 1.03x,
    # one 2.4x slower), nor with start times, where it was as often slower as faster (2-chunk
    # schedules at 6 and 8 stages).
    seeded = model.timing == PATHS and balanced is not None
    if seeded:
        # The plan the search starts from, and its slower-stage neighbours, add their critical paths:
        # sim.json 1F1B 16 x 1 x 16 at 56000 MiB 2.2 s -> 1.2 s (one solve fewer: its first plan no
        # longer misses a path); the 48 searches of SAPP's fixtures at 1.1x and 1.5x alike (1.007x).
        model.simulated_time(balanced, add_path=True)
        model.add_paths_of_slower_stages(balanced)
    # With start times a share of the limit is kept for a search the limit stops, to choose its best
    # plan's recompute again with the split fixed (`_polished`); one proven in time leaves it to the
    # tie-breaks.
    search_deadline = deadline - POLISH_SHARE * time_limit_s if model.timing == START_TIMES else deadline
    fastest = _minimize(
        model, {model.iteration: 1.0}, search_deadline, progress=_log_progress, heuristics=not seeded,
        hint={variable: balanced[variable] for variable in model.count.values()} if seeded else None,
    )
    log.info("fastest plan: %s after %d nodes (%.2f s)", fastest.status, fastest.nodes, time.perf_counter() - started)
    if fastest.status == "infeasible":
        raise _infeasible(profile, spec, schedule, groups, deadline)
    proven = fastest.status == "optimal"
    best = _break_ties(model, fastest, deadline) if proven else fastest
    values = best.values
    plan = None if values is None else _plan_of(model, values)
    if not proven and fallback is not None:
        fallback_plan = _plan_of(model, fallback)
        if fallback_plan.fits and (plan is None or fallback_plan.iteration_time_ms < plan.iteration_time_ms):
            log.info("the search's best plan is %s; the plan found without search runs %s ms and fits: taking it",
                     "none" if plan is None else f"{format_ms(plan.iteration_time_ms)} ms",
                     format_ms(fallback_plan.iteration_time_ms))
            values, plan = fallback, fallback_plan
    if not proven and plan is not None and model.timing == START_TIMES:
        polished = _polished(model, values, deadline)
        if polished is not None:
            polished_plan = _plan_of(model, polished)
            if polished_plan.fits and polished_plan.iteration_time_ms < plan.iteration_time_ms:
                log.info("its split with the recompute chosen again: %s ms", format_ms(polished_plan.iteration_time_ms))
                plan = polished_plan
    if plan is None:
        raise InputError("time_limit_s", f"no plan found within {time_limit_s:g} s; allow more time")

    if proven:
        # HiGHS holds each row to about 1e-6: along a chain of n actions the program's times may drift
        # n x 1e-6 ms from the simulator's, which only matters where whole plans run in microseconds.
        drift = 1e-6 * schedule.num_actions
        fastest_allowed = fastest.objective - 1e-6 * max(fastest.objective, 1.0) - drift
        slowest_allowed = _within(model.time_cap) + drift  # the tie-breaks' plan may run TIME_SLACK slower
        if not fastest_allowed <= plan.iteration_time_ms <= slowest_allowed:
            raise RuntimeError(
                f"the program's optimum is {fastest.objective} ms but the simulator replays its plan in "
                f"{plan.iteration_time_ms} ms: the formulation and the simulator disagree"
            )
        lower_bound = plan.iteration_time_ms
    else:  # HiGHS's bound is -inf or nan before its first LP is solved (large schedules)
        searched_bound = fastest.bound if math.isfinite(fastest.bound) else -INF
        busiest = _busiest_rank_bound_ms(profile, spec, schedule, groups)
        lower_bound = min(max(searched_bound, busiest), plan.iteration_time_ms)
    return plan.with_search(
        status="optimal" if proven else "feasible",
        gap=(plan.iteration_time_ms - lower_bound) / plan.iteration_time_ms,
        lower_bound_ms=lower_bound,
        solve_seconds=time.perf_counter() - started,
    )


def _search_time_scale(profile: ModelProfile, spec: PipelineSpec) -> float:
    """The power of ten that brings the median body layer's forward + backward between LEAST_SEARCH_MS
    and MOST_SEARCH_MS (1 where it already is), kept below the largest time a spec or profile may state."""
    median = _median_layer_ms(profile)
    if median > MOST_SEARCH_MS:
        return 10.0 ** -math.ceil(math.log10(median / MOST_SEARCH_MS))
    if median <= 0 or median >= LEAST_SEARCH_MS:
        return 1.0
    # no virtual stage's action takes longer than every layer's forward and backward with recompute
    largest = max(spec.p2p_ms, spec.action_overhead_ms + sum(
        layer.forward_ms + layer.backward_ms + max(c.extra_ms for c in layer.recompute.values())
        for layer in profile.layers))
    exponent = math.ceil(math.log10(LEAST_SEARCH_MS / median))
    while exponent > 0 and largest * 10.0**exponent > MAX_MS:
        exponent -= 1
    return 10.0**exponent


def _median_layer_ms(profile: ModelProfile) -> float:
    loads = sorted(layer.forward_ms + layer.backward_ms for layer in profile.layers if layer.is_body)
    return loads[len(loads) // 2]


def _polished(model: _Formulation, values: list[float], deadline: float) -> list[float] | None:
    """The fastest plan the program finds by `deadline` with the layer split of the plan at `values`
    (each virtual stage's layers of each group fixed), its recompute free; None if none is found.
    Adds those rows to `model` for good."""
    model.fix_split(values)
    # Started from the plan itself (its counts as a partial start: HiGHS fills in the start times).
    counts = {variable: round(values[variable]) for variable in model.count.values()}
    return _minimize(model, {model.iteration: 1.0}, deadline, hint=counts).values


def _busiest_rank_bound_ms(profile: ModelProfile, spec: PipelineSpec, schedule: Schedule, groups: list[_Group]) -> float:
    """A lower bound on any plan's iteration time, for a search stopped before it had a good one:
    the busiest rank's work (every action it runs) at the optimum of the LP relaxation of the
    program without its time rows, memory rows kept (so recompute the budget forces counts).
    Milliseconds; 0 if that LP does not solve in time."""
    model = _Formulation(profile, spec, schedule, groups, with_budget=True, timing=PATHS)  # no path rows yet
    busiest = model.milp.variable()
    program = schedule.program
    for rank in range(schedule.stages):
        work = {busiest: 1.0}  # every action the rank runs (split backwards may take longer than whole ones)
        for action in range(program.rank_offsets[rank], program.rank_offsets[rank + 1]):
            variable = model.action_duration[action]
            work[variable] = work.get(variable, 0.0) - 1.0
        model.milp.row(work, lower=0.0)
    relaxed = model.milp.minimize({busiest: 1.0}, time_limit_s=BOUND_LIMIT_S, relaxed=True)
    return relaxed.objective if relaxed.status == "optimal" else 0.0


def _plan_of(model: _Formulation, values: list[float]) -> Plan:
    return evaluate_plan(model.profile, model.spec, model.stage_layer_counts(values), model.layer_modes(values))


def _break_ties(model: _Formulation, fastest: MilpResult, deadline: float) -> MilpResult:
    """Among plans as fast as the fastest: least recompute time (unless it has none) for the fastest
    plan's layer split, then least peak memory over every split. Each solve gets part of the time left
    and at most TIE_BREAK_NODES[model.timing] branch-and-bound nodes; one cut short keeps the best plan
    it found. They start from the plan in hand, so HiGHS's root heuristics, which look for a first
    plan, are skipped (measured: sim.json 16 x 1 x 16, start times, 7.3 s -> 2.9 s)."""
    best = fastest
    model.time_cap = fastest.objective * (1 + TIME_SLACK)
    model.milp.row({model.iteration: 1.0}, upper=model.time_cap)
    if any(round(fastest.values[v]) for v in model.recompute_terms):  # else none to take away
        # With its split fixed the program is far easier, and it takes away the recompute that split
        # does not need. Measured: on 12 of SAPP's cases (1 and 2 chunks, 6-16 stages) the same least
        # recompute as the search over every split found (which it did not prove within its nodes),
        # whole solves 0.75-0.95x the time (DualPipeV 8 x 2 x 16 6.7 s -> 5.0 s, Interleaved1F1B
        # 4.8 -> 3.6 s); on 108 small ones the least recompute of every equally fast plan, checked
        # against all of them. The peak's search below keeps every split: with the split fixed there
        # too, DualPipeV 8 x 2 x 16 peaked 1% higher.
        first = model.milp.num_rows
        model.fix_split(fastest.values)
        split_rows = range(first, model.milp.num_rows)  # critical paths met in this solve come after them
        least_recompute = _minimize(
            model, model.recompute_terms, deadline, share=0.5, hint=fastest.values, heuristics=False,
            node_limit=TIE_BREAK_NODES[model.timing],
        )
        model.milp.remove_rows(split_rows)
        if least_recompute.values is None:
            return best
        _log_tie_break("least recompute time", least_recompute)
        best = least_recompute
    recompute = _dot(model.recompute_terms, best.values)
    if model.recompute_terms:
        model.milp.row(model.recompute_terms, upper=recompute * (1 + TIME_SLACK) + 1e-9)
    peak = model.add_peak_variable()
    hint = best.values + [max(row.value(best.values) for _, row in model.memory_rows)]
    least_memory = _minimize(model, {peak: 1.0}, deadline, hint=hint, heuristics=False,
                             node_limit=TIE_BREAK_NODES[model.timing])
    if least_memory.values is not None:
        _log_tie_break("least peak memory", least_memory)
        best = least_memory
    return best


def _log_tie_break(preference: str, result: MilpResult) -> None:
    if result.status == "optimal":
        log.info("tie-break on %s: proven after %d nodes", preference, result.nodes)
    else:
        log.info("tie-break on %s: best found in %d nodes (proven >= %.6g, found %.6g)",
                 preference, result.nodes, result.bound, result.objective)


def _timing_for(schedule: Schedule) -> str:
    return PATHS if schedule.chunks == 1 else START_TIMES


def _minimize(
    model: _Formulation,
    objective: dict[int, float],
    deadline: float,
    *,
    share: float = 1.0,
    hint: list[float] | dict[int, float] | None = None,
    heuristics: bool = True,
    node_limit: int | None = None,
    progress=None,
) -> MilpResult:
    """Minimise `objective` over the program with `share` of the time left and at most `node_limit`
    branch-and-bound nodes. In PATHS timing, a solution the rows let run faster than the simulator
    says adds its critical path and those of its slower-stage neighbours, and the program is solved
    again from the best plan found so far (every solution found, as simulated); a limit returns that
    one, with the relaxed program's bound."""
    time_limit = _left(deadline) * share
    stop = time.perf_counter() + time_limit
    best: list[float] | None = None
    best_value, nodes = INF, 0
    while True:
        incumbents: list[list[float]] = []
        result = model.milp.minimize(
            objective, time_limit_s=_left(stop), hint=hint, heuristics=heuristics, progress=progress,
            incumbents=incumbents if model.timing == PATHS else None,
            node_limit=None if node_limit is None else max(node_limit - nodes, 1),
        )
        nodes += result.nodes
        if model.timing != PATHS or result.values is None:
            break
        known = len(model.paths)
        values = list(result.values)
        values[model.iteration] = model.simulated_time(values)
        value = _dot(objective, values)
        holds = values[model.iteration] <= _within(model.time_cap)
        if holds and value <= _within(result.objective):
            result = MilpResult(result.status, values, value, result.bound, nodes)
            break
        if len(model.paths) == known:  # the solution's own path was a row, yet it runs faster: a bug
            raise RuntimeError(
                f"the program's plan takes {result.values[model.iteration]} ms, but the simulator replays it in "
                f"{values[model.iteration]} ms along a path the program already holds: they disagree"
            )
        model.add_paths_of_slower_stages(values)
        # Every solution found on the way is a plan: keep the best of them as simulated.
        candidates = [values]
        for incumbent in incumbents:  # their paths, too, are likely to bind in the next solve
            candidates.append(list(incumbent))
            candidates[-1][model.iteration] = model.simulated_time(incumbent)
        for candidate in candidates:
            value = _dot(objective, candidate)
            if candidate[model.iteration] <= _within(model.time_cap) and value < best_value:
                best, best_value = candidate, value
        log.info("the plan found runs %.6g ms when simulated; %d critical paths known, solving again",
                 values[model.iteration], len(model.paths))
        if best is not None:
            hint = best
        if stop - time.perf_counter() < 0.05 or (node_limit is not None and nodes >= node_limit):
            return MilpResult("stopped", best, best_value if best is not None else None, result.bound, nodes)
    if result.values is None and best is not None:
        return MilpResult("stopped", best, best_value, result.bound, nodes)
    return MilpResult(result.status, result.values, result.objective, result.bound, nodes)


def _dot(terms: dict[int, float], values: list[float]) -> float:
    """The value of the linear expression `terms` (variable -> coefficient) at `values`."""
    return sum(coefficient * values[variable] for variable, coefficient in terms.items())


def _within(value: float) -> float:
    """The most a quantity the program bounds by `value` may be: HiGHS holds rows to about 1e-6."""
    return value + 1e-6 * max(abs(value), 1.0)


def _paths_of_relaxation(model: _Formulation, deadline: float) -> None:
    """Seed PATHS timing with the critical paths of the relaxation's solutions: the integer search
    then starts from the relaxation's true bound, and rarely meets a path it has not seen."""
    while time.perf_counter() < deadline:
        relaxed = model.milp.minimize({model.iteration: 1.0}, time_limit_s=_left(deadline), relaxed=True)
        if relaxed.values is None:
            return  # infeasible: the integer search says so
        known = len(model.paths)
        model.simulated_time(relaxed.values)
        if len(model.paths) == known:
            model.add_paths_of_slower_stages(relaxed.values)
            break
    log.info("%d critical paths from the relaxation", len(model.paths))


def _log_progress(seconds: float, best_ms: float, bound_ms: float) -> None:
    if math.isfinite(best_ms):
        log.info("searching: best %.6g ms, proven >= %.6g ms (gap %.1f%%), %.0f s", best_ms, bound_ms,
                 100 * (best_ms - bound_ms) / best_ms, seconds)
    else:
        log.info("searching: no plan yet, proven >= %.6g ms, %.0f s", bound_ms, seconds)


def _left(deadline: float) -> float:
    return max(deadline - time.perf_counter(), 0.05)


def _groups(profile: ModelProfile, spec: PipelineSpec, num_cells: int) -> list[_Group]:
    """Runs of consecutive layers with one kind and identical costs: the solver's interchangeable units.
    (Layers of one kind that cost differently form separate groups, kept in model order.)"""
    runs: list[list[int]] = []
    for index, layer in enumerate(profile.layers):
        if runs and _costs_key(profile.layers[runs[-1][0]]) == _costs_key(layer):
            runs[-1].append(index)
        else:
            runs.append([index])
    groups = []
    for run in runs:
        layer = profile.layers[run[0]]
        modes = _undominated_modes(layer)
        groups.append(
            _Group(
                kind=layer.kind,
                first=run[0],
                size=len(run),
                modes=modes,
                forward_ms=layer.forward_ms,
                backward_ms=layer.backward_ms,
                weight_ms=layer.split_weight_ms(),
                input_ms=layer.split_input_ms(),
                static_mib=spec.static_bytes(layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes) / MIB,
                extra_ms={m: layer.recompute[m].extra_ms for m in modes},
                activation_mib={m: layer.recompute[m].activation_bytes / MIB for m in modes},
                working_mib={m: layer.recompute[m].working_bytes / MIB for m in modes},
                input_working_mib={m: layer.recompute[m].split_input_working_bytes() / MIB for m in modes},
                weight_working_mib={m: layer.recompute[m].split_weight_working_bytes() / MIB for m in modes},
                retained_mib={m: layer.recompute[m].retained_bytes / MIB for m in modes},
                pending_mib={m: layer.recompute[m].pending_bytes / MIB for m in modes},
                input_held_mib={m: layer.recompute[m].split_input_held_bytes() / MIB for m in modes},
                output_gradient_freed_mib={m: layer.recompute[m].output_gradient_freed_bytes / MIB for m in modes},
                weight_freed_mib={m: layer.recompute[m].split_weight_freed_bytes() / MIB for m in modes},
                pinned_cell=0 if layer.kind == HEAD else num_cells - 1 if layer.kind == TAIL else None,
            )
        )
    return groups


def _undominated_modes(layer: LayerProfile) -> tuple[str, ...]:
    """Modes no other mode beats on extra time and every amount of memory alike (the first of equals)."""
    costs = {m: (c.extra_ms, c.activation_bytes, c.working_bytes, c.retained_bytes, c.pending_bytes,
                 c.split_input_working_bytes(), c.split_weight_working_bytes(), c.split_input_held_bytes(),
                 c.inner_extra_bytes(), -c.output_gradient_freed_bytes, -c.split_weight_freed_bytes())
             for m, c in layer.recompute.items()}
    kept = []
    for mode in layer.modes:
        beaten = any(
            all(o <= c for o, c in zip(costs[other], costs[mode])) and (costs[other] != costs[mode] or other in kept)
            for other in layer.modes
            if other != mode
        )
        if not beaten:
            kept.append(mode)
    return tuple(kept)


def _costs_key(layer: LayerProfile) -> tuple:
    return (
        layer.kind, layer.forward_ms, layer.backward_ms, layer.split_weight_ms(), layer.split_input_ms(),
        layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes, tuple(sorted(layer.recompute.items())),
    )


def _check_room(schedule: Schedule, groups: list[_Group], spec: PipelineSpec) -> None:
    if spec.allow_empty_chunks:
        return
    pinned_cells = {g.pinned_cell for g in groups if g.pinned_cell is not None}
    body = sum(g.size for g in groups if g.pinned_cell is None)
    needed = schedule.num_stages - len(pinned_cells)
    if body < needed:
        raise InputError(
            "stages",
            f"{schedule.stages} x {schedule.chunks} (stages x chunks) make {schedule.num_stages} virtual stages, "
            f"but only {body} body layers can fill the {needed} without a head or tail; "
            "use fewer stages or chunks, or allow empty chunks",
        )


class _Formulation:
    """The program: layer counts per (group, virtual stage, mode), durations, the iteration time, memory."""

    def __init__(
        self,
        profile: ModelProfile,
        spec: PipelineSpec,
        schedule: Schedule,
        groups: list[_Group],
        *,
        with_budget: bool,
        timing: str,
    ) -> None:
        self.profile, self.spec, self.schedule, self.groups = profile, spec, schedule, groups
        self.timing = timing
        self.milp = milp = Milp()
        cells = schedule.num_stages
        self.count: dict[tuple[int, int, str], int] = {}  # (group, cell, mode) -> variable
        for g, group in enumerate(groups):
            if group.pinned_cell is not None:
                continue
            for c in range(cells):
                for mode in group.modes:
                    self.count[g, c, mode] = milp.variable(0, group.size, integer=True)
            milp.row({self.count[g, c, m]: 1.0 for c in range(cells) for m in group.modes}, group.size, group.size)
        self._order_groups(cells)
        self._mindformers_expressible(cells)
        self._rank_totals()
        if not spec.allow_empty_chunks:
            for c in range(cells):
                pinned = sum(g.size for g in groups if g.pinned_cell == c)
                if not pinned:
                    milp.row({v: 1.0 for (g, cell, m), v in self.count.items() if cell == c}, lower=1)

        splits = schedule_kind(spec.schedule).splits_backward  # the layers' retained bytes count only then
        forward, backward, weight, input_grad, activation, static, retained, pending = (self._cell_sum(f) for f in (
            lambda g, m: g.forward_ms,
            lambda g, m: g.backward_ms + g.extra_ms[m],
            lambda g, m: g.weight_ms,
            lambda g, m: g.input_ms + g.extra_ms[m],
            lambda g, m: g.activation_mib[m],
            lambda g, m: g.static_mib,
            lambda g, m: g.retained_mib[m] if splits else 0.0,
            lambda g, m: g.kept_by_input_mib(m) if splits else g.pending_mib[m],
        ))
        self._group_presence: dict[tuple[int, int], int] = {}  # (group, cell) -> 1 where the cell holds the group
        self._end_indicators: dict[tuple[int, int | None, int], int] = {}  # see _end_indicator
        self._end_terms: list[tuple[int, int, int | None]] = []  # (indicator, group present, neighbour present)
        self.last_layer = self._last_layers(cells) if splits else None
        if spec.receive_buffers:  # a stage's input is one of torch's buffers: its first layer keeps that
            saved = [saved_input_bytes(self.profile.layers[group.first]) / MIB for group in groups]
            for cell in range(1, cells):  # plan.buffered_input_bytes
                activation[cell].add_expression(self._at_end(cell, saved, first=True), -1.0)
        if self.last_layer is not None:  # all but the chunk's last layer keep their inner extra (plan._pending_bytes)
            for expression, (last_extra, _) in zip(pending, self.last_layer):
                expression.add_expression(last_extra, -1.0)
        if torch_splits_backward(spec):  # stage 0's W runs its whole backward, as plan.pipeline_costs states it
            weight[0] = self._cell_sum(lambda g, m: g.backward_ms)[0]
            input_grad[0] = self._cell_sum(lambda g, m: g.extra_ms[m])[0]
            pending[0] = _Linear()
        for cell, (torch_retained, torch_pending) in enumerate(zip(*torch_engine_bytes(profile, spec))):
            retained[cell].constant += torch_retained / MIB
            pending[cell].constant += torch_pending / MIB
        handed = [handed_gradient_bytes(self.profile.layers[group.first], profile.stage_output_bytes) / MIB
                  for group in groups]
        for cell, hands_over in enumerate(torch_hands_gradient_over(spec)):  # plan.pipeline_costs
            if hands_over:
                pending[cell].add_expression(self._at_end(cell, handed, first=True), -1.0)
        forward_overhead, backward_overhead, weight_overhead = spec.action_overheads_ms()
        for cell_sums, overhead in ((forward, forward_overhead), (backward, backward_overhead), (weight, weight_overhead),
                                    (input_grad, backward_overhead - weight_overhead)):
            for expression in cell_sums:
                expression.constant += overhead
        for cell, (in_flight, whole_run, held) in enumerate(zip(*boundary_bytes(profile, spec),
                                                                torch_1f1b_held_bytes(profile, spec))):
            activation[cell].constant += in_flight / MIB
            static[cell].constant += (whole_run + held) / MIB
        self.recompute_terms: dict[int, float] = {}
        for (g, _, mode), variable in self.count.items():
            if groups[g].extra_ms[mode]:
                self.recompute_terms[variable] = groups[g].extra_ms[mode]
        self.activation, self.static, self.retained, self.pending = activation, static, retained, pending
        self.working = self._working_sets(cells)
        if profile.stage_shared_bytes:  # what each stage computes for its blocks, where it holds one
            for cell in range(cells):
                self.activation[cell].add_expression(self._holds_body(cell), profile.stage_shared_bytes / MIB)

        # Durations of each kind of action on each virtual stage, as variables.
        self.duration: dict[tuple[int, str], int] = {}
        self.duration_expression: dict[int, _Linear] = {}  # duration variable -> its value in layer counts
        for c in range(cells):
            for kind, expression in ((FORWARD, forward[c]), (FULL_BACKWARD, backward[c]),
                                     (BACKWARD_INPUT, input_grad[c]), (BACKWARD_WEIGHT, weight[c])):
                self.duration[c, kind] = self._defined(expression)
                self.duration_expression[self.duration[c, kind]] = expression
        program = schedule.program
        self.action_duration = [
            self.duration[schedule.stage_index(rank, chunk), kind]
            for rank, chunk, kind in zip(program.rank, program.chunk, program.kind)
        ]
        self.iteration = milp.variable()
        self.time_cap = INF  # the most iteration time a solution may take (set by the tie-breaks)
        self.paths: set[tuple] = set()
        if timing == START_TIMES:
            self._start_times()

        # Memory at every distinct point of each rank's action list.
        self.memory_rows = self._memory_rows()
        if with_budget and spec.memory_budget_bytes < INF:
            budget_mib = spec.memory_budget_bytes / MIB
            for _, expression in self.memory_rows:
                milp.row(expression.terms, upper=budget_mib - expression.constant)

    def _start_times(self) -> None:
        """The simulator's replay as constraints: a start time for every action, after its rank's
        previous action and after the action it waits for (plus P2P between ranks)."""
        program, milp, duration = self.schedule.program, self.milp, self.action_duration
        offsets = program.rank_offsets
        start = [milp.variable() for _ in range(program.num_actions)]
        for rank in range(self.schedule.stages):
            for i in range(offsets[rank] + 1, offsets[rank + 1]):
                milp.row({start[i]: 1.0, start[i - 1]: -1.0, duration[i - 1]: -1.0}, lower=0.0)
            last = offsets[rank + 1] - 1
            milp.row({self.iteration: 1.0, start[last]: -1.0, duration[last]: -1.0}, lower=0.0)
        for i, dep in enumerate(program.dependency):
            if dep >= 0 and program.crosses_ranks[i]:
                milp.row({start[i]: 1.0, start[dep]: -1.0, duration[dep]: -1.0}, lower=self.spec.p2p_ms)

    def simulated_time(self, values: list[float], *, add_path: bool | None = None) -> float:
        """The iteration time the simulator gives the durations in `values` (fractional ones too). Its
        critical path becomes a row when `values` runs faster than it and no row holds it yet (or,
        with `add_path`, whenever no row holds it): the iteration time is at least the path's
        durations plus its P2P times."""
        terms, hops = self._critical_path(values)
        length = hops * self.spec.p2p_ms + _dot(terms, values)
        key = (tuple(sorted(terms.items())), hops)
        if add_path is None:
            add_path = length > _within(values[self.iteration])
        if add_path and key not in self.paths:
            self.paths.add(key)
            self.milp.row({self.iteration: 1.0, **{v: -c for v, c in terms.items()}}, lower=hops * self.spec.p2p_ms)
        return length

    def critical_time_per_cell(self, values: list[float]) -> list[float]:
        """Milliseconds the critical path of `values` spends on each virtual stage."""
        terms, _ = self._critical_path(values)
        return [sum(terms.get(self.duration[cell, kind], 0.0) * values[self.duration[cell, kind]] for kind in KINDS)
                for cell in range(self.schedule.num_stages)]

    def _critical_path(self, values: list[float]) -> tuple[dict[int, float], int]:
        """The simulator's critical path for the durations in `values`: how many times it runs each
        duration variable, and how many times it changes rank."""
        schedule = self.schedule
        costs = [[None] * schedule.chunks for _ in range(schedule.stages)]
        for virtual in range(schedule.num_stages):
            backward = max(values[self.duration[virtual, FULL_BACKWARD]], 0.0)
            costs[schedule.rank_of(virtual)][schedule.chunk_of(virtual)] = ChunkCosts(
                forward_ms=max(values[self.duration[virtual, FORWARD]], 0.0),
                backward_ms=backward,
                weight_ms=min(max(values[self.duration[virtual, BACKWARD_WEIGHT]], 0.0), backward),
                input_ms=max(values[self.duration[virtual, BACKWARD_INPUT]], 0.0),
            )
        chain = critical_path(schedule, PipelineCosts(tuple(map(tuple, costs)), p2p_ms=self.spec.p2p_ms))
        program = schedule.program
        terms: dict[int, float] = {}
        for action in chain:
            terms[self.action_duration[action]] = terms.get(self.action_duration[action], 0.0) + 1.0
        hops = sum(1 for before, after in zip(chain, chain[1:]) if program.rank[before] != program.rank[after])
        return terms, hops

    def fix_split(self, values: list[float]) -> None:
        """Rows holding each virtual stage's layers of each group as many as at `values`, their
        recompute modes free."""
        split: dict[tuple[int, int], dict[int, float]] = {}
        for (g, cell, _), variable in self.count.items():
            split.setdefault((g, cell), {})[variable] = 1.0
        for terms in split.values():
            layers = sum(round(values[variable]) for variable in terms)
            self.milp.row(terms, layers, layers)

    def add_paths_of_slower_stages(self, values: list[float]) -> None:
        """Add the critical path of `values` with each virtual stage in turn SLOWER_STAGE slower."""
        for cell in range(self.schedule.num_stages):
            slower = list(values)
            for kind in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                slower[self.duration[cell, kind]] *= 1 + SLOWER_STAGE
            self.simulated_time(slower, add_path=True)

    def _cell_sum(self, value) -> list[_Linear]:
        """Per virtual stage: the sum of `value(group, mode)` over the layers it holds."""
        sums = [_Linear() for _ in range(self.schedule.num_stages)]
        for group in self.groups:
            if group.pinned_cell is not None:
                sums[group.pinned_cell].constant += group.size * value(group, NONE)
        for (g, c, mode), variable in self.count.items():
            sums[c].add(variable, value(self.groups[g], mode))
        return sums

    def _last_layers(self, cells: int) -> list[tuple[_Linear, _Linear]]:
        """Per virtual stage, `plan.last_layer_bytes` of its last layer in model order, in MiB."""
        values = [last_layer_bytes(self.profile.layers[group.first]) for group in self.groups]
        last_layers = []
        for c in range(cells):
            if c == 0 and torch_splits_backward(self.spec):  # its whole backward runs at W: nothing pends
                last_layers.append((_Linear(), _Linear()))
                continue
            last_layers.append((self._at_end(c, [extra / MIB for extra, _ in values], first=False),
                                self._at_end(c, [freed / MIB for _, freed in values], first=False)))
        return last_layers

    def _at_end(self, cell: int, values: list[float], *, first: bool) -> _Linear:
        """`values[g]` of the group whose layer comes first (or last) in virtual stage `cell` in model
        order: the head (the tail) where the cell holds it; else the first (last) body group there,
        told apart by binaries where the groups' values differ (a group is first where it is present
        and the one before it is not: model order leaves no earlier one there); else the other
        pinned layer, or 0 where the cell may hold nothing."""
        pinned = [g for g, group in enumerate(self.groups) if group.pinned_cell == cell]
        at_end = [g for g in pinned if self.groups[g].kind == (HEAD if first else TAIL)]
        if at_end:
            return _Linear(constant=values[at_end[0] if first else at_end[-1]])
        fallback = values[pinned[0] if first else pinned[-1]] if pinned else 0.0
        body = [g for g, group in enumerate(self.groups) if group.pinned_cell is None]
        distinct = {values[g] for g in body}
        surely_body = not pinned and not self.spec.allow_empty_chunks
        if not body or distinct == {fallback} or (len(distinct) == 1 and surely_body):
            return _Linear(constant=next(iter(distinct)) if body and distinct != {fallback} else fallback)
        order = body[::-1] if first else body  # each group with the one it must not be followed (preceded) by
        expression = _Linear(constant=fallback)
        for g, neighbour in zip(order, order[1:] + [None]):
            expression.add(self._end_indicator(g, neighbour, cell), values[g] - fallback)
        return expression

    def _end_indicator(self, g: int, neighbour: int | None, cell: int) -> int:
        """A binary that is 1 where `cell` holds group `g` and not group `neighbour` (none: always)."""
        key = (g, neighbour, cell)
        if key not in self._end_indicators:
            indicator, present = self.milp.variable(0, 1, integer=True), self._group_present(g, cell)
            self.milp.row({indicator: 1.0, present: -1.0}, upper=0.0)
            if neighbour is None:
                self.milp.row({indicator: 1.0, present: -1.0}, lower=0.0)
                after = None
            else:
                after = self._group_present(neighbour, cell)
                self.milp.row({indicator: 1.0, after: 1.0}, upper=1.0)
                self.milp.row({indicator: 1.0, present: -1.0, after: 1.0}, lower=0.0)
            self._end_indicators[key] = indicator
            self._end_terms.append((indicator, present, after))
        return self._end_indicators[key]

    def _group_present(self, g: int, cell: int) -> int:
        """A binary that is 1 where virtual stage `cell` holds a layer of group `g`."""
        if (g, cell) not in self._group_presence:
            present = self.milp.variable(0, 1, integer=True)
            counts = {self.count[g, cell, m]: 1.0 for m in self.groups[g].modes}
            self.milp.row({**counts, present: -1.0}, lower=0.0)
            self.milp.row({**counts, present: -float(self.groups[g].size)}, upper=0.0)
            self._group_presence[g, cell] = present
        return self._group_presence[g, cell]

    def _defined(self, expression: _Linear) -> int:
        """A variable equal to `expression`."""
        variable = self.milp.variable()
        terms = {variable: 1.0}
        for index, coefficient in expression.terms.items():
            terms[index] = -coefficient
        self.milp.row(terms, expression.constant, expression.constant)
        return variable

    def _order_groups(self, cells: int) -> None:
        """Body groups keep model order: group g ends in or before the cell where group g+1 starts."""
        body = [g for g, group in enumerate(self.groups) if group.pinned_cell is None]
        for g, nxt in zip(body, body[1:]):
            crossed = [self.milp.variable(0, 1, integer=True) for _ in range(cells)]  # g+1 may sit in cell c
            for c in range(cells):
                if c + 1 < cells:
                    self.milp.row({crossed[c]: 1.0, crossed[c + 1]: -1.0}, upper=0.0)
                # Whole runs of cells, not one cell and mode at a time: g+1 sits in none of cells
                # 0..c unless crossed[c], g in none of cells c+1.. if crossed[c]. The same integer
                # plans, a far tighter relaxation: 80 random profiles of the property tests (layers
                # that all cost differently, two kinds) solve in 0.3x the time, the slowest 13 s -> 4 s.
                first_part = {self.count[nxt, d, m]: 1.0 for d in range(c + 1) for m in self.groups[nxt].modes}
                self.milp.row({**first_part, crossed[c]: -self.groups[nxt].size}, upper=0.0)
                if c + 1 < cells:
                    rest = {self.count[g, d, m]: 1.0 for d in range(c + 1, cells) for m in self.groups[g].modes}
                    self.milp.row({**rest, crossed[c]: self.groups[g].size}, upper=self.groups[g].size)

    def _rank_totals(self) -> None:
        """An integer variable for each rank's number of movable layers. Redundant for the program, but
        the branch-and-bound can branch on it: the relaxation spreads layers so that every rank holds a
        fraction more than its share, and one branch on a rank's total cuts that off where many on
        single counts would not (measured on test.json, 8 x 2 x 16 at 70000 MiB: without them
        Interleaved1F1B, ZBVZeroBubble and DualPipeV stop at 40 s with 1.7-3.4% gaps, with them they
        are proven in 2-3 s)."""
        schedule = self.schedule
        for rank in range(schedule.stages):
            cells = set(schedule.stages_of(rank))
            terms = {variable: 1.0 for (_, cell, _), variable in self.count.items() if cell in cells}
            if len(terms) > 1:
                total = self.milp.variable(0, sum(g.size for g in self.groups), integer=True)
                self.milp.row({**terms, total: -1.0}, 0.0, 0.0)

    def _mindformers_expressible(self, cells: int) -> None:
        """MindFormers counts recompute per stage as prefixes (recompute <= both <= select or comm), so
        a stage cannot hold select-only and comm-only layers at once."""
        for g, group in enumerate(self.groups):
            if group.pinned_cell is None and SELECTIVE in group.modes and COMM in group.modes:
                for c in range(cells):
                    comm_side = self.milp.variable(0, 1, integer=True)
                    self.milp.row({self.count[g, c, SELECTIVE]: 1.0, comm_side: group.size}, upper=group.size)
                    self.milp.row({self.count[g, c, COMM]: 1.0, comm_side: -group.size}, upper=0.0)

    def _working_sets(self, cells: int) -> list[dict[str, _Linear]]:
        """Per virtual stage and kind of backward action, the most its layers hold while it runs (as
        `plan.pipeline_costs` counts it). Where one backward runs the whole chunk: the largest working
        set less what the layers whose backward ran before have freed, the tail's activations, before
        any other layer's; the head's less every other layer's activations there too (a linear row in
        the counts). Where it is split: I, the tail's (its I runs first), or what the chunk's layers'
        I leave held until it ends (`input_held_mib`) plus the most any other layer's I holds above
        that; W, the most any layer's W holds, the tail's less what every other layer's W freed where
        torch's engine runs its W last. The last stage's backward (its I where split) holds the loss's
        gradient besides."""
        splits = schedule_kind(self.spec.schedule).splits_backward
        one_backward = [not splits or (c == 0 and torch_splits_backward(self.spec)) for c in range(cells)]
        freed = [0.0] * cells
        for group in self.groups:
            if group.kind == TAIL and one_backward[group.pinned_cell]:
                freed[group.pinned_cell] += group.size * group.activation_mib[NONE]
        self.working_choices: dict[int, list[WorkingChoice]] = {}  # per cell, each set after those before it
        self._presence: dict[int, int] = {}  # count variable -> a binary that is 1 where the count is not 0
        self._group_of_count = {variable: g for (g, _, _), variable in self.count.items()}
        self._body_held: dict[int, _Linear] = {}  # see _holds_body
        # the layers' own: what I forms and keeps to its end, less what the layer before each frees of
        # the gradient handed to it (each layer's own freed bytes, the last's added back: _last_layers)
        held = self._cell_sum(lambda g, m: g.kept_by_input_mib(m))
        for expression, (_, last_freed) in zip(held, self.last_layer or []):
            expression.add_expression(last_freed)
        freed_by_weights = self._cell_sum(lambda g, m: g.weight_freed_mib[m])
        tail_weight_last = torch_splits_backward(self.spec)
        handed = self.profile.stage_output_bytes / MIB
        # halves that hold what the whole backward does need no rows of their own (SAPP's files)
        halves_differ = any(g.input_working_mib != g.working_mib or g.weight_working_mib != g.working_mib
                            or any(g.input_held_mib.values()) or any(g.output_gradient_freed_mib.values())
                            or any(g.weight_freed_mib.values()) for g in self.groups)
        working = []
        for c in range(cells):
            pinned_groups = [g for g in self.groups if g.pinned_cell == c]
            if one_backward[c]:
                # the tail's backward hands the layer before it the gradient of its input, a stage
                # output's size, which that layer's working set does not count
                tail_here = any(g.kind == TAIL for g in pinned_groups)
                after_tail = freed[c] - (handed if tail_here else 0.0)
                pinned = max([g.working_mib[NONE] for g in pinned_groups if g.kind == TAIL], default=0.0)
                head = max([g.working_mib[NONE] - after_tail for g in pinned_groups if g.kind == HEAD], default=-INF)
                handed_to_head = 0.0 if tail_here else handed  # where the cell holds a body layer
                head_rows = []
                # the head's backward runs last, after every other layer here has freed
                if head + handed_to_head > pinned:
                    terms = {count: -self.groups[g].activation_mib[mode]
                             for (g, cell, mode), count in self.count.items() if cell == c}
                    # where the cell holds a body layer: the gradient handed to the head, less the
                    # tables the blocks freed (plan._working_bytes). Negative where the tables are the
                    # larger, yet never a way to a smaller peak: the micro-batch's activations, held
                    # while the head's backward runs, count the same variable with the tables' size.
                    body_coefficient = handed_to_head - self.profile.stage_shared_bytes / MIB
                    if body_coefficient:
                        terms.update({variable: body_coefficient for variable in self._holds_body(c).terms})
                    head_rows = [(head, terms)]
                whole = self._largest(c, pinned, lambda g, m, shift=after_tail: g.working_mib[m] - shift, head_rows)
                working.append(dict.fromkeys((FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT), whole))
                if splits:  # torch's first stage: its I does nothing, its W runs the whole backward
                    working[-1][BACKWARD_INPUT] = _Linear()
                continue
            # a split backward frees nothing before the head's
            whole = self._largest(c, max([g.working_mib[NONE] for g in pinned_groups], default=0.0),
                                  lambda g, m: g.working_mib[m])
            if not halves_differ:
                working.append(dict.fromkeys((FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT), whole))
                continue
            above_held = self._largest(
                c, max([0.0] + [g.input_working_mib[NONE] - g.input_held_mib[NONE] for g in pinned_groups if g.kind == HEAD]),
                lambda g, m: g.input_working_mib[m] - g.input_held_mib[m])
            above_held.add_expression(held[c])
            tails = [g.input_working_mib[NONE] for g in pinned_groups if g.kind == TAIL]
            if tails:  # the larger of the tail's and the rest's
                above_held = self._largest(c, max(tails), None, [(above_held.constant, above_held.terms)])
            tail_weights = [g.weight_working_mib[NONE] for g in pinned_groups if g.kind == TAIL]
            weight_rows = []
            if tail_weights and tail_weight_last:  # after every other layer's W has freed (plan._split_working_bytes)
                tail_freed = sum(g.size * g.weight_freed_mib[NONE] for g in pinned_groups if g.kind == TAIL)
                freed_by_others = freed_by_weights[c].constant - tail_freed  # and the terms: the body layers'
                weight_rows = [(max(tail_weights) - freed_by_others,
                                {v: -k for v, k in freed_by_weights[c].terms.items()})]
                tail_weights = []
            weight = self._largest(c, max([g.weight_working_mib[NONE] for g in pinned_groups if g.kind != TAIL]
                                          + tail_weights, default=0.0),
                                   lambda g, m: g.weight_working_mib[m], weight_rows)
            working.append({FULL_BACKWARD: whole, BACKWARD_INPUT: above_held, BACKWARD_WEIGHT: weight})
        seed = self.profile.loss_bytes / MIB  # plan.pipeline_costs: the loss's gradient, on the last stage
        if seed:  # held by its whole backward, or by its I where split (torch's first stage: none at I)
            holding = {FULL_BACKWARD} | ({BACKWARD_WEIGHT} if one_backward[-1] else {BACKWARD_INPUT})
            if not splits:
                holding.add(BACKWARD_INPUT)
            working[-1] = {kind: _Linear(dict(e.terms), e.constant + seed) if kind in holding else e
                           for kind, e in working[-1].items()}
        return working

    def _largest(self, cell: int, pinned: float, size, rows: list[tuple[float, dict[int, float]]] = ()) -> _Linear:
        """A variable at least `pinned`, at least `size(group, mode)` of every (group, mode) the cell
        holds (none where `size` is None), and at least each row (constant, terms) of `rows`, as an
        expression; a constant where nothing can raise it above `pinned`."""
        choices = [] if size is None else [
            (count, size(self.groups[g], mode)) for (g, c, mode), count in self.count.items() if c == cell]
        choices = [(count, value) for count, value in choices if value > pinned]
        rows = [(constant, terms) for constant, terms in rows if terms or constant > pinned]
        if not choices and not rows:
            return _Linear(constant=pinned)
        variable = self.milp.variable(pinned)
        self.working_choices.setdefault(cell, []).append((variable, pinned, choices, rows))
        for count, value in choices:
            self.milp.row({variable: 1.0, self._present(count): -value}, lower=0.0)
        for constant, terms in rows:
            self.milp.row({variable: 1.0, **{v: -coefficient for v, coefficient in terms.items()}}, lower=constant)
        return _Linear({variable: 1.0})

    def _holds_body(self, cell: int) -> _Linear:
        """At least 1 where virtual stage `cell` holds a body layer (a constant where nothing can be
        there); only the rows push it down."""
        if cell not in self._body_held:
            self._body_held[cell] = self._largest(cell, 0.0, lambda g, m: 1.0)
        return self._body_held[cell]

    def _present(self, count: int) -> int:
        """A variable that is 1 where the count variable `count` is not 0 (the count itself for a group
        of one layer)."""
        if count not in self._presence:
            g = self._group_of_count[count]
            present = count
            if self.groups[g].size > 1:
                present = self.milp.variable(0, 1, integer=True)
                self.milp.row({count: 1.0, present: -self.groups[g].size}, upper=0.0)
            self._presence[count] = present
        return self._presence[count]

    def _memory_rows(self) -> list[tuple[int, _Linear]]:
        """(rank, memory in MiB) at each point of each rank's action list that no other point bounds."""
        schedule = self.schedule
        program = schedule.program
        constant_mib = (self.profile.stage_constant_bytes + self.spec.stage_constant_bytes) / MIB
        retains = any(row.terms or row.constant for row in self.retained)
        pends = any(row.terms or row.constant for row in self.pending)
        past_input = [_Linear(dict(a.terms), a.constant) for a in self.activation]  # activations and pending gradients
        for expression, pending in zip(past_input, self.pending):
            expression.add_expression(pending)
        rows = []
        for rank in range(schedule.stages):
            cells = schedule.stages_of(rank)
            # per chunk, how many micro-batches are past their forward and before their backward; past
            # I and before W (apart only where something is pending there: fewer distinct points);
            # past their last backward action, B or W (only where something is retained)
            chunks = schedule.chunks
            held = [0] * (3 * chunks)
            points: set[tuple[tuple[int, ...], WorkingAt]] = set()
            for i in range(program.rank_offsets[rank], program.rank_offsets[rank + 1]):
                chunk, kind = program.chunk[i], program.kind[i]
                if kind == FORWARD:
                    held[chunk] += 1
                    points.add((tuple(held), None))
                    continue
                # the working sets of a chunk's actions, one where they are the same (a whole backward)
                same = self.working[cells[chunk]][kind] is self.working[cells[chunk]][FULL_BACKWARD]
                points.add((tuple(held), (chunk, FULL_BACKWARD if same else kind)))
                if kind == BACKWARD_INPUT:
                    if pends:
                        held[chunk] -= 1
                        held[2 * chunks + chunk] += 1
                    continue
                held[2 * chunks + chunk if kind == BACKWARD_WEIGHT and pends else chunk] -= 1
                if retains:
                    held[chunks + chunk] += 1
            # the step's end: what is retained can outweigh the activations it was part of (torch
            # keeps a stage's input gradient and its sends to the end)
            points.add((tuple(held), None))
            for counts, working in _undominated(points):
                row = _Linear(constant=constant_mib)
                for chunk, cell in enumerate(cells):
                    for part, scale in ((self.static[cell], 1), (self.activation[cell], counts[chunk]),
                                        (self.retained[cell], counts[chunks + chunk]),
                                        (past_input[cell], counts[2 * chunks + chunk])):
                        if scale:
                            row.add_expression(part, scale)
                if working is not None:
                    working_chunk, kind = working
                    row.add_expression(self.working[cells[working_chunk]][kind])
                rows.append((rank, row))
        return rows

    def point(self, counts: dict[int, int]) -> list[float]:
        """The program's variables for the layer counts `counts` (count variable -> layers): durations,
        working sets and the iteration time as simulated filled in; variables that only serve the
        search (orders, rank totals, start times) are left 0."""
        values = [0.0] * self.milp.num_variables
        for variable, number in counts.items():
            values[variable] = number
        for (g, cell), present in self._group_presence.items():
            values[present] = float(any(values[self.count[g, cell, m]] > 0.5 for m in self.groups[g].modes))
        for indicator, present, after in self._end_terms:
            values[indicator] = values[present] * (1.0 - (values[after] if after is not None else 0.0))
        for cell in self.working_choices:
            self.update_working_set(values, cell)
        for variable, expression in self.duration_expression.items():
            values[variable] = expression.value(values)
        values[self.iteration] = self.simulated_time(values, add_path=False)
        return values

    def update_working_set(self, values: list[float], cell: int) -> None:
        """Set the working-set variables of virtual stage `cell` from the layer counts in `values`."""
        for variable, least, choices, rows in self.working_choices.get(cell, []):
            sizes = [least] + [size for count, size in choices if values[count] > 0.5]
            sizes += [constant + _dot(terms, values) for constant, terms in rows]
            values[variable] = max(sizes)

    def add_peak_variable(self) -> int:
        peak = self.milp.variable()
        for _, expression in self.memory_rows:
            terms = {peak: 1.0}
            for variable, coefficient in expression.terms.items():
                terms[variable] = terms.get(variable, 0.0) - coefficient
            self.milp.row(terms, lower=expression.constant)
        return peak

    def _counts(self, values: list[float]) -> dict[tuple[int, int, str], int]:
        return {key: round(values[variable]) for key, variable in self.count.items()}

    def body_layer_counts(self, values: list[float]) -> list[int]:
        """Per virtual stage, how many layers that can move (not heads or tails) it holds."""
        counts = [0] * self.schedule.num_stages
        for (_, c, _), number in self._counts(values).items():
            counts[c] += number
        return counts

    def stage_layer_counts(self, values: list[float]) -> tuple[int, ...]:
        counts = self.body_layer_counts(values)
        for group in self.groups:
            if group.pinned_cell is not None:
                counts[group.pinned_cell] += group.size
        return tuple(counts)

    def layer_modes(self, values: list[float]) -> tuple[str, ...]:
        modes = [NONE] * len(self.profile.layers)
        counts = self._counts(values)
        for g, group in enumerate(self.groups):
            if group.pinned_cell is not None:
                continue
            position = group.first
            for c in range(self.schedule.num_stages):
                for mode in ordered_modes({m: counts[g, c, m] for m in group.modes}):
                    modes[position] = mode
                    position += 1
        return tuple(modes)


def _undominated(points: set[tuple[tuple[int, ...], WorkingAt]]) -> list[tuple[tuple[int, ...], WorkingAt]]:
    """Drop memory points another point of the rank bounds from above (more held, same working set)."""
    ordered = sorted(points, key=lambda p: (-sum(p[0]), p[0], p[1] or (-1, "")))
    kept: list[tuple[tuple[int, ...], WorkingAt]] = []
    for held, working in ordered:
        if not any(
            all(a <= b for a, b in zip(held, other)) and (working is None or working == other_working)
            for other, other_working in kept
        ):
            kept.append((held, working))
    return kept


def _infeasible(
    profile: ModelProfile, spec: PipelineSpec, schedule: Schedule, groups: list[_Group], deadline: float
) -> InfeasibleError:
    """The least peak memory any plan reaches, which stage holds it, and what to try."""
    model = _Formulation(profile, spec, schedule, groups, with_budget=False, timing=PATHS)  # time is free here
    peak = model.add_peak_variable()
    result: MilpResult = model.milp.minimize({peak: 1.0}, time_limit_s=_left(deadline))
    budget = format_bytes(spec.memory_budget_bytes)
    if result.values is None:
        return InfeasibleError(
            f"no plan fits {budget}, and none was found without the budget either in the time left",
            smallest_budget_bytes=None,
            binding_stage=None,
        )
    # The least-peak plan, simulated: its peak is a budget that surely fits.
    least = _plan_of(model, result.values)
    smallest = max(least.stage_peak_memory_bytes)
    stage = least.stage_peak_memory_bytes.index(smallest)
    tries = ["more stages"]
    if "full" not in profile.modes:
        tries.append("a profile with full recompute")
    if spec.data_parallel > 1 and spec.zero_stage < 3:
        tries.append(f"ZeRO stage {spec.zero_stage + 1}")
    elif spec.data_parallel == 1:
        tries.append("data-parallel sharding of optimizer state (ZeRO)")
    if schedule.name in ("GPipe", "Interleaved1F1B", "ZBH1"):
        tries.append("a schedule that holds fewer activations (1F1B, Interleaved1F1B-less-memory)")
    if result.status != "optimal":  # only a lower bound is proven; the plan found still fits
        smallest = max(result.bound * MIB, spec.memory_budget_bytes)
    exact = "" if result.status == "optimal" else "at least "
    return InfeasibleError(
        f"no plan fits {budget}: the smallest budget that fits is {exact}{format_bytes(smallest)} "
        f"({smallest:,.0f} bytes), where stage {stage} peaks; try a larger budget, " + ", ".join(tries),
        smallest_budget_bytes=smallest,
        binding_stage=stage,
    )
