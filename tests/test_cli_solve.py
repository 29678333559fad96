"""`sapp-hook solve`, and `sapp-hook simulate` replaying a plan: the contract and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml
from cli_args import with_flags
from solver_cases import SAPP, small_profile

from sapp_hook.cli import main
from sapp_hook.report import plan_report
from solver import PipelineSpec, evaluate_plan, even_plan, load_profile

CASE = [
    "--profile",
    str(SAPP / "test.json"),
    "--pipeline-parallel",
    "4",
    "--chunks",
    "2",
    "--micro-batches",
    "8",
    "--schedule",
    "Interleaved1F1B",
]
SOLVE = ["solve", *CASE, "--memory", "53000MiB"]


def test_solve_json_contract_and_files(capsys, tmp_path):
    mf, plan_json, chart = tmp_path / "mf.yaml", tmp_path / "plan.json", tmp_path / "plan.png"
    code = main([*SOLVE, "--json", "--mindformers-yaml", str(mf), "--plan-out", str(plan_json), "--plot", str(chart)])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    report = json.loads(out)
    for key in ("status", "iteration_time", "rank_peak_memory_bytes", "solve_seconds", "bubble", "plan"):
        assert key in report
    assert report["status"] == "optimal" and report["iteration_time"] == 153000.0
    assert set(report["bubble"]) == {"real", "ideal", "imbalance", "recompute", "comm"}
    for key in ("offset", "recompute", "select_recompute", "select_comm_recompute", "pp_interleave_num"):
        assert key in report["plan"]
    assert max(report["rank_peak_memory_bytes"]) <= 53000 * 2**20
    assert yaml.safe_load(mf.read_text())["offset"] == report["plan"]["offset"]
    assert json.loads(plan_json.read_text())["plan"]["layers"] == report["plan"]["layers"]
    assert chart.read_bytes().startswith(b"\x89PNG")
    assert report["written"] == [str(chart), str(mf), str(plan_json)]


@pytest.mark.parametrize(
    ("memory", "line"),
    [
        ("200GB", "even split      144,810 ms: the plan is 1.00x as fast"),
        (
            "53000MiB",
            (
                "even split      does not fit: rank 0 peaks at 125 GiB; with full recompute 192,330 ms, "
                "the plan is 1.07x as fast"
            ),
        ),
    ],
)
def test_solve_compares_its_plan_with_the_even_split(capsys, memory, line):
    argv = [
        "solve",
        "--profile",
        str(SAPP / "test.json"),
        "--pipeline-parallel",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "1F1B",
        "--memory",
        memory,
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == line
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    profile = load_profile(SAPP / "test.json")
    spec = PipelineSpec(
        pipeline_parallel=4, micro_batches=8, schedule="1F1B", memory_budget_bytes=report["memory_budget_bytes"]
    )
    even, full = even_plan(profile, spec), even_plan(profile, spec, "full")
    assert report["even_split"]["iteration_time"] == even.iteration_time_ms
    assert report["even_split"]["fits"] == even.fits
    assert report["even_split"]["full_recompute_iteration_time"] == (None if even.fits else full.iteration_time_ms)


def test_simulate_replays_a_mindformers_plan_and_a_plan_json(capsys, tmp_path):
    main(
        [*SOLVE, "--quiet", "--mindformers-yaml", str(tmp_path / "mf.yaml"), "--plan-out", str(tmp_path / "plan.json")]
    )
    main(["simulate", *CASE, "--mindformers-plan", str(tmp_path / "mf.yaml"), "--json"])
    from_keys = json.loads(capsys.readouterr().out)
    main(["simulate", "--profile", str(SAPP / "test.json"), "--plan", str(tmp_path / "plan.json"), "--json"])
    from_plan = json.loads(capsys.readouterr().out)
    assert from_keys["iteration_time"] == from_plan["iteration_time"] == 153000.0
    assert from_keys["status"] == "given"


def test_simulate_refuses_flags_a_plan_json_contradicts(capsys, tmp_path):
    main([*SOLVE, "--quiet", "--plan-out", str(tmp_path / "plan.json")])
    replay = ["simulate", "--profile", str(SAPP / "test.json"), "--plan", str(tmp_path / "plan.json"), "--json"]
    assert main([*replay, *CASE[2:]]) == 0  # the plan's own settings, said again: fine
    capsys.readouterr()
    for flags, words in [
        (["--pipeline-parallel", "8"], "--pipeline-parallel: 8 differs from the plan's spec.pipeline_parallel (4)"),
        (["--schedule", "ZBH1"], "--schedule: ZBH1 differs from the plan's spec.schedule (Interleaved1F1B)"),
        (["--micro-batches", "16"], "--micro-batches: 16 differs from the plan's spec.micro_batches (8)"),
        (
            ["--memory", "1GB"],
            "--memory: 1,000,000,000 differs from the plan's spec.memory_budget_bytes (55,574,528,000)",
        ),
        (["--p2p", "0.5"], "--p2p: 0.5 differs from the plan's spec.p2p_ms (0)"),
    ]:
        with pytest.raises(SystemExit):
            main([*replay, *flags])
        assert words in capsys.readouterr().err


def test_receive_buffers_count_in_every_peak(capsys, tmp_path):
    """--receive-buffers (torch's engine): each rank holds a buffer of stage_output_bytes per micro-batch
    for its input or its output gradient, and under 1F1B one send more; a plan JSON states it, and a
    replay may not say otherwise."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(dataclasses.replace(small_profile(6), stage_output_bytes=2**20).to_dict()))
    solve = [
        "solve",
        "--profile",
        str(profile),
        "--pipeline-parallel",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        "1F1B",
        "--memory",
        "10GiB",
        "--json",
    ]
    peaks = []
    for flags in ([], ["--receive-buffers"]):
        assert main([*solve, *flags, "--plan-out", str(tmp_path / f"plan{len(flags)}.json")]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["rank_peak_memory_bytes"])
    # and the one send Schedule1F1B holds past its micro-batch on each rank (`torch_1f1b_held_bytes`)
    assert [with_buffers - without for without, with_buffers in zip(*peaks)] == [(4 + 1) * 2**20, (4 + 1) * 2**20]
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", str(profile), "--plan", str(tmp_path / "plan0.json"), "--receive-buffers"])
    assert "--receive-buffers: true differs from the plan's spec.receive_buffers (false)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
                "simulate",
                "--schedule",
                "1F1B",
                "--pipeline-parallel",
                "2",
                "--micro-batches",
                "4",
                "--forward",
                "1",
                "--backward",
                "2",
                "--receive-buffers",
            ]
        )
    assert "--receive-buffers needs --profile" in capsys.readouterr().err


