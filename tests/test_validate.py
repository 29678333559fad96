"""`sapp-hook validate` in small: a 4-layer GPT-2 on 2 gloo processes. The plan runs, every layer is on
exactly one stage, losses are the model's own, and the saved-activation peaks are the predicted ones."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from cli_args import with_flags
from profiler_cases import GPT2

from sapp_hook.models import build_model, load_config, random_batch
from sapp_hook.validation.validate import Setup, profile_for, validate
from simulator import InputError
from solver import evaluate_plan


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "config.json"
    # untied: a tied embedding and LM head on two ranks would need their gradients all-reduced;
    # no dropout, so that the pipelined losses can equal the model's own
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    path.write_text(json.dumps({"model_type": "gpt2", **GPT2, "tie_word_embeddings": False, **no_dropout}))
    return str(path)


@pytest.mark.parametrize(
    ("schedule", "stages", "chunks", "plan"),
    [
        ("1F1B", 2, None, "solve"),
        ("Interleaved1F1B", 2, 2, "even-full"),
        ("DualPipeV", 2, None, "even"),
        ("ZBVZeroBubble", 2, None, "solve"),
        (
            "DualPipeV",
            1,
            None,
            "even",
        ),  # one rank runs both legs of the V (its P2P timing once waited on a second rank)
    ],
)
def test_a_plan_runs_as_predicted(gpt2_config, schedule, stages, chunks, plan):
    setup = Setup(
        model=gpt2_config,
        pipeline_parallel=stages,
        chunks=chunks,
        schedule=schedule,
        micro_batches=4,
        steps=2,
        micro_batch_size=2,
        seq_len=32,
        plan=plan,
        profile_steps=1,
    )
    report = validate(setup)
    assert len(report["ranks"]) == stages and (report["p2p_ms"] == 0) == (stages == 1)
    held = [name for row in report["ranks"] for name in row["layers"]]
    assert sorted(held) == [f"transformer.h.{i}" for i in range(4)]  # each block on exactly one rank
    for row in report["ranks"]:
        assert row["measured_activation_peak_bytes"] == row["predicted_activation_peak_bytes"]
        assert row["measured_static_bytes"] == row["predicted_static_bytes"]
        # torch's stages keep a receive buffer per micro-batch for the inputs and output gradients
        assert row["measured_receive_buffer_bytes"] == row["predicted_receive_buffer_bytes"] > 0
        # the allocator's peak as predicted, but for the Python floats of GPT-2's GELU, which `mul` saves
        # for backward as 8-byte wrapped-number tensors that saved-tensor hooks never see (three a block,
        # freed by its backward; on the CPU only, CUDA ops keep such scalars on the host): 28-192 bytes
        assert 0 <= row["measured_allocated_peak_bytes"] - row["predicted_peak_bytes"] <= 256, row
    # What torch keeps to the step's end (plan.torch_engine_bytes): the tensors its stages sent, whose
    # requests it waits on last, where the backward is split the input gradients, and the losses
    # (4 bytes each) on the last stage. Schedule1F1B names no actions to the profiler.
    for row in report["ranks"]:
        if schedule == "1F1B":
            assert row["measured_step_end_bytes"] is None
            continue
        assert row["measured_step_end_bytes"] == row["predicted_step_end_bytes"]
    config = load_config(gpt2_config)
    model = build_model(config)
    batch = random_batch(config, 2 * 4, 32, seed=0)["input_ids"]
    with torch.no_grad():
        expected = [model(input_ids=chunk, labels=chunk).loss.item() for chunk in batch.chunk(4)]
    assert report["losses"][0] == pytest.approx(expected, rel=1e-5)


def test_a_rank_whose_peak_is_the_lm_heads_weight_gradient_is_predicted_to_the_byte():
    """tiny-llama's first rank under ZBVZeroBubble at 64 tokens peaks in its last stage's W, at the LM
    head's weight gradient, after the blocks' W have freed their pending gradients and what only their
    weight gradients used (`RecomputeCost.weight_freed_bytes`; counting the pending gradients alone
    put that peak 876,544 bytes over)."""
    setup = Setup(
        model="tiny-llama",
        pipeline_parallel=2,
        schedule="ZBVZeroBubble",
        micro_batches=4,
        steps=1,
        micro_batch_size=1,
        seq_len=64,
        plan="even",
        profile_steps=1,
    )
    report = validate(setup)
    assert [row["measured_allocated_peak_bytes"] - row["predicted_peak_bytes"] for row in report["ranks"]] == [0, 0]


def test_the_cli_loop_validate_then_calibrate(gpt2_config, tmp_path, capsys):
    """`validate --profile-out` saves the profile it planned from; a second run plans from it
    (`--profile`); `calibrate` fits both runs."""
    from sapp_hook.cli import main

    profile = tmp_path / "profile.json"
    base = [
        "validate",
        "--model",
        gpt2_config,
        "--pipeline-parallel",
        "2",
        "--schedule",
        "1F1B",
        "--micro-batches",
        "4",
        "--steps",
        "2",
        "--micro-batch-size",
        "2",
        "--seq-len",
        "32",
        "--json",
    ]
    reports = []
    for flags in (["--even", "--profile-out", str(profile)], ["--even-full", "--profile", str(profile)]):
        assert main([*base, *flags]) == 0
        reports.append(tmp_path / f"run{len(reports)}.json")
        reports[-1].write_text(capsys.readouterr().out)
    assert json.loads(reports[1].read_text())["layer_modes"][1] == "full"
    assert main(["calibrate", "--profile", str(profile), *map(str, reports), "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["runs"] == 2 and fit["time_scale"] > 0
    assert fit["step_error_after"] <= fit["step_error_before"]


@pytest.mark.parametrize(
    ("model", "micro_batch", "message"),
    [
        ("tiny-llama", {}, "is a profile of 'tiny-llama'; this run trains"),
        ("", {"size": 1, "sequence": 128}, "was measured at 1 x 128 tokens per micro-batch; this run uses 2 x 32"),
    ],
)
def test_a_profile_of_another_model_or_shape_is_refused(gpt2_config, model, micro_batch, message):
    import dataclasses

    from solver_cases import small_profile

    profile = dataclasses.replace(small_profile(4), model=model, micro_batch=micro_batch)
    setup = Setup(
        model=gpt2_config, pipeline_parallel=2, schedule="1F1B", micro_batches=4, micro_batch_size=2, seq_len=32
    )
    with pytest.raises(InputError, match="profile") as error:
        validate(setup, profile=profile)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
        (["--seq-len", "0"], "--seq-len: expected an integer >= 1, got 0"),
        (["--pipeline-parallel", "64"], "--pipeline-parallel: 64 x 1 (ranks x chunks) make 64 virtual stages"),
        # refused before the profiling, where the run once crashed after it
        (
            ["--schedule", "ZBH1"],
            (
                "--schedule: torch.distributed.pipelining has no ZBH1; it runs GPipe, 1F1B, "
                "Interleaved1F1B, ZBVZeroBubble, DualPipeV"
            ),
        ),
        (["--tensor-parallel", "3"], "--tensor-parallel: 3 does not divide the model's num_attention_heads (8)"),
        (["--data-parallel", "0"], "--data-parallel: expected an integer >= 1, got 0"),
    ],
)
def test_cli_bad_input_names_the_flag(capsys, flags, message):
    from sapp_hook.cli import main

    argv = [
        "validate",
        "--model",
        "tiny-llama",
        "--pipeline-parallel",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        "1F1B",
    ]
    with pytest.raises(SystemExit) as caught:
        main(with_flags(argv, flags))
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("error:") == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--reshard-after-forward"], "--reshard-after-forward: needs fsdp"),
        (
            ["--data-parallel", "2", "--fsdp", "--reshard-after-forward", "--schedule", "ZBVZeroBubble"],
            (
                "--reshard-after-forward: ZBVZeroBubble splits the backward, and torch's split backward under FSDP with "
                "reshard after forward drops gradients"
            ),
        ),
        (
            ["--data-parallel", "2", "--ddp", "--schedule", "DualPipeV"],
            "--ddp: DualPipeV splits the backward, which torch's DDP reducer refuses",
        ),
        (["--sequence-parallel"], "--sequence-parallel: needs tensor_parallel > 1"),
        (
            ["--tensor-parallel", "2", "--sequence-parallel", "--seq-len", "127"],
            "--sequence-parallel: --seq-len 127 is not a multiple of --tensor-parallel 2",
        ),
    ],
)
def test_cli_a_layout_torch_does_not_run_is_refused_before_profiling(capsys, flags, message):
    from sapp_hook.cli import main

    with pytest.raises(SystemExit) as caught:
        main(
            [
                "validate",
                "--model",
                "tiny-llama",
                "--pipeline-parallel",
                "2",
                "--micro-batches",
                "4",
                "--schedule",
                "1F1B",
                *flags,
            ]
        )
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("error:") == 1


def test_recompute_is_refused_where_the_schedule_splits_the_backward(capsys):
    """torch runs a checkpointed block again for every weight-gradient group of a split backward
    (sapp_hook.pipelining.engine_rules): an even split with full recompute is refused before any profiling."""
    from sapp_hook.cli import main

    with pytest.raises(SystemExit) as caught:
        main(
            [
                "validate",
                "--model",
                "tiny-llama",
                "--pipeline-parallel",
                "2",
                "--micro-batches",
                "4",
                "--schedule",
                "DualPipeV",
                "--even-full",
            ]
        )
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("error:") == 1
    assert "--even-full: DualPipeV splits each backward in two, and torch runs a checkpointed block again" in err


def test_the_allocator_peak_of_a_step_is_counted_from_its_lowest_point():
    """torch.profiler's memory events, summed in order: 1 MiB and 2 MiB live, then 1 MiB freed and 0.5 MiB
    taken: 3 MiB at the peak, whatever was allocated before the step. What is held when the last action
    torch names ends (2 MiB) is the step's end; a step without named actions has none."""
    from torch.profiler import record_function

    from sapp_hook.validation.rank import _allocated_bytes

    before = torch.empty(2**20)  # noqa: F841 (held: not counted)

    def step(named: bool):
        with record_function("PP:0F0" if named else "something else"):
            first = torch.empty(2**18)
            second = torch.empty(2**19)
            del first
        third = torch.empty(2**17)  # after the last action, as torch's final waits on its sends are
        return second, third

    assert _allocated_bytes(lambda: step(named=True)) == (3 * 2**20, 2 * 2**20)
    assert _allocated_bytes(lambda: step(named=False)) == (3 * 2**20, None)


