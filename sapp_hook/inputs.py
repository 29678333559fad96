"""Reading the files a user points the CLI at: profiles, plans, MindFormers YAML. Safely."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from simulator.errors import InputError
from simulator.files import read_json, read_limited

MAX_DEPTH = 32
# What aliases may add to a document's nodes when expanded: real configs' aliases add dozens (`*dp` in
# dataset_strategy); a few lines of nested aliases ("billion laughs") add billions.
MAX_ALIAS_NODES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe subset, at most MAX_DEPTH levels deep and with at most MAX_ALIAS_NODES nodes added
    by expanding its aliases (an alias bomb is refused before anything is built), each key once in
    a mapping."""

    depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise InputError(
                    "yaml", f"line {self.peek_event().start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels"
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def compose_document(self):  # type: ignore[no-untyped-def]
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_yaml_int(self, node):  # type: ignore[no-untyped-def]
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python reads at most 4,300 decimal digits into an integer
            raise InputError(
                "yaml", f"line {_line(node)}: an integer of {len(node.value):,} digits; expected at most 4,300"
            ) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a composed document whose aliases nest it deeper than MAX_DEPTH, expand it by more than
    MAX_ALIAS_NODES nodes or refer to a node from inside it, or a mapping that repeats a key."""
    distinct: set[int] = set()
    pending = [root]
    while pending:  # every node once, however often aliases name it
        node = pending.pop()
        if id(node) not in distinct:
            distinct.add(id(node))
            pending.extend(_children(node))
    limit = len(distinct) + MAX_ALIAS_NODES
    known: dict[int, tuple[int, int]] = {}  # id -> (nodes once expanded, levels)
    inside: set[int] = set()

    def visit(node: yaml.Node, depth: int) -> tuple[int, int]:
        if id(node) in inside:
            raise InputError("yaml", f"line {_line(node)}: an alias refers to a node from inside it, which never ends")
        if id(node) not in known:
            if depth > MAX_DEPTH:
                raise InputError(
                    "yaml", f"line {_line(node)}: nested deeper than {MAX_DEPTH} levels once its aliases are expanded"
                )
            if isinstance(node, yaml.MappingNode):
                _check_keys(node)
            inside.add(id(node))
            nodes, levels = 1, 1
            for child in _children(node):
                child_nodes, child_levels = visit(child, depth + 1)
                nodes, levels = nodes + child_nodes, max(levels, child_levels + 1)
                if nodes > limit:
                    raise InputError(
                        "yaml",
                        f"its aliases expand it by more than {MAX_ALIAS_NODES:,} nodes "
                        f"(line {_line(child)}): an alias bomb?",
                    )
            inside.discard(id(node))
            known[id(node)] = nodes, levels
        if depth + known[id(node)][1] - 1 > MAX_DEPTH:
            raise InputError(
                "yaml", f"line {_line(node)}: nested deeper than {MAX_DEPTH} levels once its aliases are expanded"
            )
        return known[id(node)]

    visit(root, 1)


def _check_keys(node: yaml.MappingNode) -> None:
    """A key said twice in one mapping (PyYAML keeps the last, ruamel refuses, MindFormers reads one)."""
    seen: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode):
            first = seen.get((key.tag, key.value))
            if first is not None:
                raise InputError(
                    "yaml",
                    f"line {_line(key)}: key {key.value!r} repeats the one on line {first}; "
                    "expected each key once in a mapping",
                )
            seen[(key.tag, key.value)] = _line(key)


def read_document(path: str | Path, what: str) -> object:
    """A JSON or YAML file (by suffix) as plain data."""
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        return read_json(path, what)
    return read_yaml(path, what)


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


def read_yaml(path: str | Path, what: str) -> object:
    """A YAML file as plain data, through the strict safe loader."""
    path = Path(path)
    try:
        text = read_limited(path, what).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(what, f"{path} is not UTF-8 text: {exc}") from None
    return parse_yaml(text, what, path)


def parse_yaml(text: str, what: str, source: object) -> object:
    """YAML text (from `source`, a path) as plain data, through the strict safe loader; one
    InputError naming `what` and `source` for anything it refuses."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except InputError as exc:
        raise InputError(what, f"{source}: {exc.detail}") from None
    except yaml.YAMLError as exc:
        raise InputError(what, f"{source} is not valid YAML: {exc}".replace("\n", " ")) from None


# Where a MindFormers training config keeps each plan key, besides the top level: the classic format's
# place first (where its writer puts it), then llm_template_v2's.
MINDFORMERS_PLACES = {
    "offset": (
        ("model", "model_config", "offset"),
        ("distribute_parallel_config", "pipeline_parallel_config", "pipeline_stage_offset"),
    ),
    "pp_interleave_num": (
        ("model", "model_config", "pp_interleave_num"),
        ("distribute_parallel_config", "pipeline_parallel_config", "virtual_pipeline_model_parallel_size"),
    ),
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
    return _as_counts(keys, what)


def _ops(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, str) for item in value)


def _as_counts(keys: dict[str, object], what: str) -> dict[str, object]:
    """The recompute keys as counts, as MindFormers reads them: op patterns recompute every layer, a
    mapping of ops one count (the plan has one selective mode), and a select key saying less than
    recompute says recompute's (MindFormers selects nothing in a fully recomputed layer)."""
    if _ops(keys.get("recompute")):
        keys["recompute"] = True
    full = keys.get("recompute")
    for key in ("select_recompute", "select_comm_recompute"):
        value = keys.get(key)
        if isinstance(value, Mapping):
            values = [True if _ops(item) else item for item in value.values()]
            if any(item != values[0] for item in values):
                raise InputError(
                    what,
                    f"{key} gives its ops different counts ({value}); a plan has one "
                    "selective mode: expected the same count for every op",
                )
            value = values[0] if values else False
        value = True if _ops(value) else value
        if key not in keys:
            continue
        if value is False or value is None or full is True:
            del keys[key]  # a plan's select counts default to its full ones
        else:
            keys[key] = _at_least(value, full)
    return keys


def _at_least(value: object, floor: object) -> object:
    """`value`, each count raised to `floor`'s where both are lists of the same shape."""
    if isinstance(value, list) and isinstance(floor, list) and len(value) == len(floor):
        return [_at_least(item, limit) for item, limit in zip(value, floor)]
    if (
        isinstance(value, int)
        and isinstance(floor, int)
        and not isinstance(value, bool)
        and not isinstance(floor, bool)
    ):
        return max(value, floor)
    return value
