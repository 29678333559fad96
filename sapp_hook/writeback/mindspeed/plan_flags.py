"""What a plan needs of a MindSpeed-LLM script's flags: the split in the one form that MindSpeed version reads
(`--num-layer-list` for one chunk per rank; for virtual stages `--pipeline-num-transformer-layers` in 2.x, the
layout in master; the plan's layers placed around `--noop-layers` where the script pads with them), every
other statement of the split taken out; DualPipeV as `--schedules-method dualpipev`; recompute as Megatron-LM
says it (`megatron.plan_flags`) with MindSpeed's own recompute flags written or taken out to match, each said.
"""

from __future__ import annotations

from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.megatron.flags import (
    CKPT_FORMAT,
    EMBEDDING_IN_SPLIT,
    FB_OVERLAP,
    FIRST,
    GRANULARITY,
    GROUP_SIZE,
    LAST,
    LAYERS_PER_VIRTUAL,
    LAYOUT,
    LOAD,
    LOSS_IN_SPLIT,
    NOOP_LAYERS,
    NUM_LAYER_LIST,
    PER_PP_RANK,
    PIPELINE_NUM_LAYERS,
    PP_SIZE,
    RECOMPUTE_ACTIVATION_FUNCTION,
    RECOMPUTE_ACTIVATION_LAYERS,
    RECOMPUTE_NORM,
    RECOMPUTE_NORM_LAYERS,
    SCHEDULES_METHOD,
    SWAP_ATTENTION,
    SWAP_MODULES,
    USE_MCORE,
    VIRTUAL_STAGES,
    Occurrence,
    value_of,
)
from sapp_hook.writeback.megatron.layout_string import LayoutError, check
from sapp_hook.writeback.megatron.plan_flags import RECOMPUTE_FLAGS as MEGATRON_RECOMPUTE
from sapp_hook.writeback.megatron.plan_flags import decoder_modes, layout_string, recompute_flags, where
from sapp_hook.writeback.mindspeed.dialect import MASTER, RELEASE, SAID, Dialect
from sapp_hook.writeback.text.provenance import Reading
from simulator.schedules.interleaved import default_group_size
from solver.vocabulary.profile import NONE, SELECTIVE

# Every way a MindSpeed-LLM script says the split: the plan's is written, the others taken out
SPLIT_FLAGS = (
    NUM_LAYER_LIST,
    NOOP_LAYERS,
    PIPELINE_NUM_LAYERS,
    LAYOUT,
    FIRST,
    LAST,
    LAYERS_PER_VIRTUAL,
    VIRTUAL_STAGES,
    EMBEDDING_IN_SPLIT,
    LOSS_IN_SPLIT,
)
OWN_RECOMPUTE = (RECOMPUTE_ACTIVATION_FUNCTION, RECOMPUTE_ACTIVATION_LAYERS, RECOMPUTE_NORM, RECOMPUTE_NORM_LAYERS)
DUALPIPEV = "dualpipev"


def mindspeed_flags(
    reading: Reading,
    last: dict[str, Occurrence],
    occurring: list[Occurrence],
    layout: Layout,
    mtp: int,
    dialect: Dialect,
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    notes: list[str],
) -> str:
    """Fill in the flags the plan needs (`wanted`) and those it cannot have (`removed_flags`) in a MindSpeed-LLM
    script; what the flags cannot say of the plan is returned ("" when they say it exactly)."""
    notes.append(dialect.note())
    inexact = []
    split = _schedule(reading, last, layout, wanted) + _split(last, layout, mtp, dialect)
    wanted.extend((flag, [value]) for flag, value in split)
    removed_flags.extend(flag for flag in SPLIT_FLAGS if flag not in dict(split))
    for occurrence in occurring:
        if occurrence.flag in SPLIT_FLAGS and occurrence.flag not in dict(split) and not occurrence.alternative:
            notes.append(f"{occurrence.flag} ({where(reading, occurrence)}) taken out: the plan's split is said once")
    if layout.schedule == "Interleaved1F1B":
        group = layout.microbatch_group_size or default_group_size(layout.pipeline_parallel, layout.micro_batches)
        if dialect.version == MASTER and (group != layout.pipeline_parallel or GROUP_SIZE in last):
            wanted.append((GROUP_SIZE, [str(group)]))
        elif group != layout.pipeline_parallel:
            inexact.append(
                f"{SAID[dialect.version]} runs micro-batches in groups of the pipeline size "
                f"({layout.pipeline_parallel}), not the plan's {group}"
            )
    _checkpoint_note(reading, last, wanted, split, notes)
    megatron = recompute_flags(reading, last, occurring, layout, mtp, wanted, removed_flags, notes)
    cells = decoder_modes(layout, mtp)
    modes = {mode for cell in cells for mode in cell}
    if SELECTIVE in modes and modes <= {NONE, SELECTIVE}:  # said by MindSpeed's flags, not Megatron's
        inexact.append(_selective(last, cells, dialect, wanted, removed_flags, notes))
    else:
        inexact.append(megatron)
        _no_own_recompute(last, wanted, removed_flags, notes)
    _recompute_switches(reading, last, wanted, removed_flags, notes)
    return "; ".join(part for part in inexact if part)


