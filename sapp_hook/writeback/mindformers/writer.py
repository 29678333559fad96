"""MindFormers YAML: offset, recompute, interleave, schedule, stage and micro-batch counts, where
MindFormers keeps them.

Two formats: the classic training config (`parallel_config`, `model.model_config.offset`, ...; legacy
and mcore models alike) and MindFormers' newer "llm_template_v2" (`distribute_parallel_config`,
`training_args` and `model_config` at the top, see `v2`). The file is edited in place
(`writeback.text.yaml_splice`): anchors, aliases, merge keys, comments, quoting and line endings stay as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from basics.errors import InputError, shown
from sapp_hook.writeback.degrees import CONTEXT, DATA, EXPERT, TENSOR, ZERO, Stated
from sapp_hook.writeback.files import WriteBack, commit_config, read_config
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.mindformers.v2 import TEMPLATE_V2_SECTIONS, write_template_v2
from sapp_hook.writeback.mindformers.values import (
    check_layers,
    check_scheduler,
    check_stated_degrees,
    interleave_value,
    note_pipeline_size,
    section,
    set_counts,
    set_offset,
)
from sapp_hook.writeback.text.yaml_splice import MISSING, YamlEdit
from solver.formats.mindformers import MINDFORMERS_PLACES

# parallel_config's degrees (model_parallel is MindFormers' tensor parallel)
DEGREE_KEYS = {"model_parallel": TENSOR, "context_parallel": CONTEXT, "expert_parallel": EXPERT, "data_parallel": DATA}
TRAINING_SECTIONS = ("parallel_config", "model", "recompute_config")
RECOMPUTE_KEYS = ("recompute", "select_recompute", "select_comm_recompute")


def write_mindformers(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    old = read_config(path)
    edit = YamlEdit(old, path, "--config")
    document = edit.data
    if not isinstance(document, Mapping):
        raise InputError("--config", f"{path} is not a MindFormers config (a YAML mapping)")
    result = WriteBack(path=path, diff="")
    side_file = False
    _refuse_pynative(document, path)
    if any(name in document for name in TEMPLATE_V2_SECTIONS):
        side_file = write_template_v2(edit, layout, path, result)
    elif any(name in document for name in TRAINING_SECTIONS):
        _write_classic(edit, layout, path, result)
    elif not document or any(key in document for key in MINDFORMERS_PLACES):
        for key, value in layout.mindformers.items():  # a flat file of plan keys, as SAPP writes them
            edit.set((key,), value)
    else:
        raise InputError(
            "--config",
            f"{path} has none of {', '.join(TRAINING_SECTIONS + TEMPLATE_V2_SECTIONS)} (a MindFormers "
            f"training config) nor plan keys ({', '.join(MINDFORMERS_PLACES)}) at its top: is it a MindFormers config?",
        )
    if "base_config" in document:
        result.notes.append(
            f"{path} inherits base_config {document['base_config']}: the plan's keys are written in it, "
            "where they override the base's"
        )
    text = edit.result()
    result.notes.extend(edit.notes)
    commit_config(result, old, text, layout.plan_json() if side_file else None, dry_run=dry_run)
    return result


def _refuse_pynative(document: Mapping[str, object], path: Path) -> None:
    """One InputError for a config of MindFormers' pynative trainer (`parallelism.pipeline_parallel*`, 2026),
    whose split key changed type between its versions (lists of layer ids, then per-rank 'start-end' strings)
    with nothing in the config to tell which."""
    parallelism = document.get("parallelism")
    if isinstance(parallelism, Mapping) and any(str(key).startswith("pipeline_parallel") for key in parallelism):
        raise InputError(
            "--config",
            f"{path} is a config of MindFormers' pynative trainer (parallelism.pipeline_parallel*), whose "
            "parallelism.pipeline_parallel_layers_per_stage is lists of layer ids in some versions and "
            "'start-end' strings per rank in others, and the config does not say which: sapp-hook does not "
            "write it; set it from the plan by hand",
        )


def _optimizer_sharding(document: Mapping, path: Path) -> list[Stated]:
    """MindSpore's parallel optimizer, which shards optimizer state over data parallel (over one rank, nothing)."""
    optimizer = section(document, ("parallel",), path).get("enable_parallel_optimizer")
    if not isinstance(optimizer, bool) or section(document, ("parallel_config",), path).get("data_parallel") == 1:
        return []
    key = "parallel.enable_parallel_optimizer"
    return [
        Stated(ZERO, key, int(optimizer), said=f"{key} is {optimizer}", fix="" if optimizer else f"set {key} to True")
    ]


def _write_classic(edit: YamlEdit, layout: Layout, path: Path, result: WriteBack) -> None:
    """The plan in the classic training config's places; every check before the first change."""
    document = edit.data
    parallel = section(document, ("parallel_config",), path)
    note_pipeline_size(
        parallel, "parallel_config.pipeline_stage", ("data_parallel", "model_parallel"), layout, path, result
    )
    check_stated_degrees(
        parallel, "parallel_config", DEGREE_KEYS, layout, path, result, also=_optimizer_sharding(document, path)
    )
    model = section(document, ("model", "model_config"), path, required=True)
    check_layers(model, "model.model_config", layout, path, result)
    section(document, ("recompute_config",), path)
    pipeline = section(document, ("parallel", "pipeline_config"), path)
    where = "parallel.pipeline_config.pipeline_scheduler"
    scheduler = check_scheduler(
        layout, pipeline.get("pipeline_scheduler", MISSING), where, path, result, parallel.get("seq_split_num", MISSING)
    )

    if "parallel_config" in document:
        edit.set(("parallel_config", "pipeline_stage"), layout.pipeline_parallel)
        before = parallel.get("micro_batch_num")
        if before != layout.micro_batches:
            result.notes.append(
                f"parallel_config.micro_batch_num {'unset (1)' if before is None else shown(before)} -> {layout.micro_batches}, "
                f"the plan's: MindFormers' global batch (batch_size x data_parallel x micro_batch_num) changes with it"
            )
        edit.set(("parallel_config", "micro_batch_num"), layout.micro_batches)
    set_offset(edit, ("model", "model_config", "offset"), layout)
    if layout.chunks > 1 or "pp_interleave_num" in model:
        edit.set(("model", "model_config", "pp_interleave_num"), layout.chunks)
    for key in RECOMPUTE_KEYS:
        set_counts(edit, ("recompute_config", key), layout, result, op_dicts=True)
    # MindFormers runs pp_interleave_num chunks only with pipeline_interleave on (else it takes 1), in the
    # order pipeline_scheduler names; a one-chunk 1F1B plan needs neither where the config says neither.
    if layout.chunks == 1 and layout.schedule == "1F1B" and not pipeline:
        return
    where = "parallel.pipeline_config.pipeline_interleave"
    edit.set(
        ("parallel", "pipeline_config", "pipeline_interleave"),
        interleave_value(pipeline.get("pipeline_interleave"), layout, scheduler, where, result),
    )
    edit.set(("parallel", "pipeline_config", "pipeline_scheduler"), scheduler)
