"""Plans remembered between runs, keyed by what decides them: the model's structure, the micro-batch
shape, the parallel settings and the device. A run with the same key reuses the plan; any change to
the model (more layers, an MoE block, a longer sequence) misses and is profiled and solved again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from basics.errors import InputError
from basics.files import atomic_write_text, folder_locked, read_json

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sapp-hook"


def cache_key(parts: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class PlanCache:
    """One JSON file per key: what the key was made of, the plan, and the profile it came from."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_cache_dir()
        if self.folder.exists() and not self.folder.is_dir():  # found now, not when the first plan is stored
            raise InputError("cache_dir", f"{self.folder} is not a folder")

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def load(self, key: str) -> dict[str, object] | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            entry = read_json(path, "plan cache")
        except InputError as exc:
            log.warning("ignoring an unreadable cached plan: %s", exc.detail)
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("plan"), dict):
            log.warning("ignoring a cached plan in an unknown format: %s", path)
            return None
        return entry

    def store(
        self,
        key: str,
        parts: Mapping[str, object],
        plan: Mapping[str, object],
        profile: Mapping[str, object],
        *,
        replanned_after_drift: bool = False,
    ) -> Path | None:
        """Remember the plan (`replanned_after_drift`: made because the plan before it measured off its
        prediction); None where the folder cannot take it (read-only, full): the plan is used all the same, and
        found again only by solving again."""
        entry = {"key": dict(parts), "plan": dict(plan), "profile": dict(profile)}
        if replanned_after_drift:
            entry["replanned_after_drift"] = True
        return self._write(self.path(key), entry, "plan")

    def store_profile(self, key: str, profile: Mapping[str, object]) -> Path | None:
        """Keep a profile before it is solved, so that a failed solve does not lose what was measured."""
        return self._write(self._profile_path(key), dict(profile), "profile")

    def forget_profile(self, key: str) -> None:
        """Remove the profile `store_profile` kept (its plan's entry holds it)."""
        with contextlib.suppress(OSError):
            self._profile_path(key).unlink()

    def _profile_path(self, key: str) -> Path:
        return self.folder / f"{key}.profile.json"

    def _write(self, path: Path, data: Mapping[str, object], what: str) -> Path | None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with folder_locked(path):
                atomic_write_text(path, json.dumps(data, indent=1) + "\n")
        except OSError as exc:
            log.warning("sapp-hook: the %s is not cached: cannot write %s: %s", what, path, exc.strerror or exc)
            return None
        return path
