"""Plans found without search: the balanced split, made to fit the budget, and its improvement by
moving one layer at a time. The search starts from them and falls back on them when stopped."""

from __future__ import annotations

import logging
import time

import numpy as np

from basics.units import MIB, format_bytes, format_ms
from solver.program.formulation import IntegerProgram
from solver.program.milp import INF, Linear
from solver.vocabulary.profile import COMM, SELECTIVE

log = logging.getLogger("solver")
Key = tuple[int, int, str]  # (group, virtual stage, mode)


def balanced_plan(program: IntegerProgram, *, move_layers: bool) -> list[float] | None:
    """A plan that fits, found without search. Body layers split into virtual stages of near-equal
    forward + backward time (`balanced_virtual_stage_sizes`), each layer in its quickest mode; then, rank by
    rank while one is over the budget, the mode switch that frees the most memory per millisecond it
    adds, or (with `move_layers`) once no switch frees any, the layer at one end of its stages moved
    to the neighbouring stage of another rank that still fits with it; then on each rank the
    recompute those switches made needless is taken back (`_Fitting.reclaim`). The program's point
    for that plan, or None when a rank cannot be made to fit this way."""
    fitting = _Fitting(program, balanced_virtual_stage_sizes(program), _RankMemory(program))
    if fitting.fit(set(range(program.schedule.ranks)), move_layers=move_layers):
        return fitting.point()
    log.debug(
        "the balanced split%s cannot be made to fit %s",
        " with layers moved" if move_layers else "",
        format_bytes(program.spec.memory_budget_bytes),
    )
    return None


def improved_by_moves(program: IntegerProgram, values: list[float], deadline: float = INF) -> list[float]:
    """From the plan at `values`, move one body layer at a time from one virtual stage to another (the
    layers between them shift by one, in model order) while that shortens the simulated iteration
    time, the modes of each rank a move changes fitted again as `balanced_plan` fits them. Each step
    tries at most as many moves as there are virtual stages, the most promising first (by the time
    the critical path spends per layer on the stage a layer leaves, less that on the stage it joins)
    and takes the first that helps. Stops at a plan no such move shortens, or at `deadline`
    (a time.perf_counter() value)."""
    schedule = program.schedule
    num_virtual_stages = schedule.num_virtual_stages
    sizes = program.body_layer_counts(values)
    pinned = _pinned_virtual_stages(program)
    least = [0 if program.spec.allow_empty_chunks or c in pinned else 1 for c in range(num_virtual_stages)]
    memory = _RankMemory(program)
    fitted: dict[tuple, dict[Key, int] | None] = {}  # a rank's (stage, first layer, size)s -> its counts

    def plan_of(split: list[int]) -> list[float] | None:
        """The program's point for body layers split as `split`, or None if a rank cannot fit."""
        firsts = [sum(split[:c]) for c in range(num_virtual_stages)]
        counts: dict[Key, int] = {}
        for rank in range(schedule.ranks):
            key = tuple((c, firsts[c], split[c]) for c in schedule.virtual_stages_of(rank))
            if key not in fitted:
                fitting = _Fitting(program, split, memory)
                fitted[key] = fitting.rank_counts(rank) if fitting.fit({rank}, move_layers=False) else None
            if fitted[key] is None:
                return None
            counts.update(fitted[key])
        return program.point({program.count[key]: number for key, number in counts.items() if number})

    def one_move(plan: list[float]) -> list[float] | None:
        """The first move, in the order above, that shortens `plan`'s time (sizes updated), or None."""
        path_ms = program.critical_ms_per_virtual_stage(plan)
        per_layer = [path_ms[c] / sizes[c] if sizes[c] else 0.0 for c in range(num_virtual_stages)]
        # A move with no gain cannot shorten the path the plan runs along; the largest gains first.
        candidates = [
            (i, j)
            for i in range(num_virtual_stages)
            for j in range(num_virtual_stages)
            if i != j and sizes[i] > least[i] and per_layer[i] > per_layer[j]
        ]
        candidates.sort(key=lambda move: (per_layer[move[1]] - per_layer[move[0]], move))
        for i, j in candidates[:num_virtual_stages]:
            if time.perf_counter() > deadline:
                return None
            sizes[i] -= 1
            sizes[j] += 1
            candidate = plan_of(sizes)
            if candidate is not None and candidate[program.iteration] < plan[program.iteration] * (1 - 1e-9):
                return candidate
            sizes[i] += 1
            sizes[j] -= 1
        return None

    refitted = plan_of(sizes)  # may not fit, or run slower, where `values` moved layers to fit
    best = refitted if refitted is not None and refitted[program.iteration] < values[program.iteration] else values
    moves = 0
    while (better := one_move(best)) is not None:
        best, moves = better, moves + 1
    log.info("moving layers one at a time: %d moves, %s ms", moves, format_ms(best[program.iteration]))
    return best


