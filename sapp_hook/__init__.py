"""sapp-hook: balance pipeline-parallel training from inside the run.

The public face. Today it offers the schedule simulator; the profiler, the solver and the
`autotune` hook will join it here.
"""

from simulator import (
    SCHEDULES,
    ChunkCosts,
    InputError,
    PipelineCosts,
    Schedule,
    ScheduleError,
    SimulationResult,
    build_schedule,
    simulate,
)

__all__ = [
    "SCHEDULES",
    "ChunkCosts",
    "InputError",
    "PipelineCosts",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "build_schedule",
    "simulate",
]
