"""Megatron-LM launch scripts and arguments files: the pipeline split, virtual stages, micro-batch
groups and recompute flags a plan needs, written where the script passes its flags.

The script is read as bash runs it (`writeback.text.bash_script`): only flags that reach the command that gets
`--pipeline-model-parallel-size` count, whether written on its command line, in a bash array, in a
quoted options string, in a sourced file, in a branch, or passed through variables; a flag in a
comment is not one. A flag the plan sets is changed where it is written (in a variable's assignment
when its value is `$VAR`); one it needs and the script lacks is added next to the pipeline size; one
Megatron would refuse beside the plan's is taken out, wherever it is. The rewritten script is read
again and must pass exactly the plan's flags, each once, and pass `bash -n`, or nothing is written.

The split: with one chunk per rank and the middle stages alike, `--decoder-first/last-pipeline-num-
layers` (older Megatron reads only these); else `--pipeline-model-parallel-layout` (`E` embedding,
`t` decoder layer, `m` MTP layer, `L` loss; checked by Megatron's rules in `layout_string`).
Megatron recomputes the same way on every stage (`--recompute-method block` recomputes the first N
decoder layers of each virtual stage): a plan it cannot say exactly gets the nearest setting that
recomputes at least as much, a note, and a side file with the exact plan.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from basics.errors import InputError
from sapp_hook.writeback.files import WriteBack, commit, commit_config, read_config
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.megatron.edits import (
    EditError,
    insertion,
    reading_tokens,
    removal,
    replacement,
    splice,
)
from sapp_hook.writeback.megatron.flags import (
    DISTRIBUTE,
    FIRST,
    GRANULARITY,
    GROUP_SIZE,
    LAST,
    LAYERS_PER_VIRTUAL,
    LAYOUT,
    LEGACY,
    METHOD,
    MODULES,
    PP_SIZE,
    RECOMPUTE_ACTIVATIONS,
    RECOMPUTE_LAYERS,
    TP_SIZE,
    VIRTUAL_STAGES,
    Occurrence,
    conditional,
    occurrences,
    scan,
    split_fields,
)
from sapp_hook.writeback.megatron.layout_string import parse_stages
from sapp_hook.writeback.megatron.plan_flags import (
    SCHEDULES,
    check_interleaving,
    check_layers,
    check_micro_batches,
    check_model,
    check_parallel_degrees,
    check_pipeline_size,
    layout_string,
    plan_flags,
    split_flags,
    where,
)
from sapp_hook.writeback.mindspeed.dialect import mindspeed_dialect
from sapp_hook.writeback.mindspeed.plan_flags import mindspeed_flags
from sapp_hook.writeback.text.bash_script import read_script
from sapp_hook.writeback.text.provenance import Command, ReadError, Reading, text_of

PRINTERS = ("echo", "printf")  # they show a command's flags; they launch nothing
# What a fragment a launcher sources holds: the flags of the split and of recompute, in variables
PLAN_FLAGS = {FIRST, LAST, LAYOUT, LAYERS_PER_VIRTUAL, VIRTUAL_STAGES, GROUP_SIZE, GRANULARITY, METHOD}
PLAN_FLAGS |= {RECOMPUTE_LAYERS, MODULES, RECOMPUTE_ACTIVATIONS, DISTRIBUTE, *LEGACY}
PIPELINE_VARIABLES = ("PP", "PP_SIZE", "PIPELINE_PARALLEL_SIZE", "PIPELINE_MODEL_PARALLEL_SIZE")

__all__ = ["FIRST", "LAST", "LAYOUT", "layout_string", "parse_layout", "split_flags", "write_megatron"]


def parse_layout(text: str) -> list[int]:
    """Decoder layers per stage of a layout string (Megatron's grammar, `layout_string`)."""
    return [stage.count("t") for stage in parse_stages(text.strip("\"'"))]


def write_megatron(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    """Write the plan into the launch script (or arguments file) at `path` and the files it sources or
    runs where its flags are; in a dry run only the diff. InputError, and nothing written, where the
    script cannot run the plan or a change cannot be made safely."""
    if layout.schedule not in (*SCHEDULES, "DualPipeV"):  # MindSpeed-LLM runs DualPipeV (its dialect, below)
        _refuse_schedule(layout)
    old = read_config(path)
    _refuse_yaml(path, old)
    arguments_file = not _is_script(path, old)
    reading = _read(path, old, arguments_file, {})
    result = WriteBack(path=path, diff="")
    launchers, anchor_flag = _launchers(reading, path)
    occurring = occurrences(reading, launchers)
    last = {occurrence.flag: occurrence for occurrence in occurring if not occurrence.alternative}
    notes = result.notes
    dialect = mindspeed_dialect(reading, last, launchers, path)
    if layout.schedule not in SCHEDULES and dialect is None:
        _refuse_schedule(layout)
    wanted: list[tuple[str, list[str]]] = []
    # where no command gets the size, Megatron would run one stage: the plan's is added (said below)
    if anchor_flag.startswith("$"):
        notes.append(_fragment(reading, anchor_flag, layout, path))
    elif anchor_flag == TP_SIZE or check_pipeline_size(reading, last[PP_SIZE], layout, path, notes):
        wanted.append((PP_SIZE, [str(layout.pipeline_parallel)]))
    check_model(reading, last, launchers, layout, path)
    mtp = check_layers(reading, last, layout, path, notes, dialect.noop if dialect else ())
    check_micro_batches(reading, last, layout, path, notes)
    check_interleaving(reading, last, layout)
    seen_whole = not _unseen(reading, launchers) and not reading.unfollowed
    check_parallel_degrees(reading, last, layout, path, notes, complete=seen_whole)
    removed_flags: list[str] = []
    if dialect is None:
        inexact = plan_flags(reading, last, occurring, layout, mtp, wanted, removed_flags, notes)
    else:
        inexact = mindspeed_flags(reading, last, occurring, layout, mtp, dialect, wanted, removed_flags, notes)
    texts = _rewrite(path, old, arguments_file, reading, launchers, anchor_flag, wanted, removed_flags, notes)
    if anchor_flag == TP_SIZE:
        notes.insert(
            0,
            f"{path.name} passes no {PP_SIZE} (Megatron-LM runs 1 stage then"
            f"{_commented(reading, PP_SIZE)}): the plan's {layout.pipeline_parallel} is added",
        )
    unseen = _unseen(reading, launchers)
    if unseen:
        notes.append(
            f"the launch command also expands {', '.join(unseen)}, known only at launch: flags there are not seen"
        )
    if reading.unfollowed:
        notes.append(f"not followed: {', '.join(dict.fromkeys(reading.unfollowed))}")
    if any(source.crlf is not None and source.script is not None for source in reading.files):
        notes.append(
            "CRLF line ends: bash on Linux reads the \\r into each line's last word and a \\ before "
            "CRLF continues no line (convert with dos2unix to run it there); the rewrite keeps them"
        )
    if inexact:
        notes.append(inexact)
    texts.setdefault(path.resolve(), (old, old))  # unchanged, it still takes its side file or loses it
    _commit_all(result, texts, layout.plan_json() if inexact else None, dry_run)
    return result


# -- reading -------------------------------------------------------------------------------------


def _refuse_schedule(layout: Layout) -> None:
    raise InputError("--plan", f"Megatron-LM runs {', '.join(SCHEDULES)}; this plan is for {layout.schedule}")


def _refuse_yaml(path: Path, text: str) -> None:
    """One InputError for a Megatron-LM YAML config, which is neither a script nor a file of arguments."""
    if path.suffix not in (".yaml", ".yml"):
        return
    kind = (
        "the MODEL_ARGS of a functional-test model_config.yaml"
        if re.search(r"^MODEL_ARGS\s*:", text, re.MULTILINE)
        else "a --yaml-cfg file"
        if re.search(r"^(language_model|model_parallel)\s*:", text, re.MULTILINE)
        else "YAML"
    )
    raise InputError(
        "--config",
        f"{path} is a Megatron-LM YAML config ({kind}), not a launch script: sapp-hook writes the flags "
        "of a bash launch script or an arguments file; apply the plan to the script that launches the job",
    )


def _is_script(path: Path, text: str) -> bool:
    """A shell script, not a plain file of arguments (which `$(cat args.txt)` passes word by word)."""
    return path.suffix in (".sh", ".bash") or text.startswith("#!")


def _read(path: Path, text: str, arguments_file: bool, overrides: dict[Path, str]) -> Reading:
    try:
        return read_script(path, text, overrides=overrides, arguments_file=arguments_file)
    except ReadError as error:
        raise InputError("--config", error.detail) from None


def _launchers(reading: Reading, path: Path, anchor: str = "") -> tuple[list[int], str]:
    """The commands that get the pipeline size, and that flag; in a fragment that only sets variables of
    flags (for the script that sources it), those variables; where neither has one, the commands that
    get the tensor-parallel size. Last, a fragment whose variables hold split or recompute flags (its
    launcher passes the pipeline size): those variables, and `$NAME ...` for the flag (`anchor`: read
    the variables it names again)."""
    if anchor.startswith("$"):
        return _add_fragments(reading, set(), anchor[1:].split(" $")), anchor
    for flag, fragments in ((PP_SIZE, False), (PP_SIZE, True), (TP_SIZE, False)):
        if fragments:
            _add_fragments(reading, {flag})
        found = [
            index
            for index, command in enumerate(reading.commands)
            if any(occurrence.flag == flag for occurrence in scan(command.argv, index))
            and (text_of(command.argv[0]) if command.argv else "") not in PRINTERS
        ]
        if found:
            return found, flag
    added = len(reading.commands)
    names = [reading.definitions[index].name for index in _fragment_definitions(reading, PLAN_FLAGS, ())]
    if names and _add_fragments(reading, PLAN_FLAGS):
        return list(range(added, len(reading.commands))), "$" + " $".join(names)
    unfollowed = f"; not followed: {', '.join(reading.unfollowed)}" if reading.unfollowed else ""
    raise InputError(
        "--config",
        f"{path} has no {PP_SIZE} that bash passes to a command{_commented(reading, PP_SIZE)}"
        f"{unfollowed}: is it a Megatron-LM launch script?",
    )


def _add_fragments(reading: Reading, flags: set[str], names: list[str] | tuple[str, ...] = ()) -> list[int]:
    """Each variable whose (last) value holds one of the flags, or is named, as the arguments of a
    command to be; their indexes in `reading.commands`."""
    added = []
    for index in _fragment_definitions(reading, flags, names):
        definition = reading.definitions[index]
        fields = tuple(part for item in definition.value.elements() for part in split_fields(item))  # type: ignore[union-attr]
        added.append(len(reading.commands))
        reading.commands.append(Command(fields, definition.box, definition.conditional, False))
    return added


def _fragment_definitions(reading: Reading, flags: set[str], names: list[str] | tuple[str, ...]) -> list[int]:
    latest: dict[str, int] = {}
    for index, definition in enumerate(reading.definitions):
        value = definition.value
        fields = [part for item in value.elements() for part in split_fields(item)] if value else []
        if definition.name in names or any(occurrence.flag in flags for occurrence in scan(tuple(fields), -1)):
            latest[definition.name] = index
    return list(latest.values())


def _fragment(reading: Reading, anchor: str, layout: Layout, path: Path) -> str:
    """The note for a fragment a launcher sources; InputError where its pipeline size is not the plan's."""
    said = f"{path.name} runs no Megatron-LM command: read as a fragment sourced by a launch script"
    sizes = [
        definition
        for definition in reading.definitions
        if definition.name in PIPELINE_VARIABLES and definition.value is not None and not definition.conditional
    ]
    size = text_of(sizes[-1].value.scalar()) if sizes else None  # type: ignore[union-attr]
    if size is None or not size.isdigit():
        return (
            f"{said}; the plan's flags are written in {anchor}, and the launcher's {PP_SIZE} must be the "
            f"plan's {layout.pipeline_parallel}"
        )
    box = reading.boxes[sizes[-1].box]
    place = f"{reading.files[box.file].path.name} line {reading.files[box.file].line(box.start)}"
    if int(size) != layout.pipeline_parallel:
        raise InputError(
            "--config",
            f"{said}, it sets {sizes[-1].name}={size} ({place}), which its launcher passes as {PP_SIZE}; "
            f"the plan is for {layout.pipeline_parallel} pipeline ranks: plan for {size} or set "
            f"{sizes[-1].name}={layout.pipeline_parallel} first",
        )
    return f"{said}; the plan's flags are written in {anchor}, for {sizes[-1].name}={size} ({place})"


def _unseen(reading: Reading, launchers: list[int]) -> list[str]:
    """What a launch command expands to arguments known only at launch, where flags may be (`$EXTRA_ARGS`,
    not the value of a flag before it)."""
    found = []
    for index in launchers:
        argv = reading.commands[index].argv
        texts = ["".join(ch.unknown or ch.text for ch in field) for field in argv]
        # the words before the script are the launcher's own
        script_position = next((position for position, text in enumerate(texts) if text.endswith(".py")), -1)
        for position, field in enumerate(argv[script_position + 1 :], script_position + 1):
            if text_of(field) is None and not texts[position - 1].startswith("-"):
                found.extend(ch.unknown for ch in field if ch.unknown)
    return list(dict.fromkeys(found))


def _commented(reading: Reading, flag: str) -> str:
    """Where a flag is written but not passed: comments, here-documents, functions never called."""
    places = []
    for index, source in enumerate(reading.files):
        script = source.script
        if script is None:
            continue
        spans = [(start, end, "a comment") for start, end in script.comments]
        spans += [(start, end, "a here-document") for start, end in script.heredocs]
        spans += [
            (start, end, "a function never called") for file, start, end in reading.functions_unused if file == index
        ]
        for start, end, what in spans:
            text = script.text[start:end]
            if flag in text:
                line = script.text.count("\n", 0, start + text.index(flag)) + 1
                places.append(f"{what} ({source.path.name} line {line})")
    return f"; it is only in {', '.join(dict.fromkeys(places))}" if places else ""


# -- rewriting -----------------------------------------------------------------------------------


def _rewrite(
    path: Path,
    old: str,
    arguments_file: bool,
    reading: Reading,
    launchers: list[int],
    anchor_flag: str,
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    notes: list[str],
) -> dict[Path, tuple[str, str]]:
    """The new text of every file that changes; InputError (nothing written) where a change cannot be
    made safely or the result does not pass exactly the plan's flags."""
    try:
        texts = _change(reading, launchers, anchor_flag, wanted, removed_flags, notes, {})
        overrides = {file: new for file, (_, new) in texts.items()}
        reread = _read(path, overrides.get(path.resolve(), old), arguments_file, overrides)
        again, _ = _launchers(reading=reread, path=path, anchor=anchor_flag)
        texts = _change(reread, again, anchor_flag, wanted, removed_flags, notes, texts, insert=True)
        overrides = {file: new for file, (_, new) in texts.items()}
        final = _read(path, overrides.get(path.resolve(), old), arguments_file, overrides)
        _verify(reading, launchers, final, wanted, removed_flags, anchor_flag)
    except EditError as error:
        raise InputError("--config", f"{path}: {error.detail}; nothing was written") from None
    for file, (before, after) in texts.items():
        if file.suffix in (".sh", ".bash") or after.startswith("#!"):
            _bash_syntax(file, before, after)
    return texts


def _change(
    reading: Reading,
    launchers: list[int],
    anchor_flag: str,
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    notes: list[str],
    texts: dict[Path, tuple[str, str]],
    *,
    insert: bool = False,
) -> dict[Path, tuple[str, str]]:
    """First pass: values changed and flags taken out; second (`insert`): missing flags added."""
    occurring = occurrences(reading, launchers)
    edits = []
    anchors: dict[tuple[int, int], Occurrence] = {}
    for index in launchers:
        found = _anchors(reading, index, anchor_flag)
        anchors.setdefault(found[-1].key(), found[-1])  # argparse takes the last
    anchor_boxes = {anchor.name[0].trail[-1].box for anchor in anchors.values() if anchor.name and anchor.name[0].trail}
    uses = _variable_uses(reading, launchers)
    protected: set[str] = set()
    missing = []
    removed: list[Occurrence] = []
    for flag, values in wanted:
        flag_occurrences = [occurrence for occurrence in occurring if occurrence.flag == flag]
        if flag == anchor_flag:  # the size every other flag is added next to: changed in place, each
            flag_occurrences = list(anchors.values())
            for anchor in flag_occurrences[1:]:
                if anchor.value_text() != " ".join(values) and not insert:
                    edits.append(
                        replacement(
                            reading, anchor, values, evaluated=_evaluated(reading, anchor), protected=set(uses)
                        )[0]
                    )
        kept_occurrence = (
            flag_occurrences[0]
            if flag == anchor_flag and flag_occurrences
            else next(
                (
                    occurrence
                    for occurrence in flag_occurrences
                    if not occurrence.alternative
                    and (
                        not conditional(reading, occurrence)
                        or (occurrence.name[0].trail and occurrence.name[0].trail[-1].box in anchor_boxes)
                    )
                ),
                None,
            )
        )
        removed.extend(
            occurrence for occurrence in flag_occurrences if occurrence is not kept_occurrence and flag != anchor_flag
        )
        if kept_occurrence is None:
            missing.append((flag, values))
        elif values and kept_occurrence.value_text() != " ".join(values) and not insert:
            kept_arguments = {
                (kept_occurrence.command, kept_occurrence.position + 1 + value_index)
                for value_index in range(len(kept_occurrence.values))
            } | {(kept_occurrence.command, kept_occurrence.position)}
            shared = protected | {name for name, places in uses.items() if places - kept_arguments}
            edit, note = replacement(
                reading,
                kept_occurrence,
                values,
                evaluated=_evaluated(reading, kept_occurrence),
                protected=shared,
            )
            protected |= shared
            edits.append(edit)
            if note:
                notes.append(note)
    removed.extend(occurrence for occurrence in occurring if occurrence.flag in removed_flags)
    edits.extend(removal(reading, occurrence) for occurrence in removed)
    branched = [
        occurrence
        for occurrence in removed
        if conditional(reading, occurrence)
        and occurrence.flag not in LEGACY
        and occurrence.name[0].trail
        and occurrence.flag not in (LAYERS_PER_VIRTUAL, VIRTUAL_STAGES)
    ]  # those have a note of their own
    if branched and not insert:
        places = ", ".join(
            dict.fromkeys(f"{occurrence.flag} ({where(reading, occurrence)})" for occurrence in branched)
        )
        notes.append(f"took out {places}, passed only when a branch runs: the plan's flags hold on every branch")
    if insert:
        if edits:
            raise EditError("a flag it took out is still passed")
        for anchor in anchors.values() if missing else ():
            edit, place = insertion(reading, anchor, missing, evaluated=_evaluated(reading, anchor))
            edits.append(edit)
            notes.append(f"added {', '.join(flag for flag, _ in missing)} in {place}, next to {anchor.flag}")
    return _applied(reading, edits, texts)


def _applied(reading: Reading, edits: list, texts: dict[Path, tuple[str, str]]) -> dict[Path, tuple[str, str]]:
    by_path: dict[Path, list] = {}
    files: dict[Path, list[int]] = {}
    for index, source in enumerate(reading.files):
        files.setdefault(source.path.resolve(), []).append(index)
    for edit in edits:
        by_path.setdefault(reading.files[edit.file].path.resolve(), []).append(edit)
    changed = dict(texts)
    for path, file_edits in by_path.items():
        source = reading.files[files[path][0]]
        tokens = [span for index in files[path] for span in reading_tokens(reading, index)]
        new = splice(source.text, file_edits, tokens)
        original = texts[path][0] if path in texts else source.text
        changed[path] = (original, new)
    return changed


def _anchors(reading: Reading, index: int, anchor_flag: str) -> list[Occurrence]:
    """Where flags are added in a command: after the anchor flag; in a fragment, after its last word."""
    argv = reading.commands[index].argv
    if not anchor_flag.startswith("$"):
        return [occurrence for occurrence in scan(argv, index) if occurrence.flag == anchor_flag]
    if not argv or text_of(argv[-1]) is None:
        raise EditError(f"{anchor_flag} ends in no word written out, after which flags could be added")
    return [Occurrence(text_of(argv[-1]) or "", argv[-1], (), index, len(argv) - 1, False)]


def _variable_uses(reading: Reading, launchers: list[int]) -> dict[str, set[tuple[int, int]]]:
    """Each variable the launch commands expand, and which of their arguments use it."""
    uses: dict[str, set[tuple[int, int]]] = {}
    for index in launchers:
        for position, field in enumerate(reading.commands[index].argv):
            for ch in field:
                for site in ch.trail:
                    if site.ref >= 0:
                        uses.setdefault(reading.refs[site.ref].name, set()).add((index, position))
    return uses


def _evaluated(reading: Reading, occurrence: Occurrence) -> bool:
    return occurrence.command >= 0 and reading.commands[occurrence.command].evaluated


def _verify(
    before: Reading,
    launchers: list[int],
    after: Reading,
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    anchor_flag: str,
) -> None:
    """The rewritten script passes each wanted flag once with the plan's value, none of `removed_flags`,
    and every other argument as before."""
    try:
        again = _launchers(after, Path(""), anchor_flag if anchor_flag.startswith("$") else "")[0]
    except InputError:
        raise EditError(f"the rewritten script passes {PP_SIZE} to no command") from None
    if len(again) != len(launchers):
        raise EditError(f"the rewritten script passes {PP_SIZE} to {len(again)} commands, not {len(launchers)}")
    ours = {flag for flag, _ in wanted} | set(removed_flags)
    for old_index, new_index in zip(launchers, again):
        found = occurrences(after, [new_index])
        for flag, values in wanted:
            passed = [occurrence for occurrence in found if occurrence.flag == flag]
            if len(passed) != 1 or passed[0].alternative or (values and passed[0].value_text() != " ".join(values)):
                said = ", ".join(f"{occurrence.flag} {occurrence.value_text()}" for occurrence in passed) or "none"
                raise EditError(
                    f"the rewritten script would pass {said} where the plan needs {flag} {' '.join(values)}"
                )
        still_passed = [occurrence.flag for occurrence in found if occurrence.flag in removed_flags]
        if still_passed:
            raise EditError(f"the rewritten script still passes {still_passed[0]}")
        if _others(before, old_index, ours) != _others(after, new_index, ours):
            raise EditError("the rewrite would change other arguments of the launch command")


def _others(reading: Reading, index: int, ours: set[str]) -> list[str | None]:
    """A command's arguments but the flags the plan sets or takes out (and their values)."""
    argv = reading.commands[index].argv
    skip = set()
    for occurrence in scan(argv, index):
        if occurrence.flag in ours:
            skip |= {
                occurrence.position,
                *range(
                    occurrence.position + 1,
                    occurrence.position + 1 + (0 if occurrence.inline else len(occurrence.values)),
                ),
            }
    return [text_of(field) for position, field in enumerate(argv) if position not in skip]


def _bash_syntax(path: Path, before: str, after: str) -> None:
    """`bash -n` passes the rewrite wherever it passed the script (bash reads CRLF files converted)."""
    bash = shutil.which("bash")
    if bash is None:
        return

    def passes(text: str) -> bool:
        done = subprocess.run(
            [bash, "-n"], input=text.replace("\r\n", "\n"), capture_output=True, text=True, timeout=30, check=False
        )
        return done.returncode == 0

    if passes(before) and not passes(after):
        raise InputError("--config", f"{path}: the rewrite does not pass bash -n; nothing was written")


def _commit_all(result: WriteBack, texts: dict[Path, tuple[str, str]], side_plan: str | None, dry_run: bool) -> None:
    """Write every changed file, or none: a failure puts back those already written. The config itself goes
    last, with its side file (`side_plan`; None: none)."""
    main = result.path.resolve()
    order = sorted(texts, key=lambda changed: changed == main)  # the config itself last
    diffs, done = [], []
    try:
        for path in order:
            old, new = texts[path]
            target = result.path if path == main else path
            single = WriteBack(path=target, diff="", notes=result.notes if path == main else [])
            if path == main:
                commit_config(single, old, new, side_plan, dry_run=dry_run)
            else:
                commit(single, old, new, dry_run=dry_run)
            diffs.append(single.diff)
            if single.written:
                done.append((target, old, new))
                result.written.extend(single.written)
                if path == main:
                    result.backup = single.backup
                elif single.backup:
                    result.notes.append(f"the copy of {target} from before is {single.backup}")
            if path != main and old != new:
                result.notes.append(f"{target} changes too: {result.path.name} sources or runs it")
    except InputError:
        for target, old, new in reversed(done):
            commit(WriteBack(path=target, diff=""), new, old, dry_run=False)
        raise
    result.diff = "".join(diffs)
