"""A corpus of bad inputs, odd files and faults, each met as a user meets it: one table of cases (the
command, its inputs, the exit status expected and the flag, field or file its one error line names).

Every row: no traceback; exactly one line from sapp-hook itself (`sapp-hook CMD: error: ...`, or
`... interrupted` / `terminated`) naming what it must, none where the command succeeds; the status
expected; and where the case refuses or is stopped, every file in its folder byte for byte as it was and
no temp file left. Rows run in this process through `sapp_hook.cli.main` unless a signal, a standard
stream or a privilege is involved (`process` rows), or they call the Python API (`api` rows).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from solver_cases import SAPP, small_profile

from basics.errors import InputError, Terminated
from sapp_hook.cli import main
from sapp_hook.writeback import write_config
from sapp_hook.writeback.layout import even_layout
from simulator import PipelineCosts, build_schedule, simulate
from solver import PipelineSpec, load_profile, plan_from_dict, plan_from_mindformers, solve

ROOT = Path(__file__).parents[1]
TEMPLATES = ROOT / "sapp_hook" / "templates"
EXIT_OUTPUT, EXIT_INPUT, EXIT_NO_PLAN, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_HUNG_UP = 1, 2, 3, 130, 143, 129
SOLVE = [
    "solve",
    "--profile",
    "{profile}",
    "--pipeline-parallel",
    "4",
    "--micro-batches",
    "8",
    "--schedule",
    "1F1B",
    "--memory",
    "1TB",
]
SIMULATE = [
    "simulate",
    "--schedule",
    "1F1B",
    "--pipeline-parallel",
    "4",
    "--micro-batches",
    "8",
    "--forward",
    "1",
    "--backward",
    "2",
]
# A search that runs for minutes (SAPP's 194 layers, 16 x 3 x 16) and says when it starts
LONG_SOLVE = [
    "solve",
    "--profile",
    str(SAPP / "sim.json"),
    "--pipeline-parallel",
    "16",
    "--chunks",
    "3",
    "--micro-batches",
    "16",
    "--schedule",
    "Interleaved1F1B-less-memory",
    "--memory",
    "1TB",
    "--time-limit",
    "inf",
]


# -- the inputs, made on demand in the case's folder ------------------------------------------------------------


def _plan(folder: Path) -> Path:
    profile = _input(folder, "profile")
    plan = folder / "plan.json"
    argv = [a.replace("{profile}", str(profile)) for a in SOLVE] + ["--plan-out", str(plan), "--quiet"]
    assert main(argv) == 0
    return plan


def _profile_with(folder: Path, name: str, change: Callable[[dict], None]) -> Path:
    data = small_profile(8).to_dict()
    change(data)
    path = folder / name
    path.write_text(json.dumps(data))
    return path


def _crlf(template: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / f"crlf-{template}"
        path.write_bytes((TEMPLATES / template).read_bytes().replace(b"\n", b"\r\n"))
        return path

    return make


def _copy(template: str, name: str | None = None) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        return Path(shutil.copy(TEMPLATES / template, folder / (name or template)))

    return make


def _text(name: str, text: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_text(text)
        return path

    return make


def _device(name: str, minor: int) -> Callable[[Path], Path]:
    """A character device of our own (1, minor: 3 null, 5 zero, 7 full), never the real /dev nodes."""

    def make(folder: Path) -> Path:
        path = folder / name
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
        return path

    return make


def _fifo(folder: Path) -> Path:
    path = folder / "fifo"
    os.mkfifo(path)
    return path


def _link(name: str, to: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        target = _input(folder, to)
        (folder / "links").mkdir(exist_ok=True)
        path = folder / "links" / name
        path.symlink_to(os.path.relpath(target, path.parent))
        return path

    return make


def _read_only_config(folder: Path) -> Path:
    path = _copy("mindformers_llama.yaml", "read-only.yaml")(folder)
    path.chmod(0o444)
    return path


def _read_only_folder(folder: Path) -> Path:
    path = folder / "read-only"
    path.mkdir()
    shutil.copy(TEMPLATES / "mindformers_llama.yaml", path / "train.yaml")
    path.chmod(0o555)
    return path


def _plan_recomputing(folder: Path) -> Path:
    """A plan whose per-layer recompute TorchTitan cannot say: its write leaves a side file."""
    profile = _input(folder, "profile")
    plan = folder / "plan-recomputing.json"
    argv = [a.replace("{profile}", str(profile)) for a in SOLVE[:-1]] + ["300MiB", "--plan-out", str(plan), "--quiet"]
    assert main(argv) == 0
    assert any(layer["recompute"] != "none" for layer in json.loads(plan.read_text())["plan"]["layers"])
    return plan


def _read_only_file(name: str, text: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = _text(name, text)(folder)
        path.chmod(0o444)
        return path

    return make


def _folder(name: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        (folder / name).mkdir()
        return folder / name

    return make


def _with_bom(template: str, name: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(b"\xef\xbb\xbf" + (TEMPLATES / template).read_bytes())
        return path

    return make


MAKERS: dict[str, Callable[[Path], Path]] = {
    "profile": lambda folder: small_profile(8).save(folder / "profile.json") or folder / "profile.json",
    "plan": _plan,
    "yaml": _copy("mindformers_llama.yaml", "train.yaml"),
    "toml": _copy("torchtitan_llama.toml", "train.toml"),
    "script": _copy("megatron_llama.sh", "train.sh"),
    "earlier_plan": _text("plan.json", '{"status": "optimal", "spec": {}, "plan": {}}\n'),
    "earlier_csv": _text("schedule.csv", "0F0,0B0,,(0F1;1B0)OVERLAP_F_B\n1F0,1B0\n"),
    "bracketed_toml": _text("bracketed.toml", "[job]\ndump_folder = './outputs'\n"),
    "json_launch_config": _text("ds_config.json", '{"train_batch_size": 32, "zero_optimization": {"stage": 1}}\n'),
    "earlier_keys": _text("keys.yaml", "offset: [1, -1]\npp_interleave_num: 1\n"),
    "crlf_yaml": _crlf("mindformers_llama.yaml"),
    "crlf_toml": _crlf("torchtitan_llama.toml"),
    "malformed_json": _text("malformed.json", '{"schema_version": 1, "layers": [{"name": "embed",'),
    "nan_profile": lambda folder: _profile_with(
        folder, "nan.json", lambda data: data["layers"][1].update(forward_ms=float("nan"))
    ),
    "deep_json": _text("deep.json", "[" * 100_000 + "]" * 100_000),
    "huge_json": lambda folder: _sparse(folder / "huge.json", 65 * 2**20),
    "alias_bomb": _text(
        "bomb.yaml",
        "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\noffset: [*c, *c, *c, *c]\n",
    ),
    "python_tag": _text("tag.yaml", "offset: !!python/object/apply:os.system ['echo owned']\n"),
    "python_tag_config": _text(
        "tag-train.yaml",
        (TEMPLATES / "mindformers_llama.yaml").read_text() + "evil: !!python/object/apply:os.system ['echo owned']\n",
    ),
    "bad_toml": _text("bad.toml", "[parallelism\npipeline_parallel_degree = 4\n"),
    "not_a_plan": _text("not-a-plan.json", '{"layers": []}'),
    "zero": _device("zero", 5),
    "null": _device("null", 3),
    "fifo": _fifo,
    "link_to_null": _link("null-link", "null"),
    "link_yaml": _link("train.yaml", "yaml"),
    "read_only_config": _read_only_config,
    "read_only_folder": _read_only_folder,
    "deep_config": _text("deep-config.json", '{"a": ' * 50_000 + "1" + "}" * 50_000),
    "plan_recomputing": _plan_recomputing,
    "read_only_plan": _read_only_file("old-plan.json", "{}"),
    "backup_folder": _folder("train.yaml.sapp-hook.bak"),
    "side_file_folder": _folder("train.toml.sapp-hook.json"),
    "empty_yaml": _text("empty.yaml", "# nothing but a comment\n"),
    "layers_as_text": _text(
        "text-layers.yaml",
        (TEMPLATES / "mindformers_llama.yaml").read_text().replace("num_layers: 8", "num_layers: '8'"),
    ),
    "stages_as_text": _text(
        "text-stages.yaml",
        (TEMPLATES / "mindformers_llama.yaml").read_text().replace("pipeline_stage: 4", "pipeline_stage: '4'"),
    ),
    "bom_python": lambda folder: _python_config(folder, bom=True),
    "twice_python": lambda folder: _python_config(folder, twice=True),
    "bom_toml": _with_bom("torchtitan_llama.toml", "bom.toml"),
    "nan_constant_profile": lambda folder: _profile_with(
        folder, "nan-constant.json", lambda data: data.update(rank_constant_bytes=float("nan"))
    ),
    "huge_tied_profile": lambda folder: _profile_with(
        folder,
        "huge-tied.json",
        lambda data: data.update(tied_parameters=[{"names": ["w"], "layers": ["embed", "lm_head"], "bytes": 1e30}]),
    ),
    "bool_version_profile": lambda folder: _profile_with(
        folder, "bool-version.json", lambda data: data.update(schema_version=True)
    ),
    "sapp_overflow": _text(
        "sapp-overflow.json",
        json.dumps(
            {
                "layers_description": [
                    {"name": "H", "type": "HEAD", "time": 1},
                    {
                        "name": "B",
                        "type": "BODY",
                        "time": 1,
                        "nb_layer": 4,
                        "memory_activation": 1,
                        "memory_parameter": 1e305,
                    },
                    {"name": "T", "type": "TAIL", "time": 1},
                ]
            }
        ),
    ),
    "plan_offset_true": lambda folder: _changed_plan(folder, lambda data: data["plan"]["offset"].__setitem__(1, True)),
    # numbers past a float (JSON) or past Python's 4,300 decimal digits (0x... in YAML and TOML)
    "int_past_floats_profile": lambda folder: _profile_with(
        folder, "int-past-floats.json", lambda data: data["layers"][1].update(forward_ms=10**400)
    ),
    "tensors_past_floats_profile": lambda folder: _profile_with(
        folder, "tensors-past-floats.json", lambda data: data["layers"][1].update(parameter_tensors=10**400)
    ),
    "long_version_profile": lambda folder: _profile_with(
        folder, "long-version.json", lambda data: data.update(schema_version=4 * 10**4000)
    ),
    "digits_yaml": _text("digits.yaml", "offset: [" + "9" * 5000 + ", 1, 0, -1]\n"),
    "hex_layers_yaml": _text(
        "hex-layers.yaml",
        (TEMPLATES / "mindformers_llama.yaml").read_text().replace("num_layers: 8", "num_layers: 0x" + "f" * 5000),
    ),
    "hex_degree_toml": _text(
        "hex-degree.toml",
        (TEMPLATES / "torchtitan_llama.toml")
        .read_text()
        .replace("pipeline_parallel_degree = 4", "pipeline_parallel_degree = 0x" + "f" * 5000),
    ),
    "digits_script": _text(
        "digits.sh",
        (TEMPLATES / "megatron_llama.sh").read_text().replace("--num-layers 8", "--num-layers " + "9" * 5000),
    ),
    # TOML the TorchTitan writer met with a traceback, or rewrote into something else
    "dotted_toml": lambda folder: _dotted_parallelism(folder),
    "checkpointing_array_toml": _text(
        "checkpointing-array.toml",
        (TEMPLATES / "torchtitan_llama.toml")
        .read_text()
        .replace("[activation_checkpoint]", "[[activation_checkpoint]]")
        + '\n[[activation_checkpoint]]\nmode = "full"\n',
    ),
    # line endings: a CRLF Python config; a bash script of LF lines but one
    "crlf_python": lambda folder: _python_config(folder, crlf=True),
    "mostly_lf_script": lambda folder: _one_crlf(folder, "megatron_llama.sh"),
    "line_break_name_profile": lambda folder: _profile_with(
        folder, "line-break-name.json", lambda data: data["layers"][1].update(name="block\n0")
    ),
    # a plan JSON edited in one of its views only: apply and simulate must not read two plans
    "edited_split_plan": lambda folder: _changed_plan(
        folder, lambda data: data["plan"].update(virtual_stage_layers=[2, 4, 2, 2])
    ),
    "moved_layer_plan": lambda folder: _changed_plan(
        folder, lambda data: data["plan"]["layers"][2].update(virtual_stage=1)
    ),
    # the backup's and the side file's names, links to the config itself
    "backup_links_to_config": lambda folder: _beside(folder, "yaml", ".sapp-hook.bak"),
    "side_file_links_to_config": lambda folder: _beside(folder, "toml", ".sapp-hook.json"),
}


def _dotted_parallelism(folder: Path) -> Path:
    """The template's [parallelism] written as dotted keys (parallelism.x = ...) before its first table."""
    text = (TEMPLATES / "torchtitan_llama.toml").read_text()
    table = text[text.index("[parallelism]") : text.index("[activation_checkpoint]")]
    dotted = "".join(f"parallelism.{line}\n" for line in table.splitlines()[1:] if "=" in line)
    path = folder / "dotted.toml"
    path.write_text(dotted + text.replace(table, ""))
    return path


