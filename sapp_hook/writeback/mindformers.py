"""MindFormers YAML: offset, recompute lists, interleave and stage count, where MindFormers keeps them.

Two formats: the classic training config (`parallel_config`, `model.model_config.offset`, ...) and
MindFormers' newer "llm_template_v2" (`distribute_parallel_config`, `training_args` and
`model_config` at the top; the offsets in
`distribute_parallel_config.pipeline_parallel_config.pipeline_stage_offset`), whose reader refuses
keys it does not know in those sections and takes `select_comm_recompute` only as a bool.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedSeq

from sapp_hook.inputs import MINDFORMERS_PLACES, read_yaml
from sapp_hook.writeback.files import WriteBack, commit, read_config, write_side_file
from sapp_hook.writeback.layout import Layout
from simulator.errors import InputError

TRAINING_SECTIONS = ("parallel_config", "model", "recompute_config")
TEMPLATE_V2_SECTIONS = ("distribute_parallel_config", "training_args", "model_config")
# The orders MindSpore runs, as its pipeline_scheduler names them (`parallel.pipeline_config` in the
# classic format; llm_template_v2 takes one of 1f1b, gpipe, zero_bubble_v). With one chunk and no
# pipeline_config, MindSpore runs 1f1b.
SCHEDULERS = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "1f1b", "Interleaved1F1B-less-memory": "1f1b",
              "ZBVZeroBubble": "zero_bubble_v"}
# What llm_template_v2 takes where a config leaves these unset (its TrainingConfig and TrainingParallelConfig).
V2_DEFAULT_GLOBAL_BATCH, V2_DEFAULT_MICRO_BATCH, V2_DEFAULT_INTERLEAVE = 512, 1, 1


def write_mindformers(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    old = read_config(path)
    read_yaml(path, "--config")  # the safe, strict reader first: no aliases, bounded depth
    capitalised = len(re.findall(r":\s+(?:True|False)\b", old)) > len(re.findall(r":\s+(?:true|false)\b", old))
    yaml = _round_trip(capitalised_booleans=capitalised)
    document = yaml.load(old)
    if not isinstance(document, MutableMapping):
        raise InputError("--config", f"{path} is not a MindFormers config (a YAML mapping)")
    result = WriteBack(path=path, diff="")
    side_file = False
    if any(section in document for section in TEMPLATE_V2_SECTIONS):
        side_file = _write_template_v2(document, layout, path, result)
    elif any(section in document for section in TRAINING_SECTIONS):
        _write_classic(document, layout, path, result)
    elif not document or any(key in document for key in MINDFORMERS_PLACES):
        document.update(_flow_keys(layout))  # a flat file of plan keys, as SAPP writes them
    else:
        raise InputError(
            "--config", f"{path} has none of {', '.join(TRAINING_SECTIONS + TEMPLATE_V2_SECTIONS)} (a MindFormers "
            f"training config) nor plan keys ({', '.join(MINDFORMERS_PLACES)}) at its top: is it a MindFormers config?"
        )
    stream = io.StringIO()
    yaml.dump(document, stream)
    commit(result, old, stream.getvalue(), dry_run=dry_run)
    if side_file:
        write_side_file(result, layout.plan_json(), dry_run=dry_run)
    return result


def _write_classic(document: MutableMapping, layout: Layout, path: Path, result: WriteBack) -> None:
    """The plan in the classic training config's places."""
    _check_stage_count(document, layout, path)
    _check_layer_count(document, layout, path)
    parallel = document.get("parallel_config")
    if isinstance(parallel, MutableMapping):
        parallel["pipeline_stage"] = layout.stages
        before = parallel.get("micro_batch_num")
        if before != layout.micro_batches:
            result.notes.append(
                f"parallel_config.micro_batch_num {'unset (1)' if before is None else before} -> {layout.micro_batches}, "
                f"the plan's: MindFormers' global batch (batch_size x data_parallel x micro_batch_num) changes with it"
            )
        parallel["micro_batch_num"] = layout.micro_batches
    keys = _flow_keys(layout)
    if layout.chunks == 1 and "pp_interleave_num" not in _node(document, MINDFORMERS_PLACES["pp_interleave_num"][0][:-1], path, create=False):
        keys.pop("pp_interleave_num")
    for key, value in keys.items():
        place = MINDFORMERS_PLACES[key][0]
        _node(document, place[:-1], path, create=True)[place[-1]] = value
    _set_pipeline_config(document, layout, path, result)


def _flow_keys(layout: Layout) -> dict[str, object]:
    return {key: _flow(value) for key, value in layout.mindformers.items()}


