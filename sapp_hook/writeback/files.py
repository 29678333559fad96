"""Rewriting a user's config: whole or not at all, with a backup of what was there and a diff."""

from __future__ import annotations

import contextlib
import difflib
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from basics.errors import InputError
from basics.files import atomic_write_bytes, atomic_write_text, read_limited, writable_target, write_target
from basics.side_files import side_file_path, side_file_text

BOM = "\ufeff"


@dataclass
class WriteBack:
    """What writing a plan into a config did (or, in a dry run, would do)."""

    path: Path
    diff: str
    notes: list[str] = field(default_factory=list)  # what the config cannot express, and what was written instead
    written: list[str] = field(default_factory=list)
    backup: Path | None = None


def read_config(path: Path, flag: str = "--config") -> str:
    """The text of a config to rewrite; InputError if it is not a regular file or cannot be read (one that
    cannot be written back is refused when it would be written: a dry run reads it all the same)."""
    target = _target(path, flag)
    if not target.is_file():
        raise InputError(flag, f"{path} does not exist or is not a file")
    try:
        return read_limited(target, flag).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(flag, f"{path} is not UTF-8 text: {exc}") from None


def commit(result: WriteBack, old: str, new: str, *, dry_run: bool) -> WriteBack:
    """`commit_config` for a file that has no side file: a plan file, a file a launch script sources."""
    return _commit(result, old, new, dry_run, None, paired=False)


def commit_config(result: WriteBack, old: str, new: str, side_plan: str | None, *, dry_run: bool) -> WriteBack:
    """`_commit` of a launch config and its side file, as one unit."""
    return _commit(result, old, new, dry_run, side_plan, paired=True)


def _commit(result: WriteBack, old: str, new: str, dry_run: bool, side_plan: str | None, *, paired: bool) -> WriteBack:
    """Fill in the diff; unless a dry run, replace the file atomically. The first write keeps the
    file as it was in `NAME.sapp-hook.bak`; later writes leave that backup alone, so re-planning
    never replaces the user's own config with one sapp-hook wrote (nor touches a `NAME.bak` of theirs).
    The new text keeps the file's line endings and byte-order mark; a symbolic link is written through
    (its target rewritten, the backup beside the link); anything but a regular file is refused.

    `side_plan` (where `paired`, a launch config): the plan JSON for its side file (`NAME.sapp-hook.json`),
    written with the digest of the new config bytes before the config; None: the plan needs none, and a
    side file there (an earlier plan's) is removed after the config is written."""
    path = result.path
    target = _target(path, "--config")
    new = in_form_of(old, new)
    result.diff = "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"{path} (before)", f"{path} (sapp-hook)"
        )
    )
    if path.is_symlink():
        result.notes.append(f"{path} is a symbolic link: its target {target} is what is rewritten; the link stays")
    side = _Side.of(path, new, side_plan, result.notes, dry_run) if paired else _Side(path, None, None, False)
    if dry_run or (new == old and not side.changes):
        return result
    backup = path.with_name(path.name + ".sapp-hook.bak") if target.exists() else None
    made: Path | None = None
    try:
        check_writable(path, backup)
        if new != old and backup is not None and not os.path.lexists(backup):
            # exactly the bytes the config holds (at most read_limited's cap), whole or not at all
            made = atomic_write_bytes(
                backup, read_limited(target, "--config"), mode=stat.S_IMODE(target.stat().st_mode)
            )
        elif new != old and backup is not None:
            write_target(backup)  # the backup there stays; a folder or a device there is refused
        side.write()  # before the config: a stop between the two leaves a side file its config contradicts
        if new != old:
            atomic_write_text(target, new)
    except BaseException as exc:
        side.put_back()
        _drop_backup_of_unchanged(made, target)
        if not isinstance(exc, OSError):
            raise
        raise InputError("--config", f"cannot write {path}: {exc.strerror or exc}; it was left as it was") from None
    if new != old:
        result.backup = backup
        result.written.append(str(path))
    side.finish(result)  # after the config: a stop between the two leaves an old side file it contradicts
    return result


