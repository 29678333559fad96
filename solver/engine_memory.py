"""What torch's pipelining engine (`spec.receive_buffers`) keeps beyond the layers' own memory: the
tensors stages pass, its receive buffers, its split backward's gradients and its held sends."""

from __future__ import annotations

from simulator import schedule_kind
from solver.vocabulary.profile import LayerProfile, ModelProfile
from solver.vocabulary.spec import PipelineSpec


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
    rank until the step ends: a send request holds its tensor while it lives (gloo's do; NCCL's
    until their wait where it avoids record streams, else less: on the safe side),
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
    return [
        split and virtual > 0 and schedule.rank_of(virtual - 1) == schedule.rank_of(virtual)
        for virtual in range(schedule.num_virtual_stages)
    ]


def handed_gradient_bytes(layer: LayerProfile, stage_output_bytes: float) -> float:
    """What a stage's first layer pends less where torch hands its input's gradient over on the rank
    (`torch_hands_gradient_over`): the gradient, a stage output's size, which its pending bytes count
    (measured profiles do), at most what it pends (the least over its modes, as the search's program
    counts a stage's first layer)."""
    return min(stage_output_bytes, min(cost.pending_bytes for cost in layer.recompute.values()))


def torch_1f1b_held_bytes(profile: ModelProfile, spec: PipelineSpec) -> list[float]:
    """Per rank, what torch's `Schedule1F1B` (`spec.receive_buffers`) holds of the tensors a stage sends
    past their micro-batch, counted for the whole step (exact from the backward after the first, where
    its peaks are; before, on the safe side): the last output its warm-up sends, whose request it
    keeps until the cool-down (where the warm-up runs two or more forwards), and the input gradient
    its last backward sent back, whose send it keeps until the next backward has run (from the
    second on). Zeros elsewhere."""
    if not (spec.receive_buffers and spec.schedule == "1F1B"):
        return [0.0] * spec.pipeline_schedule.num_virtual_stages
    ranks, micro_batches = spec.pipeline_schedule.ranks, spec.micro_batches
    held = []
    for rank in range(ranks):
        keeps_output = rank < ranks - 1 and min(micro_batches, ranks - rank) >= 2
        keeps_input_gradient = rank > 0 and micro_batches >= 2
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
    last = schedule.num_virtual_stages - 1
    retained, pending = [0.0] * schedule.num_virtual_stages, [0.0] * schedule.num_virtual_stages
    split, keeps_sends = torch_splits_backward(spec), torch_keeps_sends(spec)
    for virtual in range(schedule.num_virtual_stages):
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
    it outside the stage, and the stage holds it until that micro-batch's backward."""
    schedule = spec.pipeline_schedule
    last = schedule.num_virtual_stages - 1
    size = profile.stage_output_bytes
    in_flight, whole_run = [], []
    for virtual in range(schedule.num_virtual_stages):
        # torch hands an output on to a stage of the same rank as that stage's input buffer, not a copy
        local = virtual < last and schedule.rank_of(virtual + 1) == schedule.rank_of(virtual)
        if virtual == last:
            in_flight.append(profile.model_output_bytes if spec.receive_buffers else 0.0)
        else:
            in_flight.append(0.0 if spec.receive_buffers and local else size)
        buffers = (virtual > 0) + (virtual < last) if spec.receive_buffers else 0
        whole_run.append(buffers * spec.micro_batches * size)
    return in_flight, whole_run


def torch_reduce_held_bytes(profile: ModelProfile, spec: PipelineSpec) -> list[float]:
    """Per virtual stage, what torch's engine (`spec.receive_buffers`) holds through a chunk's reduce
    besides the chunk's own: `Schedule1F1B` and `ScheduleGPipe` keep the last forward's output in a
    local of their step, which reduces before it returns; on the last stage that is the logits (the
    outputs other stages send, their sends hold: `torch_1f1b_held_bytes`, `torch_keeps_sends`). The
    runtime schedules keep it within one action. Zeros elsewhere."""
    held = [0.0] * spec.pipeline_schedule.num_virtual_stages
    if spec.receive_buffers and spec.schedule in ("1F1B", "GPipe"):
        held[-1] = profile.model_output_bytes
    return held


def torch_unshard_lookahead(spec: PipelineSpec) -> int:
    """How many chunks ahead of their actions torch's runtime schedules gather a rank's FSDP chunks
    (`_add_unshard_reshard`: UNSHARD and RESHARD actions, 3 stages active); 0 where each chunk gathers
    at its first forward (`Schedule1F1B`, `ScheduleGPipe`, engines other than torch's)."""
    return 3 if spec.receive_buffers and spec.fsdp and spec.schedule not in ("1F1B", "GPipe") else 0