def _one_crlf(folder: Path, template: str) -> Path:
    """The template with its second line ending CRLF, the others LF."""
    lines = (TEMPLATES / template).read_bytes().split(b"\n")
    path = folder / f"one-crlf-{template}"
    path.write_bytes(b"\n".join(line + (b"\r" if index == 1 else b"") for index, line in enumerate(lines)))
    return path


def _beside(folder: Path, config: str, suffix: str) -> Path:
    """A link named as the config's backup or side file, to the config itself."""
    target = _input(folder, config)
    path = target.with_name(target.name + suffix)
    path.symlink_to(target.name)
    return path


def _python_config(folder: Path, *, bom: bool = False, twice: bool = False, crlf: bool = False) -> Path:
    """A TorchTitan Python config (one function, as pytorch/torchtitan's config_registry.py writes them)."""
    text = (ROOT / "tests" / "fixtures" / "torchtitan" / "my_llama_job.py").read_text()
    if twice:
        text += "\n\ndef llama3_pp():\n    return None\n"
    if crlf:
        text = text.replace("\n", "\r\n")
    path = folder / ("bom-job.py" if bom else "twice-job.py" if twice else "crlf-job.py")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


def _changed_plan(folder: Path, change: Callable[[dict], None]) -> Path:
    data = json.loads(_input(folder, "plan").read_text())
    change(data)
    path = folder / "changed-plan.json"
    path.write_text(json.dumps(data))
    return path


