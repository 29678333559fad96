"""TorchTitan Python configs (`config_registry.py`, TorchTitan main since 2026-02, and before it the
`train_configs/*.py` files whose module sets `default_config = JobConfig(...)`): the plan written into
one config function (or that module-level config) as a minimal edit of its source.

A config function returns `Trainer.Config(parallelism=ParallelismConfig(...), activation_checkpoint=...,
...)`, or takes another function's config and changes fields of it (`config = llama3_debugmodel();
config.parallelism.x = ...; return config`); TorchTitan runs the one `--module M --config FUNCTION` names.
The writer sets the fields where the function sets them: a keyword of its `ParallelismConfig(...)`
call, an assignment `X.parallelism.FIELD = ...` (which runs after the call), else a new keyword or,
in a function that changes a config it got, a new assignment before its `return`. Only those spans
change; comments and formatting stay. What the editor cannot read whole (a `**splat`, a config built
dynamically, a function defined conditionally) is refused first (`python_rules`). The new source must
parse and compile (`ast`, never run), pass no keyword twice, and the function must then set every field
to the plan's value, or nothing is written.

Why an edit of the source rather than `--parallelism.*` command-line overrides written to a file: the
overrides (which TorchTitan's tyro parser does take, module lists as `a,b c,d`) change nothing until the
launch command is changed to read them, and a launch without them runs the old split silently; the
config, edited, says the plan wherever it is launched from. Stdlib `ast` gives every node's exact
span, which is all a minimal edit needs: no dependency (libcst: a 2.3 MB wheel, 18 MB installed,
150 ms to import).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from basics.errors import InputError
from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.files import BOM, WriteBack, commit_config
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.text.python_source import (
    Code,
    Edit,
    Text,
    import_edit,
    keyword_edits,
    render,
    splice,
    statement_edit,
    statement_removal,
    value_edit,
)
from sapp_hook.writeback.torchtitan.dialects import (
    FQNS,
    FQNS_PREFIXED,
    MICRO_KEYS,
    SHAPING_KEYS,
    Dialect,
    find_source,
    python_dialect,
)
from sapp_hook.writeback.torchtitan.models import (
    check_mtp,
    model_from_imports,
    mtp_in_python,
    python_source,
    source_notes,
)
from sapp_hook.writeback.torchtitan.plan_fields import (
    Checkpointing,
    change_notes,
    check_degree,
    check_pipelines,
    check_stated_degrees,
    checkpointing,
    module_names,
)
from sapp_hook.writeback.torchtitan.python_rules import (
    called,
    check_explicit,
    check_returns,
    check_written,
    config_function,
    dotted,
    module_config,
)

CONFIG_MODULE = "torchtitan.config"
AC_MODULE = "torchtitan.distributed.activation_checkpoint"
AC_CLASSES = {"none": None, "full": "FullAC", "selective": "SelectiveAC"}
SECTIONS = {
    "parallelism": "ParallelismConfig",
    "training": "TrainingConfig",
    "batch": "BatchConfig",
    "activation_checkpoint": "ActivationCheckpointConfig",
}
# the classes of the module-level `default_config = JobConfig(...)` files (late 2025), which lack the suffix
JOB_CONFIG_SECTIONS = {
    "parallelism": "Parallelism",
    "training": "Training",
    "activation_checkpoint": "ActivationCheckpoint",
}


@dataclass
class Sites:
    """Where a config function sets its parallelism, training and activation checkpointing."""

    function: ast.FunctionDef
    calls: dict[str, list[ast.Call]] = field(default_factory=dict)  # ParallelismConfig(...) and the like
    fields: dict[tuple[str, str], ast.Assign] = field(default_factory=dict)  # X.section.field = ..., the last
    wholes: dict[str, list[ast.AST]] = field(default_factory=dict)  # section=... keywords, X.section = ...
    returned: str | None = None  # the name it returns: a config it got and changed
    base: str | None = None  # the function it got that config from (`config = base()`)
    config_call: ast.Call | None = None  # the Trainer.Config(...) it returns
    final: ast.Return | None = None

    @classmethod
    def of(cls, function: ast.FunctionDef) -> Sites:
        sites = cls(function)
        local: dict[str, str] = {}  # a variable holding a section's config: `p = ParallelismConfig(...)`
        for node in _in_order(function):
            if isinstance(node, ast.Call):
                section = _section(node)
                if section is not None:
                    sites.calls.setdefault(section, []).append(node)
                for kw in node.keywords:
                    if kw.arg in SECTIONS:
                        sites.wholes.setdefault(kw.arg, []).append(kw.value)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and isinstance(node.value, ast.Call) and _section(node.value):
                    local[target.id] = _section(node.value)
                path = (dotted(target) or "").split(".") if isinstance(target, ast.Attribute) else []
                if len(path) == 2 and path[0] in local:
                    sites.fields[(local[path[0]], path[1])] = node
                elif len(path) >= 3:
                    sites.fields[(path[-2], path[-1])] = node
                if len(path) >= 2:
                    sites.wholes.setdefault(path[-1], []).append(node.value)
        last = function.body[-1]
        if isinstance(last, ast.Return):
            sites.final = last
            if isinstance(last.value, ast.Name):
                sites.returned = last.value.id
                sites.base = next(
                    (
                        dotted(node.value.func)
                        for node in function.body
                        if isinstance(node, ast.Assign)
                        and isinstance(node.value, ast.Call)
                        and [dotted(t) for t in node.targets] == [sites.returned]
                    ),
                    None,
                )
            elif isinstance(last.value, ast.Call) and (dotted(last.value.func) or "").endswith("Config"):
                sites.config_call = last.value
        return sites

    def values(self, section: str) -> dict[str, object]:
        """The literal values the function leaves in `section`'s fields (Code for what is not a literal);
        a whole section replaced by something else than its config class (`X.parallelism = make()`)
        leaves nothing known."""
        said: dict[str, object] = {}
        calls = self.calls.get(section, [])
        events: list[tuple[ast.AST, str | None]] = [(call, None) for call in calls]
        events += [
            (node, "")
            for node in self.wholes.get(section, [])
            if not isinstance(node, ast.Name) and all(node is not call for call in calls)
        ]
        events += [(node, name) for (where, name), node in self.fields.items() if where == section]
        for node, name in sorted(events, key=lambda event: (event[0].lineno, event[0].col_offset)):
            if name is None:
                said = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
            elif not name:
                said = {}
            else:
                said[name] = _literal(node.value)
        return said


def inherited(tree: ast.Module, sites: Sites, section: str) -> dict[str, object]:
    """`section`'s values as the function leaves them, with those of the function in the same file it
    takes its config from (`config = base()`) beneath."""
    said: dict[str, object] = {}
    for each in reversed(_chain(tree, sites)):
        said.update(each.values(section))
    return said


def _chain(tree: ast.Module, sites: Sites) -> list[Sites]:
    """The function's sites, then those of the function in the same file it takes its config from, and so on."""
    chain = [sites]
    while chain[-1].base is not None and len(chain) < 9:
        base = next(
            (node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == chain[-1].base), None
        )
        if base is None:
            break
        chain.append(Sites.of(base))
    return chain