def _write_template_v2(document: MutableMapping, layout: Layout, path: Path, result: WriteBack) -> bool:
    """The plan in llm_template_v2's places. True when the config cannot say it exactly (a side file is due)."""
    parallel = _node(document, ("distribute_parallel_config",), path, create=True)
    _check_v2_counts(document, parallel, layout, path)
    _check_v2_micro_batches(document, parallel, layout, path, result)
    parallel["pipeline_model_parallel_size"] = layout.stages
    pipeline = _subsection(parallel, "pipeline_parallel_config", "distribute_parallel_config", path)
    pipeline["pipeline_interleave"] = layout.chunks > 1
    _set_scheduler(pipeline, layout, result)
    pipeline["virtual_pipeline_model_parallel_size"] = layout.chunks
    pipeline["pipeline_stage_offset"] = _flow(layout.mindformers["offset"])
    return _set_v2_recompute(_node(document, ("recompute_config",), path, create=True), layout, result)


def _check_v2_counts(document: Mapping, parallel: Mapping, layout: Layout, path: Path) -> None:
    stages = parallel.get("pipeline_model_parallel_size")
    if stages is not None and stages != layout.stages:
        raise InputError("--plan", f"is for {layout.stages} pipeline stages; {path} has "
                                   f"distribute_parallel_config.pipeline_model_parallel_size {stages}")
    _check_declared_layers(document.get("model_config"), "model_config", "num_hidden_layers", layout, path)


def _set_v2_recompute(recompute: MutableMapping, layout: Layout, result: WriteBack) -> bool:
    """The recompute lists; True when select_comm_recompute, a bool only here, cannot say the plan's."""
    view = layout.mindformers
    recompute["recompute"] = _flow(view["recompute"])
    recompute["select_recompute"] = _flow(view["select_recompute"])
    # True recomputes the communication of every layer not fully recomputed, false of none. The counts
    # include the fully recomputed layers, as MindFormers' lists do.
    comm, full = _cells(view["select_comm_recompute"]), _cells(view["recompute"])
    share = layout.body_layers // layout.num_virtual_stages  # MindFormers' offsets are counts less this share
    held = [[offset + share for offset in row] for row in _cells(view["offset"])]
    some = any(c > f for comm_row, full_row in zip(comm, full) for c, f in zip(comm_row, full_row))
    recompute["select_comm_recompute"] = some
    if some and comm != held:
        result.notes.append(
            "llm_template_v2 takes select_comm_recompute as true or false only: the plan recomputes the "
            "communication of some layers, so it is true for all (a little more time than planned, no more memory)"
        )
        return True
    return False


def _check_v2_micro_batches(document: Mapping, parallel: Mapping, layout: Layout, path: Path, result: WriteBack) -> None:
    """llm_template_v2 runs global_batch_size // (data_parallel_size x micro_batch_size x
    micro_batch_interleave_num) micro-batches (it has no micro_batch_num to set): a config that cannot
    make the plan's count is refused; where the data-parallel size is left to the device count, the
    size that makes it is said."""
    training = document.get("training_args")
    training = training if isinstance(training, Mapping) else {}
    said = []

    def size(section: Mapping, name: str, key: str, default: int) -> object:
        value = section.get(key, default)
        said.append(f"{name}.{key} {value}{'' if key in section else ' (unset: the default)'}")
        return value

    global_batch = size(training, "training_args", "global_batch_size", V2_DEFAULT_GLOBAL_BATCH)
    micro_batch = size(training, "training_args", "micro_batch_size", V2_DEFAULT_MICRO_BATCH)
    interleave = size(parallel, "distribute_parallel_config", "micro_batch_interleave_num", V2_DEFAULT_INTERLEAVE)
    data_parallel = parallel.get("data_parallel_size")
    if not all(_is_int(value) and value > 0 for value in (global_batch, micro_batch, interleave)):
        return  # MindFormers' own checks say what is wrong with them
    per_replica = global_batch // (micro_batch * interleave)
    sizes = f"{said[0]}, {said[1]} and {said[2]}"
    if _is_int(data_parallel) and data_parallel > 0:
        if per_replica // data_parallel != layout.micro_batches:
            raise InputError("--plan", f"is for {layout.micro_batches} micro-batches per step; with {path}'s {sizes} at "
                                       f"data_parallel_size {data_parallel}, MindFormers runs {per_replica // data_parallel}")
        return
    replicas = per_replica // layout.micro_batches
    if not replicas or per_replica // replicas != layout.micro_batches:
        raise InputError("--plan", f"is for {layout.micro_batches} micro-batches per step; with {path}'s {sizes}, "
                                   f"MindFormers runs {per_replica} // data-parallel size: {layout.micro_batches} at none")
    result.notes.append(f"{sizes} make the plan's {layout.micro_batches} micro-batches per step at data-parallel "
                        f"size {replicas}")


