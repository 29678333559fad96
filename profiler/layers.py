"""Finding a model's body layers: the repeated blocks a pipeline splits between stages.

The head (embedding and whatever runs before the first block) and the tail (final norm, LM head, loss)
are not modules of their own: the recorder finds them by when they run relative to the blocks.
Multi-token-prediction (MTP) modules are blocks of kind `body:mtp`, after the decoder blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from basics.errors import InputError
from solver.vocabulary.profile import MTP_KIND


@dataclass(frozen=True)
class Block:
    """One body layer: a module the pipeline keeps whole. `kind` is the profile's `body:<type>`."""

    name: str
    module: nn.Module
    kind: str


def find_blocks(
    model: nn.Module,
    patterns: Sequence[str] | None = None,
    *,
    part: bool = False,
    mtp: Sequence[str] | None = (),
) -> tuple[Block, ...]:
    """The body layers of `model`: its decoder blocks in module order, then its MTP modules.

    With `patterns` (fnmatch on qualified module names, e.g. `model.layers.*`), the outermost modules
    that match. Otherwise the modules named in transformers' `_no_split_modules`, else the largest
    `ModuleList`/`Sequential` of two or more same-typed children. `part`: `model` is a pipeline rank's part
    of a model, which a plan may leave without blocks (its embedding or output layer alone): none is no error.
    `mtp`: module-name patterns (fnmatch) of the multi-token-prediction modules, blocks of kind `body:mtp`
    after the others (no decoder block is looked for inside them); None: the outermost modules whose own
    name starts with "mtp" (`mtp`, `model.mtp_layers`); (): none. A matched `ModuleList` stands for its
    children, one MTP depth each.
    """
    mtp_found = _mtp_modules(model, mtp, part)
    inside = {id(m) for _, module in mtp_found for m in module.modules()}
    if patterns:
        found = [] if part and not _any_matching(model, patterns) else _matching(model, patterns)
        found = [(name, module) for name, module in found if id(module) not in inside]
    else:
        found = _no_split_blocks(model, inside) or _largest_repeated_list(model, inside)
        if not found:
            raise InputError(
                "layers",
                "found no repeated blocks (no ModuleList of two or more modules of one type); "
                "name the blocks with module-name patterns such as 'model.layers.*'",
            )
    return _with_kinds(found) + tuple(Block(name=name, module=module, kind=MTP_KIND) for name, module in mtp_found)


def _mtp_modules(model: nn.Module, patterns: Sequence[str] | None, part: bool) -> list[tuple[str, nn.Module]]:
    """The MTP modules `find_blocks` takes for `patterns`, a matched ModuleList's children in its place."""
    if patterns is None:
        named = [
            (name, m) for name, m in model.named_modules() if name and name.rsplit(".", 1)[-1].lower().startswith("mtp")
        ]
        matched = _outermost(named)
    elif not patterns or (part and not _any_matching(model, patterns)):
        return []
    else:
        try:
            matched = _matching(model, patterns)
        except InputError as error:
            raise InputError("mtp_layers", error.detail) from None
    found = []
    for name, module in matched:
        if isinstance(module, nn.ModuleList):
            found.extend((f"{name}.{child}", sub) for child, sub in module.named_children())
        else:
            found.append((name, module))
    return found


def _any_matching(model: nn.Module, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, pattern) for name, _ in model.named_modules() if name for pattern in patterns)


def _matching(model: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    named = [(name, module) for name, module in model.named_modules() if name]
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name, _ in named):
            examples = ", ".join(name for name, _ in named[:6])
            raise InputError("layers", f"pattern {pattern!r} matches no module (module names look like: {examples})")
    return _outermost([(name, module) for name, module in named if any(fnmatchcase(name, p) for p in patterns)])


def _no_split_blocks(model: nn.Module, skipped: set[int]) -> list[tuple[str, nn.Module]]:
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        return []
    found = _outermost(
        [
            (name, m)
            for name, m in model.named_modules()
            if name and type(m).__name__ in classes and id(m) not in skipped
        ]
    )
    return found if len(found) >= 2 else []


def _largest_repeated_list(model: nn.Module, skipped: set[int]) -> list[tuple[str, nn.Module]]:
    """The longest ModuleList of one type, or run of one type inside a Sequential (which holds the
    embedding and the head around its blocks: `nn.Sequential(embed, *blocks, head)`)."""
    best: tuple[tuple[int, int], list[tuple[str, nn.Module]]] | None = None
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2 or id(container) in skipped:
            continue
        children = list(container.named_children())
        runs = [list(run) for _, run in itertools.groupby(children, key=lambda child: type(child[1]))]
        if isinstance(container, nn.ModuleList) and len(runs) != 1:
            continue
        prefix = f"{name}." if name else ""
        for run in runs:
            size = (len(run), sum(p.numel() for _, child in run for p in child.parameters()))
            if len(run) >= 2 and (best is None or size > best[0]):
                best = (size, [(prefix + child_name, child) for child_name, child in run])
    return best[1] if best else []


def _outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop modules nested inside another one of the list (a block's own sub-blocks)."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in named:  # named_modules order: parents before their children
        if not any(name.startswith(outer + ".") for outer, _ in kept):
            kept.append((name, module))
    return kept


def _with_kinds(found: list[tuple[str, nn.Module]]) -> tuple[Block, ...]:
    """Name each block's kind after its class; blocks of one class that differ inside (dense and MoE
    layers of one decoder class) get the class of what tells them apart as a suffix."""
    structures = {name: _structure(module) for name, module in found}
    by_class: dict[str, list[tuple[tuple[str, ...], ...]]] = {}
    for name, module in found:
        variants = by_class.setdefault(type(module).__name__, [])
        if structures[name] not in variants:
            variants.append(structures[name])
    blocks = []
    for name, module in found:
        cls = type(module).__name__
        variants = by_class[cls]
        kind = f"body:{cls}"
        if len(variants) > 1:
            kind += "/" + _distinguishing_class(structures[name], variants)
        blocks.append(Block(name=name, module=module, kind=kind))
    return tuple(blocks)


def _structure(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    """What a block is made of: each submodule's class and its parameters' shapes."""
    return tuple(
        (name, type(sub).__name__, *(f"{p}:{tuple(t.shape)}" for p, t in sub.named_parameters(recurse=False)))
        for name, sub in module.named_modules()
    )


def _distinguishing_class(structure: tuple[tuple[str, ...], ...], variants: list[tuple[tuple[str, ...], ...]]) -> str:
    """The class of the first submodule whose class differs from the same submodule in another variant."""
    others = [{entry[0]: entry[1] for entry in other} for other in variants if other != structure]
    for name, cls, *_ in structure[1:]:
        if any(other.get(name) != cls for other in others):
            return cls
    return f"variant{variants.index(structure)}"  # same classes, different shapes
