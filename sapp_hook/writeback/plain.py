"""The plan itself, as JSON or YAML (the plan JSON `solve --plan-out` writes), for launchers sapp-hook has
no target for."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from basics.files import read_limited
from sapp_hook.writeback.files import WriteBack, commit
from sapp_hook.writeback.layout import Layout


def write_plan(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    if path.suffix.lower() in (".yaml", ".yml"):
        text = yaml.safe_dump(json.loads(layout.plan_json()), sort_keys=False, default_flow_style=None)
    else:
        text = layout.plan_json()
    old = read_limited(path, "--config").decode("utf-8", "replace") if path.is_file() else ""
    return commit(WriteBack(path=path, diff=""), old, text, dry_run=dry_run)
