"""The one measurement made outside the training steps: a block re-run alone on a copy of an input it
saw, with the backward split as zero-bubble schedules split it (input gradients, then weight
gradients). How much of the backward the weight gradients take, and how much of what the block saved
the weight-gradient call leaves held (torch frees the rest of the graph only when it goes away).
Random number generators are restored, so training goes on as if this never ran."""

from __future__ import annotations

import statistics

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from profiler.clock import clock_for
from profiler.held import HeldActivations
from profiler.recompute import set_recompute
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




class _Chain(nn.Module):
    """Blocks run one after another, each on the previous one's output and the same other arguments
    (rotary tables, masks)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden: torch.Tensor, *rest: object, **kwargs: object) -> torch.Tensor:
        for block in self.blocks:
            hidden = _output_tensor(block(hidden, *rest, **kwargs))
        return hidden


def retained_share(blocks: list[nn.Module], args: tuple, kwargs: dict, device: torch.device, mode: str) -> float | None:
    """The share of a block's saved bytes torch's split backward keeps after W, for a block another block
    follows in its stage (most of a stage's blocks): from one block and from two in a row. The last
    block of a stage keeps less; counting it like the others errs on the side of memory."""
    alone = retained_fraction(blocks[0], args, kwargs, device, mode)
    if alone is None or len(blocks) < 2:
        return alone
    pair = retained_fraction(_Chain(blocks[:2]), args, kwargs, device, mode)
    if pair is None:
        return alone
    return min(1.0, max(alone, 2 * pair - alone))  # the pair keeps one followed block and one last block


def retained_fraction(module: nn.Module, args: tuple, kwargs: dict, device: torch.device, mode: str) -> float | None:
    """Of the bytes `module` saves under recompute `mode`, the share still held after the input-gradient
    and weight-gradient steps as torch.distributed.pipelining runs them (its `stage_backward_input`,
    which keeps the graph, then `stage_backward_weight`, which starts from the saved intermediates)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    inputs, params = _differentiable(module, args, kwargs)
    if not inputs or not params:
        return None
    accelerators = _accelerators(device)
    gradients = [p.grad for p in params]  # the user's: put back untouched
    undos = [set_recompute(block, mode) for block in (module.blocks if isinstance(module, _Chain) else [module])]
    try:
        for param in params:
            param.grad = None
        with torch.random.fork_rng(devices=accelerators, device_type=device.type), \
                HeldActivations([*module.parameters(), *module.buffers()]) as held:
            output = _output_tensor(module(*args, **kwargs))
            saved = held.live_bytes
            if output is None or not saved:
                return None
            _, groups = stage_backward_input([output], [torch.ones_like(output)], inputs, iter(params))
            stage_backward_weight(iter(params), groups)
            return held.live_bytes / saved
    finally:
        for undo in undos:
            undo()
        for param, gradient in zip(params, gradients):
            param.grad = gradient


def _differentiable(module: nn.Module, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[nn.Parameter]]:
    """The inputs and parameters a backward of `module` differentiates."""
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    return inputs, [p for p in module.parameters() if p.requires_grad]


def _accelerators(device: torch.device) -> list[torch.device]:
    """The devices whose random state fork_rng must save besides the CPU's."""
    return [device] if device.type != "cpu" else []
