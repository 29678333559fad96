"""What a TorchTitan config says for a plan, in any version: the modules of every model part, the split
points, the activation checkpointing, and notes for the degree and schedule a plan changes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from basics.errors import InputError, shown
from sapp_hook.writeback.degrees import CONTEXT, DATA, EXPERT, FSDP, TENSOR, Stated, check_degrees
from sapp_hook.writeback.errors import PlanMismatch
from sapp_hook.writeback.files import WriteBack
from sapp_hook.writeback.layout import Layout
from sapp_hook.writeback.torchtitan.dialects import Dialect
from sapp_hook.writeback.torchtitan.models import EVERY_PART, FIRST_PART
from simulator.schedule import stage_to_rank
from simulator.schedules import schedule_kind
from solver.vocabulary.profile import FULL, NONE, SELECTIVE

HEAD_MODULES = ["tok_embeddings"]
NORM = "norm"
MODE_NAMES = {NONE: "none", SELECTIVE: "selective", FULL: "full"}
# TorchTitan models registered without a pipelining function, where they are: TorchTitan refuses a
# pipeline degree above 1 for them ("Pipeline Parallel is enabled but ... does not support pipelining")
NO_PIPELINE = {
    "flux": "torchtitan/models/flux, experiments/flux before",
    "llama3-siglip2": "torchtitan/experiments/vlm",
}
# The degrees a config states, by key (data_parallel_shard_degree: the ranks FSDP shards each layer over)
DEGREE_KEYS = {
    "tensor_parallel_degree": TENSOR,
    "context_parallel_degree": CONTEXT,
    "expert_parallel_degree": EXPERT,
    "data_parallel_shard_degree": FSDP,
}
REPLICATE = "data_parallel_replicate_degree"


def module_names(layout: Layout, head: str | tuple[str, ...], model: str | None = None) -> list[list[str]]:
    """Every model part's modules; `head` the output projection's name (or names: TorchTitan keeps the
    modules a part names and passes over names its model lacks); `model` the TorchTitan model's name,
    for the modules its first part (FIRST_PART) and its every part (EVERY_PART) list."""
    heads = (head,) if isinstance(head, str) else head
    parts, body = [], 0
    for cell in layout.virtual_stages():
        names: list[str] = []
        for layer in cell:
            if layer.kind == "head":
                names += HEAD_MODULES
            elif layer.kind == "tail":
                names += [NORM, *heads]
            else:
                names.append(f"layers.{body}")
                body += 1
        parts.append(names + list(EVERY_PART.get(model or "", ())))
    # a list in the config is taken as written: the vision tower is in it or in no part
    parts[0][:0] = FIRST_PART.get(model or "", ())
    return parts


def check_pipelines(model: object, where: str) -> None:
    """One InputError where the TorchTitan model the config trains has no pipeline parallelism."""
    if isinstance(model, str) and model in NO_PIPELINE:
        raise InputError(
            "--config",
            f"{where} trains TorchTitan's {model!r} model ({NO_PIPELINE[model]}), which TorchTitan "
            "registers without a pipelining function: it refuses any pipeline_parallel_degree above 1, "
            "so no pipeline plan runs there",
        )


def split_points(layout: Layout, key: str) -> list[str]:
    """The first block of every virtual stage but the first: TorchTitan's split points before 2025-07,
    which cannot say a later virtual stage without blocks."""
    points = []
    for index, names in enumerate(module_names(layout, "output")[1:], start=1):
        blocks = [name for name in names if name.startswith("layers.")]
        if not blocks:
            raise PlanMismatch(
                f"gives virtual stage {index} no decoder layer; this TorchTitan splits the model at "
                f"decoder layers ({key}) and cannot say that",
            )
        points.append(blocks[0])
    return points


@dataclass(frozen=True)
class Checkpointing:
    """The activation checkpointing a config gets for a plan."""

    mode: str  # "none", "selective" or "full"
    option: str | None  # selective_ac_option: "k" (every k-th block of a rank) or "op" (per op)
    exact: bool  # whether TorchTitan runs the plan's per-layer choice as planned
    notes: tuple[str, ...] = ()


def checkpointing(layout: Layout, dialect: Dialect) -> Checkpointing:
    """The plan's recompute as TorchTitan can say it: exactly where it can, else the heaviest mode the
    plan uses, for every block."""
    modes = layout.body_modes()
    if modes <= {NONE} or modes == {FULL}:
        return Checkpointing(MODE_NAMES[modes.pop() if modes else NONE], None, True)
    if modes == {NONE, FULL} and dialect.layer_checkpointing:
        every = every_kth_block(layout)
        if every is not None:
            return Checkpointing("selective", str(every), True)
    mode = layout.heaviest_mode()
    notes = []
    if mode == SELECTIVE:
        # per op, as the profile measured it; TorchTitan's TOML default ("2") fully checkpoints every second block
        notes.append(
            "TorchTitan's per-op selective checkpointing also recomputes every second matmul, whose output "
            "the profile's selective recompute keeps: less memory and more time than the plan's"
        )
    if len(modes) > 1:
        notes.append(
            f"TorchTitan checkpoints every block alike; the plan recomputes some layers only, so mode is "
            f"{MODE_NAMES[mode]!r} for all (at least what the plan asks)"
        )
    return Checkpointing(MODE_NAMES[mode], "op" if mode == SELECTIVE else None, False, tuple(notes))


def every_kth_block(layout: Layout) -> int | None:
    """k where the plan fully recomputes exactly every k-th block of each rank (counted in model order
    over the rank's virtual stages, from 1) and nothing else: what TorchTitan's `selective_ac_option = "k"`
    does, one counter per process over the blocks it wraps."""
    placement = schedule_kind(layout.schedule).placement
    ranks: list[list[str]] = [[] for _ in range(layout.pipeline_parallel)]
    for virtual, cell in enumerate(layout.virtual_stages()):
        ranks[stage_to_rank(virtual, layout.pipeline_parallel, placement)] += [
            layer.recompute for layer in cell if layer.is_body
        ]
    for every in range(2, max(len(modes) for modes in ranks) + 1):
        if all(
            mode == (FULL if index % every == 0 else NONE) for modes in ranks for index, mode in enumerate(modes, 1)
        ):
            return every
    return None


def check_degree(value: object, where: str) -> int | None:
    """The pipeline degree a config states (None where it states none); one InputError where it is not
    a whole number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = f"the string {shown(value)}" if isinstance(value, str) else f"{type(value).__name__} {shown(value)}"
        raise InputError("--config", f"{where} is {kind}; TorchTitan expects a whole number of pipeline ranks")
    return value


def change_notes(result: WriteBack, where: str, degree: int | None, schedule: object, layout: Layout) -> None:
    """Notes for a pipeline degree or schedule the plan changes (`degree` None: the config leaves it at
    TorchTitan's default, 1)."""
    if degree != layout.pipeline_parallel:
        was = (
            "not set (TorchTitan's default: 1, no pipeline parallelism)"
            if degree is None
            else "1 (no pipeline parallelism)"
            if degree == 1
            else shown(degree)
        )
        result.notes.append(
            f"{where}.pipeline_parallel_degree was {was}; set to the plan's {layout.pipeline_parallel}: the job "
            f"runs {layout.pipeline_parallel} pipeline ranks for every rank of its other degrees (check "
            f"data_parallel_shard_degree and the launcher's rank count)"
        )
    if schedule is not None and str(schedule).lower() != layout.schedule.lower():
        result.notes.append(
            f"{where}.pipeline_parallel_schedule was {schedule!r}; set to the plan's {layout.schedule!r}"
        )


def check_stated_degrees(
    values: Mapping[str, object], section: str, layout: Layout, where: str, notes: list[str]
) -> None:
    """The degrees `values` (the `section` table's keys, as Python values) state against the plan's: a
    whole number >= 1 states one (data_parallel_shard_degree -1 is the ranks left at launch: none); the
    data-parallel size is replicate x shard where the shard degree is stated (replicate's default is 1)."""

    def whole(key: str) -> int | None:
        value = values.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    stated = [Stated(degree, f"{section}.{key}", value) for key, degree in DEGREE_KEYS.items() if (value := whole(key))]
    shard, replicate = whole("data_parallel_shard_degree"), whole(REPLICATE) if REPLICATE in values else 1
    if shard and replicate:
        named = f"{REPLICATE} x data_parallel_shard_degree" if REPLICATE in values else "data_parallel_shard_degree"
        stated.append(Stated(DATA, f"{section}.{named}", replicate * shard))
    check_degrees(stated, layout.spec, where, notes)
