"""Changing a launch script where its flags are written: taking a flag (and its value) out, giving a
flag another value (where the script sets that value, an assignment if the value is `$VAR`), and
adding flags next to another one, in the same command, array or quoted string, written the way the
lines around them are (one flag a line with the same indent and `\\` continuation, or on the line).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

from sapp_hook.writeback.megatron.flags import Occurrence, sites_at, written_depth
from sapp_hook.writeback.text.provenance import Field, Reading, Site, part_of

PLAIN = re.compile(r"[\w@%+=:,./-]*")  # what a shell word holds without quotes
CONTINUED = re.compile(r"[ \t]*\\[ \t]*")
GAP = re.compile(r"(?:[ \t]|\\\r?\n)*")


class EditError(Exception):
    """A change sapp-hook cannot make safely; `detail` says which and where."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass(frozen=True)
class Edit:
    file: int
    start: int
    end: int
    text: str
    kind: str  # the box's: "command", "array", "value", "arguments"

    @property
    def removal(self) -> bool:
        return not self.text and self.end > self.start


def quoted(value: str, quote: str, evaluated: bool) -> str:
    """`value` as a script writes it where the quoting is `quote`; `evaluated`: the text is read a
    second time (eval, bash -c), so a value with shell characters needs quotes of its own."""
    if PLAIN.fullmatch(value) or quote == "raw":  # raw: a file of arguments, split at blanks and nothing more
        return value
    if quote == '"':
        return f"'{value}'" if evaluated else value
    if quote in ("'", "$'"):
        return f'"{value}"' if evaluated else value
    return f"\"'{value}'\"" if evaluated else f'"{value}"'


def removal(reading: Reading, occurrence: Occurrence) -> Edit:
    """Take the flag and its value out where they are written."""
    depth, prefix = _container(reading, occurrence)
    sites = _sites(reading, occurrence, occurrence.name + _joined(occurrence.values), depth, prefix)
    return Edit(
        sites[0].file,
        min(site.start for site in sites),
        max(site.end for site in sites),
        "",
        reading.boxes[sites[0].box].kind,
    )


def replacement(
    reading: Reading, occurrence: Occurrence, values: list[str], *, evaluated: bool, protected: set[str]
) -> tuple[Edit, str]:
    """Give the flag these values where its value is set, and a note when that is in a variable's
    assignment (or where a variable had to give way to a value written out). A variable in
    `protected` (other flags use it) is never changed: its reference is replaced instead."""
    depth, prefix = _container(reading, occurrence)
    chars = _joined(occurrence.values)
    if not chars:  # a list flag given no value: the values go after it
        site = _sites(reading, occurrence, occurrence.name, depth, prefix)[-1]
        kind = reading.boxes[site.box].kind
        return Edit(
            site.file,
            site.end,
            site.end,
            " " + _render(values, "raw" if kind == "arguments" else site.quote, evaluated),
            kind,
        ), ""
    _sites(reading, occurrence, chars, depth, prefix)  # the value is where the flag is
    level, note = depth, ""
    followed: set[str] = set()  # X=${X:-4} names X twice on the way down
    while True:
        sites = sites_at(chars, level)
        if sites is None:
            raise EditError(f"the value of {occurrence.flag} ({_where(reading, occurrence)}) cannot be followed")
        first = sites[0]
        ref = reading.refs[first.ref] if len(set(sites)) == 1 and first.ref >= 0 else None
        if ref is not None:
            deeper = sites_at(chars, level + 1)
            if (
                deeper is not None
                and ref.state in ("set", "environment")
                and not ref.alternatives
                and (ref.name not in protected or ref.name in followed)
            ):  # set once: changed where it is set
                protected.add(ref.name)
                followed.add(ref.name)
                if written_depth(chars) == level + 1:
                    where = reading.where(deeper[0])
                    note = (
                        f"{occurrence.flag} is ${ref.name}: set in the default of ${{{ref.name}:-...}} ({where}); "
                        f"{ref.name} set where the script is launched overrides it"
                        if ref.state == "environment"
                        else f"{occurrence.flag} is ${ref.name}: set where {ref.name} is assigned ({where})"
                    )
                level += 1
                continue
            note = f"{occurrence.flag} was ${ref.name} ({reading.where(first)}): written out as the plan's value there"
        if any(site.file != first.file or site.box != first.box for site in sites):
            raise EditError(
                f"the value of {occurrence.flag} ({_where(reading, occurrence)}) is built in several places"
            )
        start, end = min(site.start for site in sites), max(site.end for site in sites)
        quote = "" if any(site.quote in ("", "\\") for site in sites) else first.quote
        kind = reading.boxes[first.box].kind
        quote = "raw" if kind == "arguments" else quote
        if kind == "value" and not quote and not all(PLAIN.fullmatch(value) for value in values):
            raise EditError(
                f"the value of {occurrence.flag} is in the unquoted value of a variable "
                f"({reading.where(first)}), where {' '.join(values)} needs quotes"
            )
        return Edit(first.file, start, end, _render(values, quote, evaluated), kind), note


