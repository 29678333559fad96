"""Editing a YAML config in place: each value a plan changes is replaced where it is written, a new key
goes after the last one of its mapping, and every other byte (comments, key order, quoting, anchors and
aliases, indentation, line endings, encoding) stays as it was. The edited text is read back with the
strict loader and checked against the intended change before anything is written.

An anchored value that others alias is changed where the anchor is defined when every use sits under
the same key (`micro_batch_num: &mbn 32` and a callback's `micro_batch_num: *mbn` are one number);
otherwise only the edited key gets its own value and the others keep theirs. A key a mapping takes
from a merge (`<<: *base`) is overridden in that mapping; the base is left alone."""

from __future__ import annotations

import copy
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from basics.documents import parse_yaml
from basics.errors import InputError

MISSING = object()
PLAIN_TEXT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
ALIGNED_COMMENT = re.compile(r"( {2,})#")  # a value's comment set in a column by spaces


@dataclass(eq=False)
class Spot:
    """A node as written: where its text starts (its anchor included) and ends (a block collection's
    where its last item's does)."""

    kind: str  # "scalar", "seq", "map" or "alias"
    start: int
    end: int
    flow: bool = False
    anchor: str | None = None
    style: str | None = None  # a scalar's quote, None where plain
    value: str = ""  # a scalar's text as read; an alias's anchor name
    target: Spot | None = None  # the node an alias names
    items: list = field(default_factory=list)  # a sequence's Spots; a mapping's (key Spot, value Spot) pairs


@dataclass(frozen=True)
class Use:
    """One place a node appears: its definition or an alias to it."""

    path: tuple
    key: object  # the mapping key it sits under: None for a list item, "<<" for a merge
    key_spot: Spot | None
    spot: Spot  # what is written there: the node, or an alias


def read_spots(text: str) -> Spot:
    """The document's root node, from the parser's events (the text passed the strict loader first)."""
    events = iter(yaml.parse(text, Loader=yaml.SafeLoader))
    anchors: dict[str, Spot] = {}

    def node(event: yaml.Event) -> Spot:
        start, end = event.start_mark.index, event.end_mark.index
        if isinstance(event, yaml.AliasEvent):
            return Spot("alias", start, end, value=event.anchor, target=anchors[event.anchor])
        if isinstance(event, yaml.ScalarEvent):
            if event.style in ("|", ">"):  # a block scalar's text ends before the line breaks it keeps
                end = len(text[:end].rstrip())
            spot = Spot("scalar", start, end, anchor=event.anchor, style=event.style, value=event.value)
        else:
            mapping = isinstance(event, yaml.MappingStartEvent)
            spot = Spot("map" if mapping else "seq", start, start, flow=bool(event.flow_style), anchor=event.anchor)
            closing = yaml.MappingEndEvent if mapping else yaml.SequenceEndEvent
            for child in events:
                if isinstance(child, closing):
                    spot.end = (
                        child.end_mark.index if spot.flow else (spot.items[-1][-1] if mapping else spot.items[-1]).end
                    )
                    break
                spot.items.append((node(child), node(next(events))) if mapping else node(child))
        if spot.anchor:
            anchors[spot.anchor] = spot
        return spot

    for event in events:
        if isinstance(event, (yaml.DocumentEndEvent, yaml.StreamEndEvent)):
            break  # an empty document
        if not isinstance(event, (yaml.StreamStartEvent, yaml.DocumentStartEvent)):
            return node(event)
    return Spot("scalar", 0, 0)


