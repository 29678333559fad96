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

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from basics.errors import MAX_MS, InputError, check_instance, check_seconds
from basics.units import format_ms
from simulator.schedule import Schedule
from solver.evaluate import evaluate_plan
from solver.parallel.model_parallel import rank_profile
from solver.program.formulation import PATHS, START_TIMES, IntegerProgram
from solver.program.groups import LayerGroup, check_room, layer_groups
from solver.program.infeasible import infeasible_error
from solver.program.milp import INF, MilpResult, dot, within
from solver.program.size import check_time_limit
from solver.program.start import balanced_plan, improved_by_moves
from solver.vocabulary.plan import Plan
from solver.vocabulary.profile import ModelProfile
from solver.vocabulary.spec import PipelineSpec

log = logging.getLogger("solver")
TIME_SLACK = 1e-7  # relative: later solves keep the iteration time within this of the best
BOUND_LIMIT_S = 5.0  # the most a stopped search spends past its limit on a bound of its own
REPLAY_SECONDS_PER_ACTION = 10e-6  # two replays of a plan, measured at 0.4-0.6 M actions
BOUND_SHARE, BOUND_LEAST_S = 0.1, 0.5  # of the limit, or at least this, within BOUND_LIMIT_S
# Nodes per tie-break (a count, unlike a time, is deterministic): proving a min-max peak can take minutes.
TIE_BREAK_NODES = {START_TIMES: 200, PATHS: 50}
POLISH_SHARE = 0.1  # of a start-times limit, to choose a stopped search's recompute again (far faster)
# HiGHS holds rows to ~1e-6 ms and fails near 1e7 ms: a median layer outside this range is searched rescaled.
LEAST_SEARCH_MS, MOST_SEARCH_MS = 1.0, 1e4


OnInterrupt = str | Callable[[Plan], object]
ON_INTERRUPT = ("raise", "best")


