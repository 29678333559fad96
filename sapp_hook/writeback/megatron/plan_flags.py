"""What a plan needs of Megatron-LM's flags, and whether a launch script's sizes fit it: the split
(first/last-stage counts or a layout string, checked by Megatron's rules), the micro-batch group of
the interleaved schedule, recompute; the pipeline size, layer counts (MTP layers too), batch sizes
and interleaving checked against the script's values, or said where the script leaves them to launch.
"""

from __future__ import annotations

from pathlib import Path

from basics.errors import InputError
from sapp_hook.writeback.degrees import CONTEXT, EXPERT, TENSOR, ZERO, Stated, check_degrees
from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.megatron.flags import (
    CP_SIZE,
    DECODER_LAYERS,
    DISTRIBUTE,
    DISTRIBUTED_OPTIMIZER,
    EMBEDDING_IN_SPLIT,
    ENCODER_LAYERS,
    EP_SIZE,
    FIRST,
    GLOBAL_BATCH,
    GRANULARITY,
    GROUP_SIZE,
    GROUPED_GEMM,
    HYBRID,
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
    NOOP_LAYERS,
    NUM_LAYERS,
    PATTERN,
    PP_SIZE,
    RAMPUP,
    RECOMPUTE_ACTIVATIONS,
    RECOMPUTE_LAYERS,
    TP_SIZE,
    VIRTUAL_STAGES,
    FlagValue,
    Occurrence,
    as_int,
    value_of,
)
from sapp_hook.writeback.megatron.layout_string import LayoutError, check, layout_text
from sapp_hook.writeback.text.provenance import Reading, text_of
from simulator.schedules.interleaved import default_group_size
from solver.vocabulary.profile import FULL, HEAD, NONE, SELECTIVE, TAIL

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


def _written(reading: Reading, occurrence: Occurrence) -> str:
    """A flag's value as the script writes it where the flag is (`$PP`, `4`)."""
    depth = len(occurrence.name[0].trail) - 1 if occurrence.name and occurrence.name[0].trail else 0
    sites = [ch.trail[depth] for value in occurrence.values for ch in value if len(ch.trail) > depth]
    if not sites:
        return occurrence.value_text() or "?"
    source = reading.files[sites[0].file]
    return source.text[min(site.start for site in sites) : max(site.end for site in sites)]


def _said(reading: Reading, occurrence: Occurrence, value: FlagValue) -> str:
    written = _written(reading, occurrence)
    return written if written == value.text or value.text is None else f"{written} (= {value.text})"


def _caveat(value: FlagValue) -> str:
    parts = []
    if value.environment:
        names = " or ".join(value.environment)
        parts.append(
            f"unless {names} {'is' if len(value.environment) == 1 else 'are'} set where the script is launched"
        )
    if value.branches:
        parts.append(f"where the branches that set {', '.join(value.branches)} give these")
    if value.conditional:
        parts.append("when the branch that passes it runs")
    return ", ".join(parts)


# -- checks --------------------------------------------------------------------------------------


def check_pipeline_size(reading: Reading, occurrence: Occurrence, layout: Layout, path: Path, notes: list[str]) -> bool:
    """Whether the script's pipeline size is to be set to the plan's (said in a note)."""
    value = value_of(reading, occurrence)
    size = value.number()
    written = _written(reading, occurrence)
    if size is None:
        launch = (
            f" (launch it with {value.environment[0]}={layout.pipeline_parallel})"
            if len(value.environment) == 1
            else ""
        )
        notes.append(
            f"{PP_SIZE} is {written} in {path.name}, known only where the script is launched: the plan is "
            f"for {layout.pipeline_parallel} pipeline ranks{launch}"
        )
        return False
    caveat = _caveat(value)
    if size != layout.pipeline_parallel:
        notes.append(
            f"{PP_SIZE} {_said(reading, occurrence, value)}{f' ({caveat})' if caveat else ''} set to the "
            f"plan's {layout.pipeline_parallel} pipeline ranks: Megatron-LM then runs world size / "
            f"({layout.pipeline_parallel} x tensor x context-parallel size) data-parallel replicas"
        )
        return True
    if caveat:
        notes.append(
            f"{PP_SIZE} is {written} in {path.name}: {size} {caveat}; the plan is for "
            f"{layout.pipeline_parallel} pipeline ranks"
        )
    return False


