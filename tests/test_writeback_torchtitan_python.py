"""What the TorchTitan Python-config editor refuses, naming the construct, and the check of what it writes:
splats, positional arguments and configs built by calls it cannot follow, functions defined conditionally,
and keywords given twice or beside a `**splat` after the edit. Each refused config is left byte-identical."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_writeback_torchtitan import PARTS_OUTPUT, plan

from sapp_hook.writeback import layout_of, write_config
from sapp_hook.writeback.torchtitan import python_config
from sapp_hook.writeback.torchtitan.python_rules import check_written
from simulator import InputError

HEADER = (
    "from torchtitan.config import ActivationCheckpointConfig, ParallelismConfig, TrainingConfig\n"
    "from torchtitan.trainer import Trainer\n\n"
)
PARALLELISM = "ParallelismConfig(pipeline_parallel_degree=2)"
TRAINING = "training=TrainingConfig(local_batch_size=8)"
CHECKPOINT = 'activation_checkpoint=ActivationCheckpointConfig(mode="none")'
# nothing here names the head module: the last part lists both names, of which the model has one
PARTS = [*PARTS_OUTPUT[:3], ["layers.7", "norm", "output", "lm_head"]]


def job(body: str) -> str:
    return HEADER + body


def one(call: str) -> str:
    """A config function `llama3_pp` that returns `call`."""
    return job(f"\ndef llama3_pp() -> Trainer.Config:\n    return {call}\n")


REFUSED = {
    # the case: PP holds the pipeline keys; writing them beside **PP raises TypeError at launch
    "double_splat_in_parallelism": (
        job(
            'PP = {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B"}\n\n\n'
            "def llama3_pp() -> Trainer.Config:\n"
            f"    return Trainer.Config({TRAINING}, parallelism=ParallelismConfig(**PP), {CHECKPOINT})\n"
        ),
        (
            r"llama3_pp: ParallelismConfig\(\*\*PP\) \(line 8\) passes \*\*PP, which sapp-hook cannot see into "
            r"and which may set the pipeline fields it writes: write those fields as keywords"
        ),
    ),
    "star_args_in_parallelism": (
        one(f"Trainer.Config({TRAINING}, parallelism=ParallelismConfig(*DEGREES), {CHECKPOINT})"),
        r"ParallelismConfig\(\*DEGREES\) \(line 6\) passes \*DEGREES, which sapp-hook cannot see into",
    ),
    "positional_in_parallelism": (
        one(f"Trainer.Config({TRAINING}, parallelism=ParallelismConfig(1, pipeline_parallel_degree=2), {CHECKPOINT})"),
        r"passes a positional argument \(1\), which sapp-hook cannot see into",
    ),
    "star_args_in_the_returned_config": (
        one(f"Trainer.Config(*SECTIONS, {TRAINING})"),
        (
            r"Trainer.Config\(\*SECTIONS, .*\(line 6\) passes \*SECTIONS, which sapp-hook cannot see into and which "
            r"may set the parallelism it adds"
        ),
    ),
    "dict_comprehension_in_the_returned_config": (
        one(f"Trainer.Config({TRAINING}, **{{k: v for k, v in SECTIONS.items()}})"),
        (
            r"passes \*\*\{k: v for k, v in SECTIONS.items\(\)\}, which sapp-hook cannot see into and which may set "
            r"the parallelism it adds"
        ),
    ),
    "helper_call_returned": (
        one(f"make_config({TRAINING}, parallelism={PARALLELISM})"),
        (
            r"llama3_pp returns make_config\(.*\(line 6\): a config built by a call sapp-hook cannot follow; "
            r"expected `return Trainer.Config\(...\)`"
        ),
    ),
    "config_from_getattr": (
        job(
            "\ndef llama3_pp() -> Trainer.Config:\n"
            '    config = getattr(registry, "llama3_8b")()\n'
            "    config.parallelism.pipeline_parallel_degree = 2\n"
            "    return config\n"
        ),
        (
            r"llama3_pp returns config from getattr\(registry, 'llama3_8b'\)\(\) \(line 6\): a config built "
            r"dynamically, which sapp-hook cannot follow"
        ),
    ),
    "config_from_a_subscript": (
        job("\ndef llama3_pp() -> Trainer.Config:\n    config = CONFIGS['8b']\n    return config\n"),
        r"llama3_pp returns config from CONFIGS\['8b'\] \(line 6\): a config built dynamically",
    ),
    "two_returns": (
        job(
            "\ndef llama3_pp() -> Trainer.Config:\n"
            "    if LONG:\n"
            f"        return Trainer.Config({TRAINING}, parallelism={PARALLELISM})\n"
            f"    return Trainer.Config({TRAINING}, parallelism={PARALLELISM})\n"
        ),
        r"llama3_pp returns in 2 places \(lines 7, 8\): sapp-hook edits a config function with one return",
    ),
    "splat_in_the_base_functions_parallelism": (
        job(
            'PP = {"pipeline_parallel_layers_per_stage": 4}\n\n\n'
            "def llama3_base() -> Trainer.Config:\n"
            f"    return Trainer.Config({TRAINING}, parallelism=ParallelismConfig(**PP))\n\n\n"
            "def llama3_pp() -> Trainer.Config:\n"
            "    config = llama3_base()\n"
            "    config.parallelism.pipeline_parallel_degree = 2\n"
            "    return config\n"
        ),
        r"llama3_pp: ParallelismConfig\(\*\*PP\) \(line 8\) passes \*\*PP",
    ),
    "splat_where_the_local_batch_is_read": (
        one(f"Trainer.Config(training=TrainingConfig(**TRAIN), parallelism={PARALLELISM}, {CHECKPOINT})"),
        (
            r"TrainingConfig\(\*\*TRAIN\) \(line 6\) passes \*\*TRAIN, which sapp-hook cannot see into and which may "
            r"set the training.local_batch_size it reads"
        ),
    ),
    "splat_in_the_checkpointing": (
        one(
            f"Trainer.Config({TRAINING}, parallelism={PARALLELISM}, activation_checkpoint=ActivationCheckpointConfig(**AC))"
        ),
        (
            r"ActivationCheckpointConfig\(\*\*AC\) \(line 6\) passes \*\*AC, which sapp-hook cannot see into and "
            r"which may set the checkpointing fields it writes"
        ),
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_editor_cannot_follow_is_refused_naming_the_construct(tmp_path, case):
    text, message = REFUSED[case]
    path = tmp_path / "job.py"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as caught:
        write_config("torchtitan", f"{path}:llama3_pp", layout_of(plan()))
    assert caught.value.field == "--config"
    assert path.read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == ["job.py"]


CONDITIONAL = {
    "if_else": (
        "if LONG:\n{def}else:\n{def}",
        "inside an if/else at line 8",
    ),
    "try": ("try:\n    import extra\nexcept ImportError:\n{def}", "inside a try block at line 7"),
    "for": ("for size in SIZES:\n{def}", "inside a for loop at line 5"),
    "with": ("with suppress(ImportError):\n{def}", "inside a with block at line 5"),
}
INDENTED = (
    "    def llama3_pp() -> Trainer.Config:\n"
    f"        return Trainer.Config({TRAINING}, parallelism={PARALLELISM}, {CHECKPOINT})\n"
)


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("case", CONDITIONAL)
def test_a_function_defined_conditionally_is_refused_as_such(tmp_path, case, named):
    shape, said = CONDITIONAL[case]
    text = job(shape.replace("{def}", INDENTED))
    path = tmp_path / "job.py"
    path.write_text(text)
    with pytest.raises(
        InputError,
        match=f"defines llama3_pp conditionally, {said}: sapp-hook edits only config "
        "functions defined once at module level",
    ):
        write_config("torchtitan", f"{path}:llama3_pp" if named else path, layout_of(plan()))
    assert path.read_text() == text


def test_a_module_level_function_redefined_conditionally_after_it_is_refused(tmp_path):
    plain = INDENTED.replace("\n    ", "\n").removeprefix("    ")
    text = job(plain + "\n\nif LONG:\n" + INDENTED)
    path = tmp_path / "job.py"
    path.write_text(text)
    with pytest.raises(
        InputError,
        match=r"inside an if/else at line 9 \(and at module level, line 4, which it "
        r"replaces when that code runs\)",
    ):
        write_config("torchtitan", f"{path}:llama3_pp", layout_of(plan()))
    assert path.read_text() == text


def test_a_module_level_definition_after_a_conditional_one_is_the_one_edited(tmp_path):
    """Python binds the name to the later, unconditional def whatever the branch: that one is edited exactly."""
    plain = INDENTED.replace("\n    ", "\n").removeprefix("    ")
    path = tmp_path / "job.py"
    path.write_text(job("if LONG:\n" + INDENTED + "\n\n" + plain))
    write_config("torchtitan", f"{path}:llama3_pp", layout_of(plan()))
    tree = ast.parse(path.read_text())
    conditional, last = tree.body[2].body[0], tree.body[3]
    assert ast.unparse(conditional) == ast.unparse(ast.parse(INDENTED.replace("\n    ", "\n").strip()).body[0])
    keywords = {kw.arg: kw.value for kw in last.body[0].value.keywords}
    parallelism = {kw.arg: ast.literal_eval(kw.value) for kw in keywords["parallelism"].keywords}
    assert parallelism["pipeline_parallel_degree"] == 4
    assert parallelism["module_fqns_per_model_part"] == PARTS


def test_a_splat_beside_the_sections_the_plan_edits_is_kept(tmp_path):
    """The returned config's `**EXTRA` beside explicit parallelism and checkpointing: those keywords are edited
    in place and none is added, so no field can be passed twice."""
    path = tmp_path / "job.py"
    path.write_text(one(f"Trainer.Config(**EXTRA, {TRAINING}, parallelism={PARALLELISM}, {CHECKPOINT})"))
    write_config("torchtitan", f"{path}:llama3_pp", layout_of(plan()))
    call = ast.parse(path.read_text()).body[-1].body[0].value
    assert [kw.arg for kw in call.keywords] == [None, "training", "parallelism", "activation_checkpoint"]
    parallelism = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords[2].value.keywords}
    assert parallelism == {
        "pipeline_parallel_degree": 4,
        "pipeline_parallel_schedule": "1F1B",
        "pipeline_parallel_microbatch_size": 1,
        "module_fqns_per_model_part": PARTS,
    }


def test_the_written_source_is_checked_even_where_the_checks_before_the_edit_miss(tmp_path, monkeypatch):
    """With the refusal of splats switched off, the issue's config gets its keywords beside **PP: the check of
    the written source finds them and the file stays as it was."""
    monkeypatch.setattr(python_config, "check_explicit", lambda *args: None)
    text, _ = REFUSED["double_splat_in_parallelism"]
    path = tmp_path / "job.py"
    path.write_text(text)
    with pytest.raises(
        InputError,
        match=r"llama3_pp would pass module_fqns_per_model_part to ParallelismConfig beside \*\*PP, which may "
        r"hold it, after the write; it was left as it was",
    ):
        write_config("torchtitan", f"{path}:llama3_pp", layout_of(plan()))
    assert path.read_text() == text


@pytest.mark.parametrize(
    ("after", "message"),
    [
        (
            "def f():\n    return C(parallelism=P(degree=2, degree=4))\n",
            r"f would pass degree twice to P \(line 2\) after the write",
        ),
        (
            "def f():\n    return C(parallelism=P(**PP, degree=4))\n",
            r"f would pass degree to P beside \*\*PP, which may hold it, after the write",
        ),
        ("def f():\n    return C(x)\n    nonlocal y\n", "would not compile after the write"),
    ],
)
def test_the_check_of_written_source(after, message):
    before = ast.parse("def f():\n    return C(parallelism=P(**PP))\n").body[0]
    with pytest.raises(InputError, match=message):
        check_written(before, ast.parse(after).body[0], after, Path("job.py"), "f")
    kept = "def f():\n    return C(**EXTRA, parallelism=P(**PP))\n"  # the user's own splats, nothing added
    check_written(ast.parse(kept).body[0], ast.parse(kept).body[0], kept, Path("job.py"), "f")
