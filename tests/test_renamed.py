"""Names renamed in this release keep working for one more, each with a warning that names the new one."""

import json

import pytest
from solver_cases import small_profile

import sapp_hook
from sapp_hook.cli import main
from sapp_hook.writeback import layout_of
from solver import PipelineSpec, evaluate_plan
from solver.vocabulary.spec import spec_from_dict, spec_to_dict


def test_pipeline_spec_takes_stages_as_pipeline_parallel():
    with pytest.warns(DeprecationWarning, match=r"PipelineSpec\(stages=...\) is deprecated .* use pipeline_parallel="):
        spec = PipelineSpec(stages=4, micro_batches=8)
    assert spec == PipelineSpec(pipeline_parallel=4, micro_batches=8)
    with pytest.warns(DeprecationWarning, match="PipelineSpec.stages is deprecated"):
        assert spec.stages == 4
    with pytest.raises(TypeError, match="pass pipeline_parallel= only"):
        PipelineSpec(stages=4, pipeline_parallel=4, micro_batches=8)


def test_a_plan_json_of_the_former_names_reads_as_the_new():
    plan = evaluate_plan(
        small_profile(8), PipelineSpec(pipeline_parallel=4, micro_batches=8), [3, 2, 3, 2], ["none"] * 10
    )
    data = json.loads(json.dumps(plan.to_dict()))
    data["spec"]["stages"] = data["spec"].pop("pipeline_parallel")
    data["spec"]["stage_constant_bytes"] = data["spec"].pop("rank_constant_bytes")
    for layer in data["plan"]["layers"]:
        layer["stage"] = layer.pop("rank")
    with pytest.warns(FutureWarning, match="spec.stages is the former name of spec.pipeline_parallel"):
        assert spec_to_dict(spec_from_dict(data["spec"])) == spec_to_dict(plan.spec)
    with pytest.warns(FutureWarning):
        layout = sapp_hook.layout_from_dict(data)
    assert layout.layers == layout_of(plan).layers


def test_sapp_hook_apply_is_build_stages():
    pytest.importorskip("torch")
    with pytest.warns(DeprecationWarning, match=r"sapp_hook.apply is deprecated .* use sapp_hook.build_stages"):
        assert sapp_hook.apply is sapp_hook.build_stages


def test_a_former_flag_works_with_a_warning(capsys):
    argv = [
        "simulate",
        "--schedule",
        "1F1B",
        "--stages",
        "4",
        "--micro-batches",
        "8",
        "--forward",
        "1",
        "--backward",
        "2",
    ]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "sapp-hook: warning: --stages is deprecated and goes in the next release; use --pipeline-parallel\n"
    )
    assert json.loads(captured.out)["ranks"] == 4


def test_a_former_flag_after_the_training_command_is_the_commands_own(tmp_path, capsys):
    """`run` passes its command's arguments on untouched: a training script may have a --stages of its own."""
    from sapp_hook.cli.flags import translate_renamed

    argv = ["run", "--config", "x.yaml", "--", "python", "train.py", "--stages", "4"]
    assert translate_renamed(argv) == (argv, [])
    argv = ["solve", "--profile", "p.json", "--stages=4", "--stage-constant", "1GB"]
    assert translate_renamed(argv)[0][3:] == ["--pipeline-parallel=4", "--rank-constant", "1GB"]


def test_the_former_names_of_results_read_the_new_ones():
    from simulator import PipelineCosts, build_schedule, simulate
    from solver import InfeasibleError
    from solver.calibrate import Calibration

    with pytest.warns(DeprecationWarning, match=r"build_schedule\(stages=...\)"):
        schedule = build_schedule("1F1B", stages=2, micro_batches=4)
    with pytest.warns(DeprecationWarning, match=r"PipelineCosts.uniform\(stages=...\)"):
        costs = PipelineCosts.uniform(stages=2, chunks=1, forward_ms=1.0, backward_ms=2.0)
    result = simulate(schedule, costs)
    for old, new in (
        ("stage_busy_ms", "rank_busy_ms"),
        ("stage_peak_memory_bytes", "rank_peak_memory_bytes"),
        ("stage_peak_activations", "rank_peak_activations"),
    ):
        with pytest.warns(DeprecationWarning, match=f"SimulationResult.{old} is deprecated"):
            assert getattr(result, old) == getattr(result, new)
    with pytest.warns(DeprecationWarning, match="PipelineCosts.stages"):
        assert costs.stages == 2
    plan = evaluate_plan(
        small_profile(8), PipelineSpec(pipeline_parallel=4, micro_batches=8), [3, 2, 3, 2], ["none"] * 10
    )
    with pytest.warns(DeprecationWarning, match="Plan.stage_chunk_ranges"):
        assert plan.stage_chunk_ranges() == plan.rank_chunk_ranges()
    with pytest.warns(DeprecationWarning, match="Plan.stage_peak_memory_bytes"):
        assert plan.stage_peak_memory_bytes == plan.rank_peak_memory_bytes
    error = InfeasibleError("no plan fits", smallest_budget_bytes=1.0, binding_rank=3)
    with pytest.warns(DeprecationWarning, match="InfeasibleError.binding_stage"):
        assert error.binding_stage == 3
    calibration = Calibration(1.0, 0.0, 0.0, 0.0, 0.0)
    with pytest.warns(DeprecationWarning, match="Calibration.apply"):
        assert calibration.apply(small_profile(8), plan.spec) == calibration.adjust(small_profile(8), plan.spec)


def test_autotunes_former_keyword_is_told_where_the_user_called_it():
    import warnings

    from profiler_cases import llama

    from sapp_hook import autotune

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autotune(llama(), stages=2, micro_batches=4)
    (warning,) = [each for each in caught if "stages=" in str(each.message)]
    assert warning.filename == __file__  # not the hook's own module, where default filters would hide it
