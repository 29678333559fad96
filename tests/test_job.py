"""What the ranks of a job agree on (sapp_hook.hook.job), on 2 gloo processes: rank 0's work reaches every rank, and
an error there stops every rank instead of leaving the others waiting; a rank known after its group is gone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from basics.errors import InputError
from sapp_hook.hook import job


def _work(outcome: str) -> object:
    if outcome == "value":
        return {"plan": [1, 2]}
    if outcome == "input":
        raise InputError("config", "plan mismatch")
    raise OSError(28, "No space left on device")


def _rank(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    said: dict[str, object] = {}
    for outcome in OUTCOMES:
        try:
            said[outcome] = {"value": job.by_rank0(lambda outcome=outcome: _work(outcome))}
        except Exception as exc:  # what each rank raised, for the test to read
            said[outcome] = {"raised": type(exc).__name__, "message": str(exc)}
    dist.destroy_process_group()
    os.environ.update(WORLD_SIZE="2", RANK=str(rank))
    said["rank_after_the_group"] = job.rank()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(said))


OUTCOMES = ("value", "input", "oserror")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of 2 gloo processes got from `by_rank0` for each outcome of rank 0's work."""
    folder = tmp_path_factory.mktemp("job")
    mp.start_processes(_rank, args=(str(folder),), nprocs=2, start_method="spawn")
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_rank0s_value_reaches_every_rank_and_each_knows_its_rank_after_the_group(ranks):
    assert [said["value"] for said in ranks] == [{"value": {"plan": [1, 2]}}] * 2
    assert [said["rank_after_the_group"] for said in ranks] == [0, 1]  # the launcher's RANK, not 0 everywhere


def test_an_error_on_rank0_stops_every_rank_with_it(ranks):
    assert [said["input"] for said in ranks] == [{"raised": "InputError", "message": "config: plan mismatch"}] * 2
    first, second = (said["oserror"] for said in ranks)
    assert first["raised"] == "OSError"  # rank 0's own error, unchanged
    assert second["raised"] == "RankZeroFailed" and "No space left on device" in second["message"]


def test_one_process_runs_the_work_itself():
    assert job.by_rank0(lambda: [3]) == [3]
    with pytest.raises(InputError, match="config: plan mismatch"):
        job.by_rank0(lambda: _work("input"))
