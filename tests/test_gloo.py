"""A spawned rank ends as soon as its work returns: gloo groups that outlive their block (held by a
DeviceMesh in DTensor's caches) are never torn down with the interpreter, which aborts a rank now and then."""

from __future__ import annotations

import atexit
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessRaisedException

from sapp_hook.validation.gloo import gloo_group, spawn


def _teardown_ran(folder: str, rank: int) -> None:
    Path(folder, f"teardown{rank}").write_text("ran")


def rank_with_teardown(rank: int, store: str, folder: str) -> None:
    with gloo_group(rank, 2, store):
        atexit.register(_teardown_ran, folder, rank)
    Path(folder, f"returned{rank}").write_text("yes")


def test_a_rank_ends_when_its_work_returns_without_interpreter_teardown(tmp_path):
    spawn(rank_with_teardown, (str(tmp_path / "store"), str(tmp_path)), 2)
    for rank in (0, 1):
        assert (tmp_path / f"returned{rank}").exists()
        assert not (tmp_path / f"teardown{rank}").exists()


def failing_rank(rank: int, store: str) -> None:
    with gloo_group(rank, 1, store):
        raise ValueError("rank 0 refused")


def test_a_rank_that_raises_reports_its_error(tmp_path):
    with pytest.raises(ProcessRaisedException, match="rank 0 refused"):
        spawn(failing_rank, (str(tmp_path / "store"),), 1)
