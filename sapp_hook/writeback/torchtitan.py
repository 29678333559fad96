"""TorchTitan TOML: the module names of every model part, the schedule, the micro-batch size that makes
the plan's micro-batch count and the activation-checkpoint mode.

TorchTitan names a Llama's modules `tok_embeddings`, `layers.<i>`, `norm` and `output`; the head is the
first, the tail the last two. It checkpoints every block the same way: a plan that varies recompute by
layer gets the heaviest mode it uses, and a side file with the exact plan for `sapp_hook.apply`; a
plan that recomputes under a schedule that splits the backward is refused (`sapp_hook.torch_engine`).
TorchTitan's newer Python configs (Trainer.Config) are code: a `.py` config gets one error saying what
to set there, with `torchtitan_module_names` for the split.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from sapp_hook.torch_engine import check_no_recompute, check_torch_runs
from sapp_hook.writeback.files import WriteBack, commit, read_config, write_side_file
from sapp_hook.writeback.layout import Layout, as_layout
from simulator.errors import InputError
from solver import Plan
from solver.profile import FULL, NONE, SELECTIVE

HEAD_MODULES, TAIL_MODULES = ["tok_embeddings"], ["norm", "output"]
# Other ways of saying the split, which module_fqns_per_model_part replaces.
SPLIT_KEYS = ("pipeline_parallel_layers_per_stage", "pipeline_parallel_first_stage_less_layers",
              "pipeline_parallel_last_stage_less_layers")


def torchtitan_module_names(plan: Plan | Layout | Mapping[str, object]) -> list[list[str]]:
    """The module names of every model part (virtual stage, in model order) for a plan (a Plan, a
    Layout or the plan JSON as read), in TorchTitan's Llama naming: what
    `pipeline_parallel_module_fqns_per_model_part` takes in a TorchTitan Python config (Trainer.Config),
    which is code sapp-hook does not rewrite."""
    return module_names(as_layout(plan))


def module_names(layout: Layout) -> list[list[str]]:
    parts, body = [], 0
    for cell in layout.virtual_stages():
        names: list[str] = []
        for layer in cell:
            if layer.kind == "head":
                names += HEAD_MODULES
            elif layer.kind == "tail":
                names += TAIL_MODULES
            else:
                names.append(f"layers.{body}")
                body += 1
        parts.append(names)
    return parts


def write_torchtitan(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    check_torch_runs(layout.schedule, "--plan", runner="TorchTitan")
    check_no_recompute(layout.schedule, layout.body_modes(), "--plan", runner="TorchTitan runs torch.distributed.pipelining: ")
    old = read_config(path)
    if path.suffix == ".py":
        raise InputError("--config", _python_config(path, layout))
    try:
        document = tomlkit.parse(old)
    except TOMLKitError as exc:
        raise InputError("--config", f"{path} is not valid TOML: {exc}") from None
    parallelism = document.get("parallelism")
    if not isinstance(parallelism, dict):
        raise InputError("--config", f"{path} has no [parallelism] table: is it a TorchTitan config?")
    degree = parallelism.get("pipeline_parallel_degree")
    if degree is not None and degree != layout.stages:
        raise InputError("--plan", f"is for {layout.stages} pipeline stages; {path} has pipeline_parallel_degree {degree}")
    result = WriteBack(path=path, diff="")
    parallelism["pipeline_parallel_degree"] = layout.stages
    parallelism["pipeline_parallel_schedule"] = layout.schedule
    _set_micro_batches(document, parallelism, layout, path)
    for key in SPLIT_KEYS:
        parallelism.pop(key, None)
    parallelism["module_fqns_per_model_part"] = module_names(layout)
    checkpoint = document.get("activation_checkpoint")
    if not isinstance(checkpoint, dict):
        checkpoint = document["activation_checkpoint"] = tomlkit.table()
    mode = layout.heaviest_mode()
    checkpoint["mode"] = {NONE: "none", SELECTIVE: "selective", FULL: "full"}.get(mode, "full")
    if mode == SELECTIVE:
        # per op, as the profile measured it; TorchTitan's default ("2") fully checkpoints every second block
        checkpoint["selective_ac_option"] = "op"
        result.notes.append(
            "TorchTitan's per-op selective checkpointing also recomputes every second matmul, whose output the "
            "profile's selective recompute keeps: less memory and more time than the plan's"
        )
    if len(layout.body_modes()) > 1:
        result.notes.append(
            f"TorchTitan checkpoints every block alike; the plan recomputes some layers only, so mode is "
            f"{checkpoint['mode']!r} for all (at least what the plan asks)"
        )
    commit(result, old, tomlkit.dumps(document), dry_run=dry_run)
    if result.notes:
        write_side_file(result, layout.plan_json(), dry_run=dry_run)
    return result


def _python_config(path: Path, layout: Layout) -> str:
    """What to set by hand in a TorchTitan Python config (TorchTitan dropped its TOML configs in 2026;
    its Python configs are code, and take no per-field overrides from the command line)."""
    checkpoint = {NONE: "None", SELECTIVE: "SelectiveAC.Config()"}.get(layout.heaviest_mode(), "FullAC.Config()")
    return (
        f"{path} is Python: sapp-hook rewrites TorchTitan's TOML configs; in a Python config (Trainer.Config) set "
        f"parallelism.pipeline_parallel_degree = {layout.stages}, pipeline_parallel_schedule = "
        f"{layout.schedule!r}, num_pp_microbatches = {layout.micro_batches}, "
        f"pipeline_parallel_module_fqns_per_model_part = sapp_hook.torchtitan_module_names(plan) (the plan JSON, "
        f"as `--target plan` or `solve --plan-out` writes it) and activation_checkpoint = {checkpoint} (one for "
        f"every block: the heaviest mode the plan uses)"
    )


def _set_micro_batches(document: dict, parallelism: dict, layout: Layout, path: Path) -> None:
    """TorchTitan's TOML configs say the micro-batch count as the size each micro-batch takes out of
    `training.local_batch_size` (and refuse keys they do not know: `num_pp_microbatches` is the Python
    configs' count, kept where a config already has it)."""
    if "num_pp_microbatches" in parallelism:
        parallelism["num_pp_microbatches"] = layout.micro_batches
        return
    training = document.get("training")
    local = training.get("local_batch_size") if isinstance(training, dict) else None
    if isinstance(local, bool) or not isinstance(local, int):
        raise InputError("--config", f"{path} has no training.local_batch_size, which TorchTitan splits into the plan's "
                                     f"{layout.micro_batches} micro-batches: set it to a multiple of {layout.micro_batches}")
    if local % layout.micro_batches:
        raise InputError("--plan", f"is for {layout.micro_batches} micro-batches; {path} has training.local_batch_size "
                                   f"{local}, which does not split into {layout.micro_batches}")
    parallelism["pipeline_parallel_microbatch_size"] = local // layout.micro_batches


def read_torchtitan_parts(path: Path) -> list[list[str]]:
    """module_fqns_per_model_part as written (for checking a write)."""
    return [list(part) for part in tomlkit.parse(read_config(path))["parallelism"]["module_fqns_per_model_part"]]
