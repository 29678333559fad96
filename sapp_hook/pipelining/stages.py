"""`build_stages`: a plan made real for `torch.distributed.pipelining`. A rank's stage modules, each holding the
plan's layers of one virtual stage (the embedding on the first, the final norm and LM head on the last)
with each layer under the plan's recompute, ready for `PipelineStage` and the plan's schedule class.

transformers' decoder-only models are cut the way their own forward runs them: the Llama family
(`embed_tokens`, `rotary_emb`, `layers`, `norm`, `lm_head`) and GPT-2 (`wte`, `wpe`, `drop`, `h`, `ln_f`,
`lm_head`). Every stage recomputes the position embeddings it needs; attention is causal with no padding.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from basics.errors import InputError
from profiler.distributed import all_gather_bytes
from profiler.layers import find_blocks
from profiler.recompute import TORCH_MODES, set_recompute
from sapp_hook.pipelining.engine_rules import TORCH_SCHEDULES, check_no_recompute, check_torch_runs
from sapp_hook.writeback.layout import Layout, as_layout
from simulator.schedule import rank_chunk_to_stage, stage_to_rank
from simulator.schedules import schedule_kind
from solver import Plan
from solver.vocabulary.profile import NONE

log = logging.getLogger(__name__)


@dataclass
class _Parts:
    """Where a model family keeps what runs around its blocks."""

    embed: nn.Module
    position_embed: nn.Module | None  # GPT-2's learned positions
    dropout: nn.Module | None
    rotary: nn.Module | None  # Llama's rotary embedding: computed by every stage
    norm: nn.Module
    head: nn.Module


class PipelineStageModule(nn.Module):
    """One virtual stage: optionally the embedding, some blocks, optionally the final norm and LM head.
    Takes token ids on the first stage and hidden states elsewhere; returns hidden states or logits."""

    def __init__(self, parts: _Parts, blocks: list[nn.Module], *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.embed = parts.embed if first else None
        self.position_embed = parts.position_embed if first else None
        self.dropout = parts.dropout if first else None
        self.rotary = parts.rotary
        self.layers = nn.ModuleList(blocks)
        self.norm = parts.norm if last else None
        self.head = parts.head if last else None
        self.sequence_shards = 1  # sequence parallelism: a later stage receives its share of the sequence

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        sequence = inputs.shape[1] * (1 if self.first else self.sequence_shards)
        positions = torch.arange(sequence, device=inputs.device).unsqueeze(0)
        hidden = inputs
        if self.first:
            hidden = self.embed(inputs)
            if self.position_embed is not None:
                hidden = hidden + self.position_embed(positions)
            if self.dropout is not None:
                hidden = self.dropout(hidden)
        extra = {}
        if self.rotary is not None and len(self.layers):
            extra["position_embeddings"] = self.rotary(hidden, positions)
        for layer in self.layers:
            output = layer(hidden, attention_mask=None, **extra)
            hidden = next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))
        if self.last:
            hidden = self.head(self.norm(hidden))
        return hidden


class LossTail(nn.Module):
    """A model's tail with its loss, from the last block's output to the loss: the final norm, the LM
    head and transformers' causal-LM loss on random labels (what it costs does not depend on them).
    The profiler re-runs it to split its backward as a zero-bubble schedule's last stage does."""

    def __init__(self, model: nn.Module, parts: _Parts) -> None:
        super().__init__()
        self.norm, self.head = parts.norm, parts.head
        self.loss_function = model.loss_function
        self.vocab_size = model.config.get_text_config().vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        labels = torch.randint(self.vocab_size, hidden.shape[:-1], device=hidden.device)
        return self.loss_function(logits=self.head(self.norm(hidden)), labels=labels, vocab_size=self.vocab_size)


def loss_tail(model: nn.Module) -> LossTail | None:
    """`model`'s tail and loss as one module, for `LayerProfiler(tail=...)`; None where `build_stages` does not
    know the model's parts (the profiler then assumes the tail's split)."""
    try:
        return LossTail(model, _parts(model))
    except InputError:
        return None


def _same_module(planned: str, found: str) -> bool:
    """Whether two qualified module names are one module, up to a wrapper's prefix (`module.` of
    DistributedDataParallel, `model.` where a profile was taken of the inner model)."""
    return planned == found or planned.endswith("." + found) or found.endswith("." + planned)


