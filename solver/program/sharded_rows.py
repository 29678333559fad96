"""Data parallelism's memory within a step as the program states it (`solver.parallel.sharding` for one split,
`simulator.sharded` for its replay): per virtual stage, as expressions in the layer counts, what it holds
gathered, its step gradients and what its reduce leaves, exactly; the working sets of gathering and of
the reduce, and the full backward that makes the step gradients (counted from its start, where the
replay adds them layer by layer), as bounds from above (the replay, exact, checks every plan)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from basics.units import MIB
from simulator.actions import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from simulator.sharded import UNSHARD, torch_unshard_events
from solver.engine_memory import torch_reduce_held_bytes, torch_unshard_lookahead
from solver.parallel.sharding import reduce_peak, tracks_step
from solver.program.groups import LayerGroup
from solver.program.milp import Linear
from solver.program.placement import LayerPlacement
from solver.vocabulary.profile import HEAD, NONE

# working-set keys besides the ops: a forward that gathers, the reduce, a backward that gathers again,
# and what every backward action holds besides its own working set (one layer gathered: ZeRO-3)
GATHER, GATHER_FIRST, REDUCE, BACKWARD_EXTRA = "gather", "gather-first", "reduce", "backward-extra"
REGATHER, REGATHER_GATHER = "regather", "regather-gather"  # a backward's own work, and its gathers
SHARDED_SETS = (GATHER, GATHER_FIRST, REDUCE, REGATHER, REGATHER_GATHER)
STATES = 3  # per chunk: gathered, holding its step gradients, reduced


@dataclass
class ShardedMemory:
    """Per virtual stage, in MiB: held while in each state (gathered, step gradients, reduced), and the
    working sets `GATHER` (a forward that gathers, above what it leaves), `GATHER_FIRST` (the same,
    at its first unit, above what it started from), `REDUCE`, `REGATHER` and `REGATHER_GATHER` (a whole
    backward that finds the chunk re-sharded by a forward: its units gathered with one's own working set,
    or with one more unit being gathered) and `BACKWARD_EXTRA` (on top of every backward action's own).
    Each bounds what `solver.parallel.sharding` counts from above."""

    gathered: list[Linear]
    step_gradient: list[Linear]
    reduced: list[Linear]
    working: list[dict[str, Linear]]
    reshards: bool  # forwards re-shard what they gather (reshard after forward, ZeRO-3)
    regathers: bool  # and backwards gather it again, and keep it (FSDP)


def sharded_memory(placement: LayerPlacement, placement_working: list[dict[str, Linear]]) -> ShardedMemory | None:
    """What `costs.pipeline_costs` counts of data parallelism within a step, as the program states it
    (`placement_working`: each virtual stage's backward working sets); None where nothing
    (`solver.parallel.sharding.tracks_step`)."""
    spec = placement.spec
    if not tracks_step(spec):
        return None
    num_virtual_stages = placement.schedule.num_virtual_stages
    handed = placement.profile.stage_output_bytes / MIB
    buffered = handed if spec.receive_buffers else 0.0  # a first layer's saved input, one of torch's buffers
    gathered = placement.virtual_stage_sums(lambda g, m: g.parameter_mib if spec.fsdp else 0.0)
    step_gradient = placement.virtual_stage_sums(lambda g, m: g.step_gradient_mib)
    reduced = placement.virtual_stage_sums(lambda g, m: g.reduced_gradient_mib)
    reduce_held = torch_reduce_held_bytes(placement.profile, spec)
    working = []
    for virtual in range(num_virtual_stages):

        def largest(size: Callable[[LayerGroup, str], float], v: int = virtual) -> Linear:
            return _largest(placement, v, size)

        seed = placement.profile.loss_bytes / MIB if virtual == num_virtual_stages - 1 else 0.0
        sets = {
            GATHER: Linear(),
            GATHER_FIRST: Linear(),
            REDUCE: Linear(),
            REGATHER: Linear(),
            REGATHER_GATHER: Linear(),
            BACKWARD_EXTRA: Linear(),
        }
        if spec.fsdp and spec.fsdp_reshard_after_forward:
            # sharding._forward_walk: the first unit's flat output and copy (above the forward's start); any
            # other's, with the flat output before it, less its activation (above the forward's end)
            sets[GATHER_FIRST] = placement.at_end(virtual, [2 * g.parameter_mib for g in placement.groups], first=True)
            sets[GATHER_FIRST].constant += placement.profile.stage_shared_bytes / MIB
            sets[GATHER] = largest(lambda g, m: g.parameter_mib)
            sets[GATHER].add_expression(
                largest(lambda g, m: 0.0 if g.kind == HEAD else max(0.0, 2 * g.parameter_mib - g.activation_mib[m]))
            )
            # sharding._backward_walk: at most all the chunk's units gathered and the gradient handed to a unit,
            # with a unit's working set, or with one unit more being copied out or prefetched
            for key, on_top in (
                (REGATHER, placement_working[virtual][FULL_BACKWARD]),
                (REGATHER_GATHER, largest(lambda g, m: g.parameter_mib)),
            ):
                sets[key] = Linear(dict(gathered[virtual].terms), gathered[virtual].constant + handed + seed)
                sets[key].add_expression(on_top)
        elif spec.fsdp or spec.zero_stage == 3:  # the copy-out (and the flat output before it), above the forward's end
            sets[GATHER] = largest(lambda g, m: max(0.0, g.parameter_mib - g.activation_mib[m]))
            sets[GATHER].constant += buffered
            if spec.fsdp:
                sets[GATHER].add_expression(largest(lambda g, m: g.parameter_mib))
            else:  # ZeRO-3: one layer gathered with its gradient in every backward action
                sets[BACKWARD_EXTRA] = largest(lambda g, m: g.parameter_mib + g.gradient_mib)
        if spec.fsdp:
            sets[REDUCE] = _reduce_walk(placement, virtual)
            sets[REDUCE].constant += reduce_held[virtual] / MIB
        working.append(sets)
    reshards = spec.fsdp_reshard_after_forward or (spec.zero_stage == 3 and not spec.fsdp)
    return ShardedMemory(
        gathered, step_gradient, reduced, working, reshards, spec.fsdp and spec.fsdp_reshard_after_forward
    )


def _reduce_walk(placement: LayerPlacement, virtual: int) -> Linear:
    """`sharding._reduce_walk` over the layers virtual stage `virtual` holds: the embedding's reduce first,
    each body layer's after the layers before it have freed their gathered parameters and gradients
    (less what these leave), the LM head's last, after all of them."""
    spec = placement.spec

    def size(g: LayerGroup, m: str) -> float:
        return reduce_peak(g.parameter_mib, g.gradient_mib, spec.data_parallel, spec.collective_backend == "gloo")

    def freed(g: LayerGroup, m: str) -> float:
        return g.parameter_mib + g.gradient_mib - g.reduced_gradient_mib

    pinned = [g for g in placement.groups if g.pinned_virtual_stage == virtual]
    first = [g for g in pinned if g.kind == HEAD]
    freed_first = sum(g.size * freed(g, NONE) for g in first)
    body = {count: -freed(placement.groups[g], m) for g, m, count in placement.counts_at[virtual]}
    last_rows = [(size(g, NONE) - freed_first, body) for g in pinned if g.kind != HEAD]
    return placement.largest(
        virtual,
        max([0.0, *(size(g, NONE) for g in first)]),
        lambda g, m: size(g, m) - freed_first,
        last_rows,
        freed,
        front_to_back=True,
    )


def _largest(placement: LayerPlacement, virtual: int, size: Callable[[LayerGroup, str], float]) -> Linear:
    """The largest `size` over the layers virtual stage `virtual` holds, at least 0."""
    pinned = [size(g, NONE) for g in placement.groups if g.pinned_virtual_stage == virtual]
    return placement.largest(virtual, max([0.0, *pinned]), size)


class ShardedStates:
    """One rank's walk through its action list: per chunk, whether it is gathered, holds its step
    gradients, or was reduced (1 or 0 each, in `flags`: a row adds what each state holds), and the
    working sets of its points."""

    def __init__(self, placement: LayerPlacement, memory: ShardedMemory | None, ops: list[tuple[int, str]]) -> None:
        self.memory, self.chunks = memory, placement.schedule.chunks
        self.flags = [0] * (STATES * self.chunks)
        self.events = torch_unshard_events([chunk for chunk, _ in ops], torch_unshard_lookahead(placement.spec))
        self.last_weight = {chunk: i for i, (chunk, op) in enumerate(ops) if op in (FULL_BACKWARD, BACKWARD_WEIGHT)}

    def before(self, index: int, chunk: int, op: str) -> str | None:
        """Torch's unshard and reshard events before action `index`, and a first weight-gradient
        action's gradients (counted from its start); REGATHER where the action is a backward that
        gathers the chunk again, else None."""
        if self.memory is None:
            return None
        for event, event_chunk in self.events[index]:
            self.flags[event_chunk] = 1 if event == UNSHARD else 0
        if op in (FULL_BACKWARD, BACKWARD_WEIGHT) and not self.flags[2 * self.chunks + chunk]:
            self.flags[self.chunks + chunk] = 1
        return REGATHER if op != FORWARD and self.memory.regathers and not self.flags[chunk] else None

    def after(self, index: int, chunk: int, op: str) -> str | None:
        """Update the states after action `index`; the working-set key of the point it adds after it
        (a forward that gathered, the reduce), None for none."""
        if self.memory is None:
            return None
        if op == FORWARD:
            gathers = self.gathers(chunk)
            self.flags[chunk] = 0 if self.memory.reshards else 1
            return GATHER if gathers else None
        if self.memory.regathers:  # a backward keeps what it gathers
            self.flags[chunk] = 1
        return REDUCE if self.last_weight.get(chunk) == index else None

    def gathers(self, chunk: int) -> bool:
        """Whether a forward of `chunk` gathers its parameters now: where they are not gathered, and
        always where each layer is gathered for its own work (ZeRO-3)."""
        return self.memory is not None and (
            not self.flags[chunk] or (self.memory.reshards and not self.memory.regathers)
        )

    def reduce(self, chunk: int) -> None:
        self.flags[chunk] = self.flags[self.chunks + chunk] = 0
        self.flags[2 * self.chunks + chunk] = 1

    def add_to(self, row: Linear, flags: tuple[int, ...], rank_stages: list[int]) -> None:
        """What the states in `flags` (as `self.flags`) hold, added to `row`."""
        if self.memory is None:
            return
        for chunk, virtual in enumerate(rank_stages):
            for state, part in enumerate((self.memory.gathered, self.memory.step_gradient, self.memory.reduced)):
                if flags[state * self.chunks + chunk]:
                    row.add_expression(part[virtual])
