"""One rank's share of a plan run in one process, on any device: the rank's actions run in the
schedule's order, with random tensors standing in for what the other ranks would send.

torch's pipelines need a device per rank; this checks the simulator's per-rank predictions (compute time,
held activations, the allocator's peak) on a machine with one accelerator, rank by rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from basics.errors import InputError
from profiler.measure.clock import clock_for, device_of, memory_for
from profiler.measure.held import HeldActivations
from sapp_hook.pipelining.stages import build_stages
from simulator.actions import FORWARD, FULL_BACKWARD
from solver import Plan


@dataclass(frozen=True)
class OneDeviceRank:
    """What one rank's step measured (the last of the steps run). The held peak comes from
    saved-tensor hooks, which do not see what selective recompute keeps in its own cache; the
    allocator does."""

    rank: int
    forward_ms: float  # all its F actions
    backward_ms: float  # all its B actions, recompute included
    held_peak_bytes: int  # what autograd held for backward at its peak
    allocated_peak_bytes: int | None  # the allocator's peak above the step's start; None on the CPU


def run_on_one_device(
    model: nn.Module, plan: Plan, rank: int, *, micro_batch_size: int, seq_len: int, steps: int = 2, seed: int = 0
) -> OneDeviceRank:
    """Run `rank`'s actions of `plan` for `steps` steps on the device `model` lies on; the last step's figures.

    The token ids of every micro-batch are made before the step, as data a pipeline holds for the whole
    step (the prediction leaves them out too). Gradients stay allocated between steps, as in training.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError("steps", f"expected an integer >= 1, got {steps!r}")
    schedule = plan.simulation.schedule
    ops = {action.op for action in schedule.rank_actions[rank]}
    if not ops <= {FORWARD, FULL_BACKWARD}:
        raise InputError(
            "plan", f"{schedule.name} splits the backward into I and W actions; a one-device run takes F and B only"
        )
    device = device_of(model)
    modules = dict(build_stages(model, plan, rank))
    parameters = [p for module in modules.values() for p in module.parameters()]
    hidden_size = model.config.get_text_config().hidden_size
    vocab_size = model.config.get_text_config().vocab_size
    dtype = parameters[0].dtype
    clock, memory = clock_for(device), memory_for(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(
            0, vocab_size, (schedule.micro_batches, micro_batch_size, seq_len), device=device, generator=generator
        )
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        marks: list[tuple[str, object, object]] = []
        if memory is not None:
            memory.reset_peak()
            start_bytes = memory.allocated()
        with HeldActivations([*model.parameters(), *model.buffers(), ids]) as held:
            for action in schedule.rank_actions[rank]:
                module = modules[action.stage_index]
                key = (action.stage_index, action.microbatch)
                started = clock.mark()
                if action.op == FORWARD:
                    inputs = (
                        ids[action.microbatch]
                        if module.first
                        else torch.randn(
                            micro_batch_size,
                            seq_len,
                            hidden_size,
                            device=device,
                            dtype=dtype,
                            generator=generator,
                            requires_grad=True,
                        )
                    )
                    output = module(inputs)
                    if module.last:
                        output = model.loss_function(
                            logits=output, labels=ids[action.microbatch], vocab_size=vocab_size
                        )
                    outputs[key] = output
                else:
                    output = outputs.pop(key)
                    gradient = (
                        None
                        if module.last
                        else torch.randn(output.shape, device=device, dtype=output.dtype, generator=generator)
                    )
                    output.backward(gradient)
                    del output, gradient
                marks.append((action.op, started, clock.mark()))
        clock.synchronize()
        allocated_peak = memory.peak() - start_bytes if memory is not None else None
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.zero_()
    forward_ms = sum(clock.elapsed_ms(start, end) for op, start, end in marks if op == FORWARD)
    backward_ms = sum(clock.elapsed_ms(start, end) for op, start, end in marks if op == FULL_BACKWARD)
    return OneDeviceRank(rank, forward_ms, backward_ms, held.peak_bytes, allocated_peak)