def _calls(tree: ast.Module, sites: Sites, *sections: str) -> list[ast.Call]:
    """The config calls of `sections` in the function and the functions it takes its config from."""
    return [call for each in _chain(tree, sites) for section in sections for call in each.calls.get(section, [])]


BOTH_HEADS = ("output", "lm_head")


def write_python(path: Path, function: str | None, as_read: str, layout: Layout, *, dry_run: bool) -> WriteBack:
    old = as_read.removeprefix(BOM)  # Python reads a source's byte-order mark; commit puts it back
    try:
        tree = ast.parse(old)
    except SyntaxError as exc:
        raise InputError("--config", f"{path} is not valid Python: {exc.msg} (line {exc.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # a NUL byte; nesting deeper than the parser goes
        raise InputError("--config", f"{path} is not Python sapp-hook can read: {exc}") from None
    chosen = config_function(tree, function, path)
    where = f"{path}: {chosen.name}"
    check_returns(chosen, where)
    model = _model_name(tree, chosen, path)
    check_pipelines(model, where)
    source, passed_over = python_source(find_source(path), where)
    dialect = python_dialect(tree, source)
    sites, text = Sites.of(chosen), Text(old)
    check_mtp(mtp_in_python(each.function for each in _chain(tree, sites)), layout.pipeline_parallel, where)
    check_explicit(_calls(tree, sites, "parallelism"), where, "the pipeline fields it writes")
    # a JobConfig(...) is older than `lm_head` (2026-04); where neither its TorchTitan nor its text names
    # the head, both names are listed, of which the model has one
    head = dialect.head or ("output" if called(sites.config_call) == "JobConfig" else "")
    heads = (head,) if head else BOTH_HEADS
    parallelism = inherited(tree, sites, "parallelism")
    # an expression (not a literal) is what it is at launch: no note, no check
    parallelism = {key: value for key, value in parallelism.items() if not isinstance(value, Code)}
    degree = check_degree(parallelism.get("pipeline_parallel_degree"), f"{where}: parallelism.pipeline_parallel_degree")
    if parallelism.get("pipeline_parallel_schedule_csv"):
        raise InputError(
            "--config",
            f"{where} sets parallelism.pipeline_parallel_schedule_csv: TorchTitan runs that "
            f"file's action order, not the plan's {layout.schedule}; remove it to apply the plan",
        )
    result = WriteBack(path=path, diff="")
    change_notes(result, f"{chosen.name}: parallelism", degree, parallelism.get("pipeline_parallel_schedule"), layout)
    check_stated_degrees(parallelism, "parallelism", layout, where, result.notes)
    wanted = {
        "pipeline_parallel_degree": layout.pipeline_parallel,
        "pipeline_parallel_schedule": layout.schedule,
        # the local batch: TrainingConfig's, BatchConfig's since 2026-07 (#3926)
        dialect.micro_key: _micro_batches(
            {**inherited(tree, sites, "training"), **inherited(tree, sites, "batch")},
            _calls(tree, sites, "training", "batch"),
            dialect,
            layout,
            where,
        ),
        dialect.split_key: module_names(layout, heads, model),
    }
    drop = {FQNS, FQNS_PREFIXED, *MICRO_KEYS, *SHAPING_KEYS} - set(wanted)
    change = Change(text, tree, sites, where)
    _set_parallelism(change, wanted, drop)
    choice = checkpointing(layout, dialect)
    checked = _set_checkpointing(change, dialect, choice)
    new = change.edited(old, chosen.name)
    _read_back(new, path, chosen, wanted, checked)
    result.notes += [*passed_over, *source_notes(where, source, dialect)]
    result.notes += [
        f"{where}: the config does not say which TorchTitan it is for (nor does a TorchTitan source "
        f"beside it): wrote {what}"
        for what in dialect.assumed
    ]
    if not head:
        result.notes.append(
            f"{where}: neither the config nor a TorchTitan source beside it says whether its TorchTitan "
            "names the output projection 'output' or 'lm_head' (since 2026-04): the last model part "
            "lists both; TorchTitan keeps the modules a part names and passes over a name its model "
            "lacks, so the head stays on the last stage in either"
        )
    result.notes += list(choice.notes)
    commit_config(result, as_read, new, None if choice.exact else layout.plan_json(), dry_run=dry_run)
    return result


def _micro_batches(
    training: dict[str, object], calls: list[ast.Call], dialect: Dialect, layout: Layout, where: str
) -> int:
    if dialect.counts_micro_batches:
        return layout.micro_batches
    local = training.get("local_batch_size")
    if local is None:
        check_explicit(calls, where, "the training.local_batch_size it reads")
        raise InputError(
            "--config",
            f"{where} sets no literal training.local_batch_size, which TorchTitan splits into the "
            f"plan's {layout.micro_batches} micro-batches: set it to a multiple of {layout.micro_batches}",
        )
    if isinstance(local, Code):
        raise InputError(
            "--config",
            f"{where} sets training.local_batch_size to {local}, not a number sapp-hook can "
            f"divide into the plan's {layout.micro_batches} micro-batches: write it as one",
        )
    if isinstance(local, bool) or not isinstance(local, int):
        raise InputError(
            "--config", f"{where}: training.local_batch_size is {local!r}; TorchTitan expects a whole number"
        )
    if local % layout.micro_batches:
        raise PlanMismatch(
            f"is for {layout.micro_batches} micro-batches; {where} has training.local_batch_size "
            f"{local}, which does not split into {layout.micro_batches}",
        )
    return local // layout.micro_batches


@dataclass
class Change:
    """The edits a write makes to one config function, gathered so that every span is edited once."""

    text: Text
    tree: ast.Module
    sites: Sites
    where: str
    edits: list[Edit] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)  # for before the function's return
    host: dict[str, tuple[str | None, dict[str, object]]] = field(default_factory=dict)  # new keywords of the
    # Trainer.Config(...) it returns: their constructor and its fields
    imports: dict[str, list[str]] = field(default_factory=dict)  # module -> names the new code uses

    @property
    def indent(self) -> str:
        """The indentation of the function's last statement."""
        return self.text.indent(self.sites.final.lineno) if self.sites.final else ""

    def statement(self, target: str, value: object) -> None:
        self.statements.append(f"{target} = {render(value, self.indent)}")

    def keyword(self, keyword: str, constructor: str | None, values: dict[str, object]) -> None:
        """`keyword=constructor(values...)` (without a constructor, `keyword=values[""]`) to add to the
        Trainer.Config(...) the function returns."""
        host = self.sites.config_call
        if host is None or any(kw.arg == keyword for kw in host.keywords):
            got = self.sites.wholes.get(keyword)
            said = (
                f"takes its {keyword} from {ast.unparse(got[-1])!r}" if got else "returns no Trainer.Config(...) call"
            )
            raise InputError(
                "--config",
                f"{self.where} {said}: sapp-hook cannot tell where to write the plan's "
                f"{keyword} ({', '.join(name or str(value) for name, value in values.items())})",
            )
        check_explicit([host], self.where, f"the {keyword} it adds")
        if constructor is not None and called(host) == "JobConfig":
            constructor = JOB_CONFIG_SECTIONS[keyword]
        self.host[keyword] = (constructor, values)
        if constructor is not None:
            self.uses(CONFIG_MODULE, constructor)

    def uses(self, module: str, name: str) -> None:
        self.imports.setdefault(module, []).append(name)

    def edited(self, old: str, function: str) -> str:
        """`old` with every edit made: those inside the function's calls first, then, on the source they
        leave, the new keywords of its Trainer.Config(...) (which may hold an edited call), imports and
        statements."""
        first = splice(old, self.edits)
        if not (self.host or self.imports or self.statements):
            return first
        try:
            tree = ast.parse(first)
        except SyntaxError:
            return first  # the read-back says so
        sites, text = Sites.of(_function(tree, function)), Text(first)
        edits = [edit for module, names in self.imports.items() if (edit := import_edit(text, tree, module, names))]
        if self.host:
            edits += keyword_edits(
                text,
                sites.config_call,
                {
                    keyword: _construct(text, sites.config_call, constructor, values)
                    for keyword, (constructor, values) in self.host.items()
                },
                set(),
            )
        if self.statements:
            edits.append(statement_edit(text, sites.final, self.statements))
        return splice(first, edits)