def test_what_the_step_before_kept_is_freed_where_the_step_frees_it():
    """A step that replaces, midway, 1 MiB the step before kept (as torch's V schedules replace their
    hand-offs): the free is counted, so the peak is the 2 MiB of work, not 3. The profiler records no
    free of a block allocated before it started: measured in one profiled step, this read 3 MiB."""
    from torch.profiler import record_function

    from sapp_hook.validation.rank import _allocated_bytes

    kept = [torch.empty(2**18)]  # what the step before kept

    def step():
        with record_function("PP:0B0"):
            work = torch.empty(2**19)
            kept.clear()
            kept.append(torch.empty(2**18))
            del work

    assert _allocated_bytes(step) == (2 * 2**20, 0)


def test_a_free_the_profiler_did_not_see_is_counted_where_its_address_is_taken_again():
    """gloo's worker thread may drop a collective's last reference, and the profiler records no event on
    that thread: the block then seems held forever. An allocation at its address says it was freed."""
    from types import SimpleNamespace

    from sapp_hook.validation.rank import memory_changes

    class _ExtraFields_Allocation(SimpleNamespace):
        pass

    def event(time_ns: int, size: int, address: int) -> SimpleNamespace:
        return SimpleNamespace(
            start_time_ns=time_ns, children=[], extra_fields=_ExtraFields_Allocation(alloc_size=size, ptr=address)
        )

    other = SimpleNamespace(start_time_ns=0, extra_fields=None, children=[event(3, -100, 1)])  # a range holding a free
    tree = [event(1, 100, 1), other, event(2, 50, 2), event(4, 80, 2), event(5, -80, 2)]
    assert memory_changes(tree) == [(1, 100), (2, 50), (3, -100), (4, -50), (4, 80), (5, -80)]


