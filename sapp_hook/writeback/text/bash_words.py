"""Reading the words of a bash script: quotes, escapes, `\\`-newline continuations and expansions
(`$X`, `${X:-word}`, `${A[@]}`, `$(...)`, backquotes, `$((...))`), each character kept with its
position and how it was quoted. `bash_shell` reads the commands these words make up.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass

META = " \t\n;&|<>()"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SPECIAL_PARAMETERS = "@*#?$!-0123456789"


class ShellError(Exception):
    """A script sapp-hook cannot read as bash does: `detail` says what, at `position` of the text."""

    def __init__(self, position: int, detail: str) -> None:
        super().__init__(detail)
        self.position = position
        self.detail = detail


def line_of(text: str, position: int) -> int:
    return text.count("\n", 0, max(0, position)) + 1


# literal text bare and inside "...", up to the next character that means more there
BARE_RUN = re.compile(f"[^{re.escape(META)}\\\\'\"$`]+")
DOUBLE_QUOTED_RUN = re.compile(r'[^"\\$`]+')


@dataclass(frozen=True, slots=True)
class Literal:
    """Literal characters of a word after quote removal, written one after another from `position` (one
    text position per character); `quote` says how they were written: '' bare, '\\\\' escaped, '"' or "'"
    inside those quotes, "$'" inside ANSI-C quotes."""

    text: str
    position: int
    quote: str


@dataclass(frozen=True)
class Param:
    """`$NAME`, `${NAME}`, `${NAME:-word}` and the like, `${NAME[@]}`; `op` is '' or one of
    :- - := = :+ + (the other operators are Opaque)."""

    name: str
    start: int
    end: int
    quote: str
    op: str = ""
    arg: Word | None = None
    index: str = ""  # '@' or '*' for a whole array


@dataclass(frozen=True)
class Opaque:
    """An expansion whose value a launch script computes at run time: `$(...)`, backquotes,
    `$((...))`, `$1`, `$@`, `${#X}`, `${X/a/b}`... `commands` holds what a `$(...)` runs."""

    text: str
    start: int
    end: int
    quote: str
    kind: str  # "command", "arithmetic", "special", "expansion"
    commands: tuple[object, ...] = ()  # bash_shell nodes


Part = Literal | Param | Opaque


@dataclass(frozen=True)
class Word:
    parts: tuple[Part, ...]
    start: int
    end: int

    def literal(self) -> str | None:
        """The word's text when it is all literal characters."""
        if all(isinstance(part, Literal) for part in self.parts):
            return "".join(part.text for part in self.parts)  # type: ignore[union-attr]
        return None

    def plain(self) -> str | None:
        """The text of a word written without any quote or escape (a reserved word, a command name)."""
        text = self.literal()
        if text is None or any(part.quote for part in self.parts):  # type: ignore[union-attr]
            return None
        return text


