"""A Plan: which contiguous layers each virtual stage holds and each layer's recompute mode, with
what the simulator says of it. Views as MindFormers keys, per-stage layer counts and per-layer lists."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from simulator import ChunkCosts, PipelineCosts, Schedule, schedule_kind, simulate
from simulator.errors import InputError
from simulator.result import BubbleSplit, SimulationResult
from solver.fields import Fields
from solver.profile import COMM, FULL, HEAD, NONE, SELECTIVE, SELECTIVE_COMM, TAIL, LayerProfile, ModelProfile
from solver.spec import PipelineSpec, spec_from_dict, spec_to_dict

# Within a virtual stage, the order MindFormers' per-stage counts imply: recompute (full) layers
# first, then select+comm, then select or comm, then the rest.
MODE_ORDER = (FULL, SELECTIVE_COMM, SELECTIVE, COMM, NONE)
MINDFORMERS_KEYS = ("offset", "recompute", "select_recompute", "select_comm_recompute", "pp_interleave_num")


def ordered_modes(counts: Mapping[str, int]) -> list[str]:
    """One mode per layer, in MODE_ORDER."""
    return [mode for mode in MODE_ORDER for _ in range(counts.get(mode, 0))]


@dataclass(frozen=True)
class Plan:
    """A layer split and recompute choice, simulated. Virtual stage v holds layers
    [sum(counts[:v]), sum(counts[:v+1])) of the model."""

    spec: PipelineSpec
    layer_names: tuple[str, ...]
    layer_kinds: tuple[str, ...]
    stage_layer_counts: tuple[int, ...]  # per virtual stage, in model order
    layer_modes: tuple[str, ...]
    iteration_time_ms: float
    bubble: BubbleSplit
    stage_peak_memory_bytes: tuple[float, ...]
    weight_split_assumed: bool
    status: str = "given"  # "optimal", "feasible" (time limit; see gap) or "given" (not searched)
    gap: float | None = None  # proven relative gap to the best possible iteration time
    lower_bound_ms: float | None = None
    solve_seconds: float | None = None
    simulation: SimulationResult | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return all(peak <= self.spec.memory_budget_bytes for peak in self.stage_peak_memory_bytes)

    def with_search(self, *, status: str, gap: float, lower_bound_ms: float, solve_seconds: float) -> Plan:
        return dataclasses.replace(
            self, status=status, gap=gap, lower_bound_ms=lower_bound_ms, solve_seconds=solve_seconds
        )

    def virtual_stage_ranges(self) -> list[range]:
        """The layers each virtual stage holds, in model order."""
        ranges, start = [], 0
        for count in self.stage_layer_counts:
            ranges.append(range(start, start + count))
            start += count
        return ranges

    def stage_chunk_ranges(self) -> list[list[range]]:
        """[stage][chunk]: the layers chunk `chunk` of pipeline stage `stage` holds."""
        schedule = self.spec.pipeline_schedule
        ranges = self.virtual_stage_ranges()
        return [[ranges[virtual] for virtual in schedule.stages_of(stage)] for stage in range(schedule.stages)]

    def mindformers(self) -> dict[str, object]:
        """MindFormers' keys (see `mindformers_view`)."""
        return mindformers_view(self.spec.pipeline_schedule, self.layer_kinds, self.layer_modes, self.stage_layer_counts)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: the outcome, the spec, and the plan in every view."""
        schedule = self.spec.pipeline_schedule
        stage_of = {}
        for virtual, layers in enumerate(self.virtual_stage_ranges()):
            for index in layers:
                stage_of[index] = virtual
        return {
            "status": self.status,
            "iteration_time": self.iteration_time_ms,
            "time_unit": "ms",
            "gap": self.gap,
            "lower_bound_ms": self.lower_bound_ms,
            "solve_seconds": self.solve_seconds,
            "bubble": self.bubble.to_dict(),
            "stage_peak_memory_bytes": [round(b) for b in self.stage_peak_memory_bytes],
            "memory_budget_bytes": None if math.isinf(self.spec.memory_budget_bytes) else self.spec.memory_budget_bytes,
            "fits": self.fits,
            "weight_split_assumed": self.weight_split_assumed,
            "spec": spec_to_dict(self.spec),
            "plan": {
                **self.mindformers(),
                "virtual_stage_layers": list(self.stage_layer_counts),
                "stage_chunk_layers": [[len(r) for r in row] for row in self.stage_chunk_ranges()],
                "layers": [
                    {
                        "name": name,
                        "kind": kind,
                        "virtual_stage": stage_of[index],
                        "stage": schedule.rank_of(stage_of[index]),
                        "chunk": schedule.chunk_of(stage_of[index]),
                        "recompute": mode,
                    }
                    for index, (name, kind, mode) in enumerate(zip(self.layer_names, self.layer_kinds, self.layer_modes))
                ],
            },
        }


def mindformers_view(
    schedule: Schedule, layer_kinds: Sequence[str], layer_modes: Sequence[str], stage_layer_counts: Sequence[int]
) -> dict[str, object]:
    """MindFormers' keys: per chunk and stage, body layers held minus the even share
    floor(n / (stages x chunks)), and the recompute counts (full layers count in all three)."""
    body = sum(1 for kind in layer_kinds if kind not in (HEAD, TAIL))
    share = body // schedule.num_stages
    starts = [0, *itertools.accumulate(stage_layer_counts)]
    keys: dict[str, list[list[int]]] = {key: [] for key in MINDFORMERS_KEYS[:4]}
    for chunk in range(schedule.chunks):
        rows: dict[str, list[int]] = {key: [] for key in keys}
        for stage in range(schedule.stages):
            virtual = schedule.stage_index(stage, chunk)
            counts = dict.fromkeys(MODE_ORDER, 0)
            for index in range(starts[virtual], starts[virtual] + stage_layer_counts[virtual]):
                if layer_kinds[index] not in (HEAD, TAIL):
                    counts[layer_modes[index]] += 1
            full_or_both = counts[FULL] + counts[SELECTIVE_COMM]
            rows["offset"].append(sum(counts.values()) - share)
            rows["recompute"].append(counts[FULL])
            rows["select_recompute"].append(full_or_both + counts[SELECTIVE])
            rows["select_comm_recompute"].append(full_or_both + counts[COMM])
        for key in keys:
            keys[key].append(rows[key])
    flat = schedule.chunks == 1
    view: dict[str, object] = {key: value[0] if flat else value for key, value in keys.items()}
    view["pp_interleave_num"] = schedule.chunks
    return view


def torch_splits_backward(spec: PipelineSpec) -> bool:
    """Whether torch's engine (`spec.receive_buffers`) runs the schedule's backward split in two, where
    it differs from the split the profile states in two ways. Virtual stage 0, whose input takes no
    gradient, runs its whole backward at its W, its I doing nothing (so nothing waits between them:
    `_PipelineStageBase.backward_weight_one_chunk`). Every other stage's I leaves its input's
    gradient on the input (`stage_backward_input` sets its `.grad`), where it stays until the next
    step clears it: part of what the profile measures as pending until W, kept after where the input
    came from another rank (`torch_engine_bytes`).
    The last stage's I drops the model's output (the logits), which the engine kept from its forward.
    Its W runs the layers in model order, each freeing its pending gradients: the tail's last."""
    return spec.receive_buffers and schedule_kind(spec.schedule).splits_backward


