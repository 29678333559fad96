"""Why nothing fits: the least peak memory any plan reaches, the rank that holds it, and what to try."""

from __future__ import annotations

from basics.units import MIB, format_bytes
from simulator.schedule import Schedule
from solver.errors import InfeasibleError
from solver.program.formulation import PATHS, IntegerProgram
from solver.program.groups import LayerGroup
from solver.program.milp import MilpResult
from solver.vocabulary.profile import ModelProfile
from solver.vocabulary.spec import PipelineSpec


def infeasible_error(
    profile: ModelProfile, spec: PipelineSpec, schedule: Schedule, groups: list[LayerGroup], time_limit_s: float
) -> InfeasibleError:
    """The least peak memory any plan reaches, which rank holds it, and what to try."""
    program = IntegerProgram(profile, spec, schedule, groups, with_budget=False, timing=PATHS)  # time is free here
    peak = program.add_peak_variable()
    result: MilpResult = program.milp.minimize({peak: 1.0}, time_limit_s=time_limit_s)
    budget = format_bytes(spec.memory_budget_bytes)
    if result.values is None:
        return InfeasibleError(
            f"no plan fits {budget}, and none was found without the budget either in the time left",
            smallest_budget_bytes=None,
            binding_rank=None,
        )
    # The least-peak plan, simulated: its peak is a budget that surely fits.
    least = program.plan(result.values)
    smallest = max(least.rank_peak_memory_bytes)
    rank = least.rank_peak_memory_bytes.index(smallest)
    tries = ["more pipeline ranks"]
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
        f"({smallest:,.0f} bytes), where rank {rank} peaks; try a larger budget, " + ", ".join(tries),
        smallest_budget_bytes=smallest,
        binding_rank=rank,
    )
