"""Human-readable reports of a replay and of a plan, for the CLI and the hook's log."""

from __future__ import annotations

import math

from basics.units import format_bytes, format_ms
from sapp_hook.pipelining.engine_rules import no_recompute_reason, recompute_runs_under
from simulator import InputError, SimulationResult
from simulator.result import BubbleSplit
from solver import ModelProfile, Plan, even_plan
from solver.formats.mindformers import MODE_ORDER
from solver.vocabulary.profile import FULL, NONE


def bubble_line(bubble: BubbleSplit) -> str:
    return (
        f"bubble          {bubble.real:.4f} = ideal {bubble.ideal:.4f} + imbalance {bubble.imbalance:.4f}"
        f" + recompute {bubble.recompute:.4f} + comm {bubble.comm:.4f}"
    )


def replay_report(result: SimulationResult) -> str:
    schedule = result.schedule
    lines = [
        f"{schedule.describe()} ({schedule.num_actions:,} actions)",
        f"iteration time  {format_ms(result.iteration_time_ms)} ms",
        bubble_line(result.bubble),
    ]
    if result.weight_split_assumed:
        lines.append("note            weight-gradient time not given (--weight): I and W each took half of B")
    lines.append(f"{'rank':>4}  {'busy ms':>10}  {'peak memory':>12}  {'peak activations':>16}")
    for rank in range(schedule.ranks):
        lines.append(
            f"{rank:>4}  {format_ms(result.rank_busy_ms[rank]):>10}  "
            f"{format_bytes(result.rank_peak_memory_bytes[rank]):>12}  {result.rank_peak_activations[rank]:>16}"
        )
    return "\n".join(lines)


def plan_report(plan: Plan) -> str:
    spec = plan.spec
    schedule = spec.pipeline_schedule
    budget = spec.memory_budget_bytes
    status = plan.status
    if plan.status in ("feasible", "interrupted") and plan.gap is not None:
        reason = "time limit" if plan.status == "feasible" else "the best found before the interrupt"
        status += f" ({reason}; within {plan.gap:.2%} of the best possible, >= {format_ms(plan.lower_bound_ms)} ms)"
    if plan.solve_seconds is not None:
        status += f", {plan.solve_seconds:.2f} s"
    lines = [
        f"{schedule.describe()}, {len(plan.layer_names)} layers",
        f"status          {status}",
        f"iteration time  {format_ms(plan.iteration_time_ms)} ms",
        bubble_line(plan.bubble),
    ]
    if plan.weight_split_assumed:
        lines.append("note            weight-gradient times not in the profile: I and W each took half of B")
    if not recompute_runs_under(schedule.name) and set(plan.layer_modes) - {NONE}:
        lines.append(
            f"note            on torch (TorchTitan, sapp_hook.build_stages): {no_recompute_reason(schedule.name)}; "
            "--modes none plans without it"
        )
    rows = []
    for rank, chunk_ranges in enumerate(plan.rank_chunk_ranges()):
        counts = "+".join(str(len(r)) for r in chunk_ranges)
        modes = {mode: 0 for mode in MODE_ORDER}
        for layers in chunk_ranges:
            for index in layers:
                modes[plan.layer_modes[index]] += 1
        recompute = ", ".join(f"{mode} {count}" for mode, count in modes.items() if count and mode != "none") or "-"
        peak = plan.rank_peak_memory_bytes[rank]
        share = "" if math.isinf(budget) else f" ({peak / budget:.0%})"
        rows.append((rank, counts, recompute, f"{format_bytes(peak):>12}{share}"))
    # columns as wide as their longest entry, and at least as wide as the headers' usual room
    counts_width = max(18, *(len(row[1]) for row in rows))
    recompute_width = max(28, *(len(row[2]) for row in rows))
    for rank, counts, recompute, peak in [("rank", "layers per chunk", "recompute", f"{'peak memory':>12}"), *rows]:
        lines.append(f"{rank:>5}  {counts:<{counts_width}}  {recompute:<{recompute_width}}  {peak}")
    if not math.isinf(budget):
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"memory budget   {format_bytes(budget)} per device: {verdict}")
    lines.append("MindFormers     " + "; ".join(f"{key}: {value}" for key, value in plan.mindformers().items()))
    return "\n".join(lines)


def against_even(plan: Plan, profile: ModelProfile) -> tuple[str, dict[str, object] | None]:
    """How the plan compares with the split people start from (layers spread evenly, no recompute,
    else full recompute where that does not fit): a report line, and the same as JSON (None where
    the even split leaves a virtual stage empty, which the plan does not)."""
    try:
        even = even_plan(profile, plan.spec)
    except InputError as error:
        return f"even split      none: {error.detail}", None
    recomputed = even if even.fits else even_plan(profile, plan.spec, FULL)
    data = {
        "iteration_time": even.iteration_time_ms,
        "fits": even.fits,
        "rank_peak_memory_bytes": list(even.rank_peak_memory_bytes),
        "full_recompute_iteration_time": None if even.fits else recomputed.iteration_time_ms,
        "full_recompute_fits": None if even.fits else recomputed.fits,
    }
    if even.fits:
        return (
            f"even split      {format_ms(even.iteration_time_ms)} ms: the plan is "
            f"{even.iteration_time_ms / plan.iteration_time_ms:.2f}x as fast"
        ), data
    worst = max(range(len(even.rank_peak_memory_bytes)), key=lambda s: even.rank_peak_memory_bytes[s])
    tail = (
        (
            f"; with full recompute {format_ms(recomputed.iteration_time_ms)} ms, the plan is "
            f"{recomputed.iteration_time_ms / plan.iteration_time_ms:.2f}x as fast"
        )
        if recomputed.fits
        else ""
    )
    return (
        f"even split      does not fit: rank {worst} peaks at {format_bytes(even.rank_peak_memory_bytes[worst])}{tail}"
    ), data
