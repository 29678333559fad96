"""sapp-hook inside a Megatron-core training loop: the forward-backward function Megatron's pipeline schedules
give (`get_forward_backward_func()`), wrapped so that each pipeline rank profiles the model chunk it holds in the
schedule's own steps, one rank plans and writes the job's launch script, and the relaunch trains with the plan.

    forward_backward = autotuned(get_forward_backward_func(), model, optimizer,
                                 memory_budget="70GB", config="train.sh")
    for iteration in range(iterations):
        forward_backward(forward_step_func=step, data_iterator=data, model=model, num_microbatches=8, ...)
        optimizer.step()
        optimizer.zero_grad()

    sapp-hook run -- bash train.sh

A step ends with the optimizer's step (without an optimizer, or where Megatron skips its step, where the next
call of the wrapped function starts); calls with `forward_only=True` (evaluation) pass through untouched. The pipeline's size, its process group and the data-,
tensor- and context-parallel degrees come from Megatron's `parallel_state`, the micro-batches from the first call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from basics.errors import InputError
from sapp_hook.hook.tune import AutoTuner

BLOCKS = ("decoder.layers.*",)  # a GPTModel's transformer layers (their layer_number is global, 1-based)
# Megatron's selective recompute is its own (core attention, --recompute-modules), not the profiler's (which
# keeps matmul outputs, and which Megatron's in-place bias-dropout-add refuses): full or none, measured
MODES = ("none", "full")
FROM_THE_JOB = frozenset(
    {
        "pipeline_parallel",
        "stages",  # its former name
        "micro_batches",
        "schedule",
        "chunks",
        "data_parallel",
        "zero_stage",
        "tensor_parallel",
        "context_parallel",
        "pipeline_group",
        "collective_backend",
    }
)


def autotuned(
    forward_backward: Callable[..., Any],
    model: nn.Module | list[nn.Module],
    optimizer: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """Megatron-core's `forward_backward` function, running `sapp_hook.autotune` in its first steps.

    Args:
        forward_backward: what `megatron.core.pipeline_parallel.get_forward_backward_func()` returned.
        model: the model chunk this rank holds (or the list of them), wrapped in Megatron's DDP or not.
        optimizer: a torch optimizer over its parameters, or Megatron's optimizer (its inner torch optimizer is
            read); None leaves optimizer state out of the profile.
        **options: `AutoTuner` options other than those the job states (`FROM_THE_JOB`): `memory_budget`,
            `config` and `target` (the launch script, "megatron" by default where a config is given),
            `profile_steps`, `modes` (default `MODES`), `on_plan`, `cache_dir`, `out_dir`, `time_limit_s`.

    Returns:
        A function called as `forward_backward` is; its `tuner` attribute is the AutoTuner (None before the
        first call).

    Raises:
        InputError: an option the job states, a model of several chunks, or a job the hook cannot profile.
    """
    stated = sorted(FROM_THE_JOB & set(options))
    if stated:
        raise InputError(stated[0], "comes from Megatron's parallel_state and the schedule's calls")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise InputError(
            "model",
            f"holds {len(chunks)} model chunks (virtual pipeline stages); sapp-hook profiles one a rank so far: "
            "profile without --num-layers-per-virtual-pipeline-stage, then plan the interleaved schedule with "
            "`sapp-hook solve --profile`",
        )
    if options.get("config") is not None:
        options.setdefault("target", "megatron")
    options.setdefault("modes", MODES)
    inner = _torch_optimizer(optimizer)
    state: dict[str, Any] = {"tuner": None, "open": False, "hook": None}

    def optimizer_stepped(*_: Any) -> None:
        if state["open"]:  # the step ends with its optimizer's: the last one too, with no call after it
            state["open"] = False
            state["tuner"].step()

    @functools.wraps(forward_backward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("forward_only"):
            return forward_backward(*args, **kwargs)
        if state["hook"] is not None:  # removed here, not in its own call: torch is going over its hooks then
            state["hook"].remove()
            state["hook"] = None
        tuner = state["tuner"]
        if tuner is None:
            tuner = state["tuner"] = tuner_for(chunks[0], optimizer, kwargs["num_microbatches"], **options)
            wrapped.tuner = tuner
        elif state["open"]:  # no optimizer step since the last call (none given, or a step Megatron skipped)
            state["open"] = False
            tuner.step()
        try:
            value = forward_backward(*args, **kwargs)
        except BaseException as error:
            tuner.close(error)
            raise
        state["open"] = True
        if inner is not None:  # after the profiler's own hook, which counts the optimizer's steps
            state["hook"] = inner.register_step_post_hook(optimizer_stepped)
        return value

    wrapped.tuner = None
    return wrapped


def tuner_for(chunk: nn.Module, optimizer: Any, micro_batches: int, **options: Any) -> AutoTuner:
    """An `AutoTuner` over the GPTModel inside `chunk`, attached for the schedule's steps."""
    from megatron.core import parallel_state

    model = _unwrapped(chunk)
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    device = next(model.parameters()).device
    tuner = AutoTuner(
        model,
        _torch_optimizer(optimizer),
        pipeline_parallel=pipeline,
        micro_batches=micro_batches,
        schedule="1F1B",  # Megatron's schedule for one chunk a rank
        data_parallel=parallel_state.get_data_parallel_world_size(),
        zero_stage=1 if _distributed_optimizer(optimizer) else 0,  # its optimizer state sharded over data parallel
        tensor_parallel=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel=parallel_state.get_context_parallel_world_size(),
        pipeline_group=parallel_state.get_pipeline_model_parallel_group() if pipeline > 1 else None,
        collective_backend="nccl" if device.type == "cuda" else "gloo",
        layers=BLOCKS,
        **options,
    )
    tuner.profiler.attach()
    return tuner


def _unwrapped(chunk: nn.Module) -> nn.Module:
    """The model inside Megatron's wrappers (DistributedDataParallel, Float16Module): each keeps it in `module`."""
    while not hasattr(chunk, "decoder") and isinstance(getattr(chunk, "module", None), nn.Module):
        chunk = chunk.module
    if not hasattr(chunk, "decoder"):
        raise InputError("model", f"expected a Megatron-core GPTModel (with a decoder), got {type(chunk).__name__}")
    return chunk


def _distributed_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is Megatron's distributed optimizer (`--use-distributed-optimizer`)."""
    return bool(getattr(getattr(optimizer, "config", None), "use_distributed_optimizer", False))


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """`optimizer` as the profiler reads its state: a torch optimizer, or the one Megatron's optimizer wraps."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise InputError("optimizer", f"expected a torch optimizer or Megatron's, got {type(optimizer).__name__}")


__all__ = ["autotuned", "tuner_for"]
