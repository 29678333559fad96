"""Pipeline actions in torch.distributed.pipelining's vocabulary: `2F0`, `1B3`, `0I1`, `0W1`."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial
from itertools import repeat
from typing import NamedTuple

FORWARD = "F"
FULL_BACKWARD = "B"  # input and weight gradients together
BACKWARD_INPUT = "I"
BACKWARD_WEIGHT = "W"
OPS = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
BACKWARD_OPS = (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
_OVERLAP = re.compile(r"^\((.*);(.*)\)OVERLAP_F_B$")


class Action(NamedTuple):
    """One compute action: `op` (F, B, I or W) of virtual stage `stage_index` on micro-batch `microbatch`.

    `overlapped` marks the second action of a DualPipeV forward/backward pair that the runtime
    overlaps with the action before it (torch's `OVERLAP_F_B`); compute still runs one at a time.
    """

    stage_index: int
    op: str
    microbatch: int
    overlapped: bool = False

    def __str__(self) -> str:
        return f"{self.stage_index}{self.op}{self.microbatch}"

    @property
    def kind(self) -> str:
        """The former name of `op`."""
        return self.op


_new_action = partial(tuple.__new__, Action)  # no Python frame per action, unlike Action(...)


def as_actions(rows: Iterable[tuple[int, str, int, bool]]) -> list[Action]:
    """`rows` of (stage, op, microbatch, overlapped) as Actions, with no Python frame per action."""
    return list(map(_new_action, rows))


def make_actions(stages: Iterable[int], ops: Iterable[str], microbatches: Iterable[int]) -> list[Action]:
    """`[Action(stage, op, microbatch) ...]` over the three in step, none overlapped."""
    return as_actions(zip(stages, ops, microbatches, repeat(False)))


def one_f_one_b_order(
    forward: tuple[list[int], list[int]], backward: tuple[list[int], list[int]], warmup: int
) -> list[Action]:
    """A rank's 1F1B order: `warmup` forwards, then one forward and one backward in turn, then the remaining
    backwards. `forward` and `backward`: (stage indices, micro-batches) in the order each kind runs."""
    (forward_stages, forward_mbs), (backward_stages, backward_mbs) = forward, backward
    total = len(forward_stages)
    warmup = min(warmup, total)
    steady = total - warmup

    def in_turn(forwards: list[int], backwards: list[int]) -> list[int]:
        merged = forwards[:warmup] + [0] * (2 * steady) + backwards[steady:]
        merged[warmup : warmup + 2 * steady : 2] = forwards[warmup:]
        merged[warmup + 1 : warmup + 2 * steady : 2] = backwards[:steady]
        return merged

    ops = [FORWARD] * warmup + [FORWARD, FULL_BACKWARD] * steady + [FULL_BACKWARD] * warmup
    return make_actions(in_turn(forward_stages, backward_stages), ops, in_turn(forward_mbs, backward_mbs))


def parse_action(text: str) -> Action:
    """Parse `2F0`-style text (one action, not an overlapped pair)."""
    match = _ACTION.match(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. 2F0, 1B3, 0I1, 0W1)")
    stage, op, microbatch = match.groups()
    return Action(int(stage), op, int(microbatch))


def format_rank_cells(actions: list[Action] | tuple[Action, ...]) -> list[str]:
    """One CSV cell per runtime step: overlapped pairs become `(0F4;3B0)OVERLAP_F_B`."""
    cells: list[str] = []
    for action in actions:
        if action.overlapped and cells:
            cells[-1] = f"({cells[-1]};{action})OVERLAP_F_B"
        else:
            cells.append(str(action))
    return cells


def parse_rank_cells(cells: list[str]) -> list[Action]:
    """Inverse of `format_rank_cells`; empty cells (torch's idle steps) are skipped."""
    actions: list[Action] = []
    for cell in cells:
        cell = cell.strip()
        if not cell:
            continue
        overlap = _OVERLAP.match(cell)
        if overlap is not None:
            first, second = (parse_action(part) for part in overlap.groups())
            actions.extend((first, second._replace(overlapped=True)))
        else:
            actions.append(parse_action(cell))
    return actions