def insertion(
    reading: Reading, anchor: Occurrence, flags: list[tuple[str, list[str]]], *, evaluated: bool
) -> tuple[Edit, str]:
    """Add flags right after `anchor`'s value, in the same command, array or string; and where."""
    depth, prefix = _container(reading, anchor)
    sites = _sites(reading, anchor, anchor.name + _joined(anchor.values), depth, prefix)
    flag_site = sites[0]
    last = max(sites, key=lambda site: site.end)
    source = reading.files[last.file]
    text = source.text
    box = reading.boxes[last.box]
    quote = "raw" if box.kind == "arguments" else "" if last.quote in ("", "\\") else last.quote
    position = last.end
    tokens = reading_tokens(reading, last.file) if box.kind in ("command", "array") else []
    if quote and tokens and (not evaluated or _token(tokens, flag_site.start + 1) != _token(tokens, last.end)):
        quote = ""  # quotes in a word read once (`"$PP"`, `--size="$PP"`) end with it: the flags go after the word
    if box.kind in ("command", "array") and not quote:
        position = (_token(tokens, position) or (position, position))[1]
    elif box.kind == "value" and not quote:
        raise EditError(
            f"{anchor.flag} is in the unquoted value of {box.name} ({reading.where(last)}): sapp-hook "
            "adds flags in a command, an array or a quoted string"
        )
    newline = "\r\n" if source.crlf is not None else "\n"
    line_start = text.rfind("\n", 0, flag_site.start) + 1
    line_end = text.find("\n", position)
    line_end = len(text) if line_end < 0 else line_end
    rest = text[position:line_end].rstrip("\r")
    continued = bool(CONTINUED.fullmatch(rest))
    own_line = not text[line_start : flag_site.start].strip()
    if box.kind == "command":
        new_line = continued
    elif box.kind == "array" and not quote:
        new_line = bool(re.fullmatch(r"[ \t]*(\\[ \t]*)?(#.*)?", rest))
    elif box.kind == "arguments":
        new_line = not rest.strip()
    else:
        new_line = bool(re.fullmatch(r"[ \t]*(\\[ \t]*)?", rest))
    rendered = [" ".join([flag, _render(values, quote, evaluated)]) if values else flag for flag, values in flags]
    kind = {"command": "command", "array": "array", "arguments": "arguments file"}.get(box.kind, "string")
    where = f"the {kind} {box.name} ({reading.where(last)})" if box.name else f"the {kind} of {reading.where(last)}"
    if own_line and new_line:
        indent = text[line_start : flag_site.start]
        tail = " \\" if continued else ""
        block = "".join(f"{indent}{line}{tail}{newline}" for line in rendered)
        block_start = line_end + 1 if line_end < len(text) else len(text)
        if line_end == len(text):
            block = newline + block.removesuffix(newline)
        return Edit(last.file, block_start, block_start, block, box.kind), where
    return Edit(last.file, position, position, "".join(" " + line for line in rendered), box.kind), where


def splice(text: str, edits: list[Edit], tokens: list[tuple[int, int]]) -> str:
    """The text with the edits made; a removal takes blanks, an emptied word or line, and the `\\`
    that continued a command onto a line that went."""
    spans: list[tuple[int, int, str]] = []
    removals = sorted((edit for edit in edits if edit.removal), key=lambda edit: edit.start)
    merged: list[list] = []
    for edit in removals:
        start, end = _whole_tokens(text, edit.start, edit.end, tokens)
        if merged and GAP.fullmatch(text, merged[-1][1], start):
            merged[-1][1] = max(merged[-1][1], end)
            merged[-1][2] = merged[-1][2] or edit.kind == "command"
        else:
            merged.append([start, end, edit.kind == "command"])
    for start, end, command in merged:
        spans.extend(_line_cleanup(text, start, end, command))
    spans.extend((edit.start, edit.end, edit.text) for edit in edits if not edit.removal)
    spans.sort(key=lambda span: (span[0], span[1]))
    for (_, end, _), (next_start, _, _) in pairwise(spans):
        if next_start < end:
            raise EditError(f"two changes meet at character {next_start}")
    for start, end, new in reversed(spans):
        text = text[:start] + new + text[end:]
    return text


