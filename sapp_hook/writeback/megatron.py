"""Megatron-LM arguments in a launch script or an arguments file: the pipeline split and the
recompute flags.

A split with one chunk per rank whose stages hold the same number of decoder layers, the first or
last apart, is said with `--decoder-first/last-pipeline-num-layers` (Megatron spreads the rest
evenly; these flags predate the layout string and older versions read only them). Any other split
is said with `--pipeline-model-parallel-layout` (`E` embedding, `t` decoder layer, `L` loss, stages
split by `|`, virtual stages in Megatron's vpp-major order, which is sapp-hook's model order for
loop placement). Megatron recomputes the same way on every stage (`--recompute-method block`
recomputes the first N layers of each stage): a plan it cannot express gets the nearest setting that
recomputes at least as much, and a side file with the exact plan.
"""

from __future__ import annotations

import re
from pathlib import Path

from sapp_hook.writeback.files import WriteBack, commit, read_config, write_side_file
from sapp_hook.writeback.layout import Layout
from simulator.errors import InputError
from solver.profile import NONE, SELECTIVE

LAYOUT = "--pipeline-model-parallel-layout"
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
PP_SIZE = "--pipeline-model-parallel-size"
NUM_LAYERS = "--num-layers"
GLOBAL_BATCH, MICRO_BATCH = "--global-batch-size", "--micro-batch-size"
# The ways of saying the split: those the plan is not written with go (Megatron refuses a layout
# next to any other).
SPLIT_FLAGS = (
    LAYOUT,
    FIRST,
    LAST,
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
)
SWITCHES = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--recompute-activations")
RECOMPUTE_FLAGS = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")
# The orders Megatron runs with pipelining (get_forward_backward_func: 1F1B, interleaved 1F1B); it has
# no GPipe: a GPipe plan would run as 1F1B, with other times and memory than planned.
SCHEDULES = ("1F1B", "Interleaved1F1B")


def layout_string(layout: Layout) -> str:
    stages = []
    for cell in layout.virtual_stages():
        text = "E" if cell and cell[0].kind == "head" else ""
        body = sum(1 for layer in cell if layer.is_body)
        text += "t" * body if body < 3 else f"t*{body}"
        text += "L" if cell and cell[-1].kind == "tail" else ""
        stages.append(text)
    return "|".join(stages)


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
    """Decoder layers per virtual stage of a layout string (`*k` repeats, `(...)*k` groups)."""
    text = text.replace(",", "").strip("\"'")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(text):
        text = group.sub(lambda m: m.group(1) * int(m.group(2)), text)
    counts = []
    for stage in text.split("|"):
        count = 0
        for symbol, repeat in re.findall(r"([EtmL])(?:\*(\d+))?", stage):
            count += int(repeat or 1) if symbol == "t" else 0
        counts.append(count)
    return counts


