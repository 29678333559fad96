"""A plan run by torch.distributed.pipelining itself: 2 gloo ranks, the stages `sapp_hook.apply` builds,
losses equal to the model's own, unpipelined."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from profiler_cases import llama
from test_stages import layout

from sapp_hook import apply, schedule_class
from sapp_hook.gloo import gloo_group

MICRO_BATCHES, SEQUENCES = 4, 8


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (SEQUENCES, 32), generator=torch.Generator().manual_seed(7))


def pipelined_rank(rank: int, store: str, folder: str, schedule: str, counts: list[int], chunks: int) -> None:
    from torch.distributed.pipelining import PipelineStage

    with gloo_group(rank, 2, store):
        model = llama()
        # torch allows one backward through a selective-checkpoint region: not under split-backward schedules
        modes = {2: "full"} if schedule == "ZBVZeroBubble" else {2: "full", 3: "selective"}
        plan = layout(counts, schedule, chunks, modes=modes)
        modules = apply(model, plan, rank)
        stages = [PipelineStage(module, index, len(counts), torch.device("cpu")) for index, module in modules]
        runner = schedule_class(plan)
        held = stages[0] if chunks == 1 else stages
        pipeline = runner(held, MICRO_BATCHES, loss_fn=loss_fn)
        ids = tokens()
        losses: list[torch.Tensor] = []
        holds_first = any(stage.is_first for stage in stages)
        holds_last = any(stage.is_last for stage in stages)
        arguments = (ids,) if holds_first else ()
        pipeline.step(*arguments, target=ids if holds_last else None, losses=losses)
        grads = {name: p.grad.norm().item() for name, p in model.named_parameters() if p.grad is not None}
        measured = {"losses": [loss.item() for loss in losses], "grads": grads}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(measured))


@pytest.mark.parametrize(
    ("schedule", "counts", "chunks"),
    [("1F1B", [2, 4], 1), ("Interleaved1F1B", [2, 1, 2, 1], 2), ("ZBVZeroBubble", [1, 2, 2, 1], 2)],
)
def test_a_planned_pipeline_trains_like_the_model(tmp_path, schedule, counts, chunks):
    mp.spawn(pipelined_rank, args=(str(tmp_path / "store"), str(tmp_path), schedule, counts, chunks), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    losses = [loss for result in results for loss in result["losses"]]
    model = llama()
    ids = tokens()
    expected = [loss_fn(model(input_ids=chunk, use_cache=False).logits, chunk) for chunk in ids.chunk(MICRO_BATCHES)]
    torch.testing.assert_close(torch.tensor(losses), torch.stack(expected).detach(), rtol=1e-5, atol=1e-5)
    (sum(expected) / MICRO_BATCHES).backward()  # the schedules scale gradients by 1 / micro-batches
    pipelined = {**results[0]["grads"], **results[1]["grads"]}
    for name, param in model.named_parameters():  # every parameter got its gradient on exactly one rank
        assert pipelined[name] == pytest.approx(param.grad.norm().item(), rel=1e-4), name
