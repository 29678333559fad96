"""MindFormers YAML: offset, recompute lists, interleave and stage count, where MindFormers keeps them."""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedSeq

from sapp_hook.inputs import MINDFORMERS_PLACES, read_yaml
from sapp_hook.writeback.files import WriteBack, commit, read_config
from sapp_hook.writeback.layout import Layout
from simulator.errors import InputError

TRAINING_SECTIONS = ("parallel_config", "model", "recompute_config")
# The orders of several chunks per rank MindFormers runs (`parallel.pipeline_config.pipeline_scheduler`).
SCHEDULERS = {"Interleaved1F1B": "1f1b", "Interleaved1F1B-less-memory": "1f1b", "ZBVZeroBubble": "zero_bubble_v"}


def write_mindformers(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    old = read_config(path)
    read_yaml(path, "--config")  # the safe, strict reader first: no aliases, bounded depth
    capitalised = len(re.findall(r":\s+(?:True|False)\b", old)) > len(re.findall(r":\s+(?:true|false)\b", old))
    yaml = _round_trip(capitalised_booleans=capitalised)
    document = yaml.load(old)
    if not isinstance(document, MutableMapping):
        raise InputError("--config", f"{path} is not a MindFormers config (a YAML mapping)")
    result = WriteBack(path=path, diff="")
    keys = {key: _flow(value) for key, value in layout.mindformers.items()}
    if any(section in document for section in TRAINING_SECTIONS):
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
        if layout.chunks == 1 and "pp_interleave_num" not in _node(document, MINDFORMERS_PLACES["pp_interleave_num"][0][:-1], path, create=False):
            keys.pop("pp_interleave_num")
        for key, value in keys.items():
            place = MINDFORMERS_PLACES[key][0]
            _node(document, place[:-1], path, create=True)[place[-1]] = value
        if layout.chunks > 1:
            _set_interleave(document, layout, path, result)
    elif not document or any(key in document for key in MINDFORMERS_PLACES):
        document.update(keys)  # a flat file of plan keys, as SAPP writes them
    else:
        raise InputError(
            "--config", f"{path} has none of {', '.join(TRAINING_SECTIONS)} (a MindFormers training config) nor "
            f"plan keys ({', '.join(MINDFORMERS_PLACES)}) at its top: is it a MindFormers config?"
        )
    stream = io.StringIO()
    yaml.dump(document, stream)
    return commit(result, old, stream.getvalue(), dry_run=dry_run)


def _set_interleave(document: MutableMapping, layout: Layout, path: Path, result: WriteBack) -> None:
    """MindFormers runs pp_interleave_num chunks only with `parallel.pipeline_config.pipeline_interleave`
    on (else it takes 1), in the order `pipeline_scheduler` names."""
    parallel = _node(document, ("parallel",), path, create=True)
    pipeline = parallel.get("pipeline_config")
    if pipeline is None:
        pipeline = parallel["pipeline_config"] = {}
    if not isinstance(pipeline, MutableMapping):
        raise InputError("--config", f"{path}: parallel.pipeline_config is not a mapping")
    pipeline["pipeline_interleave"] = True
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
    # MindFormers spreads num_layers by the offsets: other counts would place other layers than planned
    model = document.get("model")
    config = model.get("model_config") if isinstance(model, Mapping) else None
    declared = config.get("num_layers") if isinstance(config, Mapping) else None
    if isinstance(declared, int) and not isinstance(declared, bool) and declared != layout.body_layers:
        raise InputError("--plan", f"places {layout.body_layers} decoder layers; {path} has "
                                   f"model.model_config.num_layers {declared}")


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
            raise InputError("--config", f"{path} lacks the section {'.'.join(place[: depth + 1])}, where MindFormers keeps it")
        node = child
    return node
