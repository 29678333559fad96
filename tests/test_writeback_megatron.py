"""Megatron-LM write-back on launch scripts modelled on upstream ones (tests/fixtures/megatron, each
naming the script it imitates): every fixture takes a plan through `write_config` and through
`sapp-hook apply`, passes `bash -n`, and run in bash with its launcher printing the arguments it gets,
passes exactly the plan's flags, each once, next to every other argument as before; each layout
written is checked by Megatron's grammar and rules."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from solver_cases import small_profile

from sapp_hook.cli import main
from sapp_hook.writeback import check_job, layout_of, write_config
from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.layout import even_layout
from sapp_hook.writeback.megatron.layout_string import LayoutError, check, parse_stages
from sapp_hook.writeback.megatron.writer import layout_string, parse_layout
from simulator import InputError
from solver import PipelineSpec, evaluate_plan

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
PP, TP, LAYOUT = "--pipeline-model-parallel-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-layout"
GRANULARITY, METHOD, RECOMPUTE_LAYERS = "--recompute-granularity", "--recompute-method", "--recompute-num-layers"
MODULES, GROUP = "--recompute-modules", "--microbatch-group-size-per-virtual-pipeline-stage"
FIRST_STAGE_FULL = {1: "full", 3: "full", 5: "full", 8: "full"}  # the first body layer of each stage
ALL_SELECTIVE = {layer: "selective" for layer in range(1, 9)}
ALL_FULL = {layer: "full" for layer in range(1, 9)}
LISTS = {MODULES, "--rampup-batch-size"}  # flags that take several values (nargs)
# Every flag the write-back sets or takes out: the rest of the command must stay as it was
OURS = {
    PP,
    LAYOUT,
    GRANULARITY,
    METHOD,
    RECOMPUTE_LAYERS,
    MODULES,
    GROUP,
    "--recompute-activations",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--checkpoint-activations",
    "--activations-checkpoint-method",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--distribute-saved-activations",
}


def plan(
    modes: dict[int, str] | None = None,
    *,
    pipeline_parallel: int = 4,
    chunks: int = 1,
    micro_batches: int = 8,
    counts: list[int] | None = None,
):
    """A head, 8 body layers and a tail over pipeline_parallel x chunks virtual pipeline_parallel."""
    schedule = "Interleaved1F1B" if chunks > 1 else "1F1B"
    spec = PipelineSpec(
        pipeline_parallel=pipeline_parallel, chunks=chunks, micro_batches=micro_batches, schedule=schedule
    )
    counts = counts or {4: [3, 2, 3, 2], 8: [2, 1, 1, 1, 1, 1, 2, 1]}[pipeline_parallel * chunks]
    layer_modes = ["none"] * 10
    for index, mode in (modes or {}).items():
        layer_modes[index] = mode
    return evaluate_plan(small_profile(8), spec, counts, layer_modes)


# fixture applied, file run, plan, flags the launcher must get (None: not at all), notes said
CASES = {
    "arrays": (
        "gpt3_arrays.sh",
        "gpt3_arrays.sh",
        {"modes": FIRST_STAGE_FULL},
        {
            PP: ["4"],
            TP: ["2"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["full"],
            METHOD: ["block"],
            RECOMPUTE_LAYERS: ["1"],
            "--num-layers": ["8"],
            "--attention-backend": ["auto"],
        },
        ["in the array MODEL_PARALLEL_ARGS (gpt3_arrays.sh line 47), next to --pipeline-model-parallel-size"],
    ),
    "commented-out pipeline size": (
        "llama3_commented_pp.sh",
        "llama3_commented_pp.sh",
        {"modes": ALL_SELECTIVE},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["selective"],
            MODULES: ["layernorm"],
            METHOD: None,
            "--num-layers": ["8"],
            "--fp8-format": ["hybrid"],
            "--sequence-parallel": [],
        },
        [
            (
                "passes no --pipeline-model-parallel-size (Megatron-LM runs 1 stage then; it is only in a comment "
                "(llama3_commented_pp.sh line 47)): the plan's 4 is added"
            ),
            (
                "added --pipeline-model-parallel-size, --pipeline-model-parallel-layout, --recompute-granularity, "
                "--recompute-modules in the array MODEL_PARALLEL_ARGS (llama3_commented_pp.sh line 45), next to "
                "--tensor-model-parallel-size"
            ),
        ],
    ),
    "comments in arrays": (
        "mixtral_moe.sh",
        "mixtral_moe.sh",
        {"modes": ALL_SELECTIVE},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["selective"],
            MODULES: ["layernorm"],
            "--recompute-activations": None,
            "--moe-grouped-gemm": None,
            "--eval-iters": ["10"],
        },
        ["is not the selective recompute the profile measured"],
    ),
    "legacy flags in a string": (
        "gpt_legacy_string.sh",
        "gpt_legacy_string.sh",
        {"modes": ALL_FULL, "chunks": 2},
        {
            PP: ["4"],
            LAYOUT: ["Et|t|t|t|t|t|tt|L"],
            GRANULARITY: ["full"],
            METHOD: ["block"],
            RECOMPUTE_LAYERS: ["2"],
            "--checkpoint-activations": None,
            "--activations-checkpoint-method": None,
            "--num-layers-per-virtual-pipeline-stage": None,
        },
        [
            "--checkpoint-activations (gpt_legacy_string.sh line 30) is a legacy flag Megatron-LM no longer takes",
            "--activations-checkpoint-method (gpt_legacy_string.sh line 31) is a legacy flag",
            (
                "--num-layers-per-virtual-pipeline-stage (gpt_legacy_string.sh line 22) taken out: the layout's virtual "
                "stages in its place"
            ),
            "in the string GPT_ARGS (gpt_legacy_string.sh line 21)",
        ],
    ),
    "values on the next line": (
        "llama2_next_line.sh",
        "llama2_next_line.sh",
        {"modes": FIRST_STAGE_FULL},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["full"],
            METHOD: ["block"],
            RECOMPUTE_LAYERS: ["1"],
            "--decoder-first-pipeline-num-layers": None,
            "--recompute-activations": None,
            "--lr": ["3.0e-4"],
        },
        ["in the command of llama2_next_line.sh line 17"],
    ),
    "first and last stage flags": (
        "llama2_next_line.sh",
        "llama2_next_line.sh",
        {"counts": [2, 3, 3, 2]},
        {
            PP: ["4"],
            LAYOUT: None,
            "--decoder-first-pipeline-num-layers": ["1"],
            "--decoder-last-pipeline-num-layers": ["1"],
            GRANULARITY: None,
            METHOD: None,
            RECOMPUTE_LAYERS: None,
        },
        [],
    ),
    "MTP": (
        "deepseek_v3_mtp.sh",
        "deepseek_v3_mtp.sh",
        {"modes": ALL_SELECTIVE},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|mL"],
            "--mtp-num-layers": ["1"],
            GRANULARITY: ["selective"],
            MODULES: ["layernorm", "moe_act"],
            "--moe-layer-freq": ["([0]*3+[1]*4)"],
        },
        [
            (
                "--pipeline-model-parallel-size is ${PP} in deepseek_v3_mtp.sh: 4 unless PP is set where the script "
                "is launched"
            ),
            "Megatron-LM's recompute flags do not reach the MTP layers",
        ],
    ),
    "environment prefixes": (
        "run_interleaved.sh",
        "run_interleaved.sh",
        {"chunks": 2, "micro_batches": 10},
        {
            PP: ["4"],
            LAYOUT: ["Et|t|t|t|t|t|tt|L"],
            GROUP: ["5"],
            "--num-virtual-stages-per-pipeline-rank": None,
            "--global-batch-size": ["20"],
            "--nnodes": ["1"],
        },
        [
            "train_interleaved.sh changes too: run_interleaved.sh sources or runs it",
            (
                "--global-batch-size 20 and --micro-batch-size 1 make the plan's 10 micro-batches per step at "
                "data-parallel size 2"
            ),
        ],
    ),
    "sourced flags": (
        "train_with_common.sh",
        "train_with_common.sh",
        {"modes": FIRST_STAGE_FULL},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["full"],
            RECOMPUTE_LAYERS: ["1"],
            "--recompute-activations": None,
            "--use-flash-attn": [],
        },
        [
            "common_flags.sh changes too: train_with_common.sh sources or runs it",
            "in the string PARALLEL_ARGS (train_with_common.sh line 10)",
        ],
    ),
    "eval and branches": (
        "rocm_eval.sh",
        "rocm_eval.sh",
        {"modes": FIRST_STAGE_FULL},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["full"],
            METHOD: ["block"],
            RECOMPUTE_LAYERS: ["1"],
            "--num-layers": ["8"],
        },
        [
            (
                "--num-layers is $NUM_LAYERS in rocm_eval.sh, set in branches to 80 or 8: the plan is for the branch "
                "that sets 8"
            )
        ],
    ),
    "CRLF": (
        "gpt3_crlf.sh",
        "gpt3_crlf.sh",
        {"modes": ALL_FULL},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["full"],
            RECOMPUTE_LAYERS: ["3"],
            "--recompute-activations": None,
        },
        ["CRLF line ends"],
    ),
    "a string srun's sh -c reads again": (
        "gpt3_175b_srun.sh",
        "gpt3_175b_srun.sh",
        {"modes": FIRST_STAGE_FULL},
        {
            PP: ["4"],
            LAYOUT: ["Ett|tt|t*3|tL"],
            GRANULARITY: ["full"],
            METHOD: ["block"],
            RECOMPUTE_LAYERS: ["1"],
            "--checkpoint-activations": None,
            "--num-layers": ["8"],
            "--vocab-file": ["gpt2-vocab.json"],
        },
        [
            "in the string options (gpt3_175b_srun.sh line 20), next to --pipeline-model-parallel-size",
            "--checkpoint-activations (gpt3_175b_srun.sh line 29) is a legacy flag",
        ],
    ),
    "arguments file through $(cat)": (
        "train_from_args_file.sh",
        "train_from_args_file.sh",
        {"modes": FIRST_STAGE_FULL},
        {PP: ["4"], LAYOUT: ["Ett|tt|t*3|tL"], METHOD: ["block"], RECOMPUTE_LAYERS: ["1"], "--bf16": []},
        ["megatron_args.txt changes too"],
    ),
    "arguments file": (
        "megatron_args.txt",
        "train_from_args_file.sh",
        {},
        {PP: ["4"], LAYOUT: ["Ett|tt|t*3|tL"], GRANULARITY: None, METHOD: None, RECOMPUTE_LAYERS: None},
        ["in the arguments file of megatron_args.txt line 3"],
    ),
}

HARNESS = r"""
launch() { { printf '%s\n' "$@"; printf '%s\n' '<end of launch>'; } >> "$SAPP_LAUNCHED"; }
torchrun() { launch "$@"; }
python() { launch "$@"; }
srun() { while [ $# -gt 0 ] && [ "$1" != sh ]; do shift; done; shift; bash "$@"; }  # sh -c TEXT, TEXT read again
export -f launch torchrun python srun
bash "$0"
"""


def launched(script: Path, environment: dict[str, str] | None = None) -> list[list[str]]:
    """Run a script in bash with torchrun and python printing the arguments they get: one list a launch.
    A CRLF script runs converted, as bash on Linux needs it."""
    folder = script.parent
    if any(b"\r\n" in path.read_bytes() for path in folder.iterdir() if path.is_file()):
        converted = folder.parent / (folder.name + "-lf")
        shutil.rmtree(converted, ignore_errors=True)
        converted.mkdir()
        for path in folder.iterdir():
            if path.is_file():
                (converted / path.name).write_bytes(path.read_bytes().replace(b"\r\n", b"\n"))
        script = converted / script.name
    record = script.parent / "launched.txt"
    record.unlink(missing_ok=True)
    env = {"PATH": os.environ["PATH"], "SAPP_LAUNCHED": str(record), **(environment or {})}
    done = subprocess.run(
        ["bash", "-c", HARNESS, str(script)],
        env=env,
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    launches = record.read_text().split("<end of launch>\n")
    return [launch.splitlines() for launch in launches if launch]


def flags_of(arguments: list[str]) -> dict[str, list[list[str]]]:
    """Each flag of an argument list with the values of each time it is given."""
    found: dict[str, list[list[str]]] = {}
    index = 0
    while index < len(arguments):
        name, equals, value = arguments[index].partition("=")
        index += 1
        if not name.startswith("--"):
            continue
        values = [value] if equals else []
        while (
            not equals
            and index < len(arguments)
            and not arguments[index].startswith("--")
            and (not values or name in LISTS)
        ):
            values.append(arguments[index])
            index += 1
        found.setdefault(name, []).append(values)
    return found


def others(arguments: list[str]) -> list[str]:
    """The arguments but the flags the write-back sets or takes out, and their values."""
    kept, index = [], 0
    while index < len(arguments):
        name, equals, _ = arguments[index].partition("=")
        if name in OURS:
            index += 1
            taken = 0
            while (
                not equals
                and index < len(arguments)
                and not arguments[index].startswith("--")
                and (not taken or name in LISTS)
            ):
                index, taken = index + 1, taken + 1
            continue
        kept.append(arguments[index])
        index += 1
    return kept


def comment_lines(folder: Path) -> dict[str, list[str]]:
    return {
        path.name: [line.strip() for line in path.read_text().splitlines() if line.strip().startswith("#")]
        for path in sorted(folder.iterdir())
        if path.is_file() and path.suffix in (".sh", ".txt")
    }


@pytest.fixture
def fixtures(tmp_path):
    folder = tmp_path / "megatron"
    shutil.copytree(FIXTURES, folder)
    return folder


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_fixture_takes_the_plan_and_passes_exactly_its_flags(fixtures, tmp_path, capsys, case, via):
    applied, run, plan_kwargs, expected, notes = CASES[case]
    chosen = plan(plan_kwargs.get("modes"), **{k: v for k, v in plan_kwargs.items() if k != "modes"})
    before_launches = launched(fixtures / run, {"PP": "4"} if run == "train_interleaved.sh" else None)
    before_comments = comment_lines(fixtures)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in fixtures.iterdir()}
    path = fixtures / applied
    if via == "api":
        said = write_config("megatron", path, layout_of(chosen)).notes
    else:
        plan_file = tmp_path / "plan.json"
        plan_file.write_text(json.dumps(chosen.to_dict()))
        assert main(["apply", "--plan", str(plan_file), "--target", "megatron", "--config", str(path)]) == 0
        said = [line.removeprefix("note: ") for line in capsys.readouterr().err.splitlines()]
    for note in notes:
        assert any(note in line for line in said), (note, said)
    for script in fixtures.glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True, check=False).returncode == 0, script
    after_launches = launched(fixtures / run)
    assert len(after_launches) == len(before_launches) == 1
    got = flags_of(after_launches[0])
    for flag, values in expected.items():
        if values is None:
            assert flag not in got, (flag, got.get(flag))
        else:
            assert got.get(flag) == [values], (flag, got.get(flag))  # given once, with the plan's value
    assert others(after_launches[0]) == others(before_launches[0])
    if LAYOUT in got:
        written = check(
            got[LAYOUT][0][0],
            pipeline_size=int(got[PP][0][0]),
            num_layers=int(got["--num-layers"][0][0]),
            mtp_layers=int(got["--mtp-num-layers"][0][0]) if "--mtp-num-layers" in got else None,
        )
        body = [stage.count("t") + stage.count("m") for stage in written.stages]
        assert body == [sum(1 for layer in cell if layer.is_body) for cell in layout_of(chosen).virtual_stages()]
    assert comment_lines(fixtures) == before_comments  # every comment kept, the commented-out flags too
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in fixtures.iterdir() if path.name in modes} == modes
    for changed in fixtures.iterdir():
        data = changed.read_bytes()
        data.decode("utf-8")
        if changed.name == "gpt3_crlf.sh":  # the file's own line ends, none mixed
            assert data.count(b"\n") == data.count(b"\r\n") > 0
    again = write_config("megatron", path, layout_of(chosen), dry_run=True)
    assert again.diff == ""  # written once, the plan reads back as written


def test_the_environment_picks_the_branch_a_plan_was_written_for(fixtures):
    """rocm_eval.sh recomputed only when RECOMPUTE=1: the plan's recompute now holds either way."""
    write_config("megatron", fixtures / "rocm_eval.sh", layout_of(plan(FIRST_STAGE_FULL)))
    for recompute in ("0", "1"):
        got = flags_of(launched(fixtures / "rocm_eval.sh", {"RECOMPUTE": recompute})[0])
        assert (
            got[RECOMPUTE_LAYERS] == [["1"]] and got[GRANULARITY] == [["full"]] and got[LAYOUT] == [["Ett|tt|t*3|tL"]]
        )


def test_a_value_in_a_variable_is_changed_where_it_is_set(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(
        '#!/bin/bash\nRECOMPUTE_NUM_LAYERS=2\nLAYERS=8\necho "recomputing $RECOMPUTE_NUM_LAYERS"\n'
        "torchrun train.py --num-layers $LAYERS --pipeline-model-parallel-size 4 \\\n"
        "    --recompute-granularity full --recompute-method block \\\n"
        "    --recompute-num-layers $RECOMPUTE_NUM_LAYERS\n"
    )
    notes = write_config("megatron", script, layout_of(plan(FIRST_STAGE_FULL))).notes
    assert (
        "RECOMPUTE_NUM_LAYERS=1\n" in script.read_text()
        and "--recompute-num-layers $RECOMPUTE_NUM_LAYERS" in script.read_text()
    )
    assert (
        "--recompute-num-layers is $RECOMPUTE_NUM_LAYERS: set where RECOMPUTE_NUM_LAYERS is assigned (train.sh "
        "line 2)" in notes
    )
    # one variable for two flags: the one the plan changes gets the value written out
    script.write_text(
        "#!/bin/bash\nN=8\ntorchrun train.py --num-layers $N --pipeline-model-parallel-size 4 "
        "--recompute-granularity full --recompute-method block --recompute-num-layers $N\n"
    )
    notes = write_config("megatron", script, layout_of(plan(FIRST_STAGE_FULL))).notes
    assert "N=8\n" in script.read_text() and "--recompute-num-layers 1" in script.read_text()
    assert any(note.startswith("--recompute-num-layers was $N (train.sh line 3)") for note in notes)


def test_an_environment_prefix_does_not_reach_the_words_of_its_own_command(tmp_path):
    """`PP=2 torchrun ... $PP` expands the PP set before: 4 here (bash's rule), which the plan is for."""
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\nPP=4\nPP=2 torchrun train.py --num-layers 8 --pipeline-model-parallel-size $PP\n")
    notes = write_config("megatron", script, layout_of(plan())).notes
    assert flags_of(launched(script)[0])[LAYOUT] == [["Ett|tt|t*3|tL"]]
    assert not any("set to the plan's" in note for note in notes)
    script.write_text("#!/bin/bash\nPP=2\nPP=4 torchrun train.py --num-layers 8 --pipeline-model-parallel-size $PP\n")
    notes = write_config("megatron", script, layout_of(plan())).notes
    assert (
        "--pipeline-model-parallel-size $PP (= 2) set to the plan's 4 pipeline ranks: Megatron-LM then runs world size / "
        "(4 x tensor x context-parallel size) data-parallel replicas" in notes
    )
    assert script.read_text().startswith("#!/bin/bash\nPP=4\nPP=4 torchrun")


@pytest.mark.parametrize(
    ("written", "after", "said"),
    [
        (
            "--pipeline-model-parallel-size 2",
            "--pipeline-model-parallel-size 4",
            "--pipeline-model-parallel-size 2 set",
        ),
        (
            "--pipeline-model-parallel-size ${PP:-1}",
            "--pipeline-model-parallel-size ${PP:-4}",
            "--pipeline-model-parallel-size ${PP:-1} (= 1) (unless PP is set where the script is launched) set",
        ),
        # the default of a variable's own default (PP=${PP:-1}), where the launched script reads it
        (
            "PP=${PP:-1}\n--pipeline-model-parallel-size $PP",
            "PP=${PP:-4}\n",
            "--pipeline-model-parallel-size $PP (= 1) (unless PP is set where the script is launched) set",
        ),
    ],
)
def test_a_script_for_another_pipeline_size_is_set_to_the_plans(tmp_path, written, after, said):
    script = tmp_path / "train.sh"
    preamble, _, flag = written.rpartition("\n")
    script.write_text(
        f"#!/bin/bash\n{preamble}{chr(10) if preamble else ''}torchrun t.py --num-layers 8 {flag} --lr 1\n"
    )
    notes = write_config("megatron", script, layout_of(plan())).notes
    assert after in script.read_text() and "--pipeline-model-parallel-layout" in script.read_text()
    assert any(note.startswith(f"{said} to the plan's 4 pipeline ranks") for note in notes)
    got = flags_of(launched(script)[0])
    assert got[PP] == [["4"]] and got[LAYOUT] == [["Ett|tt|t*3|tL"]]


@pytest.mark.parametrize(
    ("script", "field", "message"),
    [
        # only in comments: never edited as if live
        (
            "#!/bin/bash\nARGS=(\n    --num-layers 8\n    # --pipeline-model-parallel-size 4\n)\ntorchrun t.py ${ARGS[@]}\n",
            "--config",
            (
                "has no --pipeline-model-parallel-size that bash passes to a command; it is only in a comment "
                "(train.sh line 4): is it a Megatron-LM launch script?"
            ),
        ),
        (
            "#!/bin/bash\nrun() {\n  torchrun t.py --pipeline-model-parallel-size 4\n}\n",
            "--config",
            "it is only in a function never called (train.sh line 3)",
        ),
        (
            "#!/bin/bash\nN=9\ntorchrun t.py --num-layers $N --pipeline-model-parallel-size 4\n",
            "--plan",
            "places 8 decoder layers; {path} has --num-layers $N (= 9)",
        ),
        (
            '#!/bin/bash\nARGS="--pipeline-model-parallel-size 4\n',
            "--config",
            'train.sh line 2: the " of line 2 is never closed; sapp-hook reads a launch script as bash does',
        ),
        (
            "#!/bin/bash\nPP_ARG=--pipeline-model-parallel-size=4\ntorchrun t.py $PP_ARG\n",
            "--config",
            (
                "--pipeline-model-parallel-size is in the unquoted value of PP_ARG (train.sh line 2): sapp-hook adds flags in "
                "a command, an array or a quoted string; nothing was written"
            ),
        ),
        (
            "#!/bin/bash\ntorchrun t.py --num-layers 8 --pipeline-model-parallel-size 2 --no-overlap-p2p-communication\n",
            "--plan",
            (
                "interleaves 2 chunks on 2 pipeline ranks; Megatron-LM with --no-overlap-p2p-communication "
                "interleaves only over 3 ranks or more"
            ),
        ),
    ],
)
def test_what_cannot_be_written_is_refused_naming_why_and_nothing_changes(tmp_path, script, field, message):
    path = tmp_path / "train.sh"
    path.write_text(script)
    chosen = plan(pipeline_parallel=2, chunks=2) if "interleaves" in message else plan()
    before = path.read_bytes()
    with pytest.raises(InputError) as caught:
        write_config("megatron", path, layout_of(chosen))
    assert caught.value.field == field and message.format(path=path) in caught.value.detail
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.sh"]


@pytest.mark.parametrize(
    ("fixture", "chosen", "message"),
    [
        (
            "t5_220m_strings.sh",
            {},
            (
                "splits one stack of 8 layers; {path} trains an encoder-decoder model "
                "(--encoder-num-layers and --decoder-num-layers), whose stacks Megatron-LM's layout and first/last-stage flags "
                "do not split: sapp-hook plans decoder-only models"
            ),
        ),
        (
            "mamba_hybrid.sh",
            {},
            (
                "places [2, 2, 3, 1] layers on its 4 virtual stages; {path} trains a Mamba hybrid model "
                "(--hybrid-attention-ratio, --hybrid-mlp-ratio, ../../examples/classes/pretrain_mamba.py), whose MambaStack gives "
                "every pipeline rank --num-layers / pipeline size layers and runs no virtual stages"
            ),
        ),
        ("mamba_hybrid.sh", {"chunks": 2}, "places [1, 1, 1, 1, 1, 1, 2, 0] layers on its 8 virtual"),
    ],
)
def test_models_megatron_does_not_split_by_layers_refuse_the_plan(fixtures, fixture, chosen, message):
    """T5's two stacks, and Mamba hybrid models, whose MambaStack splits --num-layers evenly over the ranks
    (megatron/core/ssm/mamba_block.py, _select_layers_for_pipeline_parallel), cannot run an uneven plan."""
    path = fixtures / fixture
    before = path.read_bytes()
    with pytest.raises(InputError) as caught:
        write_config("megatron", path, layout_of(plan(**chosen)))
    assert caught.value.field == "--plan" and message.format(path=path) in caught.value.detail
    assert path.read_bytes() == before


def test_a_hybrid_layer_pattern_marks_a_hybrid_model(tmp_path):
    """--hybrid-layer-pattern (Megatron-LM's HybridModel, which replaced the ratio flags) splits the pattern
    at its | marks, else evenly (megatron/core/models/hybrid/hybrid_layer_allocation.py): an uneven plan
    cannot run as the script is, and the refusal says what HybridModel would take."""
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\ntorchrun pretrain_hybrid.py --num-layers 8 --pipeline-model-parallel-size 4 "
        "--hybrid-layer-pattern M*M-M*M-\n"
    )
    with pytest.raises(
        InputError, match=r"\(--hybrid-layer-pattern\), whose HybridModel takes any other split only as \| stage"
    ):
        write_config("megatron", script, layout_of(plan()))


def test_a_hybrid_layer_pattern_without_num_layers_is_the_layer_count(tmp_path):
    """Newer hybrid scripts (examples/dsv4_hybrid) pass no --num-layers: the pattern's symbols are the layers
    (`|` marks stages, a `/` starts its MTP patterns); an even plan of another count is refused."""
    script = tmp_path / "train.sh"
    script.write_text(
        '#!/bin/bash\nHYBRID_PATTERN="M-M-M*M-M*"\n'
        "torchrun pretrain_hybrid.py --hybrid-layer-pattern $HYBRID_PATTERN --pipeline-model-parallel-size 1\n"
    )
    before = script.read_bytes()
    even = plan(counts=[3, 2, 2, 3])  # 2 body layers on each stage
    with pytest.raises(
        InputError, match=r"places 8 decoder layers; .*train.sh has --hybrid-layer-pattern M-M-M\*M-M\* \(10 layers\)$"
    ):
        write_config("megatron", script, layout_of(even))
    assert script.read_bytes() == before
    script.write_text(before.decode().replace("M-M-M*M-M*", "M-M-M*M-/MM"))  # 8 layers, then an MTP pattern
    write_config("megatron", script, layout_of(even))
    assert flags_of(launched(script)[0])[PP] == [["4"]]


def test_the_stage_marks_of_a_hybrid_layer_pattern_are_the_split(tmp_path):
    """Megatron-LM runs segment vp x pp + rank of a pattern with | marks on each rank: a plan of that
    split is written (the pipeline size), any other is refused, as sapp-hook does not move the marks."""
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\ntorchrun pretrain_hybrid.py --hybrid-layer-pattern 'M-M|-[M*]|M|-' --pipeline-model-parallel-size 4\n"
    )
    before = script.read_bytes()
    with pytest.raises(
        InputError, match=r"marks 4 stages of \[3, 3, 1, 1\] layers with \|, which sapp-hook does not rewrite: "
    ):
        write_config("megatron", script, layout_of(plan(counts=[3, 2, 3, 2])))  # [2, 2, 3, 1] body layers
    assert script.read_bytes() == before
    script.write_text(before.decode().replace("M-M|-[M*]|M|-", "M-|M-|-M*|M"))
    write_config("megatron", script, layout_of(plan(counts=[3, 2, 3, 2])))
    got = flags_of(launched(script)[0])
    # HybridModel refuses first/last-stage counts beside | marks; the marks say the split
    assert got[PP] == [["4"]] and LAYOUT not in got and "--decoder-first-pipeline-num-layers" not in got


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [
        (
            "model_config.yaml",
            (
                "ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\nMODEL_ARGS:\n  --num-layers: 8\n"
                "  --pipeline-model-parallel-size: 4\n  --num-layers-per-virtual-pipeline-stage: 1\nTEST_TYPE: regular\n"
            ),
            "the MODEL_ARGS of a functional-test model_config.yaml",
        ),
        (
            "gpt_config.yaml",
            "language_model:\n  num_layers: 8\nmodel_parallel:\n  pipeline_model_parallel_size: 1\n",
            "a --yaml-cfg file",
        ),
    ],
)
def test_a_megatron_yaml_config_is_refused_as_what_it_is(tmp_path, name, text, kind):
    """Megatron-LM's YAML configs (its functional tests' MODEL_ARGS, examples/gpt3's --yaml-cfg) are not
    scripts bash runs: the refusal names the format, not a missing flag (the YAML has the flag)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError, match=re.escape(f"is a Megatron-LM YAML config ({kind}), not a launch script")):
        write_config("megatron", path, layout_of(plan()))
    assert path.read_text() == text


def test_a_mamba_hybrid_model_takes_an_even_plan(fixtures):
    """What MambaStack runs: the plan's pipeline size, no split flags, the recompute."""
    notes = write_config("megatron", fixtures / "mamba_hybrid.sh", layout_of(plan(ALL_FULL, counts=[3, 2, 2, 3]))).notes
    got = flags_of(launched(fixtures / "mamba_hybrid.sh")[0])
    assert got[PP] == [["4"]] and LAYOUT not in got and "--decoder-first-pipeline-num-layers" not in got
    assert got[GRANULARITY] == [["full"]] and got[RECOMPUTE_LAYERS] == [["2"]]
    assert any("set in branches to 56 or 8: the plan is for the branch that sets 8" in note for note in notes)