def test_simulate_reads_a_mindformers_training_config(capsys, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(
        "# a MindFormers config\n"
        "parallel_config:\n  pipeline_stage: 4\n"
        "recompute_config:\n  recompute: [23, 19, 16, 13]\n  select_recompute: [23, 19, 16, 13]\n"
        "  select_comm_recompute: [23, 19, 16, 13]\n"
        "model:\n  model_config:\n    offset: [-1, 0, 0, 1]\n"
    )
    args = [
        "simulate",
        "--profile",
        str(SAPP / "test.json"),
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
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time"] == 179910.0  # SAPP's own figure for this plan


@pytest.mark.parametrize(
    "text, words",
    [
        (
            "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
            + "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi")),
            "an alias bomb",
        ),
        ("offset: " + "[" * 40 + "0" + "]" * 40 + "\n", "nested deeper than 32"),
        ("offset: [1, 2\n", "not valid YAML"),
        ("!!python/object/apply:os.system ['echo hi']\n", "not valid YAML"),
        ("just text\n", "expected a mapping"),
    ],
)
def test_unsafe_or_broken_yaml_is_one_line(capsys, tmp_path, text, words):
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    with pytest.raises(SystemExit) as caught:
        main(["simulate", *CASE, "--mindformers-plan", str(plan)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and words in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory", "50"], "--memory: expected a unit"),
        (["--memory", "1GiB"], "--memory: no plan fits 1 GiB: the smallest budget that fits is"),
        (["--time-limit", "0"], "--time-limit: expected a number of seconds > 0"),
        (["--pipeline-parallel", "0"], "--pipeline-parallel: expected an integer >= 1"),
        (["--zero-stage", "5"], "argument --zero-stage: invalid choice"),
        (["--profile", "/nonexistent.json"], "profile: cannot read /nonexistent.json"),
        (["--plan-out", "/nonexistent-dir/p.json"], "--plan-out: folder /nonexistent-dir does not exist"),
    ],
)
def test_solve_errors_are_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as caught:
        main(with_flags(SOLVE, args))
    out, err = capsys.readouterr()
    assert caught.value.code == (3 if "no plan fits" in message else 2) and out == ""  # 3: no plan fits
    lines = err.splitlines()
    assert message in lines[-1] and sum("error:" in line for line in lines) == 1
    if "no plan fits" not in message:  # found only after solving, behind its progress lines
        assert len(lines) == 1


def test_solve_refuses_a_profile_with_a_negative_sequence(capsys, tmp_path):
    data = small_profile(6).to_dict()
    data["micro_batch"] = {"size": 1, "sequence": -4096}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(data))
    args = [
        "solve",
        "--profile",
        str(profile),
        "--pipeline-parallel",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        "1F1B",
    ]
    args += ["--memory", "1GiB"]
    with pytest.raises(SystemExit) as caught:
        main(args)
    out, err = capsys.readouterr()
    assert caught.value.code == 2 and out == ""
    refusal = "micro_batch.sequence: expected an integer from 1 to 2**50, got -4096"
    assert err.splitlines() == [f"sapp-hook solve: error: --profile: {profile}: {refusal}"]


