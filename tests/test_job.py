"""What the ranks of a job agree on (sapp_hook.hook.job), on 2 gloo processes: rank 0's work reaches every rank, and
an error there stops every rank instead of leaving the others waiting; a rank known after its group is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


EXIT = """
import atexit, sys, tempfile
import torch.distributed as dist
from sapp_hook.hook import job
destroy = dist.destroy_process_group
dist.destroy_process_group = lambda: (print("groups destroyed"), destroy())
class Teardown:
    def __del__(self):
        print("interpreter torn down")
teardown = Teardown()  # its __del__ runs as the interpreter is torn down, where gloo's threads may abort
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
job.leave_groups_at_exit(int(sys.argv[1]))
if sys.argv[2] == "destroy":
    dist.destroy_process_group()
atexit.register(print, "the job's exit handler ran")  # registered after the hook's module: runs before its end
raise SystemExit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("status", [0, 75])
@pytest.mark.parametrize("destroyed", [False, True])
def test_a_job_ended_for_the_relaunch_leaves_its_groups_and_ends_with_its_status(status, destroyed):
    """A job the hook ends for the relaunch keeps its status and runs its own exit handlers; where it left its
    process groups, they are destroyed for it and the interpreter is not torn down (gloo's threads torn down
    with it now and then abort the process, which torchrun reports as the job's failure)."""
    command = [sys.executable, "-c", EXIT, str(status), "destroy" if destroyed else "keep"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    if destroyed:  # the job that destroyed its groups itself exits as any program does
        assert done.stdout == "groups destroyed\nthe job's exit handler ran\ninterpreter torn down\n"
    else:
        assert done.stdout == "the job's exit handler ran\ngroups destroyed\n"
