"""The job the hook runs in, as the ranks agree on it: whether it is distributed, this process's rank, and
what every rank (or rank 0) says, as bytes over the default process group (nothing is pickled)."""

from __future__ import annotations

import atexit
import json
import os
from collections.abc import Callable

import torch.distributed as dist

from basics.errors import InputError
from profiler.distributed import all_gather_bytes
from sapp_hook.validation.gloo import end_without_teardown


def distributed() -> bool:
    """Whether this process is one rank of a torch.distributed job of more than one."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank: the process group's, else the launcher's (the group may be gone by exit time)."""
    if distributed():
        return dist.get_rank()
    try:
        return max(0, int(os.environ.get("RANK", "0"))) if launched() > 1 else 0
    except ValueError:
        return 0


def everyone(payload: bytes) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank (every rank must call it)."""
    return all_gather_bytes(payload) if distributed() else [payload]


def from_rank0(payload: bytes) -> bytes:
    """Rank 0's `payload`, on every rank (every rank must call it)."""
    return everyone(payload)[0]


class RankZeroFailed(RuntimeError):
    """What rank 0 did for every rank raised there (rank 0 raises its own error; the others this one)."""


def by_rank0(work: Callable[[], object]) -> object:
    """`work()` run on rank 0 only, its JSON value given to every rank (every rank must call it). Where it
    raises, every rank raises: rank 0 its error, the others the same InputError, or RankZeroFailed saying it,
    so that no rank waits for a rank that left."""
    failure: BaseException | None = None
    outcome: dict[str, object] = {}
    if rank() == 0:
        try:
            outcome = {"value": work()}
        except Exception as exc:
            failure = exc
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
            if isinstance(exc, InputError):
                outcome |= {"field": exc.field, "detail": exc.detail}
    shared = json.loads(from_rank0(json.dumps(outcome).encode()))
    if failure is not None:
        raise failure
    if "field" in shared:
        raise InputError(shared["field"], shared["detail"])
    if "error" in shared:
        raise RankZeroFailed(f"rank 0 failed, so this rank stops too: {shared['error']}")
    return shared["value"]


def launched() -> int:
    """How many processes the launcher started (torchrun's WORLD_SIZE), 1 where none says."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_coordinated() -> None:
    """One InputError where a launcher started several processes and no process group joins them: each would
    profile, plan and write the config on its own."""
    world = launched()
    if world > 1 and not distributed():
        rank_said = os.environ.get("RANK", "?")
        raise InputError(
            "pipeline_group",
            f"this process is rank {rank_said} of {world} a launcher started (WORLD_SIZE={world}), and no "
            "torch.distributed process group joins them, so each would plan and write the config on its own: "
            "call torch.distributed.init_process_group() before the first step(), or launch one process",
        )


def leave_groups_at_exit(status: int) -> None:
    """End the process with `status` once the interpreter's exit handlers registered after this module's import
    have run, without tearing the interpreter down: a job ended early for the relaunch skips its own
    `destroy_process_group()`, and gloo's threads torn down with the interpreter now and then abort the
    process (SIGABRT, every rank), which torchrun reports as a failure of the whole job."""
    global _exit_status
    if dist.is_available() and dist.is_initialized():  # without a group, nothing to tear down: a plain exit
        _exit_status = status


_exit_status: int | None = None


@atexit.register  # at import: the handlers a job registers later run before it
def _end() -> None:
    # a job that destroyed its groups after all exits as it would
    if _exit_status is None or not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    end_without_teardown(_exit_status)
