"""Plans written into MindFormers configs as MindFormers ships them (tests/fixtures/mindformers, each modelled on an
upstream file named at its top): every fixture applied with `write_config` and with `sapp-hook apply`, read back
with PyYAML and ruamel, the values MindFormers will read exactly the plan's, anchors and aliases as they were, only
the plan's lines changed; refusals (an order the plan was not made for, alias bombs, repeated keys) one clear error
with the file byte-identical."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from sapp_hook.cli import main
from sapp_hook.writeback import layout_from_dict, write_config
from simulator import InputError
from solver import PipelineSpec
from solver.vocabulary.profile import RECOMPUTE_MODES
from solver.vocabulary.spec import spec_to_dict

FIXTURES = Path(__file__).parent / "fixtures" / "mindformers"
# Every line sapp-hook may change holds one of these keys (or an op pattern of a select key's mapping).
PLAN_KEYS = re.compile(
    r"\b(offset|pp_interleave_num|recompute|select_recompute|select_comm_recompute|micro_batch_num|"
    r"pipeline_stage|pipeline_config|pipeline_interleave|pipeline_scheduler|pipeline_stage_offset|"
    r"pipeline_model_parallel_size|virtual_pipeline_model_parallel_size)\b|\\\."
)


def layout(
    counts: list[int],
    *,
    chunks: int = 1,
    schedule: str = "1F1B",
    micro_batches: int = 8,
    mtp: int = 0,
    full: list[int] | None = None,
    selective: list[int] | None = None,
):
    """A plan whose virtual stages hold `counts` body layers (the head on the first, the tail on the last), the
    last `mtp` of them multi-token-prediction layers; per virtual stage, its first `full` layers fully recomputed
    and the next `selective` selectively."""
    spec = PipelineSpec(
        pipeline_parallel=len(counts) // chunks, chunks=chunks, micro_batches=micro_batches, schedule=schedule
    )
    body = sum(counts)
    layers = [{"name": "embed", "kind": "head", "virtual_stage": 0, "recompute": "none"}]
    for virtual, count in enumerate(counts):
        for position in range(count):
            index = len(layers) - 1
            f, s = (full or [0] * len(counts))[virtual], (selective or [0] * len(counts))[virtual]
            mode = "full" if position < f else "selective" if position < f + s else "none"
            layers.append(
                {
                    "name": f"layers.{index}",
                    "kind": "body:mtp" if index >= body - mtp else "body:decoder",
                    "virtual_stage": virtual,
                    "recompute": mode,
                }
            )
    layers.append({"name": "lm_head", "kind": "tail", "virtual_stage": len(counts) - 1, "recompute": "none"})
    return layout_from_dict({"spec": spec_to_dict(spec), "plan": {"layers": layers}})


def at(data: object, path: str) -> object:
    for part in re.findall(r"[^.\[\]]+", path):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


@dataclass
class Case:
    name: str
    file: str
    plan: dict
    expected: dict[str, object]  # dotted path -> what MindFormers reads there after the write
    notes: list[str] = field(default_factory=list)  # words each of some note
    prepare: tuple[str, str] | None = None  # text replaced in the fixture before the plan (else PREPARE's)


DEEPSEEK_COUNTS = [3] + [4] * 14 + [3]  # 61 decoder layers + 1 MTP over 16 stages: 3 each and 14 more
DEEPSEEK_FULL, DEEPSEEK_SELECTIVE = [2] * 8 + [1] * 8, [1] + [0] * 15
PP48_COUNTS = [5, 5, 5, 5, 5, 5, 5, 5, 4, 4]  # chunk 0's five stages, then chunk 1's: 48 layers
QWEN_COUNTS = [15, 16, 16, 17]

CASES = [
    Case(
        "deepseek3 legacy: MTP counted, anchors kept",
        "deepseek3_671b_pretrain.yaml",
        dict(counts=DEEPSEEK_COUNTS, mtp=1, micro_batches=32, full=DEEPSEEK_FULL, selective=DEEPSEEK_SELECTIVE),
        {
            "model.model_config.offset": [0] + [1] * 14 + [0],
            "recompute_config.recompute": DEEPSEEK_FULL,
            "recompute_config.select_recompute": [3] + [2] * 7 + [1] * 8,
            "parallel_config.micro_batch_num": 32,
            "callbacks[1].micro_batch_num": 32,
            "parallel.dataset_strategy": [[16, 1]] * 4,
            "model.model_config.num_layers": 61,
            "callbacks[1].num_layers": 61,
        },
    ),
    Case(
        "deepseek3 legacy: a new micro-batch count changes the anchor and its alias",
        "deepseek3_671b_pretrain.yaml",
        dict(counts=DEEPSEEK_COUNTS, mtp=1, micro_batches=16, full=DEEPSEEK_FULL),
        {
            "parallel_config.micro_batch_num": 16,
            "callbacks[1].micro_batch_num": 16,
            "recompute_config.select_recompute": False,
        },  # no layer selected beyond the fully recomputed: as it was
        ["micro_batch_num 32 -> 16", "is &micro_batch_num, also callbacks[1].micro_batch_num"],
    ),
    Case(
        "deepseek3 mcore, chunks of 8 x 2, once its scheduler is 1f1b",
        "deepseek3_mcore_seqpipe.yaml",
        dict(
            counts=[3] + [4] * 14 + [3],
            chunks=2,
            schedule="Interleaved1F1B",
            mtp=1,
            micro_batches=32,
            full=[3] + [4] * 14 + [3],
        ),
        {
            "model.model_config.offset": [[0] + [1] * 7, [1] * 7 + [0]],
            "recompute_config.recompute": True,
            "model.model_config.pp_interleave_num": 2,
            "recompute_config.select_recompute": False,
            "parallel.pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"},
        },
    ),
    Case(
        "deepseek3 mcore 16 + 1 over 16 stages: a scalar offset and a bool",
        "deepseek3_12b_pp16.yaml",
        dict(counts=[1] * 7 + [2, 2] + [1] * 6 + [0], mtp=1, micro_batches=16),
        {
            "model.model_config.offset": [0] * 7 + [1, 1] + [0] * 6 + [-1],
            "recompute_config.recompute": False,
            "parallel_config.pipeline_stage": 16,
        },
    ),
    Case(
        "deepseek3 4 layers, 2 chunks added",
        "deepseek3_4layer_interleaved.yaml",
        dict(counts=[1, 1, 1, 1], chunks=2, schedule="Interleaved1F1B", mtp=1, micro_batches=2, full=[1, 0, 0, 0]),
        {
            "model.model_config.offset": 0,
            "model.model_config.pp_interleave_num": 2,
            "recompute_config.recompute": [[1, 0], [0, 0]],
            "parallel.pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"},
            "callbacks[1]": {"type": "TopkBiasBalanceCallback", "num_layers": 3, "mtp_depth": 1, "micro_batch_num": 2},
            "processor.tokenizer.bos_token": "<｜begin▁of▁sentence｜>",
        },
    ),
    Case(
        "qwen3 mcore: num_hidden_layers, a bool kept, a multi-line flow list kept",
        "qwen3_32b_pretrain.yaml",
        dict(counts=QWEN_COUNTS, micro_batches=8, full=QWEN_COUNTS),
        {
            "model.model_config.offset": [-1, 0, 0, 1],
            "recompute_config.recompute": True,
            "parallel_config.micro_batch_num": 8,
            "parallel.dataset_strategy": [[1, 1]] * 4,
        },
        ["parallel_config.micro_batch_num 4 -> 8"],
    ),
    Case(
        "mcore template without a layer count",
        "llm_pretrain_moe_template.yaml",
        dict(counts=[11, 13], micro_batches=2, selective=[3, 0]),
        {
            "model.model_config.offset": [-1, 1],
            "recompute_config.select_recompute": [3, 0],
            "recompute_config.recompute": False,
            "parallel.dataset_strategy": [[2, 1]] * 4 + [[2, 1, 1, 1]],
        },
        ["model.model_config declares no num_layers or num_hidden_layers"],
    ),
    Case(
        "llama2 70b: CRLF, Chinese comments, counts without spaces",
        "llama2_70b_pretrain_crlf.yaml",
        dict(counts=[9] + [10] * 6 + [11], micro_batches=256, selective=[6, 4, 2, 1, 0, 0, 0, 0]),
        {
            "model.model_config.offset": [-1, 0, 0, 0, 0, 0, 0, 1],
            "recompute_config.recompute": False,
            "recompute_config.select_recompute": [6, 4, 2, 1, 0, 0, 0, 0],
            "recompute_config.select_comm_recompute": [0] * 8,
        },
    ),
    Case(
        "llama2 13b: op patterns keep their ops",
        "llama2_13b_select_ops.yaml",
        dict(counts=[19, 21], micro_batches=128, selective=[10, 5]),
        {
            "model.model_config.offset": [-1, 1],
            "recompute_config.recompute": False,
            "recompute_config.select_recompute": {
                op: [10, 5]
                for op in (
                    r"feed_forward\.mul",
                    r"feed_forward\.w1\.activation",
                    r"feed_forward\.w1\.reshape",
                    r"feed_forward\.w2\.reshape",
                )
            },
            "recompute_config.select_comm_recompute": {r".*\.norm": [0, 0]},
        },
        ["recompute_config.select_recompute names ops"],
    ),
    Case(
        "48 layers, 5 x 2: lists of lists and a mapping of ops",
        "pp_interleave_48_layers.yaml",
        dict(
            counts=PP48_COUNTS,
            chunks=2,
            schedule="Interleaved1F1B",
            micro_batches=10,
            full=[2, 1, 0, 0, 0, 1, 0, 0, 0, 0],
            selective=[1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        ),
        {
            "model.model_config.offset": [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]],
            "recompute_config.recompute": [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]],
            "recompute_config.select_recompute": {
                op: [[3, 2, 0, 0, 0], [1, 0, 0, 0, 0]]
                for op in (
                    r"feed_forward\.w1\.activation\.silu",
                    r"feed_forward\.mul",
                    r"feed_forward\.w1\.matmul",
                    r"feed_forward\.w3\.matmul",
                )
            },
            "recompute_config.select_comm_recompute": {
                op: [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]] for op in (r"ffn_norm\.norm", r"attention_norm\.norm")
            },
        },
    ),
    Case(
        "llama2 7b with merge keys: the merged value overridden where it is used",
        "llama2_7b_merge_keys.yaml",
        dict(counts=[7, 8, 8, 9], micro_batches=16, full=[7, 8, 8, 9]),
        {
            "parallel_config.micro_batch_num": 16,
            "pp4_parallel.micro_batch_num": 8,
            "parallel_config.data_parallel": 2,
            "model.model_config.offset": [-1, 0, 0, 1],
            "model.model_config.num_layers": 32,
            "recompute_config.recompute": True,
        },
        ["parallel_config.micro_batch_num came from a merge"],
    ),
    Case(
        "llm_template_v2, Chinese comments, data-parallel size left to the devices",
        "template_v2_qwen3.yaml",
        dict(counts=QWEN_COUNTS, micro_batches=8, full=QWEN_COUNTS),
        {
            "distribute_parallel_config.pipeline_parallel_config.pipeline_stage_offset": [-1, 0, 0, 1],
            "recompute_config.recompute": True,
            "distribute_parallel_config.data_parallel_size": None,
        },
        ["make the plan's 8 micro-batches per step at data-parallel size 64"],
    ),
    Case(
        "llm_template_v2 zero_bubble_v",
        "template_v2_qwen3.yaml",
        dict(counts=[8] * 8, chunks=2, schedule="ZBVZeroBubble", micro_batches=8),
        {
            "distribute_parallel_config.pipeline_parallel_config": {
                "pipeline_interleave": True,
                "pipeline_scheduler": "zero_bubble_v",
                "virtual_pipeline_model_parallel_size": 2,
                "pipeline_stage_offset": 0,
            },  # 0: even, as the plan
            "recompute_config.recompute": False,
        },
        ["pipeline_scheduler 1f1b -> zero_bubble_v: the plan is for ZBVZeroBubble"],
    ),
    Case(
        "llama2 7b finetune without pipeline parallelism: the plan's stages",
        "llama2_7b_finetune_no_pp.yaml",
        dict(counts=[7, 9, 9, 7], micro_batches=8, full=[2, 2, 0, 0]),
        {
            "parallel_config.pipeline_stage": 4,
            "parallel_config.micro_batch_num": 8,
            "parallel_config.data_parallel": 8,
            "model.model_config.offset": [-1, 1, 1, -1],
            "recompute_config.recompute": [2, 2, 0, 0],
            "recompute_config.select_recompute": False,
        },
        [
            (
                "parallel_config.pipeline_stage was 1 (no pipeline parallelism); set to the plan's 4: the job then takes "
                "data_parallel x model_parallel x 4 = 32 devices (was 8); for 8 set data_parallel to 2"
            ),
            "parallel_config.micro_batch_num 1 -> 8",
        ],
    ),
    Case(
        "telechat3 seqpipe, no sequence split: Megatron's interleaved order, kept",
        "telechat3_36b_seqpipe.yaml",
        dict(counts=[15, 17, 17, 15], chunks=2, schedule="Interleaved1F1B", micro_batches=4, full=[15, 14, 14, 14]),
        {
            "parallel.pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "seqpipe"},
            "model.model_config.offset": [[-1, 1], [1, -1]],
            "model.model_config.pp_interleave_num": 2,
            "recompute_config.recompute": [[15, 14], [14, 14]],
            "parallel.dataset_strategy": [[1, 1]] * 4,
        },
        [
            (
                "pipeline_scheduler seqpipe kept: with seq_split_num unset (1) it splits no sequence and runs the plan's "
                "Interleaved1F1B order"
            )
        ],
    ),
    Case(
        "telechat3 seqpipe, seq_split_num 1, one chunk: 1F1B",
        "telechat3_36b_seqpipe.yaml",
        dict(counts=[31, 33], micro_batches=4),
        {
            "parallel.pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "seqpipe"},
            "parallel_config.seq_split_num": 1,
            "model.model_config.offset": [-1, 1],
            "model.model_config.pp_interleave_num": 1,
            "recompute_config.recompute": [[0, 0]],
        },
        ["seqpipe kept: with seq_split_num 1 it splits no sequence and runs the plan's 1F1B order"],
        prepare=("  micro_batch_num: 4\n", "  micro_batch_num: 4\n  seq_split_num: 1\n"),
    ),
    Case(
        "telechat3 seqsmartvpp (as the 105B config), one chunk: 1F1B",
        "telechat3_36b_seqpipe.yaml",
        dict(counts=[32, 32], micro_batches=4, full=[32, 32]),
        {
            "parallel.pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "seqsmartvpp"},
            "model.model_config.pp_interleave_num": 1,
            "recompute_config.recompute": [[32, 32]],
        },
        ["seqsmartvpp kept"],
        prepare=("'seqpipe'", "seqsmartvpp"),
    ),
    Case(
        "telechat3 seqsmartvpp, no sequence split: MindFormers' small-memory order",
        "telechat3_36b_seqpipe.yaml",
        dict(counts=[16, 16, 16, 16], chunks=2, schedule="Interleaved1F1B-less-memory", micro_batches=4),
        {
            "parallel.pipeline_config": {"pipeline_interleave": True, "pipeline_scheduler": "seqsmartvpp"},
            "recompute_config.recompute": [[0, 0], [0, 0]],
            "model.model_config.offset": 0,
        },
        ["seqsmartvpp kept"],
        prepare=("'seqpipe'", "seqsmartvpp"),
    ),
    Case(
        "llm_template_v2 DeepSeek-V3: num_nextn_predict_layers counted",
        "template_v2_deepseek3_mtp.yaml",
        dict(counts=DEEPSEEK_COUNTS, mtp=1, micro_batches=32, full=DEEPSEEK_FULL, selective=DEEPSEEK_SELECTIVE),
        {
            "distribute_parallel_config.pipeline_parallel_config.pipeline_stage_offset": [0] + [1] * 14 + [0],
            "recompute_config.recompute": DEEPSEEK_FULL,
            "recompute_config.select_recompute": [3] + [2] * 7 + [1] * 8,
            "recompute_config.select_comm_recompute": False,
        },
    ),
]
# The text the seqpipe fixture gets before its plan: the order its plan is for.
PREPARE = {"deepseek3_mcore_seqpipe.yaml": ("pipeline_scheduler: seqpipe", "pipeline_scheduler: 1f1b")}


def copied(tmp_path: Path, name: str, prepare: tuple[str, str] | None = None) -> Path:
    path = tmp_path / name
    path.write_bytes((FIXTURES / name).read_bytes())
    old, new = prepare or PREPARE.get(name, ("", ""))
    if old:
        path.write_bytes(path.read_bytes().replace(old.encode(), new.encode()))
    return path


def layer_setting(data: dict, plan) -> dict[str, list[list[int]]]:
    """Per chunk and stage, the layers, the fully recomputed ones and those with selected ops recomputed that
    MindFormers' LayerSetting takes from a config: its arithmetic (mindformers/models/utils.py) written out again
    here, apart from the writer's. A layer fully recomputed recomputes no selected ops (MindFormers skips them)."""
    if "distribute_parallel_config" in data:
        pipeline = data["distribute_parallel_config"]["pipeline_parallel_config"]
        stages = data["distribute_parallel_config"]["pipeline_model_parallel_size"]
        offset, chunks = pipeline["pipeline_stage_offset"], pipeline["virtual_pipeline_model_parallel_size"]
        model = data["model_config"]
    else:
        model = data["model"]["model_config"]
        interleave = data.get("parallel", {}).get("pipeline_config", {}).get("pipeline_interleave", False)
        stages, offset = data["parallel_config"]["pipeline_stage"], model.get("offset", 0)
        chunks = model.get("pp_interleave_num", 1) if interleave else 1
    total = model.get("num_layers", model.get("num_hidden_layers", plan.body_layers)) + model.get(
        "mtp_depth", model.get("num_nextn_predict_layers", 0)
    )
    offsets = np.broadcast_to(np.array(offset, np.int32), (chunks, stages))
    assert offsets.sum() == total % (stages * chunks)
    layers = np.ones((chunks, stages), np.int32) * (total // (stages * chunks)) + offsets

    def counts(value: object) -> np.ndarray:  # LayerSetting._format_recompute_list
        if isinstance(value, bool):
            return layers if value else np.zeros_like(layers)
        if all(isinstance(item, str) for item in value):
            return layers
        if all(isinstance(item, int) for item in value):  # per stage: one layer a chunk at a time
            cells = np.zeros_like(layers)
            for stage, count in enumerate(value):
                count = min(count, layers[:, stage].sum())
                while count:
                    for chunk in range(chunks):
                        if count and cells[chunk, stage] < layers[chunk, stage]:
                            cells[chunk, stage], count = cells[chunk, stage] + 1, count - 1
            return cells
        return np.minimum(np.array(value), layers)

    recompute = data.get("recompute_config", {})
    full = counts(recompute.get("recompute", False))
    select = recompute.get("select_recompute", False)
    per_op = [counts(value) for value in select.values()] if isinstance(select, dict) else [counts(select)]
    assert all((np.maximum(op, full) == np.maximum(per_op[0], full)).all() for op in per_op)
    return {"layers": layers.tolist(), "full": full.tolist(), "selected": np.maximum(per_op[0], full).tolist()}


def plan_cells(plan) -> dict[str, list[list[int]]]:
    """Per chunk and stage, the plan's body layers, fully recomputed ones, and those recomputed fully or selectively."""
    schedule = PipelineSpec(
        pipeline_parallel=plan.pipeline_parallel,
        chunks=plan.chunks,
        micro_batches=plan.micro_batches,
        schedule=plan.schedule,
    ).pipeline_schedule
    cells = plan.virtual_stages()
    at_cell = [
        [cells[schedule.stage_index(stage, chunk)] for stage in range(plan.pipeline_parallel)]
        for chunk in range(plan.chunks)
    ]
    return {
        name: [[sum(layer.is_body and layer.recompute in modes for layer in cell) for cell in row] for row in at_cell]
        for name, modes in (("layers", RECOMPUTE_MODES), ("full", ("full",)), ("selected", ("full", "selective")))
    }


def check_written(case: Case, before: bytes, after: bytes, plan) -> None:
    text = after.decode("utf-8")
    data = yaml.safe_load(text)
    for path, value in case.expected.items():
        assert at(data, path) == value and type(at(data, path)) is type(value), path
    round_trip = YAML(typ="rt").load(text)  # ruamel reads it too, aliases and all
    for path, value in case.expected.items():
        assert at(round_trip, path) == value, path
    assert layer_setting(data, plan) == plan_cells(plan)
    old = before.decode("utf-8")
    for anchor in re.findall(r"&(\w+)", old):  # every anchor still defined, every alias still an alias
        assert text.count(f"&{anchor}") == old.count(f"&{anchor}") and text.count(f"*{anchor}") == old.count(
            f"*{anchor}"
        )
    comments = [line.split("#", 1)[1] for line in old.splitlines() if "#" in line and not PLAN_KEYS.search(line)]
    assert all(comment in text for comment in comments)
    changed = [line for line in difflib.ndiff(old.splitlines(), text.splitlines()) if line[:2] in ("- ", "+ ")]
    assert changed and all(PLAN_KEYS.search(line) for line in changed), changed
    endings = re.findall(r"\r?\n", text)
    assert len(set(endings)) == 1 and endings[0] == ("\r\n" if b"\r\n" in before else "\n")  # the file's own


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_fixture_takes_its_plan(tmp_path, case):
    path = copied(tmp_path, case.file, case.prepare)
    path.chmod(0o640)
    before = path.read_bytes()
    plan = layout(**case.plan)
    result = write_config("mindformers", path, plan)
    assert result.written == [str(path)] and result.backup.read_bytes() == before
    assert path.stat().st_mode & 0o777 == 0o640
    for words in case.notes:
        assert any(words in note for note in result.notes), (words, result.notes)
    check_written(case, before, path.read_bytes(), plan)
    again = write_config("mindformers", path, plan)  # the plan is there: nothing to change
    assert again.diff == "" and again.written == []


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_sapp_hook_apply_writes_every_fixture(tmp_path, capsys, case):
    path = copied(tmp_path, case.file, case.prepare)
    before = path.read_bytes()
    plan = layout(**case.plan)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.plan_data))
    argv = ["apply", "--plan", str(plan_file), "--target", "mindformers", "--config", str(path)]
    assert main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith(f"--- {path} (before)") and path.read_bytes() == before
    assert main([*argv, "--quiet"]) == 0
    check_written(case, before, path.read_bytes(), plan)
    written = path.read_bytes()
    path.write_bytes(before)
    write_config("mindformers", path, plan)
    assert path.read_bytes() == written  # the CLI writes what the API writes


