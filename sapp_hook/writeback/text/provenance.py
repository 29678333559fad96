"""What a run of a launch script yields: every character traced to where a file writes it (its
trail of sites), values, the boxes (commands, assignments) words are written in, variable
definitions and references, the commands run, and the files read. `bash_script` fills them in.

Characters written one after another in one place travel together (one `Ch` for a stretch, its last
site spanning them), so that a long line costs a few objects per word, not several per character.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from sapp_hook.writeback.text.bash_shell import Script
from sapp_hook.writeback.text.bash_words import line_of


@dataclass(frozen=True, slots=True)
class Site:
    """Where a file writes something: `file` index, span of its text, the box (command or assignment)
    it is written in, how it is quoted there, and for a variable reference the index of its Ref."""

    file: int
    start: int
    end: int
    box: int
    quote: str
    ref: int = -1


Trail = tuple[Site, ...]  # outermost first: the reference in the command ... the character itself


@dataclass(frozen=True, slots=True)
class Ch:
    """Characters of a field written one after another in one place: the last site of their trail spans
    them, one file character each (a value known only at launch is one character, "\\0", its site the
    expansion's); with an empty trail, text sapp-hook works out itself (the script's own folder)."""

    text: str
    trail: Trail
    unknown: str = ""  # what a value known only at launch stands for

    def cut(self, start: int, end: int) -> Ch:
        """Its characters `start` to `end`, their last site narrowed to them."""
        if (start, end) == (0, len(self.text)) or self.unknown:
            return self
        if not self.trail:
            return Ch(self.text[start:end], ())
        last = self.trail[-1]
        narrowed = Site(last.file, last.start + start, last.start + end, last.box, last.quote, last.ref)
        return Ch(self.text[start:end], (*self.trail[:-1], narrowed))


Field = tuple[Ch, ...]


def text_of(chars: Field) -> str | None:
    """The text of a field, None where part of it is known only at launch."""
    if len(chars) == 1:  # most fields: written in one place
        return None if chars[0].unknown else chars[0].text
    if any(ch.unknown for ch in chars):
        return None
    return "".join(ch.text for ch in chars)


def part_of(chars: Field, start: int, end: int | None = None) -> Field:
    """The characters `start` to `end` (None: the last) of a field, counted in characters."""
    stop = sum(len(ch.text) for ch in chars) if end is None else end
    out = []
    position = 0
    for ch in chars:
        after = position + len(ch.text)
        if after > start and position < stop:
            out.append(ch.cut(max(start, position) - position, min(stop, after) - position))
        position = after
    return tuple(out)


@dataclass(frozen=True)
class Value:
    chars: Field | None = None  # a scalar
    items: tuple[Field, ...] | None = None  # an array

    def scalar(self) -> Field:
        if self.chars is not None:
            return self.chars
        return self.items[0] if self.items else ()

    def elements(self) -> tuple[Field, ...]:
        return self.items if self.items is not None else (self.scalar(),)


@dataclass(frozen=True)
class Box:
    """A command or an assignment that holds words: kind "command", "array", "value" (a scalar's
    value) or "arguments" (a file of arguments read by `$(cat FILE)` or given as the config)."""

    kind: str
    file: int
    start: int
    end: int
    name: str = ""
    conditional: bool = False


@dataclass(frozen=True)
class Definition:
    name: str
    value: Value | None  # None: unset
    box: int
    conditional: bool
    refs: tuple[int, ...] = ()  # the references its value expands (an empty one leaves no character)


@dataclass(frozen=True)
class Ref:
    """A variable reference: "set" (one definition reaches it), "ambiguous" (several may: branches),
    "environment" (the script does not set it: its value comes from where it is launched)."""

    name: str
    state: str
    used: int  # the definition expanded (-1: none)
    alternatives: tuple[int, ...]  # other definitions that may hold instead


@dataclass(frozen=True)
class Command:
    argv: tuple[Field, ...]
    box: int
    conditional: bool
    evaluated: bool  # its words were read a second time by eval or bash -c (quotes in values count)
    refs: tuple[int, ...] = ()  # the references its words expand (and an eval's around it)


@dataclass
class SourceFile:
    path: Path
    text: str
    script: Script | None  # None: an arguments file
    crlf: list[int] | None = None  # where CRLF line ends were read as LF: the parsed index of each such LF

    def offset(self, index: int) -> int:
        """The index in `text` of the parsed text's character `index`."""
        return index + bisect_right(self.crlf, index) if self.crlf is not None else index

    def line(self, offset: int) -> int:
        return line_of(self.text, offset)


@dataclass
class Reading:
    """Everything a script run passes: its files, boxes, references, definitions and commands, and
    what could not be followed."""

    files: list[SourceFile] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    refs: list[Ref] = field(default_factory=list)
    definitions: list[Definition] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    unfollowed: list[str] = field(default_factory=list)
    functions_unused: list[tuple[int, int, int]] = field(default_factory=list)  # file, start, end

    def where(self, site: Site) -> str:
        source = self.files[site.file]
        return f"{source.path.name} line {source.line(site.start)}"


class ReadError(Exception):
    """A script sapp-hook cannot follow: `detail` names the file, line and what."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail
