"""Which names a TorchTitan version reads a pipeline plan under, told from a config and the TorchTitan
it runs on.

TorchTitan renamed its pipeline keys several times, and a key a version does not know is either refused
at launch or (2024's argparse loader, early dataclass loaders) silently ignored, so the plan would not
run. The names by version:

- 2024 (`torchtitan/config_manager.py`, argparse): the keys sit in `[experimental]`:
  `pipeline_parallel_split_points` (the first module of every stage but the first),
  `pipeline_parallel_microbatches` (a count), schedules first spelled `1f1b`, `gpipe`, `interleaved_1f1b`.
- 2025-01 to 2025-04: the same keys under `[parallelism]`; `training.batch_size`.
- 2025-04 (#1073) to 2025-07: `pipeline_parallel_microbatch_size` (the count is the local batch over it).
- 2025-07 (#1416) to v0.2.2 (2026-02, the last TOML configs): `module_fqns_per_model_part` (the modules
  of every model part) replaces the split points, which are then refused; `training.local_batch_size`.
- Python configs (`config_registry.py`, 2026-02 on): `ParallelismConfig(module_fqns_per_model_part=...,
  pipeline_parallel_microbatch_size=...)` and `ActivationCheckpointConfig(mode=...)`; the head module is
  `lm_head` from 2026-04 (#2937), `output` before (a config that says neither gets both names in its
  last part: TorchTitan passes over a listed name its model lacks); later `pipeline_parallel_module_fqns_per_model_part`,
  `num_pp_microbatches` (a count) and `FullAC.Config()` / `SelectiveAC.Config()` / `None` (#3674).

What decides, in order: the TorchTitan source the config runs on (a checkout above the config, or the
installed package), whose config classes list the fields (so a config written for an older TorchTitan
gets the names of the one it runs on); then the names the config already uses; then its other keys,
which date it. What was assumed is said in a note.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

SPLIT_POINTS = "pipeline_parallel_split_points"
FQNS = "module_fqns_per_model_part"
FQNS_PREFIXED = "pipeline_parallel_module_fqns_per_model_part"
CHUNK_NAMES = "module_names_per_model_chunk"  # #1416's first name for the FQN lists
SPLIT_KEYS = (FQNS_PREFIXED, FQNS, CHUNK_NAMES, SPLIT_POINTS)
MICRO_COUNT_2024 = "pipeline_parallel_microbatches"
MICRO_SIZE = "pipeline_parallel_microbatch_size"
MICRO_COUNT = "num_pp_microbatches"
MICRO_KEYS = (MICRO_COUNT, MICRO_SIZE, MICRO_COUNT_2024)
# Other ways of saying the split: a written module list replaces them (TorchTitan refuses a list beside
# pipeline_parallel_layers_per_stage; the less-layers weights only shape its own even split).
SHAPING_KEYS = (
    "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
)
LOWERCASE_SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved_1f1b"}
_CONFIG_CLASSES = {
    "Parallelism": "parallelism",
    "ParallelismConfig": "parallelism",
    "Training": "training",
    "TrainingConfig": "training",
    "ActivationCheckpoint": "activation_checkpoint",
    "ActivationCheckpointConfig": "activation_checkpoint",
    "Experimental": "experimental",
}
_HEAD_FILES = (
    "torchtitan/distributed/pipeline_parallel.py",
    "torchtitan/distributed/pipeline.py",
    "torchtitan/models/common/decoder.py",
    "torchtitan/models/llama3/model/model.py",
    "torchtitan/models/llama3/model.py",
    "torchtitan/models/llama/model.py",
    "torchtitan/parallelisms/pipeline_llama.py",
)
_LM_HEAD = re.compile(r"""self\.lm_head\s*=|["']norm["'],\s*["']lm_head["']""")
_OUTPUT = re.compile(r"""self\.output\s*=|["']norm["'],\s*["']output["']""")
_ARGPARSE_KEY = re.compile(r"""["']--(\w+)\.(\w+)["']""")
_DEGREES_2024 = (
    "data_parallel_degree",
    "data_parallel_shard_degree",
    "data_parallel_replicate_degree",
    "tensor_parallel_degree",
)
_SOURCE_LIMIT_BYTES = 4 << 20  # a config class file is tens of kB; anything larger is not one


