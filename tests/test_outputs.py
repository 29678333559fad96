"""Outputs: the schedule CSV (read back by us and by torch), the Chrome trace, the Gantt chart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from simulator import SCHEDULES, ChunkCosts, InputError, PipelineCosts, Schedule, build_schedule, simulate
from simulator.plot import draw_gantt
from simulator.schedule import rank_chunk_to_stage
from simulator.trace import chrome_trace, write_chrome_trace

torch.set_num_threads(1)


def small(name: str) -> Schedule:
    kind = SCHEDULES[name]
    return build_schedule(name, 3, kind.min_micro_batches(3, kind.min_chunks) + 2)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_csv_round_trip(name, tmp_path):
    schedule = small(name)
    path = tmp_path / "schedule.csv"
    schedule.write_csv(path)
    again = Schedule.from_csv(
        path.read_text(),
        name=name,
        chunks=schedule.chunks,
        micro_batches=schedule.micro_batches,
        placement=schedule.placement,
    )
    assert again == schedule


def test_dualpipev_csv_writes_overlapped_pairs_as_torch_does():
    first_row = build_schedule("DualPipeV", 2, 4).to_csv().splitlines()[0].split(",")
    assert "(0F3;3B1)OVERLAP_F_B" in first_row
    parsed = [torch_schedules._Action.from_str(cell) for cell in first_row]
    assert all(action is not None for action in parsed)


class StandInStage:
    def __init__(self, stage_index: int, stages: int, chunks: int) -> None:
        self.stage_index, self.num_stages = stage_index, stages * chunks
        self.group_size, self.group_rank = stages, 0
        self.submod = torch.nn.Identity()
        self.is_first, self.is_last = stage_index == 0, stage_index == stages * chunks - 1


@pytest.mark.parametrize(
    "name, torch_name",
    [
        ("Interleaved1F1B", "Interleaved1F1B"),
        ("Interleaved1F1B-less-memory", "Interleaved1F1B"),  # torch runs any valid order from a CSV
        ("ZBVZeroBubble", "ZBVZeroBubble"),
        ("DualPipeV", "DualPipeV"),
    ],
)
def test_torch_loads_and_validates_our_csv(name, torch_name, tmp_path):
    schedule = build_schedule(name, 4, 8)
    path = tmp_path / "schedule.csv"
    schedule.write_csv(path)
    stages = [
        StandInStage(rank_chunk_to_stage(0, chunk, 4, schedule.placement), 4, schedule.chunks)
        for chunk in range(schedule.chunks)
    ]
    runtime = torch_schedules.get_schedule_class(torch_name)(stages, 8)
    runtime._load_csv(str(path))  # validates the actions and lowers them with send/recv
    loaded = [[str(a) for a in runtime.pipeline_order[rank] if a is not None] for rank in range(4)]
    assert loaded == [cell.split(",") for cell in schedule.to_csv().splitlines()]


@pytest.mark.parametrize("text", ["0F0,0X1", "0F0,(0F1;1B0)OVERLAP", "0F-1"])
def test_bad_csv_is_refused(text):
    with pytest.raises(InputError, match="csv row 0"):
        Schedule.from_csv(text, name="x", chunks=1, micro_batches=2)


def result_with_memory(name="Interleaved1F1B", ranks=4, micro_batches=8):
    schedule = build_schedule(name, ranks, micro_batches)
    chunk = ChunkCosts(forward_ms=1.0, backward_ms=2.0, activation_bytes=2**30, static_bytes=2**32, working_bytes=2**28)
    costs = PipelineCosts(tuple((chunk,) * schedule.chunks for _ in range(ranks)), p2p_ms=0.1)
    return simulate(schedule, costs)


def test_chrome_trace(tmp_path):
    result = result_with_memory()
    trace = chrome_trace(result)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == result.schedule.num_actions
    for event in slices:
        timed = next(t for t in result.rank_timeline(event["pid"]) if str(t.action) == event["args"]["action"])
        assert event["ts"] == pytest.approx(timed.start_ms * 1000)
        assert event["dur"] == pytest.approx((timed.end_ms - timed.start_ms) * 1000)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == 0]
    assert max(e["args"]["bytes"] for e in counters) == result.rank_peak_memory_bytes[0]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(4)}
    path = tmp_path / "trace.json"
    write_chrome_trace(result, path)
    assert json.loads(path.read_text())["metadata"]["iteration_time"] == result.iteration_time_ms


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_gantt_chart_files(tmp_path, suffix, magic):
    path = tmp_path / f"gantt{suffix}"
    draw_gantt(result_with_memory("DualPipeV", 3, 6), path)
    assert path.read_bytes().startswith(magic)


def test_gantt_chart_refuses_unknown_formats(tmp_path):
    with pytest.raises(InputError, match=r"plot: expected a file ending in .png"):
        draw_gantt(result_with_memory(), tmp_path / "gantt.jpg")
    assert not (tmp_path / "gantt.jpg").exists()


def test_simulating_does_not_import_matplotlib():
    code = (
        "import sys; from simulator import build_schedule, simulate, PipelineCosts;"
        "simulate(build_schedule('1F1B', 2, 2), PipelineCosts.uniform(2, 1, forward_ms=1, backward_ms=2));"
        "import sapp_hook.cli;"
        "print('matplotlib' in sys.modules, 'torch' in sys.modules)"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.split() == ["False", "False"]
