"""MindFormers' llm_template_v2 format: `distribute_parallel_config`, `training_args` and `model_config`
at the top; the offsets in `distribute_parallel_config.pipeline_parallel_config.pipeline_stage_offset`.
Its reader refuses keys it does not know in those sections, takes `select_comm_recompute` only as a
bool, and `recompute`/`select_recompute` as a bool or a list (no mapping of ops to counts)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sapp_hook.writeback.degrees import CONTEXT, DATA, EXPERT, TENSOR
from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.files import WriteBack
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.mindformers.values import (
    cells,
    check_layers,
    check_scheduler,
    check_stated_degrees,
    held_layers,
    interleave_value,
    is_int,
    note_pipeline_size,
    section,
    set_counts,
    set_offset,
)
from sapp_hook.writeback.text.yaml_splice import MISSING, YamlEdit

TEMPLATE_V2_SECTIONS = ("distribute_parallel_config", "training_args", "model_config")
# What llm_template_v2 takes where a config leaves these unset (its TrainingConfig and TrainingParallelConfig).
V2_DEFAULT_GLOBAL_BATCH, V2_DEFAULT_MICRO_BATCH, V2_DEFAULT_INTERLEAVE = 512, 1, 1
PARALLEL = ("distribute_parallel_config",)
DEGREE_KEYS = {
    "tensor_model_parallel_size": TENSOR,
    "context_parallel_size": CONTEXT,
    "expert_model_parallel_size": EXPERT,
    "data_parallel_size": DATA,
}
PIPELINE = (*PARALLEL, "pipeline_parallel_config")


def write_template_v2(edit: YamlEdit, layout: Layout, path: Path, result: WriteBack) -> bool:
    """The plan in llm_template_v2's places. True when the config cannot say it exactly (a side file is due)."""
    document = edit.data
    parallel = section(document, PARALLEL, path)
    pipeline = section(document, PIPELINE, path)
    section(document, ("recompute_config",), path)
    note_pipeline_size(
        parallel,
        "distribute_parallel_config.pipeline_model_parallel_size",
        ("data_parallel_size", "tensor_model_parallel_size"),
        layout,
        path,
        result,
    )
    check_stated_degrees(parallel, "distribute_parallel_config", DEGREE_KEYS, layout, path, result)
    check_layers(section(document, ("model_config",), path), "model_config", layout, path, result)
    _check_micro_batches(document, parallel, layout, path, result)
    scheduler = check_scheduler(
        layout,
        pipeline.get("pipeline_scheduler", MISSING),
        "distribute_parallel_config.pipeline_parallel_config.pipeline_scheduler",
        path,
        result,
        pipeline.get("seq_split_num", MISSING),
    )

    edit.set((*PARALLEL, "pipeline_model_parallel_size"), layout.pipeline_parallel)
    edit.set(
        (*PIPELINE, "pipeline_interleave"),
        interleave_value(
            pipeline.get("pipeline_interleave"),
            layout,
            scheduler,
            "distribute_parallel_config.pipeline_parallel_config.pipeline_interleave",
            result,
        ),
    )
    edit.set((*PIPELINE, "pipeline_scheduler"), scheduler)
    edit.set((*PIPELINE, "virtual_pipeline_model_parallel_size"), layout.chunks)
    set_offset(edit, (*PIPELINE, "pipeline_stage_offset"), layout)
    for key in ("recompute", "select_recompute"):
        set_counts(edit, ("recompute_config", key), layout, result, op_dicts=False)
    return _set_communication_recompute(edit, layout, result)


def _set_communication_recompute(edit: YamlEdit, layout: Layout, result: WriteBack) -> bool:
    """select_comm_recompute, a bool here: true recomputes the communication of every layer not fully
    recomputed, false of none. True when it cannot say the plan's (a side file is due)."""
    view = layout.mindformers
    # the counts include the fully recomputed layers, as MindFormers' lists do
    comm, full = cells(view["select_comm_recompute"]), cells(view["recompute"])
    some = any(c > f for comm_row, full_row in zip(comm, full) for c, f in zip(comm_row, full_row))
    place = ("recompute_config", "select_comm_recompute")
    if some or edit.get(place) not in (MISSING, None):
        edit.set(place, some)
    if some and comm != held_layers(layout):
        result.notes.append(
            "llm_template_v2 takes select_comm_recompute as true or false only: the plan recomputes the "
            "communication of some layers, so it is true for all (a little more time than planned, no more memory)"
        )
        return True
    return False


def _check_micro_batches(document: Mapping, parallel: Mapping, layout: Layout, path: Path, result: WriteBack) -> None:
    """llm_template_v2 runs global_batch_size // (data_parallel_size x micro_batch_size x
    micro_batch_interleave_num) micro-batches (it has no micro_batch_num to set): a config that cannot
    make the plan's count is refused; where the data-parallel size is left to the device count, the
    size that makes it is said."""
    training = section(document, ("training_args",), path)
    said = []

    def size(part: Mapping, name: str, key: str, default: int) -> object:
        value = part.get(key, default)
        said.append(f"{name}.{key} {value}{'' if key in part else ' (unset: the default)'}")
        return value

    global_batch = size(training, "training_args", "global_batch_size", V2_DEFAULT_GLOBAL_BATCH)
    micro_batch = size(training, "training_args", "micro_batch_size", V2_DEFAULT_MICRO_BATCH)
    interleave = size(parallel, "distribute_parallel_config", "micro_batch_interleave_num", V2_DEFAULT_INTERLEAVE)
    data_parallel = parallel.get("data_parallel_size")
    if not all(is_int(value) and value > 0 for value in (global_batch, micro_batch, interleave)):
        return  # MindFormers' own checks say what is wrong with them
    per_replica = global_batch // (micro_batch * interleave)
    sizes = f"{said[0]}, {said[1]} and {said[2]}"
    if is_int(data_parallel) and data_parallel > 0:
        if per_replica // data_parallel != layout.micro_batches:
            raise PlanMismatch(
                f"is for {layout.micro_batches} micro-batches per step; with {path}'s {sizes} at "
                f"data_parallel_size {data_parallel}, MindFormers runs {per_replica // data_parallel}",
            )
        return
    replicas = per_replica // layout.micro_batches
    if not replicas or per_replica // replicas != layout.micro_batches:
        raise PlanMismatch(
            f"is for {layout.micro_batches} micro-batches per step; with {path}'s {sizes}, "
            f"MindFormers runs {per_replica} // data-parallel size: {layout.micro_batches} at none",
        )
    result.notes.append(
        f"{sizes} make the plan's {layout.micro_batches} micro-batches per step at data-parallel size {replicas}"
    )
