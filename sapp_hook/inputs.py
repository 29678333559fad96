"""Reading the files a user points the CLI at: profiles, plans, MindFormers YAML. Safely."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from simulator.errors import InputError
from solver.profile import read_json, read_limited

MAX_DEPTH = 32


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe subset, without anchors and aliases (a few lines of aliases can expand to
    gigabytes) and at most MAX_DEPTH levels deep."""

    depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise InputError("yaml", f"aliases are not accepted (line {event.start_mark.line + 1})")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise InputError("yaml", f"nested deeper than {MAX_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def read_document(path: str | Path, what: str) -> object:
    """A JSON or YAML file (by suffix) as plain data."""
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        return read_json(path, what)
    return read_yaml(path, what)


def read_plan_json(path: str | Path, what: str) -> Mapping:
    """A plan JSON (`solve --plan-out`, `Plan.to_dict`): an object holding `spec` and `plan`."""
    data = read_document(path, what)
    if not (isinstance(data, Mapping) and isinstance(data.get("spec"), Mapping) and isinstance(data.get("plan"), Mapping)):
        raise InputError(what, f"{path}: expected a plan JSON as sapp-hook solve --plan-out writes it "
                               "(an object with spec and plan)")
    return data


def read_yaml(path: str | Path, what: str) -> object:
    """A YAML file as plain data, through the strict safe loader."""
    path = Path(path)
    try:
        text = read_limited(path, what).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(what, f"{path} is not UTF-8 text: {exc}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except InputError as exc:
        raise InputError(what, f"{path}: {exc.detail}") from None
    except yaml.YAMLError as exc:
        raise InputError(what, f"{path} is not valid YAML: {exc}".replace("\n", " ")) from None


# Where a MindFormers training config keeps each plan key, besides the top level: the classic format's
# place first (where its writer puts it), then llm_template_v2's.
MINDFORMERS_PLACES = {
    "offset": (("model", "model_config", "offset"),
               ("distribute_parallel_config", "pipeline_parallel_config", "pipeline_stage_offset")),
    "pp_interleave_num": (("model", "model_config", "pp_interleave_num"),
                          ("distribute_parallel_config", "pipeline_parallel_config", "virtual_pipeline_model_parallel_size")),
    "recompute": (("recompute_config", "recompute"),),
    "select_recompute": (("recompute_config", "select_recompute"),),
    "select_comm_recompute": (("recompute_config", "select_comm_recompute"),),
}


def mindformers_keys(document: object, what: str) -> dict[str, object]:
    """The plan keys of a flat mapping or of a MindFormers training config."""
    if not isinstance(document, Mapping):
        raise InputError(what, f"expected a mapping of MindFormers keys, got {type(document).__name__}")
    keys: dict[str, object] = {}
    for key, places in MINDFORMERS_PLACES.items():
        if key in document:
            keys[key] = document[key]
            continue
        for place in places:
            node: object = document
            for part in place:
                node = node.get(part) if isinstance(node, Mapping) else None
            if node is not None:
                keys[key] = node
                break
    if "offset" not in keys and not any(k in keys for k in ("recompute", "select_recompute", "select_comm_recompute")):
        raise InputError(what, "found none of offset, recompute, select_recompute, select_comm_recompute")
    return keys
