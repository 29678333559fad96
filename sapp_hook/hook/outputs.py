"""What the hook tells a user and leaves behind: the report (the plan table, the even split beside it, what was
written), the out folder's files, the few summary lines, and the command that solves a kept profile again."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from basics.files import append_lines, atomic_write_text
from basics.units import format_bytes, format_ms
from sapp_hook.hook.result import TuneResult
from sapp_hook.report import against_even, plan_report
from solver import PipelineSpec

log = logging.getLogger(__name__)


def report_text(result: TuneResult) -> str:
    """The plan's table and the even split beside it where this rank solved, the cached plan's figures where it
    was reused; then what was written and the notes on what the config cannot say."""
    lines = []
    if result.plan is not None and result.profile is not None:
        lines.append(plan_report(result.plan))
        lines.append(against_even(result.plan, result.profile)[0])
    else:
        data = result.plan_data
        lines.append(
            f"cached plan: iteration time {format_ms(data['iteration_time'])} ms, peak memory per rank "
            + ", ".join(format_bytes(b) for b in data["rank_peak_memory_bytes"])
        )
    if result.writeback is not None:
        lines += _wrote(result)
        lines += [f"note: {note}" for note in result.writeback.notes]
    return "\n".join(lines)


def write_outputs(folder: Path, result: TuneResult) -> None:
    """plan.json, report.txt and plan.png (with matplotlib) into `folder` (profile.json is kept there before
    solving). A reused plan's launch adds its lines to the report the planning launch wrote, never replaces its
    table."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "plan.json", json.dumps(result.plan_data, indent=1) + "\n")
    report = folder / "report.txt"
    if result.from_cache and report.is_file():
        append_lines(report, ["", "-- a launch that reused the plan --", result.report])
    else:
        atomic_write_text(report, result.report + "\n")
    if result.plan is not None and result.plan.simulation is not None:
        try:
            from simulator.plot import draw_gantt

            draw_gantt(result.plan.simulation, folder / "plan.png")
        except ImportError:
            log.info("sapp-hook: matplotlib is not installed; no chart")


def summary(result: TuneResult) -> list[str]:
    """What the plan is, in the lines a user sees (the rank that solved, or the reused plan's figures)."""
    data = result.plan_data
    counts = ", ".join("+".join(str(count) for count in row) for row in data["plan"]["rank_chunk_layers"])
    peak = max(data["rank_peak_memory_bytes"])
    budget = data.get("memory_budget_bytes")
    fit = f" of {format_bytes(budget)}" if budget else ""
    spec = data["spec"]
    plan = (
        f"plan: {spec['schedule']} on {spec['pipeline_parallel']} ranks x {spec['chunks']} chunk(s), layers per "
        f"rank {counts}; iteration {format_ms(data['iteration_time'])} ms, peak {format_bytes(peak)}{fit}"
    )
    lines = [plan]
    if result.plan is not None and result.profile is not None:
        lines.append(against_even(result.plan, result.profile)[0].replace("even split      ", "even split: "))
    return lines


def written_lines(result: TuneResult, out_dir: Path | None) -> list[str]:
    """What was written where, in the lines a user sees."""
    lines = []
    if result.writeback is not None:
        lines += _wrote(result)
        if result.writeback.notes:
            lines.append(f"{len(result.writeback.notes)} note(s) on what the config cannot say: see the report")
    if out_dir is not None:
        lines.append(f"report: {out_dir / 'report.txt'}")
    return lines


def _wrote(result: TuneResult) -> list[str]:
    return [f"wrote {path}" for path in result.writeback.written] if result.writeback is not None else []


def ended_early(done: int, total: int) -> str:
    """Why a job that ended after `done` of the `total` steps profiling needs has no plan."""
    return (
        f"the training ended after {done} of the {total} steps profiling needs, so nothing was planned: "
        f"train at least {total} steps under the tuner (or profile fewer: profile_steps=1)"
    )


def solve_command(spec: PipelineSpec, profile: Path, budget_bytes: float | None, *, auto: bool = False) -> str:
    """The `sapp-hook solve` that plans this job again from a kept profile, without profiling (`auto`: the job's
    schedule is `auto`, not `spec`'s)."""
    parts = [
        f"sapp-hook solve --profile {profile}",
        f"--pipeline-parallel {spec.pipeline_parallel} --micro-batches {spec.micro_batches}",
        "--schedule auto" if auto else f"--schedule {spec.pipeline_schedule.name} --chunks {spec.num_chunks}",
        f"--memory {math.ceil(budget_bytes)}B" if budget_bytes is not None else "--memory SIZE",
    ]
    switches: dict[str, Any] = {
        "--receive-buffers": spec.receive_buffers,
        "--fsdp": spec.fsdp,
        "--reshard-after-forward": spec.fsdp_reshard_after_forward,
        "--sequence-parallel": spec.sequence_parallel,
        "--ddp": spec.ddp,
        "--ddp-bucket-view": spec.ddp_bucket_view,
        "--zero-grad-to-none": not spec.gradients_persist,
    }
    parts += [flag for flag, on in switches.items() if on]
    values: dict[str, tuple[object, object]] = {  # flag: (the job's value, the flag's default)
        "--data-parallel": (spec.data_parallel, 1),
        "--zero-stage": (spec.zero_stage, 0),
        "--tensor-parallel": (spec.tensor_parallel, 1),
        "--context-parallel": (spec.context_parallel, 1),
        "--expert-parallel": (spec.expert_parallel, 1),
        "--expert-tokens": (spec.expert_tokens, "balanced"),
        "--collective-backend": (spec.collective_backend, "nccl"),
        "--microbatch-group-size": (spec.microbatch_group_size, None),
        "--p2p": (spec.p2p_ms, 0.0),
        "--action-overhead": (spec.action_overhead_ms, 0.0),
    }
    parts += [f"{flag} {value}" for flag, (value, default) in values.items() if value != default]
    return " ".join(parts)