def solve(
    profile: ModelProfile, spec: PipelineSpec, *, time_limit_s: float = 60.0, on_interrupt: OnInterrupt = "raise"
) -> Plan:
    """The fastest plan that fits `spec.memory_budget_bytes`; raises InfeasibleError when none fits.

    Searches every layer split over the virtual stages and every layer's recompute mode for the least
    simulated iteration time with each rank's simulated peak within the budget (the module doc), for
    one rank of the spec's mesh. Deterministic unless the time limit stops a search.

    Args:
        profile: every layer's costs (`load_profile`, `LayerProfiler.profile()`, `analytic_profile`).
        spec: how the job runs, the memory budget included.
        time_limit_s: seconds the search may take (default 60; inf: no limit); stopped by it, the search
            returns the best plan it found.
        on_interrupt: what happens when an exception that is not an `Exception` (KeyboardInterrupt on
            Ctrl-C, what a SIGTERM handler raises) stops the search, which it does at once: "raise"
            (default), the exception propagates unchanged; "best", the fastest plan found so far that
            fits is returned, status "interrupted" with its gap; a function, called with that plan
            before the exception propagates. Where no plan that fits is known yet, the exception
            propagates whatever `on_interrupt` says.

    Returns:
        The `Plan`, simulated: status "optimal" when the search proved it, "feasible" with the proven
        gap when the time limit stopped it (the fastest plan found that fits, the balanced split's at
        least where that fits), "interrupted" as above. Ties are broken by least recompute time, then
        least peak memory.

    Raises:
        InfeasibleError: no plan fits the budget; it says the smallest budget that would
            (`smallest_budget_bytes`), the rank that peaks there (`binding_rank`) and what to try.
        InputError: `profile` or `spec` of the wrong type, a `time_limit_s` that is not a number of
            seconds > 0 (inf: no limit), an unknown `on_interrupt`, a mesh the profile cannot be
            divided for, too few body layers to fill every virtual stage (naming `pipeline_parallel`;
            unless `spec.allow_empty_chunks`), a schedule with more actions than can be built and
            replayed within `time_limit_s` (naming the largest of `micro_batches`, `ranks`, `chunks`,
            before anything is built), or no plan found within `time_limit_s` (naming it).

    Example:
        >>> from solver import LayerProfile, ModelProfile, PipelineSpec, RecomputeCost
        >>> MiB = 2**20
        >>> def layer(index, kind):  # 8 MiB kept per micro-batch, 1 MiB under full recompute (+2 ms)
        ...     modes = {"none": RecomputeCost(extra_ms=0.0, activation_bytes=8 * MiB)}
        ...     if kind == "body:block":
        ...         modes["full"] = RecomputeCost(extra_ms=2.0, activation_bytes=1 * MiB, working_bytes=8 * MiB)
        ...     return LayerProfile(f"layer{index}", kind, 2.0, 4.0, modes, parameter_bytes=10 * MiB)
        >>> profile = ModelProfile(tuple(layer(i, k) for i, k in enumerate(["head", *["body:block"] * 6, "tail"])))
        >>> plan = solve(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4, memory_budget_bytes=80 * MiB))
        >>> plan.status, plan.stage_layer_counts, plan.layer_modes.count("full"), plan.iteration_time_ms
        ('optimal', (4, 4), 2, 132.0)
        >>> [peak / MiB for peak in plan.rank_peak_memory_bytes]
        [76.0, 72.0]
        >>> from solver import InfeasibleError
        >>> try:
        ...     solve(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4, memory_budget_bytes=60 * MiB))
        ... except InfeasibleError as error:
        ...     print(error.smallest_budget_bytes / MiB, error.binding_rank)
        62.0 1
    """
    check_instance(profile, ModelProfile, "profile", "a ModelProfile (solver.load_profile)")
    check_instance(spec, PipelineSpec, "spec", "a PipelineSpec")
    check_seconds(time_limit_s, "time_limit_s")
    if not callable(on_interrupt) and on_interrupt not in ON_INTERRUPT:
        raise InputError(
            "on_interrupt", f"expected one of {', '.join(ON_INTERRUPT)} or a function, got {on_interrupt!r}"
        )
    schedule = spec.pipeline_schedule
    check_time_limit(schedule.name, schedule.ranks, schedule.chunks, schedule.micro_batches, time_limit_s)
    profile = rank_profile(profile, spec)  # one rank of the spec's mesh from here on
    scale = _search_time_scale(profile, spec)
    if scale != 1.0:
        log.info(
            "searching with every time x %g (the median layer's forward and backward take %s ms)",
            scale,
            format_ms(_median_layer_ms(profile)),
        )
        scaled_spec = dataclasses.replace(
            spec, p2p_ms=spec.p2p_ms * scale, action_overhead_ms=spec.action_overhead_ms * scale
        )

        def unscaled(found: Plan) -> Plan:
            plan = evaluate_plan(profile, spec, found.stage_layer_counts, found.layer_modes)
            proven = found.status == "optimal"
            lower_bound = (
                plan.iteration_time_ms if proven else min(found.lower_bound_ms / scale, plan.iteration_time_ms)
            )
            return plan.with_search(
                status=found.status, gap=found.gap, lower_bound_ms=lower_bound, solve_seconds=found.solve_seconds
            )

        inner = on_interrupt if not callable(on_interrupt) else (lambda found: on_interrupt(unscaled(found)))
        return unscaled(
            solve(profile.with_times_scaled(scale), scaled_spec, time_limit_s=time_limit_s, on_interrupt=inner)
        )
    found = _Found(time.perf_counter())
    try:
        return _search(profile, spec, time_limit_s, found)
    except BaseException as stop:
        if isinstance(stop, Exception) or on_interrupt == "raise":
            raise
        plan = found.best_plan(profile, spec)
        if plan is None:
            raise
        log.info(
            "interrupted: the best plan so far runs %s ms (within %.1f%% of the best possible)",
            format_ms(plan.iteration_time_ms),
            100 * plan.gap,
        )
        if on_interrupt == "best":
            return plan
        on_interrupt(plan)
        raise


