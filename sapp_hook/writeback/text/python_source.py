"""Minimal edits of Python source at the positions `ast` gives: a keyword's value replaced, keywords
added to or removed from a call, statements or an import added. Everything outside the edited spans,
comments and formatting included, stays byte for byte; added lines take the file's line endings and
the indentation around them."""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

LINE_LIMIT = 100  # a call rewritten on one line stays under this, else it gets one argument per line
Edit = tuple[int, int, str]  # replace text[start:end] with the string


class Code(str):
    """Source text to write as it is (an expression), not a value to render."""


@dataclass(frozen=True)
class Text:
    """A source text, its line starts and its line ending."""

    text: str

    @property
    def newline(self) -> str:
        return "\r\n" if "\r\n" in self.text else "\n"

    @cached_property
    def starts(self) -> list[int]:
        return [0, *(match.end() for match in re.finditer(r"\r\n|\r|\n", self.text))]

    def offset(self, line: int, column: int) -> int:
        """The text offset of ast's (1-based line, UTF-8 byte column)."""
        starts = self.starts
        start = starts[line - 1]
        end = starts[line] if line < len(starts) else len(self.text)
        return start + len(self.text[start:end].encode("utf-8")[:column].decode("utf-8", errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def source(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_start(self, line: int) -> int:
        return self.starts[line - 1]

    def line_end(self, line: int) -> int:
        """The offset just past line `line`'s ending (the next line's start)."""
        starts = self.starts
        return starts[line] if line < len(starts) else len(self.text)

    def indent(self, line: int) -> str:
        start = self.line_start(line)
        return re.match(r"[ \t]*", self.text[start:]).group()

    def starts_line(self, node: ast.AST) -> bool:
        start = self.offset(node.lineno, node.col_offset)
        return not self.text[self.line_start(node.lineno) : start].strip()


def render(value: object, indent: str, unit: str = "    ") -> str:
    """A value as Python source; a list of lists one inner list per line, the closing bracket at `indent`."""
    if isinstance(value, Code):
        return str(value)
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # double quotes, as black writes them
    if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        inner = "".join(f"{indent}{unit}{render(item, indent + unit)},\n" for item in value)
        return f"[\n{inner}{indent}]"
    if isinstance(value, list):
        return "[" + ", ".join(render(item, indent) for item in value) + "]"
    raise TypeError(f"cannot render {value!r}")


def with_newlines(source: str, text: Text) -> str:
    """`source` with the text's line ending; a part already converted (an edit inside an edit) stays so."""
    return source.replace("\r\n", "\n").replace("\n", text.newline) if text.newline != "\n" else source


def has_comment(text: Text, node: ast.AST) -> bool:
    try:
        tokens = tokenize.generate_tokens(io.StringIO(text.source(node)).readline)
        return any(token.type == tokenize.COMMENT for token in tokens)
    except (tokenize.TokenError, SyntaxError):
        return True


def arguments(call: ast.Call) -> list[ast.AST]:
    return sorted([*call.args, *call.keywords], key=lambda node: (node.lineno, node.col_offset))


def keyword_edits(text: Text, call: ast.Call, values: dict[str, object], remove: set[str]) -> list[Edit]:
    """Set keywords of `call` to `values` (replacing a keyword's value, or adding it) and remove those
    in `remove`."""
    present = {kw.arg: kw for kw in call.keywords if kw.arg}
    added = {name: value for name, value in values.items() if name not in present}
    edits: list[Edit] = []
    for name, value in values.items():
        if name in present:
            edits += value_edit(text, present[name].value, value)
    kept = [arg for arg in arguments(call) if not (isinstance(arg, ast.keyword) and arg.arg in remove)]
    dropped = [present[name] for name in remove if name in present]
    if not added and not dropped:
        return edits
    multiline = kept and call.end_lineno > kept[-1].end_lineno and all(text.starts_line(arg) for arg in kept)
    if multiline or has_comment(text, call):
        edits += [_remove(text, kw) for kw in dropped]
        if added:
            edits.append(_append(text, call, kept, added))
        return edits
    return [_rebuild(text, call, kept, values, added)]


def value_edit(text: Text, node: ast.AST, value: object) -> list[Edit]:
    """The expression `node` replaced by `value` (nothing where it already says that), laid out from the
    indentation of its line."""
    if isinstance(value, Code):
        same = ast.dump(node) == ast.dump(ast.parse(str(value), mode="eval").body)
    else:
        try:
            said = ast.literal_eval(node)
            same = said == value and type(said) is type(value)
        except (ValueError, SyntaxError, TypeError):
            same = False
    if same:
        return []
    start, end = text.span(node)
    return [(start, end, with_newlines(render(value, text.indent(node.lineno)), text))]


def _append(text: Text, call: ast.Call, kept: list[ast.AST], added: dict[str, object]) -> Edit:
    """New keywords on lines of their own after the last kept argument (a call laid out one argument
    per line), or after it on its line."""
    if not kept:
        base = call_indent(text, call)
        lines = "".join(f"{base}    {name}={render(value, base + '    ')},\n" for name, value in added.items())
        at = _open_paren(text, call) + 1
        return at, at, with_newlines("\n" + lines + base, text)
    last = kept[-1]
    end = text.offset(last.end_lineno, last.end_col_offset)
    comma = "" if re.match(r"\s*,", text.text[end:]) else ","
    if call.end_lineno > last.end_lineno and text.starts_line(last):
        indent = text.indent(last.lineno)
        lines = "".join(f"{indent}{name}={render(value, indent)},\n" for name, value in added.items())
        at = text.line_end(last.end_lineno)
        if comma:  # the comma goes right after the last argument; both edits in one span
            return end, at, comma + text.text[end:at] + with_newlines(lines, text)
        return at, at, with_newlines(lines, text)
    indent = text.indent(last.lineno)
    said = ", ".join(f"{name}={render(value, indent)}" for name, value in added.items())
    return end, end, with_newlines(f"{comma} {said}", text)


def _rebuild(
    text: Text, call: ast.Call, kept: list[ast.AST], values: dict[str, object], added: dict[str, object]
) -> Edit:
    """A call without comments inside, its arguments written again (the set ones with their new
    values): on one line where they fit, else one per line."""
    base = call_indent(text, call)

    def items(indent: str) -> list[str]:
        said = [
            f"{arg.arg}={render(values[arg.arg], indent)}"
            if isinstance(arg, ast.keyword) and arg.arg in values
            else text.source(arg)
            for arg in kept
        ]
        return [*said, *(f"{name}={render(value, indent)}" for name, value in added.items())]

    opening = _open_paren(text, call)
    column = opening - text.line_start(call.lineno)
    end = text.offset(call.end_lineno, call.end_col_offset) - 1
    joined = ", ".join(items(base))
    if "\n" not in joined and column + len(joined) + 2 <= LINE_LIMIT:
        return opening + 1, end, joined
    unit = base + "    "
    return opening + 1, end, with_newlines("\n" + "".join(f"{unit}{item},\n" for item in items(unit)) + base, text)


def call_indent(text: Text, call: ast.Call) -> str:
    """The indentation a call's closing bracket gets on a line of its own: its line's, one step more for
    every bracket still open on that line before the call."""
    start = text.offset(call.lineno, call.col_offset)
    prefix = re.sub(r"\"[^\"]*\"|'[^']*'", "", text.text[text.line_start(call.lineno) : start])
    depth = sum(prefix.count(c) for c in "([{") - sum(prefix.count(c) for c in ")]}")
    return text.indent(call.lineno) + "    " * max(depth, 0)


def _open_paren(text: Text, call: ast.Call) -> int:
    return text.text.index("(", text.offset(call.func.end_lineno, call.func.end_col_offset))


def _remove(text: Text, kw: ast.keyword) -> Edit:
    """A keyword out of a call: its whole lines where it has them to itself, else it and its comma."""
    start, end = text.span(kw)
    rest = re.match(r"[ \t]*,?[ \t]*(#[^\r\n]*)?(\r\n|\r|\n|$)", text.text[end:])
    if text.starts_line(kw) and rest:
        return text.line_start(kw.lineno), end + rest.end(), ""
    after = re.match(r"\s*,[ \t]*", text.text[end:])
    if after:
        return start, end + after.end(), ""
    before = re.search(r",\s*$", text.text[:start])
    return (before.start() if before else start), end, ""


def statement_removal(text: Text, statement: ast.stmt) -> Edit:
    """A statement out: its lines where it has them to itself, else `pass` in its place."""
    start, end = text.span(statement)
    rest = re.match(r"[ \t]*(#[^\r\n]*)?(\r\n|\r|\n|$)", text.text[end:])
    if text.starts_line(statement) and rest:
        return text.line_start(statement.lineno), end + rest.end(), ""
    return start, end, "pass"


def statement_edit(text: Text, before: ast.stmt, statements: list[str]) -> Edit:
    """Statements on lines of their own just before the statement `before`, at its indentation."""
    indent = text.indent(before.lineno)
    at = text.line_start(before.lineno)
    return at, at, with_newlines("".join(f"{indent}{line}\n" for line in statements), text)


def import_edit(text: Text, tree: ast.Module, module: str, names: list[str]) -> Edit | None:
    """`from module import names` for those of `names` the file does not yet bind at module level: added
    to an import from that module, else a line after the last top-level import."""
    bound = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            bound.add(node.name)
    missing = [name for name in dict.fromkeys(names) if name not in bound]
    if not missing:
        return None
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    for node in imports:
        if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0 and node.names[0].name != "*":
            last = node.names[-1]
            end = text.offset(last.end_lineno, last.end_col_offset)
            if node.end_lineno > last.end_lineno and text.starts_line(last):
                comma = "" if re.match(r"\s*,", text.text[end:]) else ","
                at = text.line_end(last.end_lineno)
                lines = "".join(f"{text.indent(last.lineno)}{name},\n" for name in missing)
                return end, at, comma + text.text[end:at] + with_newlines(lines, text)
            return end, end, "".join(f", {name}" for name in missing)
    line = f"from {module} import {', '.join(missing)}\n"
    at = text.line_end(imports[-1].end_lineno) if imports else 0
    return at, at, with_newlines(line, text)


def splice(text: str, edits: list[Edit]) -> str:
    """`text` with every edit made; edits may not overlap (an insertion may touch a span's ends)."""
    ordered = sorted(edits)
    for (_, end, _), (next_start, _, _) in pairwise(ordered):
        if next_start < end:
            raise ValueError("overlapping source edits")
    for start, end, replacement in sorted(edits, key=lambda edit: (edit[0], edit[1]), reverse=True):
        text = text[:start] + replacement + text[end:]
    return text