@dataclass
class _Side:
    """The side file's part in a commit: what it holds before, and what it is to hold (None: nothing)."""

    path: Path
    wanted: bytes | None
    before: bytes | None
    changes: bool

    @classmethod
    def of(cls, config: Path, new: str, plan: str | None, notes: list[str], dry_run: bool) -> _Side:
        side = side_file_path(config)
        wanted = None if plan is None else side_file_text(plan, config, new.encode("utf-8")).encode("utf-8")
        before = _read_side(side) if os.path.lexists(side) else None
        if wanted is not None:
            notes.append(f"the exact per-layer recompute plan is in {side}")
        elif os.path.lexists(side):
            notes.append(
                f"{'would remove' if dry_run else 'removed'} {side}: it held an earlier plan's exact recompute, "
                "and the config now says this plan whole"
            )
        return cls(side, wanted, before, changes=wanted != before if wanted is not None else os.path.lexists(side))

    def write(self) -> None:
        if self.wanted is not None and self.wanted != self.before:
            atomic_write_bytes(self.path, self.wanted)

    def put_back(self) -> None:
        """The side file as it was, where the config write failed after it was written."""
        if self.wanted is None or self.wanted == self.before:
            return
        with contextlib.suppress(OSError):
            if self.before is None:
                os.unlink(self.path)
            else:
                atomic_write_bytes(self.path, self.before)

    def finish(self, result: WriteBack) -> None:
        """Note the side file written, or remove the one no longer wanted."""
        if self.wanted is not None and self.wanted != self.before:
            result.written.append(str(self.path))
        elif self.wanted is None and self.changes:
            try:
                os.unlink(self.path)
            except OSError as exc:
                raise InputError(
                    "--config",
                    f"wrote {result.path}, but cannot remove {self.path}, the side file of an earlier plan: "
                    f"{exc.strerror or exc}; remove it (readers refuse it: it no longer matches the config)",
                ) from None


def _read_side(side: Path) -> bytes | None:
    """The side file's bytes; None where it cannot be read (check_writable says why, if it matters)."""
    try:
        return read_limited(side, "--config")
    except InputError:
        return None


def check_writable(path: Path, backup: Path | None = None) -> None:
    """OSError saying why where the config `path` (through its links) or the folder its backup goes in
    (beside `path`) cannot be written."""
    writable_target(path)
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"folder {path.parent} (for {backup or 'the backup'}) is read-only")
    side = side_file_path(path)
    if os.path.lexists(side):  # written after the config: found now, while the config is as it was
        writable_target(side)
    for beside in (path.with_name(path.name + ".sapp-hook.bak"), side):
        if os.path.exists(path) and os.path.exists(beside) and os.path.samefile(beside, path):
            raise OSError(errno.EINVAL, f"{beside} is {path} itself (a link to it); expected a file of its own")


def _drop_backup_of_unchanged(backup: Path | None, target: Path) -> None:
    """Remove the backup just made where the config was left as it was (the write failed or was
    interrupted before its rename): the folder then is as it was."""
    with contextlib.suppress(OSError):
        if backup is not None and backup.read_bytes() == target.read_bytes():
            os.unlink(backup)


def in_form_of(old: str, new: str) -> str:
    """`new` in the form of `old`: its byte-order mark, and its line endings: a line kept from `old` ends
    as it did there, a changed line as the one it replaces, an added line as most of `old`'s lines do."""
    old_lines, new_lines = _lines(old.removeprefix(BOM)), _lines(new.removeprefix(BOM))
    ended = [ending for _, ending in old_lines if ending]
    newline = "\r\n" if ended.count("\r\n") * 2 > len(ended) else "\n"
    matcher = difflib.SequenceMatcher(None, [text for text, _ in old_lines], [text for text, _ in new_lines], False)
    out = []
    for tag, old_start, old_end, new_start, new_end in matcher.get_opcodes():
        for step, (text, ending) in enumerate(new_lines[new_start:new_end]):
            was = old_lines[old_start + step][1] if tag != "insert" and old_start + step < old_end else ""
            out.append(text + (was or newline if ending else ""))
    return (BOM if old.startswith(BOM) or new.startswith(BOM) else "") + "".join(out)


def _lines(text: str) -> list[tuple[str, str]]:
    """Each line of `text` and its ending: CRLF, LF, or none for a last line without one."""
    parts = text.split("\n")
    lines = [(part[:-1], "\r\n") if part.endswith("\r") else (part, "\n") for part in parts[:-1]]
    return [*lines, (parts[-1], "")] if parts[-1] else lines


def _target(path: Path, flag: str) -> Path:
    """The file a write to `path` replaces (through symbolic links); InputError naming `flag` if it is
    not a regular file."""
    try:
        return write_target(path)
    except OSError as exc:
        raise InputError(flag, f"{exc.strerror}; expected a regular file") from None
