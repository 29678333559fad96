"""A pipeline's stages on a device mesh of pipeline x data x tensor-parallel ranks, as TorchTitan lays
a Llama out: tensor parallelism per block (`parallelize_module`, its Llama plan in transformers' module
names), then FSDP2 (`fully_shard` per layer on the data-parallel sub-mesh, the stage module as the root),
or ZeRO-1 (`ZeroRedundancyOptimizer`, gradients all-reduced after each step) or DDP per stage module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from basics.errors import InputError

MESH_NAMES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """P pipeline x D data-parallel x T tensor-parallel ranks; a process's global rank is
    (pp x D + dp) x T + tp. Data parallelism is FSDP (`fsdp`, re-sharding after each forward where
    `reshard_after_forward`), ZeRO-1 (`zero_stage` 1), DDP (`ddp`) or plain replicas whose gradients
    are all-reduced after each step; `sequence_parallel` splits what tensor parallelism leaves whole
    over the sequence."""

    pipeline_parallel: int
    data_parallel: int = 1
    tensor_parallel: int = 1
    fsdp: bool = False
    reshard_after_forward: bool = False
    zero_stage: int = 0
    ddp: bool = False
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel * self.data_parallel * self.tensor_parallel

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline, data-parallel, tensor-parallel) rank of global `rank`."""
        tp = rank % self.tensor_parallel
        dp = rank // self.tensor_parallel % self.data_parallel
        return rank // (self.tensor_parallel * self.data_parallel), dp, tp

    def rank_of(self, pp: int, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.data_parallel + dp) * self.tensor_parallel + tp

    @property
    def plain(self) -> bool:
        """One process per pipeline rank: nothing but the pipeline."""
        return self.data_parallel == self.tensor_parallel == 1 and not self.fsdp


def check_layout(config: Any, tensor_parallel: int, sequence_parallel: bool, fsdp: bool, seq_len: int) -> None:
    """One InputError where the mesh runner cannot lay the model out: tensor parallelism splits the Llama
    family's blocks (q/k/v/o, gate/up/down) by degrees that divide them; FSDP and tensor parallelism
    need an untied embedding."""
    text = config.get_text_config()
    if tensor_parallel > 1 and not hasattr(text, "num_key_value_heads"):
        raise InputError("--tensor-parallel", "the runner splits the Llama family's blocks (q/k/v/o, gate/up/down)")
    if tensor_parallel > 1 and (getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0)):
        # the rule splits routed experts over t (Megatron's expert TP): a run with them whole checks nothing
        raise InputError(
            "--tensor-parallel",
            "the runner's plan (TorchTitan's Llama plan) leaves an MoE model's experts whole, where sapp-hook's "
            "rule splits them over the degree; expected a dense Llama-family model",
        )
    check_tensor_parallel(config, tensor_parallel, seq_len, sequence_parallel)
    if getattr(text, "tie_word_embeddings", False) and (fsdp or tensor_parallel > 1):
        raise InputError(
            "--model",
            "ties its embedding and LM head, which FSDP and tensor parallelism would split "
            "apart; use an untied model (tie_word_embeddings: false)",
        )


def check_tensor_parallel(config: Any, tensor_parallel: int, seq_len: int, sequence_parallel: bool) -> None:
    """One InputError where `tensor_parallel` does not divide what the Llama plan splits."""
    text = config.get_text_config()
    if tensor_parallel == 1:
        return
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(text, name, None)
        if value is not None and value % tensor_parallel:
            raise InputError("--tensor-parallel", f"{tensor_parallel} does not divide the model's {name} ({value})")
    if sequence_parallel and seq_len % tensor_parallel:
        raise InputError(
            "--sequence-parallel", f"--seq-len {seq_len} is not a multiple of --tensor-parallel {tensor_parallel}"
        )


def device_mesh(shape: MeshShape) -> Any:
    """The process's device mesh ("pp", "dp", "tp"), over the default gloo group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        "cpu", (shape.pipeline_parallel, shape.data_parallel, shape.tensor_parallel), mesh_dim_names=MESH_NAMES
    )


def block_plan(sequence_parallel: bool) -> dict[str, Any]:
    """TorchTitan's tensor-parallel plan of a Llama block, in transformers' module names: the
    attention's and the MLP's input projections column-wise, their output projections row-wise; with
    sequence parallelism the norms split over the sequence and the attention's and MLP's inputs
    gathered whole (transformers passes the attention's by keyword)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    output = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(**output),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(**output),
    }
    if sequence_parallel:
        plan.update(
            {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True,
                ),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
            }
        )
    return plan