def torch_keeps_sends(spec: PipelineSpec) -> bool:
    """Whether torch's engine (`spec.receive_buffers`) keeps every tensor a stage sends to another
    rank until the step ends: a send request holds its tensor while it lives (measured with gloo;
    NCCL's until its wait where it avoids record streams, else less: on the safe side),
    and every schedule torch runs but 1F1B keeps its requests to the step's end
    (`_PipelineScheduleRuntime` waits on them after its last action, `ScheduleGPipe` keeps them in
    lists); `Schedule1F1B` drops each at its next exchange."""
    return spec.receive_buffers and spec.schedule != "1F1B"


def torch_hands_gradient_over(spec: PipelineSpec) -> list[bool]:
    """Per virtual stage, whether torch's split backward (`torch_splits_backward`) puts the gradient
    its I computes for the stage's input into the previous stage's output-gradient buffer, in place of
    what the buffer held (counted with the buffers, `boundary_bytes`): where the input was handed
    over on the rank (a V schedule's turn), not received from another."""
    schedule = spec.pipeline_schedule
    split = torch_splits_backward(spec)
    return [split and virtual > 0 and schedule.rank_of(virtual - 1) == schedule.rank_of(virtual)
            for virtual in range(schedule.num_stages)]


def handed_gradient_bytes(layer: LayerProfile, stage_output_bytes: float) -> float:
    """What a stage's first layer pends less where torch hands its input's gradient over on the rank
    (`torch_hands_gradient_over`): the gradient, a stage output's size, which its pending bytes count
    (measured profiles do), at most what it pends (the least over its modes, as the search's program
    counts a stage's first layer)."""
    return min(stage_output_bytes, min(cost.pending_bytes for cost in layer.recompute.values()))


