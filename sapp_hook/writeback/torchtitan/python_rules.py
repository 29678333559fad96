"""What the TorchTitan Python-config editor can follow, and the check of the source it writes.

The editor changes a function's source without running it, so it edits only what it can read whole: a
config function defined once at module level, returning one `Trainer.Config(...)` (or a config it got
from a plain call and changed), whose config calls name every field they set as a keyword. A `**splat`,
a `*args` or a positional argument in such a call, a config built by a call it cannot follow, and a
function defined inside an `if`, `try`, loop or `with` are refused, naming the construct: an edit there
could pass a field twice (a `TypeError` at launch) or set a field that another definition replaces.
After the edit, the new source is parsed and compiled (not run) and every call is checked for a keyword
given twice or added beside a `**splat` that may hold it.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from basics.errors import InputError

MODULE_CONFIG = "default_config"  # the name a late-2025 `train_configs/*.py` file's config has
# module-level statements whose bodies run only on a condition, or any number of times
_CONDITIONAL = {
    ast.If: "an if/else",
    ast.Try: "a try block",
    ast.For: "a for loop",
    ast.AsyncFor: "a for loop",
    ast.While: "a while loop",
    ast.With: "a with block",
    ast.AsyncWith: "a with block",
    ast.Match: "a match statement",
}
if hasattr(ast, "TryStar"):  # Python 3.11: try/except*
    _CONDITIONAL[ast.TryStar] = "a try block"


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a name or an attribute chain; None for anything else (a call, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def called(call: ast.Call | None) -> str:
    """The last name of what a call calls (`JobConfig` for `config.JobConfig(...)`)."""
    return (dotted(call.func) or "").split(".")[-1] if call is not None else ""


def module_config(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    """A module-level `name = JobConfig(...)` as a function that returns the call, so that the rest of
    the writer reads and edits it as it does a config function (None where the module has none)."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [dotted(target) for target in node.targets] == [name]
            and isinstance(node.value, ast.Call)
            and (dotted(node.value.func) or "").endswith("Config")
        ):
            returned = ast.copy_location(ast.Return(value=node.value), node)
            function = ast.FunctionDef(name=name, args=ast.arguments(), body=[returned], decorator_list=[])
            return ast.copy_location(function, node)
    return None


def config_function(tree: ast.Module, name: str | None, path: Path) -> ast.FunctionDef:
    """The config function `name`, or the file's only one (as TorchTitan's `--config` names it); in a
    file that defines none, its module-level `default_config = JobConfig(...)`, as a function returning
    it. A function defined (or a module config assigned) inside an `if`, `try`, loop or `with` is refused:
    which definition runs is decided at launch."""
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    public = [node.name for node in functions if not node.name.startswith("_")]
    conditional = _conditional_definitions(tree)
    wanted = name or (public[0] if len(public) == 1 else None)
    for candidate in dict.fromkeys(filter(None, (wanted, None if public else MODULE_CONFIG))):
        plain = [node for node in functions if node.name == candidate]
        if candidate in conditional and (not plain or conditional[candidate][0] > plain[-1].lineno):
            _refuse_conditional(path, candidate, conditional[candidate], plain)
    found_module = module_config(tree, name or MODULE_CONFIG)
    if found_module is not None and (name is not None or not public):
        return found_module
    if name is not None:
        found = [node for node in functions if node.name == name]
        if len(found) > 1:  # Python runs the last; the writer edits the first
            raise InputError(
                "--config",
                f"{path} defines {name} {len(found)} times (lines "
                f"{', '.join(str(node.lineno) for node in found)}): expected one",
            )
        if found:
            return found[0]
        raise InputError("--config", f"{path} has no config function {name!r}; it defines {_listed(public)}")
    inside = [
        defined
        for defined, (_, _, function) in conditional.items()
        if function and not defined.startswith("_") and defined not in public
    ]
    if len(public) == 1 and not inside:
        return next(node for node in functions if node.name == public[0])
    if not public and not inside:
        raise InputError(
            "--config",
            f"{path} defines no config function (a def returning Trainer.Config) and no module-level "
            f"{MODULE_CONFIG} = JobConfig(...)",
        )
    if not public and len(inside) == 1:
        _refuse_conditional(path, inside[0], conditional[inside[0]], [])
    every = [*public, *inside]
    raise InputError(
        "--config",
        f"{path} defines {len(every)} config functions ({_listed(every)}): name the one "
        f"the job runs as {path}:FUNCTION (TorchTitan's --config FUNCTION)",
    )


