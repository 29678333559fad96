"""What each (rank, chunk) costs per micro-batch: times in milliseconds, memory in bytes."""

from __future__ import annotations

from dataclasses import dataclass

from basics.deprecation import renamed_attributes, renamed_keywords
from basics.errors import InputError, check_non_negative, shown
from simulator.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from simulator.schedules import MAX_ACTIONS

MAX_CELLS = MAX_ACTIONS // 2  # (rank, chunk) cells: a replay runs at least 2 actions on each


@dataclass(frozen=True)
class ShardedCosts:
    """What a chunk's data parallelism holds within a step, per step rather than per micro-batch, where
    its parameters are sharded (FSDP, ZeRO-3) or its gradients do not persist between steps; replayed by
    `simulator.sharded`. All bytes, above what the chunk's other costs count.

    `gathered_bytes`: the chunk's whole parameters, held once gathered (by its first forward, or the
    engine's unshard before it) until its reduce; `forward_kept_bytes` of them stay gathered after a
    forward (all, unless forwards re-shard). `gradient_bytes` come at the chunk's first weight-gradient
    action (B, or W where the backward is split), counted from its start (within a B's working set
    where `first_backward_*` says it), and stay to its reduce, right
    after its last one, which leaves `reduced_gradient_bytes` in their place to the step's end. While an
    action runs: `forward_gather_working_bytes` where a forward finds the chunk not all gathered,
    `backward_gather_working_bytes` where a backward does (in place of its working set),
    `reduce_working_bytes` during the reduce, `layer_gather_bytes` on top of every backward action's working
    set where each layer is gathered for its own backward (ZeRO-3 without FSDP). Working sets are above
    what was held when the action began, like a backward's. `first_backward_working_bytes` and
    `first_backward_gather_working_bytes` (None: not known, the gradients then counted from the start)
    are the working sets of the full backward that makes the step's gradients, finding the chunk
    gathered or not: each layer's gradient arrives with its own backward, so a layer's backward holds
    those of the layers after it only."""

    gathered_bytes: float = 0.0
    forward_kept_bytes: float = 0.0
    gradient_bytes: float = 0.0
    reduced_gradient_bytes: float = 0.0
    forward_gather_working_bytes: float = 0.0
    backward_gather_working_bytes: float = 0.0
    reduce_working_bytes: float = 0.0
    layer_gather_bytes: float = 0.0
    first_backward_working_bytes: float | None = None
    first_backward_gather_working_bytes: float | None = None

    def check(self, where: str) -> None:
        for name, value in vars(self).items():
            if value is not None:
                check_non_negative(value, f"{where} sharded.{name}")
        if self.forward_kept_bytes > self.gathered_bytes:
            raise InputError(
                f"{where} sharded.forward_kept_bytes",
                f"expected at most gathered_bytes ({self.gathered_bytes:g}), got {self.forward_kept_bytes:g}",
            )


