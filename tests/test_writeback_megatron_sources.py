"""Megatron-LM write-back into what launch scripts source: a model config fragment that only sets the
variables of flags (Megatron-LM's modelopt conf/ files), files found beside the script through
`${BASH_SOURCE[0]}`, and a sourced file that is absent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from solver_cases import small_profile
from test_writeback_megatron import flags_of, launched, others, plan

from sapp_hook.writeback import layout_of, write_config
from simulator import InputError
from solver import PipelineSpec, evaluate_plan

FRAGMENT = Path(__file__).parent / "fixtures" / "megatron_modelopt" / "kimi_k2_instruct_export.sh"
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
LAYOUT, PP = "--pipeline-model-parallel-layout", "--pipeline-model-parallel-size"
# what Megatron-LM's modelopt scripts do with a model config: source it, pass ${PP} and ${MLM_EXTRA_ARGS}
LAUNCHER = """#!/bin/bash
source "$(dirname "${BASH_SOURCE[0]}")/kimi_k2_instruct_export.sh"
torchrun pretrain_gpt.py --num-layers 61 --pipeline-model-parallel-size ${PP} ${MLM_EXTRA_ARGS}
"""


def kimi_plan(counts: list[int], full_first: bool = False):
    """61 decoder layers (Kimi-K2's) over len(counts) stages; counts hold the head and the tail."""
    spec = PipelineSpec(pipeline_parallel=len(counts), micro_batches=32, schedule="1F1B")
    modes = ["none"] * 63
    if full_first:
        modes[1] = "full"
    return evaluate_plan(small_profile(61), spec, counts, modes)


@pytest.fixture
def modelopt(tmp_path):
    folder = tmp_path / "conf"
    folder.mkdir()
    shutil.copy(FRAGMENT, folder)
    (folder / "launch.sh").write_text(LAUNCHER)
    return folder


def test_a_model_config_fragment_takes_the_plan_in_its_variables(modelopt):
    """Decoder layers 4, 6, 2, 4 x 12, 1: middles unlike, so the layout replaces first/last in $MLM_EXTRA_ARGS."""
    before = launched(modelopt / "launch.sh")[0]
    chosen = kimi_plan([5, 6, 2, *[4] * 12, 2])
    notes = write_config("megatron", modelopt / "kimi_k2_instruct_export.sh", layout_of(chosen)).notes
    assert notes[0] == (
        "kimi_k2_instruct_export.sh runs no Megatron-LM command: read as a fragment sourced by a launch script; "
        "the plan's flags are written in $MLM_EXTRA_ARGS, for PP=16 (kimi_k2_instruct_export.sh line 17)"
    )
    after = launched(modelopt / "launch.sh")[0]
    got = flags_of(after)
    assert got[LAYOUT] == [["Et*4|t*6|tt" + "|t*4" * 12 + "|tL"]]
    assert FIRST not in got and LAST not in got and got[PP] == [["16"]]
    assert others(after) == others(before)  # --init-model-with-meta-device, --use-cpu-initialization kept
    text = (modelopt / "kimi_k2_instruct_export.sh").read_text()
    assert "# Layer distribution over PP: 3, [4] * 14, 2.\nPP=16\n" in text


def test_a_fragment_takes_recompute_flags_after_its_last_word(modelopt):
    chosen = kimi_plan([5, *[4] * 14, 2], full_first=True)  # 4, [4] * 14, 1: the last stage alone differs
    notes = write_config("megatron", modelopt / "kimi_k2_instruct_export.sh", layout_of(chosen)).notes
    assert (
        "added --recompute-granularity, --recompute-method, --recompute-num-layers in the string MLM_EXTRA_ARGS "
        "(kimi_k2_instruct_export.sh line 11), next to --use-cpu-initialization"
    ) in notes
    got = flags_of(launched(modelopt / "launch.sh")[0])
    assert FIRST not in got and got[LAST] == [["1"]]
    assert got["--recompute-granularity"] == [["full"]] and got["--recompute-num-layers"] == [["1"]]


def test_a_fragment_for_another_pipeline_size_is_refused_naming_it(modelopt):
    before = (modelopt / "kimi_k2_instruct_export.sh").read_text()
    with pytest.raises(InputError) as caught:
        write_config("megatron", modelopt / "kimi_k2_instruct_export.sh", layout_of(plan()))
    assert str(caught.value) == (
        "--config: kimi_k2_instruct_export.sh runs no Megatron-LM command: read as a fragment sourced by a "
        "launch script, it sets PP=16 (kimi_k2_instruct_export.sh line 17), which its launcher passes as "
        "--pipeline-model-parallel-size; the plan is for 4 pipeline ranks: plan for 16 or set PP=4 first"
    )
    assert (modelopt / "kimi_k2_instruct_export.sh").read_text() == before


@pytest.mark.parametrize(
    "source",
    [
        'source "$(dirname -- "${BASH_SOURCE[0]}")/common.sh"',
        'source "${BASH_SOURCE%/*}/common.sh"',
        'source "${BASH_SOURCE[0]%/*}/common.sh"',
        'source "$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &> /dev/null && pwd)/common.sh"',
        'source "$(cd "$(dirname "${BASH_SOURCE[0]}")" >/dev/null 2>&1 && pwd)/common.sh"',
        'source "$(dirname "$(readlink --canonicalize "${BASH_SOURCE[0]}")")/common.sh"',
        "source `dirname $0`/common.sh",
    ],
)
def test_a_file_sourced_from_beside_the_script_is_followed(tmp_path, monkeypatch, source):
    folder = tmp_path / "examples" / "gpt"
    folder.mkdir(parents=True)
    (folder / "common.sh").write_text(
        "MODEL_ARGS=(--num-layers 8 --pipeline-model-parallel-size 4 --recompute-activations)\n"
    )
    (folder / "train.sh").write_text(f'#!/bin/bash\n{source}\ntorchrun pretrain_gpt.py "${{MODEL_ARGS[@]}}"\n')
    monkeypatch.chdir(tmp_path)  # launched from the repository's root, as Megatron-LM's examples are
    result = write_config("megatron", folder / "train.sh", layout_of(plan()))
    assert not any("not followed" in note for note in result.notes), result.notes
    assert f"{folder / 'common.sh'} changes too: train.sh sources or runs it" in result.notes
    got = flags_of(launched(folder / "train.sh")[0])
    assert got[LAYOUT] == [["Ett|tt|t*3|tL"]] and "--recompute-activations" not in got


def test_a_file_sourced_in_several_places_and_absent_is_said_once(tmp_path):
    """A wrapper that sources conf/arguments.sh (Megatron-LM's modelopt layout) once per model it knows."""
    models = ["llama", "qwen", "mixtral", "deepseek", "kimi", "nemotron", "gpt-oss", "mamba"]
    branches = "".join(f'  {model}) source "${{SCRIPT_DIR}}/conf/arguments.sh" ;;\n' for model in models)
    script = tmp_path / "quantize.sh"
    script.write_text(
        '#!/bin/bash\nSCRIPT_DIR="$(dirname "$(readlink -f "$0")")"\n'
        f'case "$1" in\n{branches}esac\n${{LAUNCH_SCRIPT}} quantize.py ${{MODEL_ARGS}} ${{MLM_EXTRA_ARGS}}\n'
    )
    with pytest.raises(InputError) as caught:
        write_config("megatron", script, layout_of(plan()))
    said = str(caught.value)
    assert said.count("not found") == 1, said
    assert f"not followed: {tmp_path}/conf/arguments.sh (run from quantize.sh): not found" in said
