"""Small profiles and a brute-force search, shared by the solver tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

from basics.errors import InputError
from solver import LayerProfile, ModelProfile, PipelineSpec, RecomputeCost, evaluate_plan
from solver.formats.mindformers import ordered_modes
from solver.program.formulation import IntegerProgram
from solver.program.groups import layer_groups
from solver.vocabulary.plan import Plan

MIB = 2**20
SAPP = Path(__file__).parent / "fixtures" / "sapp"  # SAPP's own layer files and two of its runs


def layer(
    name: str,
    kind: str,
    forward: float,
    backward: float,
    weight: float | None = None,
    *,
    parameter_mib: float = 0.0,
    modes: dict[str, tuple[float, float, float]] | None = None,
) -> LayerProfile:
    """`modes`: mode -> (extra_ms, activation MiB, working MiB)."""
    modes = modes or {"none": (0.0, 0.0, 0.0)}
    return LayerProfile(
        name=name,
        kind=kind,
        forward_ms=forward,
        backward_ms=backward,
        weight_ms=weight,
        parameter_bytes=parameter_mib * MIB,
        recompute={m: RecomputeCost(e, a * MIB, w * MIB) for m, (e, a, w) in modes.items()},
    )


BODY_MODES = {"none": (0.0, 40.0, 4.0), "selective": (1.0, 22.0, 4.0), "full": (3.0, 5.0, 30.0)}


def small_profile(body_layers: int = 6, *, two_kinds: bool = False) -> ModelProfile:
    """A head, `body_layers` decoder layers (the second half MoE-like when `two_kinds`), a heavy tail."""
    layers = [layer("embed", "head", 1.0, 2.0, 1.0, parameter_mib=60)]
    for i in range(body_layers):
        moe = two_kinds and i >= body_layers // 2
        layers.append(
            layer(
                f"block.{i}",
                "body:moe" if moe else "body:decoder",
                4.0 if moe else 3.0,
                8.0 if moe else 6.0,
                3.5 if moe else 2.5,
                parameter_mib=50 if moe else 30,
                modes=BODY_MODES,
            )
        )
    layers.append(layer("lm_head", "tail", 5.0, 10.0, 5.0, parameter_mib=60, modes={"none": (0.0, 30.0, 0.0)}))
    return ModelProfile(layers=tuple(layers), model="small")


def compositions(total: int, parts: int, least: list[int]) -> Iterator[list[int]]:
    if parts == 1:
        if total >= least[0]:
            yield [total]
        return
    for first in range(least[0], total + 1):
        for rest in compositions(total - first, parts - 1, least[1:]):
            yield [first, *rest]


def brute_force(profile: ModelProfile, spec: PipelineSpec) -> Plan | None:
    """Every split and every mix of recompute modes per virtual stage, simulated; the fastest that fits.
    Layers of one kind are identical, so the order of modes inside a stage changes no cost."""
    fitting = [plan for plan in all_plans(profile, spec) if plan.fits]
    return min(fitting, key=lambda plan: plan.iteration_time_ms, default=None)


def all_plans(profile: ModelProfile, spec: PipelineSpec) -> Iterator[Plan]:
    """Every split and mix of recompute modes, simulated, whether it fits or not."""
    num_virtual_stages = spec.pipeline_schedule.num_virtual_stages
    kinds = [layer.kind for layer in profile.layers]
    heads, tails = kinds.count("head"), kinds.count("tail")
    body = len(kinds) - heads - tails
    least = [
        0 if (c == 0 and heads) or (c == num_virtual_stages - 1 and tails) else 1 for c in range(num_virtual_stages)
    ]
    if spec.allow_empty_chunks:
        least = [0] * num_virtual_stages
    for split in compositions(body, num_virtual_stages, least):
        counts = list(split)
        counts[0] += heads
        counts[-1] += tails
        runs = []  # consecutive body layers of one kind inside one virtual stage
        start = 0
        for count in counts:
            for index in range(start, start + count):
                if profile.layers[index].is_body:
                    if (
                        runs
                        and runs[-1][-1] == index - 1
                        and profile.layers[runs[-1][0]].kind == profile.layers[index].kind
                        and runs[-1][0] >= start
                    ):
                        runs[-1].append(index)
                    else:
                        runs.append([index])
            start += count
        options = [list(_mode_mixes(len(run), profile.layers[run[0]].modes)) for run in runs]
        for mixes in itertools.product(*options):
            layer_modes = ["none"] * len(profile.layers)
            for run, mix in zip(runs, mixes):
                for index, mode in zip(run, mix):
                    layer_modes[index] = mode
            try:
                yield evaluate_plan(profile, spec, counts, layer_modes)
            except InputError:
                continue


def _mode_mixes(count: int, modes: tuple[str, ...]) -> Iterator[list[str]]:
    for combo in itertools.combinations_with_replacement(modes, count):
        yield ordered_modes({m: combo.count(m) for m in modes})


def integer_program(profile: ModelProfile, spec: PipelineSpec, timing: str) -> IntegerProgram:
    """The search's integer program for `profile` under `spec`, the budget's rows included."""
    schedule = spec.pipeline_schedule
    return IntegerProgram(
        profile,
        spec,
        schedule,
        layer_groups(profile, spec, schedule.num_virtual_stages),
        with_budget=True,
        timing=timing,
    )