def _construct(text: Text, host: ast.Call, constructor: str | None, values: dict[str, object]) -> object:
    """`constructor(values...)` as a new keyword's value in `host`, laid out one field per line."""
    if constructor is None:
        return values[""]
    args = [*host.args, *host.keywords]
    laid_out = args and text.starts_line(args[-1]) and host.end_lineno > args[-1].end_lineno
    indent = text.indent(args[-1].lineno) if laid_out else text.indent(host.lineno) + "    "
    inner = "".join(f"{indent}    {name}={render(item, indent + '    ')},\n" for name, item in values.items())
    return Code(f"{constructor}(\n{inner}{indent})")


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name), None)
    return found or module_config(tree, name)  # type: ignore[return-value]


def _model_name(tree: ast.Module, chosen: ast.FunctionDef, path: Path) -> str | None:
    """The TorchTitan model a config trains: `Model(name=...)` of a JobConfig, else the model package whose
    model_registry or config functions it imports, else the one a config_registry.py sits in."""
    for node in ast.walk(chosen):
        if isinstance(node, ast.Call) and called(node) == "Model":
            named = next((kw.value for kw in node.keywords if kw.arg == "name"), None)
            if isinstance(named, ast.Constant) and isinstance(named.value, str):
                return named.value
    imported = model_from_imports(tree)
    if imported is not None:
        return imported
    return path.parent.name if path.name == "config_registry.py" else None