def test_mtp_layers_split_over_two_stages_cannot_be_said(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text("#!/bin/bash\ntorchrun t.py --num-layers 6 --mtp-num-layers 2 --pipeline-model-parallel-size 4\n")
    with pytest.raises(
        InputError,
        match=re.escape(
            "cannot be said as a Megatron-LM layout: 'Ett|tt|ttm|mL': the MTP layers m must all be in one stage"
        ),
    ) as caught:
        write_config("megatron", path, layout_of(plan()))
    assert caught.value.field == "--plan"


def test_a_failed_write_puts_back_every_file_already_written(fixtures, monkeypatch):
    before = {path.name: path.read_bytes() for path in fixtures.iterdir()}
    real_replace, calls = os.replace, []

    def second_fails(source, destination):
        calls.append(destination)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(InputError, match="left as it was"):
        write_config("megatron", fixtures / "train_with_common.sh", layout_of(plan(FIRST_STAGE_FULL)))
    assert {path.name: path.read_bytes() for path in fixtures.iterdir() if path.name in before} == before
    assert not [path.name for path in fixtures.iterdir() if path.name.startswith(".")]


def test_dry_run_shows_every_files_diff_and_writes_nothing(fixtures, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan(FIRST_STAGE_FULL).to_dict()))
    before = {path.name: path.read_bytes() for path in fixtures.iterdir()}
    config = fixtures / "train_with_common.sh"
    assert main(["apply", "--plan", str(plan_file), "--target", "megatron", "--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"--- {fixtures / 'common_flags.sh'} (before)" in out and f"--- {config} (before)" in out
    assert '-COMMON_ARGS="$COMMON_ARGS --recompute-activations"' in out
    assert {path.name: path.read_bytes() for path in fixtures.iterdir()} == before


def test_the_job_check_reads_scripts_as_the_writer_does(fixtures):
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B")
    for name in ("gpt3_arrays.sh", "rocm_eval.sh", "deepseek_v3_mtp.sh", "llama2_next_line.sh"):
        check_job("megatron", fixtures / name, spec, 8, config_field="--config")
    with pytest.raises(InputError, match=r"--config: .* does not fit this job: the plan places 9 decoder layers"):
        check_job("megatron", fixtures / "gpt3_arrays.sh", spec, 9, config_field="--config")
    # the writer's refusal is a PlanMismatch: what the plan says, named by the caller, never matched by its words
    with pytest.raises(PlanMismatch) as caught:
        write_config("megatron", fixtures / "gpt3_arrays.sh", even_layout(spec, 9), dry_run=True)
    assert (caught.value.field, caught.value.predicate) == ("--plan", caught.value.detail)
    assert caught.value.predicate.startswith("places 9 decoder layers")


# -- the layout grammar --------------------------------------------------------------------------


def test_megatrons_own_layout_examples():
    # the docstring of parse_str_to_list; DeepSeek-V3's 61 layers and an MTP layer over PP16 x VPP2
    layout = check("Ettt|(tt|)*29,m|L", pipeline_size=16, num_layers=61, mtp_layers=1)
    assert layout.virtual_size == 2 and layout.count("t") == [3] + [2] * 29 + [0, 0]
    assert parse_stages("E|(t|)*3,m|m||L") == [["E"], ["t"], ["t"], ["t"], ["m"], ["m"], [], ["L"]]
    assert parse_layout('"Et*3|(tt|)*2,t|L"') == [3, 2, 2, 1, 0]


@pytest.mark.parametrize(
    ("text", "sizes", "message"),
    [
        ("tE|L", (2, 1, None), "the first layer must be the embedding E"),
        ("Et|tL|L", (3, 2, None), "the last layer must be the loss L, and L must appear once"),
        ("Et|tL", (2, 3, None), "has 2 decoder layers t; --num-layers is 3"),
        ("Et|t|tL", (2, 3, None), "has 3 stages, not a multiple of the pipeline size 2"),
        ("Et|mtL", (2, 2, 1), "every decoder layer t must come before the MTP layers m"),
        (
            "Et|tm||L",
            (2, 2, 1),
            (
                "the MTP layers m must all be in one stage, the last virtual stage of its pipeline rank "
                "(stage 1 is virtual stage 0 of rank 1)"
            ),
        ),
        ("Et|tmL", (2, 2, None), "has 1 MTP layers m; --mtp-num-layers is 0"),
        ("E((t)*2)*2|L", (2, 4, None), "groups do not nest"),
        ("Et x|L", (2, 1, None), "' ' is not a layer"),
        ("Et*2*3|L", (2, 2, None), "'*' is not a layer"),
    ],
)
def test_layouts_megatron_refuses(text, sizes, message):
    pipeline_size, num_layers, mtp = sizes
    with pytest.raises(LayoutError, match=re.escape(message)):
        check(text, pipeline_size=pipeline_size, num_layers=num_layers, mtp_layers=mtp)


def _megatron_reading(text: str) -> list[list[str]]:
    """Megatron's reading, as its parse_str_to_list does it: commas out, groups then single symbols
    repeated by two substitutions, stages split at |."""
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text.replace(",", ""))
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    if any(symbol not in "EtmL" for stage in stages for symbol in stage):
        raise ValueError(text)
    return stages


@given(st.text(alphabet="EtmL|(),*0123", max_size=16))
def test_the_grammar_reads_what_megatron_reads_and_no_more(text):
    try:
        mine = parse_stages(text)
    except LayoutError:
        return  # refusing more than Megatron (a `)*0` that deletes a bracket) never writes a wrong layout
    assert mine == _megatron_reading(text)


@given(
    st.lists(
        st.tuples(st.sampled_from(["t", "tt", "t*3", "(t|)*2", "m", ",t", "t*12"]), st.booleans()),
        min_size=1,
        max_size=8,
    )
)
def test_well_formed_layouts_read_as_megatron_reads_them(pieces):
    text = "E" + "".join(piece + ("|" if stage_end else "") for piece, stage_end in pieces) + "L"
    assert parse_stages(text) == _megatron_reading(text)


def test_the_written_layout_is_the_plans_split():
    chosen = plan(chunks=2)
    assert layout_string(layout_of(chosen)) == "Et|t|t|t|t|t|tt|L"
    assert layout_string(layout_of(plan()), mtp_layers=1) == "Ett|tt|t*3|mL"


def test_what_the_script_leaves_to_launch_is_said(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\nsource ./site_settings.sh 2>/dev/null\n"
        "torchrun t.py --num-layers 8 $EXTRA_ARGS --tokenizer-model $TOKENIZER "
        "--pipeline-model-parallel-size 4\n"
    )
    notes = write_config("megatron", script, layout_of(plan())).notes
    # $TOKENIZER is the value of a flag before it; $EXTRA_ARGS may hold flags
    assert "the launch command also expands $EXTRA_ARGS, known only at launch: flags there are not seen" in notes
    assert "not followed: ./site_settings.sh (run from train.sh): not found" in notes
    assert flags_of(launched(script, {"EXTRA_ARGS": "--bf16"})[0])[LAYOUT] == [["Ett|tt|t*3|tL"]]


def test_flags_continued_on_the_next_line_leave_no_stale_value(tmp_path):
    """A value on the line after its flag is the flag's (bash joins the lines): it is changed or goes with
    it, the first-stage flag goes beside a layout, and a command whose last lines go still ends."""
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\ntorchrun t.py \\\n    --num-layers 8 \\\n    --pipeline-model-parallel-size \\\n"
        "        4 \\\n    --recompute-granularity full --recompute-method block \\\n"
        "    --recompute-num-layers \\\n        2 \\\n    --decoder-first-pipeline-num-layers \\\n"
        "        1\necho launched\n"
    )
    write_config("megatron", script, layout_of(plan(FIRST_STAGE_FULL)))
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    got = flags_of(launched(script)[0])
    assert got == {
        "--num-layers": [["8"]],
        PP: [["4"]],
        LAYOUT: [["Ett|tt|t*3|tL"]],
        GRANULARITY: [["full"]],
        METHOD: [["block"]],
        RECOMPUTE_LAYERS: [["1"]],
    }
    assert script.read_text().endswith("    --recompute-num-layers \\\n        1\necho launched\n")


