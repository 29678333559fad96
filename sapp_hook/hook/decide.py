"""The plan the hook decides on from a profile: the solver's, with its caveat said; after a drift, the plan in use
where the new one is not faster by more than the profile's noise (plans that differ by noise only churn)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from basics.errors import InputError
from basics.units import format_ms
from sapp_hook.pipelining.engine_rules import recompute_runs_under
from sapp_hook.writeback import check_job
from solver import ModelProfile, PipelineSpec, Plan, plan_from_dict, solve
from solver.compare import describe, faster_elsewhere, fastest, plans_by_schedule
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
    options: Sequence[tuple[str, int]],
    auto: bool = False,
) -> Plan:
    """The plan for `profile` under `spec`, with a word where another (schedule, chunks) of `options` (those the
    target runs) is predicted faster; `auto`: the fastest of `options`, `spec`'s
    own schedule ignored. `previous`, the plan JSON in use (None: none), stays where the new plan is not faster
    than it by more than `noise(profile)`. Raises what `solve` raises."""
    spread = noise(profile)
    ranks = f"{spec.pipeline_parallel} ranks (the layers' measured times vary by {spread:.1%})"
    share = time_limit_s / len(options)
    if auto:
        say(f"solving for the fastest of {', '.join(f'{name} x{chunks}' for name, chunks in options)} on {ranks} ...")
        plans = fastest(profile, spec, options, share, profile_under=functools.partial(_profile_under, profile))
        plan = plans[0]
        others = "; ".join(f"{describe(other)} {format_ms(other.iteration_time_ms)} ms" for other in plans[1:])
        say(
            f"auto: {describe(plan)}, predicted {format_ms(plan.iteration_time_ms)} ms"
            + (f" ({others})" if others else "")
        )
    else:
        say(f"solving {spec.pipeline_schedule.name} for {ranks} ...")
        plan = solve(profile, spec, time_limit_s=time_limit_s)
        mine = (spec.pipeline_schedule.name, spec.num_chunks)
        elsewhere = [option for option in options if option != mine]
        others = plans_by_schedule(
            profile, spec, elsewhere, share, profile_under=functools.partial(_profile_under, profile)
        )
        better = faster_elsewhere(plan, others, spread)
        if better is not None:
            say(
                f"{describe(better)} is predicted {format_ms(better.iteration_time_ms)} ms where {describe(plan)} "
                f"gives {format_ms(plan.iteration_time_ms)} ms: schedule={better.spec.pipeline_schedule.name!r}, "
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


def runnable_options(
    target: str,
    config: Path | None,
    spec: PipelineSpec,
    blocks: int,
    options: Sequence[tuple[str, int]],
    *,
    config_field: str,
) -> list[tuple[str, int]]:
    """The (schedule, chunks) of `options` whose even split of `blocks` the `target` config takes (`check_job`'s
    dry run): what `auto` chooses among. Raises the first option's error where none is taken."""
    errors, runnable = [], []
    for name, chunks in options:
        try:
            option_spec = dataclasses.replace(spec, schedule=name, chunks=chunks)
            check_job(target, config, option_spec, blocks, config_field=config_field)
            runnable.append((name, chunks))
        except InputError as error:
            errors.append(error)
            log.info("sapp-hook: %s x%d left out: %s", name, chunks, error)
    if not runnable:
        raise errors[0]
    return runnable


def noise(profile: ModelProfile) -> float:
    """How far the profiled steps disagree, as a fraction of a step: the layers' spreads (max - min over the
    measured steps) over their times, forward and backward, without recompute."""
    spread = sum(layer.spread.get("forward_ms", 0.0) + layer.spread.get("backward_ms", 0.0) for layer in profile.layers)
    total = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)
    return spread / total if total else 0.0


def _profile_under(profile: ModelProfile, schedule: str) -> ModelProfile:
    """`profile` with the recompute torch runs under `schedule`: none where it splits the backward."""
    if recompute_runs_under(schedule) or profile.modes == (NONE,):
        return profile
    return profile.with_modes((NONE,))
