"""TorchTitan configs: the TOML configs of every version up to v0.2.2 (`toml_config`) and the Python
configs of `config_registry.py` since 2026-02 (`python_config`), each under the key names of its
version (`dialects`). What both write: the pipeline degree and schedule, the micro-batch count
(as a count or as the size each micro-batch takes out of the local batch), the modules of every model
part (or, before 2025-07, the split points) and the activation checkpointing.

TorchTitan names a Llama's modules `tok_embeddings`, `layers.<i>`, `norm` and `output` (`lm_head` since
2026-04); the head is the first, the tail the last two. It checkpoints every block the same way, except
`selective_ac_option = "k"` (every k-th block of a rank fully checkpointed): a plan of that shape is
written exactly; any other plan that varies recompute by layer gets the heaviest mode it uses for every
block, and a side file with the exact plan for `sapp_hook.apply`. A plan that recomputes under a
schedule that splits the backward is refused (`sapp_hook.pipelining.engine_rules`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import tomlkit

from sapp_hook.pipelining.engine_rules import check_no_recompute, check_torch_runs
from sapp_hook.writeback.files import WriteBack, read_config
from sapp_hook.writeback.layout import Layout, as_layout
from sapp_hook.writeback.torchtitan.plan_fields import module_names
from sapp_hook.writeback.torchtitan.python_config import write_python
from sapp_hook.writeback.torchtitan.toml_config import write_toml
from solver import Plan


def config_path(path: str | Path) -> tuple[Path, str | None]:
    """A TorchTitan config and the config function it names: `FILE.py:FUNCTION` names the function in
    a Python config (TorchTitan's `--config FUNCTION`); any other path names a file only."""
    text = str(path)
    file, colon, function = text.rpartition(":")
    if colon and file.endswith(".py") and function.isidentifier():
        return Path(file), function
    return Path(text), None


def torchtitan_module_names(plan: Plan | Layout | Mapping[str, object], head: str = "output") -> list[list[str]]:
    """The module names of every model part (virtual stage, in model order) for a plan (a Plan, a
    Layout or the plan JSON as read), in TorchTitan's Llama naming: `head` is the output projection's
    name, `output` in TOML-era TorchTitan, `lm_head` since 2026-04. What `module_fqns_per_model_part`
    (`pipeline_parallel_module_fqns_per_model_part` on current main) takes."""
    return module_names(as_layout(plan), head)


def write_torchtitan(path: Path, layout: Layout, *, dry_run: bool = False) -> WriteBack:
    """Write `layout` into a TorchTitan TOML config, or into the config function of a Python config
    (`FILE.py:FUNCTION`; the function may be left out where the file defines one)."""
    check_torch_runs(layout.schedule, "--plan", runner="TorchTitan")
    check_no_recompute(
        layout.schedule, layout.body_modes(), "--plan", runner="TorchTitan runs torch.distributed.pipelining: "
    )
    file, function = config_path(path)
    old = read_config(file)
    if file.suffix == ".py":
        return write_python(file, function, old, layout, dry_run=dry_run)
    return write_toml(file, old, layout, dry_run=dry_run)


def read_torchtitan_parts(path: Path) -> list[list[str]]:
    """module_fqns_per_model_part as written in a TOML config (for checking a write)."""
    return [list(part) for part in tomlkit.parse(read_config(path))["parallelism"]["module_fqns_per_model_part"]]
