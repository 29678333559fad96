"""Layer groups: runs of consecutive layers with identical costs, which the search treats as
interchangeable copies (it counts layers per group instead of placing each one)."""

from __future__ import annotations

from dataclasses import dataclass

from basics.errors import InputError
from basics.units import MIB
from simulator.schedule import Schedule
from solver.parallel.sharding import layer_static, step_gradient_bytes
from solver.vocabulary.profile import BODY_PREFIX, HEAD, TAIL, LayerProfile, ModelProfile
from solver.vocabulary.spec import PipelineSpec


@dataclass
class LayerGroup:
    """Consecutive layers with identical costs, planned as interchangeable copies of their first."""

    kind: str  # the first layer's: head, tail, or one of the body kinds the group holds
    first: int
    size: int
    modes: tuple[str, ...]
    forward_ms: float
    backward_ms: float
    weight_ms: float
    input_ms: float
    static_mib: float
    parameter_mib: float  # whole, as gathered (solver.parallel.sharding)
    gradient_mib: float
    step_gradient_mib: float  # what comes at its chunk's first weight-gradient action, and stays after the reduce
    reduced_gradient_mib: float
    extra_ms: dict[str, float]
    activation_mib: dict[str, float]
    working_mib: dict[str, float]
    input_working_mib: dict[str, float]  # where the backward is split: its I half's, and its W half's
    weight_working_mib: dict[str, float]
    retained_mib: dict[str, float]
    pending_mib: dict[str, float]
    input_held_mib: dict[str, float]  # what its I leaves held until its stage's I ends
    output_gradient_freed_mib: dict[str, float]  # what its I frees of the gradient handed to it
    weight_freed_mib: dict[str, float]  # what its W frees before its stage's W ends
    pinned_virtual_stage: int | None = None  # heads and tails do not move

    def kept_by_input_mib(self, mode: str) -> float:
        """What its I holds less what it frees of the gradient handed to it: where a layer follows it
        in its chunk, what it keeps until W (its pending bytes and its inner extra)."""
        return self.input_held_mib[mode] - self.output_gradient_freed_mib[mode]


def layer_groups(profile: ModelProfile, spec: PipelineSpec, num_virtual_stages: int) -> list[LayerGroup]:
    """Runs of consecutive layers with identical costs: the solver's interchangeable units. Body layers
    of different kinds that cost the same (Gemma-2's sliding and global attention at a sequence no
    longer than the window) share a group; heads and tails never join the body's; layers that cost
    differently form separate groups, kept in model order."""
    runs: list[list[int]] = []
    for index, layer in enumerate(profile.layers):
        if runs and _costs_key(profile.layers[runs[-1][0]]) == _costs_key(layer):
            runs[-1].append(index)
        else:
            runs.append([index])
    groups = []
    for run in runs:
        layer = profile.layers[run[0]]
        modes = _undominated_modes(layer)
        groups.append(
            LayerGroup(
                kind=layer.kind,
                first=run[0],
                size=len(run),
                modes=modes,
                forward_ms=layer.forward_ms,
                backward_ms=layer.backward_ms,
                weight_ms=layer.split_weight_ms(),
                input_ms=layer.split_input_ms(),
                static_mib=layer_static(spec, layer).total / MIB,
                parameter_mib=layer.parameter_bytes / MIB,
                gradient_mib=layer.gradient_bytes / MIB,
                step_gradient_mib=step_gradient_bytes(spec, layer.gradient_bytes, layer.parameter_bytes)[0] / MIB,
                reduced_gradient_mib=step_gradient_bytes(spec, layer.gradient_bytes, layer.parameter_bytes)[1] / MIB,
                extra_ms={m: layer.recompute[m].extra_ms for m in modes},
                activation_mib={m: layer.recompute[m].activation_bytes / MIB for m in modes},
                working_mib={m: layer.recompute[m].working_bytes / MIB for m in modes},
                input_working_mib={m: layer.recompute[m].split_input_working_bytes() / MIB for m in modes},
                weight_working_mib={m: layer.recompute[m].split_weight_working_bytes() / MIB for m in modes},
                retained_mib={m: layer.recompute[m].retained_bytes / MIB for m in modes},
                pending_mib={m: layer.recompute[m].pending_bytes / MIB for m in modes},
                input_held_mib={m: layer.recompute[m].split_input_held_bytes() / MIB for m in modes},
                output_gradient_freed_mib={m: layer.recompute[m].output_gradient_freed_bytes / MIB for m in modes},
                weight_freed_mib={m: layer.recompute[m].split_weight_freed_bytes() / MIB for m in modes},
                pinned_virtual_stage=0
                if layer.kind == HEAD
                else num_virtual_stages - 1
                if layer.kind == TAIL
                else None,
            )
        )
    return groups


def _undominated_modes(layer: LayerProfile) -> tuple[str, ...]:
    """Modes no other mode beats on extra time and every amount of memory alike (the first of equals)."""
    costs = {
        m: (
            c.extra_ms,
            c.activation_bytes,
            c.working_bytes,
            c.retained_bytes,
            c.pending_bytes,
            c.split_input_working_bytes(),
            c.split_weight_working_bytes(),
            c.split_input_held_bytes(),
            c.inner_extra_bytes(),
            -c.output_gradient_freed_bytes,
            -c.split_weight_freed_bytes(),
        )
        for m, c in layer.recompute.items()
    }
    kept = []
    for mode in layer.modes:
        beaten = any(
            all(o <= c for o, c in zip(costs[other], costs[mode])) and (costs[other] != costs[mode] or other in kept)
            for other in layer.modes
            if other != mode
        )
        if not beaten:
            kept.append(mode)
    return tuple(kept)


def _costs_key(layer: LayerProfile) -> tuple:
    # a body kind's name changes no cost: alternating kinds that cost the same (Gemma-2) make one group
    return (
        BODY_PREFIX if layer.is_body else layer.kind,
        layer.forward_ms,
        layer.backward_ms,
        layer.split_weight_ms(),
        layer.split_input_ms(),
        layer.parameter_bytes,
        layer.gradient_bytes,
        layer.optimizer_bytes,
        layer.parameter_tensors,
        layer.expert_parameter_bytes,
        tuple(sorted(layer.recompute.items())),
    )


def check_room(schedule: Schedule, groups: list[LayerGroup], spec: PipelineSpec) -> None:
    if spec.allow_empty_chunks:
        return
    pinned_virtual_stages = {g.pinned_virtual_stage for g in groups if g.pinned_virtual_stage is not None}
    body = sum(g.size for g in groups if g.pinned_virtual_stage is None)
    needed = schedule.num_virtual_stages - len(pinned_virtual_stages)
    if body < needed:
        raise InputError(
            "pipeline_parallel",
            f"{schedule.ranks} x {schedule.chunks} (ranks x chunks) make {schedule.num_virtual_stages} virtual stages, "
            f"but only {body} body layers can fill the {needed} without a head or tail; "
            "use fewer ranks or chunks, or allow empty chunks",
        )
