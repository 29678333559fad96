"""SAPP's layer JSON (MindFormers / hyper_parallel `layers_description`) read with SAPP's semantics.

`time` is one micro-batch's forward in milliseconds; the backward without recompute is
2 x time x (1 + backward_coef), and recompute type r's backward is 2 x time x (1 + coef_r), or
the explicit `*_time` where given. Memory is in MiB; `memory_parameter` lumps parameters,
gradients and optimizer state. A recompute type is offered when its activation memory is > 0.
HEAD and TAIL carry a time (backward 2x) and a memory lump only.

Where SAPP is silent or wrong, this reader says so instead: a BODY whose `memory_activation`
is missing or not positive is refused (SAPP silently forbids "no recompute", bug B5), each BODY
kind keeps its own recompute types (SAPP applies the first kind's to all), and `recompute_time`
is read (SAPP's lookup key has a trailing space, bug B6).
"""

from __future__ import annotations

from collections.abc import Mapping

from basics.errors import InputError, check_bytes
from basics.fields import Fields
from basics.units import MIB
from solver.vocabulary.profile import (
    COMM,
    FULL,
    HEAD,
    MAX_LAYERS,
    NONE,
    SELECTIVE,
    SELECTIVE_COMM,
    TAIL,
    LayerProfile,
    ModelProfile,
    RecomputeCost,
)

BACKWARD_RATIO = 2.0
# mode: (activation key, coefficient key, explicit backward time key, SAPP's default coefficient)
SAPP_TYPES = {
    NONE: ("memory_activation", "backward_coef", "backward_time", 0.0),
    SELECTIVE: ("memory_select_rec", "select_rec_coef", "select_rec_time", 0.04),
    COMM: ("memory_select_comm", "select_comm_coef", "select_comm_time", 0.125),
    SELECTIVE_COMM: ("memory_both_comm_select", "both_comm_select_coef", "both_comm_select_time", 0.165),
    FULL: ("memory_recompute", "recompute_coef", "recompute_time", 0.5),
}


def profile_from_sapp(data: Mapping) -> ModelProfile:
    """A ModelProfile from SAPP's layer description (already parsed JSON)."""
    top = Fields(data, "")
    for key in ("pre_defined_layer", "auto_partition_layer"):
        top.raw(key)  # used only by SAPP's trace parser
    description = top.raw("layers_description")
    if not isinstance(description, list) or not description:
        raise InputError("layers_description", "expected a non-empty list")
    layers: list[LayerProfile] = []
    for index, item in enumerate(description):
        layers.extend(_layers(item, f"layers_description[{index}]"))
        if len(layers) > MAX_LAYERS:  # before a huge nb_layer is expanded further
            raise InputError(f"layers_description[{index}].nb_layer", f"brings the model past {MAX_LAYERS:,} layers")
    profile = ModelProfile(
        layers=tuple(layers),
        model=top.text("name"),
        source="sapp-json",
        rank_constant_bytes=_mib(top, "stage_const_mem"),
    )
    top.done()
    return profile


def _layers(item: object, where: str) -> list[LayerProfile]:
    if isinstance(item, Mapping):
        item = {str(key).strip(): value for key, value in item.items()}  # SAPP writes "recompute_time "
    fields = Fields(item, where)
    name = fields.text("name", required=True)
    fields.text("model_name")
    kind_name = fields.text("type", required=True)
    count = fields.integer("nb_layer", 1, least=1)
    if count > MAX_LAYERS:
        raise InputError(f"{where}.nb_layer", f"expected at most {MAX_LAYERS:,}, got {count:,}")
    forward_ms = fields.number("forward_time")
    time_ms = fields.number("time", required=True)
    forward_ms = time_ms if forward_ms is None else forward_ms
    parameter_bytes = _mib(fields, "memory_parameter")
    backward_ms = BACKWARD_RATIO * time_ms

    if kind_name in ("HEAD", "TAIL"):
        kind = HEAD if kind_name == "HEAD" else TAIL
        fields.done()
        return [
            LayerProfile(
                name=name if count == 1 else f"{name}.{i}",
                kind=kind,
                forward_ms=forward_ms,
                backward_ms=backward_ms,
                parameter_bytes=parameter_bytes,
                recompute={NONE: RecomputeCost(0.0, 0.0)},
            )
            for i in range(count)
        ]
    if kind_name != "BODY":
        raise InputError(f"{where}.type", f"expected HEAD, BODY or TAIL, got {kind_name!r}")

    backward = {}
    activation = {}
    for mode, (memory_key, coef_key, time_key, default_coef) in SAPP_TYPES.items():
        explicit = fields.number(time_key)
        coef = fields.number(coef_key, default_coef)
        backward[mode] = explicit if explicit is not None else backward_ms * (1.0 + coef)
        kept = _mib(fields, memory_key)
        if kept > 0:
            activation[mode] = kept
    if NONE not in activation:
        raise InputError(
            f"{where}.memory_activation",
            "expected the activation memory without recompute, > 0 (SAPP would silently forbid no recompute)",
        )
    fields.done()
    base_ms = backward[NONE]
    recompute = {}
    for mode, kept in activation.items():
        if backward[mode] < base_ms:
            raise InputError(
                f"{where}.{SAPP_TYPES[mode][1]}", f"recompute type {mode} makes the backward shorter than none"
            )
        recompute[mode] = RecomputeCost(extra_ms=backward[mode] - base_ms, activation_bytes=kept)
    return [
        LayerProfile(
            name=f"{name}.{i}",
            kind=f"body:{name}",
            forward_ms=forward_ms,
            backward_ms=base_ms,
            parameter_bytes=parameter_bytes,
            recompute=recompute,
        )
        for i in range(count)
    ]


def _mib(fields: Fields, key: str) -> float:
    """A size SAPP states in MiB (0 where missing), in bytes; InputError naming the key beyond MAX_BYTES."""
    size = (fields.number(key, 0.0) or 0.0) * MIB
    check_bytes(size, fields.at(key))
    return size
