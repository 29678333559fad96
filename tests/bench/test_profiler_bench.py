"""What profiling adds to a training step (pytest-benchmark; `make bench`): the built-in tiny-llama
(8 blocks, hidden 256, vocabulary 8192), micro-batch 2 x 128 tokens, AdamW, one thread.
Compare the medians of `plain` with `time-only` and `time+memory`; `weight-split` is paid once per body kind."""

from __future__ import annotations

import pytest
import torch

from profiler import LayerProfiler
from profiler.measure.split import measure_split_backward
from sapp_hook.models import build_model, load_config, random_batch

torch.set_num_threads(1)
CONFIG = load_config("tiny-llama")
VARIANTS = {
    "plain": None,
    "time-only": {"count_memory": False},
    "time+memory": {"count_memory": True},
}


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(**random_batch(CONFIG, 2, 128, seed=0)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step(benchmark, variant):
    model = build_model(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = VARIANTS[variant]
    if options is None:
        benchmark.pedantic(training_step, args=(model, optimizer), rounds=12, warmup_rounds=2)
        return
    # Measure under "none" for as long as the benchmark runs: the hooks' cost, not recompute's.
    profiler = LayerProfiler(model, optimizer, steps=10**6, modes=("none",), split_backward=False, **options)

    def profiled_step() -> None:
        training_step(model, optimizer)
        profiler.step()

    with profiler:
        benchmark.pedantic(profiled_step, rounds=12, warmup_rounds=2)


def test_weight_split(benchmark):
    model = build_model(CONFIG)
    block = model.model.layers[1]
    hidden = torch.randn(2, 128, CONFIG.hidden_size, requires_grad=True)
    position = model.model.rotary_emb(hidden, torch.arange(128)[None])
    split = benchmark.pedantic(
        measure_split_backward,
        args=(block, (hidden,), {"position_embeddings": position}, torch.device("cpu")),
        rounds=3,
    )
    benchmark.extra_info.update(
        input_share=split.input_share, weight_share=split.weight_share, pending_bytes=split.pending_bytes
    )
    assert split.input_share > 0 and split.weight_share > 0


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-moe"])
def test_layers_cover_the_step(benchmark, name):
    """The share of each step's forward + backward the layers' times account for (extra_info)."""
    import statistics
    import time

    config = load_config(name)
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ratios = []
    profiler = LayerProfiler(model, optimizer, steps=5, modes=("none",), pool=False, split_backward=False)

    def profiled_steps() -> None:
        with profiler:
            while not profiler.done:
                batch = random_batch(config, 2, 128, profiler.steps_done)
                start = time.perf_counter()
                model(**batch).loss.backward()
                step_ms = (time.perf_counter() - start) * 1e3
                optimizer.step()
                optimizer.zero_grad()
                profiler.step()
                if profiler.steps_done > profiler.warmup_steps:
                    layers_ms = sum(
                        s.forward_ms["none"][-1] + s.backward_ms["none"][-1] for s in profiler.samples.values()
                    )
                    ratios.append(layers_ms / step_ms)

    benchmark.pedantic(profiled_steps, rounds=1)
    benchmark.extra_info["coverage_median"] = statistics.median(ratios)
    assert 0.85 <= statistics.median(ratios) <= 1.0