def balanced_virtual_stage_sizes(program: IntegerProgram) -> list[int]:
    """Body layers per virtual stage, in model order, each stage's forward + backward time (with its
    head or tail) as near its share of the total as whole layers allow; every stage gets one unless
    empty stages are allowed or it holds a head or tail. Then each rank's: a layer moves from the
    busiest rank's largest stage to the idlest rank's smallest while that lowers the busier of the two."""
    groups, num_virtual_stages = program.groups, program.schedule.num_virtual_stages
    load = [
        group.forward_ms + group.backward_ms
        for group in groups
        for _ in range(group.size)
        if group.pinned_virtual_stage is None
    ]
    pinned_load, needs = [0.0] * num_virtual_stages, [0 if program.spec.allow_empty_chunks else 1] * num_virtual_stages
    for group in groups:
        if group.pinned_virtual_stage is not None:
            pinned_load[group.pinned_virtual_stage] += group.size * (group.forward_ms + group.backward_ms)
            needs[group.pinned_virtual_stage] = 0
    total = sum(load) + sum(pinned_load)
    sizes, taken, running = [], 0, 0.0
    for c in range(num_virtual_stages):
        running += pinned_load[c]
        target = total * (c + 1) / num_virtual_stages
        most = len(load) - taken - sum(needs[c + 1 :])
        size = 0
        while size < most and (
            size < needs[c] or running + load[taken + size] / 2 <= target or c == num_virtual_stages - 1
        ):
            running += load[taken + size]
            size += 1
        sizes.append(size)
        taken += size
    # A rank's virtual stages are far apart in model order, so their roundings add up: even out the ranks' loads.
    rank_of = [program.schedule.rank_of(c) for c in range(num_virtual_stages)]
    mean_load = sum(load) / max(len(load), 1)
    for _ in range(len(load)):
        rank_load = [0.0] * program.schedule.ranks
        position = 0
        for c, size in enumerate(sizes):
            rank_load[rank_of[c]] += pinned_load[c] + sum(load[position : position + size])
            position += size
        busiest = max(range(len(rank_load)), key=rank_load.__getitem__)
        idlest = min(range(len(rank_load)), key=rank_load.__getitem__)
        giver = max(
            (c for c in program.schedule.virtual_stages_of(busiest) if sizes[c] > needs[c]),
            key=sizes.__getitem__,
            default=None,
        )
        taker = min(program.schedule.virtual_stages_of(idlest), key=sizes.__getitem__)
        if giver is None or rank_load[idlest] + mean_load >= rank_load[busiest]:
            break
        sizes[giver] -= 1
        sizes[taker] += 1
    return sizes


class _RankMemory:
    """Each rank's memory rows as one matrix over the variables they read, so that a peak, which the
    fitting reads for every switch it weighs, is one product (ranks with several chunks have hundreds
    of rows)."""

    def __init__(self, program: IntegerProgram) -> None:
        rows_of_rank: dict[int, list[Linear]] = {}
        for rank, row in program.memory_rows:
            rows_of_rank.setdefault(rank, []).append(row)
        self.rows: dict[int, tuple[list[int], np.ndarray, np.ndarray]] = {}
        for rank, rows in rows_of_rank.items():
            variables = sorted({variable for row in rows for variable in row.terms})
            column = {variable: i for i, variable in enumerate(variables)}
            matrix = np.zeros((len(rows), len(variables)))
            for r, row in enumerate(rows):
                for variable, coefficient in row.terms.items():
                    matrix[r, column[variable]] = coefficient
            self.rows[rank] = (variables, matrix, np.array([row.constant for row in rows]))

    def peak(self, rank: int, values: list[float]) -> float:
        """The rank's memory in MiB at its fullest point, with the variables at `values`."""
        variables, matrix, constants = self.rows[rank]
        return float((matrix @ np.array([values[variable] for variable in variables]) + constants).max())