def refused(path: Path, plan, words: str, field: str = "--plan") -> InputError:
    before = path.read_bytes()
    with pytest.raises(InputError) as caught:
        write_config("mindformers", path, plan)
    assert caught.value.field == field and words in caught.value.detail, caught.value
    assert path.read_bytes() == before and not path.with_name(path.name + ".sapp-hook.bak").exists()
    return caught.value


def test_a_sequence_scheduler_that_runs_the_plan_stays(tmp_path):
    """deepseek3_mcore_seqpipe.yaml as shipped (seqpipe, no seq_split_num): MindSpore runs its 8 x 2 chunks on 32
    micro-batches in Megatron's interleaved order, so the plan goes in with the scheduler as it was."""
    path = tmp_path / "deepseek3_mcore_seqpipe.yaml"
    shutil.copy(FIXTURES / path.name, path)
    plan = layout([3] + [4] * 14 + [3], chunks=2, schedule="Interleaved1F1B", mtp=1, micro_batches=32)
    result = write_config("mindformers", path, plan)
    data = yaml.safe_load(path.read_text())
    assert data["parallel"]["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": "seqpipe"}
    assert layer_setting(data, plan) == plan_cells(plan)
    assert any("seqpipe kept" in note for note in result.notes)


@pytest.mark.parametrize(
    ("prepare", "plan", "words"),
    [
        (
            ("  micro_batch_num: 4\n", "  micro_batch_num: 4\n  seq_split_num: 4\n"),
            dict(counts=[32, 32], micro_batches=4),
            "'seqpipe', with seq_split_num 4, MindSpore's sequence-pipeline order",
        ),
        (
            None,
            dict(counts=[16] * 4, chunks=2, schedule="Interleaved1F1B", micro_batches=5),
            "'seqpipe', MindSpore's sequence-pipeline order, which sapp-hook plans only without a sequence split",
        ),
        (
            None,
            dict(counts=[16] * 4, chunks=2, schedule="Interleaved1F1B-less-memory", micro_batches=4),
            "'seqpipe', MindSpore's sequence-pipeline order",
        ),
        (("'seqpipe'", "seqvpp"), dict(counts=[32, 32], micro_batches=4), "'seqvpp', MindSpore's interleaved sequence"),
        (
            ("'seqpipe'", "seqsmartvpp"),
            dict(counts=[16] * 4, chunks=2, schedule="Interleaved1F1B", micro_batches=4),
            "'seqsmartvpp', MindSpore's small-memory interleaved sequence-pipeline order",
        ),
    ],
)
def test_a_sequence_scheduler_that_would_not_run_the_plan_is_refused(tmp_path, capsys, prepare, plan, words):
    """A sequence split, micro-batches the stages do not divide, or another order than the scheduler's: refused
    with what to set, the file byte-identical, one line from the CLI."""
    path = copied(tmp_path, "telechat3_36b_seqpipe.yaml", prepare)
    plan = layout(**plan)
    error = refused(path, plan, words)
    assert error.detail.endswith("set parallel.pipeline_config.pipeline_scheduler to 1f1b to run this plan")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.plan_data))
    with pytest.raises(SystemExit) as caught:
        main(["apply", "--plan", str(plan_file), "--target", "mindformers", "--config", str(path)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and err.startswith("sapp-hook apply: error: --plan: is for ")


@pytest.mark.parametrize(
    ("file", "old", "new", "plan", "words"),
    [
        (
            "pp_interleave_48_layers.yaml",
            "'1f1b'",
            "'seqsmartvpp'",
            dict(counts=PP48_COUNTS, chunks=2, schedule="Interleaved1F1B", micro_batches=10),
            "'seqsmartvpp', MindSpore's small-memory interleaved",
        ),
        (
            "template_v2_qwen3.yaml",
            '"1f1b"',
            '"zero_bubble_v"',
            dict(counts=QWEN_COUNTS, micro_batches=8),
            (
                "'zero_bubble_v', the order of a ZBVZeroBubble plan: solve with --schedule ZBVZeroBubble --chunks 2, or set "
                "distribute_parallel_config.pipeline_parallel_config.pipeline_scheduler to 1f1b to run this plan"
            ),
        ),
        (
            "llama2_13b_select_ops.yaml",
            '"1f1b"',
            '"1F1B"',
            dict(counts=[19, 21], micro_batches=128),
            "'1F1B', which MindSpore does not know",
        ),
        (
            "qwen3_32b_pretrain.yaml",
            "",
            "",
            dict(counts=[16, 16, 16, 16], schedule="ZBH1"),
            "is for ZBH1, an order MindFormers does not run",
        ),
        (
            "qwen3_32b_pretrain.yaml",
            "",
            "",
            dict(counts=[8] * 8, chunks=2, schedule="DualPipeV", micro_batches=8),
            "is for DualPipeV, an order MindFormers does not run",
        ),
    ],
)
def test_schedules_mindformers_would_not_run_as_planned(tmp_path, file, old, new, plan, words):
    path = tmp_path / file
    path.write_bytes((FIXTURES / file).read_bytes().replace(old.encode(), new.encode()))
    refused(path, layout(**plan), words)


BOMB = "lol: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"lol{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda text: text + BOMB, "its aliases expand it by more than 100,000 nodes (line 87): an alias bomb?"),
        (
            lambda text: text.replace("    offset: [-1, -1, 1, 1]\n", "    offset: [-1, -1, 1, 1]\n    offset: 0\n"),
            "line 74: key 'offset' repeats the one on line 73; expected each key once in a mapping",
        ),
        (lambda text: text + "loop: &loop [1, *loop]\n", "line 84: an alias refers to a node from inside it"),
        (lambda text: text + "hook: !!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
        (lambda text: text.replace("*dp", "*nowhere", 1), "found undefined alias 'nowhere'"),
    ],
)
def test_hostile_or_broken_yaml_is_one_clear_error(tmp_path, capsys, edit, words):
    path = tmp_path / "qwen3_32b_pretrain.yaml"
    path.write_text(edit((FIXTURES / path.name).read_text()))
    refused(path, layout(QWEN_COUNTS, micro_batches=8), words, field="--config")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(layout(QWEN_COUNTS, micro_batches=8).plan_data))
    with pytest.raises(SystemExit):
        main(["apply", "--plan", str(plan_file), "--target", "mindformers", "--config", str(path)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"sapp-hook apply: error: --config: {path}")


@pytest.mark.parametrize(
    ("file", "old", "new", "plan", "words"),
    [
        (
            "deepseek3_12b_pp16.yaml",
            "num_nextn_predict_layers: 1",
            "num_nextn_predict_layers: 2",
            dict(counts=[1] * 7 + [2, 2] + [1] * 6 + [0], mtp=1, micro_batches=16),
            "places 17 decoder layers; {path} has model.model_config.num_hidden_layers 16 + num_nextn_predict_layers 2",
        ),
        (
            "deepseek3_671b_pretrain.yaml",
            "",
            "",
            dict(counts=DEEPSEEK_COUNTS, mtp=2, micro_batches=32),
            "places 2 multi-token-prediction layers (body:mtp); {path} has 1 (model.model_config.mtp_depth)",
        ),
        (
            "template_v2_deepseek3_mtp.yaml",
            "  num_nextn_predict_layers: 1\n",
            "",
            dict(counts=DEEPSEEK_COUNTS, mtp=1, micro_batches=32),
            "places 62 decoder layers; {path} has model_config.num_hidden_layers 61",
        ),
    ],
)
def test_layer_counts_are_checked_as_mindformers_counts_them(tmp_path, file, old, new, plan, words):
    path = tmp_path / file
    path.write_bytes((FIXTURES / file).read_bytes().replace(old.encode(), new.encode()))
    refused(path, layout(**plan), words.format(path=path))


MODEL = "model:\n  model_config:\n    num_layers: 4\n    offset: 0\n"
SPLIT = "model:\n  model_config:\n    num_layers: 4\n    offset: [-1, 1]\n"  # the plans' [1, 3] split written
PLAIN, FULL_GPIPE = (
    dict(counts=[1, 3], micro_batches=8),
    dict(counts=[1, 3], micro_batches=8, full=[0, 2], schedule="GPipe"),
)


@pytest.mark.parametrize(
    ("text", "plan", "expected", "note"),
    [
        # the edited key's anchor is used under another name: the anchor moves to that use, which keeps its value
        (
            "parallel_config:\n  pipeline_stage: 2\n  micro_batch_num: &mbn 4  # per step\nrunner_config:\n"
            "  gradient_accumulation_steps: *mbn\n" + MODEL,
            PLAIN,
            "parallel_config:\n  pipeline_stage: 2\n  micro_batch_num: 8  # per step\nrunner_config:\n"
            "  gradient_accumulation_steps: &mbn 4\n" + SPLIT,
            "parallel_config.micro_batch_num shared &mbn with runner_config.gradient_accumulation_steps",
        ),
        # the edited key aliases another's anchor: it gets its own value
        (
            (
                "seed: &zero 0\nparallel_config: {pipeline_stage: 2, micro_batch_num: 8}\nmodel:\n  model_config:\n"
                "    num_layers: 4\n    offset: *zero\n"
            ),
            PLAIN,
            "seed: &zero 0\nparallel_config: {pipeline_stage: 2, micro_batch_num: 8}\n" + SPLIT,
            "model.model_config.offset shared &zero with seed",
        ),
        # a block list with a comment on its key's line; a section created where none was; capitalised booleans
        (
            "parallel_config:\n  pipeline_stage: 2\n  micro_batch_num: 8\n  vocab_emb_dp: True\nrecompute_config:\n"
            "  recompute:  # per stage\n    - 1\n    - 0\n" + MODEL,
            FULL_GPIPE,
            "parallel_config:\n  pipeline_stage: 2\n  micro_batch_num: 8\n  vocab_emb_dp: True\nrecompute_config:\n"
            "  recompute:  # per stage\n    [0, 2]\n"
            + SPLIT
            + "parallel:\n  pipeline_config:\n    pipeline_interleave: False\n    pipeline_scheduler: gpipe\n",
            None,
        ),
        # sections left empty (`key:`, `~`) get their keys as flow mappings
        (
            "parallel_config:\n  pipeline_stage: 2\n  micro_batch_num: 8\nparallel:\n  pipeline_config:\n"
            "recompute_config: ~  # none yet\n" + MODEL,
            FULL_GPIPE,
            "parallel_config:\n  pipeline_stage: 2\n  micro_batch_num: 8\nparallel:\n"
            "  pipeline_config: {pipeline_interleave: false, pipeline_scheduler: gpipe}\n"
            "recompute_config: {recompute: [0, 2]}  # none yet\n" + SPLIT,
            None,
        ),
        # a UTF-8 byte-order mark and a flow mapping at the top
        (
            "\ufeffparallel_config: {pipeline_stage: 2}\n" + MODEL,
            PLAIN,
            "\ufeffparallel_config: {pipeline_stage: 2, micro_batch_num: 8}\n" + SPLIT,
            "micro_batch_num unset (1) -> 8",
        ),
    ],
)
def test_anchors_blocks_and_new_sections_are_written_where_the_user_would(tmp_path, text, plan, expected, note):
    path = tmp_path / "train.yaml"
    path.write_text(text, encoding="utf-8")
    result = write_config("mindformers", path, layout(**plan))
    assert path.read_text(encoding="utf-8") == expected
    assert note is None or any(note in line for line in result.notes), result.notes


def test_a_section_from_a_merge_is_not_written_into(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "base: &base\n  model_config: {num_layers: 4, offset: 0}\nmodel:\n  <<: *base\n"
        "parallel_config: {pipeline_stage: 2, micro_batch_num: 8}\n"
    )
    refused(
        path,
        layout(**PLAIN),
        "model.model_config comes from a merge (<<:); sapp-hook writes "
        "model.model_config.offset only into a section the file writes out",
        "--config",
    )


def test_a_fifty_deep_chain_of_merges_is_edited_where_it_is_used(tmp_path):
    """Each mapping merges the one before it: the plan's micro_batch_num overrides the chain's 49 in
    parallel_config itself, and the chain is left as written."""
    from basics.documents import read_yaml

    chain = "d0: &d0 {pipeline_stage: 2, micro_batch_num: 0, vocab_emb_dp: true}\n" + "".join(
        f"d{n}: &d{n} {{<<: *d{n - 1}, micro_batch_num: {n}}}\n" for n in range(1, 50)
    )
    path = tmp_path / "train.yaml"
    path.write_text(chain + "parallel_config:\n  <<: *d49\n  use_seq_parallel: false\n" + MODEL)
    result = write_config("mindformers", path, layout(**PLAIN))
    assert path.read_text() == (
        chain + "parallel_config:\n  <<: *d49\n  use_seq_parallel: false\n  micro_batch_num: 8\n" + SPLIT
    )
    data = read_yaml(path, "--config")
    assert data["parallel_config"] == {
        "pipeline_stage": 2,
        "micro_batch_num": 8,
        "vocab_emb_dp": True,
        "use_seq_parallel": False,
    }
    assert data["d49"]["micro_batch_num"] == 49
    assert "parallel_config.micro_batch_num came from a merge (<<:)" in " ".join(result.notes)


def test_a_failure_while_writing_leaves_the_config_byte_identical(tmp_path, monkeypatch):
    path = copied(tmp_path, "llama2_70b_pretrain_crlf.yaml")
    before = path.read_bytes()

    def broken_rename(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_rename)
    with pytest.raises(InputError, match="left as it was"):
        write_config("mindformers", path, layout([9] + [10] * 6 + [11], micro_batches=256))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".bak")) == [path.name]