def torch_1f1b_held_bytes(profile: ModelProfile, spec: PipelineSpec) -> list[float]:
    """Per stage, what torch's `Schedule1F1B` (`spec.receive_buffers`) holds of the tensors a stage sends
    past their micro-batch, counted for the whole step (exact from the backward after the first, where
    its peaks are; before, on the safe side): the last output its warm-up sends, whose request it
    keeps until the cool-down (where the warm-up runs two or more forwards), and the input gradient
    its last backward sent back, whose send it keeps until the next backward has run (from the
    second on). Zeros elsewhere. Measured with gloo on tiny-llama's fully recomputed 1F1B: each one
    stage output the allocator held that the plan did not count."""
    if not (spec.receive_buffers and spec.schedule == "1F1B"):
        return [0.0] * spec.pipeline_schedule.num_stages
    stages, micro_batches = spec.pipeline_schedule.stages, spec.micro_batches
    held = []
    for stage in range(stages):
        keeps_output = stage < stages - 1 and min(micro_batches, stages - stage) >= 2
        keeps_input_gradient = stage > 0 and micro_batches >= 2
        held.append((keeps_output + keeps_input_gradient) * profile.stage_output_bytes)
    return held


def torch_engine_bytes(profile: ModelProfile, spec: PipelineSpec) -> tuple[list[float], list[float]]:
    """Per virtual stage, what torch's engine adds to the layers' retained bytes (kept from a
    micro-batch's last backward action to the step's end) and pending bytes (from I to W). Under its
    split (`torch_splits_backward`): the input's gradient, kept on the input, where the input came
    from another rank (where it was handed over on the rank: `handed_gradient_bytes`); and less the
    logits, which the last stage drops at I. Where it keeps its sends (`torch_keeps_sends`): the
    output each stage sends to another rank, and, where the backward is whole, the input gradient it
    sends back (split, that is the gradient above: one tensor). And the last stage's loss
    (`profile.loss_bytes`), which the engine keeps for the step's losses. Zeros elsewhere."""
    schedule = spec.pipeline_schedule
    last = schedule.num_stages - 1
    retained, pending = [0.0] * schedule.num_stages, [0.0] * schedule.num_stages
    split, keeps_sends = torch_splits_backward(spec), torch_keeps_sends(spec)
    for virtual in range(schedule.num_stages):
        rank = schedule.rank_of(virtual)
        receives = virtual > 0 and schedule.rank_of(virtual - 1) != rank
        sends_output = virtual < last and schedule.rank_of(virtual + 1) != rank
        keeps_input_gradient = receives and (split or keeps_sends)  # on the input's .grad, or in its send
        keeps_output = sends_output and keeps_sends
        retained[virtual] = (keeps_input_gradient + keeps_output) * profile.stage_output_bytes
    if split:
        pending[-1] -= profile.model_output_bytes - profile.loss_bytes
    if spec.receive_buffers:
        retained[-1] += profile.loss_bytes
    return retained, pending