def test_flags_passed_on_as_arguments_are_changed_where_the_caller_writes_them(tmp_path):
    """`"$@"` in a function or a called script passes the caller's arguments: a flag there is the caller's."""
    inner = tmp_path / "inner.sh"
    inner.write_text(
        '#!/bin/bash\nrun() {\n  torchrun t.py --num-layers 8 --pipeline-model-parallel-size 4 "$@"\n}\n'
        'run "$@" --bf16\n'
    )
    outer = tmp_path / "outer.sh"
    outer.write_text('#!/bin/bash\nbash "$(dirname "$0")/inner.sh" --recompute-activations --lr 1\n')
    write_config("megatron", outer, layout_of(plan(ALL_SELECTIVE)))
    assert outer.read_text() == '#!/bin/bash\nbash "$(dirname "$0")/inner.sh" --lr 1\n'
    got = flags_of(launched(outer)[0])
    assert "--recompute-activations" not in got and got[GRANULARITY] == [["selective"]] and got["--lr"] == [["1"]]


def test_a_batch_size_ramp_is_said_with_the_micro_batches(tmp_path):
    """`--rampup-batch-size 16 16 5859375` (examples/pretrain_gpt3_175B.sh, Megatron-LM 2021): the global batch
    grows to --global-batch-size, so the plan's micro-batch count holds once the ramp is done."""
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\ntorchrun pretrain_gpt.py --num-layers 8 --pipeline-model-parallel-size 4 "
        "--micro-batch-size 1 --global-batch-size 64 --rampup-batch-size 16 16 5859375 --lr 1e-4\n"
    )
    notes = write_config("megatron", script, layout_of(plan())).notes
    assert any(note.startswith("--rampup-batch-size 16 16 5859375: the global batch grows to 64") for note in notes)
    assert flags_of(launched(script)[0])["--rampup-batch-size"] == [["16", "16", "5859375"]]


