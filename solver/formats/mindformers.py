"""MindFormers' plan keys: per chunk and rank, the offset from the even share and the recompute
counts, read and written; and the order of recompute modes inside a stage those counts imply."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from basics.errors import InputError, shown
from simulator import Schedule
from solver.vocabulary.profile import COMM, FULL, HEAD, NONE, SELECTIVE, SELECTIVE_COMM, TAIL, ModelProfile
from solver.vocabulary.spec import PipelineSpec

# the order MindFormers' per-rank counts imply within a virtual stage: full, select+comm, select or comm, none
MODE_ORDER = (FULL, SELECTIVE_COMM, SELECTIVE, COMM, NONE)
MINDFORMERS_KEYS = ("offset", "recompute", "select_recompute", "select_comm_recompute", "pp_interleave_num")


def ordered_modes(counts: Mapping[str, int]) -> list[str]:
    """One mode per layer, in MODE_ORDER."""
    return [mode for mode in MODE_ORDER for _ in range(counts.get(mode, 0))]


def mindformers_view(
    schedule: Schedule, layer_kinds: Sequence[str], layer_modes: Sequence[str], stage_layer_counts: Sequence[int]
) -> dict[str, object]:
    """MindFormers' keys: per chunk and rank, body layers held minus the even share
    floor(n / (ranks x chunks)), and the recompute counts (full layers count in all three)."""
    body = sum(1 for kind in layer_kinds if kind not in (HEAD, TAIL))
    share = body // schedule.num_virtual_stages
    starts = [0, *itertools.accumulate(stage_layer_counts)]
    keys: dict[str, list[list[int]]] = {key: [] for key in MINDFORMERS_KEYS[:4]}
    for chunk in range(schedule.chunks):
        rows: dict[str, list[int]] = {key: [] for key in keys}
        for stage in range(schedule.ranks):
            virtual = schedule.stage_index(stage, chunk)
            counts = dict.fromkeys(MODE_ORDER, 0)
            for index in range(starts[virtual], starts[virtual] + stage_layer_counts[virtual]):
                if layer_kinds[index] not in (HEAD, TAIL):
                    counts[layer_modes[index]] += 1
            full_or_both = counts[FULL] + counts[SELECTIVE_COMM]
            rows["offset"].append(sum(counts.values()) - share)
            rows["recompute"].append(counts[FULL])
            rows["select_recompute"].append(full_or_both + counts[SELECTIVE])
            rows["select_comm_recompute"].append(full_or_both + counts[COMM])
        for key in keys:
            keys[key].append(rows[key])
    flat = schedule.chunks == 1
    view: dict[str, object] = {key: value[0] if flat else value for key, value in keys.items()}
    view["pp_interleave_num"] = schedule.chunks
    return view


def mindformers_split(
    profile: ModelProfile, spec: PipelineSpec, keys: Mapping[str, object], notes: list[str] | None = None
) -> tuple[list[int], list[str]]:
    """The layers per virtual stage and each layer's recompute mode that MindFormers' keys (offset
    and the three recompute counts) state for `profile` under `spec`; in `notes`, each count above the
    layers its stage holds, which MindFormers lowers to them."""
    unknown = sorted(set(keys) - set(MINDFORMERS_KEYS))
    if unknown:
        raise InputError(unknown[0], f"unknown key; expected {', '.join(MINDFORMERS_KEYS)}")
    schedule = spec.pipeline_schedule
    ranks, chunks = schedule.ranks, schedule.chunks
    interleave = keys.get("pp_interleave_num", chunks)
    if interleave != chunks:
        raise InputError("pp_interleave_num", f"the plan has {shown(interleave)} chunks; the spec runs {chunks}")
    body = [i for i, layer in enumerate(profile.layers) if layer.is_body]
    share = len(body) // schedule.num_virtual_stages
    offset = _per_chunk_and_rank(keys.get("offset", 0), "offset", ranks, chunks, per_rank=None)
    body_counts = [[share + offset[c][s] for s in range(ranks)] for c in range(chunks)]
    for c in range(chunks):
        for s in range(ranks):
            if body_counts[c][s] < 0:
                raise InputError(f"offset[{c}][{s}]", f"leaves {body_counts[c][s]} layers (even share {share})")
    total = sum(map(sum, body_counts))
    if total != len(body):
        raise InputError("offset", f"gives {total} body layers; the profile has {len(body)} (even share {share} each)")
    full = _per_chunk_and_rank(keys.get("recompute", 0), "recompute", ranks, chunks, body_counts, notes)
    # Fully recomputed layers count in both select lists; a list not given holds just those.
    select = _per_chunk_and_rank(
        keys.get("select_recompute", full), "select_recompute", ranks, chunks, body_counts, notes
    )
    comm = _per_chunk_and_rank(
        keys.get("select_comm_recompute", full), "select_comm_recompute", ranks, chunks, body_counts, notes
    )

    counts = [0] * schedule.num_virtual_stages
    virtual_stage_modes: list[list[str]] = [[] for _ in range(schedule.num_virtual_stages)]
    for c in range(chunks):
        for s in range(ranks):
            where = f"[{c}][{s}]"
            held, f, sel, com = body_counts[c][s], full[c][s], select[c][s], comm[c][s]
            for key, value in (("select_recompute", sel), ("select_comm_recompute", com)):
                if value < f:
                    raise InputError(
                        f"{key}{where}", f"is {value}, below recompute ({f}): full recompute counts in it too"
                    )
            both = max(0, min(sel - f, com - f))
            modes = {FULL: f, SELECTIVE_COMM: both, SELECTIVE: sel - f - both, COMM: com - f - both}
            if sum(modes.values()) > held:
                raise InputError(
                    f"select_recompute{where}", f"recomputes {sum(modes.values())} layers of a stage holding {held}"
                )
            modes[NONE] = held - sum(modes.values())
            virtual = schedule.stage_index(s, c)
            counts[virtual] = held
            virtual_stage_modes[virtual] = ordered_modes(modes)
    layer_modes = [NONE] * len(profile.layers)
    position = 0
    for virtual in range(schedule.num_virtual_stages):
        for mode in virtual_stage_modes[virtual]:
            index = body[position]
            if mode not in profile.layers[index].recompute:
                raise InputError(
                    "recompute",
                    f"asks for {mode} recompute of {profile.layers[index].name}, which the profile does not offer",
                )
            layer_modes[index] = mode
            position += 1
    heads = sum(1 for layer in profile.layers if layer.kind == HEAD)
    tails = sum(1 for layer in profile.layers if layer.kind == TAIL)
    counts[0] += heads
    counts[-1] += tails
    return counts, layer_modes


def _per_chunk_and_rank(
    value: object,
    key: str,
    ranks: int,
    chunks: int,
    per_rank: list[list[int]] | None,
    notes: list[str] | None = None,
) -> list[list[int]]:
    """MindFormers' forms, as its LayerSetting reads them: a bool (true: every layer of each stage), 0, a list
    per stage, or a list per chunk of lists. Offsets (`per_rank` None) in a list per stage hold for every
    chunk; recompute counts (`per_rank` the layers each chunk and stage holds) in a list per stage are
    handed out over the chunks one layer at a time, and every count is capped at the layers held."""
    if isinstance(value, bool):
        if per_rank is None:
            raise InputError(key, f"expected integers, got {shown(value)}")
        return [[held if value else 0 for held in row] for row in per_rank]
    if value == 0 and not isinstance(value, list):
        return [[0] * ranks for _ in range(chunks)]
    if isinstance(value, list) and len(value) == ranks and all(not isinstance(item, list) for item in value):
        row = [_count(item, f"{key}[{s}]", per_rank, None) for s, item in enumerate(value)]
        return [list(row) for _ in range(chunks)] if per_rank is None else _spread(row, per_rank, key, notes)
    if (
        not isinstance(value, list)
        or len(value) != chunks
        or any(not isinstance(row, list) or len(row) != ranks for row in value)
    ):
        raise InputError(
            key, f"expected {ranks} integers (one per rank) or {chunks} list(s) of them, got {shown(value)}"
        )
    return [
        [
            _count(item, f"{key}[{c}][{s}]", per_rank, None if per_rank is None else per_rank[c][s], notes)
            for s, item in enumerate(row)
        ]
        for c, row in enumerate(value)
    ]


def _count(
    item: object, where: str, per_rank: list[list[int]] | None, held: int | None, notes: list[str] | None = None
) -> int:
    """One offset, or one recompute count (a bool: all or none of the `held` layers; None: of the stage's)."""
    if isinstance(item, bool) and per_rank is not None:
        return (held if held is not None else _ALL) if item else 0
    if isinstance(item, bool) or not isinstance(item, int) or (per_rank is not None and item < 0):
        raise InputError(where, f"expected an integer{' >= 0' if per_rank else ''}, got {shown(item)}")
    if abs(item) > _ALL:  # beyond any layer count: what counts and offsets add up to stays printable
        raise InputError(where, f"expected an integer between {-_ALL:,} and {_ALL:,}, got {shown(item)}")
    if held is not None and item > held and notes is not None:
        notes.append(_capped(where, item, held))
    return item if held is None else min(item, held)


def _capped(where: str, count: int, held: int) -> str:
    return f"{where} is {count}, above the {held} layers that stage holds: MindFormers recomputes {held}"


_ALL = 2**31 - 1  # MindFormers' count for `True` in a list per stage: every layer the stage holds


def _spread(counts: list[int], held: list[list[int]], key: str, notes: list[str] | None) -> list[list[int]]:
    """MindFormers' LayerSetting._alloc_recompute_layer: each stage's count, at most the layers it holds,
    handed out over its chunks one layer at a time."""
    rows = [[0] * len(counts) for _ in held]
    for stage, count in enumerate(counts):
        left = min(count, sum(row[stage] for row in held))
        if count > left and count != _ALL and notes is not None:  # _ALL: `true`, every layer it holds
            notes.append(_capped(f"{key}[{stage}]", count, left))
        while left:
            for chunk, row in enumerate(rows):
                if left and row[stage] < held[chunk][stage]:
                    row[stage] += 1
                    left -= 1
    return rows


# Where a MindFormers training config keeps each plan key, besides the top level: the classic format's
# place first (where its writer puts it), then llm_template_v2's.
MINDFORMERS_PLACES = {
    "offset": (
        ("model", "model_config", "offset"),
        ("distribute_parallel_config", "pipeline_parallel_config", "pipeline_stage_offset"),
    ),
    "pp_interleave_num": (
        ("model", "model_config", "pp_interleave_num"),
        ("distribute_parallel_config", "pipeline_parallel_config", "virtual_pipeline_model_parallel_size"),
    ),
    "recompute": (("recompute_config", "recompute"),),
    "select_recompute": (("recompute_config", "select_recompute"),),
    "select_comm_recompute": (("recompute_config", "select_comm_recompute"),),
}


def mindformers_keys(document: object, what: str) -> dict[str, object]:
    """The plan keys of a flat mapping or of a MindFormers training config."""
    if not isinstance(document, Mapping):
        raise InputError(what, f"expected a mapping of MindFormers keys, got {type(document).__name__}")
    keys: dict[str, object] = {}
    for key, places in MINDFORMERS_PLACES.items():
        if key in document:
            keys[key] = document[key]
            continue
        for place in places:
            node: object = document
            for part in place:
                node = node.get(part) if isinstance(node, Mapping) else None
            if node is not None:
                keys[key] = node
                break
    if "offset" not in keys and not any(k in keys for k in ("recompute", "select_recompute", "select_comm_recompute")):
        raise InputError(what, "found none of offset, recompute, select_recompute, select_comm_recompute")
    return _as_counts(keys, what)


def _ops(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, str) for item in value)


