"""`sapp-hook demo`: the whole loop on a laptop. A tiny Llama (transformers, random weights, CPU) trains a
few steps under `autotune` for 4 pipeline stages with a memory budget that no split fits without
recompute; the plan is written into an example config for every target, with a chart and a report."""

from __future__ import annotations

import logging
import shutil
from importlib import resources
from pathlib import Path

from basics.files import atomic_write_text
from basics.units import format_bytes
from sapp_hook.writeback import TARGETS, write_config
from solver import InfeasibleError, PipelineSpec, solve

log = logging.getLogger(__name__)

MODEL = "tiny-llama"
STAGES, MICRO_BATCHES, SCHEDULE = 4, 8, "1F1B"
MICRO_BATCH_SIZE, SEQ_LEN = 2, 128
# (target, example config): autotune writes the first; the others get the same plan after it
TEMPLATES = (
    ("mindformers", "mindformers_llama.yaml"),
    ("mindformers", "mindformers_v2_llama.yaml"),
    ("megatron", "megatron_llama.sh"),
    ("torchtitan", "torchtitan_llama.toml"),
)
BUDGET_SHARE = 0.9  # of the least memory any split needs without recompute


def run_demo(out: str | Path) -> dict[str, object]:
    """Run the demo into folder `out`; what it decided and wrote."""
    import torch

    from sapp_hook.hook.tune import autotune
    from sapp_hook.models import build_model, load_config, random_batch

    out = Path(out)
    configs = out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    for _, name in TEMPLATES:
        shutil.copy(resources.files("sapp_hook") / "templates" / name, configs / name)

    torch.set_num_threads(1)
    config = load_config(MODEL)
    budget = demo_budget(config)
    log.info(
        "demo: %s, %d stages, %d micro-batches of %dx%d tokens, budget %s per device (%.0f%% of the least "
        "any split needs without recompute)",
        MODEL,
        STAGES,
        MICRO_BATCHES,
        MICRO_BATCH_SIZE,
        SEQ_LEN,
        format_bytes(budget),
        BUDGET_SHARE * 100,
    )
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tuner = autotune(
        model,
        optimizer,
        pipeline_parallel=STAGES,
        micro_batches=MICRO_BATCHES,
        schedule=SCHEDULE,
        memory_budget=budget,
        config=configs / TEMPLATES[0][1],
        target=TEMPLATES[0][0],
        cache_dir=out / "cache",
        force=True,
        out_dir=out,
    )
    with tuner:
        step = 0
        while not tuner.done:
            loss = model(**random_batch(config, MICRO_BATCH_SIZE, SEQ_LEN, seed=step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tuner.step()
            step += 1
    result = tuner.result
    written = list(result.writeback.written)
    notes = list(result.writeback.notes)
    for target, name in TEMPLATES[1:]:
        back = write_config(target, configs / name, result.layout)
        written += back.written
        notes += [f"{name}: {note}" for note in back.notes]
    written += write_config("plan", out / "plan.yaml", result.layout).written
    report = out / "report.md"
    atomic_write_text(report, _report(result.report, written, notes, budget))
    log.info("demo: wrote %s", ", ".join([*written, str(report), str(out / "plan.png")]))
    return {"plan": result.plan_data, "written": [*written, str(report)], "notes": notes, "budget_bytes": budget}


def demo_budget(config: object) -> float:
    """A budget no split fits without recompute: BUDGET_SHARE of the least peak any split reaches without
    recompute, from the analytic profile (what the CPU measures for transformers' Llama, less the
    checkpoints' generator states)."""
    from profiler.estimate.analytic import analytic_profile, shape_from_config

    shape = shape_from_config(config.to_dict(), sequence=SEQ_LEN, micro_batch_size=MICRO_BATCH_SIZE, dtype="float32")
    estimate = analytic_profile(shape)
    without_recompute = estimate.with_modes(())
    spec = PipelineSpec(pipeline_parallel=STAGES, micro_batches=MICRO_BATCHES, schedule=SCHEDULE, memory_budget_bytes=1)
    solver_log = logging.getLogger("solver")
    level = solver_log.level
    solver_log.setLevel(logging.WARNING)  # this search is expected to fail: its progress would only confuse
    try:
        solve(without_recompute, spec, time_limit_s=30)
    except InfeasibleError as exc:
        return float(int(exc.smallest_budget_bytes * BUDGET_SHARE))
    finally:
        solver_log.setLevel(level)
    raise AssertionError("a 1-byte budget fitted")


def _report(plan_report: str, written: list[str], notes: list[str], budget: float) -> str:
    lines = [
        "# sapp-hook demo",
        "",
        (
            f"{MODEL} (transformers Llama, random weights, CPU), {STAGES} pipeline stages, {SCHEDULE}, "
            f"{MICRO_BATCHES} micro-batches of {MICRO_BATCH_SIZE}x{SEQ_LEN} tokens, memory budget "
            f"{format_bytes(budget)} per device: {BUDGET_SHARE:.0%} of the least any split needs without recompute."
        ),
        "",
        "```",
        plan_report,
        "```",
        "",
        "Files:",
        *(f"- {path}" for path in written),
        "- plan.png: the plan's schedule and each stage's memory",
        "- plan.json, profile.json: the plan and the measured profile",
    ]
    if notes:
        lines += ["", "What the write-backs said (what a target cannot express, what it changed):"]
        lines += [f"- {note}" for note in notes]
    lines.append("")
    lines.append(
        f"Targets: {', '.join(TARGETS)}. Apply a plan yourself: sapp-hook apply --plan plan.json --target NAME --config FILE"
    )
    return "\n".join(lines) + "\n"
