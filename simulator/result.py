"""What a replay yields: when every action ran, the iteration time, memory and the bubble split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from basics.deprecation import renamed_attributes
from simulator.actions import BACKWARD_WEIGHT, Action
from simulator.costs import PipelineCosts
from simulator.schedule import Schedule
from simulator.sharded import memory_points


@dataclass(frozen=True)
class BubbleSplit:
    """Where the iteration time goes beyond the useful work, SAPP's split:
    `real = ideal + imbalance + recompute + comm`, each a fraction of the useful work
    (forward and backward, without recompute, summed over all ranks).

    real: (ranks x iteration time - useful work) / useful work.
    ideal: `real` of the same schedule with every chunk at the average cost, no recompute, no
        P2P: (S-1)/(V*M) for 1F1B and interleaved 1F1B, less for zero-bubble schedules.
    recompute: the iteration time recompute adds to that balanced pipeline (x ranks / useful
        work). SAPP counts only the recompute work (M x recompute / useful work) and leaves the
        longer warm-up and cool-down in imbalance; here balanced stages show zero imbalance.
    comm: the iteration time P2P adds (x ranks / useful work).
    imbalance: the rest: what uneven stages cost.
    """

    real: float
    ideal: float
    imbalance: float
    recompute: float
    comm: float

    def to_dict(self) -> dict[str, float]:
        return {
            "real": self.real,
            "ideal": self.ideal,
            "imbalance": self.imbalance,
            "recompute": self.recompute,
            "comm": self.comm,
        }


class TimedAction(NamedTuple):
    """An action with the rank and chunk that ran it and its start and end."""

    action: Action
    rank: int
    chunk: int
    start_ms: float
    end_ms: float


@renamed_attributes(
    stage_busy_ms="rank_busy_ms",
    stage_peak_memory_bytes="rank_peak_memory_bytes",
    stage_peak_activations="rank_peak_activations",
)
@dataclass(frozen=True)
class SimulationResult:
    """A replayed schedule. Times in milliseconds from the start of the iteration, memory in bytes."""

    schedule: Schedule
    costs: PipelineCosts
    start_ms: list[float]  # by action id (rank by rank, in schedule order)
    end_ms: list[float]
    iteration_time_ms: float
    rank_busy_ms: tuple[float, ...]
    rank_peak_memory_bytes: tuple[float, ...]
    rank_peak_activations: tuple[int, ...]  # most (chunk, micro-batch) activations held at once
    bubble: BubbleSplit

    @property
    def weight_split_assumed(self) -> bool:
        """Some I/W action split a backward whose weight-gradient time was not given."""
        uses_split = any(a.op == BACKWARD_WEIGHT for actions in self.schedule.rank_actions for a in actions)
        return uses_split and self.costs.weight_split_assumed

    def rank_timeline(self, rank: int) -> list[TimedAction]:
        """The actions of `rank` in the order it ran them."""
        first = self.schedule.compiled.rank_offsets[rank]
        ranks = self.schedule.ranks
        return [
            TimedAction(action, rank, action.stage_index // ranks, self.start_ms[first + i], self.end_ms[first + i])
            for i, action in enumerate(self.schedule.rank_actions[rank])
        ]

    def rank_finish_ms(self, rank: int) -> float:
        """When the last action of `rank` ends: its step time, from the common start."""
        offsets = self.schedule.compiled.rank_offsets
        return max(self.end_ms[offsets[rank] : offsets[rank + 1]])

    def memory_curve(self, rank: int) -> list[tuple[float, float]]:
        """(time, bytes) points of a step curve: the memory of `rank` from each point to the next."""
        return [(time, total) for time, total, _ in self.memory_split(rank)]

    def memory_split(self, rank: int) -> list[tuple[float, float, float]]:
        """(time, bytes, of them what data parallelism holds within the step) points of `rank`'s step curve."""
        row = self.costs.chunk_costs[rank]
        memory = sum(chunk.static_bytes for chunk in row)
        points = [(0.0, memory, 0.0)]
        timeline = self.rank_timeline(rank)
        ops = [(timed.chunk, timed.action.op) for timed in timeline]
        sharded = 0.0
        for timed, point in zip(timeline, memory_points(ops, row, self.costs.unshard_lookahead)):
            if point.during_bytes is not None:
                points.append((timed.start_ms, point.during_bytes, point.during_sharded_bytes))
            memory, sharded = point.held_bytes, point.sharded_bytes
            points.append((timed.end_ms, memory, sharded))
        points.append((self.iteration_time_ms, memory, sharded))
        return points

    def to_dict(self) -> dict[str, object]:
        """The summary as JSON-ready data (the `sapp-hook simulate --json` object)."""
        return {
            "schedule": self.schedule.name,
            "ranks": self.schedule.ranks,
            "chunks": self.schedule.chunks,
            "micro_batches": self.schedule.micro_batches,
            "placement": self.schedule.placement,
            "num_actions": self.schedule.num_actions,
            "time_unit": "ms",
            "iteration_time": self.iteration_time_ms,
            "bubble": self.bubble.to_dict(),
            "rank_busy_ms": list(self.rank_busy_ms),
            "rank_peak_memory_bytes": [round(b) for b in self.rank_peak_memory_bytes],
            "rank_peak_activations": list(self.rank_peak_activations),
            "p2p_ms": self.costs.p2p_ms,
            "weight_split_assumed": self.weight_split_assumed,
        }