def _sparse(path: Path, size: int) -> Path:
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


_MADE: dict[Path, dict[str, Path]] = {}


def _expand(argv: list[str], folder: Path) -> list[str]:
    out = []
    for arg in argv:
        for name in MAKERS:
            if "{" + name + "}" in arg:
                arg = arg.replace("{" + name + "}", str(_input(folder, name)))
        out.append(arg.replace("{dir}", str(folder)))
    return out


def _input(folder: Path, name: str) -> Path:
    made = _MADE.setdefault(folder, {})
    if name not in made:
        made[name] = MAKERS[name](folder)
    return made[name]


def _snapshot(folder: Path) -> dict[str, object]:
    """Every entry under `folder`: a link's target, a device's numbers, a file's bytes."""
    seen: dict[str, object] = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            seen[str(path)] = ("link", os.readlink(path))
        elif stat.S_ISREG(info.st_mode):
            seen[str(path)] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
        else:
            seen[str(path)] = (stat.S_IFMT(info.st_mode), info.st_rdev)
    return seen


# -- the table -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """`argv` names inputs as {NAME} (MAKERS) and the case's folder as {dir}; `names`: what the one line
    from sapp-hook must contain (None: the command succeeds and says nothing of its own)."""

    id: str
    argv: list[str]
    status: int
    names: str | None
    run: str = "main"  # main: in this process; process: a fresh one (see `stdout`, `stop`, `read_only`)
    stdout: str = "pipe"  # process: pipe, full (/dev/full), closed (no fd 1), left (the reader closed it)
    stop: tuple[int, str] | None = None  # process: the signal, sent once this text is on stderr
    read_only: bool = False  # process: without root's power to write read-only files (CAP_DAC_OVERRIDE)
    unchanged: bool = True  # every file in the folder as it was (a refusal or an interruption)
    fault: str | None = None  # main: an exception os.fsync raises, as a signal mid-write would; torch-2.8; or
    # EIO-on-config: the config's rename fails (a disk error) once its backup is written
    check: Callable[[Path], None] | None = None  # main: what a success must have done
    prepare: tuple[str, ...] = ()  # inputs to make before the snapshot (those argv names are made anyway)
    printed: str | None = None  # what stdout must say


def _earlier_outputs_replaced(folder: Path) -> None:
    assert "plan" in json.loads((folder / "plan.json").read_text())
    assert (folder / "schedule.csv").read_text().startswith("0F0,0F1,")
    assert "recompute" in (folder / "keys.yaml").read_text()


def _symlink_written_through(folder: Path) -> None:
    link, target = folder / "links" / "train.yaml", folder / "train.yaml"
    assert link.is_symlink() and link.resolve() == target.resolve()
    template = (TEMPLATES / "mindformers_llama.yaml").read_bytes()
    assert "offset: [" in target.read_text() and target.read_bytes() != template
    assert (folder / "links" / "train.yaml.sapp-hook.bak").read_bytes() == template  # beside the link
    assert not any(path.name.endswith(".tmp") for path in folder.rglob("*"))


def _crlf_kept(name: str) -> Callable[[Path], None]:
    def check(folder: Path) -> None:
        data = (folder / f"crlf-{name}").read_bytes()
        assert data != (TEMPLATES / name).read_bytes().replace(b"\n", b"\r\n")  # the plan is in
        assert data.count(b"\r\n") == data.count(b"\n") > 10

    return check


def _bom_kept(folder: Path) -> None:
    data = (folder / "bom-job.py").read_bytes()
    assert data.startswith(b"\xef\xbb\xbf") and not data[3:].startswith(b"\xef\xbb\xbf")
    assert b"pipeline_parallel_module_fqns_per_model_part" in data
    assert (folder / "bom-job.py.sapp-hook.bak").read_bytes().startswith(b"\xef\xbb\xbf")


def _plan_written(folder: Path) -> None:
    assert json.loads((folder / "out.json").read_text())["spec"]["pipeline_parallel"] == 4


def _toml_says(path: Path, key: str) -> None:
    import tomllib

    assert key in tomllib.loads(path.read_text())["parallelism"]


def _endings(path: Path, *, crlf: bool) -> None:
    """The rewrite added lines (its backup is the file as it was), each ending as most of the file's
    lines did; the one line that ended otherwise still does; no CR doubled."""
    old, new = path.with_name(path.name + ".sapp-hook.bak").read_bytes(), path.read_bytes()
    assert new.count(b"\n") > old.count(b"\n") and b"\r\r" not in new
    if crlf:
        assert new.count(b"\r\n") == new.count(b"\n")
    else:
        assert new.count(b"\r\n") == old.count(b"\r\n") == 1


CASES = [
    # malformed, non-numbers, nested, huge: one line naming the file's flag or the field
    Case("malformed-json", [*SOLVE, "--profile", "{malformed_json}", "--quiet"], EXIT_INPUT, "--profile"),
    Case("nan-in-profile", [*SOLVE, "--profile", "{nan_profile}", "--quiet"], EXIT_INPUT, "layers[1].forward_ms"),
    Case("deeply-nested-json", [*SOLVE, "--profile", "{deep_json}", "--quiet"], EXIT_INPUT, "--profile"),
    Case("huge-json", [*SOLVE, "--profile", "{huge_json}", "--quiet"], EXIT_INPUT, "--profile"),
    Case("endless-stream", [*SOLVE, "--profile", "{zero}", "--quiet"], EXIT_INPUT, "--profile"),
    Case(
        "yaml-alias-bomb",
        [
            "simulate",
            "--profile",
            "{profile}",
            "--mindformers-plan",
            "{alias_bomb}",
            "--pipeline-parallel",
            "4",
            "--micro-batches",
            "8",
            "--schedule",
            "1F1B",
        ],
        EXIT_INPUT,
        "--mindformers-plan",
    ),
    Case(
        "yaml-python-tag",
        [
            "simulate",
            "--profile",
            "{profile}",
            "--mindformers-plan",
            "{python_tag}",
            "--pipeline-parallel",
            "4",
            "--micro-batches",
            "8",
            "--schedule",
            "1F1B",
        ],
        EXIT_INPUT,
        "--mindformers-plan",
    ),
    Case(
        "config-python-tag",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{python_tag_config}"],
        EXIT_INPUT,
        "--config",
    ),
    Case(
        "malformed-toml",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{bad_toml}"],
        EXIT_INPUT,
        "--config",
    ),
    Case(
        "not-a-plan",
        ["apply", "--plan", "{not_a_plan}", "--target", "plan", "--config", "{dir}/out.json"],
        EXIT_INPUT,
        "--plan",
    ),
    Case(
        "deeply-nested-model-config",
        ["profile", "--estimate", "--model", "{deep_config}", "--out", "{dir}/p.json", "--quiet"],
        EXIT_INPUT,
        "--model",
    ),
    Case("missing-file", [*SOLVE, "--profile", "{dir}/nothing.json", "--quiet"], EXIT_INPUT, "--profile"),
    # impossible or overflowing specs
    Case("no-stages", [*SOLVE, "--pipeline-parallel", "0", "--quiet"], EXIT_INPUT, "--pipeline-parallel"),
    Case("no-plan-fits", [*SOLVE, "--memory", "1KB", "--quiet"], EXIT_NO_PLAN, "--memory: no plan fits"),
    Case("size-beyond-floats", [*SOLVE, "--memory", "1" + "0" * 400 + "GB", "--quiet"], EXIT_INPUT, "--memory"),
    Case("time-limit-nan", [*SOLVE, "--time-limit", "nan", "--quiet"], EXIT_INPUT, "--time-limit"),
    Case(
        "astronomic-pipeline",
        [*SIMULATE, "--pipeline-parallel", "10" + "0" * 20, "--quiet"],
        EXIT_INPUT,
        "--pipeline-parallel: ",
    ),
    Case(
        "schedule-name-a-page-long", [*SIMULATE, "--schedule", "x" * 10_000], EXIT_INPUT, "--schedule: expected one of"
    ),
    Case(
        "stages-as-many-as-layers",
        [*SOLVE, "--pipeline-parallel", "10", "--micro-batches", "10"],
        0,
        None,
        printed="even split      none: virtual stage 8 is empty",
    ),
    Case(
        "profile-field-named-with-its-file",
        [*SOLVE, "--profile", "{nan_constant_profile}"],
        EXIT_INPUT,
        "--profile: " + "{dir}/nan-constant.json: rank_constant_bytes: expected a finite number",
    ),
    Case(
        "estimate-past-a-pebibyte",
        [
            "profile",
            "--estimate",
            "--model",
            "tiny-llama",
            "--out",
            "{dir}/p.json",
            "--micro-batch-size",
            "1" + "0" * 30,
        ],
        EXIT_INPUT,
        "--micro-batch-size",
    ),
    Case(
        "tied-bytes-past-a-pebibyte",
        [*SOLVE, "--profile", "{huge_tied_profile}"],
        EXIT_INPUT,
        "tied_parameters[0].bytes: expected at most 2**50 bytes",
    ),
    Case("schema-version-true", [*SOLVE, "--profile", "{bool_version_profile}"], EXIT_INPUT, "schema_version"),
    Case(
        "sapp-size-past-floats",
        [*SOLVE, "--profile", "{sapp_overflow}"],
        EXIT_INPUT,
        "layers_description[1].memory_parameter",
    ),
    Case(
        "plan-key-true-for-1",
        ["apply", "--plan", "{plan_offset_true}", "--target", "plan", "--config", "{dir}/out.json"],
        EXIT_INPUT,
        "plan.offset: is [0, True, 0, -1]",
    ),
    Case(
        "plan-for-other-stages",
        [
            "validate",
            "--model",
            "tiny-llama",
            "--pipeline-parallel",
            "2",
            "--micro-batches",
            "8",
            "--schedule",
            "1F1B",
            "--plan",
            "{plan}",
            "--quiet",
        ],
        EXIT_INPUT,
        "--plan",
    ),
    Case(
        "more-stages-than-layers",
        [
            "validate",
            "--model",
            "tiny-llama",
            "--schedule",
            "1F1B",
            "--pipeline-parallel",
            "64",
            "--micro-batches",
            "64",
            "--even",
            "--quiet",
        ],
        EXIT_INPUT,
        "--pipeline-parallel: 64 x 1 (ranks x chunks) make 64 virtual stages, more than tiny-llama's 10 layers",
    ),
    Case(
        "tensor-parallel-moe",
        [
            "validate",
            "--model",
            "tiny-moe",
            "--schedule",
            "1F1B",
            "--pipeline-parallel",
            "2",
            "--micro-batches",
            "4",
            "--even",
            "--tensor-parallel",
            "2",
            "--quiet",
        ],
        EXIT_INPUT,
        "--tensor-parallel: the runner's plan (TorchTitan's Llama plan) leaves an MoE model's experts whole",
    ),
    # outputs that are not regular files, through links or not: refused, the node left as it was
    Case("plan-out-device", [*SOLVE, "--plan-out", "{null}", "--quiet"], EXIT_INPUT, "--plan-out"),
    Case("plan-out-link-to-device", [*SOLVE, "--plan-out", "{link_to_null}", "--quiet"], EXIT_INPUT, "--plan-out"),
    Case("yaml-out-fifo", [*SOLVE, "--mindformers-yaml", "{fifo}", "--quiet"], EXIT_INPUT, "--mindformers-yaml"),
    Case(
        "profile-out-device",
        ["profile", "--estimate", "--model", "tiny-llama", "--out", "{null}", "--quiet"],
        EXIT_INPUT,
        "--out",
    ),
    Case(
        "plan-out-name-too-long",
        [*SOLVE, "--plan-out", "{dir}/" + "x" * 300 + ".json"],
        EXIT_INPUT,
        "--plan-out: {dir}/xxx",
    ),
    Case(
        "one-file-for-two-outputs",
        [*SOLVE, "--plan-out", "{dir}/out.json", "--trace", "{dir}/out.json"],
        EXIT_INPUT,
        "--plan-out: {dir}/out.json is --trace's file too",
    ),
    # an output onto a launch config named by mistake: refused, the config as it was (apply writes plans)
    Case("plan-out-onto-a-yaml-config", [*SOLVE, "--plan-out", "{yaml}"], EXIT_INPUT, "--plan-out: {dir}/train.yaml"),
    Case("csv-onto-a-toml-config", [*SOLVE, "--csv", "{toml}"], EXIT_INPUT, "--csv: {dir}/train.toml"),
    Case("trace-onto-a-script", [*SOLVE, "--trace", "{script}"], EXIT_INPUT, "--trace: {dir}/train.sh"),
    Case(
        "mindformers-yaml-onto-a-training-config",
        [*SOLVE, "--mindformers-yaml", "{yaml}"],
        EXIT_INPUT,
        "--mindformers-yaml: {dir}/train.yaml",
    ),
    Case(
        "profile-out-onto-a-script",
        ["profile", "--estimate", "--model", "tiny-llama", "--out", "{script}", "--quiet"],
        EXIT_INPUT,
        "--out: {dir}/train.sh",
    ),
    Case("plan-out-onto-a-toml-of-brackets", [*SOLVE, "--plan-out", "{bracketed_toml}"], EXIT_INPUT, "--plan-out"),
    Case("trace-onto-a-json-launch-config", [*SOLVE, "--trace", "{json_launch_config}"], EXIT_INPUT, "--trace"),
    Case(
        "outputs-onto-earlier-outputs",
        [
            *SOLVE,
            "--plan-out",
            "{earlier_plan}",
            "--csv",
            "{earlier_csv}",
            "--mindformers-yaml",
            "{earlier_keys}",
            "--quiet",
        ],
        0,
        None,
        unchanged=False,
        check=_earlier_outputs_replaced,
    ),
    Case(
        "backup-slot-a-folder",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{yaml}"],
        EXIT_INPUT,
        "train.yaml.sapp-hook.bak is a folder",
        prepare=("backup_folder",),
    ),
    Case(
        "side-file-slot-a-folder",
        ["apply", "--plan", "{plan_recomputing}", "--target", "torchtitan", "--config", "{toml}"],
        EXIT_INPUT,
        "train.toml.sapp-hook.json is a folder",
        prepare=("side_file_folder",),
    ),
    Case(
        "config-rename-fails",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{yaml}"],
        EXIT_INPUT,
        "Input/output error; it was left as it was",
        fault="EIO-on-config",
    ),
    Case("run-cache-dir-a-file", ["run", "--cache-dir", "{profile}", "--", "true"], EXIT_INPUT, "--cache-dir"),
    Case(
        "apply-onto-device",
        ["apply", "--plan", "{plan}", "--target", "plan", "--config", "{zero}"],
        EXIT_INPUT,
        "--config",
    ),
    Case(
        "apply-onto-fifo",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{fifo}"],
        EXIT_INPUT,
        "--config",
    ),
    # links written through; CRLF kept
    Case(
        "apply-through-link",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{link_yaml}", "--quiet"],
        0,
        None,
        unchanged=False,
        check=_symlink_written_through,
    ),
    Case(
        "crlf-yaml",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{crlf_yaml}", "--quiet"],
        0,
        None,
        unchanged=False,
        check=_crlf_kept("mindformers_llama.yaml"),
    ),
    Case(
        "crlf-toml",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{crlf_toml}", "--quiet"],
        0,
        None,
        unchanged=False,
        check=_crlf_kept("torchtitan_llama.toml"),
    ),
    # read-only files and folders, for a user without root's override
    Case(
        "read-only-config",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{read_only_config}"],
        EXIT_INPUT,
        "--config",
        run="process",
        read_only=True,
    ),
    Case(
        "read-only-folder",
        [*SOLVE, "--plan-out", "{read_only_folder}/plan.json", "--quiet"],
        EXIT_INPUT,
        "--plan-out",
        run="process",
        read_only=True,
    ),
    Case(
        "read-only-output",
        [*SOLVE, "--plan-out", "{read_only_plan}", "--quiet"],
        EXIT_INPUT,
        "old-plan.json is read-only",
        run="process",
        read_only=True,
    ),
    Case(
        "read-only-plan-target",
        ["apply", "--plan", "{plan}", "--target", "plan", "--config", "{read_only_plan}"],
        EXIT_INPUT,
        "old-plan.json is read-only",
        run="process",
        read_only=True,
    ),
    Case(
        "dry-run-of-read-only-config",
        [
            "apply",
            "--plan",
            "{plan}",
            "--target",
            "mindformers",
            "--config",
            "{read_only_config}",
            "--dry-run",
            "--quiet",
        ],
        0,
        None,
        run="process",
        read_only=True,
    ),
    Case(
        "demo-into-read-only-folder",
        ["demo", "--out", "{read_only_folder}/demo", "--quiet"],
        EXIT_INPUT,
        "--out: cannot make the folder",
        run="process",
        read_only=True,
    ),
    # Ctrl-C and SIGTERM: mid-search, mid-profile, mid-write
    Case(
        "ctrl-c-in-search",
        LONG_SOLVE,
        EXIT_INTERRUPTED,
        "sapp-hook solve: interrupted",
        run="process",
        stop=(signal.SIGINT, "moving layers"),
    ),
    Case(
        "sigterm-in-search",
        LONG_SOLVE,
        EXIT_TERMINATED,
        "sapp-hook solve: terminated",
        run="process",
        stop=(signal.SIGTERM, "moving layers"),
    ),
    Case(
        "ctrl-c-in-profile",
        ["profile", "--model", "tiny-llama", "--steps", "100", "--out", "{dir}/p.json"],
        EXIT_INTERRUPTED,
        "sapp-hook profile: interrupted",
        run="process",
        stop=(signal.SIGINT, "profiling: step 2/"),
    ),
    Case(
        "hang-up-in-search",
        LONG_SOLVE,
        EXIT_HUNG_UP,
        "sapp-hook solve: hung up",
        run="process",
        stop=(signal.SIGHUP, "moving layers"),
    ),
    Case(
        "ctrl-c-mid-write",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{yaml}"],
        EXIT_INTERRUPTED,
        "sapp-hook apply: interrupted",
        fault="KeyboardInterrupt",
    ),
    Case(
        "sigterm-mid-write",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{toml}"],
        EXIT_TERMINATED,
        "sapp-hook apply: terminated",
        fault="Terminated",
    ),
    Case(
        "sigterm-mid-plan-out",
        [*SOLVE, "--plan-out", "{dir}/out.json", "--quiet"],
        EXIT_TERMINATED,
        "sapp-hook solve: terminated",
        fault="Terminated",
    ),
    # stdout full, closed, or left by its reader: the files first, then one line (none for a reader that left)
    Case(
        "json-into-full-disk",
        [*SOLVE, "--json", "--plan-out", "{dir}/out.json"],
        EXIT_OUTPUT,
        "stdout",
        run="process",
        stdout="full",
        unchanged=False,
        check=_plan_written,
    ),
    Case(
        "json-into-closed-stdout",
        [*SOLVE, "--json", "--plan-out", "{dir}/out.json"],
        EXIT_OUTPUT,
        "stdout",
        run="process",
        stdout="closed",
        unchanged=False,
        check=_plan_written,
    ),
    Case("reader-left", [*SIMULATE, "--json"], EXIT_OUTPUT, None, run="process", stdout="left"),
    Case("quiet-with-closed-stdout", [*SIMULATE, "--quiet"], 0, None, run="process", stdout="closed"),
    # configs the writers refuse, or read as Python does
    Case(
        "empty-yaml-config",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{empty_yaml}"],
        EXIT_INPUT,
        "is not a MindFormers config",
    ),
    Case(
        "layer-count-as-text",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{layers_as_text}"],
        EXIT_INPUT,
        "model.model_config.num_layers is '8'; expected an integer",
    ),
    Case(
        "stage-count-as-text",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{stages_as_text}"],
        EXIT_INPUT,
        "parallel_config.pipeline_stage is '4'",
    ),
    Case(
        "python-config-with-bom",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{bom_python}:llama3_pp", "--quiet"],
        0,
        None,
        unchanged=False,
        check=_bom_kept,
    ),
    Case(
        "python-config-defined-twice",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{twice_python}:llama3_pp"],
        EXIT_INPUT,
        "defines llama3_pp 2 times",
    ),
    Case(
        "toml-with-bom",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{bom_toml}"],
        EXIT_INPUT,
        "starts with a UTF-8 byte-order mark",
    ),
    # numbers past a float or past Python's digits: one short line, no traceback
    Case(
        "int-past-floats-in-profile",
        [*SOLVE, "--profile", "{int_past_floats_profile}"],
        EXIT_INPUT,
        "layers[1].forward_ms: expected a finite number >= 0, got 100000000000000000...",
    ),
    Case(
        "tensor-count-past-floats",
        [*SOLVE, "--profile", "{tensors_past_floats_profile}"],
        EXIT_INPUT,
        "layers[1] (block.0).parameter_tensors: expected an integer from 0 to 2**50",
    ),
    Case("version-of-4000-digits", [*SOLVE, "--profile", "{long_version_profile}"], EXIT_INPUT, "schema_version"),
    Case(
        "yaml-int-past-the-digit-limit",
        [*SIMULATE[:7], "--profile", "{profile}", "--mindformers-plan", "{digits_yaml}"],
        EXIT_INPUT,
        "--mindformers-plan: {dir}/digits.yaml: line 1: an integer of 5,000 digits; expected at most 4,300",
    ),
    Case(
        "yaml-hex-layer-count",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{hex_layers_yaml}"],
        EXIT_INPUT,
        "model.model_config.num_layers an integer of 20,000 bits",
    ),
    Case(
        "toml-hex-pipeline-degree",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{hex_degree_toml}", "--quiet"],
        0,
        None,
        unchanged=False,
    ),
    Case(
        "megatron-layers-of-5000-digits",
        ["apply", "--plan", "{plan}", "--target", "megatron", "--config", "{digits_script}"],
        EXIT_INPUT,
        "--num-layers is a number of 5,000 digits; Megatron-LM reads at most 4,300",
    ),
    Case(
        "flag-value-a-page-long",
        [*SOLVE, "--pipeline-parallel", "9" * 5000],
        EXIT_INPUT,
        "argument --pipeline-parallel: invalid int",
    ),
    # TOML: a table of dotted keys rewritten; an array of tables refused, not turned into a table
    Case(
        "toml-parallelism-as-dotted-keys",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{dotted_toml}", "--quiet"],
        0,
        None,
        unchanged=False,
        check=lambda folder: _toml_says(folder / "dotted.toml", "module_fqns_per_model_part"),
    ),
    Case(
        "toml-checkpointing-as-array-of-tables",
        ["apply", "--plan", "{plan}", "--target", "torchtitan", "--config", "{checkpointing_array_toml}"],
        EXIT_INPUT,
        "activation_checkpoint is an array of tables; expected a table",
    ),
    # line endings: each line as it ended, added lines as most do; no doubled CR
    Case(
        "python-config-crlf-rebuilt",
        ["apply", "--plan", "{plan_recomputing}", "--target", "torchtitan", "--config", "{crlf_python}:llama3_pp"],
        0,
        None,
        unchanged=False,
        check=lambda folder: _endings(folder / "crlf-job.py", crlf=True),
    ),
    Case(
        "script-of-lf-lines-but-one",
        ["apply", "--plan", "{plan_recomputing}", "--target", "megatron", "--config", "{mostly_lf_script}"],
        0,
        None,
        unchanged=False,
        check=lambda folder: _endings(folder / "one-crlf-megatron_llama.sh", crlf=False),
    ),
    # names go into tables and error lines
    Case(
        "layer-name-with-a-line-break",
        [*SOLVE, "--profile", "{line_break_name_profile}"],
        EXIT_INPUT,
        "layers[1].name: is 'block\\n0'; expected printable text",
    ),
    # a plan JSON says its split once, however many views of it it holds
    Case(
        "plan-split-edited-for-apply",
        ["apply", "--plan", "{edited_split_plan}", "--target", "plan", "--config", "{dir}/out.json"],
        EXIT_INPUT,
        "plan.virtual_stage_layers: is [2, 4, 2, 2]; the plan's layers say [3, 3, 2, 2]",
    ),
    Case(
        "plan-layer-moved-for-simulate",
        ["simulate", "--profile", "{profile}", "--plan", "{moved_layer_plan}"],
        EXIT_INPUT,
        "plan.layers[2].virtual_stage: is 1; plan.virtual_stage_layers and the profile say 0",
    ),
    # outputs and the files beside a config
    Case(
        "plan-out-to-a-pipe",
        [*SOLVE, "--plan-out", "/dev/stdout", "--quiet"],
        EXIT_INPUT,
        "--plan-out: /dev/stdout is a named pipe (FIFO)",
        run="process",
    ),
    Case("plan-out-empty", [*SOLVE, "--plan-out", ""], EXIT_INPUT, "--plan-out: expected a file name"),
    Case(
        "backup-name-links-to-config",
        ["apply", "--plan", "{plan}", "--target", "mindformers", "--config", "{yaml}"],
        EXIT_INPUT,
        "train.yaml.sapp-hook.bak is {dir}/train.yaml itself",
        prepare=("backup_links_to_config",),
    ),
    Case(
        "side-file-name-links-to-config",
        ["apply", "--plan", "{plan_recomputing}", "--target", "torchtitan", "--config", "{toml}"],
        EXIT_INPUT,
        "train.toml.sapp-hook.json is {dir}/train.toml itself",
        prepare=("side_file_links_to_config",),
    ),
    # the environment
    Case(
        "torch-too-old",
        ["profile", "--model", "tiny-llama", "--out", "{dir}/p.json", "--quiet"],
        EXIT_INPUT,
        "torch: found 2.8.0+cpu; sapp-hook needs torch >= 2.9",
        fault="torch-2.8",
    ),
    Case("version", ["--version"], 0, None, unchanged=False),
]


def _drop_root_override() -> None:
    """In the child: no CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH or CAP_FOWNER, so that root meets read-only
    files as any user does (dropped from the bounding set, they are gone once the child execs)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2, 3):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _run_process(case: Case, argv: list[str], folder: Path) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "sapp_hook", *argv]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    stdout = {"pipe": subprocess.PIPE, "left": subprocess.PIPE, "closed": None}.get(case.stdout)
    full = open("/dev/full", "w") if case.stdout == "full" else None  # noqa: SIM115 - used as the child's stdout only
    steps = []
    if case.stdout == "closed":
        steps.append(lambda: os.close(1))
    if case.read_only and os.geteuid() == 0:
        steps.append(_drop_root_override)
    process = subprocess.Popen(
        command,
        stdout=full or stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        preexec_fn=(lambda: [step() for step in steps]) if steps else None,
    )
    if full:
        full.close()
    if case.stdout == "left":
        process.stdout.close()
    err = ""
    if case.stop is not None:
        number, text = case.stop
        while text not in err:
            line = process.stderr.readline()
            assert line, f"the command ended before saying {text!r}: {err}"
            err += line
        time.sleep(0.5)
        process.send_signal(number)
    try:
        out, rest = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        out, rest = process.communicate()
        pytest.fail(f"still running 120 s after {case.stop}: {err + rest}")
    return process.returncode, out or "", err + rest