def build_stages(
    model: nn.Module,
    plan: Plan | Layout | Mapping[str, object] | str | os.PathLike,
    rank: int,
    on_kept: Callable[[torch.Tensor], None] | None = None,
) -> list[tuple[int, PipelineStageModule]]:
    """`(stage index, module)` for each virtual stage `rank` runs under `plan`, in chunk order.
    `on_kept` sees each tensor selective recompute keeps in its own cache (`set_recompute`).

    Each module runs the embedding (first stage), its blocks with the position embeddings it recomputes,
    and the final norm and LM head (last stage). The modules hold the model's own modules, not copies;
    the blocks the plan recomputes are switched to full or selective checkpointing in place. A plan
    whose body layers are not named as the model's blocks gets a warning, as does a tied embedding and
    LM head on two ranks (see `TiedGradients`).

    Args:
        model: a transformers causal LM of the Llama family or GPT-2.
        plan: a `Plan`, a `Layout`, a plan JSON as read, or its path (a config's side file,
            `NAME.sapp-hook.json`, is then checked against the config beside it).
        rank: this process's pipeline rank, 0..pipeline_parallel-1.
        on_kept: called with each tensor selective recompute keeps in its own cache; None: nothing.

    Returns:
        `(stage index, PipelineStageModule)` per chunk of `rank`, for `PipelineStage(module, stage index,
        num_stages, ...)`.

    Raises:
        InputError: a plan that does not read back (naming its field); naming `plan`: a side file whose
            config has changed since they were written together, a body-layer count other than the
            model's blocks, a recompute mode torch has not, recompute under a schedule that splits the
            backward; naming `rank` outside the pipeline; naming `model` for a model that is not of a
            family it knows.

    Example::

        stages = [
            PipelineStage(module, index, layout.num_virtual_stages, device, group=pp_group)
            for index, module in sapp_hook.build_stages(model, layout, pp_rank)
        ]
        runner = sapp_hook.schedule_class(layout)
        schedule = runner(stages if len(stages) > 1 else stages[0], layout.micro_batches, loss_fn=loss_fn)
    """
    layout = as_layout(plan)
    parts = _parts(model)
    found = find_blocks(model)
    blocks = [block.module for block in found]
    body = [layer for layer in layout.layers if layer.is_body]
    if len(body) != len(blocks):
        raise InputError("plan", f"holds {len(body)} body layers; the model has {len(blocks)} blocks")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.pipeline_parallel:
        raise InputError("rank", f"expected an integer 0..{layout.pipeline_parallel - 1}, got {rank!r}")
    for layer, block in zip(body, found):
        if not _same_module(layer.name, block.name):  # it runs all the same; its split was planned for another model
            log.warning(
                "the plan's body layer %r is the model's block %r: was the plan made for this model?",
                layer.name,
                block.name,
            )
            break
    check_no_recompute(layout.schedule, layout.body_modes(), "plan")
    placement = schedule_kind(layout.schedule).placement
    ends = _end_ranks(layout)
    if _tied_weight(parts) is not None and len(ends) > 1:
        log.warning(
            "%s ties its embedding and LM head, which this plan puts on ranks %s: sum their gradients "
            "with sapp_hook.TiedGradients after each backward, or untie them (tie_word_embeddings=False)",
            type(model).__name__,
            ends,
        )
    stages = []
    block_of = {id(layer): blocks[index] for index, layer in enumerate(body)}
    cells = layout.virtual_stages()
    for chunk in range(layout.chunks):
        stage_index = rank_chunk_to_stage(rank, chunk, layout.pipeline_parallel, placement)
        cell = cells[stage_index]
        chosen = []
        for layer in cell:
            if not layer.is_body:
                continue
            if layer.recompute not in TORCH_MODES:
                raise InputError(
                    "plan", f"{layer.name}: torch has no {layer.recompute!r} recompute; use none, selective or full"
                )
            block = block_of[id(layer)]
            if layer.recompute != NONE:
                set_recompute(block, layer.recompute, on_kept)
            chosen.append(block)
        first = stage_index == 0
        last = stage_index == layout.num_virtual_stages - 1
        stages.append((stage_index, PipelineStageModule(parts, chosen, first=first, last=last)))
    return stages