def _set_parallelism(change: Change, wanted: dict[str, object], drop: set[str]) -> None:
    """Set `wanted` in the function's parallelism and take `drop` out of its ParallelismConfig(...)."""
    sites, text = change.sites, change.text
    calls = sites.calls.get("parallelism", [])
    if len(calls) > 1:
        raise InputError(
            "--config",
            f"{change.where} builds ParallelismConfig {len(calls)} times; sapp-hook edits a "
            "function that builds it once",
        )
    call = calls[0] if calls else None
    in_call = {}
    for name, value in wanted.items():
        assigned = sites.fields.get(("parallelism", name))
        if assigned is not None:
            change.edits += value_edit(text, assigned.value, value)
        elif call is not None or sites.returned is None:
            in_call[name] = value
        else:
            change.statement(f"{sites.returned}.parallelism.{name}", value)
    stale = "pipeline_parallel_layers_per_stage"  # TorchTitan refuses it beside a module list
    for name in drop - {stale}:  # names this TorchTitan does not take, or other ways of saying the split
        if ("parallelism", name) in sites.fields:
            change.edits.append(statement_removal(text, sites.fields[("parallelism", name)]))
    if ("parallelism", stale) in sites.fields:
        change.edits += value_edit(text, sites.fields[("parallelism", stale)].value, None)
    elif call is None and sites.returned is not None and stale in ast.dump(change.tree):
        change.statement(f"{sites.returned}.parallelism.{stale}", None)
    if call is not None:
        change.edits += keyword_edits(text, call, in_call, drop & {kw.arg for kw in call.keywords})
    elif in_call:
        change.keyword("parallelism", "ParallelismConfig", in_call)