def check_layers(
    reading: Reading,
    last: dict[str, Occurrence],
    layout: Layout,
    path: Path,
    notes: list[str],
    noop: tuple[int, ...] = (),
) -> int:
    """The MTP layers (`--mtp-num-layers`, the plan's last body layers, which must be all its layers of an MTP
    kind); the layer count checked (`noop`: ids of layers that do nothing, counted in --num-layers: MindSpeed-LLM's
    --noop-layers)."""
    mtp = 0
    if MTP_LAYERS in last:
        value = value_of(reading, last[MTP_LAYERS])
        if value.number() is None:
            raise InputError(
                "--config",
                f"{MTP_LAYERS} is {_written(reading, last[MTP_LAYERS])} in {path}, known "
                "only at launch: sapp-hook needs it to place the MTP layers",
            )
        mtp = value.number() or 0
    if mtp >= layout.body_layers:
        raise PlanMismatch(f"places {layout.body_layers} layers; {path} has {MTP_LAYERS} {mtp}")
    body = [index for index, layer in enumerate(layout.layers) if layer.is_body]
    planned = [index for index in body if "mtp" in layout.layers[index].kind.lower()]
    if planned and (len(planned) != mtp or planned != body[-len(planned) :]):  # else an MTP layer runs as a decoder's
        raise PlanMismatch(
            f"places {len(planned)} multi-token-prediction layers ({layout.layers[planned[0]].kind}); {path} has "
            f"{MTP_LAYERS} {mtp}, whose layers Megatron-LM places after the decoder layers"
        )
    if NUM_LAYERS not in last:
        _check_pattern_layers(reading, last, layout.body_layers - mtp, path)
        return mtp
    value = value_of(reading, last[NUM_LAYERS])
    declared, expected = value.number(), layout.body_layers - mtp + len(noop)
    mtp_said = f" + {MTP_LAYERS} {mtp}" if mtp else ""
    if noop:
        mtp_said += f", {len(noop)} of them {NOOP_LAYERS} {','.join(map(str, noop))}"
    said = f"{NUM_LAYERS} {_said(reading, last[NUM_LAYERS], value)}{mtp_said}"
    if value.determined() and declared != expected:  # Megatron refuses a split whose layers do not add up
        raise PlanMismatch(f"places {layout.body_layers} decoder layers; {path} has {said}")
    if value.choices and value.exhaustive and not value.environment and str(expected) not in value.choices:
        raise PlanMismatch(
            f"places {layout.body_layers} decoder layers; {path} has {NUM_LAYERS} "
            f"{_written(reading, last[NUM_LAYERS])}{mtp_said}, which its branches set to "
            f"{' or '.join(value.choices)}",
        )
    if value.choices and str(expected) in value.choices:
        notes.append(
            f"{NUM_LAYERS} is {_written(reading, last[NUM_LAYERS])} in {path.name}, set in branches to "
            f"{' or '.join(value.choices)}: the plan is for the branch that sets {expected}"
        )
    elif declared is not None and declared != expected:
        notes.append(f"the plan places {layout.body_layers} decoder layers; {path.name} has {said} {_caveat(value)}")
    return mtp


def _pattern_segments(reading: Reading, last: dict[str, Occurrence]) -> list[int] | None:
    """The layers of each |-separated segment of --hybrid-layer-pattern as written (None where it is not
    given or known only at launch): its symbols before any `/`, which starts its MTP patterns; `[...]`
    brackets group layers without adding any."""
    occurrence = last.get(PATTERN)
    value = value_of(reading, occurrence) if occurrence is not None else None
    if value is None or not value.determined():
        return None
    main = value.text.split("/")[0]
    return [sum(1 for symbol in segment if symbol not in "[]") for segment in main.split("|")]


def _check_pattern_layers(reading: Reading, last: dict[str, Occurrence], expected: int, path: Path) -> None:
    """Without --num-layers, a HybridModel's layers are its --hybrid-layer-pattern's."""
    segments = _pattern_segments(reading, last)
    if segments is not None and sum(segments) != expected:
        raise PlanMismatch(
            f"places {expected} decoder layers; {path} has {PATTERN} "
            f"{value_of(reading, last[PATTERN]).text} ({sum(segments)} layers)",
        )


