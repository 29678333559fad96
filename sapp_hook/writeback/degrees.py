"""A plan's other parallel degrees (tensor, context, expert, data, FSDP, ZeRO) against those the config it is
written into states, one rule for every target: a config that shards less than the plan assumed is refused
(each device would hold more than the plan's memory check counted); one that shards more, or runs another
data-parallel size, gets a note (the plan's times and memory were predicted for its own layout). A degree
the config does not state (left to a default, or set at launch) says nothing; one whose value a launch may
change gets a note, never a refusal."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from basics.errors import shown
from sapp_hook.writeback.errors import PlanMismatch
from solver import PipelineSpec

TENSOR, CONTEXT, EXPERT, DATA, FSDP, ZERO = "tensor", "context", "expert", "data", "fsdp", "zero"
# the degrees that split the model's memory: fewer ranks (a lower stage) there, more bytes on each
SHARDING = (TENSOR, CONTEXT, EXPERT, FSDP, ZERO)
SOLVE_FLAGS = {
    TENSOR: "--tensor-parallel",
    CONTEXT: "--context-parallel",
    EXPERT: "--expert-parallel",
    DATA: "--data-parallel",
}


@dataclass(frozen=True)
class Stated:
    """One degree as a config states it.

    Attributes:
        degree: which: TENSOR, CONTEXT, EXPERT, DATA, FSDP (the ranks FSDP shards each layer over) or ZERO
            (the ZeRO stage of the sharding over data parallel: 0 none, 1 optimizer state, 2 also gradients,
            3 also parameters).
        key: the config's name for it, as a note says it ("parallel_config.model_parallel").
        value: the degree (ZERO: the stage).
        caveat: what a launch may change it by ("unless TP is set where the script is launched"); a
            difference is then a note, never a refusal.
        said: how the config says it, where not "KEY is VALUE".
        fix: how the config would shard as the plan does, where not "set KEY to" the plan's degree;
            "" where it cannot (Megatron-LM's distributed optimizer shards optimizer state only).
    """

    degree: str
    key: str
    value: int
    caveat: str = ""
    said: str = ""
    fix: str | None = None

    def saying(self) -> str:
        return self.said or f"{self.key} is {shown(self.value)}"


def plan_degree(spec: PipelineSpec, degree: str) -> int:
    """What the plan's spec assumed for `degree` (FSDP: the ranks it shards over, 1 without FSDP; ZERO:
    the ZeRO stage of its sharding over data parallel, 3 for FSDP)."""
    return {
        TENSOR: spec.tensor_parallel,
        CONTEXT: spec.context_parallel,
        EXPERT: spec.expert_parallel,
        DATA: spec.data_parallel,
        FSDP: spec.data_parallel if spec.fsdp else 1,
        ZERO: 3 if spec.fsdp else spec.zero_stage,
    }[degree]


def check_degrees(stated: Iterable[Stated], spec: PipelineSpec | None, where: str, notes: list[str]) -> None:
    """Compare each degree `where` (the config, as messages name it) states with the plan's `spec`.

    Raises:
        PlanMismatch: naming the key, both values and what to do, where the config shards less than the
            plan assumed (a smaller tensor, context, expert or FSDP degree; a lower ZeRO stage; a smaller
            data-parallel size where the plan's ZeRO or FSDP sharded over it).
    """
    if spec is None:
        return
    for each in stated:
        planned = plan_degree(spec, each.degree)
        if each.value == planned or (each.degree == ZERO and each.value < planned and spec.data_parallel == 1):
            continue  # a plan's ZeRO over one data-parallel rank shards nothing
        fewer = _shards_less(each, planned, spec)
        if fewer and not each.caveat:
            raise PlanMismatch(
                f"is for {_planned(each.degree, planned, spec)}; {where}'s {each.saying()}, which shards "
                f"less: each device would hold more than the plan's memory check counted. {_remedy(each, planned, spec)}"
            )
        caveat = f" ({each.caveat})" if each.caveat else ""
        predicted = (
            "; launch it with the plan's or solve again for the config's"
            if each.caveat
            else ": the plan's times and memory were predicted for that layout, not this one"
        )
        notes.append(
            f"{where}'s {each.saying()}{caveat}; the plan is for {_planned(each.degree, planned, spec)}{predicted}"
        )


def _shards_less(each: Stated, planned: int, spec: PipelineSpec) -> bool:
    if each.degree == DATA:  # ZeRO and FSDP shard over data parallel
        return (spec.zero_stage >= 1 or spec.fsdp) and each.value < planned
    return each.degree in SHARDING and each.value < planned


def _planned(degree: str, planned: int, spec: PipelineSpec) -> str:
    if degree == FSDP:
        return f"FSDP over {planned} ranks (solved with --fsdp --data-parallel {planned})" if planned > 1 else "no FSDP"
    if degree == ZERO:
        fsdp = " (FSDP)" if spec.fsdp else ""
        return (
            f"ZeRO stage {planned}{fsdp} over {spec.data_parallel} data-parallel ranks"
            if planned
            else "no ZeRO sharding (optimizer state whole on every rank)"
        )
    zero = ""
    if degree == DATA and (spec.fsdp or spec.zero_stage):
        zero = " with FSDP" if spec.fsdp else f" with ZeRO stage {spec.zero_stage}"
    return f"{degree} parallel {planned}{zero} (solved with {SOLVE_FLAGS[degree]} {planned})"


def _remedy(each: Stated, planned: int, spec: PipelineSpec) -> str:
    """What to do about a config that shards less: solve for it, or give it the plan's degree."""
    if each.degree == ZERO:
        solve = f"--zero-stage {each.value}{' and no --fsdp' if spec.fsdp else ''}"
    elif each.degree == FSDP:
        solve = f"--fsdp --data-parallel {each.value}" if each.value > 1 else "no --fsdp"
    else:
        solve = f"{SOLVE_FLAGS[each.degree]} {each.value}"
    fix = f"set {each.key} to {planned}" if each.fix is None else each.fix
    return f"Solve again with {solve}" + (f", or {fix}" if fix else "")