@dataclass
class _Found:
    """What a search has found so far, for an interrupted one to return the best of."""

    started: float
    program: IntegerProgram | None = None
    plans: list[list[float]] = field(default_factory=list)  # the program's points of plans that fit
    bound_ms: float = -INF  # proven lower bound on the iteration time
    searching_fastest: bool = False  # an interrupted solve's bound is one on the iteration time

    def add(self, values: list[float] | None) -> None:
        if values is not None:
            self.plans.append(values)

    def best_plan(self, profile: ModelProfile, spec: PipelineSpec) -> Plan | None:
        """The fastest plan found that fits, status "interrupted" with its gap; None for none."""
        program = self.program
        if program is None:
            return None
        stopped = program.milp.interrupted
        bound = self.bound_ms
        if stopped is not None:
            self.add(stopped.values)
            if self.searching_fastest and math.isfinite(stopped.bound):
                bound = max(bound, stopped.bound)
        fitting = [plan for plan in map(program.plan, self.plans) if plan.fits]
        if not fitting:
            return None
        plan = min(fitting, key=lambda candidate: candidate.iteration_time_ms)
        lower_bound = min(max(bound, _average_work_bound_ms(profile, spec)), plan.iteration_time_ms)
        return plan.with_search(
            status="interrupted",
            gap=(plan.iteration_time_ms - lower_bound) / plan.iteration_time_ms,
            lower_bound_ms=lower_bound,
            solve_seconds=time.perf_counter() - self.started,
        )


def _average_work_bound_ms(profile: ModelProfile, spec: PipelineSpec) -> float:
    """A lower bound on any plan's iteration time that costs nothing: every layer's forward and
    backward without recompute over every micro-batch, shared evenly by the ranks."""
    work = sum(
        layer.forward_ms + min(layer.backward_ms, layer.split_input_ms() + layer.split_weight_ms())
        for layer in profile.layers
    )
    return work * spec.micro_batches / spec.pipeline_schedule.ranks