def _run_main(case: Case, argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    if case.fault == "torch-2.8":
        import torch

        monkeypatch.setattr(torch, "__version__", "2.8.0+cpu")
    elif case.fault == "EIO-on-config":
        replace = os.replace

        def failing(source: str, target: str) -> None:
            if not str(target).endswith(".bak"):
                raise OSError(errno.EIO, "Input/output error")
            replace(source, target)

        monkeypatch.setattr(os, "replace", failing)
    elif case.fault is not None:
        exception = {"KeyboardInterrupt": KeyboardInterrupt, "Terminated": Terminated}[case.fault]

        def interrupted(handle: int) -> None:
            raise exception()

        monkeypatch.setattr(os, "fsync", interrupted)
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_corpus(case, tmp_path, capsys, monkeypatch):
    for name in case.prepare:
        _input(tmp_path, name)
    argv = _expand(case.argv, tmp_path)
    capsys.readouterr()
    before = _snapshot(tmp_path)
    if case.run == "process":
        status, out, err = _run_process(case, argv, tmp_path)
    else:
        status, out, err = _run_main(case, argv, capsys, monkeypatch)
    monkeypatch.undo()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    said = [line for line in err.splitlines() if line.startswith("sapp-hook")]
    if case.names is None:
        assert said == [], err
    else:
        assert len(said) == 1 and case.names.replace("{dir}", str(tmp_path)) in said[0], err
        assert len(said[0]) <= 2000, said[0][:300]  # a value a page long is cut short
    assert status == case.status, err
    if case.unchanged:
        assert _snapshot(tmp_path) == before
    if case.check is not None:
        case.check(tmp_path)
    if case.printed is not None:
        assert case.printed in out, out
    if case.id == "version":
        assert out.startswith("sapp-hook ") and len(out.splitlines()) == 1
    with contextlib.suppress(OSError):  # read-only folders: let pytest remove them
        for path in tmp_path.rglob("*"):
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)


