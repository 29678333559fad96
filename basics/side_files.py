"""A config and its side file (`NAME.sapp-hook.json`: the exact plan, where the config cannot say it all) as
one unit. The side file records the SHA-256 of the config bytes it was written with; it is written before
the config and removed after it, so that a process killed between the two writes leaves a pair whose
record and config disagree, which a reader finds. Readers check the pair under a shared lock of the folder
(writers hold it exclusively across both writes)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from basics.errors import InputError
from basics.files import folder_locked, read_limited

SUFFIX = ".sapp-hook.json"
RECORD = "side_file_of"  # the key of the record: {"config": NAME, "config_sha256": HEX}

log = logging.getLogger(__name__)


def side_file_path(config: Path) -> Path:
    """Where the side file of `config` goes: beside it (beside the link, for a symbolic link)."""
    return config.with_name(config.name + SUFFIX)


def config_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def side_file_text(plan_text: str, config: Path, config_bytes: bytes) -> str:
    """The plan JSON `plan_text` with the record of the config bytes it is written with."""
    data = json.loads(plan_text)
    data[RECORD] = {"config": config.name, "config_sha256": config_digest(config_bytes)}
    return json.dumps(data, indent=1) + "\n"


def is_side_file(path: object) -> bool:
    if not isinstance(path, (str, os.PathLike)):
        return False
    name = Path(path).name
    return name.endswith(SUFFIX) and len(name) > len(SUFFIX)


def read_checked(path: str | os.PathLike, what: str, read: Callable[[Path], object]) -> object:
    """`read(path)` (the document as read), checked where `path` is a side file with its config beside it:
    InputError naming `what` where the config is not the one the side file was written with. The record is
    taken out (of any plan JSON: a copy of a side file, too). A side file without a record (as sapp-hook
    wrote them before it kept one) is read as it is, with a warning."""
    if not is_side_file(path):
        return _without_record(read(path))
    path = Path(path)
    config = path.with_name(path.name[: -len(SUFFIX)])
    with folder_locked(path, shared=True):  # not between a writer's two writes
        data = read(path)
        # a side file copied away from its config is a plain plan JSON
        if not isinstance(data, Mapping) or not os.path.isfile(config):
            return _without_record(data)
        record = data.get(RECORD)
        if record is None:
            log.warning(
                "%s records no digest of the config it was written with (an older sapp-hook wrote it): it is "
                "read as a plan JSON, unchecked against %s",
                path,
                config,
            )
            return data
        said = record.get("config_sha256") if isinstance(record, Mapping) else None
        if not isinstance(said, str):
            raise InputError(
                what, f'{path}: {RECORD}: expected {{"config": NAME, "config_sha256": HEX}}, as sapp-hook writes it'
            )
        found = config_digest(read_limited(config, what))
    if found != said:
        raise InputError(
            what,
            f"{path} is the side file of {config}, but {config} has changed since they were written together "
            f"(its SHA-256 is {found[:12]}..., the side file was written with {said[:12]}...): they may say two "
            f"plans (an apply stopped between its two writes, another apply, an edit of {config.name}). Run "
            "`sapp-hook apply` again with the plan you mean, or copy this file to a name of its own to use its "
            "plan as it is",
        )
    return _without_record(data)


def _without_record(data: object) -> object:
    if isinstance(data, Mapping) and RECORD in data:
        return {key: value for key, value in data.items() if key != RECORD}
    return data