def tensor_parallelize(module: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Split a stage module's blocks, embedding (vocabulary rows) and LM head (vocabulary columns, whole
    logits: no loss parallelism) over `tp_mesh`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sequence = Shard(1) if sequence_parallel else Replicate()
    for block in module.layers:
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    if module.embed is not None:
        parallelize_module(module.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence))
    if module.head is not None:
        if sequence_parallel:
            parallelize_module(module.norm, tp_mesh, SequenceParallel())
        parallelize_module(module.head, tp_mesh, ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()))
    module.sequence_shards = tp_mesh.size() if sequence_parallel else 1


def fully_shard_stage(module: nn.Module, dp_mesh: Any, reshard_after_forward: bool) -> None:
    """FSDP2 as TorchTitan applies it under pipelining: one unit per layer (the embedding, each block,
    the final norm with the LM head), then the stage module, which owns no parameter of its own, as the
    root every unit needs."""
    from torch.distributed.fsdp import fully_shard

    units: list[Any] = [block for block in module.layers]
    if module.embed is not None:
        units.insert(0, module.embed)
    if module.head is not None:
        units.append([module.norm, module.head])
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def fsdp_parameters(modules: Iterable[nn.Module]) -> Iterator[Any]:
    """FSDP's per-parameter state (`FSDPParam`) of every unit in `modules`."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                for group in fully_shard.state(unit)._fsdp_param_groups:
                    yield from group.fsdp_params


def unsharded_bytes(modules: Iterable[nn.Module]) -> tuple[int, int]:
    """The bytes FSDP holds unsharded now: gathered parameters and their gradients."""
    from profiler.measure.recorder import unique_bytes

    unsharded = [p._unsharded_param for p in fsdp_parameters(modules) if hasattr(p, "_unsharded_param")]
    live = [p for p in unsharded if p.untyped_storage().nbytes()]
    return unique_bytes(live), unique_bytes([p.grad for p in unsharded if p.grad is not None])


def moving_storages(modules: list[nn.Module]) -> Callable[[], set[int]]:
    """A function of the storages of FSDP's unsharded parameters now (new at every all-gather), which
    autograd saves and the held-activation count leaves out."""
    from profiler.measure.recorder import storage_key

    def now() -> set[int]:
        return {storage_key(p._unsharded_param)[0] for p in fsdp_parameters(modules) if hasattr(p, "_unsharded_param")}

    return now


def parallelize(modules: list[nn.Module], shape: MeshShape, mesh: Any) -> list[nn.Module]:
    """Each stage module on the mesh, tensor parallelism first; what PipelineStage runs (DDP's wrapper)."""
    from torch.nn.parallel import DistributedDataParallel

    if shape.tensor_parallel > 1:
        for module in modules:
            tensor_parallelize(module, mesh["tp"], shape.sequence_parallel)
    if shape.fsdp:
        for module in modules:
            fully_shard_stage(module, mesh["dp"], shape.reshard_after_forward)
    if shape.ddp:
        return [DistributedDataParallel(module, process_group=mesh["dp"].get_group()) for module in modules]
    return modules


def optimizer_for(parameters: list[nn.Parameter], shape: MeshShape, mesh: Any) -> torch.optim.Optimizer:
    """AdamW, or torch's ZeRO-1 over AdamW on the data-parallel group."""
    if shape.zero_stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            parameters, optimizer_class=torch.optim.AdamW, process_group=mesh["dp"].get_group(), lr=1e-4
        )
    return torch.optim.AdamW(parameters, lr=1e-4)


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of the optimizer state this rank holds (ZeRO-1: its own partition's)."""
    state = getattr(optimizer, "optim", optimizer).state
    return [value for entry in state.values() for value in entry.values() if isinstance(value, torch.Tensor)]


def average_gradients(parameters: list[nn.Parameter], shape: MeshShape, mesh: Any) -> None:
    """Replicas' gradients averaged after the step, where neither FSDP nor DDP did it."""
    if shape.data_parallel == 1 or shape.fsdp or shape.ddp:
        return
    group = mesh["dp"].get_group()
    for parameter in parameters:
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=group)
            parameter.grad.div_(shape.data_parallel)