def test_an_error_into_a_full_stderr_still_says_its_status(tmp_path):
    """stderr on a full disk: the one line cannot be said, the status says it, and nothing else fails."""
    profile = small_profile(8).save(tmp_path / "profile.json") or tmp_path / "profile.json"
    argv = [a.replace("{profile}", str(profile)) for a in SOLVE]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "sapp_hook", *argv, "--pipeline-parallel", "0"],
            stderr=full,
            stdout=subprocess.PIPE,
            env=environment,
            timeout=60,
        )
    assert (done.returncode, done.stdout) == (EXIT_INPUT, b"")


# -- a signal before any command has loaded ---------------------------------------------------------------------------

# The signal arrives as Python looks for the module holding the commands, the moment it would on a slow disk.
LOADING = """
import importlib.abc, os, sys
class Signal(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "sapp_hook.cli.app":
            os.kill(os.getpid(), int(sys.argv[1]))
        return None
sys.meta_path.insert(0, Signal())
from sapp_hook.cli import main
raise SystemExit(main(["--version"]))
"""


@pytest.mark.parametrize(
    ("number", "status", "word"),
    [
        (signal.SIGINT, EXIT_INTERRUPTED, "interrupted"),
        (signal.SIGTERM, EXIT_TERMINATED, "terminated"),
        (signal.SIGHUP, EXIT_HUNG_UP, "hung up"),
    ],
)
def test_a_signal_while_the_commands_load_ends_with_its_line(number, status, word):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", LOADING, str(int(number))], capture_output=True, text=True, env=environment, timeout=60
    )
    assert (done.returncode, done.stderr, done.stdout) == (status, f"sapp-hook: {word}\n", "")