def _conditional_definitions(tree: ast.Module) -> dict[str, tuple[int, str, bool]]:
    """Names a def or an assignment binds inside a module-level if/try/loop/with: name -> (its line,
    the construct, whether a def binds it), the last of each."""
    found: dict[str, tuple[int, str, bool]] = {}
    for statement in tree.body:
        construct = next((said for kind, said in _CONDITIONAL.items() if isinstance(statement, kind)), None)
        if construct is None:
            continue
        for node in _statements_inside(statement):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [target.id for target in targets if isinstance(target, ast.Name)]
            for defined in names:
                found[defined] = (node.lineno, construct, isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return found


def _statements_inside(statement: ast.stmt) -> Iterator[ast.stmt]:
    """Every statement nested in a compound one, not looking into the functions or classes it defines."""
    for child in ast.iter_child_nodes(statement):
        if isinstance(child, ast.stmt):
            yield child
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from _statements_inside(child)
        elif isinstance(child, (ast.ExceptHandler, ast.match_case)):
            yield from _statements_inside(child)


def _refuse_conditional(path: Path, name: str, where: tuple[int, str, bool], plain: list[ast.FunctionDef]) -> None:
    line, construct, _ = where
    also = f" (and at module level, line {plain[0].lineno}, which it replaces when that code runs)" if plain else ""
    raise InputError(
        "--config",
        f"{path} defines {name} conditionally, inside {construct} at line {line}{also}: sapp-hook edits only "
        "config functions defined once at module level, where it can tell which definition TorchTitan runs; "
        "define it outside the block, or set the plan's fields by hand",
    )


def _listed(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "none"


def check_returns(function: ast.FunctionDef, where: str) -> None:
    """The function ends in its one `return`, of a `...Config(...)` call or of a name it binds to a plain
    call's result (`config = base()`): what the editor can follow."""
    returns = [node for node in _own_nodes(function) if isinstance(node, ast.Return)]
    last = function.body[-1]
    if len(returns) > 1:
        lines = ", ".join(str(line) for line in sorted(node.lineno for node in returns))
        raise InputError(
            "--config",
            f"{where} returns in {len(returns)} places (lines {lines}): sapp-hook edits a config function "
            "with one return, its last statement",
        )
    if not isinstance(last, ast.Return) or last.value is None:
        raise InputError(
            "--config", f"{where} does not end in `return` of its config: sapp-hook cannot tell which config it runs"
        )
    value = last.value
    if isinstance(value, ast.Call) and (dotted(value.func) or "").endswith("Config"):
        return
    if isinstance(value, ast.Name):
        bound = [
            node.value
            for node in function.body
            if isinstance(node, ast.Assign) and [dotted(target) for target in node.targets] == [value.id]
        ]
        if bound and isinstance(bound[-1], ast.Call) and dotted(bound[-1].func) is not None:
            return
        source = f" from {_shown(bound[-1])} (line {bound[-1].lineno})" if bound else ", which it does not build"
        raise InputError(
            "--config",
            f"{where} returns {value.id}{source}: a config built dynamically, which sapp-hook cannot follow; "
            f"expected `{value.id} = base()` (a function called by name), then `{value.id}.parallelism.F = ...`",
        )
    raise InputError(
        "--config",
        f"{where} returns {_shown(value)} (line {value.lineno}): a config built by a call sapp-hook cannot "
        "follow; expected `return Trainer.Config(...)` or a config it got by name and changed",
    )


def check_explicit(calls: list[ast.Call], where: str, wanted: str) -> None:
    """Every field of `calls` given as a keyword: a `**splat`, a `*args` or a positional argument may set
    one of the fields sapp-hook reads or writes (`wanted`: "the pipeline fields it writes")."""
    for call in calls:
        hidden = _hidden(call)
        if hidden is not None:
            raise InputError(
                "--config",
                f"{where}: {_shown(call)} (line {call.lineno}) passes {hidden}, which sapp-hook cannot see "
                f"into and which may set {wanted}: write those fields as keywords (name=value) to apply the plan",
            )


def _hidden(call: ast.Call) -> str | None:
    """What in a call's arguments sapp-hook cannot match to a field: a `**splat`, a `*args`, a positional
    argument; None where every argument is a keyword."""
    for keyword in call.keywords:
        if keyword.arg is None:
            return f"**{_shown(keyword.value)}"
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            return f"*{_shown(arg.value)}"
    return f"a positional argument ({_shown(call.args[0])})" if call.args else None


def check_written(old: ast.FunctionDef, new: ast.FunctionDef, source: str, path: Path, name: str) -> None:
    """The edited source compiles (it is not run) and no call of the edited function passes a keyword
    twice or has one added beside a `**splat` that may hold it."""
    left = "it was left as it was"
    for call in (node for node in ast.walk(new) if isinstance(node, ast.Call)):
        counts = Counter(keyword.arg for keyword in call.keywords if keyword.arg)
        twice = sorted(keyword for keyword, count in counts.items() if count > 1)
        if twice:
            raise InputError(
                "--config",
                f"{path}: {name} would pass {', '.join(twice)} twice to {called(call) or 'a call'} "
                f"(line {call.lineno}) after the write; {left}",
            )
    before, after = _beside_splats(old), _beside_splats(new)
    added = sorted(after - before)
    if added:
        callee, keyword, splat = added[0]
        raise InputError(
            "--config",
            f"{path}: {name} would pass {keyword} to {callee} beside **{splat}, which may hold it, after the write; "
            f"{left}",
        )
    try:
        compile(source, str(path), "exec", dont_inherit=True)  # builds the code object; runs nothing
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise InputError("--config", f"{path} would not compile after the write ({exc}); {left}") from None


def _beside_splats(function: ast.FunctionDef) -> set[tuple[str, str, str]]:
    """(callee, keyword, splat) for each keyword of a call that also passes a `**splat`."""
    said = set()
    for call in (node for node in ast.walk(function) if isinstance(node, ast.Call)):
        splats = [_shown(keyword.value) for keyword in call.keywords if keyword.arg is None]
        for splat in splats:
            said |= {(called(call) or "a call", keyword.arg, splat) for keyword in call.keywords if keyword.arg}
    return said


def _own_nodes(function: ast.FunctionDef) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the functions, lambdas or classes it defines."""
    stack = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _shown(node: ast.AST) -> str:
    """A node's source, cut to a readable length."""
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."
