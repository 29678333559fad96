"""A rank's place in a parallel job, as the profiler needs it: which ranks are one pipeline (the ranks
of one replica), and how the model it profiles is already split.

A model tensor-parallelised with DTensor (`parallelize_module`) is measured as one rank of that degree:
its local shards and local activations are what the plan needs, so the profile says so (`mesh`) and the
solver does not divide them again. FSDP2 and ZeRO hold a shard of each layer at rest and gather it while
the layer runs, which a layer's measurement cannot tell apart from its own bytes: such a model is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from basics.errors import InputError

PIPELINE_GROUPS = "TorchTitan: world_mesh['pp'], Megatron: parallel_state.get_pipeline_model_parallel_group()"


@dataclass(frozen=True)
class Pipeline:
    """This process's pipeline: the global ranks of one replica's pipeline in pipeline order, and this
    process's place among them (its pipeline rank). One rank alone holds the whole model."""

    ranks: tuple[int, ...]
    rank: int

    @property
    def whole_model(self) -> bool:
        return len(self.ranks) == 1


def pipeline_of(group: Any, pipeline_parallel: int, replicas: int = 1) -> Pipeline:
    """The pipeline this process is a rank of: `group` (a ProcessGroup, or a one-dimensional DeviceMesh,
    over the ranks of this process's pipeline), which must hold one rank (the whole model on each) or
    `pipeline_parallel` ranks. Where `group` is None, a job of `pipeline_parallel` x `replicas` ranks (the
    data, tensor and context parallel ranks of a pipeline rank) has the pipeline dimension outermost, as
    TorchTitan's and Megatron-LM's rank orders do: rank = pipeline rank x replicas + its place among them."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if group is not None:
            raise InputError("pipeline_group", "is for a torch.distributed job; this process runs alone: give None")
        return Pipeline(ranks=(0,), rank=0)
    if group is None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != pipeline_parallel * replicas:
            raise InputError(
                "pipeline_group",
                f"this job has {world} ranks and the plan {pipeline_parallel} pipeline ranks x {replicas} each (data, tensor "
                f"and context parallel): give the process group of this rank's pipeline ({PIPELINE_GROUPS})",
            )
        place = rank % replicas
        return Pipeline(ranks=tuple(pp * replicas + place for pp in range(pipeline_parallel)), rank=rank // replicas)
    group = _process_group(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) not in (1, pipeline_parallel):
        raise InputError(
            "pipeline_group",
            f"holds {len(ranks)} ranks; expected {pipeline_parallel} (pipeline_parallel) or 1 (the whole model here)",
        )
    return Pipeline(ranks=ranks, rank=dist.get_rank(group))


def _process_group(group: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise InputError("pipeline_group", f"is a {group.ndim}-D DeviceMesh; expected its pipeline dimension")
        return group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise InputError("pipeline_group", f"expected a ProcessGroup, a 1-D DeviceMesh or None, got {type(group)}")
    return group


def tensor_parallel_degree(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """The ranks `model`'s DTensor parameters are split over (1 for plain tensors). A model FSDP2 shards over
    more than one rank, parameters on a mesh of more than one dimension, and torch's ZeRO optimizer are refused
    (FSDP over one rank, as TorchTitan applies it at data-parallel degree 1, shards nothing: measured through)."""
    if holds_fsdp(model) and max((p.device_mesh.size() for p in model.parameters() if _is_dtensor(p)), default=1) > 1:
        raise InputError(
            "model",
            "is sharded by FSDP (fully_shard) over more than one rank: autotune measures each layer whole and plans FSDP itself; "
            "profile the model before fully_shard (with fsdp=True and data_parallel), or measure one rank of "
            "the mesh with `sapp-hook profile --data-parallel D --fsdp`",
        )
    if _is_zero(optimizer):
        raise InputError(
            "optimizer",
            "is torch's ZeroRedundancyOptimizer, whose state this rank holds only in part: give the plain "
            "optimizer (AdamW, ...) and zero_stage=1",
        )
    meshes = {(p.device_mesh.mesh_dim_names, p.device_mesh.shape) for p in model.parameters() if _is_dtensor(p)}
    if not meshes:
        return 1
    if len(meshes) > 1 or len(next(iter(meshes))[1]) != 1:
        shown = ", ".join(f"{names or 'unnamed'} {tuple(shape)}" for names, shape in sorted(meshes, key=str))
        raise InputError(
            "model",
            f"its parameters are DTensors on {shown}; expected one 1-D tensor-parallel mesh (tensor parallelism "
            "alone: data parallelism is planned from data_parallel, fsdp and zero_stage)",
        )
    return int(next(iter(meshes))[1][0])


def holds_fsdp(model: nn.Module) -> bool:
    """Whether FSDP2 (fully_shard) wraps `model` or a module inside it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed has no such model
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())


def _is_zero(optimizer: torch.optim.Optimizer | None) -> bool:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:
        return False
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(tensor, DTensor)