# The command stops on Ctrl-C; a second Ctrl-C and a SIGTERM arrive as the process exits.
SECOND_SIGNAL = """
import os, signal, sys
import sapp_hook.cli.app as app
def interrupted():
    raise KeyboardInterrupt
app.build_parser = interrupted
from sapp_hook.cli import main
sys.argv = ["sapp-hook", "solve"]
status = main()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGTERM)
raise SystemExit(status)
"""


def test_a_second_signal_as_the_process_exits_keeps_its_status_and_line():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, env=environment, timeout=60
    )
    assert (done.returncode, done.stderr, done.stdout) == (EXIT_INTERRUPTED, "sapp-hook: interrupted\n", "")


# The command is done; SIGTERM and Ctrl-C arrive as the process exits.
AFTER_THE_COMMAND = """
import os, signal, sys
from sapp_hook.cli import main
sys.argv = ["sapp-hook", "simulate", "--schedule", "1F1B", "--pipeline-parallel", "2", "--micro-batches", "2", "--forward", "1",
            "--backward", "1", "--quiet"]
status = main()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)
raise SystemExit(status)
"""


def test_a_signal_as_a_finished_command_exits_keeps_its_status():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", AFTER_THE_COMMAND], capture_output=True, text=True, env=environment, timeout=60
    )
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "")


