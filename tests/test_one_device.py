"""A rank's actions run in one process hold the activations the simulator predicts for that rank."""

from __future__ import annotations

import pytest
import transformers
from profiler_cases import GPT2

from sapp_hook.models import build_model, profile_example
from sapp_hook.validation.one_device import run_on_one_device
from sapp_hook.validation.validate import predictions
from simulator import InputError
from solver import PipelineSpec, even_plan
from solver.vocabulary.profile import FULL, NONE

MICRO_BATCH_SIZE, SEQ_LEN = 2, 32


@pytest.fixture(scope="module")
def config():
    # untied and without dropout, as in test_validate: GPT-2 has no rotary tables, which every stage
    # computes but the profile puts on the first block
    return transformers.GPT2Config(**GPT2, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.fixture(scope="module")
def profile(config):
    return profile_example(config, steps=1, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, modes=(NONE, FULL))


@pytest.mark.parametrize(
    ("schedule", "chunks", "mode"),
    [("1F1B", None, NONE), ("1F1B", None, FULL), ("GPipe", None, NONE), ("Interleaved1F1B", 2, FULL)],
)
def test_each_rank_holds_its_predicted_activation_peak(config, profile, schedule, chunks, mode):
    plan = even_plan(
        profile, PipelineSpec(pipeline_parallel=2, chunks=chunks, micro_batches=4, schedule=schedule), mode
    )
    predicted = predictions(plan, profile, input_bytes=MICRO_BATCH_SIZE * SEQ_LEN * 8)
    whole = predictions(plan, profile)  # its peak_bytes keep the token ids and kept outputs, as the plan's peaks
    for rank in range(2):
        assert whole["peak_bytes"][rank] + whole["static_bytes"][rank] == pytest.approx(
            plan.rank_peak_memory_bytes[rank]
        )
    model = build_model(config)
    for rank in range(2):
        measured = run_on_one_device(model, plan, rank, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN)
        assert measured.held_peak_bytes == predicted["activation_peak_bytes"][rank]
        assert measured.forward_ms > 0 and measured.backward_ms > 0
        assert measured.allocated_peak_bytes is None  # no allocator counters on the CPU


def test_no_steps_is_refused(config, profile):
    plan = even_plan(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B"), NONE)
    with pytest.raises(InputError, match="steps: expected an integer >= 1, got 0"):
        run_on_one_device(build_model(config), plan, 0, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, steps=0)


def test_split_backward_schedules_are_refused(config, profile):
    plan = even_plan(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="ZBH1"), NONE)
    with pytest.raises(
        InputError, match="plan: ZBH1 splits the backward into I and W actions; a one-device run takes F and B only"
    ):
        run_on_one_device(build_model(config), plan, 0, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN)