def _search(profile: ModelProfile, spec: PipelineSpec, time_limit_s: float, found: _Found) -> Plan:
    """`solve` at the profile's own times, recording in `found` what it finds as it goes."""
    started = found.started
    schedule = spec.pipeline_schedule
    # the plan's replay after the search, and the caller's of the even split, are in the limit too
    deadline = started + max(time_limit_s - REPLAY_SECONDS_PER_ACTION * schedule.num_actions, 0.0)
    groups = layer_groups(profile, spec, schedule.num_virtual_stages)
    check_room(schedule, groups, spec)
    log.info("solving %s, %d layers (%d actions)", schedule.describe(), len(profile.layers), schedule.num_actions)

    program = found.program = IntegerProgram(
        profile, spec, schedule, groups, with_budget=True, timing=_timing_for(schedule)
    )
    built_s = time.perf_counter() - started
    # first, so it cannot overrun: what a stopped search falls back on (the first LP alone can take minutes)
    balanced = balanced_plan(program, move_layers=False)
    fallback = balanced if balanced is not None else balanced_plan(program, move_layers=True)
    found.add(fallback)
    if program.timing == PATHS:
        _paths_of_relaxation(program, deadline)
    if fallback is not None and program.timing == START_TIMES:
        fallback = improved_by_moves(program, fallback, started + time_limit_s / 2)  # start-time searches stop often
        found.add(fallback)
    # started from the balanced split, critical-path searches skip HiGHS's root heuristics (a moved split starts too far off)
    seeded = program.timing == PATHS and balanced is not None
    if seeded and time.perf_counter() < deadline:
        # the start's own paths, so that its first solve misses none
        program.simulated_time(balanced, add_path=True)
        program.add_paths_of_slower_stages(balanced, deadline)
    # start-time searches keep a share of the limit for `_polished`; one proven in time leaves it to the tie-breaks
    search_deadline = deadline - POLISH_SHARE * time_limit_s if program.timing == START_TIMES else deadline
    found.searching_fastest = True
    if fallback is not None and time.perf_counter() >= search_deadline:
        # HiGHS takes seconds on a large program before it first checks its clock
        log.info("no time left to search: building the program and the plan without search took the limit")
        fastest = MilpResult("stopped", None, None, -INF, 0)
    else:
        fastest = _minimize(
            program,
            {program.iteration: 1.0},
            search_deadline,
            progress=_log_progress,
            heuristics=not seeded,
            hint={variable: balanced[variable] for variable in program.count.values()} if seeded else None,
        )
    found.searching_fastest = False
    found.add(fastest.values)
    if math.isfinite(fastest.bound):
        found.bound_ms = fastest.objective if fastest.status == "optimal" else fastest.bound
    log.info("fastest plan: %s after %d nodes (%.2f s)", fastest.status, fastest.nodes, time.perf_counter() - started)
    if fastest.status == "infeasible":
        raise infeasible_error(profile, spec, schedule, groups, _left(deadline))
    proven = fastest.status == "optimal"
    best = _break_ties(program, fastest, deadline) if proven else fastest
    values = best.values
    found.add(values)
    plan = None if values is None else program.plan(values)
    if not proven and fallback is not None:
        fallback_plan = program.plan(fallback)
        if fallback_plan.fits and (plan is None or fallback_plan.iteration_time_ms < plan.iteration_time_ms):
            log.info(
                "the search's best plan is %s; the plan found without search runs %s ms and fits: taking it",
                "none" if plan is None else f"{format_ms(plan.iteration_time_ms)} ms",
                format_ms(fallback_plan.iteration_time_ms),
            )
            values, plan = fallback, fallback_plan
    if not proven and plan is not None and program.timing == START_TIMES and time.perf_counter() < deadline:
        polished = _polished(program, values, deadline)
        found.add(polished)
        if polished is not None:
            polished_plan = program.plan(polished)
            if polished_plan.fits and polished_plan.iteration_time_ms < plan.iteration_time_ms:
                log.info("its split with the recompute chosen again: %s ms", format_ms(polished_plan.iteration_time_ms))
                plan = polished_plan
    if plan is None:
        raise InputError("time_limit_s", f"no plan found within {time_limit_s:g} s; allow more time")

    if proven:
        # HiGHS holds each row to ~1e-6: a chain of n actions may drift n x 1e-6 ms from the simulator
        drift = 1e-6 * schedule.num_actions
        fastest_allowed = fastest.objective - 1e-6 * max(fastest.objective, 1.0) - drift
        slowest_allowed = within(program.time_cap) + drift  # the tie-breaks' plan may run TIME_SLACK slower
        if not fastest_allowed <= plan.iteration_time_ms <= slowest_allowed:
            raise RuntimeError(
                f"the program's optimum is {fastest.objective} ms but the simulator replays its plan in "
                f"{plan.iteration_time_ms} ms: the formulation and the simulator disagree"
            )
        lower_bound = plan.iteration_time_ms
    else:  # HiGHS's bound is -inf or nan before its first LP is solved (large schedules)
        searched_bound = fastest.bound if math.isfinite(fastest.bound) else -INF
        # its program costs what this one did to build: past a small share of the limit, the bound that costs nothing
        allowance = min(BOUND_LIMIT_S, max(BOUND_LEAST_S, BOUND_SHARE * time_limit_s))
        busiest = _busiest_rank_bound_ms(profile, spec, schedule, groups, allowance) if built_s <= allowance else 0.0
        busiest = max(busiest, _average_work_bound_ms(profile, spec))  # the LP may not solve in time
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
    largest = max(
        spec.p2p_ms,
        spec.action_overhead_ms
        + sum(
            layer.forward_ms + layer.backward_ms + max(c.extra_ms for c in layer.recompute.values())
            for layer in profile.layers
        ),
    )
    exponent = math.ceil(math.log10(LEAST_SEARCH_MS / median))
    while exponent > 0 and largest * 10.0**exponent > MAX_MS:
        exponent -= 1
    return 10.0**exponent


