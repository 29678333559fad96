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
    Literal,
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
        while self.position < self.end:
            char = self.text[self.position]
            if char in BLANKS:
                self.position += 1
            elif self.startswith("\\\n"):
                self.position += 2
            elif char == "#":
                end = self.text.find("\n", self.position)
                end = self.end if end < 0 else end
                self.comments.append((self.position, end))
                self.position = end
            else:
                return

    def newline(self) -> None:
        """Consume a newline; here-document bodies begin after it."""
        self.position += 1
        for delimiter, strip_tabs in self.pending:
            start = self.position
            while self.position < self.end:
                end = self.text.find("\n", self.position)
                end = self.end if end < 0 else end
                line = self.text[self.position : end]
                self.position = min(end + 1, self.end)
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    break
            else:
                raise self.error(f"the here-document ending in {delimiter!r} never ends", start)
            self.heredocs.append((start, self.position))
        self.pending = []

    def separators(self) -> None:
        """Skip what separates commands: blanks, comments, newlines, `;` and `&`."""
        while True:
            self.blanks()
            char = self.peek()
            if char == "\n":
                self.newline()
            elif (char == ";" and not self.startswith(";;")) or (char == "&" and not self.startswith("&&")):
                self.position += 1
            else:
                return

    def next_word_text(self) -> str:
        """The plain text of the word ahead (without moving), for reserved words."""
        match = re.compile(r"[^\s;&|<>()]+").match(self.text, self.position)
        return match.group(0) if match else ""

    # -- commands ---------------------------------------------------------------------------------

    def program(self) -> list[Node]:
        commands = self.commands(frozenset())
        if self.position < self.end:
            raise self.error(f"unexpected {self.text[self.position]!r}")
        return commands

    def commands(self, stops: frozenset[str]) -> list[Node]:
        """Commands up to a reserved word in `stops` (or `)`, `;;` where listed), not consumed."""
        found: list[Node] = []
        while True:
            self.separators()
            if self.position >= self.end:
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
                self.position += 2
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
            self.position += 1
        if self.next_word_text() == "time":
            self.position += 4
        node = self.command()
        while True:
            self.blanks()
            if self.peek() == "|" and not self.startswith("||"):
                self.position += 2 if self.startswith("|&") else 1
                self.separators()
                right = self.command()
                node = Block("group", ((node, right),), span(node)[0], span(right)[1])  # both sides run
            else:
                return node

    def command(self) -> Node:
        self.blanks()
        start = self.position
        keyword = self.next_word_text()
        if keyword == "if":
            return self.if_block(start)
        if keyword in ("while", "until"):
            self.position += len(keyword)
            condition = self.commands(frozenset({"do"}))
            body = self.do_done()
            return self.after_compound(Block("loop", (tuple(condition), tuple(body)), start, self.position))
        if keyword in ("for", "select"):
            return self.for_block(start, keyword)
        if keyword == "case":
            return self.case_block(start)
        if keyword == "{":
            self.position += 1
            body = self.commands(frozenset({"}"}))
            self.expect_word("}", start)
            return self.after_compound(Block("group", (tuple(body),), start, self.position))
        if self.startswith("(("):
            end = self._arithmetic_end(self.position + 2)
            self.position = end
            return self.after_compound(Block("group", ((),), start, end))
        if self.peek() == "(":
            self.position += 1
            body = self.commands(frozenset({")"}))
            self.expect_char(")", start)
            return self.after_compound(Block("subshell", (tuple(body),), start, self.position))
        if keyword == "[[":
            end = self._double_bracket_end(self.position + 2)
            self.position = end
            return Simple((), (), (), start, end)
        if keyword == "function":
            self.position += len(keyword)
            self.blanks()
            name = self.next_word_text().removesuffix("()")
            self.position += len(self.next_word_text())
            self.blanks()
            if self.startswith("()"):
                self.position += 2
            return self.function_body(name, start)
        function = re.compile(r"([A-Za-z_][\w.:-]*)[ \t]*\([ \t]*\)").match(self.text, self.position)
        if function and keyword not in RESERVED:
            self.position = function.end()
            return self.function_body(function.group(1), start)
        if keyword in RESERVED - {"!", "time"}:
            raise self.error(f"unexpected {keyword!r}")
        return self.simple()

    def function_body(self, name: str, start: int) -> Block:
        self.separators()
        body = self.command()
        return Block("function", ((body,),), start, self.position, name=name)

    def after_compound(self, block: Block) -> Block:
        """Redirections after a compound command (`done < file`, `} > log`)."""
        while True:
            self.blanks()
            if not self.redirection():
                return block

    def expect_word(self, word: str, start: int) -> None:
        self.separators()
        if self.next_word_text() != word:
            raise self.error(f"expected {word!r} to close what line {line_of(self.text, start)} opens")
        self.position += len(word)

    def expect_char(self, char: str, start: int) -> None:
        self.separators()
        if self.peek() != char:
            raise self.error(f"expected {char!r} to close what line {line_of(self.text, start)} opens")
        self.position += 1

    def do_done(self) -> list[Node]:
        self.expect_word("do", self.position)
        body = self.commands(frozenset({"done"}))
        self.expect_word("done", self.position)
        return body

    def if_block(self, start: int) -> Block:
        bodies: list[tuple[Node, ...]] = []
        self.position += 2
        while True:
            bodies.append(tuple(self.commands(frozenset({"then"}))))
            self.expect_word("then", start)
            bodies.append(tuple(self.commands(frozenset({"elif", "else", "fi"}))))
            keyword = self.next_word_text()
            self.position += len(keyword)
            if keyword == "elif":
                continue
            if keyword == "else":
                bodies.append(tuple(self.commands(frozenset({"fi"}))))
                self.expect_word("fi", start)
            elif keyword != "fi":
                raise self.error(f"expected 'fi' to close the 'if' of line {line_of(self.text, start)}")
            return self.after_compound(Block("if", tuple(bodies), start, self.position))

    def for_block(self, start: int, keyword: str) -> Block:
        self.position += len(keyword)
        self.blanks()
        if self.startswith("(("):
            self.position = self._arithmetic_end(self.position + 2)
            words: list[Word] = []
        else:
            name = NAME.match(self.text, self.position)
            if not name:
                raise self.error(f"expected a name after {keyword!r}")
            self.position = name.end()
            self.separators_without_semicolon()
            words = []
            if self.next_word_text() == "in":
                self.position += 2
                while True:
                    self.blanks()
                    if self.peek() in ("", "\n", ";"):
                        break
                    words.append(self.word())
        self.separators()
        body = self.do_done()
        return self.after_compound(Block("loop", ((), tuple(body)), start, self.position, words=tuple(words)))

    def separators_without_semicolon(self) -> None:
        while True:
            self.blanks()
            if self.peek() != "\n":
                return
            self.newline()

    def case_block(self, start: int) -> Block:
        self.position += 4
        self.blanks()
        subject = self.word()
        self.separators_without_semicolon()
        if self.next_word_text() != "in":
            raise self.error(f"expected 'in' after the 'case' of line {line_of(self.text, start)}")
        self.position += 2
        bodies: list[tuple[Node, ...]] = []
        while True:
            self.separators_without_semicolon()
            if self.next_word_text() == "esac":
                self.position += 4
                return self.after_compound(Block("case", tuple(bodies), start, self.position, words=(subject,)))
            if self.position >= self.end:
                raise self.error(f"expected 'esac' to close the 'case' of line {line_of(self.text, start)}")
            if self.peek() == "(":
                self.position += 1
            while True:  # patterns: words separated by |, up to )
                self.blanks()
                self.word()
                self.blanks()
                if self.peek() == "|":
                    self.position += 1
                    continue
                break
            self.expect_char(")", start)
            bodies.append(tuple(self.commands(frozenset({";;", "esac"}))))
            self.blanks()
            for ending in (";;&", ";;", ";&"):
                if self.startswith(ending):
                    self.position += len(ending)
                    break

    def simple(self) -> Simple:
        start = self.position
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
            if (not words or declaring) and ASSIGNMENT.match(self.text, self.position):
                (declared if declaring else assignments).append(self.assignment())
                continue
            words.append(self.word())
        if not assignments and not words and not declared and self.position == start:
            raise self.error(f"unexpected {self.peek()!r}" if self.peek() else "unexpected end of the script")
        return Simple(tuple(assignments), tuple(words), tuple(declared), start, self.position)

    def redirection(self) -> bool:
        """A redirection and its target; a here-document's body is read after the line."""
        match = re.compile(r"(\d+|&)?(<<<|<<-|<<|<>|>>|>&|<&|>\||&>>|&>|<|>)").match(self.text, self.position)
        if not match or (match.group(1) == "&" and match.group(2) not in (">", ">>")):
            return False
        operator = match.group(2)
        if operator in ("<", ">") and self.text.startswith("(", match.end()):
            return False  # a process substitution: a word
        self.position = match.end()
        self.blanks()
        target = self.word()
        if operator in ("<<", "<<-"):
            delimiter = "".join(part.text for part in target.parts if isinstance(part, Literal))
            self.pending.append((delimiter, operator == "<<-"))
        return True

    def assignment(self) -> Assignment:
        start = self.position
        match = ASSIGNMENT.match(self.text, self.position)
        assert match
        text = match.group(0)
        name = text.removesuffix("=").removesuffix("+")  # A[2]= sets an element: a name of its own here
        self.position = match.end()
        append = text.endswith("+=")
        if self.peek() == "(" and not match.group(1):
            self.position += 1
            open_end = self.position
            items: list[Word] = []
            while True:
                self.separators_without_semicolon()
                if self.peek() == ")":
                    self.position += 1
                    break
                if self.position >= self.end:
                    raise self.error(f"the array {name}=( of line {line_of(self.text, start)} is never closed", start)
                if self.peek() in ";&|<>(":
                    raise self.error(
                        f"unexpected {self.peek()!r} in the array {name}=( of line {line_of(self.text, start)}"
                    )
                items.append(self.word())
            return Assignment(name, append, None, tuple(items), start, self.position, open_end)
        value = None if self.peek() in META or self.peek() == "" else self.word()
        return Assignment(name, append, value, None, start, self.position)

    def _double_bracket_end(self, index: int) -> int:
        """Just after the `]]` closing a `[[` (its words may hold && || < > ( ))."""
        while index < self.end:
            char = self.text[index]
            if char == "\\":
                index += 2
                continue
            if char in "'\"":
                self.position = index
                (self.single_quoted if char == "'" else self.double_quoted)()
                index = self.position
                continue
            if self.text.startswith("]]", index) and (index + 2 >= self.end or self.text[index + 2] in META):
                return index + 2
            if char == "\n":
                raise self.error("a [[ is not closed on its line")
            index += 1
        raise self.error("a [[ is never closed")
