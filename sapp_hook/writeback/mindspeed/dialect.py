"""Whether a Megatron-style launch script is MindSpeed-LLM's (the launcher Ascend NPU users train with, on
torch_npu), and which MindSpeed-LLM it runs: that decides how an uneven split is said.

Recognised from flags only MindSpeed-LLM reads (`--num-layer-list`, `--noop-layers`, `--schedules-method`,
its recompute flags, ...) or a `mindspeed_llm.` module in the launch command. The version, from the first
that says it: the script's own split flags (`--pipeline-model-parallel-layout`: master; `--pipeline-num-
transformer-layers`: 2.x), then a MindSpeed-LLM source tree holding the script (its version and whether
it registers the layout flag); else 2.x, the current releases, said in a note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from basics.errors import InputError
from sapp_hook.writeback.megatron.flags import (
    LAYOUT,
    MINDSPEED_FLAGS,
    NOOP_LAYERS,
    PIPELINE_NUM_LAYERS,
    Occurrence,
    value_of,
)
from sapp_hook.writeback.text.provenance import Reading, text_of

# Flags Megatron-LM does not have (--use-mcore-models, --ckpt-format and --load are Megatron's too)
MARKERS = tuple(flag for flag in MINDSPEED_FLAGS if flag not in ("--use-mcore-models", "--ckpt-format", "--load"))
MASTER, RELEASE, FIRST_RELEASE = "master", "2.x", "1.0"
SAID = {
    MASTER: "MindSpeed-LLM master (mid-2026 on), which reads --pipeline-model-parallel-layout",
    RELEASE: "MindSpeed-LLM 2.x, which reads --pipeline-num-transformer-layers and no layout",
    FIRST_RELEASE: "MindSpeed-LLM 1.0 (Megatron core_r0.6.0), which splits virtual stages only evenly",
}
TREE_DEPTH = 6  # folders above the script searched for a MindSpeed-LLM source tree


@dataclass(frozen=True)
class Dialect:
    """A MindSpeed-LLM script: `version` (MASTER, RELEASE or FIRST_RELEASE), `why` (what said it, for the
    note), `noop` (its --noop-layers ids, sorted; () where none), `markers` (the MindSpeed flags seen)."""

    version: str
    why: str
    noop: tuple[int, ...]
    markers: tuple[str, ...]

    def note(self) -> str:
        return f"{', '.join(self.markers)}: a MindSpeed-LLM script; written for {SAID[self.version]} ({self.why})"


def mindspeed_dialect(
    reading: Reading, last: dict[str, Occurrence], launchers: list[int], path: Path
) -> Dialect | None:
    """The MindSpeed-LLM dialect of the script, None for a Megatron-LM one."""
    words = [text_of(field) or "" for index in launchers for field in reading.commands[index].argv]
    markers = [flag for flag in MARKERS if flag in last]
    markers += ["mindspeed_llm"] * (not markers and any(word.startswith("mindspeed_llm.") for word in words))
    if not markers:
        return None
    version, why = _version(last, path)
    return Dialect(version, why, _noop(reading, last, path), tuple(markers))


def _noop(reading: Reading, last: dict[str, Occurrence], path: Path) -> tuple[int, ...]:
    if NOOP_LAYERS not in last:
        return ()
    value = value_of(reading, last[NOOP_LAYERS])
    text = value.text
    if text is None or not re.fullmatch(r"\d+(,\d+)*", text) or value.environment or value.branches:
        raise InputError(
            "--config",
            f"{NOOP_LAYERS} is {text or 'known only at launch'} in {path}: sapp-hook needs its layer ids "
            "(comma-separated numbers) to place the plan's layers around them",
        )
    return tuple(sorted({int(part) for part in text.split(",")}))


def _version(last: dict[str, Occurrence], path: Path) -> tuple[str, str]:
    if LAYOUT in last:
        return MASTER, f"the script passes {LAYOUT}"
    if PIPELINE_NUM_LAYERS in last:
        return RELEASE, f"the script passes {PIPELINE_NUM_LAYERS}"
    tree = _source_tree(path)
    if tree is not None:
        return _tree_version(tree)
    return RELEASE, "assumed: no MindSpeed-LLM source tree holds the script and its flags do not say"


def _source_tree(path: Path) -> Path | None:
    """The MindSpeed-LLM checkout holding the script (its examples/ run from the root), if any."""
    for folder in path.resolve().parents[:TREE_DEPTH]:
        if (folder / "mindspeed_llm").is_dir() or (folder / "modellink").is_dir():
            return folder
    return None


def _tree_version(tree: Path) -> tuple[str, str]:
    package = tree / "mindspeed_llm"
    if not package.is_dir():
        return FIRST_RELEASE, f"{tree} holds modellink/, the package of MindSpeed-LLM 1.0 and before"
    declared = _declared_version(tree)
    for source in sorted(package.rglob("*.py")):
        try:
            text = source.read_text(encoding="utf-8", errors="replace")
            if LAYOUT in text or "pipeline_model_parallel_layout" in text:
                return MASTER, f"{source.relative_to(tree)} registers {LAYOUT}"
        except OSError:
            continue
    if declared is not None and declared.startswith("1."):
        return FIRST_RELEASE, f"{tree} is MindSpeed-LLM {declared}"
    return RELEASE, f"{tree} is MindSpeed-LLM {declared or '(no version)'}, with no {LAYOUT}"


def _declared_version(tree: Path) -> str | None:
    for name in ("setup.py", "pyproject.toml"):
        try:
            text = (tree / name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found = re.search(r"""version\s*=\s*["']([\w.]+)["']""", text)
        if found:
            return found.group(1)
    return None
