"""sapp-hook inside TorchTitan's `Trainer`: the ranks profile the layers they hold in TorchTitan's own first
steps, one rank plans and writes the job's config, and the relaunch trains with the plan.

    # train.py, TorchTitan's entry with the hook
    from torchtitan.train import Trainer, main
    from sapp_hook.frameworks.torchtitan import autotuned

    if __name__ == "__main__":
        main(autotuned(Trainer, memory_budget="60GB"))

    sapp-hook run -- torchrun --nproc-per-node 8 train.py --job.config_file train.toml

Everything else comes from the job: the pipeline degree, schedule and micro-batches, the data- and
tensor-parallel degrees, the config file it was launched with. TorchTitan's own activation checkpointing is
switched off while the steps are profiled (each recompute mode is measured by the profiler itself) and on
again after.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch import nn

from basics.errors import InputError
from sapp_hook.hook.tune import AutoTuner
from simulator.schedules import schedule_kind

log = logging.getLogger(__name__)

BLOCKS = ("layers.*",)  # each model part's decoder layers: a ModuleDict keyed by their global index
# options `autotuned` sets from the job itself; a caller gives them in TorchTitan's config instead
FROM_THE_JOB = frozenset(
    {
        "pipeline_parallel",
        "stages",  # its former name
        "micro_batches",
        "schedule",
        "chunks",
        "data_parallel",
        "fsdp",
        "ddp",
        "tensor_parallel",
        "context_parallel",
        "pipeline_group",
        "gradients_persist",
        "collective_backend",
    }
)


def autotuned(trainer_class: type, **options: Any) -> type:
    """A subclass of TorchTitan's `trainer_class` that runs `sapp_hook.autotune` in its first steps.

    Args:
        trainer_class: TorchTitan's `Trainer` (or a subclass of it).
        **options: `AutoTuner` options other than those the job states (`FROM_THE_JOB`): `memory_budget`,
            `profile_steps`, `modes`, `on_plan`, `cache_dir`, `out_dir`, `time_limit_s`, `config` and `target`
            (by default the TOML the job was launched with, `--job.config_file`).

    Returns:
        The subclass: `main(autotuned(Trainer))` runs it as TorchTitan's `main(Trainer)` would.

    Raises:
        InputError: an option the job states, or (when the trainer starts) a job the hook cannot profile.

    Example::

        main(autotuned(Trainer, memory_budget="60GB"))
    """
    stated = sorted(FROM_THE_JOB & set(options))
    if stated:
        raise InputError(stated[0], "comes from TorchTitan's job config; set it there")

    class AutotunedTrainer(trainer_class):  # type: ignore[misc, valid-type]
        def __init__(self, job_config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(job_config, *args, **kwargs)
            self.sapp_hook = tuner_for(self, job_config, **options)

        def train_step(self, *args: Any, **kwargs: Any) -> Any:
            if not self.sapp_hook.done:  # profiling (again, after a drift): the profiler's modes, not TorchTitan's
                _bypass_checkpointing(self.model_parts[0])
            try:
                value = super().train_step(*args, **kwargs)
            except BaseException as error:
                self.sapp_hook.close(error)
                raise
            self.sapp_hook.step()
            if self.sapp_hook.done:
                _restore_checkpointing(self.model_parts)
            return value

        def close(self) -> None:
            # TorchTitan's main closes the trainer on an error too, inside its `except`: that error, if any
            self.sapp_hook.close(sys.exc_info()[1])
            _restore_checkpointing(self.model_parts)
            super().close()

    AutotunedTrainer.__name__ = AutotunedTrainer.__qualname__ = f"Autotuned{trainer_class.__name__}"
    return AutotunedTrainer


def tuner_for(trainer: Any, job_config: Any, **options: Any) -> AutoTuner:
    """An `AutoTuner` over the model part this rank of TorchTitan's `trainer` holds, attached for its steps."""
    parallelism = job_config.parallelism
    parts = list(trainer.model_parts)
    if len(parts) != 1:
        raise InputError(
            "parallelism.pipeline_parallel_schedule",
            f"{parallelism.pipeline_parallel_schedule} gives each rank {len(parts)} model parts; sapp-hook profiles "
            "one a rank so far: profile under a schedule of one stage a rank (1F1B), then plan for this one "
            "with `sapp-hook solve --profile`",
        )
    dims = trainer.parallel_dims
    if getattr(dims, "dp_shard", 1) > 1:
        raise InputError(
            "parallelism.data_parallel_shard_degree",
            "FSDP over more than one rank keeps a shard of each layer, which the profiler does not yet scale "
            "back to the whole layer: profile with data_parallel_shard_degree 1, and plan the job's FSDP with "
            "`sapp-hook solve --fsdp --data-parallel D`",
        )
    if getattr(dims, "cp", 1) > 1:
        raise InputError(
            "parallelism.context_parallel_degree",
            f"is {dims.cp}; a context-parallel rank holds a slice of each sequence, which the profiler does not yet "
            "scale back to the whole: profile with context_parallel_degree 1, and plan the job's with "
            "`sapp-hook solve --context-parallel C`",
        )
    try:
        schedule = schedule_kind(parallelism.pipeline_parallel_schedule).name
    except InputError as error:
        raise InputError("parallelism.pipeline_parallel_schedule", error.detail) from None
    config_file = getattr(job_config.job, "config_file", None)
    options.setdefault("config", config_file)
    options.setdefault("target", "torchtitan" if options["config"] else None)
    part = parts[0]
    _bypass_checkpointing(part)
    device = next(part.parameters()).device
    tuner = AutoTuner(
        part,
        trainer.optimizers.optimizers[0],  # the container keeps no state of its own: its parts' optimizers do
        pipeline_parallel=parallelism.pipeline_parallel_degree,
        micro_batches=_micro_batches(job_config),
        schedule=schedule,
        chunks=len(parts),
        data_parallel=dims.dp_replicate * dims.dp_shard,
        ddp=dims.dp_replicate > 1,  # TorchTitan replicates with torch's DDP where it does not shard
        tensor_parallel=dims.tp,
        pipeline_group=_pipeline_mesh(dims),
        gradients_persist=False,  # TorchTitan's zero_grad sets them to None
        collective_backend="nccl" if device.type == "cuda" else "gloo",
        layers=BLOCKS,
        **options,
    )
    tuner.profiler.attach()
    return tuner


