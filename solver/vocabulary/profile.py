"""What every layer of a model costs: the ModelProfile the profiler fills in and the solver reads.

Times are milliseconds per micro-batch, memory is bytes. A profile is JSON with a schema version.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from basics.errors import InputError, check_bytes, check_ms, check_non_negative, check_printable, named, shown
from basics.fields import Fields
from basics.files import atomic_write_text
from solver.vocabulary.profile_parts import (
    Collective,
    Mesh,
    check_dimensions,
    check_micro_batch,
    collectives_from_list,
    dimensions_from_dict,
    micro_batch_from_dict,
    spread_from_dict,
)

SCHEMA_VERSION = 1
NONE, SELECTIVE, COMM, SELECTIVE_COMM, FULL = "none", "selective", "comm", "selective+comm", "full"
# In MindFormers' enum order: none, select_recompute, select_comm_recompute, both, recompute.
RECOMPUTE_MODES = (NONE, SELECTIVE, COMM, SELECTIVE_COMM, FULL)
HEAD, TAIL, BODY_PREFIX = "head", "tail", "body:"
MTP_KIND = BODY_PREFIX + "mtp"  # a multi-token-prediction module: the MindFormers and Megatron-LM writers place it last
MAX_LAYERS = 100_000
LAYER_MESH_FIELDS = (
    "parameter_tensors",
    "replicated_parameter_bytes",
    "replicated_gradient_bytes",
    "expert_parameter_bytes",
)
COST_MESH_FIELDS = (
    "tp_whole_activation_bytes",
    "sp_whole_activation_bytes",
    "expert_activation_bytes",
    "expert_working_bytes",
)


@dataclass(frozen=True)
class RecomputeCost:
    """One way of keeping a layer's activations for its backward.

    extra_ms: forward work the backward redoes. activation_bytes: kept per micro-batch until the
    backward. working_bytes: held only while this layer's backward runs (gradient buffers and,
    for full recompute, the re-materialised activations). retained_bytes: the part of
    activation_bytes a split backward (an input-gradient then a weight-gradient action) keeps
    after the weight gradients, until the step ends. pending_bytes: what a split backward holds
    from the layer's input gradients to its weight gradients, per micro-batch: the gradients of
    its weighted ops' outputs, which the weight gradients still need. input_working_bytes,
    weight_working_bytes: what each half of a split backward holds at its peak above what was held
    when it began: the input-gradient half's (the pending gradients it forms included) and the
    weight-gradient half's (the pending gradients were there before it; its weight gradients
    accumulate in place); None where not measured: working_bytes stands for both.
    input_held_bytes: what the input-gradient half leaves held while the rest of its stage's runs,
    where that is more than pending_bytes: torch frees the graph on the side of the stage's output
    (for the tail, what the loss saved) only when the stage's input gradients are done, and keeps
    it past that in every layer but the stage's last; None: pending_bytes.
    output_gradient_freed_bytes: what of the gradient handed to the layer (its output's) its
    input-gradient half frees, its weight gradients not needing it: then the layer before it in a
    stage does not keep that gradient, which its own pending bytes count (on its input).
    saved_input_bytes: of activation_bytes, the layer's input itself (the tensor it is handed),
    which an engine that keeps that tensor anyway (torch's receive buffers) does not hold twice.
    weight_freed_bytes: what the weight-gradient half frees as it runs where a layer after it in its
    stage keeps the stage's graph alive (torch runs a stage's W layer by layer in model order and
    frees the rest of the graph when the last is done): its pending bytes and the saved tensors only
    its weight gradients use; None: pending_bytes.
    """

    extra_ms: float
    activation_bytes: float
    working_bytes: float = 0.0
    retained_bytes: float = 0.0
    pending_bytes: float = 0.0
    input_working_bytes: float | None = None
    weight_working_bytes: float | None = None
    input_held_bytes: float | None = None
    output_gradient_freed_bytes: float = 0.0
    saved_input_bytes: float = 0.0
    weight_freed_bytes: float | None = None
    tp_whole_activation_bytes: float | None = None
    sp_whole_activation_bytes: float | None = None
    expert_activation_bytes: float | None = None
    expert_working_bytes: float | None = None

    def split_input_working_bytes(self) -> float:
        return self.working_bytes if self.input_working_bytes is None else self.input_working_bytes

    def split_weight_working_bytes(self) -> float:
        return self.working_bytes if self.weight_working_bytes is None else self.weight_working_bytes

    def split_input_held_bytes(self) -> float:
        return self.pending_bytes if self.input_held_bytes is None else self.input_held_bytes

    def split_weight_freed_bytes(self) -> float:
        return self.pending_bytes if self.weight_freed_bytes is None else self.weight_freed_bytes

    def inner_extra_bytes(self) -> float:
        """What the layer leaves held for W beyond its pending bytes where another layer follows it in
        its stage: the graph on its output's side, less the gradient handed to it that it frees."""
        return self.split_input_held_bytes() - self.pending_bytes - self.output_gradient_freed_bytes


@dataclass(frozen=True)
class LayerProfile:
    """One layer in model order. `kind` is `head`, `tail` or `body:<type>` (e.g. `body:decoder`).
    `input_ms`: the input-gradient half (I) where the backward runs split in two, where measured;
    with `weight_ms` it may add up to more than `backward_ms` (torch's two calls cost more than one).
    For tensor and expert parallelism (`solver.parallel.model_parallel`), where measured or stated (None: not): the
    parameter tensors (each has its own optimizer step count), the parameter bytes tensor parallelism
    leaves whole (norms, row-parallel biases, the router), the gradient bytes it leaves whole (those
    parameters' and the embedding's: torch's DTensor embedding backward returns a whole gradient), the
    routed experts' parameter bytes; and the collectives the layer runs (an estimate states them)."""

    name: str
    kind: str
    forward_ms: float
    backward_ms: float  # input and weight gradients, without recompute
    recompute: Mapping[str, RecomputeCost]  # always holds "none"
    weight_ms: float | None = None  # the weight-gradient part of backward_ms, where measured
    input_ms: float | None = None
    parameter_bytes: float = 0.0
    gradient_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    spread: Mapping[str, float] = field(default_factory=dict)  # spread over the measured steps, per field
    parameter_tensors: int | None = None
    replicated_parameter_bytes: float | None = None
    replicated_gradient_bytes: float | None = None
    expert_parameter_bytes: float | None = None
    collectives: tuple[Collective, ...] = ()

    @property
    def is_body(self) -> bool:
        return self.kind.startswith(BODY_PREFIX)

    @property
    def modes(self) -> tuple[str, ...]:
        """The recompute modes this layer offers, in RECOMPUTE_MODES order."""
        return tuple(mode for mode in RECOMPUTE_MODES if mode in self.recompute)

    def split_weight_ms(self) -> float:
        """The weight-gradient time; half the backward where it was not measured (as the simulator does)."""
        return self.backward_ms / 2 if self.weight_ms is None else self.weight_ms

    def split_input_ms(self) -> float:
        """The input-gradient time of a split backward; the rest of the backward where not measured."""
        return self.backward_ms - self.split_weight_ms() if self.input_ms is None else self.input_ms

    def optimizer_tensor_bytes(self) -> float:
        """Of optimizer_bytes, what is kept per parameter tensor rather than per element: Adam's 4-byte
        step count, whatever the tensor's size or shard (0 where the tensors are not counted)."""
        return min(4.0 * (self.parameter_tensors or 0), self.optimizer_bytes)


@dataclass(frozen=True)
class TiedParameter:
    """One parameter several layers use (a tied embedding and LM head). Each layer counts its bytes:
    on different stages each holds a copy, kept equal by an all-reduce of their gradients."""

    names: tuple[str, ...]
    layers: tuple[str, ...]
    bytes: float


@dataclass(frozen=True)
class ModelProfile:
    """Every layer's costs, in model order: heads first, then body layers, then tails.

    Per micro-batch: `stage_output_bytes`, a stage's output (the hidden state it sends), which the
    pipeline engine keeps until its gradient comes back (every virtual stage but the last);
    `model_output_bytes`, what the model's forward returns (the logits), which torch's pipeline
    engine keeps on the last stage until that micro-batch's backward; `loss_bytes`, of that, the
    loss, which torch's engine keeps to the step's end; `stage_shared_bytes`, what every stage
    computes for its blocks besides their input (the rotary tables) and they keep, once per virtual
    stage holding a block; `checkpoint_state_bytes`, what each recomputed layer's checkpoint holds
    besides the tensors it saves (the CPU generator's state, on the CPU), counted in the recompute
    modes' activation_bytes.
    `mesh`: the parallel layout the numbers are per rank of (1-D: measured on one process);
    `dimensions`: the model's sizes that layout must divide (`profile_parts.DIMENSIONS`).
    """

    layers: tuple[LayerProfile, ...]
    model: str = ""
    source: str = ""  # "measured", "analytic", "sapp-json", ...
    device: str = ""
    dtype: str = ""
    micro_batch: Mapping[str, int] = field(default_factory=dict)  # e.g. {"size": 1, "sequence": 4096}
    fingerprint: str = ""
    rank_constant_bytes: float = 0.0  # held by every rank whatever its layers (framework, buffers)
    stage_output_bytes: float = 0.0
    model_output_bytes: float = 0.0
    loss_bytes: float = 0.0
    stage_shared_bytes: float = 0.0
    checkpoint_state_bytes: float = 0.0
    tied_parameters: tuple[TiedParameter, ...] = ()
    mesh: Mesh = field(default_factory=Mesh)
    dimensions: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_profile(self)

    @property
    def body_kinds(self) -> tuple[str, ...]:
        """Body layer kinds in the order they first appear."""
        return tuple(dict.fromkeys(layer.kind for layer in self.layers if layer.is_body))

    @property
    def modes(self) -> tuple[str, ...]:
        """Recompute modes any body layer offers."""
        offered = {mode for layer in self.layers if layer.is_body for mode in layer.recompute}
        return tuple(mode for mode in RECOMPUTE_MODES if mode in offered)

    def with_modes(self, modes: Iterable[str]) -> ModelProfile:
        """This profile offering only the recompute `modes` (and "none", which every layer has)."""
        kept = {NONE, *modes}
        unknown = sorted(kept - set(RECOMPUTE_MODES))
        if unknown:
            raise InputError("modes", f"expected modes among {', '.join(RECOMPUTE_MODES)}, got {', '.join(unknown)}")
        layers = tuple(
            dataclasses.replace(layer, recompute={mode: cost for mode, cost in layer.recompute.items() if mode in kept})
            for layer in self.layers
        )
        return dataclasses.replace(self, layers=layers)

    def with_times_scaled(self, factor: float) -> ModelProfile:
        """This profile with every layer time (forward, backward, weight gradient, recompute) x `factor`."""
        check_non_negative(factor, "factor")
        layers = tuple(
            dataclasses.replace(
                layer,
                forward_ms=layer.forward_ms * factor,
                backward_ms=layer.backward_ms * factor,
                weight_ms=None if layer.weight_ms is None else layer.weight_ms * factor,
                input_ms=None if layer.input_ms is None else layer.input_ms * factor,
                recompute={
                    mode: dataclasses.replace(cost, extra_ms=cost.extra_ms * factor)
                    for mode, cost in layer.recompute.items()
                },
            )
            for layer in self.layers
        )
        return dataclasses.replace(self, layers=layers)

    def to_dict(self) -> dict[str, object]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "source": self.source,
            "device": self.device,
            "dtype": self.dtype,
            "micro_batch": dict(self.micro_batch),
            "fingerprint": self.fingerprint,
            "rank_constant_bytes": self.rank_constant_bytes,
            "stage_output_bytes": self.stage_output_bytes,
            "model_output_bytes": self.model_output_bytes,
            **({"loss_bytes": self.loss_bytes} if self.loss_bytes else {}),
            **({"stage_shared_bytes": self.stage_shared_bytes} if self.stage_shared_bytes else {}),
            **({"checkpoint_state_bytes": self.checkpoint_state_bytes} if self.checkpoint_state_bytes else {}),
            "layers": [_layer_to_dict(layer) for layer in self.layers],
            "tied_parameters": [
                {"names": list(t.names), "layers": list(t.layers), "bytes": t.bytes} for t in self.tied_parameters
            ],
            "mesh": self.mesh.to_dict(),
            **({"dimensions": dict(self.dimensions)} if self.dimensions else {}),
        }

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: object) -> ModelProfile:
        fields = Fields(data, "")
        version = fields.raw("schema_version")
        if isinstance(version, bool) or version != SCHEMA_VERSION:
            raise InputError("schema_version", f"expected {SCHEMA_VERSION}, got {shown(version)}")
        layers_data = fields.raw("layers")
        if not isinstance(layers_data, list) or not layers_data:
            raise InputError("layers", "expected a non-empty list of layers")
        fields.renamed("stage_constant_bytes", "rank_constant_bytes")
        profile = cls(
            layers=tuple(_layer_from_dict(item, f"layers[{i}]") for i, item in enumerate(layers_data)),
            model=fields.text("model"),
            source=fields.text("source"),
            device=fields.text("device"),
            dtype=fields.text("dtype"),
            micro_batch=micro_batch_from_dict(fields.raw("micro_batch", {})),
            fingerprint=fields.text("fingerprint"),
            rank_constant_bytes=fields.number("rank_constant_bytes", 0.0),
            stage_output_bytes=fields.number("stage_output_bytes", 0.0),
            stage_shared_bytes=fields.number("stage_shared_bytes", 0.0),
            checkpoint_state_bytes=fields.number("checkpoint_state_bytes", 0.0),
            model_output_bytes=fields.number("model_output_bytes", 0.0),
            loss_bytes=fields.number("loss_bytes", 0.0),
            tied_parameters=_tied_from_list(fields.raw("tied_parameters", [])),
            mesh=Mesh.from_dict(fields.raw("mesh", {})),
            dimensions=dimensions_from_dict(fields.raw("dimensions", {})),
        )
        fields.done()
        return profile


