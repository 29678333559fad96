"""Reading the files the solver takes: a profile in either format it comes in (sapp-hook's JSON or SAPP's layer
JSON), and a plan JSON."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from basics.documents import read_document
from basics.errors import InputError, check_instance
from basics.files import read_json
from solver.formats.sapp import profile_from_sapp
from solver.vocabulary.profile import ModelProfile


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile: sapp-hook's JSON, or SAPP's layer JSON (`layers_description`)."""
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
    """A plan JSON (`solve --plan-out`, `Plan.to_dict`): an object holding `spec` and `plan`."""
    data = read_document(path, what)
    if not (
        isinstance(data, Mapping) and isinstance(data.get("spec"), Mapping) and isinstance(data.get("plan"), Mapping)
    ):
        raise InputError(
            what, f"{path}: expected a plan JSON as sapp-hook solve --plan-out writes it (an object with spec and plan)"
        )
    return data
