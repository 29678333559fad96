"""build_schedule + simulate, a built schedule's simulate and critical_path on issue 44's cases, best of 7 (ms).

Run with PYTHONPATH naming the code to time, e.g. a `git archive` of another commit's simulator and basics."""

import time

from simulator import PipelineCosts, build_schedule, critical_path, simulate


def best_ms(call, rounds=7):
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return min(times) * 1e3


def measure(ranks: int, chunks: int, micro_batches: int) -> str:
    name = "1F1B" if chunks == 1 else "Interleaved1F1B"
    costs = PipelineCosts.uniform(ranks, chunks, forward_ms=1.0, backward_ms=2.0)
    whole = best_ms(lambda: simulate(build_schedule(name, ranks, micro_batches, chunks), costs))
    build = best_ms(lambda: build_schedule(name, ranks, micro_batches, chunks).compiled)
    built = build_schedule(name, ranks, micro_batches, chunks)
    _ = built.compiled
    replay, path = best_ms(lambda: simulate(built, costs)), best_ms(lambda: critical_path(built, costs))
    return (
        f"{ranks}x{chunks}x{micro_batches}: build+simulate {whole:.1f}, build {build:.1f}, simulate {replay:.1f}, "
        f"critical path {path:.1f}"
    )


for case in [(16, 1, 64), (16, 2, 128), (32, 2, 256), (32, 1, 1024), (64, 4, 256)]:
    print(measure(*case))
