"""How MindFormers reads the values a plan sets (its LayerSetting: offsets, recompute bools, counts and op
patterns), the form sapp-hook writes a plan's in, and the checks both MindFormers formats share.

A value is rewritten only where MindFormers would read it otherwise than the plan says, and in the
config's own form where that form can say it: `recompute: True` stays for a plan that fully recomputes
every layer, a per-rank list stays one where the plan has one chunk, op patterns keep their ops."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from basics.errors import InputError, shown
from sapp_hook.writeback.degrees import Stated, check_degrees
from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.files import WriteBack
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.text.yaml_splice import MISSING, YamlEdit

# The orders MindSpore runs, as its pipeline_scheduler names them; with pipeline_interleave on, 1f1b
# runs the chunks interleaved.
SCHEDULERS = {
    "1F1B": "1f1b",
    "GPipe": "gpipe",
    "Interleaved1F1B": "1f1b",
    "Interleaved1F1B-less-memory": "1f1b",
    "ZBVZeroBubble": "zero_bubble_v",
}
# The plain orders, which sapp-hook sets to the plan's (with a note); any other a config names is the user's
# choice of an order the plan was not made for.
PLAIN_SCHEDULERS = ("1f1b", "gpipe")
OTHER_SCHEDULERS = {  # what each is, and what else the user may do than run the plan's
    "seqpipe": (
        (
            "MindSpore's sequence-pipeline order, which sapp-hook plans only without a sequence split "
            "(seq_split_num 1: 1F1B, or Interleaved1F1B on micro-batches a multiple of the pipeline ranks)"
        ),
        "",
    ),
    "seqvpp": (
        (
            "MindSpore's interleaved sequence-pipeline order, which sapp-hook plans only without a sequence split "
            "(seq_split_num 1: Interleaved1F1B on micro-batches a multiple of the pipeline ranks)"
        ),
        "",
    ),
    "seqsmartvpp": (
        (
            "MindSpore's small-memory interleaved sequence-pipeline order, which sapp-hook plans only "
            "without a sequence split (seq_split_num 1: 1F1B, or Interleaved1F1B-less-memory on micro-batches "
            "a multiple of the pipeline ranks)"
        ),
        "",
    ),
    "zero_bubble_v": ("the order of a ZBVZeroBubble plan", "solve with --schedule ZBVZeroBubble --chunks 2, or "),
}
# With seq_split_num 1 (MindFormers' default) MindSpore's sequence schedulers split no sequence and run known
# orders (mindspore/ccsrc/frontend/parallel/pipeline_transformer/seqpipe_scheduler.cc): forwards in groups
# ("cycles") of S micro-batches, each group through chunk 0, then chunk 1 ..., the M mod S leftovers spread
# over the groups; rank r runs (S-1-r) x bias + (V-1) x (first group) forwards first, then one forward and
# one backward (the earliest micro-batch's latest chunk). bias is 2 with chunks (1 for seqsmartvpp), so on M a
# multiple of S: one chunk is 1F1B, seqpipe and seqvpp are Megatron's interleaved order (warm-up
# 2(S-1-r) + (V-1)S), seqsmartvpp MindFormers' small-memory one ((V-1)S + S-1-r). seqvpp refuses one chunk.
SEQUENCE_ORDERS = {
    "seqpipe": ("1F1B", "Interleaved1F1B"),
    "seqvpp": ("Interleaved1F1B",),
    "seqsmartvpp": ("1F1B", "Interleaved1F1B-less-memory"),
}
DECODER_KEYS = ("num_layers", "num_hidden_layers")  # the legacy models' name, then mcore's and Hugging Face's
# The multi-token-prediction depth: research/deepseek3's classic key, mcore's, Hugging Face's (DeepSeek-V3).
# MindFormers spreads these layers with the decoder layers: LayerSetting(num_layers + depth, offset, ...).
MTP_KEYS = ("mtp_depth", "mtp_num_layers", "num_nextn_predict_layers")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def section(data: object, place: tuple[str, ...], path: Path, *, required: bool = False) -> Mapping:
    """The mapping at `place`, empty where it is missing (an error where `required`)."""
    node = data
    for depth, part in enumerate(place):
        node = node.get(part) if isinstance(node, Mapping) else None
        where = ".".join(place[: depth + 1])
        if node is None:
            if required:
                raise InputError("--config", f"{path} lacks the section {where}, where MindFormers keeps it")
            return {}
        if not isinstance(node, Mapping):
            kind = "a list" if isinstance(node, list) else f"the {type(node).__name__} {shown(node)}"
            raise InputError("--config", f"{path}: {where} is {kind}; expected a mapping")
    return node


def check_count(value: object, where: str, path: Path) -> None:
    """A count the config states (a pipeline size or layer count) is an integer, or not stated (None)."""
    if value is not None and not is_int(value):
        raise InputError("--config", f"{path}: {where} is {shown(value)}; expected an integer")


def note_pipeline_size(
    parallel: Mapping, where: str, sizes: tuple[str, str], layout: Layout, path: Path, result: WriteBack
) -> None:
    """A pipeline size other than the plan's is set to the plan's, with a note of the device count it
    then takes (MindFormers runs data x model x pipeline parallel devices; `sizes` the other two keys)."""
    value = parallel.get(where.rsplit(".", 1)[-1])
    if value is None or value == layout.pipeline_parallel:
        return
    if not is_int(value) or value < 1:
        raise InputError("--config", f"{path}: {where} is {shown(value)}; expected a whole number of pipeline ranks")
    others = [parallel.get(key) for key in sizes]
    devices = ""
    if all(is_int(size) and size > 0 for size in others):
        before, after = others[0] * others[1] * value, others[0] * others[1] * layout.pipeline_parallel
        keep = (
            before // (others[1] * layout.pipeline_parallel)
            if before % (others[1] * layout.pipeline_parallel) == 0
            else None
        )
        devices = (
            f": the job then takes {sizes[0]} x {sizes[1]} x {layout.pipeline_parallel} = {shown(after)} devices "
            f"(was {shown(before)})" + (f"; for {shown(before)} set {sizes[0]} to {shown(keep)}" if keep else "")
        )
    result.notes.append(
        f"{where} was {shown(value)}{' (no pipeline parallelism)' if value == 1 else ''}; set to the plan's "
        f"{layout.pipeline_parallel}{devices}"
    )


def check_stated_degrees(
    parallel: Mapping,
    where: str,
    keys: Mapping[str, str],
    layout: Layout,
    path: Path,
    result: WriteBack,
    *,
    also: Sequence[Stated] = (),
) -> None:
    """The degrees `parallel` (the section at `where`) states under `keys` (key -> degree), and `also`, against
    the plan's: a whole number >= 1 states one; anything else (null: from the device count) states none."""
    stated = [
        Stated(degree, f"{where}.{key}", parallel[key])
        for key, degree in keys.items()
        if is_int(parallel.get(key)) and parallel[key] >= 1
    ]
    check_degrees([*stated, *also], layout.spec, str(path), result.notes)


