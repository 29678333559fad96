"""MindSpeed-LLM launch scripts (tests/fixtures/mindspeed, each naming the upstream script it imitates) under
`--target megatron`: recognised from MindSpeed's own flags, the split said once in the form the version reads
(`--num-layer-list`, `--noop-layers` placed, `--pipeline-num-transformer-layers` in 2.x, the layout in master),
DualPipeV for `--schedules-method dualpipev`, MindSpeed's recompute flags matched to the plan; each script run
in bash with its launcher printing the arguments it gets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from solver_cases import small_profile
from test_writeback_megatron import launched, plan

from sapp_hook.cli import main
from sapp_hook.writeback import layout_of, write_config
from sapp_hook.writeback.errors import PlanMismatch
from solver import PipelineSpec, evaluate_plan

FIXTURES = Path(__file__).parent / "fixtures" / "mindspeed"
LIST, NOOP, LAYOUT = "--num-layer-list", "--noop-layers", "--pipeline-model-parallel-layout"
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
PER_VIRTUAL, MATRIX = "--num-layers-per-virtual-pipeline-stage", "--pipeline-num-transformer-layers"
SPLITS = (LIST, NOOP, LAYOUT, FIRST, LAST, PER_VIRTUAL, MATRIX)
FIRST_STAGE_FULL = {1: "full", 3: "full", 5: "full", 8: "full"}


@pytest.fixture
def scripts(tmp_path):
    folder = tmp_path / "mindspeed"
    shutil.copytree(FIXTURES, folder)
    return folder


def passed(script: Path) -> dict[str, list[str]]:
    """The flags the one launch of the script gets, each with its values (a switch: [])."""
    (arguments,) = launched(script)
    found: dict[str, list[str]] = {}
    for index, word in enumerate(arguments):
        if word.startswith("--"):
            assert word not in found, f"{word} passed twice"
            following = arguments[index + 1] if index + 1 < len(arguments) else "--"
            found[word] = [] if following.startswith("--") else [following]
    return found


def split_of(flags: dict[str, list[str]]) -> dict[str, list[str]]:
    return {flag: values for flag, values in flags.items() if flag in SPLITS}


def dualpipev_plan(counts: list[int]):
    spec = PipelineSpec(pipeline_parallel=2, chunks=2, micro_batches=8, schedule="DualPipeV")
    return evaluate_plan(small_profile(8), spec, counts, ["none", "full"] + ["none"] * 8)


def test_the_num_layer_list_is_rewritten_and_no_other_split_is_added(scripts, capsys):
    script = scripts / "pretrain_llama2_num_layer_list.sh"
    result = write_config("megatron", script, layout_of(plan(FIRST_STAGE_FULL)))
    flags = passed(script)
    # decoder layers per rank of the plan's [3, 2, 3, 2] (head and tail counted) layers
    assert split_of(flags) == {LIST: ["2,2,3,1"]}
    assert flags["--recompute-num-layers"] == ["1"] and flags["--recompute-method"] == ["block"]
    assert "--swap-attention" not in flags and "--use-fused-rmsnorm" in flags
    assert (
        "--num-layer-list, --swap-attention: a MindSpeed-LLM script; written for MindSpeed-LLM 2.x, which reads "
        "--pipeline-num-transformer-layers and no layout (assumed: no MindSpeed-LLM source tree holds the script "
        "and its flags do not say)"
    ) in result.notes
    assert (
        "the split changes from --num-layer-list 1,2,3,2 to --num-layer-list 2,2,3,1: checkpoints saved in torch "
        "format with the old split (the script's --load) hold each rank's layers and do not load under the new "
        "one; convert them first (MindSpeed-LLM's convert_ckpt.py with the new split), or save with --ckpt-format "
        "torch_dist"
    ) in result.notes
    assert (
        "--swap-attention (pretrain_llama2_num_layer_list.sh line 52) taken out: MindSpeed skips the full "
        "recompute written beside it, and the plan recomputes whole layers"
    ) in result.notes


def test_an_even_plan_keeps_the_list_form_and_the_same_split_says_no_checkpoint_note(scripts):
    script = scripts / "pretrain_llama2_num_layer_list.sh"
    text = script.read_text().replace("--num-layer-list 1,2,3,2", "--num-layer-list 2,2,3,1")
    script.write_text(text)
    result = write_config("megatron", script, layout_of(plan(FIRST_STAGE_FULL)))
    assert split_of(passed(script)) == {LIST: ["2,2,3,1"]}
    assert not any("checkpoints" in note for note in result.notes)


def test_noop_layers_are_placed_where_the_plan_has_fewer_layers(scripts):
    script = scripts / "pretrain_kimi2_noop.sh"
    result = write_config("megatron", script, layout_of(plan()))
    flags = passed(script)
    # 12 slots (8 layers + 4 noop) over 4 ranks, 3 each: the plan's 2, 2, 3, 1 layers, noop slots after them
    assert split_of(flags) == {NOOP: ["2,5,10,11"]}
    assert "--recompute-granularity" not in flags and "--recompute-num-layers" not in flags
    assert "--num-layer-list (pretrain_kimi2_noop.sh line 15) taken out: the plan's split is said once" in result.notes


def test_a_plan_with_more_layers_than_a_stages_slots_is_refused_naming_the_noop_layers(scripts):
    script = scripts / "pretrain_kimi2_noop.sh"
    before = script.read_text()
    with pytest.raises(PlanMismatch) as raised:
        write_config("megatron", script, layout_of(plan(counts=[5, 1, 2, 2])))
    assert raised.value.predicate == (
        "places [4, 1, 2, 1] decoder layers on its virtual stages; with --noop-layers 8,9,10,11, MindSpeed gives "
        "each 3 slots of --num-layers 12 (the padding placed where layers are fewer): the plan needs 4 on one; "
        "refused"
    )
    assert script.read_text() == before


def test_counting_the_noop_layers_in_the_plan_is_a_mismatch_that_says_them(scripts):
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B")
    twelve = evaluate_plan(small_profile(12), spec, [4, 3, 4, 3], ["none"] * 14)
    with pytest.raises(PlanMismatch) as raised:
        write_config("megatron", scripts / "pretrain_kimi2_noop.sh", layout_of(twelve), dry_run=True)
    assert raised.value.predicate.endswith("has --num-layers 12, 4 of them --noop-layers 8,9,10,11")


def test_a_dualpipev_script_refuses_a_1f1b_plan(scripts):
    with pytest.raises(PlanMismatch) as raised:
        write_config("megatron", scripts / "pretrain_deepseek3_dualpipev.sh", layout_of(plan(pipeline_parallel=4)))
    assert raised.value.predicate.startswith(
        "is for 1F1B; the script passes --schedules-method dualpipev, which runs MindSpeed's DualPipeV"
    )


def test_a_dualpipev_plan_is_written_for_that_schedule(scripts):
    script = scripts / "pretrain_deepseek3_dualpipev.sh"
    write_config("megatron", script, layout_of(dualpipev_plan([3, 2, 2, 3])))
    flags = passed(script)
    assert flags["--schedules-method"] == ["dualpipev"] and "--moe-fb-overlap" in flags
    assert split_of(flags) == {}
    assert flags["--recompute-method"] == ["block"] and flags["--recompute-num-layers"] == ["1"]


def test_an_uneven_dualpipev_plan_is_refused_without_noop_layers(scripts):
    with pytest.raises(PlanMismatch) as raised:
        write_config("megatron", scripts / "pretrain_deepseek3_dualpipev.sh", layout_of(dualpipev_plan([2, 3, 2, 3])))
    assert raised.value.predicate.startswith(
        "places [1, 3, 2, 2] decoder layers on its virtual stages; MindSpeed's --schedules-method dualpipev splits"
    )


def test_a_dualpipev_plan_is_refused_where_mindspeed_cannot_run_it(scripts):
    with pytest.raises(PlanMismatch) as raised:
        write_config("megatron", scripts / "pretrain_kimi2_noop.sh", layout_of(dualpipev_plan([3, 2, 2, 3])))
    assert "only with --moe-fb-overlap (MoE models), which the script does not pass" in raised.value.predicate


VIRTUAL = [2, 3, 2, 3]  # decoder layers 1, 3, 2, 2 on virtual stages 0-3 (rank 0 holds 0 and 2)


def test_virtual_stages_in_a_2x_release_are_its_matrix(scripts):
    script = scripts / "pretrain_qwen3_vpp.sh"
    result = write_config("megatron", script, layout_of(plan(pipeline_parallel=2, chunks=2, counts=VIRTUAL)))
    flags = passed(script)
    assert split_of(flags) == {MATRIX: ["[[1,2],[3,2]]"], PER_VIRTUAL: ["2"]}
    assert "--enable-recompute-layers-per-pp-rank" not in flags and "--recompute-activation-function" not in flags
    assert (
        "--enable-recompute-layers-per-pp-rank (pretrain_qwen3_vpp.sh line 21) taken out: it makes "
        "--recompute-num-layers a count per rank, and the plan's is per virtual stage"
    ) in result.notes
    assert "--recompute-activation-function taken out: the plan recomputes nothing" in result.notes


def test_virtual_stages_in_master_are_the_layout(scripts):
    features = scripts / "mindspeed_llm" / "features_manager"
    features.mkdir(parents=True)
    (features / "layout.py").write_text("group.add_argument('--pipeline-model-parallel-layout', type=str)\n")
    script = scripts / "pretrain_qwen3_vpp.sh"
    result = write_config("megatron", script, layout_of(plan(pipeline_parallel=2, chunks=2, counts=VIRTUAL)))
    assert split_of(passed(script)) == {LAYOUT: ["Et|t*3|tt|ttL"]}
    said = "mindspeed_llm/features_manager/layout.py registers --pipeline-model-parallel-layout"
    assert any(said in note for note in result.notes), result.notes


def test_virtual_stages_in_1_0_are_refused_naming_why(scripts):
    (scripts / "modellink").mkdir()
    with pytest.raises(PlanMismatch) as raised:
        write_config(
            "megatron",
            scripts / "pretrain_qwen3_vpp.sh",
            layout_of(plan(pipeline_parallel=2, chunks=2, counts=VIRTUAL)),
            dry_run=True,
        )
    assert raised.value.predicate.startswith(
        "places [1, 3, 2, 2] decoder layers on its virtual stages; MindSpeed-LLM 1.0"
    )
    assert raised.value.predicate.endswith(
        "--num-layer-list refuses virtual stages there, and it has neither --pipeline-num-transformer-layers nor a "
        "layout"
    )


def test_fb_overlap_needs_virtual_stages_and_no_empty_chunk(scripts):
    script = scripts / "pretrain_qwen3_vpp.sh"
    with pytest.raises(PlanMismatch) as raised:
        write_config("megatron", script, layout_of(plan(pipeline_parallel=2, counts=[5, 5])), dry_run=True)
    assert raised.value.predicate.startswith(
        "runs one chunk per rank; the script passes --moe-fb-overlap, which MindSpeed overlaps over pipeline ranks "
        "only with virtual stages"
    )
    with pytest.raises(PlanMismatch) as raised:
        write_config(
            "megatron", script, layout_of(plan(pipeline_parallel=2, chunks=2, counts=[1, 3, 3, 3])), dry_run=True
        )
    assert raised.value.predicate == (
        "leaves virtual stage 0 without decoder layers; MindSpeed's --moe-fb-overlap (in the script) runs no "
        "empty chunk"
    )


def test_selective_recompute_is_mindspeeds_activation_and_norm_recompute(scripts):
    script = scripts / "pretrain_llama2_num_layer_list.sh"
    result = write_config("megatron", script, layout_of(plan({1: "selective", 3: "selective", 5: "selective"})))
    flags = passed(script)
    assert flags["--recompute-activation-function"] == [] and flags["--recompute-norm"] == []
    assert flags["--recompute-activation-function-num-layers"] == ["1"] and flags["--recompute-norm-num-layers"] == [
        "1"
    ]
    for megatron_flag in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers"):
        assert megatron_flag not in flags
    assert "--swap-attention" in flags
    assert (
        "the plan's selective recompute written as --recompute-activation-function and --recompute-norm of the "
        "first 1 layers of each virtual stage"
    ) in result.notes


def test_a_plain_megatron_script_is_no_mindspeed_one(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\ntorchrun pretrain_gpt.py --pipeline-model-parallel-size 4 --num-layers 8\n")
    result = write_config("megatron", script, layout_of(plan()))
    assert not any("MindSpeed" in note for note in result.notes)
    assert '--pipeline-model-parallel-layout "Ett|tt|t*3|tL"' in script.read_text()


def test_the_cli_writes_a_mindspeed_script(scripts, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan().to_dict()))
    assert (
        main(
            [
                "apply",
                "--plan",
                str(plan_file),
                "--target",
                "megatron",
                "--config",
                str(scripts / "pretrain_kimi2_noop.sh"),
            ]
        )
        == 0
    )
    assert split_of(passed(scripts / "pretrain_kimi2_noop.sh")) == {NOOP: ["2,5,10,11"]}
    said = capsys.readouterr()
    assert "--noop-layers: a MindSpeed-LLM script; written for MindSpeed-LLM 2.x" in said.out + said.err
