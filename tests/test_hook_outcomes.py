"""What a user of `autotune` sees and keeps, on one process: the lines on stderr (and none when quiet), the profile
kept when no plan fits with the command that plans it again, a job ended too soon said at exit, a foreign or
damaged cache entry planned again with its reason, another schedule predicted faster said with both figures, and
schedule="auto". (The torchrun cases are tests/test_real_jobs.py.)"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
from profiler_cases import llama, qwen3_moe, train_step
from solver_cases import small_profile
from test_autotune import PROFILING, SETTING, train

from sapp_hook import autotune
from sapp_hook.cli import main
from sapp_hook.hook.cache import PlanCache
from sapp_hook.hook.check import verdict
from sapp_hook.hook.decide import plan_for
from sapp_hook.hook.outputs import solve_command
from sapp_hook.writeback import runnable_schedules
from simulator import InputError
from solver import InfeasibleError, PipelineSpec, solve
from solver.compare import candidates, fastest


def said(captured: str) -> list[str]:
    return [line.removeprefix("sapp-hook: ") for line in captured.splitlines() if line.startswith("sapp-hook: ")]


def test_a_plain_script_shows_what_was_planned_and_written_and_quiet_shows_nothing(tmp_path, capfd):
    plan_file = tmp_path / "plan.json"
    train(llama(), PROFILING + 1, config=plan_file, target="plan", cache_dir=tmp_path / "cache", out_dir=tmp_path)
    lines = said(capfd.readouterr().err)
    assert lines[0].startswith("no plan cached for this job: profiling its 4 layers a rank over the next 6 steps")
    assert any(line.startswith("solving 1F1B for 4 ranks (the layers' measured times vary by ") for line in lines)
    assert any(line.startswith("plan: 1F1B on 4 ranks x 1 chunk(s), layers per rank ") for line in lines)
    assert f"wrote {plan_file}" in lines and f"report: {tmp_path / 'report.txt'}" in lines
    train(llama(), 3, config=plan_file, target="plan", cache_dir=tmp_path / "cache", out_dir=tmp_path, quiet=True)
    assert said(capfd.readouterr().err) == []
    report = (tmp_path / "report.txt").read_text()
    assert report.startswith("1F1B: 4 ranks x 1 chunk") and "-- a launch that reused the plan --" in report


def test_no_plan_fits_keeps_the_profile_and_says_how_to_plan_again_from_it(tmp_path, capsys):
    with pytest.raises(InputError) as caught:
        train(llama(), PROFILING + 1, memory_budget="10KB", cache_dir=tmp_path / "cache", out_dir=tmp_path)
    message = caught.value.detail
    assert "sapp-hook found no plan; the config is untouched" in message and "smallest budget that fits" in message
    command = message.split("plan again without profiling with `")[1].rstrip("`")
    assert (tmp_path / "profile.json").is_file()
    assert main([*shlex.split(command)[1:], "--quiet"]) == 0  # the budget it names fits, from the kept profile


def test_a_job_that_ends_before_its_plan_says_so_at_exit(tmp_path, capfd, monkeypatch):
    planned = tmp_path / "planned.json"
    monkeypatch.setenv("SAPP_HOOK_PLANNED_FILE", str(planned))
    tuner = train(llama(), 3, cache_dir=tmp_path)
    assert not tuner.done
    why = "the training ended after 3 of the 7 steps profiling needs, so nothing was planned"
    assert any(line.startswith(why) for line in said(capfd.readouterr().err))
    assert json.loads(planned.read_text())["incomplete"].startswith(why)  # for sapp-hook run to report


def _entry(cache: Path) -> Path:
    (path,) = [path for path in cache.glob("*.json") if not path.name.endswith(".profile.json")]
    return path


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda entry: entry["plan"]["spec"].update(schedule="GPipe"), "it was planned for other settings: schedule"),
        (lambda entry: entry["plan"].pop("iteration_time"), "its plan lacks iteration_time"),
        (lambda entry: entry["key"].update(model="another"), "it was made for another job"),
    ],
    ids=["another-schedule", "missing-field", "foreign"],
)
def test_a_foreign_or_damaged_cache_entry_is_planned_again_with_its_reason(tmp_path, capfd, damage, reason):
    options = {"config": tmp_path / "plan.json", "target": "plan", "cache_dir": tmp_path / "cache"}
    train(llama(), PROFILING + 1, **options)
    entry = json.loads(_entry(tmp_path / "cache").read_text())
    damage(entry)
    _entry(tmp_path / "cache").write_text(json.dumps(entry))
    capfd.readouterr()
    again = train(llama(), PROFILING + 1, **options)
    assert again.done and not again.result.from_cache  # planned again, no KeyError
    assert any("not reusing the cached plan" in line and reason in line for line in said(capfd.readouterr().err))
    assert json.loads(options["config"].read_text())["spec"]["schedule"] == "1F1B"


def test_a_plan_within_the_profiles_noise_of_the_new_one_stays():
    profile = small_profile(8)
    noisy = dataclasses.replace(
        profile,
        layers=tuple(dataclasses.replace(layer, spread={"forward_ms": layer.forward_ms}) for layer in profile.layers),
    )
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8)
    best = solve(profile, spec)
    slower = dataclasses.replace(best, stage_layer_counts=(2, 3, 3, 2)).to_dict()  # another split, not faster
    lines: list[str] = []
    kept = plan_for(noisy, spec, 10.0, slower, lines.append, options=[("1F1B", 1)])
    assert kept.stage_layer_counts == (2, 3, 3, 2) and "so the plan in use stays" in lines[-1]
    quiet = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(layer, spread={}) for layer in profile.layers)
    )
    assert (
        plan_for(quiet, spec, 10.0, slower, lines.append, options=[("1F1B", 1)]).stage_layer_counts
        == best.stage_layer_counts
    )


def test_another_schedule_predicted_faster_is_said_and_auto_picks_the_fastest():
    profile = small_profile(8)
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=4, schedule="GPipe")
    lines: list[str] = []
    megatron = candidates(runnable_schedules("megatron"))
    plan = plan_for(profile, spec, 10.0, None, lines.append, options=megatron)
    assert plan.spec.schedule == "GPipe"
    advice = [line for line in lines if "is predicted" in line]
    assert len(advice) == 1 and "where GPipe x1 gives" in advice[0] and "schedule='auto'" in advice[0]
    auto = plan_for(profile, spec, 10.0, None, lines.append, options=megatron, auto=True)
    assert auto.spec.pipeline_schedule.name in ("1F1B", "Interleaved1F1B")  # what Megatron-LM runs
    assert lines[-1].startswith(f"auto: {auto.spec.pipeline_schedule.name} x")
    assert auto.iteration_time_ms <= plan.iteration_time_ms


def test_solve_takes_schedule_auto(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    small_profile(8).save(profile)
    argv = ["solve", "--profile", str(profile), "--pipeline-parallel", "4", "--micro-batches", "8", "--memory", "1GB"]
    assert main([*argv, "--schedule", "auto", "--time-limit", "20", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)["iteration_time"]
    for schedule in ("GPipe", "1F1B"):
        assert main([*argv, "--schedule", schedule, "--json"]) == 0
        assert auto <= json.loads(capsys.readouterr().out)["iteration_time"]


def test_a_step_function_that_crashes_leaves_no_word_of_an_early_end(tmp_path, capfd, monkeypatch):
    planned = tmp_path / "planned.json"
    monkeypatch.setenv("SAPP_HOOK_PLANNED_FILE", str(planned))
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tuner = autotune(model, optimizer, **SETTING, cache_dir=tmp_path)

    @tuner
    def step(index: int) -> None:
        if index == 2:
            raise RuntimeError("out of data")
        train_step(model, optimizer, index)

    step(0), step(1)
    with pytest.raises(RuntimeError, match="out of data"):
        step(2)
    tuner.close()  # what the process's exit runs: the crash said why nothing was planned
    assert not any("the training ended after" in line for line in said(capfd.readouterr().err))
    assert not planned.exists() and not tuner.profiler.attached


def test_a_drift_under_a_plan_that_leaves_a_rank_no_layer_keeps_the_plan():
    profile = small_profile(8)
    best = solve(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4, allow_empty_chunks=True))
    plan_data = dataclasses.replace(best, stage_layer_counts=(len(profile.layers) - 1, 1)).to_dict()  # rank 1: tail
    blocks = len(profile.layers) - 2
    measured = [
        {"activation_bytes": 1e12, "step_ms": 1.0, "forwards": 4, "blocks": blocks},  # far off the prediction
        {"activation_bytes": 0, "step_ms": 1.0, "forwards": 4, "blocks": 0},
    ]
    lines: list[str] = []
    checks, why = verdict(measured, {"profile": profile.to_dict()}, plan_data, None, lines.append)
    assert why is None and checks[0].drifted
    assert "rank 1 holds no layer under it" in lines[-1] and lines[-1].endswith("force=True)")


def test_auto_chooses_the_chunks_and_its_failure_names_the_least_budget_and_auto(tmp_path, capsys):
    with pytest.raises(InputError, match=r"^chunks: schedule='auto' chooses the chunks"):
        autotune(llama(), schedule="auto", chunks=2, pipeline_parallel=2, micro_batches=4)
    profile_path = tmp_path / "profile.json"
    small_profile(8).save(profile_path)
    argv = ["solve", "--profile", str(profile_path), "--pipeline-parallel", "4", "--micro-batches", "8"]
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--memory", "1GB", "--schedule", "auto", "--chunks", "2"])
    assert refused.value.code == 2
    assert "--chunks: --schedule auto chooses the chunks" in capsys.readouterr().err
    profile, spec = small_profile(8), PipelineSpec(pipeline_parallel=4, micro_batches=8, memory_budget_bytes=1.0)
    options = candidates(runnable_schedules("torchtitan"))
    least = []
    for name, chunks in options:
        with pytest.raises(InfeasibleError) as each:
            solve(profile, dataclasses.replace(spec, schedule=name, chunks=chunks), time_limit_s=5)
        least.append((each.value.smallest_budget_bytes, name, chunks))
    with pytest.raises(InfeasibleError) as caught:
        fastest(profile, spec, options, 5.0)
    budget, name, chunks = min(least)
    assert caught.value.smallest_budget_bytes == budget and caught.value.detail.startswith(f"{name} x{chunks}, ")
    assert " --schedule auto --memory " in solve_command(spec, profile_path, budget, auto=True)


def test_a_cache_that_cannot_take_the_plan_keeps_the_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(PlanCache, "store", lambda *args, **kwargs: None)  # a full or read-only folder
    tuner = train(llama(), PROFILING + 1, cache_dir=tmp_path)
    assert tuner.done and len(list(tmp_path.glob("*.profile.json"))) == 1  # what was measured is not lost


@pytest.mark.parametrize(
    ("model", "options", "field", "message"),
    [
        (llama, {"tensor_parallel": 3}, "tensor_parallel", "expected a divisor of the model's heads (4), got 3"),
        (llama, {"expert_parallel": 2, "data_parallel": 2}, "expert_parallel", "the model has no routed experts"),
        (qwen3_moe, {"expert_parallel": 3, "data_parallel": 3}, "expert_parallel", "the model's experts (4), got 3"),
    ],
)
def test_a_layout_the_model_cannot_be_split_by_is_refused_before_profiling(tmp_path, model, options, field, message):
    with pytest.raises(InputError) as caught:
        autotune(model(), None, **{**SETTING, **options}, cache_dir=tmp_path)
    assert caught.value.field == field and message in caught.value.detail


def test_an_error_of_the_profile_under_the_layout_names_its_own_field(tmp_path):
    with pytest.raises(InputError) as caught:
        train(llama(), PROFILING + 1, context_parallel=3, cache_dir=tmp_path)
    assert caught.value.field == "context_parallel"
    assert "the profile's sequence (32) to be a multiple of 2 x 3" in caught.value.detail


@pytest.mark.parametrize("accumulating", [False, True])
def test_step_called_twice_per_training_step_is_refused_before_a_plan(tmp_path, accumulating):
    """A second step() with no forward since the first, or (gradient accumulation) with a forward and backward
    but no optimizer step, would profile a part of a step as a whole one."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError) as caught:
        with autotune(model, optimizer, **SETTING, cache_dir=tmp_path, out_dir=tmp_path) as tuner:
            for index in range(PROFILING + 1):
                train_step(model, optimizer, index)
                tuner.step()
                if accumulating:
                    model(torch.randint(0, 512, (2, 16))).logits.sum().backward()
                tuner.step()
    why = "optimizer.step() ran not once since the last call" if accumulating else "the model ran no forward"
    assert str(caught.value).startswith(f"step() is called more than once per training step: {why}")
    assert tuner.profiler.steps_done == 1 and tuner.result is None and not (tmp_path / "plan.json").exists()