def check_layers(model: Mapping, where: str, layout: Layout, path: Path, result: WriteBack) -> None:
    """The decoder and multi-token-prediction layers the config declares are the plan's body layers
    (MindFormers spreads both by the offsets, the MTP layers last); where it declares none (mcore
    configs take them from pretrained_model_dir's config.json), a note says so."""
    for name in (*DECODER_KEYS, *MTP_KEYS):
        check_count(model.get(name), f"{where}.{name}", path)
    key = next((name for name in DECODER_KEYS if is_int(model.get(name))), None)
    mtp_key = next((name for name in MTP_KEYS if is_int(model.get(name)) and model.get(name)), None)
    mtp = model[mtp_key] if mtp_key else 0
    said = f" + {mtp_key} {shown(mtp)}" if mtp_key else ""
    if key is None:
        result.notes.append(
            f"{where} declares no {' or '.join(DECODER_KEYS)} (MindFormers then reads the model's "
            f"config.json in pretrained_model_dir): the plan places {layout.body_layers} layers, decoder "
            "and multi-token-prediction, which sapp-hook could not check against it"
        )
        return
    if model[key] + mtp != layout.body_layers:
        raise PlanMismatch(
            f"places {layout.body_layers} decoder layers; {path} has {where}.{key} {shown(model[key])}{said}"
        )
    body = [index for index, layer in enumerate(layout.layers) if layer.is_body]
    planned = [index for index in body if "mtp" in layout.layers[index].kind.lower()]
    if planned and (len(planned) != mtp or planned != body[-len(planned) :]):
        raise PlanMismatch(
            f"places {len(planned)} multi-token-prediction layers ({layout.layers[planned[0]].kind}); "
            f"{path} has {mtp} ({where}.{mtp_key or MTP_KEYS[0]}), which MindFormers places after "
            "the decoder layers",
        )