@dataclass(frozen=True)
class Dialect:
    """The names one TorchTitan version reads a pipeline plan under."""

    table: str  # the TOML table of the pipeline keys
    split_key: str
    micro_key: str
    head: str  # the head module's name: "output" or "lm_head"
    batch_key: str = "local_batch_size"  # the training key a micro-batch size divides
    layer_checkpointing: bool = True  # selective_ac_option "k": every k-th block fully checkpointed
    lowercase_schedules: bool = False  # 2024's schedule spelling
    ac_classes: bool = False  # FullAC.Config() / SelectiveAC.Config() / None instead of mode strings
    assumed: tuple[str, ...] = ()  # what neither the config nor a TorchTitan source said, for a note

    @property
    def counts_micro_batches(self) -> bool:
        return self.micro_key != MICRO_SIZE


@dataclass(frozen=True)
class Source:
    """What the TorchTitan source a config runs on says: its config fields by section, its head's name."""

    where: Path
    fields: Mapping[str, frozenset[str]]
    head: str | None
    ac_classes: bool
    installed: bool = False  # the installed package, not a checkout above the config
    python_configs: bool = True  # has `torchtitan/trainer.py`, whose Trainer.Config Python configs build

    def knows(self, section: str, key: str) -> bool | None:
        """Whether `section.key` is a field there (None where that section was not found)."""
        names = self.fields.get(section)
        return None if names is None else key in names


def find_source(config: Path) -> Source | None:
    """The TorchTitan a config runs on: a checkout above it, else the installed package (not imported)."""
    for folder in config.resolve().parents:
        if (folder / "torchtitan" / "distributed").is_dir() or (folder / "torchtitan" / "config_manager.py").is_file():
            return read_source(folder)
    try:
        spec = importlib.util.find_spec("torchtitan")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    found = read_source(Path(spec.origin).parent.parent)
    return None if found is None else replace(found, installed=True)


def read_source(root: Path) -> Source | None:
    """The config fields and head name in the TorchTitan source under `root` (None where it has neither)."""
    fields: dict[str, set[str]] = {}
    package = root / "torchtitan"
    files = [package / "config_manager.py", *sorted((package / "config").rglob("*.py"))[:80]]
    for path in files:
        text = _read(path)
        if text is None:
            continue
        for section, key in _ARGPARSE_KEY.findall(text):
            fields.setdefault(section, set()).add(key)
        for section, names in _dataclass_fields(text).items():
            fields.setdefault(section, set()).update(names)
    head = None
    for name in _HEAD_FILES:
        text = _read(root / name) or ""
        if _LM_HEAD.search(text):
            head = "lm_head"
            break
        if _OUTPUT.search(text):
            head = "output"
            break
    ac_classes = "class FullAC" in (_read(package / "distributed" / "activation_checkpoint.py") or "")
    if not fields and head is None:
        return None
    return Source(
        where=root,
        fields={k: frozenset(v) for k, v in fields.items()},
        head=head,
        ac_classes=ac_classes,
        python_configs=(package / "trainer.py").is_file(),
    )


