"""Reading a profile file in either format it comes in: sapp-hook's JSON or SAPP's layer JSON."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from simulator.errors import InputError, check_instance
from simulator.files import read_json
from solver.profile import ModelProfile
from solver.sapp import profile_from_sapp


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
