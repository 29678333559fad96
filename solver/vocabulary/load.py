"""Reading the files the solver takes: a profile in either format it comes in (sapp-hook's JSON or SAPP's layer
JSON), and a plan JSON."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from basics.documents import read_document
from basics.errors import InputError, check_instance
from basics.files import read_json
from basics.side_files import read_checked
from solver.formats.sapp import profile_from_sapp
from solver.vocabulary.profile import ModelProfile


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile: sapp-hook's JSON, or SAPP's layer JSON (`layers_description`).

    Args:
        path: a JSON file: sapp-hook's profile (`ModelProfile.save`, `sapp-hook profile`: an object with
            `schema_version` and `layers`) or SAPP's layer description (an object with `layers_description`).

    Returns:
        The `ModelProfile`: every layer's times (ms) and bytes, per recompute mode.

    Raises:
        InputError: naming `profile` where the path is not a path, the file cannot be read, is too large,
            is not JSON or is neither format; naming the field where a field is missing or wrong
            (`schema_version`, `layers`, ...).

    Example:
        >>> import pathlib, tempfile
        >>> from solver import LayerProfile, ModelProfile, RecomputeCost
        >>> none = {"none": RecomputeCost(extra_ms=0.0, activation_bytes=1024.0)}
        >>> kinds = ["head", "body:block", "body:block", "tail"]
        >>> profile = ModelProfile(tuple(LayerProfile(f"layer{i}", k, 2.0, 4.0, none) for i, k in enumerate(kinds)))
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "profile.json"
        >>> profile.save(path)
        >>> load_profile(path) == profile
        True
    """
    check_instance(path, (str, os.PathLike), "profile", "a path (str or os.PathLike)")
    data = read_json(path, "profile")
    if not isinstance(data, Mapping) or not ("layers_description" in data or "schema_version" in data):
        raise InputError(
            "profile",
            f"{path}: expected sapp-hook's profile (an object with schema_version and layers) or SAPP's "
            "layer JSON (an object with layers_description)",
        )
    if "layers_description" in data:
        return profile_from_sapp(data)
    return ModelProfile.from_dict(data)


def read_plan_json(path: str | Path, what: str) -> Mapping:
    """A plan JSON (`solve --plan-out`, `Plan.to_dict`): an object holding `spec` and `plan`. A config's side
    file (`NAME.sapp-hook.json`) is checked against the config beside it (`basics.side_files`)."""
    data = read_checked(path, what, lambda plan: read_document(plan, what))
    if not (
        isinstance(data, Mapping) and isinstance(data.get("spec"), Mapping) and isinstance(data.get("plan"), Mapping)
    ):
        raise InputError(
            what, f"{path}: expected a plan JSON as sapp-hook solve --plan-out writes it (an object with spec and plan)"
        )
    return data