def test_a_second_signal_raises_nothing_while_the_first_unwinds():
    """Ctrl-C twice as torch loads: the second must not raise inside the first one's unwinding (in a
    library's C++ code an exception there aborts the process); the watchdog ends the process for it."""
    from sapp_hook.cli.terminal import signals_end_the_command

    for first, raised in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)):
        with signals_end_the_command(lambda: "sapp-hook test"):
            with pytest.raises(raised):
                signal.getsignal(first)(first, None)
            for later in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                assert signal.getsignal(later)(later, None) is None


# -- the Python API: one InputError naming the argument -------------------------------------------------------------

SPEC = PipelineSpec(pipeline_parallel=4, micro_batches=8)
UNIFORM = PipelineCosts.uniform(4, 1, forward_ms=1.0, backward_ms=2.0)


def _autotune(**options):
    import torch

    import sapp_hook

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    arguments = {"model": model, "pipeline_parallel": 2, "micro_batches": 4, **options}
    return sapp_hook.autotune(arguments.pop("model"), **arguments)


def _older_torch(tmp_path, monkeypatch):
    import torch

    import sapp_hook

    monkeypatch.setattr(torch, "__version__", "2.8.0+cpu")
    return sapp_hook.autotune


API_CASES = [
    ("autotune-model-none", lambda tmp_path, monkeypatch: _autotune(model=None), "model"),
    ("autotune-schedule-none", lambda tmp_path, monkeypatch: _autotune(schedule=None), "schedule"),
    ("autotune-modes-string", lambda tmp_path, monkeypatch: _autotune(modes="full"), "modes"),
    ("autotune-budget-list", lambda tmp_path, monkeypatch: _autotune(memory_budget=[1]), "memory_budget"),
    ("autotune-steps-zero", lambda tmp_path, monkeypatch: _autotune(profile_steps=0), "profile_steps"),
    ("autotune-config-number", lambda tmp_path, monkeypatch: _autotune(config=3, target="plan"), "config"),
    (
        "write-config-no-layout",
        lambda tmp_path, monkeypatch: __import__("sapp_hook").write_config("plan", tmp_path / "plan.json", None),
        "layout",
    ),
    ("apply-no-plan", lambda tmp_path, monkeypatch: __import__("sapp_hook").build_stages(None, None, 0), "plan"),
    ("older-torch", _older_torch, "torch"),
    (
        "autotune-cache-dir-a-file",
        lambda tmp_path, monkeypatch: _autotune(cache_dir=ROOT / "pyproject.toml"),
        "cache_dir",
    ),
    ("solve-no-profile", lambda tmp_path, monkeypatch: solve(None, SPEC), "profile"),
    ("solve-spec-as-dict", lambda tmp_path, monkeypatch: solve(small_profile(8), {"pipeline_parallel": 4}), "spec"),
    (
        "simulate-arguments-swapped",
        lambda tmp_path, monkeypatch: simulate(UNIFORM, build_schedule("1F1B", 4, 8)),
        "schedule",
    ),
    (
        "uniform-forward-none",
        lambda tmp_path, monkeypatch: PipelineCosts.uniform(4, 1, forward_ms=None, backward_ms=2.0),
        "forward_ms",
    ),
    ("build-schedule-no-name", lambda tmp_path, monkeypatch: build_schedule(None, 4, 8), "schedule"),
    (
        "spec-schedule-number",
        lambda tmp_path, monkeypatch: PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule=5),
        "schedule",
    ),
    (
        "write-config-target-list",
        lambda tmp_path, monkeypatch: write_config(["plan"], tmp_path / "p.json", even_layout(SPEC, 8)),
        "target",
    ),
    (
        "write-config-dry-run-text",
        lambda tmp_path, monkeypatch: write_config("plan", tmp_path / "p.json", even_layout(SPEC, 8), dry_run="no"),
        "dry_run",
    ),
    ("load-profile-none", lambda tmp_path, monkeypatch: load_profile(None), "profile"),
    ("plan-from-dict-no-profile", lambda tmp_path, monkeypatch: plan_from_dict(None, {}), "profile"),
    (
        "mindformers-keys-none",
        lambda tmp_path, monkeypatch: plan_from_mindformers(small_profile(8), SPEC, None),
        "keys",
    ),
    ("times-scaled-by-nan", lambda tmp_path, monkeypatch: small_profile(8).with_times_scaled(float("nan")), "factor"),
    (
        "budget-past-floats",
        lambda tmp_path, monkeypatch: PipelineSpec(pipeline_parallel=4, micro_batches=8, memory_budget_bytes=10**400),
        "memory_budget_bytes",
    ),
    ("ranks-of-20000-bits", lambda tmp_path, monkeypatch: build_schedule("1F1B", 2**20000, 8), "ranks"),
    (
        "uniform-ranks-past-any-replay",
        lambda tmp_path, monkeypatch: PipelineCosts.uniform(5_000_001, 1, forward_ms=1.0, backward_ms=2.0),
        "ranks",
    ),
    (
        "time-limit-past-floats",
        lambda tmp_path, monkeypatch: solve(small_profile(8), SPEC, time_limit_s=10**400),
        "time_limit_s",
    ),
    ("autotune-out-dir-a-file", lambda tmp_path, monkeypatch: _autotune(out_dir=ROOT / "pyproject.toml"), "out_dir"),
    (
        "environment-on-plan",
        lambda tmp_path, monkeypatch: _from_environment(monkeypatch, ON_PLAN="never"),
        "SAPP_HOOK_ON_PLAN",
    ),
    ("environment-force", lambda tmp_path, monkeypatch: _from_environment(monkeypatch, FORCE="yes"), "SAPP_HOOK_FORCE"),
    (
        "environment-cache-dir",
        lambda tmp_path, monkeypatch: _from_environment(monkeypatch, CACHE_DIR=str(ROOT / "pyproject.toml")),
        "SAPP_HOOK_CACHE_DIR",
    ),
]