def _pinned_virtual_stages(program: IntegerProgram) -> set[int]:
    return {group.pinned_virtual_stage for group in program.groups if group.pinned_virtual_stage is not None}


class _Fitting:
    """Body layers split into virtual stages of the given sizes (in model order), each in its quickest
    mode, and the memory each rank then takes; `fit` switches modes (and moves layers) until ranks fit."""

    def __init__(self, program: IntegerProgram, sizes: list[int], memory: _RankMemory) -> None:
        self.program = program
        groups = program.groups
        self.counts: dict[Key, int] = dict.fromkeys(program.count, 0)
        layers = iter(
            [g for g, group in enumerate(groups) if group.pinned_virtual_stage is None for _ in range(group.size)]
        )
        for c, size in enumerate(sizes):
            for _ in range(size):
                g = next(layers)
                quickest = min(groups[g].modes, key=lambda mode: groups[g].extra_ms[mode])
                self.counts[g, c, quickest] += 1
        # What memory reads: the counts and the working sets they set (no durations, no simulation).
        self.values = [0.0] * program.milp.num_variables
        for key, number in self.counts.items():
            self.values[program.count[key]] = number
        for virtual in range(program.schedule.num_virtual_stages):
            program.update_working_set(self.values, virtual)
        self.memory = memory
        self.budget_mib = program.spec.memory_budget_bytes / MIB
        self.pinned = _pinned_virtual_stages(program)
        # each rank's keys in the order of `counts`: scanning every key per rank is quadratic in the ranks
        self.keys_of_rank: list[list[Key]] = [[] for _ in range(program.schedule.ranks)]
        for key in self.counts:
            self.keys_of_rank[program.schedule.rank_of(key[1])].append(key)

    def point(self) -> list[float]:
        return self.program.point({self.program.count[key]: number for key, number in self.counts.items() if number})

    def rank_counts(self, rank: int) -> dict[Key, int]:
        return {key: self.counts[key] for key in self.keys_of_rank[rank]}

    def fit(self, ranks: set[int], *, move_layers: bool) -> bool:
        """Rank by rank while one of `ranks` is over the budget: the mode switch that frees the most
        memory per millisecond it adds, or (with `move_layers`) once no switch frees any, the layer
        at one end of its stages moved to the neighbouring stage of another rank that still fits with
        it (which joins `ranks`); then `reclaim` on every rank changed. Whether they all fit."""
        schedule = self.program.schedule
        # a rank that receives a layer fits with it, so back and forth is rare: the cap ends any that is left
        unchecked, touched = set(ranks), set(ranks)
        steps = 10 * len(self.counts) * max(len(group.modes) for group in self.program.groups)
        while unchecked and steps:
            rank = min(unchecked)
            now = self.peak(rank)
            if now <= self.budget_mib:
                unchecked.discard(rank)
                continue
            step = self.cheapest_switch(rank, now) or (self.roomiest_shift(rank) if move_layers else None)
            if step is None:
                return False
            self.move(*step)
            unchecked.add(schedule.rank_of(step[3]))  # the rank the layer went to (itself for a switch)
            touched.add(schedule.rank_of(step[3]))
            steps -= 1
        if unchecked:
            return False
        for rank in sorted(touched):
            self.reclaim(rank)
        return True

    def reclaim(self, rank: int) -> None:
        """Take back recompute the switches made needless: while one is left that keeps the rank within
        the budget, the switch or pair of switches (say one layer to a quicker mode, another to a
        slower one) that saves the most time. The greedy switches one layer at a time in order of memory freed
        per millisecond, and its last switches often free more than the rank needed."""
        groups, counts = self.program.groups, self.counts
        while True:
            switches = [
                (g, c, mode, c, to)
                for g, c, mode in self.keys_of_rank[rank]
                if counts[g, c, mode]
                for to in groups[g].modes
                if to != mode
            ]

            def saving(switch: tuple[int, int, str, int, str]) -> float:
                g, _, mode, _, to = switch
                return groups[g].extra_ms[mode] - groups[g].extra_ms[to]

            options = [[switch] for switch in switches] + [
                [first, second] for i, first in enumerate(switches) for second in switches[i + 1 :]
            ]
            options = sorted(
                (option for option in options if sum(map(saving, option)) > 1e-9),
                key=lambda option: -sum(map(saving, option)),
            )
            best = next((option for option in options if self._fits_after(rank, option)), None)
            if best is None:
                return
            for step in best:
                self.move(*step)

    def _fits_after(self, rank: int, steps: list[tuple[int, int, str, int, str]]) -> bool:
        """Whether the rank fits with `steps` made (they are undone), and they stay expressible."""
        done = []
        for g, c, mode, to_virtual, to in steps:
            if not self.counts[g, c, mode]:
                break
            self.move(g, c, mode, to_virtual, to)
            done.append((g, c, mode, to_virtual, to))
        fits = (
            len(done) == len(steps)
            and self.peak(rank) <= self.budget_mib
            and all(self.expressible(g, c) for g, c, *_ in steps)
        )
        for g, c, mode, to_virtual, to in reversed(done):
            self.move(g, to_virtual, to, c, mode)
        return fits

    def peak(self, rank: int) -> float:
        return self.memory.peak(rank, self.values)

    def expressible(self, g: int, virtual: int) -> bool:
        """MindFormers cannot state select-only and comm-only layers of one kind in one stage."""
        return not (self.counts.get((g, virtual, SELECTIVE)) and self.counts.get((g, virtual, COMM)))

    def move(self, g: int, virtual: int, mode: str, to_virtual: int, to_mode: str) -> None:
        """One layer of group g from (virtual, mode) to (to_virtual, to_mode), in the counts and in what
        memory reads."""
        program = self.program
        self.counts[g, virtual, mode] -= 1
        self.counts[g, to_virtual, to_mode] += 1
        self.values[program.count[g, virtual, mode]] -= 1
        self.values[program.count[g, to_virtual, to_mode]] += 1
        program.update_working_set(self.values, virtual)
        program.update_working_set(self.values, to_virtual)

    def cheapest_switch(self, rank: int, now: float) -> tuple[int, int, str, int, str] | None:
        groups, counts = self.program.groups, self.counts
        best, best_cost = None, INF  # extra ms per MiB freed
        for g, c, mode in self.keys_of_rank[rank]:
            if not counts[g, c, mode]:
                continue
            for to in groups[g].modes:
                if to == mode:
                    continue
                self.move(g, c, mode, c, to)
                after = self.peak(rank)
                expressible = self.expressible(g, c)
                self.move(g, c, to, c, mode)
                if expressible and after < now - 1e-9:
                    cost = (groups[g].extra_ms[to] - groups[g].extra_ms[mode]) / (now - after)
                    if cost < best_cost:
                        best, best_cost = (g, c, mode, c, to), cost
        return best

    def leanest_peak(self, rank: int) -> float:
        """The rank's peak with each of its layers in the mode that keeps the fewest activations."""
        groups = self.program.groups
        switched = []
        for g, c, mode in self.keys_of_rank[rank]:
            number = self.counts[g, c, mode]
            if number:
                leanest = min(groups[g].modes, key=lambda m: (groups[g].activation_mib[m], groups[g].extra_ms[m]))
                if leanest != mode:
                    for _ in range(number):
                        self.move(g, c, mode, c, leanest)
                    switched.append((g, c, mode, leanest, number))
        result = self.peak(rank)
        for g, c, mode, leanest, number in switched:
            for _ in range(number):
                self.move(g, c, leanest, c, mode)
        return result

    def roomiest_shift(self, rank: int) -> tuple[int, int, str, int, str] | None:
        program, counts = self.program, self.counts
        schedule, num_virtual_stages = program.schedule, program.schedule.num_virtual_stages
        best, best_room = None, -INF  # the budget left on the rank it moves to
        for c in schedule.virtual_stages_of(rank):
            keys = [key for key in self.keys_of_rank[rank] if key[1] == c]
            held = [key[0] for key in keys if counts[key]]
            if not held or (
                sum(counts[key] for key in keys) == 1 and c not in self.pinned and not program.spec.allow_empty_chunks
            ):
                continue  # every virtual stage keeps a layer
            for g, to_virtual in ((max(held), c + 1), (min(held), c - 1)):  # model order: last layer on, first back
                if not 0 <= to_virtual < num_virtual_stages or schedule.rank_of(to_virtual) == rank:
                    continue
                for mode in program.groups[g].modes:
                    if not counts[g, c, mode]:
                        continue
                    self.move(g, c, mode, to_virtual, mode)
                    room = self.budget_mib - self.leanest_peak(schedule.rank_of(to_virtual))
                    self.move(g, to_virtual, mode, c, mode)
                    if room >= 0 and room > best_room:
                        best, best_room = (g, c, mode, to_virtual, mode), room
        return best
