"""The collectives an estimated layer runs on each mesh dimension, their time on the links given, and
what of it is exposed (added to the layer's forward and backward). Needs no torch.

Counts per block and micro-batch are what eager DTensor runs under TorchTitan's plan on torch 2.13
(counted on 2 x 2 gloo ranks; tests/test_profile_mesh.py runs them): without sequence parallel 2 all-reduces forward and 5
backward (one per column-parallel projection: DTensor reduces each projection's input gradient apart);
with it 2 all-gathers and 2 reduce-scatters forward, 2 all-gathers and 5 all-reduces backward; the
embedding and the LM head one or two each. Each moves a rank's hidden state. Ring algorithms: an
all-reduce moves 2 (k - 1) / k of the tensor per rank, an all-gather, reduce-scatter or all-to-all
(k - 1) / k; each call adds the latency. Tensor-parallel and all-to-all collectives are exposed (the
compute waits for them); ring attention's key-value passes hide behind the attention they feed;
data-parallel collectives run once per step (ZeRO and FSDP that keeps parameters gathered: after the
step's last backward, and at the first forward), FSDP that reshards after forward gathers in every
forward and backward, the backward's prefetched behind the layer's compute.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from basics.errors import InputError
from profiler.estimate.shape import TransformerShape
from solver.parallel.model_parallel import DTYPE_BYTES, expert_replicas, token_copies_ratio
from solver.vocabulary.profile import NONE, LayerProfile, ModelProfile
from solver.vocabulary.profile_parts import Collective
from solver.vocabulary.spec import ZERO_STAGES, PipelineSpec

MICRO_BATCH, STEP = "micro-batch", "step"


@dataclass(frozen=True)
class Network:
    """The links collectives run on (bytes/s each way per rank; 0: no link time), the latency of one
    collective call, and the data-parallel side of the job (its collectives only: the spec shards
    static bytes over it). `data_link_bytes_per_second`: between nodes, where data parallelism runs;
    None: `link_bytes_per_second`."""

    link_bytes_per_second: float = 0.0
    data_link_bytes_per_second: float | None = None
    latency_s: float = 0.0
    data_parallel: int = 1
    zero_stage: int = 0
    fsdp: bool = False
    reshard_after_forward: bool = False

    def __post_init__(self) -> None:
        for name in ("link_bytes_per_second", "data_link_bytes_per_second", "latency_s"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                raise InputError(name, f"expected a finite number >= 0, got {value!r}")
        # the same layout checks as a plan's spec
        PipelineSpec(
            pipeline_parallel=1,
            micro_batches=1,
            schedule="1F1B",
            data_parallel=self.data_parallel,
            zero_stage=self.zero_stage,
            fsdp=self.fsdp,
            fsdp_reshard_after_forward=self.reshard_after_forward,
        )
        if self.zero_stage not in ZERO_STAGES:
            raise InputError("zero_stage", f"expected one of {ZERO_STAGES}, got {self.zero_stage!r}")

    @property
    def data_link(self) -> float:
        return (
            self.link_bytes_per_second if self.data_link_bytes_per_second is None else self.data_link_bytes_per_second
        )


@dataclass
class _Pass:
    """A layer's collectives as they are added up: one per mesh dimension, operation and period (its
    forward's and backward's together), and what the forward, backward and a re-run forward
    (recompute) are made longer by."""

    collectives: dict[tuple[str, str, str], Collective] = dataclasses.field(default_factory=dict)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    rerun_ms: float = 0.0  # of forward_ms, what a recomputed forward runs again (not FSDP's gathers)

    def add(
        self,
        network: Network,
        dimension: str,
        operation: str,
        ranks: int,
        calls: int,
        each_bytes: float,
        *,
        when: str,
        per: str = MICRO_BATCH,
        hidden_ms: float = 0.0,
    ) -> None:
        """`calls` of `operation` over `ranks`, each of `each_bytes`, in the forward, the backward or at
        the step's end (`when`); `hidden_ms` of compute it may hide behind."""
        if ranks == 1 or not calls:
            return
        link = network.data_link if dimension == "data" else network.link_bytes_per_second
        share = 1.0 if operation == "send-receive" else (ranks - 1) / ranks * (2 if operation == "all-reduce" else 1)
        total = calls * each_bytes
        ms = 1e3 * ((share * total / link if link else 0.0) + calls * network.latency_s)
        exposed = max(0.0, ms - hidden_ms)
        self._time(dimension, per, when, exposed)
        was = self.collectives.get((dimension, operation, per))
        if was is not None:
            calls, total, ms, exposed = was.calls + calls, was.bytes + total, was.ms + ms, was.exposed_ms + exposed
        self.collectives[dimension, operation, per] = Collective(dimension, operation, per, calls, total, ms, exposed)

    def _time(self, dimension: str, per: str, when: str, exposed_ms: float) -> None:
        if per == MICRO_BATCH and when == "forward":
            self.forward_ms += exposed_ms
            self.rerun_ms += exposed_ms if dimension != "data" else 0.0
        elif per == MICRO_BATCH:
            self.backward_ms += exposed_ms


