"""`sapp_hook.autotune` around a real CPU training loop: profile, solve, write, cache, re-plan."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from profiler_cases import batch, llama, qwen3_moe, train_step

from sapp_hook import REPLAN_EXIT_CODE, autotune
from simulator import InputError

CONFIGS = Path(__file__).parents[1] / "sapp_hook" / "templates"
SETTING = {"pipeline_parallel": 4, "micro_batches": 8, "schedule": "1F1B", "profile_steps": 1}
PROFILING = 7  # steps: a warm-up, then per recompute mode (none, selective, full) one timed and one counting memory


@pytest.fixture
def mindformers_yaml(tmp_path):
    path = tmp_path / "train.yaml"
    shutil.copy(CONFIGS / "mindformers_llama.yaml", path)
    set_layers(path, 4)  # the 4 blocks of llama()
    return path


def set_layers(path, layers: int) -> None:
    """The config's num_layers, as a user edits it along with the model."""
    path.write_text(re.sub(r"num_layers: \d+", f"num_layers: {layers}", path.read_text()))


def train(model: torch.nn.Module, steps: int, **options: object):
    """A training script wrapped with autotune; the tuner when the loop ends."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with autotune(model, optimizer, **{**SETTING, **options}) as tuner:
        for step in range(steps):
            train_step(model, optimizer, step)
            tuner.step()
    return tuner


def test_profiles_solves_writes_then_reuses_then_replans(tmp_path, mindformers_yaml):
    options = {"config": mindformers_yaml, "target": "mindformers", "cache_dir": tmp_path / "cache"}
    first = train(llama(), PROFILING + 1, **options)
    assert first.done and not first.result.from_cache and first.profiler.steps_done == PROFILING
    text = mindformers_yaml.read_text()
    assert "# parallel settings: the pipeline split lives under model.model_config" in text
    offset, planned = yaml.safe_load(text)["model"]["model_config"]["offset"], first.result.plan.mindformers()["offset"]
    assert (
        offset == (planned if any(planned) else 0) and sum(planned) == 0
    )  # the template's 0 already says an even split
    assert first.result.plan_data["spec"]["receive_buffers"] is False  # MindSpore's engine: not torch's buffers
    assert "even split" in first.result.report

    again = train(llama(), 3, **options)  # same model and setting: the cached plan, after one step
    assert again.result.from_cache and again.profiler.steps_done == 1
    assert again.result.plan_data == first.result.plan_data

    set_layers(mindformers_yaml, 5)
    deeper = train(llama(num_hidden_layers=5), PROFILING + 1, **options)  # a layer more: profiled and solved again
    assert not deeper.result.from_cache and deeper.profiler.steps_done == PROFILING
    assert len(deeper.result.layout.layers) == 7

    set_layers(mindformers_yaml, 4)
    forced = train(llama(), PROFILING + 1, **options, force=True)
    assert not forced.result.from_cache


def test_a_plan_another_release_cached_is_planned_again(tmp_path, monkeypatch):
    """Another release may count memory another way: its plans are not reused."""
    from sapp_hook.hook import reuse

    first = train(llama(), PROFILING + 1, cache_dir=tmp_path)
    assert train(llama(), 3, cache_dir=tmp_path).result.from_cache
    monkeypatch.setattr(reuse, "installed_version", lambda: "99.0")
    again = train(llama(), PROFILING + 1, cache_dir=tmp_path)
    assert not again.result.from_cache and again.profiler.steps_done == first.profiler.steps_done


@pytest.mark.parametrize("damage", ["layers", "stages"])
def test_a_cached_plan_that_does_not_read_back_is_planned_again(tmp_path, damage):
    first = train(llama(), PROFILING + 1, cache_dir=tmp_path)
    (entry_path,) = [path for path in tmp_path.glob("*.json") if not path.name.endswith(".profile.json")]
    entry = json.loads(entry_path.read_text())
    if damage == "layers":  # as an older or hand-edited cache might hold
        del entry["plan"]["plan"]["layers"]
    else:
        entry["plan"]["spec"]["pipeline_parallel"] = 2
    entry_path.write_text(json.dumps(entry))
    again = train(llama(), PROFILING + 1, cache_dir=tmp_path)  # a KeyError or "other parallel settings" before
    assert not again.result.from_cache and again.profiler.steps_done == first.profiler.steps_done
    assert train(llama(), 3, cache_dir=tmp_path).result.plan_data == again.result.plan_data  # cached anew


@pytest.mark.parametrize("under_sapp_hook_run", [False, True])
def test_exit_after_writing_so_the_launcher_restarts(tmp_path, mindformers_yaml, monkeypatch, under_sapp_hook_run):
    """Status 75 for a launcher to restart the job on; under `sapp-hook run`, which reads the file it is handed,
    status 0, so that no launcher reports a failure (torchrun's traceback for its workers' 75)."""
    # a config the plan changes (one that already says the plan is left as it is, without a backup)
    mindformers_yaml.write_text(mindformers_yaml.read_text().replace("micro_batch_num: 8", "micro_batch_num: 4"))
    if under_sapp_hook_run:
        monkeypatch.setenv("SAPP_HOOK_PLANNED_FILE", str(tmp_path / "planned.json"))
    with pytest.raises(SystemExit) as caught:
        train(llama(), PROFILING + 1, config=mindformers_yaml, target="mindformers", cache_dir=tmp_path, on_plan="exit")
    assert caught.value.code == (0 if under_sapp_hook_run else REPLAN_EXIT_CODE)
    assert mindformers_yaml.with_name("train.yaml.sapp-hook.bak").exists()
    if under_sapp_hook_run:
        said = json.loads((tmp_path / "planned.json").read_text())
        assert said == {"config": str(mindformers_yaml), "restart": True}


def test_a_config_that_already_says_the_plan_trains_on(tmp_path, mindformers_yaml, monkeypatch, caplog):
    """on_plan="exit" restarts a job only to run a changed config: one that already said the plan is not
    written, and the job, already running that plan, trains on; the file for `sapp-hook run` says so."""
    # a config the plan changes whatever split the measured times give (the template may say it already)
    mindformers_yaml.write_text(mindformers_yaml.read_text().replace("micro_batch_num: 8", "micro_batch_num: 4"))
    options = {"config": mindformers_yaml, "target": "mindformers", "cache_dir": tmp_path}
    assert train(llama(), PROFILING + 1, **options).result.writeback.written == [str(mindformers_yaml)]
    planned = tmp_path / "planned.json"
    monkeypatch.setenv("SAPP_HOOK_PLANNED_FILE", str(planned))
    before = mindformers_yaml.read_bytes()
    tuner = train(llama(), 4, **options, on_plan="exit")  # the cached plan, after one step
    assert tuner.done and tuner.result.from_cache and tuner.result.writeback.written == []
    assert mindformers_yaml.read_bytes() == before
    assert tuner.profiler.steps_done == 1  # the steps after the plan trained on, unprofiled
    assert json.loads(planned.read_text()) == {"config": str(mindformers_yaml), "restart": False}
    assert "wrote" not in caplog.text


def test_a_crash_while_profiling_leaves_the_config_and_no_hooks(tmp_path, mindformers_yaml):
    before = mindformers_yaml.read_text()
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with (
        pytest.raises(KeyboardInterrupt),
        autotune(
            model, optimizer, **SETTING, config=mindformers_yaml, target="mindformers", cache_dir=tmp_path
        ) as tuner,
    ):
        for step in range(6):
            train_step(model, optimizer, step)
            tuner.step()
            if step == 2:
                raise KeyboardInterrupt
    assert mindformers_yaml.read_text() == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_as_a_decorator_of_the_step_function(tmp_path):
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tuner = autotune(model, optimizer, **SETTING, cache_dir=tmp_path, out_dir=tmp_path / "out")

    @tuner
    def step(index: int) -> float:
        return train_step(model, optimizer, index)

    losses = [step(i) for i in range(PROFILING + 1)]
    assert tuner.done and len(losses) == PROFILING + 1
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"plan.json", "report.txt", "profile.json", "plan.png"}


def test_no_plan_fits_the_budget(tmp_path, mindformers_yaml):
    before = mindformers_yaml.read_text()
    with pytest.raises(InputError, match="sapp-hook found no plan; the config is untouched"):
        train(
            llama(),
            PROFILING + 1,
            config=mindformers_yaml,
            target="mindformers",
            cache_dir=tmp_path,
            memory_budget="1MB",
        )
    assert mindformers_yaml.read_text() == before


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"on_plan": "restart"}, "on_plan"),
        ({"config": "x.yaml"}, "target"),
        ({"memory_budget": "56"}, "memory_budget"),
        ({"action_overhead_ms": -1.0}, "action_overhead_ms"),
        # refused before the profiling steps, not after them
        ({"config": "x.yaml", "target": "deepspeed"}, "target"),
        ({"config": "/no/such.yaml", "target": "mindformers"}, "config"),
        ({"time_limit_s": 0}, "time_limit_s"),
        ({"time_limit_s": math.nan}, "time_limit_s"),
    ],
)
def test_bad_options(options, field):
    with pytest.raises(InputError) as caught:
        autotune(llama(), **{**SETTING, **options})
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("target", "template", "setting", "message"),
    [
        (
            "mindformers",
            "mindformers_llama.yaml",
            {},
            "the plan places 4 decoder layers; .* has model.model_config.num_layers 8",
        ),
        (
            "mindformers",
            "mindformers_v2_llama.yaml",
            {},
            "the plan places 4 decoder layers; .* has model_config.num_hidden_layers 8",
        ),
        ("megatron", "megatron_llama.sh", {}, "the plan places 4 decoder layers; .* has --num-layers 8"),
        (
            "megatron",
            "megatron_llama.sh",
            {"schedule": "ZBH1"},
            "Megatron-LM runs 1F1B, Interleaved1F1B; this plan is for ZBH1",
        ),
        (
            "torchtitan",
            "torchtitan_llama.toml",
            {"micro_batches": 5},
            "the plan is for 5 micro-batches; .* training.local_batch_size 16",
        ),
    ],
)
def test_a_config_that_cannot_take_the_jobs_plan_is_refused_before_profiling(
    tmp_path, target, template, setting, message
):
    config = tmp_path / "config"
    shutil.copy(CONFIGS / template, config)
    with pytest.raises(InputError, match=f"config: {config} does not fit this job: {message}"):
        autotune(llama(), **{**SETTING, **setting}, config=config, target=target)


def test_the_engine_costs_reach_the_plan_and_the_cache_key(tmp_path):
    """A calibrated overhead and a measured P2P time are planned with, and a plan made without them is
    not reused for them."""
    train(llama(), PROFILING + 1, cache_dir=tmp_path)
    calibrated = train(llama(), PROFILING + 1, cache_dir=tmp_path, action_overhead_ms=2.0, p2p_ms=0.5)
    assert not calibrated.result.from_cache
    spec = calibrated.result.plan_data["spec"]
    assert spec["action_overhead_ms"] == 2.0 and spec["p2p_ms"] == 0.5
    assert spec["receive_buffers"] is True  # no config to write: the plan runs on torch's engine (`apply`)


def test_the_model_trains_the_same_under_autotune(tmp_path):
    plain, tuned = llama(), llama()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    expected = [train_step(plain, plain_optimizer, step) for step in range(PROFILING + 2)]
    tuned_optimizer = torch.optim.AdamW(tuned.parameters(), lr=1e-3)
    with autotune(tuned, tuned_optimizer, **SETTING, cache_dir=tmp_path) as tuner:
        got = []
        for step in range(PROFILING + 2):  # the steps counting memory included
            got.append(train_step(tuned, tuned_optimizer, step))
            tuner.step()
    assert got == expected
    assert batch(0).shape == (2, 32)
    assert "tail" in tuner.profiler.backward_splits  # a transformers model: its tail's backward is split too


def test_split_backward_schedules_are_profiled_and_planned_without_recompute(tmp_path):
    """torch runs a checkpointed block again for every weight-gradient group of a split backward
    (sapp_hook.pipelining.engine_rules): no recompute mode is offered there."""
    tuner = autotune(
        llama(), pipeline_parallel=2, chunks=2, micro_batches=4, schedule="ZBVZeroBubble", cache_dir=tmp_path
    )
    assert tuner.profiler.modes == ("none",)


def test_a_plan_whose_peak_runs_may_exceed_says_what_margin_to_leave(tmp_path, caplog):
    """ZBVZeroBubble x tensor parallel from a one-process profile: the margin `solve` notes, logged."""
    split = {"schedule": "ZBVZeroBubble", "pipeline_parallel": 2, "chunks": 2, "micro_batches": 4}
    train(llama(), 3, **split, tensor_parallel=2, cache_dir=tmp_path / "tp")
    assert "a middle rank's peak was measured up to 8% above its prediction" in caplog.text
    caplog.clear()
    train(llama(), 3, **split, cache_dir=tmp_path / "whole")
    assert "measured up to 8% above" not in caplog.text


def test_the_jobs_parallel_layout_reaches_the_spec(tmp_path):
    """autotune takes the degrees a spec does; a layout torch does not run is refused before profiling."""
    layout = {
        "data_parallel": 2,
        "fsdp": True,
        "gradients_persist": False,
        "tensor_parallel": 2,
        "sequence_parallel": True,
        "context_parallel": 2,
        "expert_parallel": 2,
        "expert_tokens": "dropless",
        "collective_backend": "gloo",
    }
    tuner = autotune(qwen3_moe(), **SETTING, **layout, cache_dir=tmp_path)
    assert {name: getattr(tuner.spec, name) for name in layout} == layout
    with pytest.raises(InputError) as caught:
        autotune(
            llama(),
            **{**SETTING, "schedule": "ZBVZeroBubble", "pipeline_parallel": 2, "micro_batches": 4},
            fsdp=True,
            fsdp_reshard_after_forward=True,
        )
    assert caught.value.field == "fsdp_reshard_after_forward"
