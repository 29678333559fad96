"""sapp-hook: balance pipeline-parallel training from inside the run.

The public face: `autotune` (profile, solve, simulate, write the launch config), `write_config`,
`torchtitan_module_names` (a plan's module names per model part, as TorchTitan takes them), and the schedule simulator's names. The
torch parts are imported on first use, so planning and simulation work where torch is not installed.
"""

from typing import Any

from sapp_hook.protocol import REPLAN_EXIT_CODE
from sapp_hook.writeback import layout_from_dict, layout_of, write_config
from sapp_hook.writeback.torchtitan import torchtitan_module_names
from simulator import (
    SCHEDULES,
    ChunkCosts,
    InputError,
    PipelineCosts,
    Schedule,
    ScheduleError,
    SimulationResult,
    build_schedule,
    critical_path,
    simulate,
)

# Imported on first use: these need torch.
_TORCH_EXPORTS = {
    "autotune": "sapp_hook.tune",
    "AutoTuner": "sapp_hook.tune",
    "TuneResult": "sapp_hook.tune",
    "apply": "sapp_hook.stages",
    "TiedGradients": "sapp_hook.stages",
    "schedule_class": "sapp_hook.stages",
}


def __getattr__(name: str) -> Any:
    if name not in _TORCH_EXPORTS:
        raise AttributeError(f"module 'sapp_hook' has no attribute {name!r}")
    import importlib

    from sapp_hook.torch_engine import check_torch

    check_torch()
    return getattr(importlib.import_module(_TORCH_EXPORTS[name]), name)


__all__ = [
    *_TORCH_EXPORTS,
    "REPLAN_EXIT_CODE",
    "layout_from_dict",
    "layout_of",
    "torchtitan_module_names",
    "write_config",
    "SCHEDULES",
    "ChunkCosts",
    "InputError",
    "PipelineCosts",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "build_schedule",
    "critical_path",
    "simulate",
]