def test_a_comment_set_in_a_column_stays_in_it(tmp_path):
    """llm_pretrain_moe_template.yaml aligns its end-of-line comments; a value written longer or shorter than the
    one it replaces takes its room from the spaces before the comment, not the comment's column."""
    path = copied(tmp_path, "llm_pretrain_moe_template.yaml")
    before = path.read_text()
    write_config("mindformers", path, layout([5, 3, 4, 4], micro_batches=8, full=[2, 1, 0, 0]))
    columns = {line.split(":")[0].strip(): line.index("#") for line in before.splitlines() if "  #" in line}
    changed = [line for line in path.read_text().splitlines() if line not in before.splitlines() and "  #" in line]
    assert {line.split(":")[0].strip() for line in changed} >= {"offset", "recompute", "micro_batch_num"}
    for line in changed:
        assert line.index("#") == columns[line.split(":")[0].strip()], line


def test_simulate_reads_a_shipped_config_with_aliases(tmp_path, capsys):
    """`simulate --mindformers-plan` takes the keys from a config with anchors and aliases, as MindFormers reads them."""
    from solver_cases import small_profile

    profile = tmp_path / "profile.json"
    small_profile(8).save(profile)
    config = copied(tmp_path, "qwen3_32b_pretrain.yaml")
    config.write_text(
        config.read_text()
        .replace("num_hidden_layers: 64", "num_hidden_layers: 8")
        .replace("offset: [-1, -1, 1, 1]", "offset: [-1, 0, 0, 1]")
    )
    argv = [
        "simulate",
        "--profile",
        str(profile),
        "--pipeline-parallel",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "1F1B",
        "--mindformers-plan",
        str(config),
        "--json",
    ]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    # recompute: True is every layer; select_recompute: False selects nothing more (was refused: "below recompute")
    assert plan["offset"] == [-1, 0, 0, 1] and plan["recompute"] == plan["select_recompute"] == [1, 2, 2, 3]