def boundary_bytes(profile: ModelProfile, spec: PipelineSpec) -> tuple[list[float], list[float]]:
    """Per virtual stage, what the engine keeps of the tensors stages pass (`profile.stage_output_bytes`
    each): per micro-batch in flight, the output it sent, until the output's gradient comes back; for
    the whole run, with `spec.receive_buffers` (torch's engine), torch's buffers: one per micro-batch
    for the input received (every virtual stage but the first) and one for the output gradient (all
    but the last). torch's engine also keeps the last stage's output, the model's
    (`profile.model_output_bytes`, the logits), per micro-batch in flight: the loss is computed from
    it outside the stage, and the stage holds it until that micro-batch's backward (GPipe's last
    rank, 8 micro-batches of tiny-llama: 32 MiB its allocator held that the plan did not count)."""
    schedule = spec.pipeline_schedule
    last = schedule.num_stages - 1
    size = profile.stage_output_bytes
    in_flight, whole_run = [], []
    for virtual in range(schedule.num_stages):
        # torch hands an output to the next virtual stage on the same rank as that stage's input
        # buffer: the buffers hold it, not a copy
        local = virtual < last and schedule.rank_of(virtual + 1) == schedule.rank_of(virtual)
        if virtual == last:
            in_flight.append(profile.model_output_bytes if spec.receive_buffers else 0.0)
        else:
            in_flight.append(0.0 if spec.receive_buffers and local else size)
        buffers = (virtual > 0) + (virtual < last) if spec.receive_buffers else 0
        whole_run.append(buffers * spec.micro_batches * size)
    return in_flight, whole_run


def pipeline_costs(profile: ModelProfile, spec: PipelineSpec, counts: tuple[int, ...], modes: tuple[str, ...]) -> PipelineCosts:
    """The simulator's per-(stage, chunk) costs of a split: sums over each chunk's layers, its
    working set the largest of theirs, each stage's constant memory on its first chunk, and what the
    engine keeps of the tensors stages pass (`boundary_bytes`, `torch_1f1b_held_bytes`) and of their
    backwards (`torch_engine_bytes`). The layers' retained bytes count where the backward is split only."""
    schedule = spec.pipeline_schedule
    constant = profile.stage_constant_bytes + spec.stage_constant_bytes
    kept_in_flight, kept_whole_run = boundary_bytes(profile, spec)
    in_buffers = buffered_input_bytes(profile, spec, counts)
    torch_retained, torch_pending = torch_engine_bytes(profile, spec)
    hands_over = torch_hands_gradient_over(spec)
    held_sends = torch_1f1b_held_bytes(profile, spec)
    forward_overhead, backward_overhead, weight_overhead = spec.action_overheads_ms()
    splits, torch_split = schedule_kind(spec.schedule).splits_backward, torch_splits_backward(spec)
    grid: list[list[ChunkCosts]] = [[None] * schedule.chunks for _ in range(schedule.stages)]  # type: ignore[list-item]
    start = 0
    for virtual, count in enumerate(counts):
        layers = [(profile.layers[i], modes[i]) for i in range(start, start + count)]
        start += count
        stage, chunk = schedule.rank_of(virtual), schedule.chunk_of(virtual)
        whole = torch_split and virtual == 0
        # what the stage computes for its blocks (the rotary tables), where it holds one
        shared = profile.stage_shared_bytes if any(layer.is_body for layer, _ in layers) else 0.0
        handed_gradient = (handed_gradient_bytes(layers[0][0], profile.stage_output_bytes)
                           if hands_over[virtual] and layers else 0.0)
        # the loss's gradient (a scalar's), which the last stage's backward starts from and holds to
        # its end (its I's where split): no layer's working set counts it, as none counts the
        # gradient handed to it (a pipeline run's allocator held these 4 bytes more on the loss's rank)
        seed = profile.loss_bytes if virtual == schedule.num_stages - 1 else 0.0
        grid[stage][chunk] = ChunkCosts(
            forward_ms=sum(layer.forward_ms for layer, _ in layers) + forward_overhead,
            backward_ms=sum(layer.backward_ms for layer, _ in layers) + backward_overhead,
            weight_ms=sum(layer.backward_ms if whole else layer.split_weight_ms() for layer, _ in layers)
            + weight_overhead,
            input_ms=(0.0 if whole else sum(layer.split_input_ms() for layer, _ in layers))
            + backward_overhead - weight_overhead,
            recompute_ms=sum(layer.recompute[mode].extra_ms for layer, mode in layers),
            activation_bytes=sum(layer.recompute[mode].activation_bytes for layer, mode in layers)
            + kept_in_flight[virtual] - in_buffers[virtual] + shared,
            retained_bytes=(sum(layer.recompute[mode].retained_bytes for layer, mode in layers) if splits else 0.0)
            + torch_retained[virtual],
            pending_bytes=(0.0 if whole else _pending_bytes(layers, splits))
            + torch_pending[virtual] - handed_gradient,
            static_bytes=sum(
                spec.static_bytes(layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes)
                for layer, _ in layers
            )
            + (constant if chunk == 0 else 0.0)
            + kept_whole_run[virtual]
            + held_sends[virtual],
            working_bytes=_working_bytes(layers, one_backward=whole or not splits, handed_bytes=profile.stage_output_bytes,
                                         shared_bytes=shared) + seed,
            **(_split_working_bytes(layers, tail_weight_last=torch_split, seed_bytes=seed)
               if splits and not whole else {}),
            **({"input_working_bytes": 0.0} if whole else {}),  # torch's I does nothing there
        )
    return PipelineCosts(tuple(tuple(row) for row in grid), p2p_ms=spec.p2p_ms)


