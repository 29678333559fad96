"""Pipeline schedules as per-rank action lists, replayed with per-(rank, chunk) costs.

    >>> from simulator import build_schedule, PipelineCosts, simulate
    >>> schedule = build_schedule("1F1B", ranks=4, micro_batches=8)
    >>> result = simulate(schedule, PipelineCosts.uniform(4, 1, forward_ms=1.0, backward_ms=2.0))
    >>> result.iteration_time_ms  # (M + S - 1) * (F + B)
    33.0

Knows nothing of solvers or torch.
"""

from basics.errors import InputError
from simulator.actions import Action
from simulator.costs import ChunkCosts, PipelineCosts
from simulator.errors import ScheduleError
from simulator.replay import critical_path, simulate
from simulator.result import BubbleSplit, SimulationResult, TimedAction
from simulator.schedule import Schedule
from simulator.schedules import SCHEDULES, ScheduleKind, build_schedule, schedule_kind

__all__ = [
    "SCHEDULES",
    "Action",
    "BubbleSplit",
    "ChunkCosts",
    "InputError",
    "PipelineCosts",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "SimulationResult",
    "TimedAction",
    "build_schedule",
    "critical_path",
    "schedule_kind",
    "simulate",
]