def _set_checkpointing(change: Change, dialect: Dialect, choice: Checkpointing) -> dict[str, object]:
    """Give the function the checkpointing `choice`; what it must then say."""
    sites, text = change.sites, change.text
    current = sites.wholes.get("activation_checkpoint", [])
    last = current[-1] if current else None
    if dialect.ac_classes:
        name = AC_CLASSES[choice.mode]
        code = Code("None" if name is None else f"{name}.Config()")
        checked: dict[str, object] = {"class": name or "None"}
        if last is not None and _ac_class(last) == checked["class"]:
            return checked
        if any(section == "activation_checkpoint" for section, _ in sites.fields):
            raise InputError(
                "--config",
                f"{change.where} sets fields of its activation checkpointing, which the "
                f"plan's {code} would replace: remove them or set {code} by hand",
            )
        if name is not None:
            change.uses(AC_MODULE, name)
        if last is not None:
            change.edits += value_edit(text, last, code)
        elif sites.returned is not None:
            change.statement(f"{sites.returned}.activation_checkpoint", code)
        else:
            change.keyword("activation_checkpoint", None, {"": code})
        return checked
    settings: dict[str, object] = {"mode": choice.mode}
    if choice.option is not None and dialect.layer_checkpointing:
        settings["selective_ac_option"] = choice.option
    call = last if isinstance(last, ast.Call) and _section(last) == "activation_checkpoint" else None
    check_explicit([call] if call is not None else [], change.where, "the checkpointing fields it writes")
    in_call = {}
    for name, value in settings.items():
        assigned = sites.fields.get(("activation_checkpoint", name))
        if assigned is not None:
            change.edits += value_edit(text, assigned.value, value)
        elif call is not None or (last is None and sites.returned is None):
            in_call[name] = value
        elif last is None:
            change.statement(f"{sites.returned}.activation_checkpoint.{name}", value)
        else:
            raise InputError(
                "--config",
                f"{change.where} takes its activation checkpointing from "
                f"{ast.unparse(last)!r}; set mode={choice.mode!r} there",
            )
    if call is not None:
        change.edits += keyword_edits(text, call, in_call, set())
    elif in_call:
        change.keyword("activation_checkpoint", "ActivationCheckpointConfig", in_call)
    return settings


def _read_back(
    new: str, path: Path, chosen: ast.FunctionDef, wanted: dict[str, object], checked: dict[str, object]
) -> None:
    """Parse the new source as Python does and check the function sets what was written, passing no keyword
    twice."""
    name = chosen.name
    try:
        tree = ast.parse(new)
    except SyntaxError as exc:
        raise InputError(
            "--config", f"{path} would not parse after the write ({exc.msg}); it was left as it was"
        ) from None
    function = _function(tree, name)
    check_written(chosen, function, new, path, name)
    sites = Sites.of(function)
    said = {key: value for key, value in sites.values("parallelism").items() if key in wanted}
    if "class" in checked:
        current = sites.wholes.get("activation_checkpoint", [])
        said_checkpoint = {"class": _ac_class(current[-1]) if current else None}
    else:
        said_checkpoint = {key: value for key, value in sites.values("activation_checkpoint").items() if key in checked}
    if said != wanted or said_checkpoint != checked:
        wrong = sorted(
            {key for key in wanted if said.get(key) != wanted[key]}
            | {key for key in checked if said_checkpoint.get(key) != checked[key]}
        )
        raise InputError(
            "--config", f"{path}: {name} would not set {', '.join(wrong)} as written; it was left as it was"
        )


def _ac_class(node: ast.AST) -> str | None:
    """`FullAC` for `FullAC.Config(...)`, `None` for None."""
    if isinstance(node, ast.Constant) and node.value is None:
        return "None"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Config":
        return dotted(node.func.value)
    return None


def _section(call: ast.Call) -> str | None:
    """The section a call builds the config of (`ParallelismConfig(...)`, `Parallelism(...)`: parallelism)."""
    name = called(call)
    return next(
        (section for names in (SECTIONS, JOB_CONFIG_SECTIONS) for section, config in names.items() if config == name),
        None,
    )


def _literal(node: ast.AST) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return Code(ast.unparse(node))


def _in_order(function: ast.FunctionDef) -> Iterator[ast.AST]:
    nodes = [node for node in ast.walk(function) if hasattr(node, "lineno") and node is not function]
    return iter(sorted(nodes, key=lambda node: (node.lineno, node.col_offset)))