def _working_bytes(layers: list[tuple[LayerProfile, str]], *, one_backward: bool, handed_bytes: float,
                   shared_bytes: float) -> float:
    """What a chunk holds above its activations while its backward runs: the largest working set of
    its layers. Where one backward runs the whole chunk (`one_backward`: not a split backward, which
    keeps the graph for the weight gradients) each layer's backward frees what it saved, so the tail
    layers, last in the model, go first and free their activations (the LM head's logits) before
    any other layer's backward (measured on an H200: full recompute on the last rank was
    over-predicted by 13.6% without this, 2.0% with it), and the head layers go last, when every
    other layer of the chunk has freed its activations (the embedding's gradient, as large as the
    embedding, comes then: in the validation study the first rank's allocator peak was over-predicted
    by up to 32% without this, within 7% with it). What went before them leaves them the gradient of
    their output (`handed_bytes`, as large as a stage's output), which their working sets, measured
    from its arrival, do not hold (the first rank of tiny-llama's fully recomputed 1F1B, 3.3% under
    without it); the blocks have freed what the stage computed for them too (`shared_bytes`, the
    rotary tables, 0 where the chunk holds no block: the first rank 32 KiB over without it). Body
    layers are counted less the tail's activations only, as the search states them."""
    if not one_backward:
        return max([layer.recompute[mode].working_bytes for layer, mode in layers], default=0.0)
    kinds = {layer.kind for layer, _ in layers}
    freed_by_tail = sum(layer.recompute[mode].activation_bytes for layer, mode in layers if layer.kind == TAIL)
    freed_before_head = shared_bytes + sum(
        layer.recompute[mode].activation_bytes for layer, mode in layers if layer.kind != HEAD)
    freed = {TAIL: 0.0, HEAD: freed_before_head - (handed_bytes if kinds - {HEAD} else 0.0)}
    body_freed = freed_by_tail - (handed_bytes if TAIL in kinds else 0.0)
    return max([layer.recompute[mode].working_bytes - freed.get(layer.kind, body_freed) for layer, mode in layers],
               default=0.0)


def buffered_input_bytes(profile: ModelProfile, spec: PipelineSpec, counts: Sequence[int]) -> list[float]:
    """Per virtual stage, what its first layer keeps of its input where that input is one of torch's
    receive buffers (`spec.receive_buffers`: every stage but the first, the V's turn on one rank
    included), which `boundary_bytes` counts for the whole run: the layer keeps that tensor, not a
    copy (fp32 blocks keep their input, bf16 Llama blocks an fp32 copy of it). Zeros elsewhere."""
    starts = list(itertools.accumulate(counts, initial=0))
    return [saved_input_bytes(profile.layers[start]) if spec.receive_buffers and virtual > 0 and count else 0.0
            for virtual, (start, count) in enumerate(zip(starts, counts))]


def saved_input_bytes(layer: LayerProfile) -> float:
    """What of its input `layer` keeps for its backward, the least over its recompute modes (as the
    search's program counts a stage's first layer)."""
    return min(cost.saved_input_bytes for cost in layer.recompute.values())