# -- the split -----------------------------------------------------------------------------------


def _decoders(layout: Layout, mtp: int) -> list[int]:
    """Decoder layers (MTP layers not counted) of each virtual stage, in model order."""
    counts, seen = [], 0
    for cell in layout.virtual_stages():
        count = 0
        for layer in cell:
            seen += layer.is_body
            count += layer.is_body and seen <= layout.body_layers - mtp
        counts.append(count)
    return counts


def _schedule(
    reading: Reading, last: dict[str, Occurrence], layout: Layout, wanted: list[tuple[str, list[str]]]
) -> list[tuple[str, str]]:
    """DualPipeV as MindSpeed runs it: `--schedules-method dualpipev`, which needs `--moe-fb-overlap`."""
    method = value_of(reading, last[SCHEDULES_METHOD]).text if SCHEDULES_METHOD in last else None
    if method == DUALPIPEV and layout.schedule != "DualPipeV":
        raise PlanMismatch(
            f"is for {layout.schedule}; the script passes {SCHEDULES_METHOD} {DUALPIPEV}, which runs MindSpeed's "
            "DualPipeV (two chunks per rank in a V, split evenly): plan it with --schedule DualPipeV, or take "
            f"{SCHEDULES_METHOD} out to run this plan"
        )
    if layout.schedule != "DualPipeV":
        if FB_OVERLAP in last and layout.pipeline_parallel > 1 and layout.chunks == 1:
            raise PlanMismatch(
                f"runs one chunk per rank; the script passes {FB_OVERLAP}, which MindSpeed overlaps over "
                f"pipeline ranks only with virtual stages or {SCHEDULES_METHOD} {DUALPIPEV}: plan with --chunks 2 "
                f"or more, or take {FB_OVERLAP} out"
            )
        return []
    if FB_OVERLAP not in last:
        raise PlanMismatch(
            f"is for DualPipeV; MindSpeed-LLM runs it ({SCHEDULES_METHOD} {DUALPIPEV}) only with {FB_OVERLAP} "
            "(MoE models), which the script does not pass"
        )
    return [(SCHEDULES_METHOD, DUALPIPEV)]