def _tied_from_list(data: object) -> tuple[TiedParameter, ...]:
    if not isinstance(data, list):
        raise InputError("tied_parameters", f"expected a list, got {type(data).__name__}")
    tied = []
    for index, item in enumerate(data):
        fields = Fields(item, f"tied_parameters[{index}]")
        names, layers = fields.raw("names", []), fields.raw("layers", [])
        for key, value in (("names", names), ("layers", layers)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InputError(fields.at(key), f"expected a list of strings, got {value!r}")
        tied.append(
            TiedParameter(names=tuple(names), layers=tuple(layers), bytes=fields.number("bytes", required=True))
        )
        fields.done()
    return tuple(tied)


def _layer_to_dict(layer: LayerProfile) -> dict[str, object]:
    data: dict[str, object] = {
        "name": layer.name,
        "kind": layer.kind,
        "forward_ms": layer.forward_ms,
        "backward_ms": layer.backward_ms,
        "weight_ms": layer.weight_ms,
        "input_ms": layer.input_ms,
        "parameter_bytes": layer.parameter_bytes,
        "gradient_bytes": layer.gradient_bytes,
        "optimizer_bytes": layer.optimizer_bytes,
        "recompute": {mode: _cost_to_dict(c) for mode, c in layer.recompute.items()},
    }
    if layer.spread:
        data["spread"] = dict(layer.spread)
    for name in LAYER_MESH_FIELDS:
        if getattr(layer, name) is not None:
            data[name] = getattr(layer, name)
    if layer.collectives:
        data["collectives"] = [collective.to_dict() for collective in layer.collectives]
    return data


def _cost_to_dict(cost: RecomputeCost) -> dict[str, float]:
    data = {
        "extra_ms": cost.extra_ms,
        "activation_bytes": cost.activation_bytes,
        "working_bytes": cost.working_bytes,
        "retained_bytes": cost.retained_bytes,
        "pending_bytes": cost.pending_bytes,
    }
    for name in (
        "input_working_bytes",
        "weight_working_bytes",
        "input_held_bytes",
        "weight_freed_bytes",
        *COST_MESH_FIELDS,
    ):
        if getattr(cost, name) is not None:
            data[name] = getattr(cost, name)
    for name in ("output_gradient_freed_bytes", "saved_input_bytes"):
        if getattr(cost, name):
            data[name] = getattr(cost, name)
    return data


def _layer_from_dict(data: object, where: str) -> LayerProfile:
    fields = Fields(data, where)
    recompute_data = fields.raw("recompute")
    if not isinstance(recompute_data, Mapping) or not recompute_data:
        raise InputError(f"{where}.recompute", 'expected an object of recompute modes holding at least "none"')
    recompute = {}
    for mode, cost_data in recompute_data.items():
        cost = Fields(cost_data, f"{where}.recompute.{mode}")
        recompute[mode] = RecomputeCost(
            extra_ms=cost.number("extra_ms", required=True),
            activation_bytes=cost.number("activation_bytes", required=True),
            working_bytes=cost.number("working_bytes", 0.0),
            retained_bytes=cost.number("retained_bytes", 0.0),
            pending_bytes=cost.number("pending_bytes", 0.0),
            input_working_bytes=cost.number("input_working_bytes"),
            weight_working_bytes=cost.number("weight_working_bytes"),
            input_held_bytes=cost.number("input_held_bytes"),
            output_gradient_freed_bytes=cost.number("output_gradient_freed_bytes", 0.0),
            saved_input_bytes=cost.number("saved_input_bytes", 0.0),
            weight_freed_bytes=cost.number("weight_freed_bytes"),
            **{name: cost.number(name) for name in COST_MESH_FIELDS},
        )
        cost.done()
    layer = LayerProfile(
        name=fields.text("name", required=True),
        kind=fields.text("kind", required=True),
        forward_ms=fields.number("forward_ms", required=True),
        backward_ms=fields.number("backward_ms", required=True),
        weight_ms=fields.number("weight_ms"),
        input_ms=fields.number("input_ms"),
        parameter_bytes=fields.number("parameter_bytes", 0.0),
        gradient_bytes=fields.number("gradient_bytes", 0.0),
        optimizer_bytes=fields.number("optimizer_bytes", 0.0),
        recompute=recompute,
        spread=spread_from_dict(fields.raw("spread", {}), f"{where}.spread"),
        parameter_tensors=fields.integer("parameter_tensors"),
        replicated_parameter_bytes=fields.number("replicated_parameter_bytes"),
        replicated_gradient_bytes=fields.number("replicated_gradient_bytes"),
        expert_parameter_bytes=fields.number("expert_parameter_bytes"),
        collectives=collectives_from_list(fields.raw("collectives", []), f"{where}.collectives"),
    )
    fields.done()
    return layer


def _check_profile(profile: ModelProfile) -> None:
    if not profile.layers:
        raise InputError("layers", "expected at least one layer")
    if len(profile.layers) > MAX_LAYERS:
        raise InputError("layers", f"{len(profile.layers):,} layers; expected at most {MAX_LAYERS:,}")
    check_bytes(profile.rank_constant_bytes, "rank_constant_bytes")
    check_bytes(profile.stage_output_bytes, "stage_output_bytes")
    check_bytes(profile.stage_shared_bytes, "stage_shared_bytes")
    check_bytes(profile.checkpoint_state_bytes, "checkpoint_state_bytes")
    check_bytes(profile.model_output_bytes, "model_output_bytes")
    check_bytes(profile.loss_bytes, "loss_bytes")
    if profile.loss_bytes > profile.model_output_bytes:
        raise InputError(
            "loss_bytes",
            f"expected at most model_output_bytes ({profile.model_output_bytes:,.0f}), got {profile.loss_bytes:,.0f}",
        )
    check_dimensions(profile.dimensions)
    check_micro_batch(profile.micro_batch)
    layers = profile.layers
    check_printable(profile.model, "model")
    for index, layer in enumerate(layers):  # names go into tables and error lines: each one line
        check_printable(layer.name, f"layers[{index}].name")
        check_printable(layer.kind, f"layers[{index}].kind")
    check_kinds(
        [layer.kind for layer in layers], [f"layers[{i}] ({named(layer.name)}).kind" for i, layer in enumerate(layers)]
    )
    for index, layer in enumerate(layers):
        _check_layer(layer, f"layers[{index}] ({named(layer.name)})")
    names = {layer.name for layer in layers}
    for index, tied in enumerate(profile.tied_parameters):
        check_bytes(tied.bytes, f"tied_parameters[{index}].bytes")
        unknown = [name for name in tied.layers if name not in names]
        if unknown:
            raise InputError(f"tied_parameters[{index}].layers", f"{unknown[0]!r} is not a layer of this profile")


def check_kinds(kinds: Sequence[str], names: Sequence[str]) -> None:
    """Each kind is head, tail or body:<type>, heads before every body layer, tails after; at least
    one body layer. `names` name each kind in errors."""
    seen_body = seen_tail = False
    for kind, where in zip(kinds, names):
        body = kind.startswith(BODY_PREFIX) and len(kind) > len(BODY_PREFIX)
        if kind not in (HEAD, TAIL) and not body:
            raise InputError(where, f"expected head, tail or body:<type>, got {kind!r}")
        if kind == HEAD and (seen_body or seen_tail):
            raise InputError(where, "a head layer must come before every body and tail layer")
        if body and seen_tail:
            raise InputError(where, "a body layer must come before every tail layer")
        seen_body |= body
        seen_tail |= kind == TAIL
    if not seen_body:
        raise InputError("layers", "expected at least one body layer (kind body:<type>)")


def _check_layer(layer: LayerProfile, where: str) -> None:
    for name in ("forward_ms", "backward_ms"):
        check_ms(getattr(layer, name), f"{where}.{name}")
    for name in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        check_bytes(getattr(layer, name), f"{where}.{name}")
    _check_parts(layer, where)
    if layer.input_ms is not None:
        check_ms(layer.input_ms, f"{where}.input_ms")
    if layer.weight_ms is not None:
        check_ms(layer.weight_ms, f"{where}.weight_ms")
        if layer.weight_ms > layer.backward_ms:
            raise InputError(
                f"{where}.weight_ms", f"expected at most backward_ms ({layer.backward_ms:g}), got {layer.weight_ms:g}"
            )
    if NONE not in layer.recompute:
        raise InputError(f"{where}.recompute", 'expected the mode "none" (no recompute)')
    kept = layer.recompute[NONE].activation_bytes
    for mode, cost in layer.recompute.items():
        if mode not in RECOMPUTE_MODES:
            raise InputError(f"{where}.recompute.{mode}", f"unknown mode; expected one of {', '.join(RECOMPUTE_MODES)}")
        check_ms(cost.extra_ms, f"{where}.recompute.{mode}.extra_ms")
        for name in (
            "activation_bytes",
            "working_bytes",
            "retained_bytes",
            "pending_bytes",
            "input_working_bytes",
            "weight_working_bytes",
            "input_held_bytes",
            "output_gradient_freed_bytes",
            "saved_input_bytes",
            "weight_freed_bytes",
            *COST_MESH_FIELDS,
        ):
            if getattr(cost, name) is not None:
                check_bytes(getattr(cost, name), f"{where}.recompute.{mode}.{name}")
        if cost.input_held_bytes is not None and cost.input_held_bytes < cost.pending_bytes:
            raise InputError(
                f"{where}.recompute.{mode}.input_held_bytes",
                f"expected at least pending_bytes ({cost.pending_bytes:,.0f}), got {cost.input_held_bytes:,.0f}",
            )
        freed_most = cost.pending_bytes + cost.activation_bytes
        if cost.weight_freed_bytes is not None and not cost.pending_bytes <= cost.weight_freed_bytes <= freed_most:
            raise InputError(
                f"{where}.recompute.{mode}.weight_freed_bytes",
                f"expected pending_bytes ({cost.pending_bytes:,.0f}) to pending_bytes + activation_bytes "
                f"({freed_most:,.0f}), got {cost.weight_freed_bytes:,.0f}",
            )
        if cost.saved_input_bytes > cost.activation_bytes:
            raise InputError(
                f"{where}.recompute.{mode}.saved_input_bytes",
                f"expected at most activation_bytes ({cost.activation_bytes:,.0f}), got {cost.saved_input_bytes:,.0f}",
            )
        if cost.retained_bytes > cost.activation_bytes:
            raise InputError(
                f"{where}.recompute.{mode}.retained_bytes",
                f"expected at most activation_bytes ({cost.activation_bytes:,.0f}), got {cost.retained_bytes:,.0f}",
            )
        _check_parts_of(cost, f"{where}.recompute.{mode}")
        if cost.activation_bytes > kept:
            raise InputError(
                f"{where}.recompute.{mode}.activation_bytes",
                f"keeps more ({cost.activation_bytes:,.0f}) than no recompute ({kept:,.0f}); a recompute mode must save memory",
            )
    if layer.recompute[NONE].extra_ms != 0:
        raise InputError(
            f"{where}.recompute.none.extra_ms",
            f"expected 0 (no recompute redoes nothing), got {layer.recompute[NONE].extra_ms:g}",
        )
    if not layer.is_body and set(layer.recompute) != {NONE}:
        raise InputError(f"{where}.recompute", 'head and tail layers are not recomputed; give only "none"')


def _check_parts(layer: LayerProfile, where: str) -> None:
    """The parts of a layer's parameter and gradient bytes that tensor and expert parallelism treat apart."""
    tensors = layer.parameter_tensors
    if tensors is not None and (isinstance(tensors, bool) or not isinstance(tensors, int) or not 0 <= tensors <= 2**50):
        raise InputError(f"{where}.parameter_tensors", f"expected an integer from 0 to 2**50, got {shown(tensors)}")
    apart = 0.0
    for name in ("replicated_parameter_bytes", "expert_parameter_bytes"):
        if getattr(layer, name) is not None:
            check_bytes(getattr(layer, name), f"{where}.{name}")
            apart += getattr(layer, name)
    if apart > layer.parameter_bytes:
        raise InputError(
            f"{where}.replicated_parameter_bytes",
            f"with expert_parameter_bytes, expected at most "
            f"parameter_bytes ({layer.parameter_bytes:,.0f}), got {apart:,.0f}",
        )
    if layer.replicated_gradient_bytes is not None:
        check_bytes(layer.replicated_gradient_bytes, f"{where}.replicated_gradient_bytes")
        if layer.replicated_gradient_bytes > layer.gradient_bytes:
            raise InputError(
                f"{where}.replicated_gradient_bytes",
                f"expected at most gradient_bytes "
                f"({layer.gradient_bytes:,.0f}), got {layer.replicated_gradient_bytes:,.0f}",
            )


def _check_parts_of(cost: RecomputeCost, where: str) -> None:
    """Each part of a mode's activation (working) bytes is at most the whole; with sequence
    parallelism, less stays whole than without."""
    for name in ("tp_whole_activation_bytes", "sp_whole_activation_bytes", "expert_activation_bytes"):
        if getattr(cost, name) is not None and getattr(cost, name) > cost.activation_bytes:
            raise InputError(
                f"{where}.{name}",
                f"expected at most activation_bytes ({cost.activation_bytes:,.0f}), got {getattr(cost, name):,.0f}",
            )
    if cost.expert_working_bytes is not None and cost.expert_working_bytes > cost.working_bytes:
        raise InputError(
            f"{where}.expert_working_bytes",
            f"expected at most working_bytes ({cost.working_bytes:,.0f}), got {cost.expert_working_bytes:,.0f}",
        )
    whole, sequence_whole = cost.tp_whole_activation_bytes, cost.sp_whole_activation_bytes
    if whole is not None and sequence_whole is not None and sequence_whole > whole:
        raise InputError(
            f"{where}.sp_whole_activation_bytes",
            f"expected at most tp_whole_activation_bytes ({whole:,.0f}), got {sequence_whole:,.0f}",
        )
