"""The integer program: layer counts per (group, virtual stage, mode), each virtual stage's action
durations, the iteration time as the simulator's replay makes it, and memory within the budget at
every point of every rank's action list. Its optimum is the simulated optimum.

The iteration time is stated one of two ways (`timing`). START_TIMES: every action's start as a
variable, the simulator's replay as rows. PATHS: one row per critical path met so far (the time is
at least each path's length), adding the path of any solution the rows let run faster than the
simulator does, and with it the paths of that solution with each virtual stage in turn SLOWER_STAGE
slower, which is where the integer plans near it differ.
"""

from __future__ import annotations

import itertools
import time

from basics.units import MIB
from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OPS
from simulator.costs import ChunkCosts, PipelineCosts
from simulator.replay import critical_path
from simulator.schedule import Schedule
from solver.engine_memory import torch_splits_backward
from solver.evaluate import evaluate_plan
from solver.program.groups import LayerGroup
from solver.program.memory_rows import memory_rows, stage_memory
from solver.program.milp import INF, Linear, dot, within
from solver.program.placement import LayerPlacement
from solver.vocabulary.plan import Plan
from solver.vocabulary.profile import ModelProfile
from solver.vocabulary.spec import PipelineSpec

# PATHS where one chunk per rank leaves few critical paths; with more chunks, solutions keep finding paths the rows miss.
START_TIMES, PATHS = "start-times", "paths"
SLOWER_STAGE = 0.1  # the paths of a solution's slower-stage neighbours are the ones the next solutions run along


