"""Reading JSON and YAML documents a user gives: YAML through a strict safe loader (bounded depth and alias
expansion, each key once), either by file suffix."""

from __future__ import annotations

from pathlib import Path

import yaml

from basics.errors import InputError
from basics.files import read_json, read_limited

MAX_DEPTH = 32
# What the parser's own recursion may take as written (three Python frames a level): a merge value nested in
# place (`<<: {<<: {...}}`) adds no level to the data, but still one to the text.
MAX_WRITTEN_DEPTH = 128
# What aliases may add to a document's nodes when expanded: real configs' aliases add dozens (`*dp` in
# dataset_strategy); a few lines of nested aliases ("billion laughs") add billions.
MAX_ALIAS_NODES = 100_000
MERGE = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe subset, at most MAX_DEPTH levels deep as loaded (a merge key's mapping adds none: its keys
    join the mapping that merges it) and with at most MAX_ALIAS_NODES nodes added by expanding its aliases
    and merges (an alias bomb is refused before anything is built), each key once in a mapping."""

    depth = written = 0
    merging: tuple[bool, ...] = ()  # per node being composed: whether it is a merge key's value

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        merged = _is_merge(index) if isinstance(parent, yaml.MappingNode) else None
        flat = bool(merged) or (isinstance(parent, yaml.SequenceNode) and self.merging[-1])
        self.depth += not flat
        self.written += 1
        self.merging += (bool(merged),)
        try:
            if self.depth > MAX_DEPTH or self.written > MAX_WRITTEN_DEPTH:
                what = f"{MAX_DEPTH} levels" if self.depth > MAX_DEPTH else f"{MAX_WRITTEN_DEPTH} levels as written"
                raise InputError("yaml", f"line {self.peek_event().start_mark.line + 1}: nested deeper than {what}")
            return super().compose_node(parent, index)
        finally:
            self.depth -= not flat
            self.written -= 1
            self.merging = self.merging[:-1]

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


def _is_merge(key: object) -> bool:
    return isinstance(key, yaml.ScalarNode) and key.tag == MERGE


def _children(node: yaml.Node) -> list[tuple[yaml.Node, int]]:
    """A node's children, each with the levels it adds below the node as loaded: 1, or 0 for a merge key's
    value and a merged list's mappings (their keys join the node's own)."""
    if isinstance(node, yaml.SequenceNode):
        return [(item, 1) for item in node.value]
    if not isinstance(node, yaml.MappingNode):
        return []
    children = []
    for key, value in node.value:
        children.append((key, 1))
        if not _is_merge(key):
            children.append((value, 1))
        elif isinstance(value, yaml.SequenceNode):  # `<<: [*a, *b]`: the list itself is no level either
            children.extend((item, 0) for item in value.value)
        else:
            children.append((value, 0))
    return children


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a composed document whose aliases and merges nest it deeper than MAX_DEPTH as loaded, expand
    it by more than MAX_ALIAS_NODES nodes (PyYAML copies each merged key into the mapping that merges it) or
    refer to a node from inside it, or a mapping that repeats a key."""
    distinct: set[int] = set()
    pending = [root]
    while pending:  # every node once, however often aliases name it
        node = pending.pop()
        if id(node) not in distinct:
            distinct.add(id(node))
            pending.extend(child for child, _ in _children(node))
    limit = len(distinct) + MAX_ALIAS_NODES
    known: dict[int, tuple[int, int]] = {}  # id -> (nodes once expanded, levels as loaded)
    inside: set[int] = set()

    def deeper(node: yaml.Node) -> InputError:
        return InputError(
            "yaml", f"line {_line(node)}: nested deeper than {MAX_DEPTH} levels once its aliases are expanded"
        )

    def visit(node: yaml.Node, depth: int) -> tuple[int, int]:
        if id(node) in inside:
            raise InputError("yaml", f"line {_line(node)}: an alias refers to a node from inside it, which never ends")
        if id(node) not in known:
            if depth > MAX_DEPTH:
                raise deeper(node)
            if isinstance(node, yaml.MappingNode):
                _check_keys(node)
            inside.add(id(node))
            nodes, levels = 1, 1
            for child, step in _children(node):
                child_nodes, child_levels = visit(child, depth + step)
                nodes, levels = nodes + child_nodes, max(levels, child_levels + step)
                if nodes > limit:
                    raise InputError(
                        "yaml",
                        f"its aliases expand it by more than {MAX_ALIAS_NODES:,} nodes "
                        f"(line {_line(child)}): an alias bomb?",
                    )
            inside.discard(id(node))
            known[id(node)] = nodes, levels
        if depth + known[id(node)][1] - 1 > MAX_DEPTH:
            raise deeper(node)
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