def test_simulate_reads_lists_per_stage_under_chunks_as_mindformers_does(tmp_path, capsys):
    """telechat3 with 2 chunks per stage and its offsets and full recompute per stage: MindFormers takes the offsets
    for every chunk and hands each stage's count out over its chunks one layer at a time; `simulate
    --mindformers-plan` reads them so (it refused lists per stage under chunks)."""
    from solver_cases import small_profile

    profile = tmp_path / "profile.json"
    small_profile(8).save(profile)
    config = copied(tmp_path, "telechat3_36b_seqpipe.yaml", ("num_hidden_layers: 64", "num_hidden_layers: 8"))
    config.write_text(
        config.read_text()
        .replace("offset: 0", "offset: [1, -1]")
        .replace("recompute: [[14, 14], [14, 14]]", "recompute: [3, 1]")
    )
    argv = [
        "simulate",
        "--profile",
        str(profile),
        "--pipeline-parallel",
        "2",
        "--chunks",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        "Interleaved1F1B",
        "--mindformers-plan",
        str(config),
        "--json",
    ]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["offset"] == [[1, -1], [1, -1]] and plan["recompute"] == [[2, 1], [1, 0]]


@st.composite
def plans_for(draw, body: int, stages: int, chunks: int, mtp: int = 0):
    """A plan of `body` layers over stages x chunks, each virtual stage holding one or more, with any full and
    selective recompute."""
    cuts = sorted(
        draw(
            st.lists(st.integers(1, body - 1), min_size=stages * chunks - 1, max_size=stages * chunks - 1, unique=True)
        )
    )
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, body])]
    full = [draw(st.integers(0, count)) for count in counts]
    selective = [draw(st.integers(0, count - f)) for count, f in zip(counts, full)]
    schedule = "Interleaved1F1B" if chunks > 1 else "1F1B"
    return layout(
        counts, chunks=chunks, schedule=schedule, micro_batches=stages * 2, mtp=mtp, full=full, selective=selective
    )