def test_modes_limit_the_recompute_a_plan_may_use(capsys, tmp_path):
    profile = tmp_path / "profile.json"
    small_profile(6).save(profile)  # none, selective and full for every body layer
    argv = [
        "solve",
        "--profile",
        str(profile),
        "--pipeline-parallel",
        "2",
        "--chunks",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        "ZBVZeroBubble",
        "--memory",
        "400MiB",
    ]
    assert main(argv) == 0
    report = capsys.readouterr().out
    # on torch, a split backward runs a checkpointed block again for every weight-gradient group
    assert "selective 2" in report and "splits each backward in two" in report and "--modes none plans" in report
    assert main([*argv, "--modes", "none,full", "--json"]) == 0
    modes = {layer["recompute"] for layer in json.loads(capsys.readouterr().out)["plan"]["layers"]}
    assert modes == {"none", "full"}
    with pytest.raises(SystemExit):
        main([*argv, "--modes", "none,fast"])
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("--modes: expected modes among none, selective, comm, selective+comm, full, got fast")
    )


def test_simulate_profile_needs_a_plan(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", *CASE])
    assert "--profile needs one of --mindformers-plan FILE or --plan FILE" in capsys.readouterr().err


def test_json_stdout_is_clean_in_a_fresh_process():
    # HiGHS prints a banner on the C-level stdout the first time; it must not reach --json.
    done = subprocess.run([sys.executable, "-m", "sapp_hook", *SOLVE, "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "optimal"


def test_the_plan_table_keeps_its_columns_with_long_recompute_lists():
    profile = load_profile(SAPP / "sim.json")  # modes none, full, selective+comm, comm, ...
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B")
    body = [index for index, layer in enumerate(profile.layers) if layer.is_body]
    modes = ["none"] * len(profile.layers)
    for index, mode in zip(body[:3], ("full", "selective+comm", "comm")):
        modes[index] = mode
    half = len(profile.layers) // 2
    table = plan_report(evaluate_plan(profile, spec, [half, len(profile.layers) - half], modes)).splitlines()
    rows = [line for line in table if line.lstrip().startswith(("rank", "0 ", "1 "))]
    assert "full 1, selective+comm 1, comm 1" in rows[1]
    assert len({len(row) for row in rows}) == 1  # the peak memory column, right-aligned, ends where its header does


@pytest.mark.parametrize(
    ("schedule", "flags", "noted"),
    [
        ("ZBVZeroBubble", [], "profile with --tensor-parallel"),
        ("ZBVZeroBubble", ["--sequence-parallel"], "tensor x sequence parallel"),
        ("1F1B", [], None),
    ],
)
def test_solve_and_simulate_note_the_margin_zbv_x_tensor_parallel_needs(capsys, tmp_path, schedule, flags, noted):
    """The layouts measured to run above their prediction (docs/results/nd-validation.md) say so; a
    profile measured on the mesh is not noted (tests/test_validate_mesh.py shows it exact)."""
    profile, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert main(["profile", "--estimate", "--model", "tiny-llama", "--out", str(profile), "--quiet"]) == 0
    argv = [
        "solve",
        "--profile",
        str(profile),
        "--pipeline-parallel",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        schedule,
    ]
    assert main([*argv, "--memory", "1TB", "--tensor-parallel", "2", *flags, "--plan-out", str(plan)]) == 0
    solved = capsys.readouterr().err
    assert main(["simulate", "--profile", str(profile), "--plan", str(plan)]) == 0
    for err in (solved, capsys.readouterr().err):
        assert ("up to 8% above its prediction" in err) == (noted is not None)
        assert noted is None or noted in err
    mesh = {"tensor_parallel": 2, "sequence_parallel": bool(flags)}  # as `profile --tensor-parallel 2` writes it
    profile.write_text(json.dumps({**json.loads(profile.read_text()), "mesh": mesh}))
    assert main([*argv, "--memory", "1TB", "--tensor-parallel", "2", *flags]) == 0
    assert ("up to 8% above its prediction" in capsys.readouterr().err) == bool(flags)


@pytest.mark.parametrize(
    "recompute, chunks, said",
    [
        ("[2, 0, 30, 0]", "1", ["recompute[2] is 30, above the 24 layers that stage holds: MindFormers recomputes 24"]),
        (
            "[[2, 0, 30, 0], [0, 0, 0, 13]]",
            "2",
            [
                "recompute[0][2] is 30, above the 12 layers that stage holds: MindFormers recomputes 12",
                "recompute[1][3] is 13, above the 12 layers that stage holds: MindFormers recomputes 12",
            ],
        ),
    ],
)
def test_a_recompute_count_above_a_stages_layers_is_said(capsys, tmp_path, recompute, chunks, said):
    """MindFormers lowers such a count to the layers the stage holds; the replay does too, and says so."""
    config = tmp_path / "mf.yaml"
    config.write_text(f"recompute_config:\n  recompute: {recompute}\n")
    args = [*CASE[:2], "--pipeline-parallel", "4", "--chunks", chunks, "--micro-batches", "8"]
    schedule = "1F1B" if chunks == "1" else "Interleaved1F1B"
    assert main(["simulate", *args, "--schedule", schedule, "--mindformers-plan", str(config), "--json"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [f"sapp-hook simulate: warning: {config}: {line}" for line in said]
