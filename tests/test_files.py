"""Writing files: whole or not at all, through symbolic links, never over a device or a pipe, keeping a
rewritten file's mode, owner, line endings and byte-order mark; and a command that does not stop when
told is ended by the CLI's watchdog with its temp files removed."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from basics.errors import InputError, Terminated
from basics.files import MAX_FILE_BYTES, atomic_write_bytes, atomic_write_text, read_limited, write_target
from sapp_hook.writeback.files import WriteBack, commit, in_form_of

ROOT = Path(__file__).parents[1]


def _leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.endswith(".tmp"))


def test_a_rewritten_file_keeps_its_mode_and_owner_and_a_new_one_follows_the_umask(tmp_path):
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(kept, 65534, 65534)
    atomic_write_text(kept, "new")
    info = kept.stat()
    assert kept.read_text() == "new" and stat.S_IMODE(info.st_mode) == 0o640
    if os.geteuid() == 0:
        assert (info.st_uid, info.st_gid) == (65534, 65534)
    umask = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "new.json", "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640  # 0o666 less 0o027


def test_a_link_is_written_through_and_stays_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "plan.json"
    target.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to("real/plan.json")
    assert atomic_write_text(link, "new") == target.resolve()
    assert link.is_symlink() and target.read_text() == "new" and _leftovers(tmp_path / "real") == []
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to("real/made.json")
    atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "real" / "made.json").read_text() == "made"


@pytest.mark.parametrize("kind", ["character device", "named pipe (FIFO)", "folder"])
def test_anything_but_a_regular_file_is_never_replaced(tmp_path, kind):
    path = tmp_path / "node"
    if kind == "character device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    link = tmp_path / "link"
    link.symlink_to(path)
    for name in (path, link):
        with pytest.raises(OSError, match=re.escape(f"{name} is a {kind}")):
            atomic_write_bytes(name, b"x")
    assert path.lstat().st_mode == (tmp_path / "node").lstat().st_mode and link.is_symlink()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("exception", [KeyboardInterrupt, Terminated, OSError])
def test_an_interrupted_write_leaves_no_temp_file_and_the_old_bytes(tmp_path, monkeypatch, exception):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"old: 1\n")

    def interrupted(handle: int) -> None:
        raise exception()

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(exception):
        atomic_write_text(path, "new: 2\n")
    assert path.read_bytes() == b"old: 1\n" and _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("old", "new", "kept"),
    [
        ("a: 1\r\nb: 2\r\n", "a: 1\r\nb: 3\nc: 4\n", "a: 1\r\nb: 3\r\nc: 4\r\n"),  # CRLF throughout
        ("a: 1\nb: 2\n", "a: 1\nb: 3\n", "a: 1\nb: 3\n"),
        ("a: 1\r\nb: 2\n", "a: 1\nb: 3\n", "a: 1\r\nb: 3\n"),  # mixed: each line as it ended
        ("\ufeffa: 1\n", "a: 2\n", "\ufeffa: 2\n"),  # the byte-order mark stays
        # most lines LF, one CRLF: a line added is LF (a CRLF after a bash `\\` continues no line), the CRLF
        # one stays CRLF, a writer's CRLF throughout is undone where the file did not say it
        ("a \\\n# x\r\nb\n", "a \\\r\n  c \\\r\n# x\r\nb\r\n", "a \\\n  c \\\n# x\r\nb\n"),
        ("a\r\nb\r\nc\n", "a\r\nb\nX\nc\n", "a\r\nb\r\nX\r\nc\n"),  # most lines CRLF: an added one too
        ("a\r\n", "a\r\r\n", "a\r\r\n"),  # a CR inside a line is the line's own text
        ("a\r\nb", "a\r\nb\nc", "a\r\nb\r\nc"),  # the last line's ending as the file's others
    ],
)
def test_new_text_takes_the_old_files_form(old, new, kept):
    assert in_form_of(old, new) == kept


def test_the_backup_is_the_config_as_it_was_with_its_mode(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_bytes(b"a: 1\r\n")
    path.chmod(0o600)
    result = commit(WriteBack(path=path, diff=""), "a: 1\r\n", "a: 2\n", dry_run=False)
    assert path.read_bytes() == b"a: 2\r\n" and result.backup.read_bytes() == b"a: 1\r\n"
    assert stat.S_IMODE(result.backup.stat().st_mode) == 0o600 and _leftovers(tmp_path) == []


def test_a_config_that_is_a_device_is_refused_even_in_a_dry_run(tmp_path):
    path = tmp_path / "zero"
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    with pytest.raises(InputError, match=r"--config: .* is a character device; expected a regular file"):
        commit(WriteBack(path=path, diff=""), "", "plan: 1\n", dry_run=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zero"]


def test_a_stream_is_read_to_one_byte_past_the_cap(tmp_path):
    zero = tmp_path / "zero"
    os.mknod(zero, 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    with pytest.raises(InputError, match=f"holds more than {MAX_FILE_BYTES:,} bytes"):
        read_limited(zero, "--profile")
    with pytest.raises(OSError, match="is a character device"):
        write_target(zero)


WATCHED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from sapp_hook.cli.terminal import signals_end_the_command
    from basics import files

    temp = Path(sys.argv[1])
    with signals_end_the_command(lambda: "sapp-hook test"):
        temp.write_text("half")
        files._PENDING.add(str(temp))
        ready = False
        while True:  # code that swallows every interrupt, as a C library's callback may
            try:
                if not ready:  # the signal comes only after this line, so never before the try
                    ready = True
                    print("ready", file=sys.stderr, flush=True)
                time.sleep(0.1)
            except BaseException:
                pass
""")


@pytest.mark.parametrize(
    ("number", "status", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_command_that_swallows_the_signal_is_ended_with_its_temp_files_removed(tmp_path, number, status, word):
    temp = tmp_path / ".plan.json.1234.tmp"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", WATCHED, str(temp)], stderr=subprocess.PIPE, text=True, env=environment
    )
    assert process.stderr.readline() == "ready\n"
    process.send_signal(number)
    _, err = process.communicate(timeout=60)
    assert process.returncode == status and err == f"sapp-hook test: {word}\n" and not temp.exists(), err