@pytest.mark.parametrize(
    ("preamble", "unquoted", "quoted"),
    [
        ("PP=${PP:-4}\n", "--pipeline-model-parallel-size $PP", '--pipeline-model-parallel-size "$PP"'),
        ("PP=4\n", "--pipeline-model-parallel-size ${PP}", '--pipeline-model-parallel-size "${PP}"'),
        ("", "--pipeline-model-parallel-size ${PP:-4}", '--pipeline-model-parallel-size "${PP:-4}"'),
        ("PP=4\n", "--pipeline-model-parallel-size=$PP", '--pipeline-model-parallel-size="$PP"'),
        ("PP=4\n", "ARGS=(--pipeline-model-parallel-size $PP", 'ARGS=("--pipeline-model-parallel-size" "$PP"'),
    ],
)
@pytest.mark.parametrize("pipeline_parallel", [4, 2])
def test_quoted_and_unquoted_variables_read_alike(tmp_path, preamble, unquoted, quoted, pipeline_parallel):
    """`"$PP"` passes what `$PP` passes: a plan goes into both alike (the flags it adds after the quoted word)."""
    chosen = plan(pipeline_parallel=pipeline_parallel, counts=[3, 2, 3, 2] if pipeline_parallel == 4 else [6, 4])
    results = []
    for form in (unquoted, quoted):
        folder = tmp_path / ("quoted" if form == quoted else "unquoted")
        folder.mkdir()
        script = folder / "train.sh"
        command = "torchrun pretrain_gpt.py --num-layers 8 {} --tensor-model-parallel-size 1\n"
        if form.startswith("ARGS=("):
            command = form + ' --tensor-model-parallel-size 1)\ntorchrun pretrain_gpt.py --num-layers 8 "${ARGS[@]}"\n'
        else:
            command = command.format(form)
        script.write_text(f"#!/bin/bash\n{preamble}{command}")
        notes = write_config("megatron", script, layout_of(chosen)).notes
        results.append((notes, launched(script)[0], script.read_text().replace(quoted, unquoted).replace('"', "")))
    assert results[0] == results[1]
    got = flags_of(results[0][1])
    assert got[PP] == [[str(pipeline_parallel)]]
    assert got.get(LAYOUT, got.get("--decoder-first-pipeline-num-layers")) == [
        ["Ett|tt|t*3|tL" if pipeline_parallel == 4 else "5"]
    ]


def test_a_long_line_is_read_in_memory_linear_in_its_length(tmp_path):
    """A 45 KB `--data-path` line (real blends run to megabytes) costs the reader a small multiple of its bytes:
    one record per stretch of text written in one place, not per character."""
    import tracemalloc

    from sapp_hook.writeback.text.bash_script import read_script

    blend = " ".join(f"1.0 /data/corpus/shard_{i:07d}_text_document" for i in range(1000))
    script = tmp_path / "train.sh"
    text = (
        f'#!/bin/bash\nPP=4\nDATA_PATH="{blend}"\n'
        "torchrun pretrain_gpt.py --num-layers 8 --pipeline-model-parallel-size $PP --data-path $DATA_PATH\n"
    )
    script.write_text(text)
    tracemalloc.start()
    try:
        reading = read_script(script, text)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(reading.commands[-1].argv) == 7 + 2000  # the blend split into its words, as bash splits it
    assert peak_bytes < 64 * len(text), f"{peak_bytes / len(text):.0f} bytes held per byte of the script"
    write_config("megatron", script, layout_of(plan(FIRST_STAGE_FULL)))
    assert launched(script)[0].count("--data-path") == 1 and blend in script.read_text()
