"""`sapp-hook simulate`: the JSON contract, the human report, outputs, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_args import with_flags

from sapp_hook.cli import main

BASE = [
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


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, err = run(capsys, *BASE, "--json", "--activation", "1GiB", "--static", "10GB")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["iteration_time"] == (8 + 4 - 1) * 3
    assert set(report["bubble"]) == {"real", "ideal", "imbalance", "recompute", "comm"}
    assert report["bubble"]["ideal"] == pytest.approx(3 / 8)
    assert report["rank_peak_memory_bytes"] == [10**10 + k * 2**30 for k in (4, 3, 2, 1)]
    assert report["rank_peak_activations"] == [4, 3, 2, 1]
    assert report["time_unit"] == "ms" and report["written"] == []


def test_chunks_split_the_whole_rank_times(capsys):
    _, out, _ = run(capsys, *BASE[:2], "Interleaved1F1B", *BASE[3:], "--chunks", "2", "--json")
    # M(F+B) + (S-1)(F+B)/V
    assert json.loads(out)["iteration_time"] == pytest.approx(8 * 3 + 3 * 3 / 2)


def test_zero_bubble_weight(capsys):
    _, out, _ = run(capsys, *BASE[:2], "ZBH1", *BASE[3:], "--weight", "0.5", "--json")
    report = json.loads(out)
    assert report["iteration_time"] == pytest.approx(8 * 3 + 3 * (3 - 2 * 0.5))
    assert report["weight_split_assumed"] is False


def test_human_report_says_what_it_took(capsys):
    code, out, err = run(capsys, *BASE[:2], "ZBH1", *BASE[3:], "--static", "52GiB")
    assert code == 0
    assert "--static 52GiB = 55,834,574,848 bytes (52 GiB)" in err
    assert "iteration time  27 ms" in out  # M(F+B) + (S-1)(F+B-2W) with W = B/2
    assert "I and W each took half of B" in out
    assert out.count("\n") == 4 + 1 + 4  # header, time, bubble, note, table header, 4 ranks


def test_outputs_are_written(capsys, tmp_path):
    plot, trace, csv = tmp_path / "g.svg", tmp_path / "t.json", tmp_path / "s.csv"
    code, out, _ = run(capsys, *BASE, "--plot", str(plot), "--trace", str(trace), "--csv", str(csv), "--json")
    assert code == 0
    assert json.loads(out)["written"] == [str(plot), str(trace), str(csv)]
    assert plot.read_bytes().startswith(b"<?xml")
    assert json.loads(trace.read_text())["traceEvents"]
    assert csv.read_text().splitlines()[3] == "3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3,3F4,3B4,3F5,3B5,3F6,3B6,3F7,3B7"


def test_quiet_prints_nothing(capsys):
    assert run(capsys, *BASE, "--quiet") == (0, "", "")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--schedule", "Nope"], "--schedule: expected one of"),
        (["--pipeline-parallel", "0"], "--pipeline-parallel: expected an integer >= 1, got 0"),
        (["--pipeline-parallel", "two"], "argument --pipeline-parallel: invalid int value: 'two'"),
        (["--micro-batches", "-3"], "--micro-batches: expected an integer >= 1, got -3"),
        (["--forward", "-1"], "--forward: expected a number of milliseconds >= 0, got -1"),
        (["--backward", "nan"], "--backward: expected a number of milliseconds >= 0, got nan"),
        (["--weight", "5"], "--weight: expected at most --backward (2), got 5"),
        (["--chunks", "2"], "--chunks: 1F1B runs exactly 1 chunk per rank, got 2"),
        (["--activation", "3"], "--activation: expected a unit"),
        (["--forward", "1e300"], "--forward: expected at most 1e+09 ms, got 1e+300"),
        (["--working", "2000000TB"], "--working: expected at most 2**50 bytes (1 PiB)"),
        (
            ["--pipeline-parallel", "100000", "--micro-batches", "100000"],
            "make 20,000,000,000 actions; expected at most",
        ),
        (["--plot", "out.gif"], "--plot: expected a file ending in .png, .svg, .pdf"),
        (["--trace", "/nonexistent-dir/t.json"], "--trace: folder /nonexistent-dir does not exist"),
    ],
)
def test_errors_are_one_line_and_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as caught:
        main(with_flags(BASE, args))
    out, err = capsys.readouterr()
    assert caught.value.code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("sapp-hook simulate: error: ")
    assert message in err


def test_missing_required_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["simulate", "--schedule", "1F1B"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and "required" in err


def test_console_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "sapp_hook", *BASE, "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["iteration_time"] == 33.0


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`sapp-hook ... | head`: the pipe closes before the report is written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sapp_hook", *BASE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait() == 1
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