def _median_layer_ms(profile: ModelProfile) -> float:
    loads = sorted(layer.forward_ms + layer.backward_ms for layer in profile.layers if layer.is_body)
    return loads[len(loads) // 2]


def _polished(program: IntegerProgram, values: list[float], deadline: float) -> list[float] | None:
    """The fastest plan the program finds by `deadline` with the layer split of the plan at `values`
    (each virtual stage's layers of each group fixed), its recompute free; None if none is found.
    Adds those rows to `program` for good."""
    program.fix_split(values)
    # Started from the plan itself (its counts as a partial start: HiGHS fills in the start times).
    counts = {variable: round(values[variable]) for variable in program.count.values()}
    return _minimize(program, {program.iteration: 1.0}, deadline, hint=counts).values


def _busiest_rank_bound_ms(
    profile: ModelProfile,
    spec: PipelineSpec,
    schedule: Schedule,
    groups: list[LayerGroup],
    time_limit_s: float = BOUND_LIMIT_S,
) -> float:
    """A lower bound on any plan's iteration time, for a search stopped before it had a good one:
    the busiest rank's work (every action it runs) at the optimum of the LP relaxation of the
    program without its time rows, memory rows kept (so recompute the budget forces counts).
    Milliseconds; 0 if that LP does not solve within `time_limit_s`."""
    program = IntegerProgram(profile, spec, schedule, groups, with_budget=True, timing=PATHS)  # no path rows yet
    busiest = program.milp.variable()
    compiled = schedule.compiled
    for rank in range(schedule.ranks):
        work = {busiest: 1.0}  # every action the rank runs (split backwards may take longer than whole ones)
        for action in range(compiled.rank_offsets[rank], compiled.rank_offsets[rank + 1]):
            variable = program.action_duration[action]
            work[variable] = work.get(variable, 0.0) - 1.0
        program.milp.row(work, lower=0.0)
    relaxed = program.milp.minimize({busiest: 1.0}, time_limit_s=time_limit_s, relaxed=True)
    return relaxed.objective if relaxed.status == "optimal" else 0.0


def _break_ties(program: IntegerProgram, fastest: MilpResult, deadline: float) -> MilpResult:
    """Among plans as fast as the fastest: least recompute time (unless it has none) for the fastest
    plan's layer split, then least peak memory over every split. Each solve gets part of the time left
    and at most TIE_BREAK_NODES[program.timing] branch-and-bound nodes; one cut short keeps the best plan
    it found. They start from the plan in hand, with HiGHS's root heuristics, which look for a first
    plan, skipped."""
    best = fastest
    program.time_cap = fastest.objective * (1 + TIME_SLACK)
    program.milp.row({program.iteration: 1.0}, upper=program.time_cap)
    if any(round(fastest.values[v]) for v in program.recompute_terms):  # else none to take away
        # the fastest plan's split fixed: a far easier program, the same least recompute (the peak keeps every split)
        first = program.milp.num_rows
        program.fix_split(fastest.values)
        split_rows = range(first, program.milp.num_rows)  # critical paths met in this solve come after them
        least_recompute = _minimize(
            program,
            program.recompute_terms,
            deadline,
            share=0.5,
            hint=fastest.values,
            heuristics=False,
            node_limit=TIE_BREAK_NODES[program.timing],
        )
        program.milp.remove_rows(split_rows)
        if least_recompute.values is None:
            return best
        _log_tie_break("least recompute time", least_recompute)
        best = least_recompute
    recompute = dot(program.recompute_terms, best.values)
    if program.recompute_terms:
        program.milp.row(program.recompute_terms, upper=recompute * (1 + TIME_SLACK) + 1e-9)
    peak = program.add_peak_variable()
    hint = [*best.values, max(row.value(best.values) for _, row in program.memory_rows)]
    least_memory = _minimize(
        program, {peak: 1.0}, deadline, hint=hint, heuristics=False, node_limit=TIE_BREAK_NODES[program.timing]
    )
    if least_memory.values is not None:
        _log_tie_break("least peak memory", least_memory)
        best = least_memory
    return best


def _log_tie_break(preference: str, result: MilpResult) -> None:

    if result.status == "optimal":
        log.info("tie-break on %s: proven after %d nodes", preference, result.nodes)
    else:
        log.info(
            "tie-break on %s: best found in %d nodes (proven >= %.6g, found %.6g)",
            preference,
            result.nodes,
            result.bound,
            result.objective,
        )


def _timing_for(schedule: Schedule) -> str:
    return PATHS if schedule.chunks == 1 else START_TIMES


def _minimize(
    program: IntegerProgram,
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
        result = program.milp.minimize(
            objective,
            time_limit_s=_left(stop),
            hint=hint,
            heuristics=heuristics,
            progress=progress,
            incumbents=incumbents if program.timing == PATHS else None,
            node_limit=None if node_limit is None else max(node_limit - nodes, 1),
        )
        nodes += result.nodes
        if program.timing != PATHS or result.values is None:
            break
        known = len(program.paths)
        values = list(result.values)
        values[program.iteration] = program.simulated_time(values)
        value = dot(objective, values)
        holds = values[program.iteration] <= within(program.time_cap)
        if holds and value <= within(result.objective):
            result = MilpResult(result.status, values, value, result.bound, nodes)
            break
        if len(program.paths) == known:  # the solution's own path was a row, yet it runs faster: a bug
            raise RuntimeError(
                f"the program's plan takes {result.values[program.iteration]} ms, but the simulator replays it in "
                f"{values[program.iteration]} ms along a path the program already holds: they disagree"
            )
        program.add_paths_of_slower_stages(values)
        # Every solution found on the way is a plan: keep the best of them as simulated.
        candidates = [values]
        for incumbent in incumbents:  # their paths, too, are likely to bind in the next solve
            candidates.append(list(incumbent))
            candidates[-1][program.iteration] = program.simulated_time(incumbent)
        for candidate in candidates:
            value = dot(objective, candidate)
            if candidate[program.iteration] <= within(program.time_cap) and value < best_value:
                best, best_value = candidate, value
        log.info(
            "the plan found runs %.6g ms when simulated; %d critical paths known, solving again",
            values[program.iteration],
            len(program.paths),
        )
        if best is not None:
            hint = best
        if stop - time.perf_counter() < 0.05 or (node_limit is not None and nodes >= node_limit):
            return MilpResult("stopped", best, best_value if best is not None else None, result.bound, nodes)
    if result.values is None and best is not None:
        return MilpResult("stopped", best, best_value, result.bound, nodes)
    return MilpResult(result.status, result.values, result.objective, result.bound, nodes)


def _paths_of_relaxation(program: IntegerProgram, deadline: float) -> None:
    """Seed PATHS timing with the critical paths of the relaxation's solutions: the integer search
    then starts from the relaxation's true bound, and rarely meets a path it has not seen."""
    while time.perf_counter() < deadline:
        relaxed = program.milp.minimize({program.iteration: 1.0}, time_limit_s=_left(deadline), relaxed=True)
        if relaxed.values is None:
            return  # infeasible: the integer search says so
        known = len(program.paths)
        program.simulated_time(relaxed.values)
        if len(program.paths) == known:
            program.add_paths_of_slower_stages(relaxed.values)
            break
    log.info("%d critical paths from the relaxation", len(program.paths))


def _log_progress(seconds: float, best_ms: float, bound_ms: float) -> None:
    if math.isfinite(best_ms):
        log.info(
            "searching: best %.6g ms, proven >= %.6g ms (gap %.1f%%), %.0f s",
            best_ms,
            bound_ms,
            100 * (best_ms - bound_ms) / best_ms,
            seconds,
        )
    else:
        log.info("searching: no plan yet, proven >= %.6g ms, %.0f s", bound_ms, seconds)


def _left(deadline: float) -> float:
    return max(deadline - time.perf_counter(), 0.05)