def last_layer_bytes(layer: LayerProfile) -> tuple[float, float]:
    """Where `layer` comes last in its stage (model order) under a split backward: the least it would
    keep beyond its pending bytes were another layer to follow it (`RecomputeCost.inner_extra_bytes`),
    which it does not keep, and the most it frees of the gradient handed to it, which no layer after
    it hands back; over its recompute modes, as the search's program counts them."""
    costs = layer.recompute.values()
    return min(cost.inner_extra_bytes() for cost in costs), max(cost.output_gradient_freed_bytes for cost in costs)


def _pending_bytes(layers: list[tuple[LayerProfile, str]], splits: bool) -> float:
    """What a chunk's split backward holds from its I to its W: every layer's pending bytes, and the
    extra each but the last keeps where another follows it (pending and extra together: all its I
    holds but what it frees)."""
    if not splits or not layers:
        return sum(layer.recompute[mode].pending_bytes for layer, mode in layers)
    return _kept_by_inputs(layers) - last_layer_bytes(layers[-1][0])[0]


def _kept_by_inputs(layers: list[tuple[LayerProfile, str]]) -> float:
    """The sum over a chunk's layers of what each one's I holds less what it frees of the gradient
    handed to it."""
    return sum(layer.recompute[mode].split_input_held_bytes() - layer.recompute[mode].output_gradient_freed_bytes
               for layer, mode in layers)


def _split_working_bytes(layers: list[tuple[LayerProfile, str]], *, tail_weight_last: bool,
                         seed_bytes: float = 0.0) -> dict[str, float]:
    """What each half of a chunk's split backward holds above what was held when it began. The I
    half runs the layers last to first, each forming its pending gradients, which stay for W: the
    tail's first, with nothing pending yet; then what every layer's I leaves held until the chunk's
    I ends (its `input_held_bytes`, less what the layer before it frees of the gradient it hands that
    layer: the sum takes each layer's own freed bytes but the last's, to which no layer hands one,
    `last_layer_bytes`) plus the most any other layer's I holds above its own (exact where that layer
    comes first in the chunk, more otherwise). The W half starts with the pending gradients held:
    the most any layer's W holds, but the tail's less what every other layer's W has freed where
    its W runs last (`tail_weight_last`: torch's engine; `RecomputeCost.weight_freed_bytes`). I holds
    `seed_bytes` besides (the loss's gradient, on the last stage)."""
    held = _kept_by_inputs(layers) + (last_layer_bytes(layers[-1][0])[1] if layers else 0.0)
    tail = [layer.recompute[mode].split_input_working_bytes() for layer, mode in layers if layer.kind == TAIL]
    others = [layer.recompute[mode].split_input_working_bytes() - layer.recompute[mode].split_input_held_bytes()
              for layer, mode in layers if layer.kind != TAIL]
    freed_by_others = sum(layer.recompute[mode].split_weight_freed_bytes() for layer, mode in layers
                          if layer.kind != TAIL)
    return {
        "input_working_bytes": max(tail + ([held + max(0.0, *others)] if others else []), default=0.0) + seed_bytes,
        "weight_working_bytes": max([layer.recompute[mode].split_weight_working_bytes()
                                     - (freed_by_others if layer.kind == TAIL and tail_weight_last else 0.0)
                                     for layer, mode in layers], default=0.0),
    }


