"""Under `torchrun`: every rank profiles the stages it holds; one rank gets the whole model's profile.

Profiles travel as JSON in byte tensors (no pickling), so this works over any backend, gloo included.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

from solver.vocabulary.profile import LayerProfile, ModelProfile

_NUMBERED = re.compile(r"(.*?)(\d+)")  # a block named by its index: `layers.3`


def gather_profiles(
    local: Sequence[tuple[int, ModelProfile]], *, dst: int = 0, group: dist.ProcessGroup | None = None
) -> ModelProfile | None:
    """Join every rank's `(stage index, profile of that stage's layers)` in stage order on rank `dst`.

    Every rank of `group` must call it; ranks other than `dst` get None.

    Args:
        local: this rank's `(stage index, profile)` pairs: one per stage it profiled (its chunks), or
            none (a rank whose profiles are not wanted, such as another pipeline's).
        dst: the rank of `group` that gets the joined profile. Default 0.
        group: the process group (a pipeline's, or the world where None) the profiles travel over, as
            JSON in byte tensors: any backend, gloo included.

    Returns:
        On `dst`, one `ModelProfile` with every stage's layers in stage order (body layers renamed
        `stageN.NAME` where the stages' names repeat); None on the other ranks.

    Raises:
        ValueError: on `dst`, a stage index given twice.

    Example::

        with LayerProfiler(stage_module, optimizer) as profiler:
            ...  # the training steps, profiler.step() after each
        profile = gather_profiles([(stage_index, profiler.profile())])
        if profile is not None:  # rank 0
            profile.save("profile.json")
    """
    payload = json.dumps([{"stage": stage, "profile": profile.to_dict()} for stage, profile in local]).encode()
    parts = all_gather_bytes(payload, group)
    if dist.get_rank(group) != dst:
        return None
    stages = [(item["stage"], ModelProfile.from_dict(item["profile"])) for part in parts for item in json.loads(part)]
    return join_profiles(stages)


def join_profiles(stages: Sequence[tuple[int, ModelProfile]]) -> ModelProfile:
    """One profile from the profiles of consecutive stages, in stage order."""
    ordered = [profile for _, profile in sorted(stages, key=lambda item: item[0])]
    indices = sorted(stage for stage, _ in stages)
    if len(set(indices)) != len(indices):
        raise ValueError(f"stage indices repeat: {indices}")
    layers: list[LayerProfile] = [layer for profile in ordered for layer in profile.layers]
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):  # stage modules that name their layers from 0 each
        layers = _renamed(layers, [stage for stage, profile in zip(indices, ordered) for _ in profile.layers])
    # every field the stages agree on is the first stage's; those that differ are joined below
    return dataclasses.replace(
        ordered[0],
        layers=tuple(layers),
        fingerprint=hashlib.sha256("".join(p.fingerprint for p in ordered).encode()).hexdigest()[:16],
        rank_constant_bytes=max(p.rank_constant_bytes for p in ordered),
        stage_output_bytes=max(p.stage_output_bytes for p in ordered),
        model_output_bytes=ordered[-1].model_output_bytes,
        loss_bytes=ordered[-1].loss_bytes,
        stage_shared_bytes=max(p.stage_shared_bytes for p in ordered),  # each stage computes its own
        checkpoint_state_bytes=max(p.checkpoint_state_bytes for p in ordered),
        tied_parameters=tuple(t for p in ordered for t in p.tied_parameters),
    )


def _renamed(layers: list[LayerProfile], stages: list[int]) -> list[LayerProfile]:
    """The body layers of stages that each number their blocks from 0 (`layers.0`, `layers.1` on every stage),
    numbered through the model as the model's own blocks are (`layers.0` to `layers.3`); names of another
    pattern get their stage's index in front (`stage1.block`)."""
    found = [_NUMBERED.fullmatch(layer.name) for layer in layers if layer.is_body]
    prefixes = {match.group(1) for match in found if match is not None}
    if all(found) and len(prefixes) == 1:
        (prefix,), numbers = prefixes, iter(range(len(found)))
        return [
            dataclasses.replace(layer, name=f"{prefix}{next(numbers)}") if layer.is_body else layer for layer in layers
        ]
    return [
        dataclasses.replace(layer, name=f"stage{stage}.{layer.name}") if layer.is_body else layer
        for stage, layer in zip(stages, layers)
    ]


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank (byte tensors: nothing is pickled)."""
    world = dist.get_world_size(group)
    device = (
        torch.device("cpu")
        if dist.get_backend(group) == "gloo"
        else torch.device(torch.accelerator.current_accelerator())
    )
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:  # frombuffer refuses an empty buffer
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    buffers = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(buffers, buffer, group=group)
    return [bytes(b[: int(s.item())].cpu().tolist()) for b, s in zip(buffers, sizes)]
