"""Megatron-LM launch scripts and arguments files: the pipeline split, virtual stages, micro-batch
groups and recompute flags a plan needs, written where the script passes its flags.

The script is read as bash runs it (`megatron_script`): only flags that reach the command that gets
`--pipeline-model-parallel-size` count, whether written on its command line, in a bash array, in a
quoted options string, in a sourced file, in a branch, or passed through variables; a flag in a
comment is not one. A flag the plan sets is changed where it is written (in a variable's assignment
when its value is `$VAR`); one it needs and the script lacks is added next to the pipeline size; one
Megatron would refuse beside the plan's is taken out, wherever it is. The rewritten script is read
again and must pass exactly the plan's flags, each once, and pass `bash -n`, or nothing is written.

The split: with one chunk per rank and the middle stages alike, `--decoder-first/last-pipeline-num-
layers` (older Megatron reads only these); else `--pipeline-model-parallel-layout` (`E` embedding,
`t` decoder layer, `m` MTP layer, `L` loss; checked by Megatron's rules in `megatron_layout`).
Megatron recomputes the same way on every stage (`--recompute-method block` recomputes the first N
decoder layers of each virtual stage): a plan it cannot say exactly gets the nearest setting that
recomputes at least as much, a note, and a side file with the exact plan.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sapp_hook.writeback.files import WriteBack, commit, read_config, write_side_file
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.megatron_edits import (
    EditError,
    apply,
    insertion,
    reading_tokens,
    removal,
    replacement,
)
from sapp_hook.writeback.megatron_flags import (
    DISTRIBUTE,
    EMBEDDING_IN_SPLIT,
    FIRST,
    GLOBAL_BATCH,
    GRANULARITY,
    GROUP_SIZE,
    GROUPED_GEMM,
    LAST,
    LAYERS_PER_VIRTUAL,
    LAYOUT,
    LEGACY,
    LOSS_IN_SPLIT,
    METHOD,
    MICRO_BATCH,
    MODULES,
    MTP_LAYERS,
    NO_OVERLAP_P2P,
    NUM_LAYERS,
    PP_SIZE,
    RECOMPUTE_ACTIVATIONS,
    RECOMPUTE_LAYERS,
    TP_SIZE,
    VIRTUAL_STAGES,
    FlagValue,
    Occurrence,
    conditional,
    occurrences,
    scan,
    split_fields,
    value_of,
)
from sapp_hook.writeback.megatron_layout import (
    LayoutError,
    check,
    layout_text,
    parse_stages,
)
from sapp_hook.writeback.megatron_script import (
    Command,
    ReadError,
    Reading,
    read_script,
    text_of,
)
from simulator.errors import InputError
from simulator.schedules.interleaved import default_group_size
from solver.profile import FULL, HEAD, NONE, SELECTIVE, TAIL

# The orders Megatron runs with pipelining (get_forward_backward_func: 1F1B, interleaved 1F1B); it has
# no GPipe: a GPipe plan would run as 1F1B, with other times and memory than planned.
SCHEDULES = ("1F1B", "Interleaved1F1B")
# The ways of saying the split: those the plan is not written with go (Megatron refuses a layout
# next to any other, and the first/last flags next to --account-for-*)
SPLIT_FLAGS = (LAYOUT, FIRST, LAST, LAYERS_PER_VIRTUAL, VIRTUAL_STAGES, EMBEDDING_IN_SPLIT, LOSS_IN_SPLIT)
RECOMPUTE_FLAGS = (GRANULARITY, METHOD, RECOMPUTE_LAYERS, MODULES, RECOMPUTE_ACTIVATIONS, DISTRIBUTE, *LEGACY)


def layout_string(layout: Layout, mtp_layers: int = 0) -> str:
    """The layout string of a plan: its last `mtp_layers` body layers are MTP layers (`m`)."""
    body_total = layout.body_layers
    stages, seen = [], 0
    for cell in layout.virtual_stages():
        symbols = []
        for layer in cell:
            if layer.kind == HEAD:
                symbols += [] if "E" in symbols else ["E"]
            elif layer.kind == TAIL:
                symbols += [] if "L" in symbols else ["L"]
            else:
                seen += 1
                symbols.append("m" if seen > body_total - mtp_layers else "t")
        stages.append(symbols)
    return layout_text(stages)


def split_flags(layout: Layout) -> list[tuple[str, str]] | None:
    """The first/last-stage flags that say the plan's split, none for an even one; None where only a
    layout string can say it (several chunks, uneven middle stages, a stage without decoder layers)."""
    body = [sum(1 for layer in cell if layer.is_body) for cell in layout.virtual_stages()]
    if layout.chunks != 1 or min(body) < 1:
        return None
    for first, last in ((False, False), (True, False), (False, True), (True, True)):
        evenly = body[int(first) : len(body) - int(last)]  # the stages Megatron splits the rest over
        if evenly and len(set(evenly)) == 1:
            return [(FIRST, str(body[0]))] * first + [(LAST, str(body[-1]))] * last
    return None


def parse_layout(text: str) -> list[int]:
    """Decoder layers per stage of a layout string (Megatron's grammar, `megatron_layout`)."""
    return [stage.count("t") for stage in parse_stages(text.strip("\"'"))]


def write_megatron(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    if layout.schedule not in SCHEDULES:
        raise InputError("--plan", f"Megatron-LM runs {', '.join(SCHEDULES)}; this plan is for {layout.schedule}")
    old = read_config(path)
    arguments_file = not _is_script(path, old)
    reading = _read(path, old, arguments_file, {})
    result = WriteBack(path=path, diff="")
    launchers, anchor_flag = _launchers(reading, path)
    occurring = occurrences(reading, launchers)
    last = {occurrence.flag: occurrence for occurrence in occurring if not occurrence.alternative}
    notes = result.notes
    wanted: list[tuple[str, list[str]]] = []
    if anchor_flag == TP_SIZE:  # Megatron would run one stage: the plan's count is added, said below
        wanted.append((PP_SIZE, [str(layout.stages)]))
    else:
        _check_stages(reading, last[PP_SIZE], layout, path, notes)
    mtp = _check_layers(reading, last, layout, path, notes)
    _check_micro_batches(reading, last, layout, path, notes)
    _check_interleaving(reading, last, layout)
    gone: list[str] = []
    inexact = _plan_flags(reading, last, occurring, layout, mtp, wanted, gone, notes)
    texts = _rewrite(path, old, arguments_file, reading, launchers, anchor_flag, wanted, gone, notes)
    if anchor_flag == TP_SIZE:
        notes.insert(0, f"{path.name} passes no {PP_SIZE} (Megatron-LM runs 1 stage then"
                        f"{_commented(reading, PP_SIZE)}): the plan's {layout.stages} is added")
    if any(source.offsets is not None and source.script is not None for source in reading.files):
        notes.append("CRLF line ends: bash on Linux reads the \\r into each line's last word and a \\ before "
                     "CRLF continues no line (convert with dos2unix to run it there); the rewrite keeps them")
    _commit_all(result, texts, dry_run)
    if inexact:
        notes.append(inexact)
        write_side_file(result, layout.plan_json(), dry_run=dry_run)
    return result


# -- reading -------------------------------------------------------------------------------------


def _is_script(path: Path, text: str) -> bool:
    """A shell script, not a plain file of arguments (which `$(cat args.txt)` passes word by word)."""
    return path.suffix in (".sh", ".bash") or text.startswith("#!")


def _read(path: Path, text: str, arguments_file: bool, overrides: dict[Path, str]) -> Reading:
    try:
        return read_script(path, text, overrides=overrides, arguments_file=arguments_file)
    except ReadError as error:
        raise InputError("--config", error.detail) from None


def _launchers(reading: Reading, path: Path) -> tuple[list[int], str]:
    """The commands that get the pipeline size; in a fragment that only sets variables of flags (for
    the script that sources it), those variables; where neither has one, the commands that get the
    tensor-parallel size (the pipeline size is added there)."""
    for flag, fragments in ((PP_SIZE, False), (PP_SIZE, True), (TP_SIZE, False)):
        if fragments:
            _add_fragments(reading, flag)
        found = [index for index, command in enumerate(reading.commands)
                 if any(occurrence.flag == flag for occurrence in scan(command.argv, index))]
        if found:
            return found, flag
    unfollowed = f"; not followed: {', '.join(reading.unfollowed)}" if reading.unfollowed else ""
    raise InputError("--config", f"{path} has no {PP_SIZE} that bash passes to a command{_commented(reading, PP_SIZE)}"
                                 f"{unfollowed}: is it a Megatron-LM launch script?")


def _add_fragments(reading: Reading, flag: str) -> None:
    """Each variable whose (last) value holds the flag, as the arguments of a command to be."""
    latest: dict[str, int] = {}
    for index, definition in enumerate(reading.definitions):
        value = definition.value
        fields = [part for item in value.elements() for part in split_fields(item)] if value else []
        if any(occurrence.flag == flag for occurrence in scan(tuple(fields), -1)):
            latest[definition.name] = index
    for index in latest.values():
        definition = reading.definitions[index]
        fields = tuple(part for item in definition.value.elements() for part in split_fields(item))  # type: ignore[union-attr]
        reading.commands.append(Command(fields, definition.box, definition.conditional, False))


def _commented(reading: Reading, flag: str) -> str:
    """Where a flag is written but not passed: comments, here-documents, functions never called."""
    places = []
    for index, source in enumerate(reading.files):
        script = source.script
        if script is None:
            continue
        spans = [(start, end, "a comment") for start, end in script.comments]
        spans += [(start, end, "a here-document") for start, end in script.heredocs]
        spans += [(start, end, "a function never called") for file, start, end in reading.functions_unused
                  if file == index]
        for start, end, what in spans:
            text = script.text[start:end]
            if flag in text:
                line = script.text.count("\n", 0, start + text.index(flag)) + 1
                places.append(f"{what} ({source.path.name} line {line})")
    return f"; it is only in {', '.join(dict.fromkeys(places))}" if places else ""


def _written(reading: Reading, occurrence: Occurrence) -> str:
    """A flag's value as the script writes it where the flag is (`$PP`, `4`)."""
    depth = len(occurrence.name[0].trail) - 1 if occurrence.name and occurrence.name[0].trail else 0
    sites = [ch.trail[depth] for value in occurrence.values for ch in value if len(ch.trail) > depth]
    if not sites:
        return occurrence.value_text() or "?"
    source = reading.files[sites[0].file]
    return source.text[min(site.start for site in sites):max(site.end for site in sites)]


def _said(reading: Reading, occurrence: Occurrence, value: FlagValue) -> str:
    written = _written(reading, occurrence)
    return written if written == value.text or value.text is None else f"{written} (= {value.text})"


def _caveat(value: FlagValue) -> str:
    parts = []
    if value.environment:
        names = " or ".join(value.environment)
        parts.append(f"unless {names} {'is' if len(value.environment) == 1 else 'are'} set where the script is "
                     "launched")
    if value.branches:
        parts.append(f"if the branches that set {', '.join(value.branches)} give that")
    if value.conditional:
        parts.append("when the branch that passes it runs")
    return ", ".join(parts)


# -- checks --------------------------------------------------------------------------------------


def _check_stages(reading: Reading, occurrence: Occurrence, layout: Layout, path: Path, notes: list[str]) -> None:
    value = value_of(reading, occurrence)
    stages = value.number()
    if stages is not None and value.determined() and stages != layout.stages:
        raise InputError("--plan", f"is for {layout.stages} pipeline stages; {path} has {PP_SIZE} "
                                   f"{_said(reading, occurrence, value)}")
    written = _written(reading, occurrence)
    if stages is None:
        launch = f" (launch it with {value.environment[0]}={layout.stages})" if len(value.environment) == 1 else ""
        notes.append(f"{PP_SIZE} is {written} in {path.name}, known only where the script is launched: the plan is "
                     f"for {layout.stages} stages{launch}")
    elif not value.determined() or value.conditional:
        notes.append(f"{PP_SIZE} is {written} in {path.name}: {stages} {_caveat(value)}; the plan is for "
                     f"{layout.stages} stages")


def _check_layers(reading: Reading, last: dict[str, Occurrence], layout: Layout, path: Path, notes: list[str]) -> int:
    """The MTP layers (`--mtp-num-layers`, the plan's last body layers); the layer count checked."""
    mtp = 0
    if MTP_LAYERS in last:
        value = value_of(reading, last[MTP_LAYERS])
        if value.number() is None:
            raise InputError("--config", f"{MTP_LAYERS} is {_written(reading, last[MTP_LAYERS])} in {path}, known "
                                         "only at launch: sapp-hook needs it to place the MTP layers")
        mtp = value.number() or 0
    if mtp >= layout.body_layers:
        raise InputError("--plan", f"places {layout.body_layers} layers; {path} has {MTP_LAYERS} {mtp}")
    if NUM_LAYERS not in last:
        return mtp
    value = value_of(reading, last[NUM_LAYERS])
    declared, expected = value.number(), layout.body_layers - mtp
    mtp_said = f" + {MTP_LAYERS} {mtp}" if mtp else ""
    said = f"{NUM_LAYERS} {_said(reading, last[NUM_LAYERS], value)}{mtp_said}"
    if value.determined() and declared != expected:  # Megatron refuses a split whose layers do not add up
        raise InputError("--plan", f"places {layout.body_layers} decoder layers; {path} has {said}")
    if value.choices and value.exhaustive and not value.environment and str(expected) not in value.choices:
        raise InputError("--plan", f"places {layout.body_layers} decoder layers; {path} has {NUM_LAYERS} "
                                   f"{_written(reading, last[NUM_LAYERS])}{mtp_said}, which its branches set to "
                                   f"{' or '.join(value.choices)}")
    if value.choices and str(expected) in value.choices:
        notes.append(f"{NUM_LAYERS} is {_written(reading, last[NUM_LAYERS])} in {path.name}, set in branches to "
                     f"{' or '.join(value.choices)}: the plan is for the branch that sets {expected}")
    elif declared is not None and declared != expected:
        notes.append(f"the plan places {layout.body_layers} decoder layers; {path.name} has {said} {_caveat(value)}")
    return mtp


def _check_micro_batches(reading: Reading, last: dict[str, Occurrence], layout: Layout, path: Path,
                         notes: list[str]) -> None:
    """Megatron runs global / (micro-batch size x data-parallel size) micro-batches per step: a script
    whose batch sizes cannot make the plan's count at any data-parallel size is refused, else the size
    that makes it is said."""
    if GLOBAL_BATCH not in last or MICRO_BATCH not in last:
        return  # left to Megatron's defaults
    values = value_of(reading, last[GLOBAL_BATCH]), value_of(reading, last[MICRO_BATCH])
    global_batch, micro_batch = (value.number() for value in values)
    if not global_batch or not micro_batch:
        return
    samples = global_batch // micro_batch
    fits = global_batch % micro_batch == 0 and samples % layout.micro_batches == 0
    said = f"{GLOBAL_BATCH} {global_batch} and {MICRO_BATCH} {micro_batch}"
    caveat = _caveat(FlagValue(None, tuple(dict.fromkeys(v for value in values for v in value.environment)),
                               tuple(dict.fromkeys(v for value in values for v in value.branches)),
                               any(value.conditional for value in values)))
    if not fits and not caveat:
        raise InputError("--plan", f"is for {layout.micro_batches} micro-batches per step; with {path}'s {said}, "
                                   f"Megatron runs {global_batch} / ({micro_batch} x data-parallel size): "
                                   f"{layout.micro_batches} at no data-parallel size")
    if fits:
        notes.append(f"{said} make the plan's {layout.micro_batches} micro-batches per step at data-parallel size "
                     f"{samples // layout.micro_batches}" + (f" ({caveat})" if caveat else ""))
    else:
        notes.append(f"{said} ({caveat}) make {layout.micro_batches} micro-batches per step at no data-parallel size")


def _check_interleaving(reading: Reading, last: dict[str, Occurrence], layout: Layout) -> None:
    """Megatron interleaves only over more than 1 pipeline rank, more than 2 without P2P overlap."""
    if layout.chunks == 1:
        return
    least = 3 if NO_OVERLAP_P2P in last else 2
    if layout.stages < least:
        why = f" with {NO_OVERLAP_P2P}" if least == 3 else ""
        raise InputError("--plan", f"interleaves {layout.chunks} chunks on {layout.stages} pipeline stages; Megatron-LM"
                                   f"{why} interleaves only over {least} stages or more")


# -- the flags a plan needs ----------------------------------------------------------------------


def _plan_flags(reading: Reading, last: dict[str, Occurrence], occurring: list[Occurrence], layout: Layout,
                mtp: int, wanted: list[tuple[str, list[str]]], gone: list[str], notes: list[str]) -> str:
    """Fill in the flags the plan needs (`wanted`) and those it cannot have (`gone`); what the flags
    cannot say of the plan is returned ("" when they say it exactly)."""
    split = split_flags(layout) if not mtp else None
    if split is None:
        text = layout_string(layout, mtp)
        try:
            check(text, pipeline_size=layout.stages, num_layers=layout.body_layers - mtp, mtp_layers=mtp or None)
        except LayoutError as error:
            raise InputError("--plan", f"cannot be said as a Megatron-LM layout: {error.detail}") from None
        split = [(LAYOUT, text)]
    wanted.extend((flag, [value]) for flag, value in split)
    gone.extend(flag for flag in SPLIT_FLAGS if flag not in dict(split))
    for occurrence in occurring:
        if occurrence.flag in (LAYERS_PER_VIRTUAL, VIRTUAL_STAGES):
            now = "the layout's virtual stages" if layout.chunks > 1 else "the plan's one chunk per rank"
            notes.append(f"{occurrence.flag} ({_where(reading, occurrence)}) taken out: {now} in its place")
    if layout.schedule == "Interleaved1F1B":
        group = layout.microbatch_group_size or default_group_size(layout.stages, layout.micro_batches)
        if group != layout.stages or GROUP_SIZE in last:  # Megatron's default is the pipeline size
            wanted.append((GROUP_SIZE, [str(group)]))
    return _recompute(reading, last, occurring, layout, mtp, wanted, gone, notes)


def _recompute(reading: Reading, last: dict[str, Occurrence], occurring: list[Occurrence], layout: Layout, mtp: int,
               wanted: list[tuple[str, list[str]]], gone: list[str], notes: list[str]) -> str:
    cells, seen = [], 0
    for cell in layout.virtual_stages():
        decoders = []
        for layer in cell:
            seen += layer.is_body
            if layer.is_body and seen <= layout.body_layers - mtp:
                decoders.append(layer.recompute)
        cells.append(decoders)
    if mtp and any(layer.recompute != NONE for layer in [layer for layer in layout.layers if layer.is_body][-mtp:]):
        notes.append("Megatron-LM's recompute flags do not reach the MTP layers: they keep their activations")
    for occurrence in occurring:
        if occurrence.flag in LEGACY:
            notes.append(f"{occurrence.flag} ({_where(reading, occurrence)}) is a legacy flag Megatron-LM no longer "
                         f"takes (now {LEGACY[occurrence.flag]}): taken out, the plan's recompute said with current flags")
    modes = {mode for cell in cells for mode in cell}
    keep = {DISTRIBUTE} if DISTRIBUTE in last else set()
    if modes <= {NONE}:
        gone.extend(RECOMPUTE_FLAGS)
        return ""
    if modes == {SELECTIVE}:
        modules = ["layernorm"] + (["moe_act"] if GROUPED_GEMM in last else [])
        wanted.extend([(GRANULARITY, ["selective"]), (MODULES, modules)])
        gone.extend(flag for flag in RECOMPUTE_FLAGS if flag not in (GRANULARITY, MODULES))
        return (f"Megatron-LM's selective recompute redoes the modules {MODULES} names; {' '.join(modules)} is the "
                "nearest to the plan's, and is not the selective recompute the profile measured (norms, activations "
                "and rotary redone, matmul and attention outputs kept): Megatron keeps the dense MLP's activation and "
                "the rotary outputs, so its memory is above the plan's")
    counts = [sum(1 for mode in cell if mode != NONE) for cell in cells]
    most = max(counts)
    wanted.extend([(GRANULARITY, ["full"]), (METHOD, ["block"]), (RECOMPUTE_LAYERS, [str(most)])])
    if "--distribute-checkpointed-activations" in {o.flag for o in occurring}:
        keep.add(DISTRIBUTE)
        wanted.append((DISTRIBUTE, []))
    gone.extend(flag for flag in RECOMPUTE_FLAGS if flag not in {GRANULARITY, METHOD, RECOMPUTE_LAYERS} | keep)
    if modes <= {NONE, FULL} and len(set(counts)) == 1:
        return ""
    return (f"Megatron-LM recomputes the same number of layers on every stage; the plan varies it per stage, so "
            f"every stage fully recomputes its first {most} layers (at least what the plan asks, slower than the plan)")


def _where(reading: Reading, occurrence: Occurrence) -> str:
    trail = occurrence.name[0].trail if occurrence.name else ()
    return reading.where(trail[-1]) if trail else "?"


# -- rewriting -----------------------------------------------------------------------------------


def _rewrite(path: Path, old: str, arguments_file: bool, reading: Reading, launchers: list[int], anchor_flag: str,
             wanted: list[tuple[str, list[str]]], gone: list[str], notes: list[str]) -> dict[Path, tuple[str, str]]:
    """The new text of every file that changes; InputError (nothing written) where a change cannot be
    made safely or the result does not pass exactly the plan's flags."""
    try:
        texts = _change(reading, launchers, anchor_flag, wanted, gone, notes, {})
        overrides = {p: new for p, (_, new) in texts.items()}
        reread = _read(path, overrides.get(path.resolve(), old), arguments_file, overrides)
        again, _ = _launchers(reading=reread, path=path)
        texts = _change(reread, again, anchor_flag, wanted, gone, notes, texts, insert=True)
        overrides = {p: new for p, (_, new) in texts.items()}
        final = _read(path, overrides.get(path.resolve(), old), arguments_file, overrides)
        _verify(reading, launchers, final, wanted, gone)
    except EditError as error:
        raise InputError("--config", f"{path}: {error.detail}; nothing was written") from None
    for file, (before, after) in texts.items():
        if file.suffix in (".sh", ".bash") or after.startswith("#!"):
            _bash_syntax(file, before, after)
    return texts


def _change(reading: Reading, launchers: list[int], anchor_flag: str, wanted: list[tuple[str, list[str]]],
            gone: list[str], notes: list[str], texts: dict[Path, tuple[str, str]], *,
            insert: bool = False) -> dict[Path, tuple[str, str]]:
    """First pass: values changed and flags taken out; second (`insert`): missing flags added."""
    occurring = occurrences(reading, launchers)
    edits = []
    anchors: dict[tuple[int, int], Occurrence] = {}
    for index in launchers:
        found = [o for o in scan(reading.commands[index].argv, index) if o.flag == anchor_flag]
        anchors.setdefault(found[-1].key(), found[-1])  # argparse takes the last
    anchor_boxes = {o.name[0].trail[-1].box for o in anchors.values() if o.name and o.name[0].trail}
    uses = _variable_uses(reading, launchers)
    protected: set[str] = set()
    missing = []
    for flag, values in wanted:
        mine = [o for o in occurring if o.flag == flag]
        keep = next((o for o in mine if not o.alternative and (
            not conditional(reading, o) or (o.name[0].trail and o.name[0].trail[-1].box in anchor_boxes))), None)
        edits.extend(removal(reading, o) for o in mine if o is not keep)
        if keep is None:
            missing.append((flag, values))
        elif values and keep.value_text() != " ".join(values) and not insert:
            own = {(keep.command, keep.position + 1 + k) for k in range(len(keep.values))} | {
                (keep.command, keep.position)}
            shared = protected | {name for name, places in uses.items() if places - own}
            edit, note = replacement(reading, keep, values, evaluated=_evaluated(reading, keep), protected=shared)
            protected |= shared
            edits.append(edit)
            if note:
                notes.append(note)
    edits.extend(removal(reading, o) for o in occurring if o.flag in gone)
    if insert:
        if edits:
            raise EditError("a flag it took out is still passed")
        for anchor in anchors.values() if missing else ():
            edit, where = insertion(reading, anchor, missing, evaluated=_evaluated(reading, anchor))
            edits.append(edit)
            notes.append(f"added {', '.join(flag for flag, _ in missing)} in {where}, next to {anchor.flag}")
    return _applied(reading, edits, texts)


def _applied(reading: Reading, edits: list, texts: dict[Path, tuple[str, str]]) -> dict[Path, tuple[str, str]]:
    by_path: dict[Path, list] = {}
    files: dict[Path, list[int]] = {}
    for index, source in enumerate(reading.files):
        files.setdefault(source.path.resolve(), []).append(index)
    for edit in edits:
        by_path.setdefault(reading.files[edit.file].path.resolve(), []).append(edit)
    changed = dict(texts)
    for path, mine in by_path.items():
        source = reading.files[files[path][0]]
        tokens = [span for index in files[path] for span in reading_tokens(reading, index)]
        new = apply(source.text, mine, tokens)
        original = texts[path][0] if path in texts else source.text
        changed[path] = (original, new)
    return changed


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


def _verify(before: Reading, launchers: list[int], after: Reading, wanted: list[tuple[str, list[str]]],
            gone: list[str]) -> None:
    """The rewritten script passes each wanted flag once with the plan's value, none of those gone,
    and every other argument as before."""
    again = _launchers(after, Path(""))[0]
    if len(again) != len(launchers):
        raise EditError(f"the rewritten script passes {PP_SIZE} to {len(again)} commands, not {len(launchers)}")
    ours = {flag for flag, _ in wanted} | set(gone)
    for old_index, new_index in zip(launchers, again):
        found = occurrences(after, [new_index])
        for flag, values in wanted:
            mine = [o for o in found if o.flag == flag]
            if len(mine) != 1 or mine[0].alternative or (values and mine[0].value_text() != " ".join(values)):
                said = ", ".join(f"{o.flag} {o.value_text()}" for o in mine) or "none"
                raise EditError(f"the rewritten script would pass {said} where the plan needs {flag} {' '.join(values)}")
        if any(o.flag in gone for o in found):
            raise EditError(f"the rewritten script still passes {next(o.flag for o in found if o.flag in gone)}")
        if _others(before, old_index, ours) != _others(after, new_index, ours):
            raise EditError("the rewrite would change other arguments of the launch command")


def _others(reading: Reading, index: int, ours: set[str]) -> list[str | None]:
    """A command's arguments but the flags the plan sets or takes out (and their values)."""
    argv = reading.commands[index].argv
    skip = set()
    for occurrence in scan(argv, index):
        if occurrence.flag in ours:
            skip |= {occurrence.position, *range(occurrence.position + 1,
                                                 occurrence.position + 1 + (0 if occurrence.inline else
                                                                            len(occurrence.values)))}
    return [text_of(field) for position, field in enumerate(argv) if position not in skip]


def _bash_syntax(path: Path, before: str, after: str) -> None:
    """`bash -n` passes the rewrite wherever it passed the script (bash reads CRLF files converted)."""
    bash = shutil.which("bash")
    if bash is None:
        return
    def passes(text: str) -> bool:
        done = subprocess.run([bash, "-n"], input=text.replace("\r\n", "\n"), capture_output=True, text=True,
                              timeout=30, check=False)
        return done.returncode == 0
    if passes(before) and not passes(after):
        raise InputError("--config", f"{path}: the rewrite does not pass bash -n; nothing was written")


def _commit_all(result: WriteBack, texts: dict[Path, tuple[str, str]], dry_run: bool) -> None:
    """Write every changed file, or none: a failure puts back those already written."""
    main = result.path.resolve()
    order = sorted(texts, key=lambda p: p == main)  # the config itself last
    diffs, done = [], []
    try:
        for path in order:
            old, new = texts[path]
            target = result.path if path == main else path
            single = commit(WriteBack(path=target, diff=""), old, new, dry_run=dry_run)
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