def evaluate_plan(
    profile: ModelProfile, spec: PipelineSpec, counts: tuple[int, ...] | list[int], modes: tuple[str, ...] | list[str]
) -> Plan:
    """Check a split and recompute choice against the profile and spec, and simulate it."""
    counts, modes = tuple(counts), tuple(modes)
    schedule = spec.pipeline_schedule
    layers = profile.layers
    if len(counts) != schedule.num_stages:
        raise InputError("stage_layer_counts", f"expected {schedule.num_stages} virtual stages, got {len(counts)}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise InputError("stage_layer_counts", f"expected integers >= 0, got {list(counts)}")
    if sum(counts) != len(layers):
        raise InputError("stage_layer_counts", f"sum to {sum(counts)}; the profile has {len(layers)} layers")
    heads = sum(1 for layer in layers if layer.kind == HEAD)
    tails = sum(1 for layer in layers if layer.kind == TAIL)
    if counts[0] < heads:
        raise InputError("stage_layer_counts", f"the first virtual stage must hold all {heads} head layers")
    if counts[-1] < tails:
        raise InputError("stage_layer_counts", f"the last virtual stage must hold all {tails} tail layers")
    if not spec.allow_empty_chunks and 0 in counts:
        raise InputError("stage_layer_counts", f"virtual stage {counts.index(0)} is empty (allow empty chunks to permit it)")
    if len(modes) != len(layers):
        raise InputError("layer_modes", f"expected one recompute mode per layer ({len(layers)}), got {len(modes)}")
    for index, (layer, mode) in enumerate(zip(layers, modes)):
        if not isinstance(mode, str) or mode not in layer.recompute:
            raise InputError(
                f"layer_modes[{index}]", f"{layer.name} offers {', '.join(layer.modes)}; got {mode!r}"
            )
    result = simulate(schedule, pipeline_costs(profile, spec, counts, modes))
    return Plan(
        spec=spec,
        layer_names=tuple(layer.name for layer in layers),
        layer_kinds=tuple(layer.kind for layer in layers),
        stage_layer_counts=counts,
        layer_modes=modes,
        iteration_time_ms=result.iteration_time_ms,
        bubble=result.bubble,
        stage_peak_memory_bytes=result.stage_peak_memory_bytes,
        weight_split_assumed=result.weight_split_assumed,
        simulation=result,
    )


def plan_from_mindformers(profile: ModelProfile, spec: PipelineSpec, keys: Mapping[str, object]) -> Plan:
    """A user's hand-made plan from MindFormers' keys (offset and the three recompute counts)."""
    unknown = sorted(set(keys) - set(MINDFORMERS_KEYS))
    if unknown:
        raise InputError(unknown[0], f"unknown key; expected {', '.join(MINDFORMERS_KEYS)}")
    schedule = spec.pipeline_schedule
    stages, chunks = schedule.stages, schedule.chunks
    interleave = keys.get("pp_interleave_num", chunks)
    if interleave != chunks:
        raise InputError("pp_interleave_num", f"the plan has {interleave!r} chunks; the spec runs {chunks}")
    body = [i for i, layer in enumerate(profile.layers) if layer.is_body]
    share = len(body) // schedule.num_stages
    offset = _per_cell(keys.get("offset", 0), "offset", stages, chunks, per_stage=None)
    body_counts = [[share + offset[c][s] for s in range(stages)] for c in range(chunks)]
    for c in range(chunks):
        for s in range(stages):
            if body_counts[c][s] < 0:
                raise InputError(f"offset[{c}][{s}]", f"leaves {body_counts[c][s]} layers (even share {share})")
    total = sum(map(sum, body_counts))
    if total != len(body):
        raise InputError("offset", f"gives {total} body layers; the profile has {len(body)} (even share {share} each)")
    full = _per_cell(keys.get("recompute", 0), "recompute", stages, chunks, per_stage=body_counts)
    # Fully recomputed layers count in both select lists; a list not given holds just those.
    select = _per_cell(keys.get("select_recompute", full), "select_recompute", stages, chunks, per_stage=body_counts)
    comm = _per_cell(keys.get("select_comm_recompute", full), "select_comm_recompute", stages, chunks, per_stage=body_counts)

    counts = [0] * schedule.num_stages
    cell_modes: list[list[str]] = [[] for _ in range(schedule.num_stages)]
    for c in range(chunks):
        for s in range(stages):
            where = f"[{c}][{s}]"
            held, f, sel, com = body_counts[c][s], full[c][s], select[c][s], comm[c][s]
            for key, value in (("select_recompute", sel), ("select_comm_recompute", com)):
                if value < f:
                    raise InputError(f"{key}{where}", f"is {value}, below recompute ({f}): full recompute counts in it too")
            both = max(0, min(sel - f, com - f))
            modes = {FULL: f, SELECTIVE_COMM: both, SELECTIVE: sel - f - both, COMM: com - f - both}
            if sum(modes.values()) > held:
                raise InputError(f"select_recompute{where}", f"recomputes {sum(modes.values())} layers of a stage holding {held}")
            modes[NONE] = held - sum(modes.values())
            virtual = schedule.stage_index(s, c)
            counts[virtual] = held
            cell_modes[virtual] = ordered_modes(modes)
    layer_modes = [NONE] * len(profile.layers)
    position = 0
    for virtual in range(schedule.num_stages):
        for mode in cell_modes[virtual]:
            index = body[position]
            if mode not in profile.layers[index].recompute:
                raise InputError("recompute", f"asks for {mode} recompute of {profile.layers[index].name}, which the profile does not offer")
            layer_modes[index] = mode
            position += 1
    heads = sum(1 for layer in profile.layers if layer.kind == HEAD)
    tails = sum(1 for layer in profile.layers if layer.kind == TAIL)
    counts[0] += heads
    counts[-1] += tails
    return evaluate_plan(profile, spec, counts, layer_modes)


def _per_cell(value: object, key: str, stages: int, chunks: int, per_stage: list[list[int]] | None) -> list[list[int]]:
    """MindFormers' forms: a bool (true: every layer of each stage), 0, a list per stage, or a list per chunk of lists."""
    if isinstance(value, bool):
        if per_stage is None:
            raise InputError(key, f"expected integers, got {value!r}")
        return [[held if value else 0 for held in row] for row in per_stage]
    if value == 0 and not isinstance(value, list):
        return [[0] * stages for _ in range(chunks)]
    if isinstance(value, list) and value and not isinstance(value[0], list):
        value = [value]
    if not isinstance(value, list) or len(value) != chunks or any(not isinstance(row, list) or len(row) != stages for row in value):
        raise InputError(key, f"expected {chunks} list(s) of {stages} integers (one per stage), got {value!r}")
    cells = []
    for c, row in enumerate(value):
        cells.append([])
        for s, item in enumerate(row):
            if isinstance(item, bool) and per_stage is not None:
                item = per_stage[c][s] if item else 0
            elif isinstance(item, bool) or not isinstance(item, int) or (per_stage is not None and item < 0):
                raise InputError(f"{key}[{c}][{s}]", f"expected an integer{' >= 0' if per_stage else ''}, got {item!r}")
            cells[c].append(item)
    return cells


def plan_from_dict(profile: ModelProfile, data: object) -> Plan:
    """Read back a plan JSON (Plan.to_dict) and re-simulate it against `profile`."""
    fields = Fields(data, "")
    spec = spec_from_dict(fields.raw("spec"))
    plan = Fields(fields.raw("plan"), "plan")
    counts = plan.raw("virtual_stage_layers")
    layer_items = plan.raw("layers")
    if not isinstance(layer_items, list) or len(layer_items) != len(profile.layers):
        raise InputError("plan.layers", f"expected {len(profile.layers)} layers like the profile")
    modes = []
    for index, item in enumerate(layer_items):
        layer = Fields(item, f"plan.layers[{index}]")
        name = layer.text("name", required=True)
        if name != profile.layers[index].name:
            raise InputError(layer.at("name"), f"is {name!r}; the profile's layer {index} is {profile.layers[index].name!r}")
        modes.append(layer.text("recompute", required=True))
    if not isinstance(counts, list):
        raise InputError("plan.virtual_stage_layers", f"expected a list of integers, got {counts!r}")
    return evaluate_plan(profile, spec, counts, modes)


def even_counts(layers: int, stages: int) -> list[int]:
    """`layers` spread evenly over `stages`, the first ones taking one more where they do not divide."""
    return [layers // stages + (1 if v < layers % stages else 0) for v in range(stages)]


def even_plan(profile: ModelProfile, spec: PipelineSpec, mode: str = NONE) -> Plan:
    """The split people start from: body layers spread evenly over the virtual stages (the first ones
    take one more where they do not divide), head layers on the first, tail layers on the last, every
    body layer under recompute `mode`. Simulated like any plan; it may not fit."""
    stages = spec.pipeline_schedule.num_stages
    heads = sum(1 for layer in profile.layers if layer.kind == HEAD)
    tails = sum(1 for layer in profile.layers if layer.kind == TAIL)
    body = len(profile.layers) - heads - tails
    counts = even_counts(body, stages)
    counts[0] += heads
    counts[-1] += tails
    modes = [mode if layer.is_body and mode in layer.recompute else NONE for layer in profile.layers]
    return evaluate_plan(profile, spec, counts, modes)