def check_scheduler(
    layout: Layout, configured: object, where: str, path: Path, result: WriteBack, seq_split: object = MISSING
) -> str:
    """The pipeline_scheduler MindSpore runs the plan's schedule under. A config naming another plain
    order gets the plan's, with a note; a sequence scheduler without a sequence split (`seq_split`, the
    config's seq_split_num) stays where it runs the plan's order; any other order (seqpipe splitting
    sequences, zero_bubble_v ...) is refused, as is a plan for an order MindSpore does not run."""
    wanted = SCHEDULERS.get(layout.schedule)
    if wanted is None:
        known = ", ".join(f"{name} ({scheduler})" for name, scheduler in SCHEDULERS.items())
        raise PlanMismatch(
            f"is for {layout.schedule}, an order MindFormers does not run (sapp-hook plans for "
            f"it {known}): solve with one of these",
        )
    if configured is MISSING or configured is None or configured == wanted:
        return wanted
    if configured in PLAIN_SCHEDULERS:
        result.notes.append(f"{where} {configured} -> {wanted}: the plan is for {layout.schedule}")
        return wanted
    unsplit = seq_split in (MISSING, None, 1)
    if configured in SEQUENCE_ORDERS and unsplit and _sequence_order_runs(configured, layout):
        result.notes.append(
            f"{where} {configured} kept: with seq_split_num {'unset (1)' if seq_split in (MISSING, None) else 1} "
            f"it splits no sequence and runs the plan's {layout.schedule} order"
        )
        return configured
    what, advice = (
        OTHER_SCHEDULERS.get(configured, ("which MindSpore does not know", ""))
        if isinstance(configured, str)
        else ("which is not a scheduler's name", "")
    )
    if configured in SEQUENCE_ORDERS and not unsplit:
        what = f"with seq_split_num {seq_split}, {what}"
    raise PlanMismatch(
        f"is for {layout.schedule} (pipeline_scheduler {wanted}); {path} has {where} {configured!r}, "
        f"{what}: {advice}set {where} to {wanted} to run this plan",
    )


def _sequence_order_runs(scheduler: str, layout: Layout) -> bool:
    """Whether a sequence scheduler without a sequence split runs the plan's order (SEQUENCE_ORDERS)."""
    if layout.schedule not in SEQUENCE_ORDERS[scheduler]:
        return False
    grouped = layout.micro_batches % layout.pipeline_parallel == 0 and layout.microbatch_group_size in (
        None,
        layout.pipeline_parallel,
    )
    return layout.chunks == 1 or grouped


def interleave_value(before: object, layout: Layout, scheduler: str, where: str, result: WriteBack) -> bool:
    """pipeline_interleave for the plan: on for chunks; kept on for a sequence scheduler (it runs in
    MindSpore's interleaved pipeline, one chunk too). A change is noted."""
    value = layout.chunks > 1 or (scheduler in SEQUENCE_ORDERS and before is True)
    if isinstance(before, bool) and before != value:
        result.notes.append(f"{where} {before} -> {value}: the plan has {layout.chunks} chunk(s) per rank")
    return value


def cells(value: object) -> list[list[int]]:
    """A MindFormers per-rank list, or list of lists per chunk, as lists per chunk."""
    return [list(row) for row in value] if value and isinstance(value[0], list) else [list(value)]


def _two_d(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(row, list) for row in value)


def read_offset(value: object, chunks: int, ranks: int) -> list[list[int]] | None:
    """Per chunk and rank, the offsets MindFormers takes from `value` (one int for all, a list per rank
    for every chunk, or a list per chunk), or None where it takes none of these."""
    if is_int(value):
        return [[value] * ranks for _ in range(chunks)]
    rows = value if _two_d(value) else [value] * chunks if isinstance(value, list) else None
    if rows is None or len(rows) != chunks or any(len(row) != ranks or not all(map(is_int, row)) for row in rows):
        return None
    return [list(row) for row in rows]