def with_collectives(
    profile: ModelProfile, s: TransformerShape, network: Network, flops_per_second: float
) -> ModelProfile:
    """`profile` (one rank of the shape's mesh) with each layer's collectives stated and their exposed
    time added to its forward and backward (a recompute re-runs the forward's)."""
    p = DTYPE_BYTES[s.dtype]
    t, c, e = s.tensor_parallel, s.context_parallel, s.expert_parallel
    tokens = s.micro_batch_size * s.sequence // c  # a rank's, before tensor parallelism
    hidden = tokens * s.hidden_size * p
    head_dim = s.head_dim or s.hidden_size // s.num_heads
    spec = PipelineSpec(
        pipeline_parallel=1,
        micro_batches=1,
        schedule="1F1B",
        data_parallel=network.data_parallel,
        tensor_parallel=t,
        context_parallel=c,
        expert_parallel=e,
    )
    layers = []
    for layer in profile.layers:
        work = _Pass()
        if layer.kind == "head":
            _tensor_head(work, network, t, s.sequence_parallel, hidden)
        elif layer.kind == "tail":
            _tensor_tail(work, network, t, s.sequence_parallel, hidden, tokens * s.vocab_size * p)
        else:
            _tensor_block(work, network, t, s.sequence_parallel, hidden)
            # ring attention: c - 1 remote key-value chunks each way, behind the attention they feed
            kv = 2 * tokens * (s.num_kv_heads or s.num_heads) * head_dim * p / t
            attention_ms = 1e3 * 2 * tokens * s.sequence * s.num_heads * head_dim / (t * c) / flops_per_second
            work.add(network, "context", "send-receive", c, c - 1, kv, when="forward", hidden_ms=attention_ms)
            work.add(
                network, "context", "send-receive", c, 2 * (c - 1), kv, when="backward", hidden_ms=2 * attention_ms
            )
            if layer.kind == "body:moe" and e > 1:  # dispatch and combine; the busiest rank receives the most
                ratio = token_copies_ratio(s.expert_tokens, s.num_experts, s.experts_per_token, e)
                sent = tokens / t * s.experts_per_token * s.hidden_size * p * max(1.0, ratio)
                work.add(network, "expert", "all-to-all", e, 2, sent, when="forward")
                work.add(network, "expert", "all-to-all", e, 2, sent, when="backward")
        _data(work, network, layer, spec)
        layers.append(_timed(layer, work))
    return dataclasses.replace(profile, layers=tuple(layers))


def _tensor_block(work: _Pass, network: Network, t: int, sp: bool, hidden: float) -> None:
    if sp:
        work.add(network, "tensor", "all-gather", t, 2, hidden, when="forward")
        work.add(network, "tensor", "reduce-scatter", t, 2, hidden, when="forward")
        work.add(network, "tensor", "all-gather", t, 2, hidden, when="backward")
    else:
        work.add(network, "tensor", "all-reduce", t, 2, hidden, when="forward")
    work.add(network, "tensor", "all-reduce", t, 5, hidden, when="backward")


def _tensor_head(work: _Pass, network: Network, t: int, sp: bool, hidden: float) -> None:
    """The embedding: its partial sums reduced (scattered by sequence under sequence parallel)."""
    work.add(network, "tensor", "reduce-scatter" if sp else "all-reduce", t, 1, hidden, when="forward")
    if sp:
        work.add(network, "tensor", "all-gather", t, 1, hidden, when="backward")


def _tensor_tail(work: _Pass, network: Network, t: int, sp: bool, hidden: float, logits: float) -> None:
    """The LM head: its logits gathered whole (no loss parallel), its input's gradient reduced."""
    if sp:
        work.add(network, "tensor", "all-gather", t, 1, hidden, when="forward")
    work.add(network, "tensor", "all-gather", t, 1, logits, when="forward")
    work.add(network, "tensor", "reduce-scatter" if sp else "all-reduce", t, 1, hidden, when="backward")


def _data(work: _Pass, network: Network, layer: LayerProfile, spec: PipelineSpec) -> None:
    """Data-parallel collectives of the layer's own (rank) parameters and gradients; routed experts'
    over the ranks holding the same experts."""
    experts = layer.expert_parameter_bytes or 0.0
    share = experts / layer.parameter_bytes if layer.parameter_bytes else 0.0
    for replicas, fraction in ((network.data_parallel, 1 - share), (expert_replicas(spec), share)):
        parameters, gradients = layer.parameter_bytes * fraction, layer.gradient_bytes * fraction
        if replicas == 1 or not parameters:
            continue
        if not network.fsdp:  # gradients reduced after the step's last backward; ZeRO gathers the updated weights
            operation = "reduce-scatter" if network.zero_stage >= 2 else "all-reduce"
            work.add(network, "data", operation, replicas, 1, gradients, when="step", per=STEP)
            if network.zero_stage >= 1:
                work.add(network, "data", "all-gather", replicas, 1, parameters, when="step", per=STEP)
            continue
        work.add(network, "data", "reduce-scatter", replicas, 1, gradients, when="step", per=STEP)
        if network.reshard_after_forward:
            work.add(network, "data", "all-gather", replicas, 1, parameters, when="forward")
            work.add(
                network, "data", "all-gather", replicas, 1, parameters, when="backward", hidden_ms=layer.backward_ms
            )
        else:
            work.add(network, "data", "all-gather", replicas, 1, parameters, when="step", per=STEP)


def _timed(layer: LayerProfile, work: _Pass) -> LayerProfile:
    if not work.collectives:
        return layer
    recompute = {
        mode: dataclasses.replace(cost, extra_ms=cost.extra_ms + (work.rerun_ms if mode != NONE else 0.0))
        for mode, cost in layer.recompute.items()
    }
    return dataclasses.replace(
        layer,
        forward_ms=layer.forward_ms + work.forward_ms,
        backward_ms=layer.backward_ms + work.backward_ms,
        recompute=recompute,
        collectives=tuple(work.collectives.values()),
    )