def write_megatron(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    if layout.schedule not in SCHEDULES:
        raise InputError("--plan", f"Megatron-LM runs {', '.join(SCHEDULES)}; this plan is for {layout.schedule}")
    old = read_config(path)
    size = _value(old, PP_SIZE)
    if size is None:
        raise InputError("--config", f"{path} has no {PP_SIZE}: is it a Megatron-LM launch script?")
    result = WriteBack(path=path, diff="")
    if not size.isdigit():  # a shell variable or expression: the script decides at launch
        result.notes.append(f"{PP_SIZE} is {size} in {path}: the plan is for {layout.stages} stages")
    elif int(size) != layout.stages:
        raise InputError("--plan", f"is for {layout.stages} pipeline stages; {path} has {PP_SIZE} {size}")
    declared = _value(old, NUM_LAYERS)
    if declared is not None and declared.isdigit() and int(declared) != layout.body_layers:
        # Megatron refuses a split whose layers do not add up to the decoder layers
        raise InputError("--plan", f"places {layout.body_layers} decoder layers; {path} has {NUM_LAYERS} {declared}")
    _check_micro_batches(old, layout, path, result)
    # A shell script needs the layout quoted (| and *), except inside a quoted string (GPT_ARGS="...",
    # expanded later as $GPT_ARGS), where | and * are already literal and quotes would end the string;
    # an arguments file (`$(cat args.txt)`) must not have quotes either.
    shell = path.suffix in (".sh", ".bash") or old.startswith("#!")
    quoted = shell and _inside_quotes(old, _pattern(PP_SIZE, True).search(old).start())
    split = split_flags(layout)
    if split is None:
        text = layout_string(layout)
        split = [(LAYOUT, f'"{text}"' if shell and not quoted else text)]
    recompute, inexact = _recompute_flags(layout)
    flags = [*split, *recompute]
    new = old
    kept = {flag for flag, _ in split}  # rewritten where they stand
    for flag in [flag for flag in SPLIT_FLAGS if flag not in kept] + list(RECOMPUTE_FLAGS):
        new = _remove(new, flag, takes_value=True)
    for flag in SWITCHES:
        new = _remove(new, flag, takes_value=False)
    for flag, value in reversed(flags):  # each new line goes right after the pipeline size: last first
        new = _set(new, flag, value)
    commit(result, old, new, dry_run=dry_run)
    if inexact:
        result.notes.append(inexact)
        write_side_file(result, layout.plan_json(), dry_run=dry_run)
    return result


def _check_micro_batches(text: str, layout: Layout, path: Path, result: WriteBack) -> None:
    """Megatron runs global / (micro-batch size x data-parallel size) micro-batches per step: a script
    whose batch sizes cannot make the plan's count at any data-parallel size is refused, else the size
    that makes it is said."""
    global_batch, micro_batch = _value(text, GLOBAL_BATCH), _value(text, MICRO_BATCH)
    if not (global_batch and micro_batch and global_batch.isdigit() and micro_batch.isdigit() and int(micro_batch)):
        return  # variables, or left to Megatron's defaults
    samples = int(global_batch) // int(micro_batch)
    if int(global_batch) % int(micro_batch) or samples % layout.micro_batches:
        raise InputError("--plan", f"is for {layout.micro_batches} micro-batches per step; with {path}'s {GLOBAL_BATCH} "
                                   f"{global_batch} and {MICRO_BATCH} {micro_batch}, Megatron runs {global_batch} / "
                                   f"({micro_batch} x data-parallel size): {layout.micro_batches} at no data-parallel size")
    result.notes.append(f"{GLOBAL_BATCH} {global_batch} and {MICRO_BATCH} {micro_batch} make the plan's "
                        f"{layout.micro_batches} micro-batches per step at data-parallel size "
                        f"{samples // layout.micro_batches}")


def _recompute_flags(layout: Layout) -> tuple[list[tuple[str, str]], str]:
    """The recompute flags, and what they cannot say of the plan ("" when they say it exactly)."""
    modes = layout.body_modes()
    if modes <= {NONE}:
        return [], ""
    if modes == {SELECTIVE}:
        return [("--recompute-granularity", "selective")], (
            "Megatron-LM's selective recompute (--recompute-modules, core attention by default) is not the selective "
            "recompute the profile measured (norms, activations and rotary redone, matmul and attention outputs kept): "
            "its memory and time are not the plan's"
        )
    full = layout.uniform_full_count()
    if full is not None:
        return [("--recompute-granularity", "full"), ("--recompute-method", "block"), ("--recompute-num-layers", str(full))], ""
    most = max(sum(1 for layer in cell if layer.recompute != NONE) for cell in layout.virtual_stages())
    flags = [("--recompute-granularity", "full"), ("--recompute-method", "block"), ("--recompute-num-layers", str(most))]
    return flags, (
        f"Megatron-LM recomputes the same number of layers on every stage; the plan varies it per stage, so "
        f"every stage fully recomputes its first {most} layers (at least what the plan asks, slower than the plan)"
    )


def _pattern(flag: str, takes_value: bool) -> re.Pattern[str]:
    # a bare value stops at a quote: in A="--pipeline-model-parallel-size 4" the quote ends the string
    value = r"(?:[ \t]+|=)(\"[^\"]*\"|'[^']*'|[^\s\\\"']+)" if takes_value else ""
    return re.compile(rf"(?<![\w-]){re.escape(flag)}{value}(?![\w-])")


def _inside_quotes(text: str, position: int) -> bool:
    """Whether `position` of shell script `text` lies inside a quoted string."""
    quote = ""
    index = 0
    while index < position:
        char = text[index]
        if char == "\\" and quote != "'":
            index += 2  # an escaped character, quote or not
            continue
        if quote:
            if char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char == "#" and (index == 0 or text[index - 1].isspace()):
            index = text.find("\n", index)  # a comment, to the end of its line
            if index < 0:
                break
            continue
        index += 1
    return bool(quote)


def _value(text: str, flag: str) -> str | None:
    match = _pattern(flag, True).search(text)
    return match.group(1) if match else None


def _remove(text: str, flag: str, *, takes_value: bool) -> str:
    """Drop the flag (and its value); a line left holding only a continuation goes too."""
    pattern = _pattern(flag, takes_value)
    lines = []
    for line in text.splitlines(keepends=True):
        stripped = pattern.sub("", line)
        if stripped != line and stripped.strip() in ("", "\\"):
            continue
        lines.append(stripped)
    return "".join(lines)


def _set(text: str, flag: str, value: str) -> str:
    """Give `flag` `value`: in place if present, else on a line of its own after the pipeline size."""
    pattern = _pattern(flag, True)
    if pattern.search(text):
        return pattern.sub(lambda m: f"{flag} {value}", text, count=1)
    lines = text.splitlines(keepends=True)
    size = _pattern(PP_SIZE, True)
    for index, line in enumerate(lines):
        if size.search(line):
            continued = line.rstrip().endswith("\\")
            if continued or line.lstrip().startswith(PP_SIZE):  # one flag per line: add a line like it
                indent = line[: len(line) - len(line.lstrip())]
                ending = " \\\n" if continued else "\n"
                lines.insert(index + 1, f"{indent}{flag} {value}{ending}")
            else:
                lines[index] = size.sub(lambda m: f"{m.group(0)} {flag} {value}", line, count=1)
            return "".join(lines)
    raise AssertionError("the pipeline size was found before")
