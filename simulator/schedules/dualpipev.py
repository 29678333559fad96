"""DualPipeV (DeepSeek-V3 report; the V-shaped "cut-in-half" DualPipe): two chunks per rank in a
V, forwards of one chunk overlapped with backwards of the other in the steady state, and the
weight gradients of the edges deferred zero-bubble style.

The order is torch's ScheduleDualPipeV (itself after deepseek-ai/DualPipe `dualpipev.py`), in
its eight phases. An overlapped pair is an F followed by a B marked `overlapped`; compute on a
rank still runs one action at a time, the overlap hides communication.
"""

from __future__ import annotations

from collections import deque

from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Action, as_actions


def dualpipev_actions(ranks: int, micro_batches: int) -> list[list[Action]]:
    return [_rank_actions(ranks, micro_batches, rank) for rank in range(ranks)]


def _rank_actions(ranks: int, micro_batches: int, rank: int) -> list[Action]:
    down, up = rank, 2 * ranks - 1 - rank  # chunk 0 going down the ranks, chunk 1 coming back
    next_forward = {down: 0, up: 0}
    next_backward = {down: 0, up: 0}  # B and I share the count: each micro-batch has one of them
    pending_weights: deque[tuple[int, int]] = deque()
    rows: list[tuple[int, str, int, bool]] = []  # made Actions at once, at the end

    def forward(stage: int) -> None:
        rows.append((stage, FORWARD, next_forward[stage], False))
        next_forward[stage] += 1

    def backward(stage: int, *, split: bool = False, overlapped: bool = False) -> None:
        microbatch = next_backward[stage]
        rows.append((stage, BACKWARD_INPUT if split else FULL_BACKWARD, microbatch, overlapped))
        if split:
            pending_weights.append((stage, microbatch))
        next_backward[stage] += 1

    def weight_if_pending() -> None:
        if pending_weights:
            stage, microbatch = pending_weights.popleft()
            rows.append((stage, BACKWARD_WEIGHT, microbatch, False))

    def overlapped_forward_backward(forward_stage: int, backward_stage: int) -> None:
        forward(forward_stage)
        backward(backward_stage, overlapped=True)

    # 1. F0: warm the way down.
    for _ in range((ranks - rank - 1) * 2):
        forward(down)
    # 2. F0F1: forwards on both chunks.
    for _ in range(rank + 1):
        forward(down)
        forward(up)
    # 3. I1W1F1: the first backwards of the way up, weight gradients right behind.
    for _ in range(ranks - rank - 1):
        backward(up, split=True)
        weight_if_pending()
        forward(up)
    # 4. Main loop: F0 with B1, then F1 with B0, overlapped.
    for i in range(micro_batches - 2 * ranks + rank + 1):
        if i == 0 and rank == ranks - 1:
            forward(down)  # the turn of the V: not overlapped, to keep the bubble small
            backward(up)
        else:
            overlapped_forward_backward(down, up)
        overlapped_forward_backward(up, down)
    # 5. B1 then F1 with B0.
    for _ in range(ranks - rank - 1):
        backward(up)
        overlapped_forward_backward(up, down)
    # 6. B1B0: the second half splits off its weight gradients.
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            split = True
        backward(up, split=split)
        if i == half and rank % 2 == 0:
            split = True
        backward(down, split=split)
    # 7. W0B0: deferred weight gradients interleaved with the last backwards.
    for _ in range(ranks - rank - 1):
        weight_if_pending()
        backward(down, split=split)
    # 8. W0: the remaining weight gradients.
    while pending_weights:
        weight_if_pending()
    return as_actions(rows)
