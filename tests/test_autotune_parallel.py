"""`autotune` inside a parallel job: one replica's pipeline is profiled, a tensor-parallel (DTensor) model
is measured as one rank of its degree, and what it cannot measure (FSDP, ZeRO) is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from profiler_cases import batch, llama, train_step
from test_profiler_distributed import FirstStage, LastStage, train_stage

from profiler import LayerProfiler
from sapp_hook import autotune
from sapp_hook.validation.gloo import gloo_group, spawn
from sapp_hook.validation.parallelize import block_plan
from simulator import InputError
from solver.parallel.model_parallel import profile_for_mesh
from solver.vocabulary.profile import Mesh, ModelProfile

MODES = ("none", "full")
SETTING = {"micro_batches": 4, "schedule": "1F1B", "profile_steps": 1, "modes": MODES}


def whole_model_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids = batch(step)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def tensor_parallel(model: torch.nn.Module, tp_mesh: object) -> torch.nn.Module:
    """TorchTitan's Llama plan on the whole model: blocks, embedding rows, LM head columns (whole logits)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.model.layers:
        parallelize_module(block, tp_mesh, block_plan(False))
    parallelize_module(model.model.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return model


def tensor_parallel_rank(rank: int, store: str, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("tp", "pp"))  # each rank holds the whole model
        model = tensor_parallel(llama(), mesh["tp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        try:
            autotune(model, optimizer, pipeline_parallel=2, **SETTING, pipeline_group=mesh["pp"])
        except InputError as error:
            Path(folder, f"refused{rank}").write_text(str(error))
        options = {"pipeline_parallel": 2, **SETTING, "tensor_parallel": 2, "pipeline_group": mesh["pp"]}
        with autotune(model, optimizer, **options, cache_dir=Path(folder) / "cache") as tuner:
            for step in range(tuner.profiler.total_steps):
                whole_model_step(model, optimizer, step)
                tuner.step()
        if rank == 0:
            tuner.result.profile.save(Path(folder) / "profile.json")


def test_a_tensor_parallel_model_is_profiled_as_one_rank_of_its_degree(tmp_path):
    spawn(tensor_parallel_rank, (str(tmp_path / "store"), str(tmp_path)), 2)
    for rank in (0, 1):  # the degree the model is split over, not the spec's default
        said = (tmp_path / f"refused{rank}").read_text()
        assert said == "tensor_parallel: the model's parameters are split over 2 ranks (DTensor): expected 2, got 1"
    measured = ModelProfile.from_dict(json.loads((tmp_path / "profile.json").read_text()))
    assert measured.mesh == Mesh(tensor_parallel=2)  # so the solver divides it no further

    model = llama()  # the same model on one process, then the tensor-parallel rule
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with LayerProfiler(model, optimizer, steps=1, modes=MODES) as profiler:
        while not profiler.done:
            whole_model_step(model, optimizer, profiler.steps_done)
            profiler.step()
    predicted = profile_for_mesh(profiler.profile(), Mesh(tensor_parallel=2))
    assert [layer.name for layer in measured.layers] == [layer.name for layer in predicted.layers]
    for got, want in zip(measured.layers, predicted.layers):  # the rule and the rank agree to the byte
        assert (got.parameter_bytes, got.gradient_bytes, got.optimizer_bytes) == (
            want.parameter_bytes,
            want.gradient_bytes,
            want.optimizer_bytes,
        ), got.name
        assert got.recompute.keys() == want.recompute.keys()
        for mode in got.recompute:
            assert got.recompute[mode].activation_bytes == want.recompute[mode].activation_bytes, (got.name, mode)


def data_parallel_rank(rank: int, store: str, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_group(rank, 4, store):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # rank = 2 pp + dp, as TorchTitan
        stage_index = mesh.get_local_rank("pp")
        stage = (FirstStage if stage_index == 0 else LastStage)(llama())
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        plan_file = Path(folder) / "plan.json"
        options = {"pipeline_parallel": 2, **SETTING, "config": plan_file, "target": "plan"}
        try:  # four ranks cannot be two stages of one rank each
            autotune(stage, optimizer, **options)
        except InputError as error:
            Path(folder, f"refused{rank}").write_text(str(error))
        # two stages of two data-parallel ranks each, the pipeline outermost (rank = 2 stage + dp), or the group
        group = {"pipeline_group": mesh["pp"]} if rank % 2 else {}
        with autotune(stage, optimizer, **options, data_parallel=2, **group, cache_dir=Path(folder) / "c") as tuner:
            for step in range(tuner.profiler.total_steps):
                train_stage(stage, stage_index, step, optimizer)
                tuner.step()
        (Path(folder) / f"layout{rank}.json").write_text(tuner.result.layout.plan_json())


def test_under_data_parallelism_one_replicas_pipeline_is_planned_and_every_rank_gets_the_plan(tmp_path):
    spawn(data_parallel_rank, (str(tmp_path / "store"), str(tmp_path)), 4)
    for rank in range(4):  # refused on each rank
        said = (tmp_path / f"refused{rank}").read_text()
        assert said.startswith(
            "pipeline_group: this job has 4 ranks and the plan 2 pipeline ranks x 1 each (data, tensor"
        )
    layouts = [json.loads((tmp_path / f"layout{rank}.json").read_text()) for rank in range(4)]
    assert all(layout == layouts[0] for layout in layouts)
    kinds = [layer["kind"] for layer in layouts[0]["plan"]["layers"]]
    assert kinds == ["head", *["body:LlamaDecoderLayer"] * 4, "tail"]  # one replica's blocks, not both
    assert layouts[0]["spec"]["data_parallel"] == 2
    assert json.loads((tmp_path / "plan.json").read_text()) == layouts[0]


def fsdp_rank(rank: int, store: str, folder: str, world: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with gloo_group(rank, world, store):
        said = []
        zero = ZeroRedundancyOptimizer(llama().parameters(), optimizer_class=torch.optim.AdamW)
        with pytest.raises(InputError) as caught:
            autotune(llama(), zero, pipeline_parallel=2, **SETTING)
        said.append(str(caught.value))
        sharded = llama()
        fully_shard(sharded)
        try:  # over one rank FSDP shards nothing, as TorchTitan applies it at data-parallel degree 1
            optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
            group = dist.new_group([rank]) if world > 1 else None
            with autotune(sharded, optimizer, pipeline_parallel=2, **SETTING, pipeline_group=group) as tuner:
                for step in range(8):  # a warm-up, then one timed and one memory step per recompute mode
                    train_step(sharded, optimizer, step)
                    tuner.step()
            whole = sum(p.numel() * 4 for p in llama().parameters())
            said += [tuner.done, sum(layer.parameter_bytes for layer in tuner.result.profile.layers) == whole]
        except InputError as error:
            said.append(str(error))
        Path(folder, f"said{rank}.json").write_text(json.dumps(said))


def test_zero_and_fsdp_over_several_ranks_are_refused_by_name_fsdp_over_one_is_measured_through(tmp_path):
    spawn(fsdp_rank, (str(tmp_path / "store1"), str(tmp_path), 1), 1)
    zero, planned, whole = json.loads((tmp_path / "said0.json").read_text())
    assert zero.startswith("optimizer: is torch's ZeroRedundancyOptimizer, whose state this rank holds only in part")
    assert planned is True and whole is True  # profiled and planned through FSDP's wrappers, each layer whole
    spawn(fsdp_rank, (str(tmp_path / "store2"), str(tmp_path), 2), 2)
    _, fsdp = json.loads((tmp_path / "said0.json").read_text())
    assert fsdp.startswith("model: is sharded by FSDP (fully_shard) over more than one rank: autotune measures")


def test_a_pipeline_group_outside_a_distributed_job_is_refused():
    with pytest.raises(InputError, match=r"^pipeline_group: is for a torch.distributed job"):
        autotune(llama(), pipeline_parallel=2, **SETTING, pipeline_group=object())
