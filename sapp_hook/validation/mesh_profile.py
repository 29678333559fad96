"""One rank of a tensor-parallel x FSDP job, profiled on that job's own mesh.

The model is profiled on one process first: its memory, which `solver.parallel.model_parallel` turns into one rank's
exactly (docs/results/nd-validation.md). Then D x T gloo processes run the whole model (no pipeline)
laid out as `sapp-hook validate` lays a stage out (`sapp_hook.validation.parallelize`: TorchTitan's Llama plan per
block, FSDP2 per layer on the data-parallel ranks), each timing every layer with the `LayerProfiler`,
putting every collective down to the layer it ran in (`profiler.measure.collective_log`) and, under tensor
parallel, measuring what each body kind's split backward holds (`measures_split_backward`). The rank
profile holds the one-process profile's memory for one rank, its split backward as the mesh measured
it, and for every layer the slowest rank's times (a stage moves at its slowest rank: its collectives
make the others wait) and the collectives it ran; its `mesh` says the numbers are per rank already, so
planning divides neither times nor memory again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from basics.errors import InputError
from profiler.measure.build import split_cost_fields
from profiler.measure.split import SplitBackward
from profiler.recompute import TORCH_MODES
from solver import PipelineSpec, even_plan
from solver.parallel.model_parallel import profile_for_mesh
from solver.vocabulary.profile import NONE, LayerProfile, ModelProfile
from solver.vocabulary.profile_parts import Collective, Mesh

log = logging.getLogger(__name__)

FSDP_VIEW_WARNING = "FSDP2-wrapped module .* returned a view tensor"
DIMENSIONS = (("tp", "tensor"), ("dp", "data"))  # the mesh's names and solver.vocabulary.profile_parts' dimensions
OPTIMIZER = "optimizer"  # the slot of collectives the optimizer step runs (sequence parallel's norm gradients)


@dataclass(frozen=True)
class MeshRun:
    """The mesh a rank is measured on (D x T processes) and the profiling steps, as `profile_example` takes them."""

    model: str
    data_parallel: int = 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    fsdp: bool = False
    reshard_after_forward: bool = False
    micro_batch_size: int = 2
    seq_len: int = 128
    dtype: str = "float32"
    steps: int = 2
    warmup_steps: int = 1
    modes: tuple[str, ...] = TORCH_MODES

    @property
    def mesh(self) -> Mesh:
        """The layout the rank profile's numbers are per rank of (data parallelism: the spec's)."""
        return Mesh(tensor_parallel=self.tensor_parallel, sequence_parallel=self.sequence_parallel)

    def shape(self) -> Any:
        from sapp_hook.validation.parallelize import MeshShape

        return MeshShape(
            pipeline_parallel=1,
            data_parallel=self.data_parallel,
            tensor_parallel=self.tensor_parallel,
            fsdp=self.fsdp,
            reshard_after_forward=self.reshard_after_forward,
            sequence_parallel=self.sequence_parallel,
        )


def measures_split_backward(run: MeshRun) -> bool:
    """Whether the mesh run measures what each body kind's split backward holds: under tensor parallel,
    where that is not the one process's / t (some gradients stay whole) and a block measured alone
    holds what a pipeline stage does. Not with sequence parallel (the block alone holds more than a
    stage does) nor FSDP (its unsharding refuses a block's backward run alone): the rule's division
    stands there (docs/results/nd-validation.md)."""
    return run.tensor_parallel > 1 and not run.sequence_parallel and not run.fsdp


def check_mesh_run(run: MeshRun) -> None:
    """One InputError, naming the flag, for a mesh this runner cannot lay the model out on."""
    from sapp_hook.models import load_config
    from sapp_hook.validation.parallelize import check_layout

    for name in ("data_parallel", "tensor_parallel"):
        value = getattr(run, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(_flag(name), f"expected an integer >= 1, got {value!r}")
    if run.data_parallel > 1 and not run.fsdp:
        raise InputError(
            "--data-parallel",
            "measured replicas run FSDP2 (add --fsdp); plain replicas and ZeRO "
            "reduce once a step, outside every layer: --estimate states those",
        )
    if run.fsdp and run.data_parallel == 1:
        raise InputError("--fsdp", "needs --data-parallel 2 or more")
    if run.reshard_after_forward and not run.fsdp:
        raise InputError("--reshard-after-forward", "needs --fsdp")
    if run.sequence_parallel and run.tensor_parallel == 1:
        raise InputError("--sequence-parallel", "needs --tensor-parallel 2 or more")
    config = load_config(run.model)
    if not hasattr(config.get_text_config(), "num_key_value_heads"):
        raise InputError(
            "--model", "a mesh is measured for the Llama family (TorchTitan's layout); for another model use --estimate"
        )
    check_layout(config, run.tensor_parallel, run.sequence_parallel, run.fsdp, run.seq_len)


def profile_on_mesh(run: MeshRun, one_d: ModelProfile, workdir: str | Path | None = None) -> ModelProfile:
    """One rank's profile of `run`'s mesh: `one_d` (the model profiled on one process at the run's shape)
    for its memory, the mesh run for its times and collectives."""
    check_mesh_run(run)
    if not one_d.mesh.is_one_d:
        raise InputError("profile", f"is per rank of {one_d.mesh.describe()} already; expected a one-process profile")
    memory = profile_for_mesh(one_d, run.mesh)
    return mesh_profile(memory, run_mesh(run, one_d, workdir), run.mesh)


def run_mesh(run: MeshRun, one_d: ModelProfile, workdir: str | Path | None = None) -> list[dict[str, Any]]:
    """What each of the mesh's processes measured, in rank order: its profile (times) and, per layer of
    `one_d`'s, the collectives of a step without recompute, forward's and backward's apart."""
    from sapp_hook.validation.rank import spawn_ranks

    plan = even_plan(one_d, PipelineSpec(pipeline_parallel=1, micro_batches=1, schedule="1F1B"), NONE).to_dict()
    world = run.data_parallel * run.tensor_parallel
    log.info("profiling one rank of %s on %d gloo processes", _describe(run), world)
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        return spawn_ranks(_rank_main, (run, json.loads(json.dumps(plan)), folder), world, Path(folder))


def mesh_profile(memory: ModelProfile, ranks: Sequence[Mapping[str, Any]], mesh: Mesh) -> ModelProfile:
    """`memory` (a rank's memory) with every layer's times the slowest rank's and its collectives."""
    measured = [ModelProfile.from_dict(rank["profile"]) for rank in ranks]
    for rank, profile in enumerate(measured):  # FSDP renames the blocks' classes: their kinds differ
        if [_part(layer) for layer in profile.layers] != [_part(layer) for layer in memory.layers]:
            raise RuntimeError(
                f"rank {rank} measured layers {[layer.kind for layer in profile.layers]}; the "
                f"one-process profile has {[layer.kind for layer in memory.layers]}"
            )
    layers = tuple(
        _split_on_mesh(
            _timed(
                layer, [profile.layers[index] for profile in measured], [rank["collectives"][index] for rank in ranks]
            ),
            [rank.get("splits", {}).get(profile.layers[index].kind) for rank, profile in zip(ranks, measured)],
        )
        for index, layer in enumerate(memory.layers)
    )
    return dataclasses.replace(memory, layers=layers, mesh=mesh)


def _split_on_mesh(layer: LayerProfile, measured: list[Mapping[str, Any] | None]) -> LayerProfile:
    """`layer` with what its split backward holds as every rank measured it (the most any held), where
    they did (`measures_split_backward`)."""
    if not measured or any(split is None for split in measured):
        return layer
    most = SplitBackward(**{field: max(split[field] for split in measured) for field in measured[0]})
    recompute = {
        mode: dataclasses.replace(cost, **split_cost_fields(most, mode, cost.activation_bytes))
        for mode, cost in layer.recompute.items()
    }
    return dataclasses.replace(layer, recompute=recompute)


def _part(layer: LayerProfile) -> str:
    return "body" if layer.is_body else layer.kind


def _timed(layer: LayerProfile, ranks: list[LayerProfile], collectives: list[list[dict[str, Any]]]) -> LayerProfile:
    """`layer` with the slowest rank's times; its backward split in the shares the one-process profile
    measured (the mesh run's split counts for its memory only)."""
    forward = max(rank.forward_ms for rank in ranks)
    backward = max(rank.backward_ms for rank in ranks)

    def share(part: float | None) -> float | None:
        return None if part is None or not layer.backward_ms else min(backward * part / layer.backward_ms, backward)

    recompute = {
        mode: dataclasses.replace(cost, extra_ms=max(rank.recompute[mode].extra_ms for rank in ranks))
        for mode, cost in layer.recompute.items()
    }
    spread = {name: max(rank.spread.get(name, 0.0) for rank in ranks) for name in ("forward_ms", "backward_ms")}
    return dataclasses.replace(
        layer,
        forward_ms=forward,
        backward_ms=backward,
        weight_ms=share(layer.weight_ms),
        input_ms=share(layer.input_ms),
        recompute=recompute,
        spread=spread,
        collectives=_slowest(collectives),
    )


def _slowest(ranks: list[list[dict[str, Any]]]) -> tuple[Collective, ...]:
    """Each collective as every rank ran it (the same calls and bytes), its forward's and backward's
    together, in the slowest rank's time; on gloo all of it exposed."""
    first = [_key(row) for row in ranks[0]]
    for rank, rows in enumerate(ranks):
        if [_key(row) for row in rows] != first:
            raise RuntimeError(f"rank {rank} ran other collectives than rank 0: {rows} vs {ranks[0]}")
    totals: dict[tuple[str, str, str], list[float]] = {}
    for index, row in enumerate(ranks[0]):
        total = totals.setdefault((row["dimension"], row["operation"], row["per"]), [0, 0.0, 0.0])
        total[0] += row["calls"]
        total[1] += row["bytes"]
        total[2] += max(rank[index]["ms"] for rank in ranks)
    return tuple(
        Collective(dimension, operation, per, int(calls), size, ms, ms)
        for (dimension, operation, per), (calls, size, ms) in totals.items()
    )


def _key(row: Mapping[str, Any]) -> tuple:
    return row["dimension"], row["operation"], row["per"], row["phase"], row["calls"]


def _describe(run: MeshRun) -> str:
    parts = []
    if run.tensor_parallel > 1:
        parts.append(f"tensor parallel {run.tensor_parallel}" + (" + SP" if run.sequence_parallel else ""))
    if run.data_parallel > 1:
        parts.append(
            f"FSDP2 over {run.data_parallel}" + (", reshard after forward" if run.reshard_after_forward else "")
        )
    return " x ".join(parts) or "one process"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- one rank -------------------------------------------------------------------------------------


def _rank_main(rank: int, run: MeshRun, plan: dict[str, Any], folder: str) -> None:
    from sapp_hook.validation.gloo import gloo_group

    with gloo_group(rank, run.data_parallel * run.tensor_parallel, Path(folder) / "store"):
        measured = _measure_rank(rank, run, plan)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(measured))


def _measure_rank(rank: int, run: MeshRun, plan: dict[str, Any]) -> dict[str, Any]:
    """The whole model on this rank's share of the mesh, profiled: its profile (times) and, per layer, the
    collectives of its steps without recompute."""
    import warnings

    import torch
    import transformers

    from profiler import LayerProfiler
    from profiler.measure.collective_log import CollectiveLog
    from sapp_hook.models import build_model, load_config, parameter_dtype, random_batch
    from sapp_hook.pipelining.stages import build_stages
    from sapp_hook.validation.parallelize import device_mesh, parallelize

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING)  # nothing here writes into FSDP's views
    shape = run.shape()
    _, dp, _ = shape.coordinates(rank)
    mesh = device_mesh(shape)
    config = load_config(run.model)
    model = build_model(config).to(dtype=parameter_dtype(run.dtype))
    [(_, module)] = build_stages(model, plan, 0)
    parallelize([module], shape, mesh)
    if shape.reshard_after_forward:
        _gather_own_units(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    profiler = LayerProfiler(
        module,
        optimizer,
        steps=run.steps,
        warmup_steps=run.warmup_steps,
        modes=run.modes,
        split_backward=measures_split_backward(run),
        count_memory=False,
        model_name=run.model,
        micro_batch={"size": run.micro_batch_size, "sequence": run.seq_len},
    )
    groups = {mesh[name].get_group().group_name: dimension for name, dimension in DIMENSIONS if mesh[name].size() > 1}
    collectives = CollectiveLog(profiler.recorder, groups, shape.reshard_after_forward)
    vocab = config.get_text_config().vocab_size
    plain_steps = []  # per step without recompute: its calls
    with profiler, collectives.watching():
        while not profiler.done:
            step, before = profiler.steps_done, len(collectives.calls)
            # replicas train on their own data; tensor-parallel ranks on the same
            ids = random_batch(config, run.micro_batch_size, run.seq_len, seed=step + 1000 * dp)["input_ids"]
            model.loss_function(logits=module(ids), labels=ids, vocab_size=vocab).backward()
            with collectives.outside(OPTIMIZER):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= run.warmup_steps and profiler.mode_of(step) == NONE:
                plain_steps.append(collectives.calls[before:])
            profiler.step()
    recorder = profiler.recorder
    slots = [
        *(["head"] if recorder.has_head else []),
        *recorder.structure.body_order,
        *(["tail"] if recorder.has_tail else []),
    ]
    lost = [call for calls in plain_steps for call in calls if call.slot is None]
    if lost:
        raise RuntimeError(f"collectives outside every layer and the optimizer step: {lost}")
    return {
        "profile": profiler.profile().to_dict(),
        "splits": {kind: dataclasses.asdict(split) for kind, split in profiler.backward_splits.items()},
        "collectives": [_per_layer(slot, plain_steps) for slot in slots],
        "optimizer_collectives": _per_layer(OPTIMIZER, plain_steps),
    }


def _gather_own_units(module: Any) -> None:
    """Each FSDP unit gathers its own parameters in its own backward: a unit told to prefetch only itself
    prefetches nothing (by default it prefetches the next unit's, which would count in its own time)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule) and unit is not module:
            unit.set_modules_to_backward_prefetch([unit])


def _per_layer(slot: object, steps: list[list[Any]]) -> list[dict[str, Any]]:
    """A slot's collectives per step, one entry per (dimension, operation, period, phase): the median over
    the steps of its calls, bytes and milliseconds."""
    keys: dict[tuple[str, str, str, str], None] = {}
    for calls in steps:
        for call in calls:
            if call.slot == slot:
                keys.setdefault((call.dimension, call.operation, call.per, call.phase))
    rows = []
    for key in keys:
        dimension, operation, per, phase = key
        counts, sizes, times = [], [], []
        for calls in steps:
            mine = [c for c in calls if c.slot == slot and (c.dimension, c.operation, c.per, c.phase) == key]
            counts.append(len(mine))
            sizes.append(sum(c.bytes for c in mine))
            times.append(sum(c.ms for c in mine))
        rows.append(
            {
                "dimension": dimension,
                "operation": operation,
                "per": per,
                "phase": phase,
                "calls": int(statistics.median(counts)),
                "bytes": statistics.median(sizes),
                "ms": statistics.median(times),
            }
        )
    return rows