def _whole_tokens(text: str, start: int, end: int, tokens: list[tuple[int, int]]) -> tuple[int, int]:
    """Widen a removal over each word it cuts whose rest is only quotes (`"--flag value"` goes whole)."""
    widened_start, widened_end = start, end
    for token_start, token_end in tokens:
        if token_end <= start or token_start >= end:
            continue
        rest = text[token_start : max(token_start, start)] + text[min(token_end, end) : token_end]
        if not rest.strip("\"'$"):
            widened_start, widened_end = min(widened_start, token_start), max(widened_end, token_end)
    return widened_start, widened_end


def _line_cleanup(text: str, start: int, end: int, command: bool) -> list[tuple[int, int, str]]:
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    line_end = len(text) if line_end < 0 else line_end
    before, after = text[line_start:start], text[end:line_end].rstrip("\r")
    if not before.strip() and after.strip() in ("", "\\"):
        spans = [(line_start, min(line_end + 1, len(text)), "")]
        if command and not after.strip() and line_start > 0:  # the command's last line went
            previous_start = text.rfind("\n", 0, line_start - 1) + 1
            previous = text[previous_start : line_start - 1].rstrip("\r")
            backslash = re.search(r"[ \t]*\\$", previous)
            if backslash:
                spans.append((previous_start + backslash.start(), previous_start + backslash.end(), ""))
        return spans
    blanks = re.match(r"[ \t]+", text[end:line_end])
    if blanks:
        return [(start, end + blanks.end(), "")]
    trailing = re.search(r"[ \t]+$", before)
    return [(line_start + trailing.start() if trailing else start, end, "")]


def _token(tokens: list[tuple[int, int]], position: int) -> tuple[int, int] | None:
    """The narrowest shell word holding the character before `position`."""
    best = None
    for start, end in tokens:
        if start < position <= end and (best is None or end - start < best[1] - best[0]):
            best = (start, end)
    return best


def reading_tokens(reading: Reading, file: int) -> list[tuple[int, int]]:
    """Every word's span in a file's own text."""
    source = reading.files[file]
    if source.script is None:
        return [(match.start(), match.end()) for match in re.finditer(r"\S+", source.text)]
    return [(source.offset(start), source.offset(end - 1) + 1) for start, end in source.script.words if end > start]


def _container(reading: Reading, occurrence: Occurrence) -> tuple[int, tuple[Site, ...]]:
    flag_chars = part_of(occurrence.name, 0, len(occurrence.flag))
    depth = written_depth(flag_chars)
    if depth is None:
        raise EditError(
            f"{occurrence.flag} is built from variables or a value known only at launch "
            f"({_where(reading, occurrence)}): sapp-hook cannot change it where it is written"
        )
    return depth, flag_chars[0].trail[:depth]


def _sites(reading: Reading, occurrence: Occurrence, chars: Field, depth: int, prefix: tuple[Site, ...]) -> list[Site]:
    sites = sites_at(chars, depth)
    if (
        sites is None
        or any(ch.trail[:depth] != prefix for ch in chars)
        or any((site.file, site.box) != (sites[0].file, sites[0].box) for site in sites)
    ):
        raise EditError(
            f"{occurrence.flag} and its value ({_where(reading, occurrence)}) are not written in one "
            "place: sapp-hook cannot change them"
        )
    return sites


def _where(reading: Reading, occurrence: Occurrence) -> str:
    trail = occurrence.name[0].trail if occurrence.name else ()
    return reading.where(trail[-1]) if trail else "a value known only at launch"


def _joined(fields: tuple[Field, ...]) -> Field:
    return tuple(ch for chars in fields for ch in chars)


def _render(values: list[str], quote: str, evaluated: bool) -> str:
    return " ".join(quoted(value, quote, evaluated) for value in values)
