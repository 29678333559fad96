"""The arguments `autotune` takes and the settings `sapp-hook run` passes it: each refused with one InputError naming
it, before anything is attached or profiled."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from basics.errors import InputError, check_non_negative
from profiler.estimate.shape import model_dimensions
from profiler.tp_roles import tagged
from sapp_hook.hook.relaunch import ENVIRONMENT, ON_PLAN
from solver import PipelineSpec
from solver.parallel.model_parallel import check_dimensions, spec_mesh


def check_arguments(model: object, optimizer: object, **given: object) -> None:
    """The arguments' types, each refused with one InputError naming it (the numbers the pipeline spec
    takes are checked there), before anything is attached or profiled."""
    if not isinstance(model, nn.Module):
        raise InputError("model", f"expected a torch.nn.Module, got {_kind(model)}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError("optimizer", f"expected a torch.optim.Optimizer or None, got {_kind(optimizer)}")
    if not isinstance(given["schedule"], str):
        raise InputError("schedule", f"expected a schedule name such as '1F1B', got {_kind(given['schedule'])}")
    budget = given["memory_budget"]
    if budget is not None and not isinstance(budget, str) and budget != math.inf:
        check_non_negative(budget, "memory_budget")
    for name in ("config", "cache_dir", "out_dir"):
        if given[name] is not None and not isinstance(given[name], (str, os.PathLike)):
            raise InputError(name, f"expected a path (str or os.PathLike) or None, got {_kind(given[name])}")
    if given["target"] is not None and not isinstance(given["target"], str):
        raise InputError("target", f"expected a target name such as 'mindformers', got {_kind(given['target'])}")
    for name in ("profile_steps", "warmup_steps"):
        value = given[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(name, f"expected an integer >= 1, got {value!r}")
    for name in ("modes", "layers", "mtp_layers"):
        value = given[name]
        if value is not None and (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not all(isinstance(item, str) for item in value)
        ):
            raise InputError(name, f"expected a list of strings, got {_kind(value)}")
    if given["modes"] is None:
        raise InputError("modes", "expected a list of recompute modes such as ['none', 'full'], got None")
    if not isinstance(given["force"], bool):
        raise InputError("force", f"expected True or False, got {_kind(given['force'])}")


def check_layout(model: nn.Module, spec: PipelineSpec, measured_tensor_parallel: int) -> None:
    """The model's sizes against the degrees `spec` splits them by, before any step is profiled: InputError
    naming tensor_parallel where it divides no heads, key-value heads, FFN or vocabulary, expert_parallel
    where the model has no routed experts or their count is not a multiple. A model whose sizes the profiler
    does not read (not of the Llama family) is checked once profiled."""
    dimensions = model_dimensions(model.config.to_dict()) if tagged(model) else {}
    # a model already split over t (DTensor) is measured per rank: nothing more is divided
    tensor = spec.tensor_parallel > 1 and measured_tensor_parallel == 1
    check_dimensions(dimensions, spec_mesh(spec), tensor=tensor, expert=spec.expert_parallel > 1)


def settings(
    config: str | Path | None, target: str | None, on_plan: str, cache_dir: str | Path | None, force: bool
) -> tuple[dict[str, str], tuple]:
    """(each setting's name in errors: the argument's, or the environment variable's that overrode it; config,
    target, on_plan, cache_dir and force as `sapp-hook run`'s environment overrides them). InputError for an
    on_plan it does not know, and for config or target without the other."""
    given = environment()
    field = {name: ENVIRONMENT[name] if name in given else name for name in ENVIRONMENT}
    config, target = given.get("config", config), given.get("target", target)
    on_plan, cache_dir = given.get("on_plan", on_plan), given.get("cache_dir", cache_dir)
    force = force or given.get("force") == "1"
    if on_plan not in ON_PLAN:
        raise InputError(field["on_plan"], f"expected one of {', '.join(ON_PLAN)}, got {on_plan!r}")
    if (config is None) != (target is None):
        missing, other = ("target", "config") if target is None else ("config", "target")
        raise InputError(
            ENVIRONMENT[missing] if other in given else missing,
            f"give config and target together ({field[other]} is set)",
        )
    return field, (config, target, on_plan, cache_dir, force)


def environment() -> dict[str, str]:
    """The settings `sapp-hook run` passes in the environment (ENVIRONMENT), those set and not empty."""
    given = {name: os.environ[variable] for name, variable in ENVIRONMENT.items() if os.environ.get(variable)}
    if given.get("force", "0") not in ("0", "1"):
        raise InputError(ENVIRONMENT["force"], f"expected 1 (profile again) or 0, got {given['force']!r}")
    return given


def check_out_dir(folder: Path) -> None:
    """The folder for the plan, report and chart: refused now where it cannot be made or written, not
    once the profiling steps are done."""
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError("out_dir", f"{existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError("out_dir", f"folder {existing} is read-only")


def _kind(value: object) -> str:
    """`value` for an error line: short ones as written, others by their type."""
    shown = repr(value)
    return shown if len(shown) <= 40 else f"a {type(value).__name__}"