@dataclass(frozen=True)
class ChunkCosts:
    """Costs of one chunk (virtual stage) on one rank, per micro-batch: times in ms, memory in bytes.

    Memory is counted as the replay walks a rank's actions (`simulator.replay`): a forward adds
    `activation_bytes`, a backward's working set comes on top while it runs, its end frees the activation.

    Attributes:
        forward_ms: the forward (F) of one micro-batch.
        backward_ms: the full backward (input and weight gradients) without recompute.
        weight_ms: the part of `backward_ms` that computes weight gradients, which zero-bubble schedules
            run as a separate W action; None: not measured (half the backward is assumed).
        recompute_ms: the forward work the backward redoes for activation recompute (added to B, or I).
        activation_bytes: kept from a forward's end to the backward action that frees it (B; W where the
            backward is split).
        static_bytes: held for the whole run (parameters, gradients, optimizer state, ...); a rank's
            memory starts at the sum of its chunks'.
        working_bytes: held only while a backward of this chunk runs (gradient buffers, re-materialised
            activations), above what was held when it began.
        retained_bytes: from a micro-batch's last backward action (W, or B where the backward is whole) to
            the end of the step: what the engine does not free with the activations (torch's input
            gradient, left on its receive buffer; tensors sent to other ranks, whose requests torch keeps).
        pending_bytes: where the backward is split, held from the I action to the W action (the gradients
            the weight gradients still need, those of each weighted op's output; torch keeps them in its
            param groups); negative where the I action frees more than it holds, down to the whole
            activation.
        input_ms: the I action's part of the backward; None: the rest of the backward (`weight_ms` and
            `input_ms` may add up to more than `backward_ms`, as torch's two calls do).
        input_working_bytes: takes the place of `working_bytes` while an I action runs (None:
            `working_bytes`): what it holds above what was held when it began.
        weight_working_bytes: the same for a W action.
        sharded: what data parallelism holds within a step (`ShardedCosts`); None: nothing.

    Example:
        >>> costs = ChunkCosts(forward_ms=1.0, backward_ms=2.0, activation_bytes=100.0, retained_bytes=10.0)
        >>> costs.held_change_bytes("F"), costs.held_change_bytes("B")
        (100.0, -90.0)
        >>> costs.split_weight_ms(), costs.split_input_ms()  # no weight_ms measured: half each
        (1.0, 1.0)
    """

    forward_ms: float
    backward_ms: float
    weight_ms: float | None = None
    recompute_ms: float = 0.0
    activation_bytes: float = 0.0
    static_bytes: float = 0.0
    working_bytes: float = 0.0
    retained_bytes: float = 0.0
    pending_bytes: float = 0.0
    input_ms: float | None = None
    input_working_bytes: float | None = None
    weight_working_bytes: float | None = None
    sharded: ShardedCosts | None = None

    def check(self, where: str) -> None:
        """Raise InputError naming `where` and the field on a negative, non-finite or inconsistent cost."""
        for name in (
            "forward_ms",
            "backward_ms",
            "recompute_ms",
            "activation_bytes",
            "static_bytes",
            "working_bytes",
            "retained_bytes",
        ):
            check_non_negative(getattr(self, name), f"{where} {name}")
        # the I action may free part of the activations (torch's last stage drops the model's output there)
        check_non_negative(self.pending_bytes + self.activation_bytes, f"{where} pending_bytes + activation_bytes")
        for name in ("input_ms", "input_working_bytes", "weight_working_bytes"):
            if getattr(self, name) is not None:
                check_non_negative(getattr(self, name), f"{where} {name}")
        if self.sharded is not None:
            self.sharded.check(where)
        if self.weight_ms is not None:
            check_non_negative(self.weight_ms, f"{where} weight_ms")
            if self.weight_ms > self.backward_ms:
                raise InputError(
                    f"{where} weight_ms",
                    f"expected at most backward_ms ({self.backward_ms:g}), got {self.weight_ms:g}",
                )

    def held_change_bytes(self, op: str) -> float:
        """What an action `op` on this chunk adds to the bytes its rank holds once it has run
        (negative: what it frees). Its working set comes on top while a backward runs."""
        if op == FORWARD:
            return self.activation_bytes
        if op == BACKWARD_INPUT:
            return self.pending_bytes
        if op == BACKWARD_WEIGHT:
            return -(self.activation_bytes - self.retained_bytes + self.pending_bytes)
        return -(self.activation_bytes - self.retained_bytes)

    def working_bytes_during(self, op: str) -> float:
        """What a backward action `op` holds while it runs, above what was held when it began."""
        if op == BACKWARD_INPUT and self.input_working_bytes is not None:
            return self.input_working_bytes
        if op == BACKWARD_WEIGHT and self.weight_working_bytes is not None:
            return self.weight_working_bytes
        return self.working_bytes

    def split_weight_ms(self) -> float:
        """The weight-gradient part of the backward; half of it where it was not measured."""
        return self.backward_ms / 2 if self.weight_ms is None else self.weight_ms

    def split_input_ms(self) -> float:
        """The input-gradient part of a split backward, without recompute; the rest of the backward
        where it was not given."""
        return self.backward_ms - self.split_weight_ms() if self.input_ms is None else self.input_ms


