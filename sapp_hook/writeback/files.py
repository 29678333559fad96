"""Rewriting a user's config: whole or not at all, with a backup of what was there and a diff."""

from __future__ import annotations

import difflib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from simulator.errors import InputError
from simulator.files import atomic_write_text
from solver.profile import read_limited


@dataclass
class WriteBack:
    """What writing a plan into a config did (or, in a dry run, would do)."""

    path: Path
    diff: str
    notes: list[str] = field(default_factory=list)  # what the config cannot express, and what was written instead
    written: list[str] = field(default_factory=list)
    backup: Path | None = None


def read_config(path: Path, flag: str = "--config") -> str:
    """The text of a config to rewrite; InputError if it cannot be read or written back."""
    if not path.is_file():
        raise InputError(flag, f"{path} does not exist or is not a file")
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        raise InputError(flag, f"{path} is read-only (or its folder is); nothing was written")
    try:
        return read_limited(path, flag).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(flag, f"{path} is not UTF-8 text: {exc}") from None


def commit(result: WriteBack, old: str, new: str, *, dry_run: bool) -> WriteBack:
    """Fill in the diff; unless a dry run, replace the file atomically. The first write keeps the
    file as it was in `NAME.sapp-hook.bak`; later writes leave that backup alone, so re-planning
    never replaces the user's own config with one sapp-hook wrote (nor touches a `NAME.bak` of theirs)."""
    path = result.path
    result.diff = "".join(difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"{path} (before)", f"{path} (sapp-hook)"))
    if dry_run or new == old:
        return result
    backup = path.with_name(path.name + ".sapp-hook.bak") if path.exists() else None
    try:
        if backup is not None and not backup.exists():
            shutil.copy2(path, backup)
        atomic_write_text(path, new, mode=path.stat().st_mode & 0o7777 if backup else None)
    except OSError as exc:
        raise InputError("--config", f"cannot write {path}: {exc.strerror or exc}; it was left as it was") from None
    result.backup = backup
    result.written.append(str(path))
    return result


def write_side_file(result: WriteBack, text: str, *, dry_run: bool) -> None:
    """The plan JSON next to the config (`NAME.sapp-hook.json`), for `sapp_hook.apply`."""
    side = result.path.with_name(result.path.name + ".sapp-hook.json")
    result.notes.append(f"the exact per-layer recompute plan is in {side}")
    if not dry_run:
        try:
            atomic_write_text(side, text)
        except OSError as exc:
            raise InputError("--config", f"cannot write {side}: {exc.strerror or exc}") from None
        result.written.append(str(side))
