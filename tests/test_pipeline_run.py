"""A plan run by torch.distributed.pipelining itself: 2 gloo ranks, the stages `sapp_hook.build_stages` builds,
losses equal to the model's own, unpipelined."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from profiler_cases import gpt2, llama
from test_stages import layout

from sapp_hook import TiedGradients, build_stages, schedule_class
from sapp_hook.validation.gloo import gloo_group, spawn

MICRO_BATCHES, SEQUENCES = 4, 8


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (SEQUENCES, 32), generator=torch.Generator().manual_seed(7))


def untied_or_tied(family: str) -> torch.nn.Module:
    # GPT-2 ties its LM head to the embedding; no dropout, so that the pipeline computes what the model does
    return llama() if family == "llama" else gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def pipelined_rank(
    rank: int, store: str, folder: str, schedule: str, counts: list[int], chunks: int, family: str = "llama"
) -> None:
    from torch.distributed.pipelining import PipelineStage

    with gloo_group(rank, 2, store):
        model = untied_or_tied(family)
        # no recompute under split-backward schedules, where torch runs a checkpointed block once per weight group
        modes = {} if schedule == "ZBVZeroBubble" else {2: "full", 3: "selective"}
        plan = layout(counts, schedule, chunks, modes=modes)
        modules = build_stages(model, plan, rank)
        stages = [PipelineStage(module, index, len(counts), torch.device("cpu")) for index, module in modules]
        runner = schedule_class(plan)
        held = stages[0] if chunks == 1 else stages
        pipeline = runner(held, MICRO_BATCHES, loss_fn=loss_fn)
        tied = TiedGradients(model, plan, rank)
        ids = tokens()
        losses: list[torch.Tensor] = []
        holds_first = any(stage.is_first for stage in stages)
        holds_last = any(stage.is_last for stage in stages)
        arguments = (ids,) if holds_first else ()
        pipeline.step(*arguments, target=ids if holds_last else None, losses=losses)
        tied()
        grads = {name: p.grad.norm().item() for name, p in model.named_parameters() if p.grad is not None}
        measured = {"losses": [loss.item() for loss in losses], "grads": grads}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(measured))


@pytest.mark.parametrize(
    ("family", "schedule", "counts", "chunks"),
    [
        ("llama", "1F1B", [2, 4], 1),
        ("llama", "Interleaved1F1B", [2, 1, 2, 1], 2),
        ("llama", "ZBVZeroBubble", [1, 2, 2, 1], 2),
        ("gpt2", "1F1B", [2, 4], 1),
    ],  # its embedding and LM head, one weight, on two ranks: TiedGradients sums them
)
def test_a_planned_pipeline_trains_like_the_model(tmp_path, family, schedule, counts, chunks):
    spawn(pipelined_rank, (str(tmp_path / "store"), str(tmp_path), schedule, counts, chunks, family), 2)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    losses = [loss for result in results for loss in result["losses"]]
    model = untied_or_tied(family)
    ids = tokens()
    expected = [loss_fn(model(input_ids=chunk, use_cache=False).logits, chunk) for chunk in ids.chunk(MICRO_BATCHES)]
    torch.testing.assert_close(torch.tensor(losses), torch.stack(expected).detach(), rtol=1e-5, atol=1e-5)
    (sum(expected) / MICRO_BATCHES).backward()  # the schedules scale gradients by 1 / micro-batches
    for name, param in model.named_parameters():  # the model's gradient on every rank that holds the parameter
        holders = [result["grads"][name] for result in results if name in result["grads"]]
        assert holders and holders == pytest.approx([param.grad.norm().item()] * len(holders), rel=1e-4), name


def two_pipelines_rank(rank: int, store: str, folder: str) -> None:
    import torch.distributed as dist

    with gloo_group(rank, 4, store):
        pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # data parallelism of 2 over pipelines of 2
        model = gpt2()
        tied = TiedGradients(model, layout([3, 3]), rank % 2, group=pipelines[rank // 2])
        model.transformer.wte.weight.grad = torch.full_like(model.transformer.wte.weight, float(rank + 1))
        tied()
        Path(folder, f"rank{rank}.json").write_text(json.dumps(model.lm_head.weight.grad.unique().tolist()))


def test_tied_gradients_are_summed_within_each_pipeline_only(tmp_path):
    spawn(two_pipelines_rank, (str(tmp_path / "store"), str(tmp_path)), 4)
    sums = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert sums == [[1.0 + 2.0], [1.0 + 2.0], [3.0 + 4.0], [3.0 + 4.0]]