def _pipeline_mesh(dims: Any) -> Any:
    """The pipeline's mesh of TorchTitan's ParallelDims (None without pipeline parallelism), in every version."""
    if not dims.pp_enabled:
        return None
    if hasattr(dims, "get_optional_mesh"):  # since 2025-11
        return dims.get_optional_mesh("pp")
    return dims.world_mesh["pp"]


def _micro_batches(job_config: Any) -> int:
    """Micro-batches per step, as TorchTitan splits the local batch."""
    training, parallelism = job_config.training, job_config.parallelism
    size = parallelism.pipeline_parallel_microbatch_size
    if size < 1 or training.local_batch_size % size:
        raise InputError(
            "parallelism.pipeline_parallel_microbatch_size",
            f"is {size}; expected a divisor of training.local_batch_size ({training.local_batch_size})",
        )
    return training.local_batch_size // size


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The module TorchTitan's activation checkpointing wraps (torch's CheckpointWrapper), or None."""
    return getattr(module, "_checkpoint_wrapped_module", None)


def _bypass_checkpointing(part: nn.Module) -> None:
    """Run each checkpoint-wrapped layer of `part` as the module it wraps, so that the profiler's own
    recompute modes are what each profiled step runs under."""
    for layer in getattr(part, "layers", {}).values():
        inner = _wrapped(layer)
        if inner is not None and "forward" not in layer.__dict__:
            layer.forward = inner.__call__  # the wrapped module's own hooks still run


def _restore_checkpointing(parts: list[nn.Module]) -> None:
    for part in parts:
        for layer in getattr(part, "layers", {}).values():
            if _wrapped(layer) is not None:
                layer.__dict__.pop("forward", None)
