"""Reading a bash launch script the way bash reads it: words with their quotes, escapes and expansions,
comments, here-documents, assignments (bash arrays too), simple commands and the compound commands
around them (`if`, `case`, loops, functions, groups, subshells, `&&` / `||` lists).

Not a full bash: what it cannot follow (an unterminated quote, a construct it does not know) is a
`ShellError` naming the line, never a guess. The syntax tree keeps every position, so that a writer
can change a script where a word stands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sapp_hook.writeback.text.bash_words import (
    META,
    Char,
    Word,
    WordReader,
    line_of,
)

BLANKS = " \t"
RESERVED = frozenset(
    {
        "if",
        "then",
        "elif",
        "else",
        "fi",
        "for",
        "select",
        "while",
        "until",
        "do",
        "done",
        "case",
        "esac",
        "function",
        "{",
        "}",
        "!",
        "[[",
        "in",
        "time",
    }
)
DECLARATIONS = frozenset({"export", "declare", "typeset", "local", "readonly"})
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\])?\+?=")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Assignment:
    name: str
    append: bool
    value: Word | None  # a scalar's value (None: empty)
    items: tuple[Word, ...] | None  # an array's elements, `NAME=( ... )`
    start: int
    end: int
    open_end: int = -1  # for an array: just after its `(`


@dataclass(frozen=True)
class Simple:
    """A simple command: assignments before it (or alone), its words, and assignments that a
    declaration builtin (`export`, `declare`, `local`...) makes."""

    assignments: tuple[Assignment, ...]
    words: tuple[Word, ...]
    declared: tuple[Assignment, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Block:
    """A compound command. `kind`: if, loop, case, group, subshell, function. `bodies` in order; for
    `if` the first body (the first condition) always runs and the others may not; a loop's and a
    case's bodies may not run; a function's body runs where the function is called."""

    kind: str
    bodies: tuple[tuple[Node, ...], ...]
    start: int
    end: int
    name: str = ""
    words: tuple[Word, ...] = ()  # a `for` loop's list, a `case` word


@dataclass(frozen=True)
class AndOr:
    """`left && right` or `left || right`: the right side may not run."""

    left: Node
    right: Node


Node = Simple | Block | AndOr


def span(node: Node) -> tuple[int, int]:
    if isinstance(node, AndOr):
        return span(node.left)[0], span(node.right)[1]
    return node.start, node.end


@dataclass
class Script:
    """A parsed script: its commands, and where its comments and here-document bodies are."""

    text: str
    commands: tuple[Node, ...]
    comments: list[tuple[int, int]] = field(default_factory=list)
    heredocs: list[tuple[int, int]] = field(default_factory=list)
    words: list[tuple[int, int]] = field(default_factory=list)  # every word's span, for edits


def parse(text: str) -> Script:
    """Parse a bash script; ShellError where it cannot."""
    parser = _Parser(text)
    commands = parser.program()
    return Script(text, tuple(commands), parser.comments, parser.heredocs, sorted(parser.word_spans))


class _Parser(WordReader):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.comments: list[tuple[int, int]] = []
        self.heredocs: list[tuple[int, int]] = []
        self.pending: list[tuple[str, bool]] = []  # here-documents whose bodies start on the next line

    # -- characters -------------------------------------------------------------------------------

    def blanks(self) -> None:
        """Skip blanks, line continuations and a comment (to the end of its line)."""
        while self.i < self.n:
            char = self.s[self.i]
            if char in BLANKS:
                self.i += 1
            elif self.startswith("\\\n"):
                self.i += 2
            elif char == "#":
                end = self.s.find("\n", self.i)
                end = self.n if end < 0 else end
                self.comments.append((self.i, end))
                self.i = end
            else:
                return

    def newline(self) -> None:
        """Consume a newline; here-document bodies begin after it."""
        self.i += 1
        for delimiter, strip_tabs in self.pending:
            start = self.i
            while self.i < self.n:
                end = self.s.find("\n", self.i)
                end = self.n if end < 0 else end
                line = self.s[self.i : end]
                self.i = min(end + 1, self.n)
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    break
            else:
                raise self.error(f"the here-document ending in {delimiter!r} never ends", start)
            self.heredocs.append((start, self.i))
        self.pending = []

    def separators(self) -> None:
        """Skip what separates commands: blanks, comments, newlines, `;` and `&`."""
        while True:
            self.blanks()
            char = self.peek()
            if char == "\n":
                self.newline()
            elif (char == ";" and not self.startswith(";;")) or (char == "&" and not self.startswith("&&")):
                self.i += 1
            else:
                return

    def next_word_text(self) -> str:
        """The plain text of the word ahead (without moving), for reserved words."""
        match = re.compile(r"[^\s;&|<>()]+").match(self.s, self.i)
        return match.group(0) if match else ""

    # -- commands ---------------------------------------------------------------------------------

    def program(self) -> list[Node]:
        commands = self.commands(frozenset())
        if self.i < self.n:
            raise self.error(f"unexpected {self.s[self.i]!r}")
        return commands

    def commands(self, stops: frozenset[str]) -> list[Node]:
        """Commands up to a reserved word in `stops` (or `)`, `;;` where listed), not consumed."""
        found: list[Node] = []
        while True:
            self.separators()
            if self.i >= self.n:
                return found
            if self.peek() == ")" and ")" in stops:
                return found
            if self.startswith(";;"):
                if ";;" in stops:
                    return found
                raise self.error("unexpected ';;'")
            if self.next_word_text() in stops:
                return found
            found.append(self.and_or())

    def and_or(self) -> Node:
        node = self.pipeline()
        while True:
            self.blanks()
            if self.startswith(("&&", "||")):
                self.i += 2
                while True:  # a newline may follow && and ||
                    self.blanks()
                    if self.peek() != "\n":
                        break
                    self.newline()
                node = AndOr(node, self.pipeline())
            else:
                return node

    def pipeline(self) -> Node:
        self.blanks()
        if self.next_word_text() == "!":
            self.i += 1
        if self.next_word_text() == "time":
            self.i += 4
        node = self.command()
        while True:
            self.blanks()
            if self.peek() == "|" and not self.startswith("||"):
                self.i += 2 if self.startswith("|&") else 1
                self.separators()
                right = self.command()
                node = Block("group", ((node, right),), span(node)[0], span(right)[1])  # both sides run
            else:
                return node

    def command(self) -> Node:
        self.blanks()
        start = self.i
        keyword = self.next_word_text()
        if keyword == "if":
            return self.if_block(start)
        if keyword in ("while", "until"):
            self.i += len(keyword)
            condition = self.commands(frozenset({"do"}))
            body = self.do_done()
            return self.after_compound(Block("loop", (tuple(condition), tuple(body)), start, self.i))
        if keyword in ("for", "select"):
            return self.for_block(start, keyword)
        if keyword == "case":
            return self.case_block(start)
        if keyword == "{":
            self.i += 1
            body = self.commands(frozenset({"}"}))
            self.expect_word("}", start)
            return self.after_compound(Block("group", (tuple(body),), start, self.i))
        if self.startswith("(("):
            end = self._arithmetic_end(self.i + 2)
            self.i = end
            return self.after_compound(Block("group", ((),), start, end))
        if self.peek() == "(":
            self.i += 1
            body = self.commands(frozenset({")"}))
            self.expect_char(")", start)
            return self.after_compound(Block("subshell", (tuple(body),), start, self.i))
        if keyword == "[[":
            end = self._double_bracket_end(self.i + 2)
            self.i = end
            return Simple((), (), (), start, end)
        if keyword == "function":
            self.i += len(keyword)
            self.blanks()
            name = self.next_word_text().removesuffix("()")
            self.i += len(self.next_word_text())
            self.blanks()
            if self.startswith("()"):
                self.i += 2
            return self.function_body(name, start)
        function = re.compile(r"([A-Za-z_][\w.:-]*)[ \t]*\([ \t]*\)").match(self.s, self.i)
        if function and keyword not in RESERVED:
            self.i = function.end()
            return self.function_body(function.group(1), start)
        if keyword in RESERVED - {"!", "time"}:
            raise self.error(f"unexpected {keyword!r}")
        return self.simple()

    def function_body(self, name: str, start: int) -> Block:
        self.separators()
        body = self.command()
        return Block("function", ((body,),), start, self.i, name=name)

    def after_compound(self, block: Block) -> Block:
        """Redirections after a compound command (`done < file`, `} > log`)."""
        while True:
            self.blanks()
            if not self.redirection():
                return block

    def expect_word(self, word: str, start: int) -> None:
        self.separators()
        if self.next_word_text() != word:
            raise self.error(f"expected {word!r} to close what line {line_of(self.s, start)} opens")
        self.i += len(word)

    def expect_char(self, char: str, start: int) -> None:
        self.separators()
        if self.peek() != char:
            raise self.error(f"expected {char!r} to close what line {line_of(self.s, start)} opens")
        self.i += 1

    def do_done(self) -> list[Node]:
        self.expect_word("do", self.i)
        body = self.commands(frozenset({"done"}))
        self.expect_word("done", self.i)
        return body

    def if_block(self, start: int) -> Block:
        bodies: list[tuple[Node, ...]] = []
        self.i += 2
        while True:
            bodies.append(tuple(self.commands(frozenset({"then"}))))
            self.expect_word("then", start)
            bodies.append(tuple(self.commands(frozenset({"elif", "else", "fi"}))))
            keyword = self.next_word_text()
            self.i += len(keyword)
            if keyword == "elif":
                continue
            if keyword == "else":
                bodies.append(tuple(self.commands(frozenset({"fi"}))))
                self.expect_word("fi", start)
            elif keyword != "fi":
                raise self.error(f"expected 'fi' to close the 'if' of line {line_of(self.s, start)}")
            return self.after_compound(Block("if", tuple(bodies), start, self.i))

    def for_block(self, start: int, keyword: str) -> Block:
        self.i += len(keyword)
        self.blanks()
        if self.startswith("(("):
            self.i = self._arithmetic_end(self.i + 2)
            words: list[Word] = []
        else:
            name = NAME.match(self.s, self.i)
            if not name:
                raise self.error(f"expected a name after {keyword!r}")
            self.i = name.end()
            self.separators_without_semicolon()
            words = []
            if self.next_word_text() == "in":
                self.i += 2
                while True:
                    self.blanks()
                    if self.peek() in ("", "\n", ";"):
                        break
                    words.append(self.word())
        self.separators()
        body = self.do_done()
        return self.after_compound(Block("loop", ((), tuple(body)), start, self.i, words=tuple(words)))

    def separators_without_semicolon(self) -> None:
        while True:
            self.blanks()
            if self.peek() != "\n":
                return
            self.newline()

    def case_block(self, start: int) -> Block:
        self.i += 4
        self.blanks()
        subject = self.word()
        self.separators_without_semicolon()
        if self.next_word_text() != "in":
            raise self.error(f"expected 'in' after the 'case' of line {line_of(self.s, start)}")
        self.i += 2
        bodies: list[tuple[Node, ...]] = []
        while True:
            self.separators_without_semicolon()
            if self.next_word_text() == "esac":
                self.i += 4
                return self.after_compound(Block("case", tuple(bodies), start, self.i, words=(subject,)))
            if self.i >= self.n:
                raise self.error(f"expected 'esac' to close the 'case' of line {line_of(self.s, start)}")
            if self.peek() == "(":
                self.i += 1
            while True:  # patterns: words separated by |, up to )
                self.blanks()
                self.word()
                self.blanks()
                if self.peek() == "|":
                    self.i += 1
                    continue
                break
            self.expect_char(")", start)
            bodies.append(tuple(self.commands(frozenset({";;", "esac"}))))
            self.blanks()
            for ending in (";;&", ";;", ";&"):
                if self.startswith(ending):
                    self.i += len(ending)
                    break

    def simple(self) -> Simple:
        start = self.i
        assignments: list[Assignment] = []
        words: list[Word] = []
        declared: list[Assignment] = []
        while True:
            self.blanks()
            char = self.peek()
            if char in ("", "\n", ";", "&", "|", ")"):
                break
            if self.redirection():
                continue
            if char == "(":
                raise self.error("unexpected '('")
            declaring = bool(words) and words[0].plain() in DECLARATIONS
            if (not words or declaring) and ASSIGNMENT.match(self.s, self.i):
                (declared if declaring else assignments).append(self.assignment())
                continue
            words.append(self.word())
        if not assignments and not words and not declared and self.i == start:
            raise self.error(f"unexpected {self.peek()!r}" if self.peek() else "unexpected end of the script")
        return Simple(tuple(assignments), tuple(words), tuple(declared), start, self.i)

    def redirection(self) -> bool:
        """A redirection and its target; a here-document's body is read after the line."""
        match = re.compile(r"(\d+|&)?(<<<|<<-|<<|<>|>>|>&|<&|>\||&>>|&>|<|>)").match(self.s, self.i)
        if not match or (match.group(1) == "&" and match.group(2) not in (">", ">>")):
            return False
        operator = match.group(2)
        if operator in ("<", ">") and self.s.startswith("(", match.end()):
            return False  # a process substitution: a word
        self.i = match.end()
        self.blanks()
        target = self.word()
        if operator in ("<<", "<<-"):
            delimiter = "".join(part.char for part in target.parts if isinstance(part, Char))
            self.pending.append((delimiter, operator == "<<-"))
        return True

    def assignment(self) -> Assignment:
        start = self.i
        match = ASSIGNMENT.match(self.s, self.i)
        assert match
        text = match.group(0)
        name = text.removesuffix("=").removesuffix("+")  # A[2]= sets an element: a name of its own here
        self.i = match.end()
        append = text.endswith("+=")
        if self.peek() == "(" and not match.group(1):
            self.i += 1
            open_end = self.i
            items: list[Word] = []
            while True:
                self.separators_without_semicolon()
                if self.peek() == ")":
                    self.i += 1
                    break
                if self.i >= self.n:
                    raise self.error(f"the array {name}=( of line {line_of(self.s, start)} is never closed", start)
                if self.peek() in ";&|<>(":
                    raise self.error(
                        f"unexpected {self.peek()!r} in the array {name}=( of line {line_of(self.s, start)}"
                    )
                items.append(self.word())
            return Assignment(name, append, None, tuple(items), start, self.i, open_end)
        value = None if self.peek() in META or self.peek() == "" else self.word()
        return Assignment(name, append, value, None, start, self.i)

    def _double_bracket_end(self, index: int) -> int:
        """Just after the `]]` closing a `[[` (its words may hold && || < > ( ))."""
        while index < self.n:
            char = self.s[index]
            if char == "\\":
                index += 2
                continue
            if char in "'\"":
                self.i = index
                (self.single_quoted if char == "'" else self.double_quoted)()
                index = self.i
                continue
            if self.s.startswith("]]", index) and (index + 2 >= self.n or self.s[index + 2] in META):
                return index + 2
            if char == "\n":
                raise self.error("a [[ is not closed on its line")
            index += 1
        raise self.error("a [[ is never closed")
