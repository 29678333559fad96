"""What torch.distributed.pipelining does that a plan must allow for. No torch import: the CLI reads it."""

from __future__ import annotations

import re
from collections.abc import Iterable

from basics.errors import InputError
from simulator.schedules import schedule_kind
from solver.vocabulary.profile import NONE

# sapp-hook's schedule names as torch.distributed.pipelining's classes; its get_schedule_class (which
# TorchTitan's pipeline_parallel_schedule goes through) takes the keys.
TORCH_SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


# torch.distributed.pipelining has every schedule class above from this release on (ScheduleDualPipeV came last).
TORCH_FLOOR = (2, 9)


def check_torch() -> None:
    """One InputError naming torch where it is missing or older than TORCH_FLOOR (pyproject's floor)."""
    floor = ".".join(map(str, TORCH_FLOOR))
    try:
        import torch
    except ImportError:
        raise InputError(
            "torch", f"not installed; the profiler and the hook need torch >= {floor} (pip install 'sapp-hook[torch]')"
        ) from None
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None or tuple(map(int, found.groups())) < TORCH_FLOOR:
        raise InputError(
            "torch",
            f"found {torch.__version__}; sapp-hook needs torch >= {floor}, the first release "
            "whose torch.distributed.pipelining has every schedule it runs (DualPipeV)",
        )


def check_torch_runs(schedule: str, field: str, runner: str = "it") -> None:
    """One InputError naming `field` where torch.distributed.pipelining has no class for `schedule`
    (`runner`: who runs torch, for the message)."""
    if schedule not in TORCH_SCHEDULES:
        raise InputError(
            field, f"torch.distributed.pipelining has no {schedule}; {runner} runs {', '.join(TORCH_SCHEDULES)}"
        )


def recompute_runs_under(schedule: str) -> bool:
    """Whether torch runs recomputed (checkpointed) blocks as planned under `schedule`: not where the
    schedule splits the backward (ZBH1, ZBVZeroBubble, DualPipeV). torch's split backward runs
    `stage_backward_input`, then `stage_backward_weight` with one `autograd.grad` per group of weights,
    and a checkpointed region is run again for every call that reaches it: a selective-checkpoint region
    refuses the second backward, and a fully checkpointed Llama block ran its forward 10 times instead of
    2 (two blocks, 9 weight groups each). tiny-llama under ZBVZeroBubble with every block fully
    recomputed took 2.6x its predicted step time and peaked above the same split without recompute."""
    return not schedule_kind(schedule).splits_backward


def check_no_recompute(schedule: str, modes: Iterable[str], field: str, runner: str = "") -> None:
    """One InputError naming `field` where a plan recomputing layers (its `modes`) would run under
    `schedule` on torch (`runner`: who runs torch, for the message)."""
    if not recompute_runs_under(schedule) and set(modes) - {NONE}:
        raise InputError(field, f"recomputes layers; {runner}{no_recompute_reason(schedule)}; plan with --modes none")


def no_recompute_reason(schedule: str) -> str:
    """Why a plan under `schedule` may not recompute on torch (for errors and notes)."""
    return (
        f"{schedule} splits each backward in two, and torch runs a checkpointed block again for every "
        "weight-gradient group of the second half (a selective one not at all): recompute there costs "
        "several forwards and holds more memory than none"
    )