def read_counts(value: object, held: list[list[int]]) -> list[list[int]] | None:
    """Per chunk and rank, how many layers (the first ones of each) MindFormers recomputes for `value`:
    a bool for all or none, op patterns for all, a count per rank (MindFormers hands it out over the
    chunks one layer at a time, `_alloc_recompute_layer`), or a count per chunk and rank (a bool for
    the cell's all or none); None for anything else."""
    chunks, ranks = len(held), len(held[0])
    if isinstance(value, bool):
        return [list(row) if value else [0] * ranks for row in held]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return [list(row) for row in held]
    if isinstance(value, list) and len(value) == ranks and all(isinstance(item, int) for item in value):
        counts = [[0] * ranks for _ in range(chunks)]
        for rank, count in enumerate(value):
            left = (
                sum(row[rank] for row in held)
                if count is True
                else 0
                if count is False
                else min(count, sum(row[rank] for row in held))
            )
            while left > 0:
                for chunk in range(chunks):
                    if left and counts[chunk][rank] < held[chunk][rank]:
                        counts[chunk][rank] += 1
                        left -= 1
        return counts
    if _two_d(value) and len(value) == chunks and all(len(row) == ranks for row in value):
        return [
            [
                held[c][s]
                if item is True
                else 0
                if item is False
                else max(0, min(item, held[c][s]))
                if is_int(item)
                else -1
                for s, item in enumerate(row)
            ]
            for c, row in enumerate(value)
        ]
    return None


def offset_value(current: object, desired: list[list[int]], chunks: int) -> list:
    """The plan's offsets in the config's form: per chunk where there are chunks or the config has lists of lists."""
    return desired if chunks > 1 or _two_d(current) else desired[0]


def count_value(current: object, desired: list[list[int]], held: list[list[int]], chunks: int) -> object:
    """The plan's counts in the config's form: a bool where the config has one and the plan recomputes
    every layer or none, else per rank, or per chunk where there are chunks or the config has lists."""
    if isinstance(current, bool) and desired in (held, [[0] * len(row) for row in held]):
        return desired == held
    return desired if chunks > 1 or _two_d(current) else desired[0]


def set_offset(edit: YamlEdit, place: tuple[str, ...], layout: Layout) -> None:
    desired = cells(layout.mindformers["offset"])
    current = edit.get(place)
    if read_offset(current, layout.chunks, layout.pipeline_parallel) != desired:
        edit.set(place, offset_value(current, desired, layout.chunks))


def held_layers(layout: Layout) -> list[list[int]]:
    """Body layers per chunk and rank, as the plan's offsets say them."""
    share = layout.body_layers // layout.num_virtual_stages
    return [[share + offset for offset in row] for row in cells(layout.mindformers["offset"])]


def set_counts(edit: YamlEdit, place: tuple[str, ...], layout: Layout, result: WriteBack, *, op_dicts: bool) -> None:
    """One recompute key. A select key's count below the full recompute's says the same (MindFormers
    selects nothing in a fully recomputed layer). Op patterns keep their ops with the plan's counts: each
    pattern's where the format takes a mapping of them (`op_dicts`), else the counts alone (MindFormers'
    default ops)."""
    key, where = place[-1], ".".join(place)
    desired, held = cells(layout.mindformers[key]), held_layers(layout)
    floor = cells(layout.mindformers["recompute"]) if key != "recompute" else [[0] * len(row) for row in held]

    def says_plan(value: object) -> bool:
        counts = read_counts(False if value is None else value, held)
        return counts is not None and [[max(c, f) for c, f in zip(*rows)] for rows in zip(counts, floor)] == desired

    current = edit.get(place)
    if current is MISSING or says_plan(current):
        if current is MISSING and not says_plan(False):  # MindFormers' default recomputes nothing
            edit.set(place, count_value(None, desired, held, layout.chunks))
        return
    if isinstance(current, Mapping) and op_dicts:
        for pattern, value in current.items():
            if not says_plan(value):
                edit.set((*place, pattern), count_value(value, desired, held, layout.chunks))
        return
    patterns = isinstance(current, list) and current and all(isinstance(item, str) for item in current)
    value = count_value(current, desired, held, layout.chunks)
    if patterns and op_dicts:
        value = {pattern: value for pattern in current}
        result.notes.append(f"{where} names ops ({', '.join(current)}): each now has the plan's counts")
    elif patterns or isinstance(current, Mapping):
        result.notes.append(
            f"{where} named ops, which this format cannot give counts: the plan's counts replace them "
            "(MindFormers recomputes its default ops)"
        )
    edit.set(place, value)
