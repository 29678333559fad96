"""What a TorchTitan model asks of a pipeline plan beyond its decoder's modules, told from the config
alone: which model it trains (so that its own modules join the parts written), whether it trains
multi-token-prediction layers (which TorchTitan runs without pipeline parallelism), and which
TorchTitan source answered for the key names.

- Vision-language models (`qwen3_5`, `kimi_k2_5`): their pipelining functions add `vision_encoder` to
  the first part of module lists TorchTitan generates, and take a list in the config as written.
- The transformers backend (`transformers_backend`, renamed `transformers_modeling_backend`): its split
  lists the HF model's shared `rotary_emb` in every part.
- MTP (`n_mtp_layers`, `num_mtp_layers`, `num_mtp_modules`, `mtp_layers`, or `MTPLoss`): the model
  configs raise "MTP does not support pipeline parallelism yet" for a pipeline degree above 1.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping

from basics.errors import InputError
from sapp_hook.writeback.torchtitan.dialects import Dialect, Source
from sapp_hook.writeback.torchtitan.python_rules import dotted

# the modules a model's pipelining function puts before the embedding in the first part it generates
FIRST_PART = {"qwen3_5": ("vision_encoder",), "kimi_k2_5": ("vision_encoder",)}
# the modules every part lists: the transformers backend's rotary embedding, shared by all its layers
EVERY_PART = {"transformers_backend": ("rotary_emb",), "transformers_modeling_backend": ("rotary_emb",)}
MTP_FIELDS = ("n_mtp_layers", "num_mtp_layers", "num_mtp_modules", "mtp_layers")
_MODEL_PACKAGES = ("torchtitan.models.", "torchtitan.experiments.")


def model_from_imports(tree: ast.Module) -> str | None:
    """The model whose `model_registry` or config functions a config imports (`from
    torchtitan.models.kimi_k2_5 import model_registry`), None where it imports neither by an absolute name."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            registry = node.module.endswith(".config_registry")
            if registry or any(alias.name == "model_registry" for alias in node.names):
                for prefix in _MODEL_PACKAGES:
                    if node.module.startswith(prefix):
                        return node.module.removeprefix(prefix).split(".")[0]
    return None


def mtp_in_python(functions: Iterable[ast.FunctionDef]) -> str | None:
    """What in these config functions trains MTP layers (`n_mtp_layers=1 (line 41)`), None where nothing does."""
    for function in functions:
        constants = {
            node.targets[0].id: node.value.value
            for node in ast.walk(function)
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
        }
        for node in sorted(
            (node for node in ast.walk(function) if hasattr(node, "lineno")), key=lambda n: (n.lineno, n.col_offset)
        ):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg in MTP_FIELDS and _positive(kw.value, constants):
                        return f"{kw.arg}={ast.unparse(kw.value)} (line {kw.value.lineno})"
                # upstream's MTPLoss needs at least one MTP prediction; a count it is given is read above
                if (dotted(node.func) or "").endswith("MTPLoss.Config") and not any(
                    kw.arg in MTP_FIELDS for kw in node.keywords
                ):
                    return f"{ast.unparse(node.func)}(...) (line {node.lineno})"
            elif (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Attribute)
                and node.targets[0].attr in MTP_FIELDS
                and _positive(node.value, constants)
            ):
                return f"{ast.unparse(node.targets[0])} = {ast.unparse(node.value)} (line {node.lineno})"
    return None


def mtp_in_toml(document: Mapping[str, object]) -> str | None:
    """The `[training]` or `[model]` key that trains MTP layers (torchtitan-npu's `num_mtp_modules`)."""
    for table in ("training", "model"):
        section = document.get(table)
        if isinstance(section, Mapping):
            for key in MTP_FIELDS:
                value = section.get(key)
                if value and not isinstance(value, bool):
                    return f"{table}.{key} = {value}"
    return None


def _positive(node: ast.AST, constants: Mapping[str, object]) -> bool:
    value = constants.get(node.id) if isinstance(node, ast.Name) else getattr(node, "value", None)
    if isinstance(node, (ast.List, ast.Tuple)):
        return bool(node.elts)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_mtp(evidence: str | None, pipeline_parallel: int, where: str) -> None:
    """One InputError where a config that trains MTP layers would get a pipeline degree above 1."""
    if evidence is not None and pipeline_parallel > 1:
        raise InputError(
            "--config",
            f"{where} trains multi-token-prediction layers ({evidence}); TorchTitan refuses a "
            f'pipeline_parallel_degree above 1 beside them ("MTP does not support pipeline parallelism '
            f"yet\"), so the plan's {pipeline_parallel} pipeline ranks would stop the job at launch: plan "
            "with pipeline_parallel 1, or train without MTP",
        )


def source_notes(where: str, source: Source | None, dialect: Dialect) -> list[str]:
    """A note where the installed torchtitan package (not a checkout above the config) named the keys."""
    if source is None or not source.installed:
        return []
    return [
        (
            f"{where}: wrote {dialect.split_key} and {dialect.micro_key}, the names the installed torchtitan "
            f"({source.where / 'torchtitan'}, its config classes read, not imported) takes; a job launched with "
            "another TorchTitan may read other names: run apply where that one is installed"
        )
    ]


def python_source(source: Source | None, where: str) -> tuple[Source | None, list[str]]:
    """The source that answers for a Python config: not an installed package from before Python configs
    (no `torchtitan/trainer.py`), which the config cannot run on; a note where one is passed over."""
    if source is None or not source.installed or source.python_configs:
        return source, []
    return None, [
        (
            f"{where}: the installed torchtitan ({source.where / 'torchtitan'}) predates Python configs (it has "
            "no torchtitan/trainer.py), so it is not the TorchTitan this config runs on: the key names were "
            "taken from the config itself"
        )
    ]