def _cells(value: object) -> list[list[int]]:
    """A MindFormers per-stage list, or list of lists per chunk, as lists per chunk."""
    return [list(row) for row in value] if value and isinstance(value[0], list) else [list(value)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _set_pipeline_config(document: MutableMapping, layout: Layout, path: Path, result: WriteBack) -> None:
    """MindFormers runs pp_interleave_num chunks only with `parallel.pipeline_config.pipeline_interleave`
    on (else it takes 1), in the order `pipeline_scheduler` names; a one-chunk 1F1B plan needs neither
    where the config does not say them."""
    section = document.get("parallel")
    pipeline = section.get("pipeline_config") if isinstance(section, Mapping) else None
    if layout.chunks == 1 and layout.schedule == "1F1B" and pipeline is None:
        return
    pipeline = _subsection(_node(document, ("parallel",), path, create=True), "pipeline_config", "parallel", path)
    pipeline["pipeline_interleave"] = layout.chunks > 1
    _set_scheduler(pipeline, layout, result)


def _subsection(parent: MutableMapping, key: str, where: str, path: Path) -> MutableMapping:
    """The mapping at `parent[key]` (`where` names `parent`), made empty where it is missing."""
    child = parent.get(key)
    if child is None:
        child = parent[key] = {}
    if not isinstance(child, MutableMapping):
        raise InputError("--config", f"{path}: {where}.{key} is not a mapping")
    return child


def _set_scheduler(pipeline: MutableMapping, layout: Layout, result: WriteBack) -> None:
    scheduler = SCHEDULERS.get(layout.schedule)
    if scheduler is not None:
        pipeline["pipeline_scheduler"] = scheduler
    else:
        known = ", ".join(f"{scheduler} for {name}" for name, scheduler in SCHEDULERS.items())
        result.notes.append(
            f"sapp-hook knows no MindFormers pipeline_scheduler for {layout.schedule} ({known}): it is left as it "
            f"was, and the plan's times assume {layout.schedule}"
        )


def _flow(value: object) -> object:
    """Lists as MindFormers configs write them: `[1, 0, -1]`, `[[1, 0], [0, -1]]`."""
    if not isinstance(value, list):
        return value
    sequence = CommentedSeq(_flow(item) for item in value)
    sequence.fa.set_flow_style()
    return sequence


def _round_trip(*, capitalised_booleans: bool) -> YAML:
    yaml = YAML(typ="rt")  # round-trip: comments, key order and quoting survive; built on the safe constructor
    yaml.preserve_quotes = True
    yaml.width = 4096
    if capitalised_booleans:  # MindFormers' own configs write True/False: keep unrelated lines as they were
        yaml.representer.add_representer(
            bool, lambda representer, value: representer.represent_scalar("tag:yaml.org,2002:bool", str(value))
        )
    return yaml


def _check_layer_count(document: MutableMapping, layout: Layout, path: Path) -> None:
    model = document.get("model")
    config = model.get("model_config") if isinstance(model, Mapping) else None
    _check_declared_layers(config, "model.model_config", "num_layers", layout, path)


# The multi-token-prediction depth: research/deepseek3's classic configs, then parallel_core's
MTP_KEYS = ("mtp_depth", "mtp_num_layers")


def _check_declared_layers(model: object, section: str, key: str, layout: Layout, path: Path) -> None:
    """MindFormers spreads the decoder layers and then the multi-token-prediction layers by the offsets
    (LayerSetting gets both counts, in either format): another count would place other layers than planned."""
    model = model if isinstance(model, Mapping) else {}
    declared = model.get(key)
    mtp_key = next((name for name in MTP_KEYS if _is_int(model.get(name)) and model.get(name)), None)
    mtp = model[mtp_key] if mtp_key else 0
    if _is_int(declared) and declared + mtp != layout.body_layers:
        said = f" + {mtp_key} {mtp}" if mtp_key else ""
        raise InputError("--plan", f"places {layout.body_layers} decoder layers; {path} has {section}.{key} {declared}{said}")


def _check_stage_count(document: MutableMapping, layout: Layout, path: Path) -> None:
    parallel = document.get("parallel_config")
    stages = parallel.get("pipeline_stage") if isinstance(parallel, MutableMapping) else None
    if stages is not None and stages != layout.stages:
        raise InputError("--plan", f"is for {layout.stages} pipeline stages; {path} has parallel_config.pipeline_stage {stages}")


def _node(document: MutableMapping, place: tuple[str, ...], path: Path, *, create: bool) -> MutableMapping:
    """The mapping at `place`. A missing top-level section (recompute_config) is created; a nested one
    (model.model_config, which says what the model is) must be there."""
    node = document
    for depth, part in enumerate(place):
        child = node.get(part)
        if child is None and create and depth == 0:
            child = node[part] = {}
        if not isinstance(child, MutableMapping):
            if not create:
                return {}
            section = ".".join(place[: depth + 1])
            if child is not None:
                kind = "a list" if isinstance(child, list) else f"the {type(child).__name__} {child!r}"
                raise InputError("--config", f"{path}: {section} is {kind}; expected a mapping")
            raise InputError("--config", f"{path} lacks the section {section}, where MindFormers keeps it")
        node = child
    return node
