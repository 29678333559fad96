"""`sapp-hook calibrate`: reports of measured runs in, the time factor and per-action overhead out, and
the loop back into planning (`--profile-out`, `--action-overhead`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from solver_cases import small_profile

from sapp_hook.cli import main
from solver import PipelineSpec, evaluate_plan, load_profile
from solver.calibrate import Run, rank_end_ms

SCALE, OVERHEAD_MS, P2P_MS = 1.25, 0.5, 0.1
PLANS = (("1F1B", 1, (3, 2, 3, 2)), ("ZBH1", 1, (2, 3, 3, 2)), ("Interleaved1F1B", 2, (2, 1, 1, 1, 1, 1, 2, 1)))


def report_of(profile, schedule, chunks, counts) -> dict:
    """What `sapp-hook validate --json` reports of a run on an engine with SCALE and OVERHEAD_MS (the
    keys calibrate reads, and one it does not)."""
    spec = PipelineSpec(pipeline_parallel=4, chunks=chunks, micro_batches=8, schedule=schedule, p2p_ms=P2P_MS)
    modes = ("none",) * len(profile.layers)
    measured = rank_end_ms(Run(profile, spec, counts, modes, ()), SCALE, OVERHEAD_MS)
    return {
        "schedule": schedule,
        "pipeline_parallel": 4,
        "chunks": chunks,
        "micro_batches": 8,
        "p2p_ms": P2P_MS,
        "stage_layer_counts": list(counts),
        "layer_modes": list(modes),
        "model": "small",
        "ranks": [{"rank": rank, "measured_step_ms": ms} for rank, ms in enumerate(measured)],
    }


@pytest.fixture
def runs(tmp_path):
    profile = small_profile(8)
    profile.save(tmp_path / "profile.json")
    paths = []
    for i, plan in enumerate(PLANS):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(report_of(profile, *plan)))
    return tmp_path / "profile.json", [str(path) for path in paths]


def test_the_factor_and_overhead_are_found_and_plan_again(runs, tmp_path, capsys):
    profile_path, reports = runs
    scaled = tmp_path / "scaled.json"
    code = main(["calibrate", "--profile", str(profile_path), *reports, "--profile-out", str(scaled), "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    fit = json.loads(out)
    assert fit["time_scale"] == pytest.approx(SCALE, rel=1e-4)
    assert fit["action_overhead_ms"] == pytest.approx(OVERHEAD_MS, abs=1e-4)
    assert fit["step_error_before"] > 0.1 and fit["step_error_after"] < 1e-4
    assert fit["runs"] == 3 and fit["written"] == [str(scaled)]
    original = load_profile(profile_path)
    assert [layer.forward_ms for layer in load_profile(scaled).layers] == pytest.approx(
        [SCALE * layer.forward_ms for layer in original.layers]
    )

    # The scaled profile and the overhead replay the first run as it was measured.
    schedule, chunks, counts = PLANS[0]
    spec = PipelineSpec(pipeline_parallel=4, chunks=chunks, micro_batches=8, schedule=schedule)
    keys = tmp_path / "plan.yaml"
    keys.write_text(yaml.safe_dump(evaluate_plan(original, spec, counts, ("none",) * 10).mindformers()))
    code = main(
        [
            "simulate",
            "--profile",
            str(scaled),
            "--mindformers-plan",
            str(keys),
            "--schedule",
            schedule,
            "--pipeline-parallel",
            "4",
            "--micro-batches",
            "8",
            "--p2p",
            str(P2P_MS),
            "--action-overhead",
            str(fit["action_overhead_ms"]),
            "--json",
        ]
    )
    replayed = json.loads(capsys.readouterr().out)
    measured = [rank["measured_step_ms"] for rank in json.loads(Path(reports[0]).read_text())["ranks"]]
    assert code == 0 and replayed["iteration_time"] == pytest.approx(max(measured), rel=1e-4)


def test_solve_plans_with_the_overhead(runs, capsys):
    profile_path, _ = runs
    base = [
        "solve",
        "--profile",
        str(profile_path),
        "--pipeline-parallel",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "1F1B",
        "--memory",
        "1GiB",
        "--json",
    ]
    assert main([*base, "--action-overhead", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    spec = PipelineSpec(pipeline_parallel=4, micro_batches=8, schedule="1F1B", action_overhead_ms=2.0)
    counts = plan["plan"]["virtual_stage_layers"]
    modes = [layer["recompute"] for layer in plan["plan"]["layers"]]
    expected = evaluate_plan(load_profile(profile_path), spec, counts, modes)
    assert plan["spec"]["action_overhead_ms"] == 2.0
    assert plan["iteration_time"] == pytest.approx(expected.iteration_time_ms)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("ranks"), "run0.json.ranks: expected one row per rank of its 4 (pipeline_parallel), got None"),
        (
            lambda r: r.update(pipeline_parallel=2),
            "run0.json.ranks: expected one row per rank of its 2 (pipeline_parallel), got 4 rows",
        ),
        (lambda r: r["ranks"][1].pop("measured_step_ms"), "run0.json.ranks[1].measured_step_ms: missing"),
        (lambda r: r.update(layer_modes=["none"] * 4), "run0.json.layer_modes: 4 layers, but the profile has 10"),
        (lambda r: r.update(stage_layer_counts=[3, 3, 3, 3]), "run0.json.stage_layer_counts: sum to 12"),
        (lambda r: r.update(schedule="Nope"), "run0.json.schedule"),
        (
            lambda r: r.update(data_parallel=2),
            "run0.json.data_parallel: is 2: calibrate fits runs of the pipeline alone",
        ),
    ],
)
def test_a_bad_report_is_one_line_naming_the_field(runs, capsys, change, message):
    profile_path, reports = runs
    report = json.loads(Path(reports[0]).read_text())
    change(report)
    with open(reports[0], "w") as file:
        json.dump(report, file)
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--profile", str(profile_path), reports[0]])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("sapp-hook calibrate: error: ") and message in err


def test_overhead_flag_errors(runs, tmp_path, capsys):
    profile_path, _ = runs
    with pytest.raises(SystemExit):
        main(
            [
                "solve",
                "--profile",
                str(profile_path),
                "--pipeline-parallel",
                "4",
                "--micro-batches",
                "8",
                "--schedule",
                "1F1B",
                "--memory",
                "1GiB",
                "--action-overhead",
                "-1",
            ]
        )
    assert "--action-overhead: expected a number of milliseconds >= 0, got -1" in capsys.readouterr().err
    plan_json = tmp_path / "plan.json"
    assert (
        main(
            [
                "solve",
                "--profile",
                str(profile_path),
                "--pipeline-parallel",
                "4",
                "--micro-batches",
                "8",
                "--schedule",
                "1F1B",
                "--memory",
                "1GiB",
                "--plan-out",
                str(plan_json),
                "--quiet",
            ]
        )
        == 0
    )
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", str(profile_path), "--plan", str(plan_json), "--action-overhead", "1"])
    assert "--action-overhead: a plan JSON states its own" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
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
                "--action-overhead",
                "1",
            ]
        )
    assert "--action-overhead needs --profile and --mindformers-plan" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["calibrate", "solve"])
def test_an_output_that_cannot_be_written_is_one_error_naming_its_flag(runs, capsys, command):
    profile_path, reports = runs
    unwritable = "/proc/sapp-hook-test.json"  # /proc is a folder no file can be made in
    if command == "calibrate":
        argv = ["calibrate", "--profile", str(profile_path), *reports, "--profile-out", unwritable]
        flag = "--profile-out"
    else:
        argv = [
            "solve",
            "--profile",
            str(profile_path),
            "--pipeline-parallel",
            "4",
            "--micro-batches",
            "8",
            "--schedule",
            "1F1B",
            "--memory",
            "1GiB",
            "--plan-out",
            unwritable,
            "--quiet",
        ]
        flag = "--plan-out"
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"sapp-hook {command}: error: {flag}: cannot write {unwritable}: ")
