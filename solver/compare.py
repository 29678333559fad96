"""One job planned under several schedules, to say which is fastest: the schedule a user picked against the others
its engine runs, and `schedule="auto"`'s choice."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Sequence

from basics.errors import InputError
from simulator.schedules import schedule_kind
from solver.errors import InfeasibleError
from solver.program.search import solve
from solver.vocabulary.plan import Plan
from solver.vocabulary.profile import ModelProfile
from solver.vocabulary.spec import PipelineSpec

log = logging.getLogger("solver")


def candidates(schedules: Iterable[str]) -> list[tuple[str, int]]:
    """(schedule, chunks) worth comparing for `schedules`: each at its own chunk count, an interleaved one at 2."""
    found = []
    for name in schedules:
        kind = schedule_kind(name)
        found.append((kind.name, kind.default_chunks if kind.max_chunks == kind.min_chunks else 2))
    return list(dict.fromkeys(found))


def plans_by_schedule(
    profile: ModelProfile,
    spec: PipelineSpec,
    options: Sequence[tuple[str, int]],
    time_limit_s: float,
    *,
    profile_under: Callable[[str], ModelProfile] | None = None,
) -> list[Plan]:
    """The best plan under each (schedule, chunks) of `options` (each search `time_limit_s` at most), fastest
    first; an option the job cannot run (too few micro-batches or layers for it) or where no plan fits is left
    out. `profile_under(schedule)`: the profile planned under that schedule (its recompute modes; default
    `profile`)."""
    return _plans_and_errors(profile, spec, options, time_limit_s, profile_under, "raise")[0]


def fastest(
    profile: ModelProfile,
    spec: PipelineSpec,
    options: Sequence[tuple[str, int]],
    time_limit_s: float,
    *,
    profile_under: Callable[[str], ModelProfile] | None = None,
    on_interrupt: str | Callable[[Plan], object] = "raise",
) -> list[Plan]:
    """`plans_by_schedule`, `schedule="auto"`'s way: the fastest first, never empty. `on_interrupt`: "raise", or a
    function called with the fastest plan found so far before an interrupt propagates (`solve`'s own).

    Raises:
        InfeasibleError: no option has a plan that fits: the one whose smallest fitting budget is least, that
            schedule named.
        InputError: the job runs under none of `options`: the first option's error.
    """
    plans, errors = _plans_and_errors(profile, spec, options, time_limit_s, profile_under, on_interrupt)
    if plans:
        return plans
    infeasible = [(option, error) for option, error in errors if isinstance(error, InfeasibleError)]
    if not infeasible:
        raise errors[0][1]
    (name, chunks), error = min(infeasible, key=lambda pair: pair[1].smallest_budget_bytes or math.inf)
    raise InfeasibleError(
        f"{name} x{chunks}, the schedule that needs the least memory: {error.detail}",
        smallest_budget_bytes=error.smallest_budget_bytes,
        binding_rank=error.binding_rank,
    )


def _plans_and_errors(
    profile: ModelProfile,
    spec: PipelineSpec,
    options: Sequence[tuple[str, int]],
    time_limit_s: float,
    profile_under: Callable[[str], ModelProfile] | None,
    on_interrupt: str | Callable[[Plan], object],
) -> tuple[list[Plan], list[tuple[tuple[str, int], InputError]]]:
    """Each option's best plan (each fits: `solve` refuses where none does), fastest first, and each refused
    option's error."""
    plans: list[Plan] = []
    errors: list[tuple[tuple[str, int], InputError]] = []

    def fastest_so_far(best: Plan) -> object:  # this schedule's best beside the others' plans
        return on_interrupt(_sorted([*plans, best])[0])  # type: ignore[operator]

    keep = fastest_so_far if callable(on_interrupt) else on_interrupt
    for name, chunks in options:
        planned = profile if profile_under is None else profile_under(name)
        try:
            option_spec = dataclasses.replace(spec, schedule=name, chunks=chunks)
            plans.append(solve(planned, option_spec, time_limit_s=time_limit_s, on_interrupt=keep))
        except InputError as error:  # InfeasibleError among them
            log.info("%s x%d: %s", name, chunks, error)
            errors.append(((name, chunks), error))
    return _sorted(plans), errors


def _sorted(plans: list[Plan]) -> list[Plan]:
    return sorted(plans, key=lambda plan: plan.iteration_time_ms)


def faster_elsewhere(chosen: Plan, others: Sequence[Plan], noise: float = 0.0) -> Plan | None:
    """The fastest of `others` that beats `chosen` by more than `noise` (a fraction); None where none does."""
    for other in others:
        if (other.spec.schedule, other.spec.num_chunks) == (chosen.spec.schedule, chosen.spec.num_chunks):
            continue
        if other.iteration_time_ms < chosen.iteration_time_ms * (1 - noise):
            return other
    return None


def describe(plan: Plan) -> str:
    """`Interleaved1F1B x2` (a plan's schedule and chunks)."""
    return f"{plan.spec.pipeline_schedule.name} x{plan.spec.num_chunks}"
