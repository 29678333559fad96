"""`sapp_hook.build_stages`: a plan's stage modules for torch.distributed.pipelining, on transformers models."""

from __future__ import annotations

import pytest
import torch
from profiler_cases import batch, gpt2, llama

from profiler.layers import find_blocks
from sapp_hook import TiedGradients, build_stages, schedule_class
from sapp_hook.pipelining.stages import loss_tail
from sapp_hook.writeback import Layout, layout_from_dict
from simulator import InputError


def layout(
    counts: list[int],
    schedule: str = "1F1B",
    chunks: int = 1,
    modes: dict[int, str] | None = None,
    blocks: str = "model.layers",
) -> Layout:
    """Head, 4 body layers (`blocks`.0-3), tail over virtual stages holding `counts` layers each."""
    kinds = ["head", *["body:block"] * 4, "tail"]
    names = ["head", *[f"{blocks}.{j}" for j in range(4)], "tail"]
    stage_of = [v for v, count in enumerate(counts) for _ in range(count)]
    layers = [
        {"name": names[i], "kind": kind, "virtual_stage": stage_of[i], "recompute": (modes or {}).get(i, "none")}
        for i, kind in enumerate(kinds)
    ]
    spec = {"pipeline_parallel": len(counts) // chunks, "chunks": chunks, "micro_batches": 4, "schedule": schedule}
    return layout_from_dict({"spec": spec, "plan": {"layers": layers}})


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize(
    ("counts", "schedule", "chunks"),
    [([3, 3], "1F1B", 1), ([2, 1, 1, 2], "Interleaved1F1B", 2), ([1, 2, 2, 1], "ZBVZeroBubble", 2)],
)
def test_the_stages_in_order_compute_what_the_model_computes(make, counts, schedule, chunks):
    model = make().eval()
    plan = layout(counts, schedule, chunks)
    stages = dict(stage for rank in range(plan.pipeline_parallel) for stage in build_stages(model, plan, rank))
    assert sorted(stages) == list(range(len(counts)))
    ids = batch(0)
    hidden = ids
    with torch.no_grad():
        for index in range(len(counts)):
            hidden = stages[index](hidden)
        expected = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_the_loss_tail_computes_the_models_loss_from_the_last_blocks_output(make):
    """What the profiler splits the tail's backward on (`LayerProfiler(tail=...)`)."""
    model = make().eval()
    outputs = []
    last_block = find_blocks(model)[-1].module
    handle = last_block.register_forward_hook(
        lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out)
    )
    ids = batch(0)
    tail = loss_tail(model)
    with torch.no_grad():
        torch.manual_seed(3)
        labels = torch.randint(model.config.vocab_size, ids.shape)
        expected = model(input_ids=ids, labels=labels, use_cache=False).loss
        torch.manual_seed(3)  # the tail draws the same labels
        got = tail(outputs[0])
    handle.remove()
    torch.testing.assert_close(got, expected)
    assert tail.head is model.lm_head
    assert loss_tail(torch.nn.Linear(2, 2)) is None  # not a transformers causal LM: the profiler assumes the split


def test_each_layer_is_on_exactly_one_stage_and_recompute_is_applied():
    model = llama()
    plan = layout([2, 1, 1, 2], "Interleaved1F1B", 2, modes={1: "full", 3: "selective"})
    held = [id(block) for rank in range(2) for _, stage in build_stages(model, plan, rank) for block in stage.layers]
    blocks = [block.module for block in find_blocks(model)]
    assert sorted(held) == sorted(id(block) for block in blocks)
    assert blocks[0].gradient_checkpointing and blocks[2].gradient_checkpointing
    assert not getattr(blocks[1], "gradient_checkpointing", False)
    assert schedule_class(plan).__name__ == "ScheduleInterleaved1F1B"


def test_bad_plans_for_the_model():
    with pytest.raises(InputError, match="holds 4 body layers; the model has 5 blocks"):
        build_stages(llama(num_hidden_layers=5), layout([3, 3]), 0)
    with pytest.raises(InputError, match=r"rank: expected an integer 0..1, got 2"):
        build_stages(llama(), layout([3, 3]), 2)
    with pytest.raises(InputError, match=r"rank: expected an integer 0..1, got '0'"):  # was a TypeError
        build_stages(llama(), layout([3, 3]), "0")
    with pytest.raises(InputError, match="has no ZBH1"):
        schedule_class(layout([3, 3], "ZBH1"))


def test_a_plan_made_for_another_model_is_warned_about(caplog):
    build_stages(llama(), layout([3, 3]), 0)
    build_stages(llama(), layout([3, 3], blocks="layers"), 0)  # an estimate names them after the config
    assert "was the plan made for this model" not in caplog.text
    build_stages(gpt2(), layout([3, 3]), 0)  # as many blocks, other names: it runs, but was planned for Llama
    assert "the plan's body layer 'model.layers.0' is the model's block 'transformer.h.0'" in caplog.text


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_under_a_split_backward_schedule_is_refused(mode):
    with pytest.raises(
        InputError,
        match="plan: recomputes layers; ZBVZeroBubble splits each backward in two, and "
        "torch runs a checkpointed block again for every weight-gradient group",
    ):
        build_stages(llama(), layout([1, 2, 2, 1], "ZBVZeroBubble", 2, modes={2: mode}), 0)


def test_a_tied_embedding_split_over_ranks_is_warned_about(caplog):
    build_stages(
        gpt2(), layout([3, 3], blocks="transformer.h"), 0
    )  # transformers' GPT-2 ties its LM head to the embedding
    assert "ties its embedding and LM head, which this plan puts on ranks [0, 1]" in caplog.text
    caplog.clear()
    build_stages(
        gpt2(), layout([1, 2, 2, 1], "ZBVZeroBubble", 2, blocks="transformer.h"), 0
    )  # a V puts both ends on rank 0
    assert "ties its embedding" not in caplog.text


def test_tied_gradients_have_nothing_to_do_in_one_process():
    model = gpt2()  # every stage in this process shares the one weight
    tied = TiedGradients(model, layout([3, 3]), 0)
    tied()
    assert tied.weight is model.lm_head.weight and tied.group is None and tied.weight.grad is None