def _as_counts(keys: dict[str, object], what: str) -> dict[str, object]:
    """The recompute keys as counts, as MindFormers reads them: op patterns recompute every layer, a
    mapping of ops one count (the plan has one selective mode), and a select key saying less than
    recompute says recompute's (MindFormers selects nothing in a fully recomputed layer)."""
    if _ops(keys.get("recompute")):
        keys["recompute"] = True
    full = keys.get("recompute")
    for key in ("select_recompute", "select_comm_recompute"):
        value = keys.get(key)
        if isinstance(value, Mapping):
            values = [True if _ops(item) else item for item in value.values()]
            if any(item != values[0] for item in values):
                raise InputError(
                    what,
                    f"{key} gives its ops different counts ({value}); a plan has one "
                    "selective mode: expected the same count for every op",
                )
            value = values[0] if values else False
        value = True if _ops(value) else value
        if key not in keys:
            continue
        if value is False or value is None or full is True:
            del keys[key]  # a plan's select counts default to its full ones
        else:
            keys[key] = _at_least(value, full)
    return keys


def _at_least(value: object, floor: object) -> object:
    """`value`, each count raised to `floor`'s where both are lists of the same shape."""
    if isinstance(value, list) and isinstance(floor, list) and len(value) == len(floor):
        return [_at_least(item, limit) for item, limit in zip(value, floor)]
    if (
        isinstance(value, int)
        and isinstance(floor, int)
        and not isinstance(value, bool)
        and not isinstance(floor, bool)
    ):
        return max(value, floor)
    return value