@pytest.mark.parametrize(
    "blocks",
    [
        pytest.param(["selective"], id="every-block-selective"),
        pytest.param(["none", "selective", "full"], id="modes-mixed"),
    ],
)
def test_a_plan_that_recomputes_some_blocks_is_predicted_to_the_byte(tmp_path, blocks):
    """Selective checkpointing, like full, keeps the rotary tables through its own frame, where autograd's
    hooks do not see them; with the blocks' modes mixed, a block's backward comes after the later blocks'
    have freed their activations (a fully recomputed block's working set is not stacked on them)."""
    setup = Setup(model="tiny-llama", pipeline_parallel=2, schedule="1F1B", micro_batches=4, steps=1, profile_steps=1)
    profile = profile_for(setup)
    body = len(profile.layers) - 2
    modes = ["none", *(blocks[i % len(blocks)] for i in range(body)), "none"]
    plan = evaluate_plan(profile, setup.spec(), [len(modes) // 2, len(modes) - len(modes) // 2], modes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    report = validate(dataclasses.replace(setup, plan=str(path)), profile=profile)
    assert report["layer_modes"] == modes
    for row in report["ranks"]:
        assert row["measured_activation_peak_bytes"] == row["predicted_activation_peak_bytes"], row["rank"]
        assert row["measured_allocated_peak_bytes"] == row["predicted_peak_bytes"], row["rank"]