class TiedGradients:
    """The gradient of the weight a model's embedding and LM head share, summed over the pipeline ranks
    that hold the two (Megatron's embedding group), so that both copies stay one weight.

    Make it on every rank of the world, after `build_stages` (it makes the process groups of the holders,
    one per pipeline where data parallelism runs several); call it after each step's backward and
    before the optimizer step. `rank` is the rank in the pipeline `group` (default: the world). It
    does nothing where the model does not tie the two or one rank holds both (V schedules).

    Args:
        model: the model `build_stages` cut (a Llama-family or GPT-2 causal LM).
        plan: the same plan: a `Plan`, a `Layout` or a plan JSON as read.
        rank: this process's pipeline rank, its rank in `group`.
        group: the process group of this rank's pipeline; None: the world is one pipeline.

    Raises:
        InputError: naming `model` for a model that is not of a family `build_stages` knows; under
            torch.distributed, with tied weights, a plan that does not read back.

    Example::

        tied = sapp_hook.TiedGradients(model, layout, pp_rank, group=pp_group)  # on every rank
        for batch in batches:
            schedule.step(...)
            tied()  # after the backward, before the optimizer step
            optimizer.step()
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan | Layout | Mapping[str, object],
        rank: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.weight = _tied_weight(_parts(model))
        self.group, self.holds = None, False
        if not (dist.is_available() and dist.is_initialized()):
            return  # one process runs every stage: they share the weight itself
        holders = _end_ranks(as_layout(plan)) if self.weight is not None else []
        members = [r if group is None else dist.get_global_rank(group, r) for r in holders] if len(holders) > 1 else []
        # new_group is collective over the world: every rank learns every pipeline's holders first
        everyone = {tuple(json.loads(part)) for part in all_gather_bytes(json.dumps(members).encode())} - {()}
        if everyone:
            self.group, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in sorted(everyone)])
        self.holds = rank in holders

    def __call__(self) -> None:
        if self.group is None or not self.holds:
            return
        if self.weight.grad is None:  # no micro-batch reached this rank's use of it
            self.weight.grad = torch.zeros_like(self.weight)
        dist.all_reduce(self.weight.grad, group=self.group)


def schedule_class(plan: Plan | Layout | Mapping[str, object] | str | os.PathLike) -> type:
    """The torch.distributed.pipelining schedule class that runs `plan`.

    Args:
        plan: a `Plan`, a `Layout`, a plan JSON as read, or its path (a config's side file,
            `NAME.sapp-hook.json`, is then checked against the config beside it).

    Returns:
        The class (`Schedule1F1B`, `ScheduleGPipe`, `ScheduleInterleaved1F1B`, `ScheduleZBVZeroBubble` or
        `ScheduleDualPipeV`), to make with the rank's stage (or list of stages, one per chunk).

    Raises:
        InputError: a plan that does not read back; naming `plan` where torch has no class for its
            schedule (Interleaved1F1B-less-memory, ZBH1).

    Example::

        runner = sapp_hook.schedule_class(layout)  # e.g. Schedule1F1B
        schedule = runner(stage, n_microbatches=layout.micro_batches, loss_fn=loss_fn)
    """
    import torch.distributed.pipelining as pipelining

    layout = as_layout(plan)
    check_torch_runs(layout.schedule, "plan")
    return getattr(pipelining, TORCH_SCHEDULES[layout.schedule])


def _tied_weight(parts: _Parts) -> nn.Parameter | None:
    """The weight the embedding and the LM head share, if they do."""
    weight = getattr(parts.embed, "weight", None)
    return weight if weight is not None and weight is getattr(parts.head, "weight", None) else None


def _end_ranks(layout: Layout) -> list[int]:
    """The pipeline ranks that hold the first or the last virtual stage (one rank under V schedules)."""
    placement = schedule_kind(layout.schedule).placement
    return sorted(
        {stage_to_rank(end, layout.pipeline_parallel, placement) for end in (0, layout.num_virtual_stages - 1)}
    )


def _parts(model: nn.Module) -> _Parts:
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "lm_head", None)
    if base is None or head is None:
        raise InputError(
            "model", f"{type(model).__name__}: expected a transformers causal LM (a base model and lm_head)"
        )
    if hasattr(base, "embed_tokens") and hasattr(base, "norm"):  # the Llama family
        return _Parts(
            embed=base.embed_tokens,
            position_embed=None,
            dropout=None,
            rotary=getattr(base, "rotary_emb", None),
            norm=base.norm,
            head=head,
        )
    if hasattr(base, "wte") and hasattr(base, "ln_f"):  # GPT-2
        return _Parts(
            embed=base.wte, position_embed=base.wpe, dropout=base.drop, rotary=None, norm=base.ln_f, head=head
        )
    raise InputError("model", f"{type(model).__name__}: sapp_hook.build_stages knows the Llama family and GPT-2")
