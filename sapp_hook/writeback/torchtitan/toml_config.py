"""TorchTitan TOML configs (every version up to v0.2.2): the plan under the key names of the config's
version, its comments, key order and line endings kept, the result read back with `tomllib` (what
TorchTitan reads it with) before it replaces anything."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from basics.errors import InputError, shown
from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.files import BOM, WriteBack, commit_config
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.torchtitan.dialects import (
    LOWERCASE_SCHEDULES,
    MICRO_KEYS,
    SHAPING_KEYS,
    SPLIT_KEYS,
    SPLIT_POINTS,
    Dialect,
    find_source,
    toml_dialect,
)
from sapp_hook.writeback.torchtitan.models import check_mtp, mtp_in_toml, source_notes
from sapp_hook.writeback.torchtitan.plan_fields import (
    change_notes,
    check_degree,
    check_pipelines,
    check_stated_degrees,
    checkpointing,
    module_names,
    split_points,
)

TOML_INT_MAX = 2**63 - 1

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomlkit's reading is the check
    tomllib = None


def write_toml(path: Path, old: str, layout: Layout, *, dry_run: bool) -> WriteBack:
    if old.startswith(BOM):
        raise InputError(
            "--config",
            f"{path} starts with a UTF-8 byte-order mark, which TorchTitan's TOML reader (tomllib) refuses: remove it",
        )
    try:
        document = tomlkit.parse(old)
    except TOMLKitError as exc:
        raise InputError("--config", f"{path} is not valid TOML: {exc}") from None
    model = document.get("model")
    model = _plain(model.get("name")) if isinstance(model, Mapping) else None
    check_pipelines(model, str(path))
    check_mtp(mtp_in_toml(document), layout.pipeline_parallel, str(path))
    source = find_source(path)
    dialect = toml_dialect(document, source)
    if dialect.table == "experimental" and "experimental" not in document:
        document["experimental"] = tomlkit.table()  # where 2024's TorchTitan reads the pipeline keys
    table = document.get(dialect.table)
    if not isinstance(table, dict):
        raise InputError("--config", f"{path} has no [{dialect.table}] table: is it a TorchTitan config?")
    where = f"{path}: {dialect.table}"
    degree = check_degree(_plain(table.get("pipeline_parallel_degree")), f"{where}.pipeline_parallel_degree")
    csv = table.get("pipeline_parallel_schedule_csv")
    if csv:
        raise InputError(
            "--config",
            f"{where}.pipeline_parallel_schedule_csv is {str(csv)!r}: TorchTitan runs that "
            f"file's action order, not the plan's {layout.schedule}; remove it to apply the plan",
        )
    result = WriteBack(path=path, diff="")
    change_notes(result, dialect.table, degree, table.get("pipeline_parallel_schedule"), layout)
    # 2024's TorchTitan keeps the degrees in [training], later ones in [parallelism]
    degrees = document.get("parallelism") if "parallelism" in document else document.get("training")
    if isinstance(degrees, Mapping):
        section = "parallelism" if "parallelism" in document else "training"
        check_stated_degrees(
            {key: _plain(value) for key, value in degrees.items()}, section, layout, str(path), result.notes
        )
    written = {
        "pipeline_parallel_degree": layout.pipeline_parallel,
        "pipeline_parallel_schedule": _schedule(table.get("pipeline_parallel_schedule"), layout, dialect),
    }
    written[dialect.micro_key] = _micro_batches(document, dialect, layout, path)
    if dialect.split_key == SPLIT_POINTS:
        written[SPLIT_POINTS] = split_points(layout, SPLIT_POINTS)
    else:
        written[dialect.split_key] = module_names(layout, dialect.head, model)
    # each change through the table fetched anew: a table spread over dotted keys is a proxy one change outdates
    for key in (*SPLIT_KEYS, *MICRO_KEYS, *SHAPING_KEYS):
        if key not in written:
            document[dialect.table].pop(key, None)
    one_line = isinstance(table, tomlkit.items.InlineTable)  # `parallelism = {...}` holds no line break
    for key, value in written.items():
        lists_parts = key == dialect.split_key and key != SPLIT_POINTS and not one_line
        current = document[dialect.table].get(key)
        document[dialect.table][key] = _multiline(value) if lists_parts else _like(current, value)
    choice = checkpointing(layout, dialect)
    section = document.get("activation_checkpoint")
    if section is None:
        section = document["activation_checkpoint"] = tomlkit.table()
    elif not isinstance(section, dict):  # an array of tables, a string: TorchTitan reads a table; none is replaced
        kind = (
            "an array of tables" if isinstance(section, list) else f"{type(_plain(section)).__name__} {shown(section)}"
        )
        raise InputError(
            "--config", f"{path}: activation_checkpoint is {kind}; expected a table ([activation_checkpoint])"
        )
    checked = {"mode": choice.mode}
    if choice.option is not None:
        checked["selective_ac_option"] = choice.option
    for key, value in checked.items():
        section[key] = _like(section.get(key), value)
    result.notes += [*_assumed(dialect), *source_notes(str(path), source, dialect), *choice.notes]
    new = tomlkit.dumps(document)  # its line endings: commit's, as the config had them
    _read_back(new, path, dialect.table, written, checked)
    commit_config(result, old, new, None if choice.exact else layout.plan_json(), dry_run=dry_run)
    return result


def _schedule(current: object, layout: Layout, dialect: Dialect) -> str:
    """The plan's schedule as this TorchTitan spells it (the config's own spelling where it is the same)."""
    if isinstance(current, str) and current.lower() == layout.schedule.lower():
        return current
    # 2024's [experimental] TorchTitan: until mid-2024 it took only the lowercase names; after, any case
    unspelled = dialect.table == "experimental" and layout.schedule in ("1F1B", "GPipe")
    if not dialect.lowercase_schedules and not unspelled:
        return layout.schedule
    if layout.schedule not in LOWERCASE_SCHEDULES:
        raise PlanMismatch(
            f"is for {layout.schedule}; this TorchTitan (schedules spelled "
            f"{', '.join(LOWERCASE_SCHEDULES.values())}) runs only {', '.join(LOWERCASE_SCHEDULES)}",
        )
    return LOWERCASE_SCHEDULES[layout.schedule]


def _micro_batches(document: Mapping[str, object], dialect: Dialect, layout: Layout, path: Path) -> int:
    """The value of the dialect's micro-batch key: the count, or the size each micro-batch takes out of
    the training batch (`training.local_batch_size`, `training.batch_size` before mid-2025)."""
    if dialect.counts_micro_batches:
        return layout.micro_batches
    training = document.get("training")
    key = dialect.batch_key
    local = training.get(key) if isinstance(training, Mapping) else None
    if local is None:
        raise InputError(
            "--config",
            f"{path} has no training.{key}, which TorchTitan splits into the plan's "
            f"{layout.micro_batches} micro-batches: set it to a multiple of {layout.micro_batches}",
        )
    local = _plain(local)
    if isinstance(local, bool) or not isinstance(local, int):
        kind = f"the string {shown(str(local))}" if isinstance(local, str) else shown(local)
        raise InputError("--config", f"{path}: training.{key} is {kind}; TorchTitan expects a whole number")
    if abs(local) > TOML_INT_MAX:  # the micro-batch size written from it must be a TOML integer too
        raise InputError(
            "--config", f"{path}: training.{key} is {shown(local)}; expected a 64-bit integer, as TOML's are"
        )
    if local % layout.micro_batches:
        raise PlanMismatch(
            f"is for {layout.micro_batches} micro-batches; {path} has training.{key} "
            f"{shown(local)}, which does not split into {layout.micro_batches}",
        )
    return local // layout.micro_batches


def _plain(value: object) -> object:
    """A TOML value as Python's own type (tomlkit's items are subclasses: Float, String)."""
    return value.unwrap() if isinstance(value, tomlkit.items.Item) else value


def _like(current: object, value: object) -> object:
    """`value`, a string quoted as the config quotes the one it replaces ('...' stays '...')."""
    if (
        isinstance(value, str)
        and isinstance(current, tomlkit.items.String)
        and current.type == tomlkit.items.StringType.SLL
    ):
        return tomlkit.string(value, literal=True)
    return value


def _multiline(parts: list[list[str]]) -> tomlkit.items.Array:
    """One model part per line: a list a reader can check against the plan."""
    array = tomlkit.array()
    array.extend(parts)
    return array.multiline(True)


def _assumed(dialect: Dialect) -> list[str]:
    return [
        f"the config does not say which TorchTitan it is for (nor does a TorchTitan source beside it): wrote {what}"
        for what in dialect.assumed
    ]


def _read_back(new: str, path: Path, table: str, written: Mapping[str, object], checked: Mapping[str, str]) -> None:
    """Read the new text as TorchTitan does and check it says what was written."""
    if tomllib is None:
        return
    try:
        data = tomllib.loads(new)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(
            "--config", f"{path} would not be valid TOML after the write ({exc}); it was left as it was"
        ) from None
    said = {key: data.get(table, {}).get(key) for key in written}
    said.update({f"activation_checkpoint.{key}": data.get("activation_checkpoint", {}).get(key) for key in checked})
    wanted = {**written, **{f"activation_checkpoint.{key}": value for key, value in checked.items()}}
    if said != wanted:
        wrong = sorted(key for key in wanted if said[key] != wanted[key])
        raise InputError(
            "--config", f"{path} would not read back as written ({', '.join(wrong)}); it was left as it was"
        )