def check_model(
    reading: Reading, last: dict[str, Occurrence], launchers: list[int], layout: Layout, path: Path
) -> None:
    """Models whose layers Megatron-LM does not split by the layout or the first/last-stage flags: T5's
    encoder and decoder stacks; a Mamba hybrid model, whose MambaStack gives every rank --num-layers /
    pipeline size layers and runs no virtual stages (only an even plan of one chunk runs there)."""
    stacks = [flag for flag in (ENCODER_LAYERS, DECODER_LAYERS) if flag in last]
    if stacks:
        raise PlanMismatch(
            f"splits one stack of {layout.body_layers} layers; {path} trains an encoder-decoder "
            f"model ({' and '.join(stacks)}), whose stacks Megatron-LM's layout and first/last-"
            "stage flags do not split: sapp-hook plans decoder-only models",
        )
    words = [text_of(field) or "" for index in launchers for field in reading.commands[index].argv]
    hybrid = [flag for flag in HYBRID if flag in last] + [word for word in words if word.endswith("pretrain_mamba.py")]
    body = [sum(1 for layer in cell if layer.is_body) for cell in layout.virtual_stages()]
    segments = _pattern_segments(reading, last)
    if segments is not None and len(segments) > 1:  # the pattern's | marks are the split Megatron runs
        if segments != body or layout.chunks > 1:
            raise PlanMismatch(
                f"places {body} layers on its {layout.num_virtual_stages} virtual stages; {path}'s "
                f"{PATTERN} marks {len(segments)} stages of {segments} layers with |, which sapp-hook does not "
                "rewrite: only a plan of one chunk per rank that those marks say runs there as it is",
            )
        return
    if hybrid and (layout.chunks > 1 or len(set(body)) > 1):
        why = (
            # HybridModel (megatron/core/models/hybrid/hybrid_layer_allocation.py), whose layers are the pattern's
            "a hybrid model ({}), whose HybridModel takes any other split only as | stage boundaries "
            "in --hybrid-layer-pattern (or, in some versions, first/last-stage layer counts), which "
            "sapp-hook does not write"
            if PATTERN in last
            else "a Mamba hybrid model ({}), whose MambaStack gives every pipeline rank --num-layers / "
            "pipeline size layers and runs no virtual stages (newer Megatron-LM's HybridModel also takes "
            "stage boundaries as | in --hybrid-layer-pattern, not written by sapp-hook)"
        )
        raise PlanMismatch(
            f"places {body} layers on its {layout.num_virtual_stages} virtual stages; {path} trains "
            f"{why.format(', '.join(hybrid))}: only an even split of one chunk per rank runs there as it is",
        )


