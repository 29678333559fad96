"""The plan the hook decides on from a profile: the solver's, with its caveat said; after a drift, the plan in use
where the new one is not faster by more than the profile's noise (plans that differ by noise only churn)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from basics.errors import InputError
from basics.units import format_ms
from sapp_hook.hook.outputs import noise
from sapp_hook.pipelining.engine_rules import recompute_runs_under
from sapp_hook.writeback import runnable_schedules
from solver import ModelProfile, PipelineSpec, Plan, plan_from_dict, solve
from solver.compare import candidates, describe, faster_elsewhere, plans_by_schedule
from solver.parallel.model_parallel import prediction_caveat
from solver.vocabulary.profile import NONE

log = logging.getLogger(__name__)


def plan_for(
    profile: ModelProfile,
    spec: PipelineSpec,
    time_limit_s: float,
    previous: Mapping[str, Any] | None,
    say: Callable[[str], None],
    *,
    target: str | None = None,
    auto: bool = False,
) -> Plan:
    """The plan for `profile` under `spec`, with a word where another schedule the `target` runs is predicted
    faster (or fits where this one does not); `auto`: the fastest of those schedules, `spec`'s own ignored.
    `previous`, the plan JSON in use (None: none), stays where the new plan is not faster than it by more than
    `noise(profile)`. Raises what `solve` raises."""
    spread = noise(profile)
    options = candidates(runnable_schedules(target))
    ranks = f"{spec.pipeline_parallel} ranks (the layers' measured times vary by {spread:.1%})"
    if auto:
        say(f"solving for the fastest of {', '.join(f'{name} x{chunks}' for name, chunks in options)} on {ranks} ...")
        plans = _plans(profile, spec, options, time_limit_s / len(options))
        plan = plans[0] if plans else solve(profile, spec, time_limit_s=time_limit_s)  # its error says why
        others = "; ".join(f"{describe(other)} {format_ms(other.iteration_time_ms)} ms" for other in plans[1:])
        say(
            f"auto: {describe(plan)}, predicted {format_ms(plan.iteration_time_ms)} ms"
            + (f" ({others})" if others else "")
        )
    else:
        say(f"solving {spec.pipeline_schedule.name} for {ranks} ...")
        plan = solve(profile, spec, time_limit_s=time_limit_s)
        mine = (spec.pipeline_schedule.name, spec.num_chunks)
        others = _plans(profile, spec, [option for option in options if option != mine], time_limit_s / len(options))
        better = faster_elsewhere(plan, others, spread)
        if better is not None:
            fits = "" if plan.fits else " and fits where it does not"
            say(
                f"{describe(better)} is predicted {format_ms(better.iteration_time_ms)} ms where {describe(plan)} "
                f"gives {format_ms(plan.iteration_time_ms)} ms{fits}: schedule={better.spec.pipeline_schedule.name!r}, "
                f"chunks={better.spec.num_chunks} (or schedule='auto') plans for it"
            )
    caveat = prediction_caveat(profile, plan.spec)
    if caveat is not None:
        log.warning("sapp-hook: %s", caveat)
    try:
        kept = plan_from_dict(profile, previous) if previous is not None else None
    except InputError:
        kept = None
    if kept is not None and kept.fits and kept.iteration_time_ms <= plan.iteration_time_ms * (1 + spread):
        say(
            f"the plan in use predicts {format_ms(kept.iteration_time_ms)} ms, the new one "
            f"{format_ms(plan.iteration_time_ms)} ms: within the profile's noise, so the plan in use stays"
        )
        return kept
    return plan


def _plans(
    profile: ModelProfile, spec: PipelineSpec, options: list[tuple[str, int]], time_limit_s: float
) -> list[Plan]:
    """`plans_by_schedule`, each schedule with the recompute torch runs under it (none where it splits the
    backward: `recompute_runs_under`)."""
    plans = []
    for name, chunks in options:
        profile_of = profile if recompute_runs_under(name) or profile.modes == (NONE,) else profile.with_modes((NONE,))
        plans += plans_by_schedule(profile_of, spec, [(name, chunks)], time_limit_s)
    return sorted(plans, key=lambda plan: (not plan.fits, plan.iteration_time_ms))