class WordReader(abc.ABC):
    """The word-level half of the parser: `text`, the `position` read up to, and the `end` where reading stops."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.position = 0
        self.end = len(text)
        self.word_spans: set[tuple[int, int]] = set()

    @abc.abstractmethod
    def commands(self, stops: frozenset[str]) -> list:
        """The commands up to a stop (in a `$(...)`): the command reader's."""

    def error(self, detail: str, position: int | None = None) -> ShellError:
        return ShellError(self.position if position is None else position, detail)

    def peek(self, offset: int = 0) -> str:
        index = self.position + offset
        return self.text[index] if index < self.end else ""

    def startswith(self, text: str | tuple[str, ...]) -> bool:
        return self.text.startswith(text, self.position)

    # -- words ------------------------------------------------------------------------------------

    def word(self) -> Word:
        start = self.position
        parts: list[Part] = []
        while self.position < self.end:
            char = self.text[self.position]
            if char in META:
                if char in "<>" and self.peek(1) == "(":  # <(...) >(...)
                    parts.append(self.command_substitution(self.position + 2, "", "process substitution"))
                    continue
                break
            if char == "\\":
                if self.peek(1) == "\n":
                    self.position += 2
                elif self.position + 1 < self.end:
                    parts.append(Literal(self.text[self.position + 1], self.position + 1, "\\"))
                    self.position += 2
                else:
                    parts.append(Literal("\\", self.position, ""))
                    self.position += 1
            elif char == "'":
                parts.extend(self.single_quoted())
            elif char == '"':
                parts.extend(self.double_quoted())
            elif char == "$":
                parts.extend(self.dollar(""))
            elif char == "`":
                parts.append(self.backquoted(""))
            else:
                run = BARE_RUN.match(self.text, self.position, self.end)
                end = run.end() if run else self.position + 1
                parts.append(Literal(self.text[self.position : end], self.position, ""))
                self.position = end
        if self.position == start:
            raise self.error(f"unexpected {self.peek()!r}" if self.peek() else "unexpected end of the script")
        self.word_spans.add((start, self.position))
        return Word(merged(parts), start, self.position)

    def single_quoted(self) -> list[Part]:
        start = self.position
        end = self.text.find("'", self.position + 1)
        if end < 0:
            raise self.error(f"the ' of line {line_of(self.text, start)} is never closed", start)
        self.position = end + 1
        return [Literal(self.text[start + 1 : end], start + 1, "'")] if end > start + 1 else []

    def double_quoted(self) -> list[Part]:
        start = self.position
        self.position += 1
        parts: list[Part] = []
        while True:
            if self.position >= self.end:
                raise self.error(f'the " of line {line_of(self.text, start)} is never closed', start)
            char = self.text[self.position]
            if char == '"':
                self.position += 1
                return parts
            if char == "\\" and self.peek(1) in ("$", "`", '"', "\\", "\n"):
                if self.peek(1) != "\n":  # \<newline> inside "" is a line continuation
                    parts.append(Literal(self.peek(1), self.position + 1, '"'))
                self.position += 2
            elif char == "$":
                parts.extend(self.dollar('"'))
            elif char == "`":
                parts.append(self.backquoted('"'))
            else:
                run = DOUBLE_QUOTED_RUN.match(self.text, self.position, self.end)
                end = run.end() if run else self.position + 1
                parts.append(Literal(self.text[self.position : end], self.position, '"'))
                self.position = end

    def backquoted(self, quote: str) -> Opaque:
        start = self.position
        index = self.position + 1
        while index < self.end and self.text[index] != "`":
            index += 2 if self.text[index] == "\\" else 1
        if index >= self.end:
            raise self.error(f"the ` of line {line_of(self.text, start)} is never closed", start)
        self.position = index + 1
        return Opaque(self.text[start : self.position], start, self.position, quote, "command")

    def dollar(self, quote: str) -> list[Part]:
        start = self.position
        following = self.peek(1)
        if following == "'" and not quote:
            return self.ansi_c_quoted()
        if following == '"' and not quote:
            self.position += 1
            return self.double_quoted()
        if self.text.startswith("$((", self.position):
            end = self._arithmetic_end(self.position + 3)
            self.position = end
            return [Opaque(self.text[start:end], start, end, quote, "arithmetic")]
        if following == "(":
            return [self.command_substitution(self.position + 2, quote, "command")]
        if following == "{":
            return [self.braced(quote)]
        name = NAME.match(self.text, self.position + 1)
        if name:
            self.position = name.end()
            return [Param(name.group(0), start, self.position, quote)]
        if following and following in SPECIAL_PARAMETERS:
            self.position += 2
            return [Opaque(self.text[start : self.position], start, self.position, quote, "special")]
        self.position += 1
        return [Literal("$", start, quote)]

    def ansi_c_quoted(self) -> list[Part]:
        start = self.position
        self.position += 2
        parts: list[Part] = []
        escapes = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "a": "\a", "r": "\r"}
        while True:
            if self.position >= self.end:
                raise self.error(f"the $' of line {line_of(self.text, start)} is never closed", start)
            char = self.text[self.position]
            if char == "'":
                self.position += 1
                return parts
            if char == "\\" and self.peek(1) in escapes:
                parts.append(Literal(escapes[self.peek(1)], self.position + 1, "$'"))
                self.position += 2
            else:
                parts.append(Literal(char, self.position, "$'"))
                self.position += 1

    def command_substitution(self, inner: int, quote: str, kind: str) -> Opaque:
        start = self.position
        self.position = inner
        commands = self.commands(frozenset({")"}))
        if self.peek() != ")":
            raise self.error(f"the $( of line {line_of(self.text, start)} is never closed", start)
        self.position += 1
        return Opaque(self.text[start : self.position], start, self.position, quote, "command", tuple(commands))

    def braced(self, quote: str) -> Param | Opaque:
        start = self.position
        end = self._braced_end(self.position + 2)
        self.position = end
        inner = self.text[start + 2 : end - 1]
        match = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[([@*])\])?").match(inner)
        if not match:
            return Opaque(
                self.text[start:end], start, end, quote, "special" if inner[:1] in SPECIAL_PARAMETERS else "expansion"
            )
        rest = inner[match.end() :]
        name, index = match.group(1), match.group(2) or ""
        if not rest:
            return Param(name, start, end, quote, index=index)
        operator = re.compile(r":?[-=+]").match(rest)
        if not operator or index:
            return Opaque(self.text[start:end], start, end, quote, "expansion")
        arg_start = start + 2 + match.end() + operator.end()
        return Param(name, start, end, quote, operator.group(0), self._argument(arg_start, end - 1, quote))

    def _argument(self, start: int, end: int, quote: str) -> Word:
        """The word of `${X:-word}`, read like the text around it (quoted or not); blanks kept."""
        saved_position, saved_end = self.position, self.end
        self.position, self.end = start, end
        parts: list[Part] = []
        try:
            while self.position < self.end:
                char = self.text[self.position]
                if char == "\\" and self.position + 1 < self.end:
                    if not quote or self.peek(1) in ("$", "`", '"', "\\"):
                        parts.append(Literal(self.text[self.position + 1], self.position + 1, quote or "\\"))
                    else:
                        parts.append(Literal("\\", self.position, quote))
                        self.position -= 1
                    self.position += 2
                elif char == "'" and not quote:
                    parts.extend(self.single_quoted())
                elif char == '"':
                    parts.extend(self.double_quoted())
                elif char == "$":
                    parts.extend(self.dollar(quote))
                elif char == "`":
                    parts.append(self.backquoted(quote))
                else:
                    parts.append(Literal(char, self.position, quote))
                    self.position += 1
        finally:
            self.position, self.end = saved_position, saved_end
        return Word(merged(parts), start, end)

    def _braced_end(self, index: int) -> int:
        """Just after the `}` closing a `${`, across nested expansions and quotes."""
        depth = 1
        while index < self.end:
            char = self.text[index]
            if char == "\\":
                index += 2
                continue
            if char == "'" and depth:
                close = self.text.find("'", index + 1)
                index = (self.end if close < 0 else close) + 1
                continue
            if self.text.startswith("${", index):
                depth += 1
                index += 2
                continue
            if char == "}":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        raise self.error("a ${ is never closed")

    def _arithmetic_end(self, index: int) -> int:
        """Just after the `))` closing a `((` or `$((`."""
        depth = 2
        while index < self.end:
            char = self.text[index]
            if char == "(":
                depth += 1
            elif char == ")":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        raise self.error("a (( is never closed")


def merged(parts: list[Part]) -> tuple[Part, ...]:
    """The parts with each stretch of literals written one after another, alike quoted, made one."""
    out: list[Part] = []
    pending: list[Literal] = []

    def flush() -> None:
        if pending:
            first = pending[0]
            out.append(
                first if len(pending) == 1 else Literal("".join(p.text for p in pending), first.position, first.quote)
            )
            pending.clear()

    for part in parts:
        if not isinstance(part, Literal):
            flush()
            out.append(part)
            continue
        last = pending[-1] if pending else None
        if last is not None and (last.quote != part.quote or last.position + len(last.text) != part.position):
            flush()
        pending.append(part)
    flush()
    return tuple(out)
