"""Reading input files up to a size, and writing output files whole or not at all, only over regular files."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import signal
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from basics.errors import InputError

MAX_FILE_BYTES = 64 * 2**20  # a profile, plan or config file is far smaller

# Temp files being written right now; a process ended by a signal removes them (`remove_pending`).
_PENDING: set[str] = set()
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
)


def write_target(path: str | Path) -> Path:
    """The file a write to `path` replaces: `path`, or where its symbolic links lead (the link stays a
    link). OSError if that exists and is not a regular file: a device, a pipe or a folder is never replaced."""
    target = Path(os.path.realpath(path))
    try:
        # `path` itself, through its links: /dev/stdout's leads to a pipe that realpath cannot name
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "of an unknown kind")
        raise OSError(errno.EINVAL, f"{path} is {kind}")
    return target


def writable_target(path: str | Path) -> Path:
    """`write_target(path)`, checked to be writable before any work: OSError saying why (in its strerror,
    the path named) where the file is not a regular one, is read-only or its folder is missing or
    read-only, or where the path itself cannot be looked up (too long, a loop of links)."""
    try:
        target = write_target(path)
        exists = os.path.lexists(target)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror) from None
    folder = target.parent
    if not os.path.isdir(folder):
        raise OSError(errno.ENOENT, f"folder {folder} does not exist")
    if exists and not os.access(target, os.W_OK):
        raise OSError(errno.EACCES, f"{path} is read-only")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"folder {folder} is read-only")
    return target


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    """Write `data` to `path` through a temp file in the same folder, fsync, then rename; returns the
    file written (through symbolic links, their target). A file rewritten keeps its permission bits
    (`mode`, if given, replaces them) and, where this process may, its owner; a new one gets 0o666 less
    the umask. Interrupted (any exception, Ctrl-C, SIGTERM), it leaves no temp file and `path` as it was."""
    target = write_target(path)
    try:
        old = os.stat(target)
    except FileNotFoundError:
        old = None
    temp_name = str(target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp"))
    try:
        with _signals_held():  # the temp file is known the moment it exists
            handle = os.open(temp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
            _PENDING.add(temp_name)
            temp = os.fdopen(handle, "wb")
        with temp:
            if old is not None:
                _keep_owner(temp.fileno(), old)
            if mode is not None or old is not None:
                os.fchmod(temp.fileno(), mode if mode is not None else stat.S_IMODE(old.st_mode))
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        os.replace(temp_name, target)
        _PENDING.discard(temp_name)
    except BaseException:
        remove_pending(temp_name)
        raise
    _sync_folder(target.parent)
    return target


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def append_lines(path: str | Path, lines: Sequence[str]) -> None:
    """`lines` added to the end of the text file at `path` (made where it is not), whole or not at all."""
    path = Path(path)
    before = path.read_text() if path.is_file() else ""
    atomic_write_text(path, before + "\n".join(lines) + "\n")


def remove_pending(*names: str) -> None:
    """Remove temp files of writes under way (those of `names`, or all): for a write or a process that must end now."""
    for name in [name for name in names if name in _PENDING] if names else list(_PENDING):
        with contextlib.suppress(OSError):
            os.unlink(name)
        _PENDING.discard(name)


def _keep_owner(handle: int, old: os.stat_result) -> None:
    if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(OSError):  # only root may give a file away; others keep their own
            os.fchown(handle, old.st_uid, old.st_gid)


def _sync_folder(folder: Path) -> None:
    """The rename made durable; not every file system lets a folder be opened or synced."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait (in this thread) until the block is done."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def folder_locked(path: str | Path, *, shared: bool = False) -> Iterator[None]:
    """An exclusive lock on the folder `path` lies in, held while the block runs, so that two writers there (two
    jobs, two `apply` runs) take turns: flock on the folder itself, which leaves no file beside a user's config
    and outlives no process. `shared`: a reader's lock, which waits for a writer's and lets other readers in.
    Where the platform has no flock, or the folder cannot be opened, no lock."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        handle = os.open(Path(path).parent or ".", os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing the last descriptor releases the lock


def read_limited(path: str | Path, what: str) -> bytes:
    """The bytes of a file of at most MAX_FILE_BYTES; InputError naming `what` otherwise."""
    path = Path(path)
    limit = f"expected at most {MAX_FILE_BYTES:,}"
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise InputError(what, f"{path} is {size:,} bytes; {limit}")
        with path.open("rb") as stream:  # a pipe or a device states no size: read one byte past the cap
            # what the file holds, not a buffer of the cap's size whatever it holds
            chunks, total, want = [], 0, size + 1
            while total <= MAX_FILE_BYTES:
                chunk = stream.read(min(want, MAX_FILE_BYTES + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total, want = total + len(chunk), 2**20
            data = b"".join(chunks)
    except OSError as exc:
        raise InputError(what, f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise InputError(what, f"{path} holds more than {MAX_FILE_BYTES:,} bytes; {limit}")
    return data


def read_json(path: str | Path, what: str) -> object:
    """Parse a JSON file of at most MAX_FILE_BYTES; InputError on anything else."""
    data = read_limited(path, what)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise InputError(what, f"{path} is not valid JSON: {exc}") from None