@renamed_attributes(stages="ranks")
@dataclass(frozen=True)
class PipelineCosts:
    """Costs of every chunk, indexed [rank][chunk], and the P2P time between neighbouring ranks.

    Attributes:
        chunk_costs: per rank, per chunk (the rank's virtual stages in chunk order), its `ChunkCosts`;
            every rank has as many chunks.
        p2p_ms: what an activation or gradient takes to reach another rank (0: free).
        unshard_lookahead: how many chunks ahead of their actions torch's runtime schedules gather a
            rank's FSDP chunks; 0: each is gathered at its first forward.

    Raises:
        InputError: on construction, no rank or no chunk, rows of different lengths, a negative,
            non-finite or inconsistent cost (naming the rank, chunk and field), a negative `p2p_ms` or
            `unshard_lookahead`.

    Example:
        >>> slow = ChunkCosts(forward_ms=2.0, backward_ms=4.0)
        >>> fast = ChunkCosts(forward_ms=1.0, backward_ms=2.0)
        >>> costs = PipelineCosts(((slow,), (fast,)), p2p_ms=0.1)
        >>> costs.ranks, costs.chunks, costs[1, 0].forward_ms
        (2, 1, 1.0)
        >>> PipelineCosts.uniform(2, 2, forward_ms=2.0, backward_ms=4.0)[0, 1].forward_ms  # a rank's, split
        1.0
    """

    chunk_costs: tuple[tuple[ChunkCosts, ...], ...]
    p2p_ms: float = 0.0
    # torch's runtime schedules gather this many chunks ahead of their actions (FSDP), 0: each at its first forward
    unshard_lookahead: int = 0

    def __post_init__(self) -> None:
        if not self.chunk_costs or not self.chunk_costs[0]:
            raise InputError("chunk_costs", "expected at least one rank with at least one chunk")
        chunks = len(self.chunk_costs[0])
        for rank, row in enumerate(self.chunk_costs):
            if len(row) != chunks:
                raise InputError(f"chunk_costs[{rank}]", f"expected {chunks} chunks like rank 0, got {len(row)}")
            for chunk, costs in enumerate(row):
                costs.check(f"rank {rank} chunk {chunk}")
        check_non_negative(self.p2p_ms, "p2p_ms")
        if (
            isinstance(self.unshard_lookahead, bool)
            or not isinstance(self.unshard_lookahead, int)
            or self.unshard_lookahead < 0
        ):
            raise InputError("unshard_lookahead", f"expected an integer >= 0, got {self.unshard_lookahead!r}")

    @property
    def ranks(self) -> int:
        return len(self.chunk_costs)

    @property
    def chunks(self) -> int:
        return len(self.chunk_costs[0])

    def __getitem__(self, rank_chunk: tuple[int, int]) -> ChunkCosts:
        rank, chunk = rank_chunk
        return self.chunk_costs[rank][chunk]

    def all_chunks(self) -> list[ChunkCosts]:
        return [costs for row in self.chunk_costs for costs in row]

    @property
    def weight_split_assumed(self) -> bool:
        """True where some weight-gradient time was not given (I/W actions then split the backward in half)."""
        return any(costs.weight_ms is None for costs in self.all_chunks())

    @classmethod
    @renamed_keywords(stages="ranks")
    def uniform(
        cls,
        ranks: int,
        chunks: int,
        *,
        forward_ms: float,
        backward_ms: float,
        weight_ms: float | None = None,
        recompute_ms: float = 0.0,
        activation_bytes: float = 0.0,
        static_bytes: float = 0.0,
        working_bytes: float = 0.0,
        p2p_ms: float = 0.0,
    ) -> PipelineCosts:
        """Identical ranks; each figure is a whole rank's, split evenly over its chunks."""
        for name, value in (("ranks", ranks), ("chunks", chunks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(name, f"expected an integer >= 1, got {shown(value)}")
        if ranks * chunks > MAX_CELLS:
            raise InputError(
                "ranks", f"{shown(ranks)} x {shown(chunks)} (ranks x chunks); expected at most {MAX_CELLS:,}"
            )
        for name, value in (
            ("forward_ms", forward_ms),
            ("backward_ms", backward_ms),
            ("weight_ms", weight_ms),
            ("recompute_ms", recompute_ms),
            ("activation_bytes", activation_bytes),
            ("static_bytes", static_bytes),
            ("working_bytes", working_bytes),
        ):
            if value is not None or name != "weight_ms":
                check_non_negative(value, name)
        share = ChunkCosts(
            forward_ms=forward_ms / chunks,
            backward_ms=backward_ms / chunks,
            weight_ms=None if weight_ms is None else weight_ms / chunks,
            recompute_ms=recompute_ms / chunks,
            activation_bytes=activation_bytes / chunks,
            static_bytes=static_bytes / chunks,
            working_bytes=working_bytes / chunks,
        )
        return cls(tuple((share,) * chunks for _ in range(ranks)), p2p_ms)