def _read(path: Path) -> str | None:
    try:
        if not path.is_file() or path.stat().st_size > _SOURCE_LIMIT_BYTES:
            return None
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _dataclass_fields(text: str) -> dict[str, set[str]]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in _CONFIG_CLASSES:
            names = {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
            found.setdefault(_CONFIG_CLASSES[node.name], set()).update(names)
    return found


def _first_known(source: Source | None, section: str, keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if source is not None and source.knows(section, key):
            return key
    return None


def toml_dialect(document: Mapping[str, object], source: Source | None) -> Dialect:
    """The names a TorchTitan TOML config is read under (every TOML-era TorchTitan names its head `output`)."""
    experimental = document.get("experimental")
    in_experimental = isinstance(experimental, Mapping) and any(
        str(key).startswith("pipeline_parallel_") for key in experimental
    )
    training = document.get("training")
    training = training if isinstance(training, Mapping) else {}
    # 2024: no [parallelism] yet; the degrees sat in [training], the pipeline keys in [experimental]
    in_2024 = "parallelism" not in document and any(key in training for key in _DEGREES_2024)
    table = "experimental" if in_experimental or in_2024 else "parallelism"
    keys = document.get(table)
    keys = keys if isinstance(keys, Mapping) else {}
    model = document.get("model")
    model = model if isinstance(model, Mapping) else {}
    assumed: list[str] = []
    split = _first_known(source, table, (FQNS, CHUNK_NAMES, SPLIT_POINTS)) or next(
        (key for key in SPLIT_KEYS if key in keys), None
    )
    micro = _first_known(source, table, MICRO_KEYS) or next((key for key in MICRO_KEYS if key in keys), None)
    if split is None:
        if table == "experimental" or micro == MICRO_COUNT_2024 or "batch_size" in training:
            split = SPLIT_POINTS  # before #1416 (2025-07): also before local_batch_size
        elif "hf_assets_path" in model or any(key in keys for key in SHAPING_KEYS[1:]):
            split = FQNS  # keys that came with or after #1416
        else:
            split = FQNS
            assumed.append(f"{FQNS} (TorchTitan from 2025-07 on; before, {SPLIT_POINTS})")
    if micro is None:
        micro = MICRO_COUNT_2024 if table == "experimental" else MICRO_SIZE
        if table != "experimental" and split == SPLIT_POINTS and "local_batch_size" not in training:
            assumed.append(f"{MICRO_SIZE} (TorchTitan from 2025-04 on; before, {MICRO_COUNT_2024})")
    batch_key = "batch_size" if "batch_size" in training and "local_batch_size" not in training else "local_batch_size"
    if (
        source is not None
        and source.knows("training", "local_batch_size") is False
        and source.knows("training", "batch_size")
    ):
        batch_key = "batch_size"
    schedule = str(keys.get("pipeline_parallel_schedule", ""))
    return Dialect(
        table=table,
        split_key=split,
        micro_key=micro,
        head="output",
        batch_key=batch_key,
        lowercase_schedules=schedule in LOWERCASE_SCHEDULES.values(),
        assumed=tuple(assumed),
    )


# What a Python config's own text says about its TorchTitan: names that came late, names that went early.
_PYTHON_NEW = (
    "num_pp_microbatches",
    FQNS_PREFIXED,
    "FullAC",
    "SelectiveAC",
    "MemoryBudgetAC",
    "num_tokens_per_microbatch_per_dp_rank",
)
_PYTHON_OLD = (MICRO_SIZE, "ActivationCheckpointConfig", "local_batch_size")


def python_dialect(tree: ast.Module, source: Source | None) -> Dialect:
    """The names a TorchTitan Python config (config_registry.py) is read under."""
    names = _names_in(tree)
    newer = any(name in names for name in _PYTHON_NEW)
    older = any(name in names for name in _PYTHON_OLD) and not newer
    assumed: list[str] = []
    split = _first_known(source, "parallelism", (FQNS_PREFIXED, FQNS)) or next(
        (key for key in (FQNS_PREFIXED, FQNS) if key in names), None
    )
    if split is None:
        split = FQNS if older else FQNS_PREFIXED
        if not older and not newer:
            assumed.append(f"{FQNS_PREFIXED} (TorchTitan main; before, {FQNS})")
    micro = _first_known(source, "parallelism", (MICRO_COUNT, MICRO_SIZE)) or next(
        (key for key in (MICRO_COUNT, MICRO_SIZE) if key in names), None
    )
    if micro is None:
        micro = MICRO_SIZE if older else MICRO_COUNT
        if not older and not newer:
            assumed.append(f"{MICRO_COUNT} (TorchTitan main; before, {MICRO_SIZE})")
    if source is not None and (source.ac_classes or "activation_checkpoint" in source.fields):
        ac_classes = source.ac_classes
    elif "FullAC" in names or "SelectiveAC" in names or "MemoryBudgetAC" in names:
        ac_classes = True
    else:
        ac_classes = not older and "ActivationCheckpointConfig" not in names
    known = None if source is None else source.knows("activation_checkpoint", "selective_ac_option")
    # ActivationCheckpointConfig keeps TOML-era TorchTitan's selective_ac_option (its configs set "2" and "op")
    layer_checkpointing = (not ac_classes or "selective_ac_option" in names) if known is None else known
    # the prefixed name came after `lm_head` (2026-04): a TorchTitan that takes it names its head so
    head = python_head(tree, source) or ("lm_head" if split == FQNS_PREFIXED else "")
    return Dialect(
        table="parallelism",
        split_key=split,
        micro_key=micro,
        head=head,
        layer_checkpointing=layer_checkpointing and not ac_classes,
        ac_classes=ac_classes,
        assumed=tuple(assumed),
    )


def python_head(tree: ast.Module, source: Source | None) -> str:
    """`lm_head` or `output`: as the TorchTitan source the config runs on names it, else as the config's
    own lists of module names do; "" where neither says."""
    if source is not None and source.head is not None:
        return source.head
    listed = {
        item.value
        for node in ast.walk(tree)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set))
        for item in node.elts
        if isinstance(item, ast.Constant) and isinstance(item.value, str)
    }
    if "lm_head" in listed:  # module names are listed: ["norm", "lm_head"], filter_fqns=["output"]
        return "lm_head"
    return "output" if "output" in listed else ""


def _names_in(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.split(".")[-1])
    return found