class YamlEdit:
    """A YAML file's text, its data, and the changes to make to it."""

    def __init__(self, text: str, source: Path, flag: str) -> None:
        self.text, self.source, self.flag = text, source, flag
        self.data = parse_yaml(text, flag, source)
        self.root = read_spots(text)
        self.uses: dict[int, list[Use]] = defaultdict(list)
        self._walk(self.root, (), None, None)
        self.expected = copy.deepcopy(self.data)
        self.notes: list[str] = []
        self._edits: list[tuple[int, int, str]] = []
        self._created: dict[int, tuple[Spot, dict]] = {}
        self.newline = "\r\n" if "\r\n" in text else "\n"
        scalars = [spot.value for use in self.uses.values() for spot in [use[0].spot] if spot.kind == "scalar"]
        words = Counter(value for value in scalars if value in ("True", "False", "true", "false"))
        self.capitals = words["True"] + words["False"] > words["true"] + words["false"]
        self.step = self._indent_step()

    def _walk(self, spot: Spot, path: tuple, key: object, key_spot: Spot | None) -> None:
        node = spot.target if spot.kind == "alias" else spot
        self.uses[id(node)].append(Use(path, key, key_spot, spot))
        if spot.kind == "map":
            for key_node, value in spot.items:
                name = key_node.value if key_node.kind == "scalar" else None
                self._walk(value, (*path, name), "<<" if name == "<<" else name, key_node)
        elif spot.kind == "seq":
            for index, item in enumerate(spot.items):
                self._walk(item, (*path, index), None, None)

    def _indent_step(self) -> int:
        steps = Counter(
            self._column(value.items[0][0].start) - self._column(key.start)
            for use in self.uses.values()
            for spot in [use[0].spot]
            if spot.kind == "map" and not spot.flow
            for key, value in spot.items
            if value.kind == "map" and not value.flow and value.items
        )
        return max((step for step in steps if step > 0), key=lambda step: steps[step], default=2)

    def _column(self, index: int) -> int:
        line_start = self.text.rfind("\n", 0, index) + 1
        return index - line_start - (line_start == 0 and self.text.startswith("\ufeff"))

    def get(self, path: tuple) -> object:
        """The value at `path` as MindFormers reads it (merges applied), or MISSING."""
        node = self.data
        for part in path:
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return MISSING
        return node

    def set(self, path: tuple, value: object) -> None:
        """Make `path` hold `value`: nothing where it already does."""
        if same(self.get(path), value):
            return
        mapping, found = self._mapping_at(path)
        where = dotted(path)
        pair = (
            next((pair for pair in mapping.items if pair[0].value == path[-1]), None)
            if found == len(path) - 1
            else None
        )
        if pair is None:
            if found == len(path) - 1 and self.get(path) is not MISSING:
                self.notes.append(
                    f"{where} came from a merge (<<:): it is written in {dotted(path[:-1])} itself, "
                    "overriding the merged value; the merged mapping is left as it was"
                )
            self._create(mapping, path[found:], value)
            _put(self.expected, path, value)
            return
        key_spot, spot = pair
        node = spot.target if spot.kind == "alias" else spot
        uses = self.uses[id(node)]
        if len(uses) == 1:
            self._replace(node, value, key_spot)
            _put(self.expected, path, value)
            return
        others = ", ".join(dotted(use.path) for use in uses if use.path != path)
        if all(use.key == path[-1] for use in uses):
            definition = uses[0]
            self._replace(node, value, definition.key_spot)
            for use in uses:
                _put(self.expected, use.path, value)
            self.notes.append(
                f"{where} is {'*' if spot.kind == 'alias' else '&'}{node.anchor}, also {others}: "
                f"changed where &{node.anchor} is defined ({dotted(definition.path)}), so every use follows"
            )
            return
        if spot.kind == "alias":
            self._edits.append((spot.start, spot.end, self.render(value)))
        elif node.kind == "scalar" or node.flow:  # the anchor moves to its first alias, which keeps the value
            self._edits.append((uses[1].spot.start, uses[1].spot.end, self.text[node.start : node.end]))
            self._edits.append((node.start, node.end, self.render(value, node)))
        else:
            raise InputError(
                self.flag,
                f"{self.source}: {where} is the anchor &{node.anchor} of a block also used as "
                f"{others}: give {where} a value of its own, then apply again",
            )
        _put(self.expected, path, value)
        self.notes.append(
            f"{where} shared &{node.anchor} with {others}: it gets a value of its own and the others keep theirs"
        )

    def _mapping_at(self, path: tuple) -> tuple[Spot, int]:
        """The deepest mapping the file writes along `path` (its own keys, aliases followed) and how
        many parts of `path` lead to it."""
        spot = self.root
        for depth, part in enumerate(path[:-1]):
            pair = next((pair for pair in spot.items if pair[0].value == part), None) if spot.kind == "map" else None
            if pair is None:
                if self.get(path[: depth + 1]) is not MISSING:
                    raise InputError(
                        self.flag,
                        f"{self.source}: {dotted(path[: depth + 1])} comes from a merge (<<:); "
                        f"sapp-hook writes {dotted(path)} only into a section the file writes "
                        f"out: write {dotted(path[: depth + 1])} out in {dotted(path[:depth]) or 'the file'}",
                    )
                return spot, depth
            node = pair[1].target if pair[1].kind == "alias" else pair[1]
            uses = self.uses[id(node)]
            if len(uses) > 1 and any(use.key != part for use in uses):
                others = ", ".join(dotted(use.path) for use in uses if use.path != path[: depth + 1])
                raise InputError(
                    self.flag,
                    f"{self.source}: {dotted(path[: depth + 1])} is shared (&{node.anchor}) "
                    f"with {others}: sapp-hook changes a shared section only where every use "
                    f"has its name; give {dotted(path[: depth + 1])} a section of its own",
                )
            if node.kind == "scalar" and self.get(path[: depth + 1]) is None:  # `section:` left empty
                return node, depth + 1
            if node.kind != "map":
                raise InputError(self.flag, f"{self.source}: {dotted(path[: depth + 1])} is not a mapping")
            spot = node
        return spot, len(path) - 1

    def _create(self, mapping: Spot, keys: tuple, value: object) -> None:
        tree = self._created.setdefault(id(mapping), (mapping, {}))[1]
        for key in keys[:-1]:
            tree = tree.setdefault(key, {})
        tree[keys[-1]] = value

    def _replace(self, node: Spot, value: object, key_spot: Spot | None) -> None:
        anchor = f"&{node.anchor} " if node.anchor else ""
        if node.kind == "scalar" and node.start == node.end:  # `key:` with nothing after it
            self._edits.append((node.start, node.end, " " + anchor + self.render(value)))
        elif node.kind in ("scalar", "alias") or node.flow:
            self._edits.append(self._aligned(node.start, node.end, anchor + self.render(value, node)))
        else:  # a block collection: a flow one on the key's line where nothing else is there
            colon = self.text.index(":", key_spot.end) + 1 if key_spot else node.start
            line_end = self._line_end(colon)
            if key_spot and not anchor and not self.text[colon:line_end].strip():
                self._edits.append((colon, node.end, " " + self.render(value)))
            else:
                self._edits.append((node.start, node.end, anchor + self.render(value)))

    def _aligned(self, start: int, end: int, replacement: str) -> tuple[int, int, str]:
        """An edit of text[start:end] that keeps an aligned end-of-line comment after it in its column."""
        gap = ALIGNED_COMMENT.match(self.text, end)
        if gap is None:
            return start, end, replacement
        spaces = max(1, len(gap.group(1)) - (len(replacement) - (end - start)))
        return start, gap.end(1), replacement + " " * spaces

    def _line_end(self, index: int) -> int:
        end = self.text.find("\n", index)
        end = len(self.text) if end < 0 else end
        return end - 1 if end and self.text[end - 1] == "\r" else end

    def render(self, value: object, like: Spot | None = None) -> str:
        """`value` as flow YAML, quoted and capitalised as `like` (the value it replaces) or the file is."""
        if isinstance(value, bool):
            capitals = (
                like.value[:1].isupper()
                if like is not None and like.value in ("True", "False", "true", "false")
                else self.capitals
            )
            return str(value) if capitals else str(value).lower()
        if isinstance(value, int):
            return str(value)
        if isinstance(value, str):
            quote = like.style if like is not None and like.kind == "scalar" and like.style in ("'", '"') else None
            if quote == '"':
                return json.dumps(value, ensure_ascii=False)
            if quote is None and PLAIN_TEXT.fullmatch(value) and yaml.safe_load(value) == value:
                return value
            return "'" + value.replace("'", "''") + "'"
        if isinstance(value, list):
            return "[" + ", ".join(self.render(item) for item in value) + "]"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{self.render(str(key))}: {self.render(item)}" for key, item in value.items()) + "}"
        if value is None:
            return "null"
        raise TypeError(f"no YAML for {value!r}")

    def _block(self, tree: dict, indent: int) -> list[str]:
        lines = []
        for key, value in tree.items():
            if isinstance(value, dict):
                lines.append(f"{' ' * indent}{self.render(str(key))}:")
                lines.extend(self._block(value, indent + self.step))
            else:
                lines.append(f"{' ' * indent}{self.render(str(key))}: {self.render(value)}")
        return lines

    def result(self) -> str:
        """The edited text, checked: it reads back as the data with the intended changes and nothing else."""
        inserts: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for mapping, tree in self._created.values():
            if mapping.kind == "scalar":  # an empty section gets its keys as a flow mapping
                self._edits.append(
                    (mapping.start, mapping.end, " " * (mapping.start == mapping.end) + self.render(tree))
                )
            elif mapping.flow:
                text = ", ".join(f"{self.render(str(key))}: {self.render(value)}" for key, value in tree.items())
                inserts[mapping.end - 1].append((0, (", " if mapping.items else "") + text))
            elif mapping.items:
                indent = self._column(mapping.items[0][0].start)
                lines = self._block(tree, indent)
                inserts[self._line_end(mapping.end)].append((-indent, "".join(self.newline + line for line in lines)))
            else:  # an empty document
                inserts[len(self.text)].append((0, self.newline.join(self._block(tree, 0)) + self.newline))
        edits = sorted(
            self._edits
            + [
                (at, at, "".join(text for _, text in sorted(parts, key=lambda part: part[0])))
                for at, parts in inserts.items()
            ]
        )
        pieces, done = [], 0
        for start, end, replacement in edits:
            if start < done:
                raise InputError(
                    self.flag, f"{self.source}: sapp-hook would change one place of it twice; nothing was written"
                )
            pieces += [self.text[done:start], replacement]
            done = end
        text = "".join([*pieces, self.text[done:]])
        where = difference(parse_yaml(text, self.flag, self.source), self.expected, ())
        if where is not None:
            raise InputError(
                self.flag,
                f"{self.source}: rewritten, it would read differently at {dotted(where) or 'its top'} "
                "from the config with the plan in it; nothing was written",
            )
        return text


def _put(data: object, path: tuple, value: object) -> None:
    for part in path[:-1]:
        if isinstance(data, dict) and data.get(part) is None:
            data[part] = {}
        data = data[part]
    data[path[-1]] = copy.deepcopy(value)


def dotted(path: tuple) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


def same(a: object, b: object) -> bool:
    """Equal as YAML values: 1 is not True, 1.0 is not 1."""
    return difference(a, b, ()) is None


def difference(a: object, b: object, path: tuple) -> tuple | None:
    """Where `a` and `b` first differ as YAML values, or None."""
    if type(a) is not type(b):
        return path
    if isinstance(a, dict):
        if list(a) != list(b):
            return path
        return next((where for key in a if (where := difference(a[key], b[key], (*path, key))) is not None), None)
    if isinstance(a, list):
        if len(a) != len(b):
            return path
        return next(
            (
                where
                for index, (x, y) in enumerate(zip(a, b))
                if (where := difference(x, y, (*path, index))) is not None
            ),
            None,
        )
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else path
