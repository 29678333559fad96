"""Where the layers go, as variables: how many layers of each group each virtual stage holds in each
recompute mode, the rows that keep groups in model order and stages expressible, and the binaries
and largest-of variables other rows read off those counts."""

from __future__ import annotations

import itertools

from simulator.schedule import Schedule
from solver.formats.mindformers import MODE_ORDER, ordered_modes
from solver.program.groups import LayerGroup
from solver.program.milp import Linear, Milp, dot
from solver.vocabulary.profile import COMM, HEAD, NONE, SELECTIVE, TAIL, ModelProfile
from solver.vocabulary.spec import PipelineSpec

# (variable, least value, (count variable, working set, what the layers after it free) of each layer that may
# raise it, rows (constant, terms) below it)
WorkingChoice = tuple[int, float, list[tuple[int, float, dict[int, float]]], list[tuple[float, dict[int, float]]]]


class LayerPlacement:
    """The layer counts per (group, virtual stage, mode) of a program, and what is read off them."""

    def __init__(self, profile: ModelProfile, spec: PipelineSpec, schedule: Schedule, groups: list[LayerGroup]) -> None:
        self.profile, self.spec, self.schedule, self.groups = profile, spec, schedule, groups
        self.milp = milp = Milp()
        num_virtual_stages = schedule.num_virtual_stages
        self.count: dict[tuple[int, int, str], int] = {}  # (group, virtual stage, mode) -> variable
        # per virtual stage, its (group, mode, variable)s in the order of `count`: scanning `count` per stage is quadratic
        self.counts_at: list[list[tuple[int, str, int]]] = [[] for _ in range(num_virtual_stages)]
        for g, group in enumerate(groups):
            if group.pinned_virtual_stage is not None:
                continue
            for c in range(num_virtual_stages):
                for mode in group.modes:
                    self.count[g, c, mode] = milp.variable(0, group.size, integer=True)
                    self.counts_at[c].append((g, mode, self.count[g, c, mode]))
            milp.row(
                {self.count[g, c, m]: 1.0 for c in range(num_virtual_stages) for m in group.modes},
                group.size,
                group.size,
            )
        self._order_groups(num_virtual_stages)
        self._mindformers_expressible(num_virtual_stages)
        self._rank_totals()
        if not spec.allow_empty_chunks:
            for c in range(num_virtual_stages):
                pinned = sum(g.size for g in groups if g.pinned_virtual_stage == c)
                if not pinned:
                    milp.row({v: 1.0 for _, _, v in self.counts_at[c]}, lower=1)
        self._group_presence: dict[tuple[int, int], int] = {}  # (group, virtual stage) -> 1 where it holds the group
        self._end_indicators: dict[tuple[int, int | None, int], int] = {}  # see _end_indicator
        self._end_terms: list[tuple[int, int, int | None]] = []  # (indicator, group present, neighbour present)
        self.working_choices: dict[int, list[WorkingChoice]] = {}  # per virtual stage, each set after those before it
        self._presence: dict[int, int] = {}  # count variable -> a binary that is 1 where the count is not 0
        self._group_of_count = {variable: g for (g, _, _), variable in self.count.items()}
        self._body_held: dict[int, Linear] = {}  # see holds_body

    def virtual_stage_sums(self, value) -> list[Linear]:
        """Per virtual stage: the sum of `value(group, mode)` over the layers it holds."""
        sums = [Linear() for _ in range(self.schedule.num_virtual_stages)]
        for group in self.groups:
            if group.pinned_virtual_stage is not None:
                sums[group.pinned_virtual_stage].constant += group.size * value(group, NONE)
        for (g, c, mode), variable in self.count.items():
            sums[c].add(variable, value(self.groups[g], mode))
        return sums

    def at_end(self, virtual: int, values: list[float], *, first: bool) -> Linear:
        """`values[g]` of the group whose layer comes first (or last) in virtual stage `virtual` in model
        order: the head (the tail) where the virtual stage holds it; else the first (last) body group there,
        told apart by binaries where the groups' values differ (a group is first where it is present
        and the one before it is not: model order leaves no earlier one there); else the other
        pinned layer, or 0 where the virtual stage may hold nothing."""
        pinned = [g for g, group in enumerate(self.groups) if group.pinned_virtual_stage == virtual]
        at_end = [g for g in pinned if self.groups[g].kind == (HEAD if first else TAIL)]
        if at_end:
            return Linear(constant=values[at_end[0] if first else at_end[-1]])
        fallback = values[pinned[0] if first else pinned[-1]] if pinned else 0.0
        body = [g for g, group in enumerate(self.groups) if group.pinned_virtual_stage is None]
        distinct = {values[g] for g in body}
        surely_body = not pinned and not self.spec.allow_empty_chunks
        if not body or distinct == {fallback} or (len(distinct) == 1 and surely_body):
            return Linear(constant=next(iter(distinct)) if body and distinct != {fallback} else fallback)
        order = body[::-1] if first else body  # each group with the one it must not be followed (preceded) by
        expression = Linear(constant=fallback)
        for g, neighbour in zip(order, [*order[1:], None]):
            expression.add(self._end_indicator(g, neighbour, virtual), values[g] - fallback)
        return expression

    def _end_indicator(self, g: int, neighbour: int | None, virtual: int) -> int:
        """A binary that is 1 where `virtual` holds group `g` and not group `neighbour` (none: always)."""
        key = (g, neighbour, virtual)
        if key not in self._end_indicators:
            indicator, present = self.milp.variable(0, 1, integer=True), self._group_present(g, virtual)
            self.milp.row({indicator: 1.0, present: -1.0}, upper=0.0)
            if neighbour is None:
                self.milp.row({indicator: 1.0, present: -1.0}, lower=0.0)
                after = None
            else:
                after = self._group_present(neighbour, virtual)
                self.milp.row({indicator: 1.0, after: 1.0}, upper=1.0)
                self.milp.row({indicator: 1.0, present: -1.0, after: 1.0}, lower=0.0)
            self._end_indicators[key] = indicator
            self._end_terms.append((indicator, present, after))
        return self._end_indicators[key]

    def _group_present(self, g: int, virtual: int) -> int:
        """A binary that is 1 where virtual stage `virtual` holds a layer of group `g`."""
        if (g, virtual) not in self._group_presence:
            present = self.milp.variable(0, 1, integer=True)
            counts = {self.count[g, virtual, m]: 1.0 for m in self.groups[g].modes}
            self.milp.row({**counts, present: -1.0}, lower=0.0)
            self.milp.row({**counts, present: -float(self.groups[g].size)}, upper=0.0)
            self._group_presence[g, virtual] = present
        return self._group_presence[g, virtual]

    def _order_groups(self, num_virtual_stages: int) -> None:
        """Body groups keep model order: group g ends in or before the virtual stage where group g+1 starts."""
        body = [g for g, group in enumerate(self.groups) if group.pinned_virtual_stage is None]
        for g, nxt in itertools.pairwise(body):
            crossed = [self.milp.variable(0, 1, integer=True) for _ in range(num_virtual_stages)]  # g+1 may sit in c
            for c in range(num_virtual_stages):
                if c + 1 < num_virtual_stages:
                    self.milp.row({crossed[c]: 1.0, crossed[c + 1]: -1.0}, upper=0.0)
                # over whole runs (g+1 in none of 0..c unless crossed[c], g in none of c+1.. if so): a far tighter relaxation
                first_part = {self.count[nxt, d, m]: 1.0 for d in range(c + 1) for m in self.groups[nxt].modes}
                self.milp.row({**first_part, crossed[c]: -self.groups[nxt].size}, upper=0.0)
                if c + 1 < num_virtual_stages:
                    rest = {
                        self.count[g, d, m]: 1.0 for d in range(c + 1, num_virtual_stages) for m in self.groups[g].modes
                    }
                    self.milp.row({**rest, crossed[c]: self.groups[g].size}, upper=self.groups[g].size)

    def _rank_totals(self) -> None:
        """An integer variable for each rank's number of movable layers. Redundant for the program, but
        the branch-and-bound can branch on it: the relaxation spreads layers so that every rank holds a
        fraction more than its share, and one branch on a rank's total cuts that off where many on
        single counts would not."""
        schedule = self.schedule
        for rank in range(schedule.ranks):
            held = sorted(v for c in schedule.virtual_stages_of(rank) for _, _, v in self.counts_at[c])
            terms = dict.fromkeys(held, 1.0)  # in the order of `count`
            if len(terms) > 1:
                total = self.milp.variable(0, sum(g.size for g in self.groups), integer=True)
                self.milp.row({**terms, total: -1.0}, 0.0, 0.0)

    def _mindformers_expressible(self, num_virtual_stages: int) -> None:
        """MindFormers counts recompute per stage as prefixes (recompute <= both <= select or comm), so
        a stage cannot hold select-only and comm-only layers at once."""
        for g, group in enumerate(self.groups):
            if group.pinned_virtual_stage is None and SELECTIVE in group.modes and COMM in group.modes:
                for c in range(num_virtual_stages):
                    comm_side = self.milp.variable(0, 1, integer=True)
                    self.milp.row({self.count[g, c, SELECTIVE]: 1.0, comm_side: group.size}, upper=group.size)
                    self.milp.row({self.count[g, c, COMM]: 1.0, comm_side: -group.size}, upper=0.0)

    def largest(
        self,
        virtual: int,
        pinned: float,
        size,
        rows: list[tuple[float, dict[int, float]]] = (),
        freed=None,
        *,
        front_to_back: bool = False,
    ) -> Linear:
        """A variable at least `pinned`, at least `size(group, mode)` of every (group, mode) the virtual stage
        holds (none where `size` is None), and at least each row (constant, terms) of `rows`, as an
        expression; a constant where nothing can raise it above `pinned`. `freed(group, mode)`: where
        given, what each layer frees as a walk over the virtual stage passes it, back to front (a
        backward) or `front_to_back`: each (group, mode)'s size less what the layers the walk passed
        before its first one free."""
        choices = (
            []
            if size is None
            else [
                (count, size(self.groups[g], mode), self._freed_before(virtual, g, mode, freed, front_to_back))
                for g, mode, count in self.counts_at[virtual]
            ]
        )
        choices = [choice for choice in choices if choice[1] > pinned]
        rows = [(constant, terms) for constant, terms in rows if terms or constant > pinned]
        if not choices and not rows:
            return Linear(constant=pinned)
        variable = self.milp.variable(pinned)
        self.working_choices.setdefault(virtual, []).append((variable, pinned, choices, rows))
        for count, value, after in choices:
            self.milp.row({variable: 1.0, self._present(count): -value, **after}, lower=0.0)
        for constant, terms in rows:
            self.milp.row({variable: 1.0, **{v: -coefficient for v, coefficient in terms.items()}}, lower=constant)
        return Linear({variable: 1.0})

    def _freed_before(self, virtual: int, g: int, mode: str, freed, front_to_back: bool) -> dict[int, float]:
        """What the layers a walk of the virtual stage passes before (group g, `mode`)'s layers free,
        `freed(group, mode)` each, as terms in their counts: back to front, the later groups' and the
        group's own in later modes (`ordered_modes` lays a group's layers out in MODE_ORDER); front to
        back, the earlier ones."""
        if freed is None:
            return {}
        sign = -1 if front_to_back else 1
        first, rank = sign * self.groups[g].first, sign * MODE_ORDER.index(mode)
        passed = {
            count: freed(self.groups[h], other)
            for h, other, count in self.counts_at[virtual]
            if sign * self.groups[h].first > first or (h == g and sign * MODE_ORDER.index(other) > rank)
        }
        return {count: bytes_freed for count, bytes_freed in passed.items() if bytes_freed}

    def holds_body(self, virtual: int) -> Linear:
        """At least 1 where virtual stage `virtual` holds a body layer (a constant where nothing can be
        there); only the rows push it down."""
        if virtual not in self._body_held:
            self._body_held[virtual] = self.largest(virtual, 0.0, lambda g, m: 1.0)
        return self._body_held[virtual]

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

    def update_working_set(self, values: list[float], virtual: int) -> None:
        """Set the working-set variables of virtual stage `virtual` from the layer counts in `values`."""
        for variable, least, choices, rows in self.working_choices.get(virtual, []):
            sizes = [least] + [size - dot(after, values) for count, size, after in choices if values[count] > 0.5]
            sizes += [constant + dot(terms, values) for constant, terms in rows]
            values[variable] = max(sizes)

    def set_indicators(self, values: list[float]) -> None:
        """Set the binaries and working-set variables from the layer counts in `values`."""
        for (g, virtual), present in self._group_presence.items():
            values[present] = float(any(values[self.count[g, virtual, m]] > 0.5 for m in self.groups[g].modes))
        for indicator, present, after in self._end_terms:
            values[indicator] = values[present] * (1.0 - (values[after] if after is not None else 0.0))
        for virtual in self.working_choices:
            self.update_working_set(values, virtual)

    def fix_split(self, values: list[float]) -> None:
        """Rows holding each virtual stage's layers of each group as many as at `values`, their
        recompute modes free."""
        split: dict[tuple[int, int], dict[int, float]] = {}
        for (g, virtual, _), variable in self.count.items():
            split.setdefault((g, virtual), {})[variable] = 1.0
        for terms in split.values():
            layers = sum(round(values[variable]) for variable in terms)
            self.milp.row(terms, layers, layers)

    def _counts(self, values: list[float]) -> dict[tuple[int, int, str], int]:
        return {key: round(values[variable]) for key, variable in self.count.items()}

    def body_layer_counts(self, values: list[float]) -> list[int]:
        """Per virtual stage, how many layers that can move (not heads or tails) it holds."""
        counts = [0] * self.schedule.num_virtual_stages
        for (_, c, _), number in self._counts(values).items():
            counts[c] += number
        return counts

    def stage_layer_counts(self, values: list[float]) -> tuple[int, ...]:
        counts = self.body_layer_counts(values)
        for group in self.groups:
            if group.pinned_virtual_stage is not None:
                counts[group.pinned_virtual_stage] += group.size
        return tuple(counts)

    def layer_modes(self, values: list[float]) -> tuple[str, ...]:
        modes = [NONE] * len(self.profile.layers)
        counts = self._counts(values)
        for g, group in enumerate(self.groups):
            if group.pinned_virtual_stage is not None:
                continue
            position = group.first
            for c in range(self.schedule.num_virtual_stages):
                for mode in ordered_modes({m: counts[g, c, m] for m in group.modes}):
                    modes[position] = mode
                    position += 1
        return tuple(modes)