def check_micro_batches(
    reading: Reading, last: dict[str, Occurrence], layout: Layout, path: Path, notes: list[str]
) -> None:
    """Megatron runs global / (micro-batch size x data-parallel size) micro-batches per step: a script
    whose batch sizes cannot make the plan's count at any data-parallel size is refused, else the size
    that makes it is said."""
    if GLOBAL_BATCH not in last or MICRO_BATCH not in last:
        return  # left to Megatron's defaults
    values = value_of(reading, last[GLOBAL_BATCH]), value_of(reading, last[MICRO_BATCH])
    options = [
        [number for number in map(as_int, value.choices) if number is not None]
        or ([value.number()] if value.number() else [])
        for value in values
    ]
    pairs = [(global_size, micro_size) for global_size in options[0] for micro_size in options[1] if micro_size]
    if not pairs:
        return
    fitting = [
        (global_size, micro_size)
        for global_size, micro_size in pairs
        if global_size % micro_size == 0 and (global_size // micro_size) % layout.micro_batches == 0
    ]
    global_batch, micro_batch = (fitting or pairs)[0]
    said = f"{GLOBAL_BATCH} {global_batch} and {MICRO_BATCH} {micro_batch}"
    caveat = _caveat(
        FlagValue(
            None,
            tuple(dict.fromkeys(name for value in values for name in value.environment)),
            tuple(dict.fromkeys(name for value in values for name in value.branches)),
            any(value.conditional for value in values),
        )
    )
    if not fitting and (
        not caveat
        or (
            all(value.exhaustive for value in values if value.branches)
            and not any(value.environment or value.conditional for value in values)
        )
    ):
        raise PlanMismatch(
            f"is for {layout.micro_batches} micro-batches per step; with {path}'s {said}"
            f"{' (or what its branches set)' if len(pairs) > 1 else ''}, Megatron runs "
            f"{global_batch} / ({micro_batch} x data-parallel size): {layout.micro_batches} at "
            "no data-parallel size",
        )
    if fitting:
        notes.append(
            f"{said} make the plan's {layout.micro_batches} micro-batches per step at data-parallel size "
            f"{global_batch // micro_batch // layout.micro_batches}" + (f" ({caveat})" if caveat else "")
        )
        if RAMPUP in last:  # Megatron steps the global batch up from the ramp's start: fewer micro-batches until then
            ramp = value_of(reading, last[RAMPUP]).text or "?"
            notes.append(
                f"{RAMPUP} {ramp}: the global batch grows to {global_batch} over the ramp's samples, with "
                f"fewer micro-batches per step until then; the plan's {layout.micro_batches} hold after it"
            )
    else:
        notes.append(f"{said} make {layout.micro_batches} micro-batches per step at no data-parallel size ({caveat})")


def check_parallel_degrees(
    reading: Reading, last: dict[str, Occurrence], layout: Layout, path: Path, notes: list[str], *, complete: bool
) -> None:
    """The tensor, context and expert sizes and the distributed optimizer the script passes, against the plan's
    (`writeback.degrees`). A size known only at launch states none; one a launch may change (a variable from
    the environment, a branch) only gets a note. A missing --use-distributed-optimizer states it off where the
    launch command's every argument is seen (`complete`)."""
    stated = []
    for flag, degree in ((TP_SIZE, TENSOR), (CP_SIZE, CONTEXT), (EP_SIZE, EXPERT)):
        if flag not in last:
            continue
        value = value_of(reading, last[flag])
        if value.number():
            stated.append(
                Stated(
                    degree, flag, value.number() or 1, _caveat(value), f"{flag} is {_said(reading, last[flag], value)}"
                )
            )
    if DISTRIBUTED_OPTIMIZER in last:
        caveat = _caveat(value_of(reading, last[DISTRIBUTED_OPTIMIZER]))
        said = f"{DISTRIBUTED_OPTIMIZER} is passed (ZeRO stage 1: optimizer state only)"
        stated.append(Stated(ZERO, DISTRIBUTED_OPTIMIZER, 1, caveat, said, fix=""))
    elif complete:
        fix = f"pass {DISTRIBUTED_OPTIMIZER}" if layout.spec and layout.spec.zero_stage == 1 else ""
        said = f"{DISTRIBUTED_OPTIMIZER} is not passed (no ZeRO sharding)"
        stated.append(Stated(ZERO, DISTRIBUTED_OPTIMIZER, 0, said=said, fix=fix))
    check_degrees(stated, layout.spec, str(path), notes)


def check_interleaving(reading: Reading, last: dict[str, Occurrence], layout: Layout) -> None:
    """Megatron interleaves only over more than 1 pipeline rank, more than 2 without P2P overlap."""
    if layout.chunks == 1:
        return
    least = 3 if NO_OVERLAP_P2P in last else 2
    if layout.pipeline_parallel < least:
        why = f" with {NO_OVERLAP_P2P}" if least == 3 else ""
        raise PlanMismatch(
            f"interleaves {layout.chunks} chunks on {layout.pipeline_parallel} pipeline ranks; Megatron-LM"
            f"{why} interleaves only over {least} ranks or more",
        )


# -- the flags a plan needs ----------------------------------------------------------------------


def plan_flags(
    reading: Reading,
    last: dict[str, Occurrence],
    occurring: list[Occurrence],
    layout: Layout,
    mtp: int,
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    notes: list[str],
) -> str:
    """Fill in the flags the plan needs (`wanted`) and those it cannot have (`removed_flags`); what the flags
    cannot say of the plan is returned ("" when they say it exactly)."""
    split = split_flags(layout) if not mtp else None
    segments = _pattern_segments(reading, last)
    if segments is not None and len(segments) > 1:  # the | marks say the split (check_model): no split flags
        split = []
    if split is None:
        text = layout_string(layout, mtp)
        try:
            check(
                text,
                pipeline_size=layout.pipeline_parallel,
                num_layers=layout.body_layers - mtp,
                mtp_layers=mtp or None,
            )
        except LayoutError as error:
            raise PlanMismatch(f"cannot be said as a Megatron-LM layout: {error.detail}") from None
        split = [(LAYOUT, text)]
    wanted.extend((flag, [value]) for flag, value in split)
    removed_flags.extend(flag for flag in SPLIT_FLAGS if flag not in dict(split))
    for occurrence in occurring:
        if occurrence.flag in (LAYERS_PER_VIRTUAL, VIRTUAL_STAGES):
            now = "the layout's virtual stages" if layout.chunks > 1 else "the plan's one chunk per rank"
            notes.append(f"{occurrence.flag} ({where(reading, occurrence)}) taken out: {now} in its place")
    if layout.schedule == "Interleaved1F1B":
        group = layout.microbatch_group_size or default_group_size(layout.pipeline_parallel, layout.micro_batches)
        if group != layout.pipeline_parallel or GROUP_SIZE in last:  # Megatron's default is the pipeline size
            wanted.append((GROUP_SIZE, [str(group)]))
    return recompute_flags(reading, last, occurring, layout, mtp, wanted, removed_flags, notes)


def recompute_flags(
    reading: Reading,
    last: dict[str, Occurrence],
    occurring: list[Occurrence],
    layout: Layout,
    mtp: int,
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    notes: list[str],
) -> str:
    cells = decoder_modes(layout, mtp)
    if mtp and any(layer.recompute != NONE for layer in [layer for layer in layout.layers if layer.is_body][-mtp:]):
        notes.append("Megatron-LM's recompute flags do not reach the MTP layers: they keep their activations")
    for occurrence in occurring:
        if occurrence.flag in LEGACY:
            notes.append(
                f"{occurrence.flag} ({where(reading, occurrence)}) is a legacy flag Megatron-LM no longer "
                f"takes (now {LEGACY[occurrence.flag]}): taken out, the plan's recompute said with current flags"
            )
    modes = {mode for cell in cells for mode in cell}
    kept_flags = {DISTRIBUTE} if DISTRIBUTE in last else set()
    if modes <= {NONE}:
        removed_flags.extend(RECOMPUTE_FLAGS)
        return ""
    if modes == {SELECTIVE}:
        modules = ["layernorm"] + (["moe_act"] if GROUPED_GEMM in last else [])
        wanted.extend([(GRANULARITY, ["selective"]), (MODULES, modules)])
        removed_flags.extend(flag for flag in RECOMPUTE_FLAGS if flag not in (GRANULARITY, MODULES))
        return (
            f"Megatron-LM's selective recompute redoes the modules {MODULES} names; {' '.join(modules)} is the "
            "nearest to the plan's, and is not the selective recompute the profile measured (norms, activations "
            "and rotary redone, matmul and attention outputs kept): Megatron keeps the dense MLP's activation and "
            "the rotary outputs, so its memory is above the plan's"
        )
    counts = [sum(1 for mode in cell if mode != NONE) for cell in cells]
    most = max(counts)
    wanted.extend([(GRANULARITY, ["full"]), (METHOD, ["block"]), (RECOMPUTE_LAYERS, [str(most)])])
    if "--distribute-checkpointed-activations" in {occurrence.flag for occurrence in occurring}:
        kept_flags.add(DISTRIBUTE)
        wanted.append((DISTRIBUTE, []))
    removed_flags.extend(
        flag for flag in RECOMPUTE_FLAGS if flag not in {GRANULARITY, METHOD, RECOMPUTE_LAYERS} | kept_flags
    )
    if modes <= {NONE, FULL} and len(set(counts)) == 1:
        return ""
    return (
        f"Megatron-LM recomputes the same number of layers on every stage; the plan varies it per stage, so "
        f"every stage fully recomputes its first {most} layers (at least what the plan asks, slower than the plan)"
    )


def where(reading: Reading, occurrence: Occurrence) -> str:
    trail = occurrence.name[0].trail if occurrence.name else ()
    return reading.where(trail[-1]) if trail else "?"


def decoder_modes(layout: Layout, mtp: int) -> list[list[str]]:
    """The recompute mode of each decoder layer (the last `mtp` body layers, MTP's, not counted), per virtual
    stage."""
    cells, seen = [], 0
    for cell in layout.virtual_stages():
        modes = []
        for layer in cell:
            seen += layer.is_body
            if layer.is_body and seen <= layout.body_layers - mtp:
                modes.append(layer.recompute)
        cells.append(modes)
    return cells
