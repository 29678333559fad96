"""Writing a plan into the launch config of a training job: one module per target.

Every writer keeps comments, key order and unrelated keys, checks the plan against the config (stage
count, schedule) before touching anything, writes atomically with a backup, and in a dry run only
returns the diff. Where a target cannot express the plan it says so in `WriteBack.notes`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sapp_hook.writeback import megatron, mindformers
from sapp_hook.writeback.files import WriteBack, read_config
from sapp_hook.writeback.layout import Layout, layout_from_dict, layout_of
from sapp_hook.writeback.megatron import write_megatron
from sapp_hook.writeback.mindformers import write_mindformers
from sapp_hook.writeback.plain import write_plan
from sapp_hook.writeback.torchtitan import write_torchtitan
from simulator.errors import InputError

TARGETS: dict[str, Callable[..., WriteBack]] = {
    "mindformers": write_mindformers,
    "megatron": write_megatron,
    "torchtitan": write_torchtitan,
    "plan": write_plan,
}


def write_config(target: str, path: str | Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    """Write `layout` into the `target` config at `path`."""
    check_target(target, "--target")
    return TARGETS[target](Path(path), layout, dry_run=dry_run)


def check_target(target: str, field: str) -> None:
    if target not in TARGETS:
        raise InputError(field, f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")


DECLARED_LAYERS: dict[str, Callable[[Path, str], tuple[int, str] | None]] = {
    "mindformers": mindformers.declared_layers,
    "megatron": megatron.declared_layers,
}


def check_destination(
    target: str, path: str | Path, *, target_field: str, config_field: str, body_layers: int | None = None
) -> None:
    """Refuse, before any work, a target sapp-hook does not know, a config it cannot rewrite (a plan
    file, the `plan` target, may be new), or one that says another number of decoder layers than the
    model's `body_layers` (where known)."""
    check_target(target, target_field)
    if target == "plan":
        return
    read_config(Path(path), config_field)
    if body_layers is None or target not in DECLARED_LAYERS:
        return
    declared = DECLARED_LAYERS[target](Path(path), config_field)
    if declared is not None and declared[0] != body_layers:
        raise InputError(config_field, f"{path} has {declared[1]} {declared[0]}; the model has {body_layers} blocks")


__all__ = ["TARGETS", "Layout", "WriteBack", "check_destination", "layout_from_dict", "layout_of", "write_config"]