def _from_environment(monkeypatch, **settings: str):
    """autotune under `sapp-hook run`, whose settings arrive as SAPP_HOOK_* variables."""
    for name, value in settings.items():
        monkeypatch.setenv(f"SAPP_HOOK_{name}", value)
    return _autotune()


@pytest.mark.parametrize(("call", "field"), [case[1:] for case in API_CASES], ids=[case[0] for case in API_CASES])
def test_api_corpus(call, field, tmp_path, monkeypatch):
    with pytest.raises(InputError) as caught:
        call(tmp_path, monkeypatch)
    assert caught.value.field == field and "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_step_outside_the_tuners_block_says_how_to_call_it():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tuner = __import__("sapp_hook").autotune(model, pipeline_parallel=2, micro_batches=4, force=True)
    with tuner:
        model(torch.randn(2, 4)).sum().backward()
        tuner.step()
    with pytest.raises(RuntimeError, match=r"^autotune's step\(\) outside its profiling window: call it inside `with"):
        tuner.step()


def test_run_gives_the_job_its_config_whatever_folder_it_runs_in(tmp_path, monkeypatch, capsys):
    """`--config train.yaml` reaches the job as a path it finds after a `cd` (torchrun's workers may)."""
    shutil.copy(TEMPLATES / "mindformers_llama.yaml", tmp_path / "train.yaml")
    monkeypatch.chdir(tmp_path)
    check = 'cd / && test -f "$SAPP_HOOK_CONFIG"'
    # the check passed (a failed `test` exits 1); the command planned nothing, which run says with status 4
    assert main(["run", "--config", "train.yaml", "--target", "mindformers", "--", "bash", "-c", check]) == 4


def test_a_cache_that_takes_no_plan_costs_only_the_cache(tmp_path, monkeypatch, caplog):
    """A full disk or read-only cache folder: the plan goes on into the config, only uncached."""
    from sapp_hook.hook.cache import PlanCache

    def full(path: object, text: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("sapp_hook.hook.cache.atomic_write_text", full)
    assert PlanCache(tmp_path / "cache").store("key", {}, {"plan": {}}, {}) is None
    assert "the plan is not cached" in caplog.text and "No space left on device" in caplog.text
