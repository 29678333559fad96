"""One job planned under several schedules, to say which is fastest: the schedule a user picked against the others
its engine runs, and `schedule="auto"`'s choice."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

from basics.errors import InputError
from simulator.schedules import schedule_kind
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
    profile: ModelProfile, spec: PipelineSpec, options: Sequence[tuple[str, int]], time_limit_s: float
) -> list[Plan]:
    """The best plan under each (schedule, chunks) of `options` (each search `time_limit_s` at most), fastest
    first, those that fit before those that do not; an option the job cannot run (too few micro-batches or
    layers for it) or where no plan fits is left out."""
    plans = []
    for name, chunks in options:
        try:
            plans.append(
                solve(profile, dataclasses.replace(spec, schedule=name, chunks=chunks), time_limit_s=time_limit_s)
            )
        except InputError as error:  # InfeasibleError among them
            log.info("%s x%d: %s", name, chunks, error)
    return sorted(plans, key=lambda plan: (not plan.fits, plan.iteration_time_ms))


def faster_elsewhere(chosen: Plan, others: Sequence[Plan], noise: float = 0.0) -> Plan | None:
    """The fastest of `others` that fits and beats `chosen` by more than `noise` (a fraction), or fits where it
    does not; None where none does."""
    for other in others:
        if (other.spec.schedule, other.spec.num_chunks) == (chosen.spec.schedule, chosen.spec.num_chunks):
            continue
        if other.fits and (not chosen.fits or other.iteration_time_ms < chosen.iteration_time_ms * (1 - noise)):
            return other
    return None


def describe(plan: Plan) -> str:
    """`Interleaved1F1B x2` (a plan's schedule and chunks)."""
    return f"{plan.spec.pipeline_schedule.name} x{plan.spec.num_chunks}"
