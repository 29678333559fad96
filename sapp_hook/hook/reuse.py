"""Whether a cached plan may be reused: the entry read back whole, against everything this job asks for, before
anything is written. An entry made for another job (copied, edited, of an older release) or damaged is planned
again, with the reason said."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from basics.errors import InputError
from profiler.measure.build import device_name, fingerprint, parameters_dtype
from sapp_hook.hook.relaunch import installed_version
from sapp_hook.writeback import layout_from_dict
from solver import ModelProfile, PipelineSpec, plan_from_dict
from solver.vocabulary.spec import spec_from_dict, spec_to_dict

# what the hook reads of a plan, beyond what layout_from_dict checks
PLAN_FIELDS = ("iteration_time", "rank_peak_memory_bytes", "spec", "plan")


def unusable(
    entry: Mapping[str, Any], key_parts: Mapping[str, object], spec: PipelineSpec, *, auto: bool = False
) -> str | None:
    """Why the cached `entry` cannot stand for this job (made of `key_parts`, planned for `spec`; `auto`: for
    whichever schedule was fastest), or None."""
    if _normal(entry.get("key")) != _normal(key_parts):
        return "it was made for another job (its key's parts differ)"
    plan = entry.get("plan")
    missing = [name for name in PLAN_FIELDS if not isinstance(plan, Mapping) or name not in plan]
    if missing:
        return f"its plan lacks {', '.join(missing)}"
    try:
        planned = spec_to_dict(spec_from_dict(plan["spec"]))
        layout_from_dict(plan)
        profile = ModelProfile.from_dict(entry.get("profile"))
        plan_from_dict(profile, plan)
    except InputError as error:
        return f"it does not read back ({error})"
    wanted = spec_to_dict(spec)
    chosen = ("schedule", "chunks") if auto else ()
    differs = sorted(name for name in wanted if planned.get(name) != wanted[name] and name not in chosen)
    if differs:
        names = ", ".join(f"{name} {planned.get(name)!r} (this job: {wanted[name]!r})" for name in differs[:3])
        return f"it was planned for other settings: {names}"
    return None


def job_key(
    pipeline: Sequence[Mapping[str, Any]],
    spec: PipelineSpec,
    device: torch.device,
    model: nn.Module,
    modes: Sequence[str],
) -> dict[str, object]:
    """What a cached plan is keyed by: the model whatever the split (its pipeline ranks' `model_structure` and
    input shapes, in pipeline order), the settings, the device, the dtype, the recompute modes and this release."""
    return {
        # the model, whatever the split: a plan written for it must find itself again after the relaunch
        "model": fingerprint([part["structure"] for part in pipeline]),
        "input_shapes": [part["input_shape"] for part in pipeline],
        "spec": spec_to_dict(spec),
        "device": device_name(device),
        "dtype": parameters_dtype(model),
        "modes": list(modes),
        # another release may measure or plan differently (its memory model gains what runs showed)
        "sapp_hook": installed_version(),
    }


def _normal(value: object) -> object:
    """`value` as JSON reads it back (tuples as lists), for comparing what was stored with what is made now."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))
