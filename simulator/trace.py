"""Chrome / Perfetto trace of a replay: one process per rank, one slice per action, a memory counter."""

from __future__ import annotations

import json
from pathlib import Path

from basics.files import atomic_write_text
from simulator.result import SimulationResult

CATEGORY = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def chrome_trace(result: SimulationResult) -> dict[str, object]:
    """Trace events (`ph: X` slices, `ph: C` memory counters) with timestamps in microseconds."""
    events: list[dict[str, object]] = []
    for rank in range(result.schedule.ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        for timed in result.rank_timeline(rank):
            action = timed.action
            events.append(
                {
                    "name": f"{action.op} mb{action.microbatch}",
                    "cat": CATEGORY[action.op],
                    "ph": "X",
                    "pid": rank,
                    "tid": 0,
                    "ts": timed.start_ms * 1000.0,
                    "dur": (timed.end_ms - timed.start_ms) * 1000.0,
                    "args": {
                        "action": str(action),
                        "stage_index": action.stage_index,
                        "chunk": timed.chunk,
                        "microbatch": action.microbatch,
                    },
                }
            )
        for time_ms, memory_bytes in result.memory_curve(rank):
            events.append(
                {"name": "memory", "ph": "C", "pid": rank, "ts": time_ms * 1000.0, "args": {"bytes": memory_bytes}}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": result.to_dict()}


def write_chrome_trace(result: SimulationResult, path: str | Path) -> None:
    atomic_write_text(path, json.dumps(chrome_trace(result)))
