"""What `autotune` decided, as its `result` holds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sapp_hook.hook.check import RankCheck
from sapp_hook.writeback import Layout, WriteBack
from solver import ModelProfile, Plan


@dataclass
class TuneResult:
    """What autotune decided. `plan` (with its simulation) and `profile` exist on the rank that solved."""

    plan_data: dict[str, Any]
    layout: Layout
    from_cache: bool
    plan: Plan | None = None
    profile: ModelProfile | None = None
    writeback: WriteBack | None = None
    report: str = ""
    check: list[RankCheck] | None = None  # a reused plan's first step, measured against it (rank 0)
