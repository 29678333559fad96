"""A config and its side file (`NAME.sapp-hook.json`, the exact plan where the config cannot say it) as one
unit: the side file removed when a plan needs none, written with a digest of the config bytes it belongs
with, writers taking turns, and a pair a killed `apply` left disagreeing refused by every reader of plans
(`apply --plan`, `simulate --plan`, `build_stages`, `read_plan_json`)."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import shutil
from pathlib import Path

import pytest
import tomllib
from solver_cases import small_profile
from test_writeback import CONFIGS, FILES, TEMPLATE_V2, comm_plan, plan

from basics.files import folder_locked
from sapp_hook import torchtitan_module_names
from sapp_hook.cli import main
from sapp_hook.writeback import layout_from_dict, layout_of, write_config
from simulator import InputError
from solver.vocabulary.load import read_plan_json

PYTHON = Path(__file__).parent / "fixtures" / "torchtitan" / "llama3_config_registry_2026_03.py"
# per target: the config, a plan it cannot say exactly (a side file), a plan it says whole (none)
CASES = {
    "torchtitan": (FILES["torchtitan"], plan({2: "full", 4: "selective"}), plan()),
    "torchtitan-python": (PYTHON.name + ":llama3_debugmodel", plan({2: "full", 4: "selective"}), plan()),
    "megatron": (FILES["megatron"], plan({1: "full", 2: "full"}), plan()),
    "mindformers": (TEMPLATE_V2, comm_plan({1: "comm", 3: "selective+comm"}), comm_plan({1: "full", 8: "full"})),
}


def copy(tmp_path: Path, name: str) -> tuple[Path, str]:
    """The config copied into `tmp_path`: its file, and the path `write_config` takes (`FILE.py:FUNCTION`)."""
    file, colon, function = name.partition(":")
    path = tmp_path / file
    shutil.copy(PYTHON if file == PYTHON.name else CONFIGS / file, path)
    return path, f"{path}{colon}{function}"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("case", CASES)
def test_a_plan_that_needs_no_side_file_removes_the_one_an_earlier_plan_left(tmp_path, case):
    name, inexact, exact = CASES[case]
    target = case.partition("-")[0]
    path, config = copy(tmp_path, name)
    side = Path(f"{path}.sapp-hook.json")
    first = write_config(target, config, layout_of(inexact))
    assert str(side) in first.written
    data = json.loads(side.read_text())
    assert data.pop("side_file_of") == {"config": path.name, "config_sha256": digest(path)}
    assert data == inexact.to_dict() and read_plan_json(side, "--plan") == inexact.to_dict()

    dry = write_config(target, config, layout_of(exact), dry_run=True)
    assert (
        f"would remove {side}: it held an earlier plan's exact recompute, and the config now says this plan whole"
        in dry.notes
    )
    assert side.exists()
    second = write_config(target, config, layout_of(exact))
    assert (
        f"removed {side}: it held an earlier plan's exact recompute, and the config now says this plan whole"
        in second.notes
    )
    assert not side.exists() and str(side) not in second.written
    assert write_config(target, config, layout_of(exact), dry_run=True).diff == ""  # the config says it


def test_a_side_file_is_rewritten_where_only_the_exact_plan_changes(tmp_path):
    """Two plans the config says alike (the heaviest mode for every block, one split): the config stays as it
    is, and its side file takes the new exact plan, with the digest of the config as it is."""
    path, config = copy(tmp_path, FILES["torchtitan"])
    write_config("torchtitan", config, layout_of(plan({2: "full", 4: "selective"})))
    before = path.read_bytes()
    other = plan({2: "full", 6: "selective"})
    result = write_config("torchtitan", config, layout_of(other))
    assert path.read_bytes() == before and result.written == [f"{path}.sapp-hook.json"]
    assert read_plan_json(f"{path}.sapp-hook.json", "--plan") == other.to_dict()


def _apply_killed(config: str, plan_file: str, between: str) -> None:
    """`sapp-hook apply`, killed (SIGKILL: no clean-up runs) between writing the side file and the config
    (`between="side and config"`) or between writing the config and removing the side file."""
    import os
    import signal

    from sapp_hook.writeback import files

    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if between == "side and config":
        write = files.atomic_write_text
        files.atomic_write_text = lambda path, *args: (
            kill() if Path(path).name == Path(config).name else write(path, *args)
        )
    else:
        unlink = os.unlink
        os.unlink = lambda path, *args: kill() if str(path).endswith(".sapp-hook.json") else unlink(path, *args)
    main(["apply", "--plan", plan_file, "--target", "torchtitan", "--config", config, "--quiet"])


@pytest.mark.parametrize("between", ["side and config", "config and side removal"])
def test_a_kill_between_the_two_writes_leaves_a_pair_every_reader_refuses(tmp_path, capsys, between):
    path, config = copy(tmp_path, FILES["torchtitan"])
    side = Path(f"{path}.sapp-hook.json")
    plans = {"inexact": plan({2: "full", 4: "selective"}), "exact": plan()}
    for key, chosen in plans.items():
        (tmp_path / f"{key}.json").write_text(json.dumps(chosen.to_dict()))
    if between != "side and config":
        write_config("torchtitan", config, layout_of(plans["inexact"]))
    before = path.read_bytes()
    killed = "inexact" if between == "side and config" else "exact"
    process = multiprocessing.get_context("spawn").Process(
        target=_apply_killed, args=(config, str(tmp_path / f"{killed}.json"), between)
    )
    process.start()
    process.join(120)
    assert process.exitcode == -9  # SIGKILL, between the two writes
    assert side.exists() and (path.read_bytes() == before) == (between == "side and config")

    said = f"{side} is the side file of {path}, but {path} has changed since they were written together"
    profile = tmp_path / "profile.json"
    small_profile(8).save(profile)
    for argv in (
        ["apply", "--plan", str(side), "--target", "plan", "--config", str(tmp_path / "out.json")],
        ["simulate", "--profile", str(profile), "--plan", str(side)],
    ):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and err.count("\n") == 1
        assert f"error: --plan: {said}" in err and "Run `sapp-hook apply` again with the plan you mean" in err
    from sapp_hook.pipelining.stages import build_stages

    with pytest.raises(InputError, match=f"^plan: {said}") as caught:
        build_stages(None, side, 0)  # the plan is read, and refused, before the model is looked at
    assert not (tmp_path / "out.json").exists()
    write_config("torchtitan", config, layout_of(plans[killed]))  # applying a plan again makes a pair
    assert (read_plan_json(side, "--plan") == plans[killed].to_dict()) if side.exists() else killed == "exact"


def test_side_files_without_a_record_and_copies_of_side_files_are_read_as_plans(tmp_path, caplog):
    """A side file an older sapp-hook wrote (no digest) is read unchecked, with a warning; a side file copied
    to a name of its own is a plain plan JSON, its record taken out."""
    path, config = copy(tmp_path, FILES["torchtitan"])
    chosen = plan({2: "full", 4: "selective"})
    side = Path(f"{path}.sapp-hook.json")
    side.write_text(json.dumps(chosen.to_dict()))
    with caplog.at_level(logging.WARNING):
        assert read_plan_json(side, "--plan") == chosen.to_dict()
    assert f"{side} records no digest of the config it was written with (an older sapp-hook wrote it)" in caplog.text
    write_config("torchtitan", config, layout_of(chosen))
    path.write_text(path.read_text() + "# edited\n")
    with pytest.raises(InputError, match="has changed since they were written together"):
        read_plan_json(side, "--plan")
    kept = tmp_path / "kept-plan.json"
    shutil.copy(side, kept)
    assert read_plan_json(kept, "--plan") == chosen.to_dict()
    side.write_text(json.dumps({**chosen.to_dict(), "side_file_of": "train.toml"}))
    with pytest.raises(InputError, match=r'side_file_of: expected \{"config": NAME, "config_sha256": HEX\}'):
        read_plan_json(side, "--plan")


def _apply_rounds(config: str, plan_files: list[str], rounds: int, start: object) -> None:
    """One `sapp-hook apply` after another into one config (a process of its own)."""
    start.wait()
    for _ in range(rounds):
        for plan_file in plan_files:
            main(["apply", "--plan", plan_file, "--target", "torchtitan", "--config", config, "--quiet"])


def test_concurrent_applies_leave_the_config_and_its_side_file_saying_one_plan(tmp_path):
    """Four `apply` runs at once on one config, alternating a plan that needs a side file and one that needs
    none: each waits for the one writing, and whenever a reader looks the pair says one plan."""
    path, config = copy(tmp_path, FILES["torchtitan"])
    side = Path(f"{path}.sapp-hook.json")
    plans = [plan({2: "full", 4: "selective"}).to_dict(), plan(counts=[2, 3, 2, 3]).to_dict()]
    files = []
    for index, data in enumerate(plans):
        files.append(str(tmp_path / f"plan{index}.json"))
        Path(files[-1]).write_text(json.dumps(data))
    modules = [torchtitan_module_names(layout_from_dict(data)) for data in plans]
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(5)
    writers = [context.Process(target=_apply_rounds, args=(config, files[::step], 6, start)) for step in (1, -1, 1, -1)]
    for writer in writers:
        writer.start()
    start.wait()
    looks = []
    while any(writer.is_alive() for writer in writers):
        with folder_locked(path, shared=True):
            looks.append((_said(path, modules), read_plan_json(side, "--plan") if side.exists() else None))
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0
    looks.append((_said(path, modules), read_plan_json(side, "--plan") if side.exists() else None))
    assert len(looks) > 5 and looks[-1][0] in (0, 1)
    assert all(side_plan == (plans[0] if said == 0 else None) for said, side_plan in looks)


def _said(path: Path, modules: list[list[list[str]]]) -> int:
    """Which plan the config's module lists are (-1: none yet, the template as it was)."""
    parallelism = tomllib.loads(path.read_text())["parallelism"]
    return (
        modules.index(parallelism["module_fqns_per_model_part"]) if "module_fqns_per_model_part" in parallelism else -1
    )