def _split(last: dict[str, Occurrence], layout: Layout, mtp: int, dialect: Dialect) -> list[tuple[str, str]]:
    counts = _decoders(layout, mtp)
    stages = len(counts)
    if FB_OVERLAP in last and min(counts) == 0:
        empty = [index for index, count in enumerate(counts) if count == 0]
        raise PlanMismatch(
            f"leaves virtual stage {', '.join(map(str, empty))} without decoder layers; MindSpeed's "
            f"{FB_OVERLAP} (in the script) runs no empty chunk"
        )
    if mtp and not (dialect.version == MASTER and layout.chunks > 1 and not dialect.noop):
        _mtp_last(layout, mtp)
    if dialect.noop:
        return _around_noop(layout, mtp, counts, dialect.noop)
    if layout.schedule == "DualPipeV":
        if len(set(counts)) > 1:
            raise PlanMismatch(
                f"places {counts} decoder layers on its virtual stages; MindSpeed's {SCHEDULES_METHOD} "
                f"{DUALPIPEV} splits them evenly and reads no {NUM_LAYER_LIST} or layout: only an even plan, or "
                f"one placed around {NOOP_LAYERS}, runs there"
            )
        return []
    if layout.chunks == 1:
        if layout.pipeline_parallel == 1 or (len(set(counts)) == 1 and NUM_LAYER_LIST not in last):
            return []
        return [(NUM_LAYER_LIST, ",".join(map(str, counts)))]
    if len(set(counts)) == 1:
        return [(LAYERS_PER_VIRTUAL, str(counts[0]))]
    if dialect.version == MASTER:
        text = layout_string(layout, mtp)
        try:
            check(text, pipeline_size=layout.pipeline_parallel, num_layers=sum(counts), mtp_layers=mtp or None)
        except LayoutError as error:
            raise PlanMismatch(f"cannot be said as a MindSpeed-LLM layout: {error.detail}") from None
        return [(LAYOUT, text)]
    if dialect.version != RELEASE:
        raise PlanMismatch(
            f"places {counts} decoder layers on its virtual stages; {SAID[dialect.version]} "
            f"({dialect.why}): {NUM_LAYER_LIST} refuses virtual stages there, and it has neither "
            f"{PIPELINE_NUM_LAYERS} nor a layout"
        )
    if sum(counts) % stages:
        raise PlanMismatch(
            f"places {counts} decoder layers on its virtual stages; MindSpeed-LLM 2.x reads "
            f"{PIPELINE_NUM_LAYERS} only beside {LAYERS_PER_VIRTUAL}, whose even share of --num-layers "
            f"{sum(counts)} over {stages} virtual stages is not whole"
        )
    rows = [
        [counts[chunk * layout.pipeline_parallel + rank] for chunk in range(layout.chunks)]
        for rank in range(layout.pipeline_parallel)
    ]
    matrix = "[" + ",".join("[" + ",".join(map(str, row)) + "]" for row in rows) + "]"
    return [(PIPELINE_NUM_LAYERS, matrix), (LAYERS_PER_VIRTUAL, str(sum(counts) // stages))]


def _mtp_last(layout: Layout, mtp: int) -> None:
    """MindSpeed builds the MTP layers on the last virtual stage (in model order)."""
    cells = layout.virtual_stages()
    last_cell = sum(1 for layer in cells[-1] if layer.is_body)
    if last_cell < mtp:
        raise PlanMismatch(
            f"places MTP layers (--mtp-num-layers {mtp}, the plan's last body layers) before the last virtual "
            "stage; MindSpeed-LLM builds them on the last one"
        )


def _around_noop(layout: Layout, mtp: int, counts: list[int], noop: tuple[int, ...]) -> list[tuple[str, str]]:
    """The plan's layers with the padding placed after each virtual stage's: MindSpeed splits --num-layers
    (padding counted) evenly over the virtual stages, ignoring --num-layer-list beside --noop-layers."""
    stages = len(counts)
    total = sum(counts) + len(noop)
    said = f"{NOOP_LAYERS} {','.join(map(str, noop))}"
    if total % stages:
        raise PlanMismatch(
            f"runs {stages} virtual stages; with {said}, MindSpeed splits --num-layers {total} evenly over them, "
            "which is not whole"
        )
    slots = total // stages
    if max(counts) > slots:
        raise PlanMismatch(
            f"places {counts} decoder layers on its virtual stages; with {said}, MindSpeed gives each "
            f"{slots} slots of --num-layers {total} (the padding placed where layers are fewer): the plan "
            f"needs {max(counts)} on one; refused"
        )
    ids = [stage * slots + index for stage, count in enumerate(counts) for index in range(count, slots)]
    split = [(NOOP_LAYERS, ",".join(map(str, ids)))]
    if layout.chunks > 1 and layout.schedule != "DualPipeV":
        split.append((LAYERS_PER_VIRTUAL, str(slots)))
    return split


def _checkpoint_note(
    reading: Reading,
    last: dict[str, Occurrence],
    wanted: list[tuple[str, list[str]]],
    split: list[tuple[str, str]],
    notes: list[str],
) -> None:
    """Torch-format checkpoints hold each rank's layers: a new split does not load the old ones."""
    before = {flag: last[flag].value_text() or "" for flag in SPLIT_FLAGS if flag in last}
    after = dict(split)
    changed = before != after or any(flag == PP_SIZE for flag, _ in wanted)
    ckpt_format = value_of(reading, last[CKPT_FORMAT]).text if CKPT_FORMAT in last else "torch"
    if not changed or ckpt_format not in ("torch", None):
        return
    old = " ".join(f"{flag} {value}".strip() for flag, value in before.items()) or "the even split"
    new = " ".join(f"{flag} {value}" for flag, value in after.items()) or "the even split"
    load = f" (the script's {LOAD})" if LOAD in last else ""
    notes.append(
        f"the split changes from {old} to {new}: checkpoints saved in torch format with the old split{load} "
        "hold each rank's layers and do not load under the new one; convert them first (MindSpeed-LLM's "
        "convert_ckpt.py with the new split), or save with --ckpt-format torch_dist"
    )


# -- MindSpeed's own recompute flags ---------------------------------------------------------------


def _no_own_recompute(
    last: dict[str, Occurrence], wanted: list[tuple[str, list[str]]], removed_flags: list[str], notes: list[str]
) -> None:
    """A plan without selective recompute: MindSpeed's activation-function and norm recompute go."""
    removed_flags.extend(OWN_RECOMPUTE)
    present = [flag for flag in OWN_RECOMPUTE if flag in last]
    if present:
        what = "whole layers and nothing else" if GRANULARITY in dict(wanted) else "nothing"
        notes.append(f"{', '.join(present)} taken out: the plan recomputes {what}")


def _recompute_switches(
    reading: Reading,
    last: dict[str, Occurrence],
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    notes: list[str],
) -> None:
    """--swap-attention out under full recompute (MindSpeed skips the full recompute beside it);
    --enable-recompute-layers-per-pp-rank out (the counts written are per virtual stage)."""
    if PER_PP_RANK in last:
        removed_flags.append(PER_PP_RANK)
        notes.append(
            f"{PER_PP_RANK} ({where(reading, last[PER_PP_RANK])}) taken out: it makes --recompute-num-layers a "
            "count per rank, and the plan's is per virtual stage"
        )
    if SWAP_ATTENTION in last:
        if dict(wanted).get(GRANULARITY) == ["full"]:
            removed_flags.extend([SWAP_ATTENTION, SWAP_MODULES])
            notes.append(
                f"{SWAP_ATTENTION} ({where(reading, last[SWAP_ATTENTION])}) taken out: MindSpeed skips the full "
                "recompute written beside it, and the plan recomputes whole layers"
            )
        else:
            notes.append(
                f"{SWAP_ATTENTION} kept: it moves attention activations to host memory, which the plan did not "
                "measure (its memory is below the plan's, its time may be above)"
            )


def _selective(
    last: dict[str, Occurrence],
    cells: list[list[str]],
    dialect: Dialect,
    wanted: list[tuple[str, list[str]]],
    removed_flags: list[str],
    notes: list[str],
) -> str:
    """The profiled selective recompute (norms and activations redone) as MindSpeed's flags, not Megatron's
    --recompute-modules (which MindSpeed refuses beside --recompute-norm)."""
    wanted[:] = [(flag, values) for flag, values in wanted if flag not in MEGATRON_RECOMPUTE]
    removed_flags.extend(MEGATRON_RECOMPUTE)
    counts = [sum(1 for mode in cell if mode == SELECTIVE) for cell in cells]
    every = all(mode == SELECTIVE for cell in cells for mode in cell)
    norm = USE_MCORE in last or dialect.version == MASTER  # MindSpeed recomputes norms of mcore models only
    pairs = [(RECOMPUTE_ACTIVATION_FUNCTION, RECOMPUTE_ACTIVATION_LAYERS)] + [
        (RECOMPUTE_NORM, RECOMPUTE_NORM_LAYERS)
    ] * norm
    for switch, count in pairs:
        wanted.append((switch, []))
        if every:
            removed_flags.append(count)
        else:
            wanted.append((count, [str(max(counts))]))
    if not norm:
        removed_flags.extend([RECOMPUTE_NORM, RECOMPUTE_NORM_LAYERS])
    said = " and ".join(switch for switch, _ in pairs)
    notes.append(
        f"the plan's selective recompute written as {said}"
        + ("" if every else f" of the first {max(counts)} layers of each virtual stage")
    )
    parts = []
    if not norm:
        parts.append(f"MindSpeed recomputes norms only with {USE_MCORE}: the norms keep their activations")
    if not every and len(set(counts)) > 1:
        parts.append(f"MindSpeed recomputes the same number of layers on every stage; the plan varies it ({counts})")
    return "; ".join(parts)