class IntegerProgram(LayerPlacement):
    """The program: layer counts per (group, virtual stage, mode), durations, the iteration time, memory."""

    def __init__(
        self,
        profile: ModelProfile,
        spec: PipelineSpec,
        schedule: Schedule,
        groups: list[LayerGroup],
        *,
        with_budget: bool,
        timing: str,
    ) -> None:
        super().__init__(profile, spec, schedule, groups)
        self.timing = timing
        milp, num_virtual_stages = self.milp, schedule.num_virtual_stages
        self.memory = stage_memory(self)
        forward, backward, weight, input_grad = (
            self.virtual_stage_sums(f)
            for f in (
                lambda g, m: g.forward_ms,
                lambda g, m: g.backward_ms + g.extra_ms[m],
                lambda g, m: g.weight_ms,
                lambda g, m: g.input_ms + g.extra_ms[m],
            )
        )
        if torch_splits_backward(spec):  # stage 0's W runs its whole backward, as costs.pipeline_costs states it
            weight[0] = self.virtual_stage_sums(lambda g, m: g.backward_ms)[0]
            input_grad[0] = self.virtual_stage_sums(lambda g, m: g.extra_ms[m])[0]
        forward_overhead, backward_overhead, weight_overhead = spec.action_overheads_ms()
        for sums, overhead in (
            (forward, forward_overhead),
            (backward, backward_overhead),
            (weight, weight_overhead),
            (input_grad, backward_overhead - weight_overhead),
        ):
            for expression in sums:
                expression.constant += overhead
        self.recompute_terms: dict[int, float] = {}
        for (g, _, mode), variable in self.count.items():
            if groups[g].extra_ms[mode]:
                self.recompute_terms[variable] = groups[g].extra_ms[mode]

        # Durations of each op (F, B, I, W) on each virtual stage, as variables.
        self.duration: dict[tuple[int, str], int] = {}
        self.duration_expression: dict[int, Linear] = {}  # duration variable -> its value in layer counts
        for c in range(num_virtual_stages):
            for op, expression in (
                (FORWARD, forward[c]),
                (FULL_BACKWARD, backward[c]),
                (BACKWARD_INPUT, input_grad[c]),
                (BACKWARD_WEIGHT, weight[c]),
            ):
                self.duration[c, op] = self._defined(expression)
                self.duration_expression[self.duration[c, op]] = expression
        compiled = schedule.compiled
        self.action_duration = [
            self.duration[schedule.stage_index(rank, chunk), op]
            for rank, chunk, op in zip(compiled.rank, compiled.chunk, compiled.op)
        ]
        self.iteration = milp.variable()
        self.time_cap = INF  # the most iteration time a solution may take (set by the tie-breaks)
        self.paths: set[tuple] = set()
        if timing == START_TIMES:
            self._start_times()
        self.memory_rows = memory_rows(self, self.memory)
        if with_budget and spec.memory_budget_bytes < INF:
            budget_mib = spec.memory_budget_bytes / MIB
            for _, expression in self.memory_rows:
                milp.row(expression.terms, upper=budget_mib - expression.constant)

    def _start_times(self) -> None:
        """The simulator's replay as constraints: a start time for every action, after its rank's
        previous action and after the action it waits for (plus P2P between ranks)."""
        compiled, milp, duration = self.schedule.compiled, self.milp, self.action_duration
        offsets = compiled.rank_offsets
        start = [milp.variable() for _ in range(compiled.num_actions)]
        for rank in range(self.schedule.ranks):
            for i in range(offsets[rank] + 1, offsets[rank + 1]):
                milp.row({start[i]: 1.0, start[i - 1]: -1.0, duration[i - 1]: -1.0}, lower=0.0)
            last = offsets[rank + 1] - 1
            milp.row({self.iteration: 1.0, start[last]: -1.0, duration[last]: -1.0}, lower=0.0)
        for i, dep in enumerate(compiled.dependency):
            if dep >= 0 and compiled.crosses_ranks[i]:
                milp.row({start[i]: 1.0, start[dep]: -1.0, duration[dep]: -1.0}, lower=self.spec.p2p_ms)

    def simulated_time(self, values: list[float], *, add_path: bool | None = None) -> float:
        """The iteration time the simulator gives the durations in `values` (fractional ones too). Its
        critical path becomes a row when `values` runs faster than it and no row holds it yet (or,
        with `add_path`, whenever no row holds it): the iteration time is at least the path's
        durations plus its P2P times."""
        terms, hops = self._critical_path(values)
        length = hops * self.spec.p2p_ms + dot(terms, values)
        key = (tuple(sorted(terms.items())), hops)
        if add_path is None:
            add_path = length > within(values[self.iteration])
        if add_path and key not in self.paths:
            self.paths.add(key)
            self.milp.row({self.iteration: 1.0, **{v: -c for v, c in terms.items()}}, lower=hops * self.spec.p2p_ms)
        return length

    def critical_ms_per_virtual_stage(self, values: list[float]) -> list[float]:
        """Milliseconds the critical path of `values` spends on each virtual stage."""
        terms, _ = self._critical_path(values)
        return [
            sum(terms.get(self.duration[virtual, op], 0.0) * values[self.duration[virtual, op]] for op in OPS)
            for virtual in range(self.schedule.num_virtual_stages)
        ]

    def _critical_path(self, values: list[float]) -> tuple[dict[int, float], int]:
        """The simulator's critical path for the durations in `values`: how many times it runs each
        duration variable, and how many times it changes rank."""
        schedule = self.schedule
        costs = [[None] * schedule.chunks for _ in range(schedule.ranks)]
        for virtual in range(schedule.num_virtual_stages):
            backward = max(values[self.duration[virtual, FULL_BACKWARD]], 0.0)
            costs[schedule.rank_of(virtual)][schedule.chunk_of(virtual)] = ChunkCosts(
                forward_ms=max(values[self.duration[virtual, FORWARD]], 0.0),
                backward_ms=backward,
                weight_ms=min(max(values[self.duration[virtual, BACKWARD_WEIGHT]], 0.0), backward),
                input_ms=max(values[self.duration[virtual, BACKWARD_INPUT]], 0.0),
            )
        chain = critical_path(schedule, PipelineCosts(tuple(map(tuple, costs)), p2p_ms=self.spec.p2p_ms))
        compiled = schedule.compiled
        terms: dict[int, float] = {}
        for action in chain:
            terms[self.action_duration[action]] = terms.get(self.action_duration[action], 0.0) + 1.0
        hops = sum(1 for before, after in itertools.pairwise(chain) if compiled.rank[before] != compiled.rank[after])
        return terms, hops

    def add_paths_of_slower_stages(self, values: list[float], deadline: float = INF) -> None:
        """Add the critical path of `values` with each virtual stage in turn SLOWER_STAGE slower, until
        `deadline` (a time.perf_counter() value): each is a replay, and there are as many as virtual stages."""
        for virtual in range(self.schedule.num_virtual_stages):
            if time.perf_counter() >= deadline:
                return
            slower = list(values)
            for op in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                slower[self.duration[virtual, op]] *= 1 + SLOWER_STAGE
            self.simulated_time(slower, add_path=True)

    def _defined(self, expression: Linear) -> int:
        """A variable equal to `expression`."""
        variable = self.milp.variable()
        terms = {variable: 1.0}
        for index, coefficient in expression.terms.items():
            terms[index] = -coefficient
        self.milp.row(terms, expression.constant, expression.constant)
        return variable

    def point(self, counts: dict[int, int]) -> list[float]:
        """The program's variables for the layer counts `counts` (count variable -> layers): durations,
        working sets and the iteration time as simulated filled in; variables that only serve the
        search (orders, rank totals, start times) are left 0."""
        values = [0.0] * self.milp.num_variables
        for variable, number in counts.items():
            values[variable] = number
        self.set_indicators(values)
        for variable, expression in self.duration_expression.items():
            values[variable] = expression.value(values)
        values[self.iteration] = self.simulated_time(values, add_path=False)
        return values

    def add_peak_variable(self) -> int:
        """A variable at least every memory row: the peak over every rank."""
        peak = self.milp.variable()
        for _, expression in self.memory_rows:
            terms = {peak: 1.0}
            for variable, coefficient in expression.terms.items():
                terms[variable] = terms.get(variable, 0.0) - coefficient
            self.milp.row(terms, lower=expression.constant)
        return peak

    def plan(self, values: list[float]) -> Plan:
        """The plan at `values`, simulated."""
        return evaluate_plan(self.profile, self.spec, self.stage_layer_counts(values), self.layer_modes(values))
