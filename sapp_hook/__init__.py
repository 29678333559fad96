"""sapp-hook: balance pipeline-parallel training from inside the run.

The public face: `autotune` (profile, solve, simulate, write the launch config), `write_config`,
`torchtitan_module_names` (a plan's module names per model part, as TorchTitan takes them), and the schedule
simulator's names. Each is imported on first use: planning and simulation work where torch is not installed,
and the `sapp-hook` command starts without loading what it does not run.
"""

import importlib
from typing import Any

from sapp_hook.hook.relaunch import REPLAN_EXIT_CODE

# Imported on first use, so that `import sapp_hook` (and the `sapp-hook` command starting) loads nothing
# heavy: name -> the module that has it.
_EXPORTS = {
    **{name: "sapp_hook.writeback" for name in ("layout_from_dict", "layout_of", "write_config")},
    "torchtitan_module_names": "sapp_hook.writeback.torchtitan",
    **{
        name: "simulator"
        for name in (
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
        )
    },
}
# These need torch.
_TORCH_EXPORTS = {
    "autotune": "sapp_hook.hook.tune",
    "AutoTuner": "sapp_hook.hook.tune",
    "TuneResult": "sapp_hook.hook.tune",
    "build_stages": "sapp_hook.pipelining.stages",
    "TiedGradients": "sapp_hook.pipelining.stages",
    "schedule_class": "sapp_hook.pipelining.stages",
}


# Renamed public names, kept for one release: old name -> new name.
_RENAMED = {"apply": "build_stages"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        from basics.deprecation import warn_renamed

        warn_renamed(f"sapp_hook.{name}", f"sapp_hook.{_RENAMED[name]}")
        name = _RENAMED[name]
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name not in _TORCH_EXPORTS:
        raise AttributeError(f"module 'sapp_hook' has no attribute {name!r}")
    from sapp_hook.pipelining.engine_rules import check_torch

    check_torch()
    return getattr(importlib.import_module(_TORCH_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_TORCH_EXPORTS})


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