@pytest.mark.parametrize(
    ("file", "body", "stages", "chunks", "mtp", "micro_batches"),
    [
        ("pp_interleave_48_layers.yaml", 48, 5, 2, 0, 10),
        ("llama2_13b_select_ops.yaml", 40, 2, 1, 0, 128),
        ("deepseek3_671b_pretrain.yaml", 62, 16, 1, 1, 32),
        ("llama2_70b_pretrain_crlf.yaml", 80, 8, 1, 0, 256),
        ("template_v2_deepseek3_mtp.yaml", 62, 16, 1, 1, 32),
    ],
)
def test_any_plan_reads_back_as_planned(tmp_path, file, body, stages, chunks, mtp, micro_batches):
    """Any split and recompute, written into a shipped config's shape, is what MindFormers reads back."""

    @settings(max_examples=25, deadline=None)
    @given(plans_for(body, stages, chunks, mtp))
    def check(plan):
        plan = layout_from_dict({**plan.plan_data, "spec": {**plan.plan_data["spec"], "micro_batches": micro_batches}})
        path = tmp_path / file
        path.write_bytes((FIXTURES / file).read_bytes())
        write_config("mindformers", path, plan)
        assert layer_setting(yaml.safe_load(path.read_text(encoding="utf-8")), plan) == plan_cells(plan)

    check()


def test_a_pynative_trainer_config_is_refused_saying_why(tmp_path):
    """MindFormers' pynative trainer (configs/deepseek3/pretrain_deepseek3_1b_8p_pynative.yaml) keeps its split
    in parallelism.pipeline_parallel_layers_per_stage, typed List[List[int]] in some versions of its config.py
    and per-rank 'start-end' strings in others (pipeline_parallel.py): the refusal says so, not that the file
    lacks model.model_config."""
    path = tmp_path / "pretrain_pynative.yaml"
    text = (
        "training:\n  local_batch_size: 1\n  global_batch_size: 8\n"
        'parallelism:\n  pipeline_parallel: 1\n  pipeline_parallel_schedule: "1f1b"\n'
        "  pipeline_parallel_layers_per_stage: null\n"
        "model:\n  model_type: deepseek_v3\n  num_hidden_layers: 8\n"
    )
    path.write_text(text)
    with pytest.raises(InputError, match=r"is a config of MindFormers' pynative trainer .* does not write it"):
        write_config("mindformers", path, layout([2, 2, 2, 2]))
    assert path.read_text() == text
