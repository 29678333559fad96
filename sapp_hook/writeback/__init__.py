"""Writing a plan into the launch config of a training job: one module per target.

Every writer keeps comments, key order and unrelated keys, checks the plan against the config (stage
and layer counts, schedule, micro-batches) before touching anything, writes atomically with a backup,
and in a dry run only returns the diff. Where a target cannot express the plan it says so in `WriteBack.notes`;
where the config runs other parallel degrees than the plan was solved for, `degrees` says so or refuses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from basics.errors import InputError, check_instance, shown
from basics.files import folder_locked
from sapp_hook.pipelining.engine_rules import TORCH_SCHEDULES
from sapp_hook.writeback.errors import PLAN, PlanMismatch
from sapp_hook.writeback.files import WriteBack, check_writable, read_config
from sapp_hook.writeback.layout import Layout, even_layout, layout_from_dict, layout_of
from sapp_hook.writeback.megatron import write_megatron
from sapp_hook.writeback.megatron.plan_flags import SCHEDULES as MEGATRON_SCHEDULES
from sapp_hook.writeback.mindformers import write_mindformers
from sapp_hook.writeback.mindformers.values import SCHEDULERS as MINDFORMERS_SCHEDULERS
from sapp_hook.writeback.plain import write_plan
from sapp_hook.writeback.torchtitan import config_path, write_torchtitan
from simulator import SCHEDULES
from solver import PipelineSpec

TARGETS: dict[str, Callable[..., WriteBack]] = {
    "mindformers": write_mindformers,
    "megatron": write_megatron,
    "torchtitan": write_torchtitan,
    "plan": write_plan,
}


def runnable_schedules(target: str | None) -> tuple[str, ...]:
    """The schedules a target's engine runs (and its config can say); None or "plan": every schedule sapp-hook
    plans."""
    runs = {
        "mindformers": tuple(MINDFORMERS_SCHEDULERS),
        "megatron": MEGATRON_SCHEDULES,
        "torchtitan": tuple(TORCH_SCHEDULES),
    }
    return runs.get(target or "plan", tuple(SCHEDULES))


def write_config(target: str, path: str | Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    """Write `layout` into the `target` config at `path`.

    The writer keeps the config's comments, key order and unrelated keys, checks the plan against it
    (stage and layer counts, schedule, micro-batches) before touching anything, and writes atomically:
    the first write keeps the file as it was in `NAME.sapp-hook.bak`.

    Args:
        target: "mindformers" (a YAML config), "megatron" (a launch script or arguments file),
            "torchtitan" (a TOML config, or a Python config as `FILE.py:FUNCTION`) or "plan" (the plan
            JSON itself, YAML where `path` ends in .yaml or .yml; the file may be new).
        path: the config to rewrite.
        layout: the plan (`layout_of(plan)`, or `layout_from_dict` of a plan JSON).
        dry_run: only work out the diff; write nothing.

    Returns:
        A `WriteBack`: `path`, the unified `diff`, `notes` (what the config cannot express, and what was
        written instead), `written` (the files written; empty in a dry run or where nothing changed) and
        `backup`.

    Raises:
        InputError: an unknown `target`, or `path`, `layout` or `dry_run` of the wrong type (naming the
            argument); a config that cannot be read, parsed or written (naming `--config`); a plan the
            config cannot run (`PlanMismatch`, naming `--plan`). Nothing is written then.

    Example:
        >>> import pathlib, tempfile
        >>> from solver import PipelineSpec
        >>> from sapp_hook.writeback.layout import even_layout
        >>> layout = even_layout(PipelineSpec(pipeline_parallel=2, micro_batches=4), body_layers=4)
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
        >>> write_config("plan", path, layout).written == [str(path)]
        True
        >>> write_config("plan", path, layout, dry_run=True).diff  # the file already says the plan
        ''
    """
    check_target(target, "target")
    check_instance(path, (str, os.PathLike), "path", "a path (str or os.PathLike)")
    check_instance(layout, Layout, "layout", "a Layout (sapp_hook.layout_of(plan) or layout_from_dict(plan JSON))")
    check_instance(dry_run, bool, "dry_run", "True or False")
    if dry_run:
        return TARGETS[target](Path(path), layout, dry_run=True)
    # the config and its side file together, and never interleaved with another writer's
    with folder_locked(config_path(path)[0] if target == "torchtitan" else Path(path)):
        return TARGETS[target](Path(path), layout, dry_run=False)


def check_target(target: str, field: str) -> None:
    if not isinstance(target, str) or target not in TARGETS:
        raise InputError(field, f"unknown target {shown(target)}; expected one of {', '.join(TARGETS)}")


def check_destination(target: str, path: str | Path, *, target_field: str, config_field: str) -> None:
    """Refuse, before any work, a target sapp-hook does not know or a config it cannot rewrite (a plan
    file, the `plan` target, may be new).

    Args:
        target: the target, as `write_config` takes it.
        path: the config `write_config` will rewrite.
        target_field: the name errors about `target` give (the argument, or the environment variable
            that set it).
        config_field: the name errors about the config give.

    Raises:
        InputError: naming `target_field` for an unknown target; naming `config_field` where the config
            is not a readable UTF-8 file (any target but "plan") or it, its backup or their folder cannot
            be written.
    """
    check_target(target, target_field)
    # a TorchTitan Python config may name its config function: FILE.py:FUNCTION
    file = config_path(path)[0] if target == "torchtitan" else Path(path)
    if target != "plan":
        read_config(file, config_field)
    try:
        check_writable(file)
    except OSError as exc:
        raise InputError(config_field, f"cannot write {path}: {exc.strerror or exc}") from None


def check_job(target: str, path: str | Path, spec: PipelineSpec, body_layers: int, *, config_field: str) -> None:
    """Refuse, before any work, a config that cannot take any plan for this job (pipeline size, schedule,
    layer count, batch sizes): an even split of `body_layers` written in a dry run.

    Args:
        target: the target, as `write_config` takes it.
        path: the config.
        spec: the job's pipeline (schedule, ranks, chunks, micro-batches).
        body_layers: the blocks of the whole model (every rank's, in a pipeline that profiles its own).
        config_field: the name errors give (the argument, or the environment variable that set it).

    Raises:
        InputError: naming `config_field`: "PATH does not fit this job: the plan ..." where the config
            cannot run a plan for this job, or what `write_config` refuses about the config itself.
    """
    try:
        write_config(target, path, even_layout(spec, body_layers), dry_run=True)
    except PlanMismatch as mismatch:
        raise InputError(config_field, f"{path} does not fit this job: the plan {mismatch.predicate}") from None
    except InputError as error:
        if error.field != PLAN:
            raise InputError(config_field, error.detail) from None
        raise InputError(config_field, f"{path} does not fit this job: {error.detail}") from None


__all__ = [
    "TARGETS",
    "Layout",
    "WriteBack",
    "check_destination",
    "check_job",
    "layout_from_dict",
    "layout_of",
    "runnable_schedules",
    "write_config",
]
