"""The measurements made outside the training steps: a block re-run alone on a copy of an input it
saw, its backward split as torch's pipeline stages split it for zero-bubble schedules (input
gradients, then weight gradients: `stage_backward_input`, `stage_backward_weight`), for what each
half takes against one plain backward and what is held between the two. Random number generators
and the parameters' gradients are restored, so training goes on as if this never ran."""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._pytree import tree_leaves

from profiler.measure.clock import clock_for, memory_for
from profiler.measure.cpu_memory import CpuMemory
from profiler.measure.recorder import _output_tensor

HELD_COUNTS = 3  # what a split holds is counted this many times, the median kept


@dataclass(frozen=True)
class SplitBackward:
    """A block's backward split in two, against one plain backward of the same block.

    input_share, weight_share: the input-gradient and weight-gradient halves' times over the plain
    backward's (they may add up to more than 1: torch's two calls cost more than one backward).
    pending_bytes: what the first half leaves held for the second (`RecomputeCost.pending_bytes`).
    input_working_bytes, weight_working_bytes: what each half holds at its peak above what was held
    when it began (`RecomputeCost.input_working_bytes`, `weight_working_bytes`).
    input_held_bytes: what the first half holds as it ends, when the input's gradient is formed,
    before torch detaches the output and frees the graph on its side (for a loss, what it saved).
    output_gradient_freed_bytes: what of the gradient handed in the first half frees, the second
    not needing it.
    weight_freed_bytes: what the second half frees while the graph stays alive, as a layer after
    this one in its stage keeps it (`RecomputeCost.weight_freed_bytes`).
    """

    input_share: float
    weight_share: float
    pending_bytes: int
    input_working_bytes: int
    weight_working_bytes: int
    input_held_bytes: int
    output_gradient_freed_bytes: int
    weight_freed_bytes: int


def measure_split_backward(
    module: nn.Module, args: tuple, kwargs: dict, device: torch.device, repeats: int = 3
) -> SplitBackward | None:
    """Time `repeats` plain backwards and split ones of `module` after a warm-up (medians of the
    shares), then count what a split holds between its halves (HELD_COUNTS times, the median of
    each field). None where the block takes no input gradient or has no parameters."""
    inputs, params = _differentiable(module, args, kwargs)
    if not inputs or not params:
        return None
    clock = clock_for(device)
    gradients = [p.grad for p in params]  # stage_backward_weight accumulates into .grad, in place
    _clear_gradients([], params)
    shares: list[tuple[float, float]] = []
    try:
        with torch.random.fork_rng(devices=_accelerators(device), device_type=device.type):
            for attempt in range(repeats + 1):
                output = _output_tensor(module(*args, **kwargs))
                if output is None:
                    return None
                grad = torch.ones_like(output)
                start = clock.mark()
                torch.autograd.grad(output, inputs + params, grad)
                plain = clock.mark()
                output = _output_tensor(module(*args, **kwargs))
                begin = clock.mark()
                _, param_groups = stage_backward_input([output], [grad], inputs, iter(params))
                middle = clock.mark()
                stage_backward_weight(iter(params), param_groups)
                end = clock.mark()
                clock.synchronize()
                plain_ms = clock.elapsed_ms(start, plain)
                if attempt and plain_ms > 0:
                    shares.append(
                        (clock.elapsed_ms(begin, middle) / plain_ms, clock.elapsed_ms(middle, end) / plain_ms)
                    )
                _clear_gradients(inputs, params)
            # a collective's buffer its backend frees late (gloo, on its own thread) can fall in one count
            counts = [_held_bytes(module, args, kwargs, inputs, params, device) for _ in range(HELD_COUNTS)]
            held = None if None in counts else tuple(map(statistics.median_low, zip(*counts)))
    finally:
        for p, gradient in zip(params, gradients):
            p.grad = gradient
    if not shares or held is None:
        return None
    pending, input_peak, weight_peak, input_held, freed, weight_freed = held
    return SplitBackward(
        input_share=float(statistics.median(share for share, _ in shares)),
        weight_share=float(statistics.median(share for _, share in shares)),
        pending_bytes=pending,
        input_working_bytes=input_peak,
        weight_working_bytes=weight_peak,
        input_held_bytes=input_held,
        output_gradient_freed_bytes=freed,
        weight_freed_bytes=weight_freed,
    )


def _held_bytes(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    inputs: list[torch.Tensor],
    params: list[nn.Parameter],
    device: torch.device,
) -> tuple[int, int, int, int, int, int] | None:
    """As the allocator counts it: what the input-gradient half leaves held for the weight-gradient
    half (the gradients of the weighted ops' outputs, which the weight gradients need, and the
    input's, which torch leaves on the input; less what the first half frees of the graph the second
    does not use), what each half holds at its peak above what was held when it began, what the
    first holds as the input's gradient is formed, before it frees that graph, what of the
    gradient handed in it frees (dropped, it goes unless the second half needs it), and what the
    second frees while the graph lives on. The
    weight gradients accumulate in place, as into the gradients a step's earlier micro-batches left:
    only their transients count (a tiny-moe MoE block's W: 4.75 MiB, where the profile's working set
    of its whole backward is 3.6 MiB; a pipeline run's W held 4.75)."""
    memory = memory_for(device) or CpuMemory()
    counting = memory if isinstance(memory, CpuMemory) else contextlib.nullcontext()
    with counting:
        for p in params:
            p.grad = torch.zeros_like(p)
        output = _output_tensor(module(*args, **kwargs))
        if output is None:
            return None
        grad = torch.ones_like(output)
        memory.reset_peak()
        before = memory.allocated()
        at_input_gradient: list[int] = []
        hooks = [tensor.register_hook(lambda _: at_input_gradient.append(memory.allocated())) for tensor in inputs]
        try:
            input_grads, param_groups = stage_backward_input([output], [grad], inputs, iter(params))
        finally:
            for hook in hooks:
                hook.remove()
        input_peak = memory.peak() - before
        del input_grads  # sent on by the engine
        held = memory.allocated() - before
        del grad  # the engine's, handed in: the weight gradients may keep it
        freed = held - (memory.allocated() - before)
        # in a stage, later layers keep this one's graph alive until the stage's W ends: hold its start nodes alike
        graph = [node for group in param_groups for node in group["intermediates"]]
        memory.reset_peak()
        weight_start = memory.allocated()
        stage_backward_weight(iter(params), param_groups)
        weight_peak = memory.peak() - weight_start
        weight_freed = weight_start - memory.allocated()
        del graph
        _clear_gradients(inputs, params)
    held = max(held, 0)
    return (
        held,
        max(input_peak, 0),
        max(weight_peak, 0),
        max([held] + [at - before for at in at_input_gradient]),
        max(freed, 0),
        max(weight_freed, held),
    )


def _clear_gradients(inputs: list[torch.Tensor], params: list[nn.Parameter]) -> None:
    """Drop what a split backward accumulated into `.grad` (the inputs' and the parameters')."""
    for tensor in [*inputs, *params]:
        tensor.grad = None


def _differentiable(module: nn.Module, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[nn.Parameter]]:
    """The inputs and parameters a backward of `module` differentiates."""
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    return inputs, [p for p in module.parameters() if p.requires_grad]


def _accelerators(device: torch.device) -> list[torch.device]:
    """The devices whose random state fork_rng must save besides the CPU's."""
    return [device] if device.type != "cpu" else []
