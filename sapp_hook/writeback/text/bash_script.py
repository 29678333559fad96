"""What a launch script passes to the commands it runs: each command's arguments as bash builds them
(assignments, arrays, `${X:-default}`, word splitting, `source`, `bash other.sh` with its environment
prefixes, `eval`, functions), every character traced back to where a file writes it.

The run is a superset of every real run: each branch of an `if` or `case` and each loop body runs
once, in file order; a value set in a branch is marked as one of several (its other definitions kept),
so that a flag written in any branch is found. Values only known at launch (`$(...)`, positional
arguments, variables from the environment) stay unknown and say what they stand for.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from sapp_hook.writeback.text.bash_shell import Assignment, Block, Node, Simple, parse
from sapp_hook.writeback.text.bash_words import (
    Literal,
    Opaque,
    Param,
    ShellError,
    Word,
    line_of,
)
from sapp_hook.writeback.text.provenance import (
    Box,
    Ch,
    Command,
    Definition,
    Field,
    ReadError,
    Reading,
    Ref,
    Site,
    SourceFile,
    Trail,
    Value,
    part_of,
    text_of,
)

IFS = " \t\n"
NOT_BLANK = re.compile(f"[^{IFS}]+")
MAX_FILES = 32
MAX_DEPTH = 16  # sourced files, called scripts, evals and function calls inside each other
_SOURCE = r"\$(?:0|\{0\}|BASH_SOURCE|\{BASH_SOURCE(?:\[0\])?\})"
_CANONICAL = r"(?:realpath(?:-[es])?|readlink-[fem]|readlink--canonicalize(?:-existing|-missing)?)(?:--)?"
_DIRNAME = rf"\$\(dirname(?:--)?(?:{_SOURCE}|\$\({_CANONICAL}{_SOURCE}\))\)"
_QUIET = r"(?:[12&]?>/dev/null|2>&1)*"  # cd's output thrown away
# the script's own folder, as scripts compute it (quotes and blanks taken out first, `...` read as $(...))
SCRIPT_DIR = re.compile(
    rf"^(?:{_DIRNAME}|\$\((?:cd(?:--)?{_DIRNAME}{_QUIET}(?:&&|;)pwd(?:-P)?|realpath{_DIRNAME})\)"
    r"|\$\{(?:BASH_SOURCE(?:\[0\])?|0)%/\*\})$"
)
POSITIONAL = re.compile(r"\$(?:[1-9@*]|\{(?:[1-9]|[@*])\})")
FILE_CONTENT = re.compile(r"""^\$\(\s*(?:cat\s+|<\s*)(["']?)([^\s"'$`;&|<>()]+)\1\s*\)$""")


def read_script(
    path: Path, text: str, *, overrides: dict[Path, str] | None = None, arguments_file: bool = False
) -> Reading:
    """Run the script at `path` (its text given) as described above. `overrides`: other files' texts
    to use instead of what is on disk (a rewrite being checked)."""
    run = _Run(overrides or {})
    run.overrides[path.resolve()] = text
    if arguments_file:
        index = run.load(path, arguments=True)
        box = run.box("arguments", index, 0, len(text), "", False)
        chars = run.file_chars(index, box)
        run.reading.commands.append(Command(tuple(_split([(ch, True) for ch in chars])), box, False, False))
        return run.reading
    index = run.load(path, arguments=False)
    run.block_file(index, _Scope({}, {}, set(), {}), False, False, 0)
    return run.reading


@dataclass
class _Scope:
    variables: dict[str, list[int]]  # name -> its definitions, in order
    environment: dict[str, Value]  # what a calling script passes (prefix assignments, exports)
    exported: set[str]
    functions: dict[str, tuple[Block, int]]
    positional: tuple[Field, ...] | None = None  # $1 $2 ... "$@": None where given at launch

    def copy(self) -> _Scope:
        return _Scope(
            {k: list(v) for k, v in self.variables.items()},
            dict(self.environment),
            set(self.exported),
            self.functions,
            self.positional,
        )


class _Unit:
    """Text being run: a file's (parsed text, offsets into the file) or an eval's (the characters it
    was made of, each kept with its trail; a value known only at launch is one stand-in character)."""

    def __init__(self, file: int, source: SourceFile | None, chars: Field | None = None) -> None:
        self.file = file
        self.source = source
        self.chars = chars
        self.starts: list[int] = []  # where each of an eval's characters begins in its text
        position = 0
        for ch in chars or ():
            self.starts.append(position)
            position += len(ch.text)

    @property
    def evaluated(self) -> bool:
        return self.chars is not None

    def literal(self, part: Literal, box: int) -> list[Ch]:
        """The characters of a literal, each stretch written in one place one Ch."""
        start, end = part.position, part.position + len(part.text)
        if self.chars is None:
            source = self.source
            assert source is not None
            # a CRLF read as LF puts the characters after it one further on in the file
            breaks = (
                []
                if source.crlf is None
                else source.crlf[bisect_right(source.crlf, start) : bisect_right(source.crlf, end - 1)]
            )
            out = []
            for first, stop in zip([start, *breaks], [*breaks, end]):
                offset = source.offset(first)
                site = Site(self.file, offset, offset + stop - first, box, part.quote)
                out.append(Ch(part.text[first - start : stop - start], (site,)))
            return out
        out = []
        index = bisect_right(self.starts, start) - 1
        while index < len(self.chars) and self.starts[index] < end:
            ch, at = self.chars[index], self.starts[index]
            low, high = max(start, at), min(end, at + len(ch.text))
            text = part.text[low - start : high - start]
            out.append(ch if ch.unknown else Ch(text, ch.cut(low - at, high - at).trail))
            index += 1
        return out

    def span_trail(self, start: int, end: int, box: int, quote: str, ref: int = -1) -> Trail:
        if self.chars is None:
            source = self.source
            return (Site(self.file, source.offset(start), source.offset(end - 1) + 1, box, quote, ref),)  # type: ignore[union-attr]
        trails = [ch.trail for ch in self.literal(Literal("\0" * (end - start), start, quote), box) if ch.trail]
        if not trails or any(trail[:-1] != trails[0][:-1] or trail[-1].file != trails[0][-1].file for trail in trails):
            return ()
        first, last = trails[0][-1], trails[-1][-1]
        return (*trails[0][:-1], Site(first.file, first.start, last.end, last.box, last.quote, ref))


class _Run:
    def __init__(self, overrides: dict[Path, str]) -> None:
        self.reading = Reading()
        self.overrides = overrides
        self.loaded: dict[tuple[Path, bool], int] = {}
        self.collecting: list[list[int]] = []  # the references made by each expansion under way

    # -- files ------------------------------------------------------------------------------------

    def load(self, path: Path, *, arguments: bool) -> int:
        key = (path.resolve(), arguments)
        if key in self.loaded:
            return self.loaded[key]
        if len(self.reading.files) >= MAX_FILES:
            raise ReadError(f"{path}: more than {MAX_FILES} files sourced or called")
        text = self.overrides.get(key[0])
        if text is None:
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ReadError(f"{path}: cannot be read as UTF-8 text ({exc})") from None
        source = SourceFile(path, text, None)
        if "\r\n" in text:  # read a CRLF file as bash would read it converted (its line ends kept on writing)
            source.crlf = [match.start() - number for number, match in enumerate(re.finditer("\r\n", text))]
        if not arguments:
            lexed = text.replace("\r\n", "\n") if source.crlf is not None else text
            try:
                source.script = parse(lexed)
            except ShellError as error:
                raise ReadError(
                    f"{path.name} line {line_of(lexed, error.position)}: {error.detail}; sapp-hook "
                    "reads a launch script as bash does and could not read this one"
                ) from None
        self.reading.files.append(source)
        self.loaded[key] = len(self.reading.files) - 1
        return self.loaded[key]

    def file_chars(self, index: int, box: int) -> Field:
        """A file's characters but its carriage returns, each stretch between them one Ch."""
        text = self.reading.files[index].text
        return tuple(
            Ch(match.group(), (Site(index, match.start(), match.end(), box, ""),))
            for match in re.finditer("[^\r]+", text)
        )

    def resolve(self, name: str, current: int) -> Path | None:
        """A file a script names, relative to its folder or a folder above it (scripts are often run
        from their repository's root), or absolute."""
        candidate = Path(name)
        if candidate.is_absolute():
            return candidate if candidate.is_file() or candidate.resolve() in self.overrides else None
        folder = self.reading.files[current].path.resolve().parent
        for base in (folder, *list(folder.parents)[:4], Path.cwd()):
            path = (base / candidate).resolve()
            if path.is_file() or path in self.overrides:
                return path
        return None

    def box(self, kind: str, file: int, start: int, end: int, name: str, conditional: bool) -> int:
        self.reading.boxes.append(Box(kind, file, start, end, name, conditional))
        return len(self.reading.boxes) - 1

    # -- commands ---------------------------------------------------------------------------------

    def block_file(self, index: int, scope: _Scope, conditional: bool, evaluated: bool, depth: int) -> None:
        source = self.reading.files[index]
        self.nodes(source.script.commands, _Unit(index, source), scope, conditional, evaluated, depth)  # type: ignore[union-attr]

    def nodes(
        self, nodes: tuple[Node, ...], unit: _Unit, scope: _Scope, conditional: bool, evaluated: bool, depth: int
    ) -> None:
        for node in nodes:
            self.node(node, unit, scope, conditional, evaluated, depth)

    def node(self, node: Node, unit: _Unit, scope: _Scope, conditional: bool, evaluated: bool, depth: int) -> None:
        if isinstance(node, Simple):
            self.simple(node, unit, scope, conditional, evaluated, depth)
        elif isinstance(node, Block):
            if node.kind == "function":
                scope.functions[node.name] = (node, unit.file)
                if not unit.evaluated:
                    self.reading.functions_unused.append((unit.file, node.start, node.end))
                return
            if node.kind in ("if", "case"):
                self.branches(node, unit, scope, evaluated, depth)
                return
            inner = scope.copy() if node.kind == "subshell" else scope
            for body in node.bodies:
                self.nodes(body, unit, inner, conditional or node.kind == "loop", evaluated, depth)
        else:
            self.node(node.left, unit, scope, conditional, evaluated, depth)
            self.node(node.right, unit, scope, True, evaluated, depth)

    def branches(self, block: Block, unit: _Unit, scope: _Scope, evaluated: bool, depth: int) -> None:
        """An `if`'s conditions run in turn; each branch runs from the variables as they were before it,
        not as a sibling branch left them; afterwards every branch's definitions may hold."""
        if block.kind == "if":
            bodies = block.bodies[1::2] + ((block.bodies[-1],) if len(block.bodies) % 2 else ())
            for number, condition in enumerate(block.bodies[0 : 2 * (len(block.bodies) // 2) : 2]):
                self.nodes(condition, unit, scope, number > 0, evaluated, depth)
        else:
            bodies = block.bodies
        before = {name: list(definitions) for name, definitions in scope.variables.items()}
        added: dict[str, list[int]] = {}
        for body in bodies:
            scope.variables = {name: list(definitions) for name, definitions in before.items()}
            self.nodes(body, unit, scope, True, evaluated, depth)
            for name, definitions in scope.variables.items():
                added.setdefault(name, []).extend(definitions[len(before.get(name, [])) :])
        for name, definitions in added.items():
            before.setdefault(name, []).extend(definitions)
        scope.variables = before

    def simple(
        self, command: Simple, unit: _Unit, scope: _Scope, conditional: bool, evaluated: bool, depth: int
    ) -> None:
        if not command.words:
            for assignment in command.assignments:
                self.assign(assignment, unit, scope, conditional, exported=False)
            return
        self.collecting.append([])
        try:
            box = self.box("command", unit.file, *self._file_span(unit, command.start, command.end), "", conditional)
            prefix = {a.name: self.assignment_value(a, unit, scope, conditional)[0] for a in command.assignments}
            argv: list[Field] = []
            for word in command.words:
                argv.extend(self.expand(word, unit, scope, box, split=True))
            for assignment in command.declared:
                self.assign(assignment, unit, scope, conditional, exported=command.words[0].plain() == "export")
            self.dispatch(argv, prefix, command, unit, scope, conditional, evaluated, depth, box)
        finally:
            self.collecting.pop()

    def dispatch(
        self,
        argv: list[Field],
        prefix: dict[str, Value],
        command: Simple,
        unit: _Unit,
        scope: _Scope,
        conditional: bool,
        evaluated: bool,
        depth: int,
        box: int,
    ) -> None:
        name = text_of(argv[0]) if argv else ""
        if name in ("exec", "nohup", "command", "builtin", "time") and len(argv) > 1:
            self.dispatch(argv[1:], prefix, command, unit, scope, conditional, evaluated, depth, box)
        elif name == "env":
            rest = 1
            while rest < len(argv) and re.match(r"[A-Za-z_]\w*=", text_of(argv[rest]) or ""):
                key, _, _ = (text_of(argv[rest]) or "").partition("=")
                prefix[key] = Value(part_of(argv[rest], len(key) + 1))
                rest += 1
            if rest < len(argv):
                self.dispatch(argv[rest:], prefix, command, unit, scope, conditional, evaluated, depth, box)
        elif name in ("source", ".") and len(argv) > 1:
            self.include(argv[1], unit, scope, conditional, evaluated, depth, child=None)
        elif name in ("bash", "sh") and len(argv) > 1:
            self.child_shell(argv, prefix, unit, scope, conditional, depth)
        elif (shell := _shell_c(argv)) is not None:  # srun/docker/mpirun ... sh -c TEXT: TEXT is read again
            self.child_shell(argv[shell:], prefix, unit, scope, conditional, depth)
        elif name == "eval":
            joined: list[Ch] = []
            for number, part in enumerate(argv[1:]):
                joined.extend(((Ch(" ", ()),) if number else ()) + part)
            self.evaluate(tuple(joined), unit, scope, conditional, depth)
        elif name == "export":
            for part in argv[1:]:
                scope.exported.add(text_of(part) or "")
        elif name == "unset":
            for part in argv[1:]:
                self.define(text_of(part) or "", None, box, scope, conditional)
        elif name in scope.functions and depth < MAX_DEPTH:
            block, file = scope.functions[name]
            source = self.reading.files[file]
            self.reading.functions_unused[:] = [
                f for f in self.reading.functions_unused if f != (file, block.start, block.end)
            ]
            outer, scope.positional = scope.positional, tuple(argv[1:])
            try:
                self.nodes(block.bodies[0], _Unit(file, source), scope, conditional, evaluated, depth + 1)
            finally:
                scope.positional = outer
        else:
            refs = tuple(dict.fromkeys(ref for made in self.collecting for ref in made))
            self.reading.commands.append(Command(tuple(argv), box, conditional, evaluated, refs))

    def include(
        self,
        name_field: Field,
        unit: _Unit,
        scope: _Scope,
        conditional: bool,
        evaluated: bool,
        depth: int,
        child: _Scope | None,
    ) -> None:
        name = text_of(name_field)
        path = self.resolve(name, unit.file) if name else None
        if path is None or depth >= MAX_DEPTH:
            said = name if name is not None else "".join(ch.unknown or ch.text for ch in name_field)
            missing = f"{said} (run from {self.reading.files[unit.file].path.name}): not found"
            if missing not in self.reading.unfollowed:  # sourced from several places: said once
                self.reading.unfollowed.append(missing)
            return
        index = self.load(path, arguments=False)
        self.block_file(index, child or scope, conditional, evaluated, depth + 1)

    def child_shell(
        self, argv: list[Field], prefix: dict[str, Value], unit: _Unit, scope: _Scope, conditional: bool, depth: int
    ) -> None:
        """`bash FILE` or `bash -c TEXT`: a new shell with the exported variables and the prefix."""
        environment = {name: value for name, value in self._current(scope).items() if name in scope.exported}
        environment.update(prefix)
        child = _Scope({}, environment, set(environment), {})
        rest = 1
        while rest < len(argv) and (text_of(argv[rest]) or "").startswith("-"):
            if text_of(argv[rest]) == "-c" and rest + 1 < len(argv):
                self.evaluate(argv[rest + 1], unit, child, conditional, depth)
                return
            rest += 1
        if rest < len(argv):
            child.positional = tuple(argv[rest + 1 :])
            self.include(argv[rest], unit, scope, conditional, False, depth, child=child)

    def evaluate(self, chars: Field, unit: _Unit, scope: _Scope, conditional: bool, depth: int) -> None:
        """Run text again as commands (eval, bash -c); a value known only at launch stays one word."""
        if depth >= MAX_DEPTH:
            return
        text = "".join("\ue000" if ch.unknown else ch.text for ch in chars)  # a stand-in: one literal character
        try:
            script = parse(text)
        except ShellError as error:
            raise ReadError(f"the text an eval runs cannot be read: {error.detail}") from None
        inner = _Unit(unit.file, None, chars)
        self.nodes(script.commands, inner, scope, conditional, True, depth + 1)

    def _current(self, scope: _Scope) -> dict[str, Value]:
        values = dict(scope.environment)
        for name, definitions in scope.variables.items():
            value = self.reading.definitions[definitions[-1]].value
            if value is not None:
                values[name] = value
        return values

    # -- assignments ------------------------------------------------------------------------------

    def assign(self, assignment: Assignment, unit: _Unit, scope: _Scope, conditional: bool, *, exported: bool) -> None:
        self.collecting.append([])
        try:
            value, box = self.assignment_value(assignment, unit, scope, conditional)
        finally:
            refs = tuple(self.collecting.pop())
        self.define(assignment.name, value, box, scope, conditional, refs)
        if exported:
            scope.exported.add(assignment.name)

    def assignment_value(
        self, assignment: Assignment, unit: _Unit, scope: _Scope, conditional: bool
    ) -> tuple[Value, int]:
        span = self._file_span(unit, assignment.start, assignment.end)
        if assignment.items is not None:
            box = self.box("array", unit.file, *span, assignment.name, conditional)
            items: list[Field] = []
            for word in assignment.items:
                items.extend(self.expand(word, unit, scope, box, split=True))
            if assignment.append:
                before = self.lookup(assignment.name, scope)[0]
                items = list(before.elements() if before else ()) + items
            return Value(items=tuple(items)), box
        box = self.box("value", unit.file, *span, assignment.name, conditional)
        chars = self.expand(assignment.value, unit, scope, box, split=False)[0] if assignment.value else ()
        if assignment.append:
            before = self.lookup(assignment.name, scope)[0]
            if before is not None and before.items is not None:
                return Value(items=(*before.items, chars)), box
            chars = (before.scalar() if before else ()) + chars
        return Value(chars=chars), box

    def define(
        self, name: str, value: Value | None, box: int, scope: _Scope, conditional: bool, refs: tuple[int, ...] = ()
    ) -> None:
        self.reading.definitions.append(Definition(name, value, box, conditional, refs))
        scope.variables.setdefault(name, []).append(len(self.reading.definitions) - 1)

    def lookup(self, name: str, scope: _Scope) -> tuple[Value | None, str, int, tuple[int, ...]]:
        """The value a reference sees, its state, the definition used and the others that may hold."""
        definitions = scope.variables.get(name, [])
        if not definitions:
            if name in scope.environment:
                return scope.environment[name], "set", -1, ()
            return None, "environment", -1, ()
        reaching = []
        for index in reversed(definitions):
            reaching.append(index)
            if not self.reading.definitions[index].conditional:
                break
        used = reaching[0]
        everywhere = not self.reading.definitions[reaching[-1]].conditional
        state = "set" if len(reaching) == 1 and everywhere else "ambiguous"
        value = self.reading.definitions[used].value
        if value is None and everywhere and len(reaching) == 1:
            return None, "unset", used, ()
        return value, state, used, tuple(reaching[1:])

    # -- words ------------------------------------------------------------------------------------

    def expand(self, word: Word, unit: _Unit, scope: _Scope, box: int, *, split: bool) -> list[Field]:
        """The fields a word gives: one for an assignment's value (`split` False), else as many as
        word splitting makes (none for an unquoted empty expansion)."""
        pieces: list[tuple[Ch, bool] | None] = []  # None: a break between "${A[@]}" elements
        quoted = False
        for part in word.parts:
            if isinstance(part, Literal):
                pieces.extend((ch, False) for ch in unit.literal(part, box))
                quoted |= bool(part.quote)
            elif isinstance(part, Param):
                quoted |= bool(part.quote)
                pieces.extend(self.parameter(part, unit, scope, box))
            elif part.kind == "special" and scope.positional is not None and POSITIONAL.fullmatch(part.text):
                quoted |= bool(part.quote)
                pieces.extend(self.positional(part, unit, scope, box))
            else:
                quoted |= bool(part.quote)
                pieces.extend((ch, not part.quote) for ch in self.opaque(part, unit, scope, box))
        if not split:
            return [tuple(Ch(" ", ()) if piece is None else piece[0] for piece in pieces)]
        return _split(pieces, keep_empty=quoted)

    def parameter(self, part: Param, unit: _Unit, scope: _Scope, box: int) -> list[tuple[Ch, bool] | None]:
        value, state, used, alternatives = self.lookup(part.name, scope)
        if part.op and part.arg is not None:
            empty = value is None or (part.op.startswith(":") and not any(value.scalar()))
            if part.op.endswith(("-", "=")) and (state == "environment" or empty):
                inner = self.expand(part.arg, unit, scope, box, split=False)[0]
                value = Value(chars=inner)
                if part.op.endswith("="):
                    self.define(part.name, value, box, scope, False)
            elif part.op.endswith("+"):
                value = (
                    None
                    if value is None or empty
                    else Value(chars=self.expand(part.arg, unit, scope, box, split=False)[0])
                )
        self.reading.refs.append(Ref(part.name, state, used, alternatives))
        for made in self.collecting:
            made.append(len(self.reading.refs) - 1)
        trail = unit.span_trail(part.start, part.end, box, part.quote, len(self.reading.refs) - 1)
        splits = not part.quote
        if value is None:
            return [] if state == "unset" else [(Ch("\0", trail, f"${part.name}"), splits)]
        if part.index == "@" and part.quote:
            pieces: list[tuple[Ch, bool] | None] = []
            for number, item in enumerate(value.elements()):
                if number:
                    pieces.append(None)
                pieces.extend((Ch(ch.text, trail + ch.trail, ch.unknown), False) for ch in item)
            return pieces
        chars: list[Ch] = []
        for number, item in enumerate(value.elements() if part.index else (value.scalar(),)):
            if number:
                chars.append(Ch(" ", ()))
            chars.extend(Ch(ch.text, trail + ch.trail, ch.unknown) for ch in item)
        return [(ch, splits) for ch in chars]

    def positional(self, part: Opaque, unit: _Unit, scope: _Scope, box: int) -> list[tuple[Ch, bool] | None]:
        """`$1`, `$@`, `"$@"`, `$*` where the caller's arguments are known (a function, `bash FILE ...`)."""
        given = scope.positional or ()
        name = part.text.strip("${}")
        trail = unit.span_trail(part.start, part.end, box, part.quote)
        if name.isdigit():
            number = int(name)
            chosen = (given[number - 1],) if 0 < number <= len(given) else ()
        else:
            chosen = given
        pieces: list[tuple[Ch, bool] | None] = []
        for count, item in enumerate(chosen):
            if count:
                pieces.append(None if name == "@" and part.quote else (Ch(" ", ()), not part.quote))
            pieces.extend((Ch(ch.text, trail + ch.trail, ch.unknown), not part.quote) for ch in item)
        return pieces

    def opaque(self, part: Opaque, unit: _Unit, scope: _Scope, box: int) -> list[Ch]:
        trail = unit.span_trail(part.start, part.end, box, part.quote)
        text = part.text
        if SCRIPT_DIR.match(re.sub(r"`([^`]*)`", r"$(\1)", re.sub(r"[\s\"']", "", text))):
            folder = str(self.reading.files[unit.file].path.resolve().parent)
            return [Ch(folder, ())]
        content = FILE_CONTENT.match(text)
        if content:
            path = self.resolve(content.group(2), unit.file)
            if path is not None:
                index = self.load(path, arguments=True)
                arguments_box = self.box("arguments", index, 0, len(self.reading.files[index].text), "", False)
                return [Ch(ch.text, trail + ch.trail) for ch in self.file_chars(index, arguments_box)]
        return [Ch("\0", trail, text)]

    def _file_span(self, unit: _Unit, start: int, end: int) -> tuple[int, int]:
        if not unit.evaluated:
            return unit.source.offset(start), unit.source.offset(max(start, end - 1)) + 1  # type: ignore[union-attr]
        return start, end  # an eval's text: the span is of its own text


def _shell_c(argv: list[Field]) -> int | None:
    """Where a launcher's arguments end in a shell running a string (`srun ... sh -c TEXT`, `docker run
    IMAGE /bin/bash -c TEXT`): the index of that shell's word; None where they do not."""
    for index in range(1, len(argv) - 2):
        if (text_of(argv[index]) or "").rsplit("/", 1)[-1] in ("bash", "sh") and text_of(argv[index + 1]) == "-c":
            return index
    return None


def _split(pieces: list[tuple[Ch, bool] | None], keep_empty: bool = False) -> list[Field]:
    """Word splitting: split characters that came from unquoted expansions at blanks."""
    fields: list[Field] = []
    current: list[Ch] = []
    started = keep_empty
    for piece in pieces:
        if piece is None:
            fields.append(tuple(current))
            current, started = [], True
            continue
        ch, splits = piece
        if not splits or ch.unknown:
            current.append(ch)
            started = True
            continue
        position = 0
        for match in NOT_BLANK.finditer(ch.text):
            if match.start() > position and (current or started):  # blanks end the field
                fields.append(tuple(current))
                current, started = [], False
            current.append(ch.cut(match.start(), match.end()))
            started, position = True, match.end()
        if position < len(ch.text) and (current or started):
            fields.append(tuple(current))
            current, started = [], False
    if current or started:
        fields.append(tuple(current))
    return fields
