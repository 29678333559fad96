"""The measurements made outside the training steps: a block re-run alone on a copy of an input it
saw, with the backward split as zero-bubble schedules split it (input gradients, then weight
gradients), for how much of the backward the weight gradients take and what is held between the
two. Random number generators and the parameters' gradients are restored, so training goes on as
if this never ran."""

from __future__ import annotations

import contextlib
import statistics

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._pytree import tree_leaves

from profiler.clock import clock_for, memory_for
from profiler.cpu_memory import CpuMemory
from profiler.recorder import _output_tensor


def weight_fraction(module: nn.Module, args: tuple, kwargs: dict, device: torch.device, repeats: int = 3) -> float | None:
    """The share of `module`'s backward spent on weight gradients: one backward for the input gradient
    alone, one for everything, on the same graph; the median over `repeats` after a warm-up."""
    inputs, params = _differentiable(module, args, kwargs)
    if not inputs or not params:
        return None
    clock = clock_for(device)
    fractions = []
    accelerators = _accelerators(device)
    with torch.random.fork_rng(devices=accelerators, device_type=device.type):
        for attempt in range(repeats + 1):
            output = _output_tensor(module(*args, **kwargs))
            if output is None:
                return None
            grad = torch.ones_like(output)
            start = clock.mark()
            torch.autograd.grad(output, inputs, grad, retain_graph=True)
            middle = clock.mark()
            torch.autograd.grad(output, inputs + params, grad)
            end = clock.mark()
            clock.synchronize()
            input_ms, total_ms = clock.elapsed_ms(start, middle), clock.elapsed_ms(middle, end)
            if attempt and total_ms > 0:
                fractions.append(min(1.0, max(0.0, (total_ms - input_ms) / total_ms)))
    return float(statistics.median(fractions)) if fractions else None


def pending_gradient_bytes(module: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> int | None:
    """What torch's split backward holds for `module` from its input gradients to its weight gradients
    (`stage_backward_input`, then `stage_backward_weight`, as its pipeline stages run them): the
    gradients of its weighted ops' outputs, in bytes as the allocator counts them."""
    inputs, params = _differentiable(module, args, kwargs)
    if not inputs or not params:
        return None
    memory = memory_for(device) or CpuMemory()
    counting = memory if isinstance(memory, CpuMemory) else contextlib.nullcontext()
    gradients = [p.grad for p in params]  # stage_backward_weight accumulates into .grad
    for p in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=_accelerators(device), device_type=device.type), counting:
            output = _output_tensor(module(*args, **kwargs))
            if output is None:
                return None
            grad = torch.ones_like(output)
            before = memory.allocated()
            input_grads, param_groups = stage_backward_input([output], [grad], inputs, iter(params))
            del input_grads  # sent on by the engine
            held = memory.allocated() - before
            stage_backward_weight(iter(params), param_groups)
    finally:
        for p, gradient in zip(params, gradients):
            p.grad = gradient
    return max(held, 0)


def _differentiable(module: nn.Module, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[nn.Parameter]]:
    """The inputs and parameters a backward of `module` differentiates."""
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    return inputs, [p for p in module.parameters() if p.requires_grad]


def _accelerators(device: torch.device) -> list[torch.device]:
    """The devices whose random state fork_rng must save besides the CPU's."""
    return [device] if device.type != "cpu" else []
