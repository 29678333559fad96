"""Two gloo ranks each profile the pipeline stage they hold; rank 0 gathers one profile of the model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from profiler_cases import BATCH, LLAMA, SEQ, batch, llama
from solver_cases import layer as layer_profile

from profiler import LayerProfiler
from profiler.distributed import gather_profiles, join_profiles
from profiler.recompute import checkpoint_state_bytes
from sapp_hook.validation.gloo import gloo_group, spawn
from simulator import InputError
from solver.vocabulary.profile import ModelProfile

CONFIGS = Path(__file__).parents[1] / "sapp_hook" / "templates"


class FirstStage(torch.nn.Module):
    """Embedding and the first two blocks of a Llama."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.embed_tokens, self.rotary_emb = model.model.embed_tokens, model.model.rotary_emb
        self.layers = torch.nn.ModuleList(model.model.layers[:2])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(ids)
        position = self.rotary_emb(hidden, torch.arange(ids.shape[1])[None])
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=position)
        return hidden


class LastStage(torch.nn.Module):
    """The last two blocks, the final norm and the LM head."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.rotary_emb, self.norm, self.lm_head = model.model.rotary_emb, model.model.norm, model.lm_head
        self.layers = torch.nn.ModuleList(model.model.layers[2:])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position = self.rotary_emb(hidden, torch.arange(hidden.shape[1])[None])
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=position)
        return self.lm_head(self.norm(hidden))


def train_stage(stage: torch.nn.Module, rank: int, step: int, optimizer: torch.optim.Optimizer) -> None:
    """One local step of a stage: a made-up gradient for the first, a loss for the last."""
    if rank == 0:
        stage(batch(step)).backward(torch.ones(BATCH, SEQ, 64))
    else:
        logits = stage(torch.randn(BATCH, SEQ, 64, requires_grad=True))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch(0).flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def rank_main(rank: int, store: str, out: str) -> None:
    with gloo_group(rank, 2, store):
        stage = (FirstStage if rank == 0 else LastStage)(llama())
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        with LayerProfiler(stage, optimizer, steps=1, modes=("none", "full")) as profiler:
            while not profiler.done:
                train_stage(stage, rank, profiler.steps_done, optimizer)
                profiler.step()
        joined = gather_profiles([(rank, profiler.profile())])
        if rank == 0:
            joined.save(out)
        else:
            assert joined is None


def test_each_rank_profiles_its_stage_and_rank_0_gathers_the_model(tmp_path):
    out = tmp_path / "profile.json"
    spawn(rank_main, (str(tmp_path / "store"), str(out)), 2)
    profile = ModelProfile.from_dict(json.loads(out.read_text()))
    assert [layer.kind for layer in profile.layers] == ["head", *["body:LlamaDecoderLayer"] * 4, "tail"]
    assert [layer.name for layer in profile.layers] == [
        "head",
        "layers.0",  # each stage module names its blocks from 0: numbered through the model, as its own are
        "layers.1",
        "layers.2",
        "layers.3",
        "tail",
    ]
    model = llama()
    assert sum(layer.parameter_bytes for layer in profile.layers) == sum(p.numel() * 4 for p in model.parameters())
    state = checkpoint_state_bytes(torch.device("cpu"))
    assert all(
        layer.recompute["full"].activation_bytes == BATCH * SEQ * 64 * 4 + state for layer in profile.layers[1:5]
    )
    head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    assert profile.stage_shared_bytes == 2 * SEQ * head_dim * 4  # the rotary tables each stage computes


def test_joined_profile_keeps_what_the_stages_share_and_joins_what_they_do_not():
    block = layer_profile("block.0", "body:b", 3, 6)
    first = ModelProfile(
        layers=(layer_profile("embed", "head", 1, 2), block),
        model="m",
        dtype="bf16",
        micro_batch={"size": 1},
        fingerprint="a",
        rank_constant_bytes=5,
        stage_output_bytes=8,
        stage_shared_bytes=16,
        checkpoint_state_bytes=4,
    )
    last = dataclasses.replace(
        first,
        layers=(block, layer_profile("lm_head", "tail", 2, 4)),
        fingerprint="b",
        rank_constant_bytes=7,
        model_output_bytes=64,
    )
    joined = join_profiles([(1, last), (0, first)])
    assert [each.name for each in joined.layers] == ["embed", "block.0", "block.1", "lm_head"]
    assert (joined.model, joined.dtype, joined.micro_batch) == ("m", "bf16", {"size": 1})
    assert (joined.rank_constant_bytes, joined.stage_output_bytes) == (7, 8)
    assert (joined.model_output_bytes, joined.stage_shared_bytes, joined.checkpoint_state_bytes) == (64, 16, 4)
    assert joined.fingerprint not in ("a", "b")


def refused_rank(rank: int, store: str, config: str) -> None:
    from sapp_hook import autotune

    with gloo_group(rank, 2, store):
        stage = (FirstStage if rank == 0 else LastStage)(llama())
        try:
            autotune(stage, pipeline_parallel=2, micro_batches=8, schedule="1F1B", config=config, target="mindformers")
        except InputError as error:
            Path(f"{config}.{rank}").write_text(str(error))


def test_autotune_under_two_ranks_checks_the_config_against_the_whole_model_up_front(tmp_path):
    config = tmp_path / "train.yaml"  # 8 layers on 4 stages; the model: 4 blocks on 2 ranks
    config.write_text((CONFIGS / "mindformers_llama.yaml").read_text())
    before = config.read_bytes()
    spawn(refused_rank, (str(tmp_path / "store"), str(config)), 2)
    for rank in (0, 1):  # both ranks refuse, before any step: one rank alone would leave the other waiting
        said = Path(f"{config}.{rank}").read_text()  # (its 4 stages it would take the plan's 2 for)
        assert said.startswith(f"config: {config} does not fit this job: the plan places 4 decoder layers")
    assert config.read_bytes() == before


def tuned_rank(rank: int, store: str, folder: str) -> None:
    from sapp_hook import autotune

    with gloo_group(rank, 2, store):
        stage = (FirstStage if rank == 0 else LastStage)(llama())
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        plan_file = Path(folder) / "plan.json"
        with autotune(
            stage,
            optimizer,
            pipeline_parallel=2,
            micro_batches=4,
            schedule="1F1B",
            profile_steps=1,
            modes=("none", "full"),
            config=plan_file,
            target="plan",
            cache_dir=Path(folder) / "cache",
        ) as tuner:
            for step in range(tuner.profiler.total_steps):
                train_stage(stage, rank, step, optimizer)
                tuner.step()
        result = tuner.result
        assert (result.plan is not None) == (rank == 0)  # rank 0 solved; both have the layout
        (Path(folder) / f"layout{rank}.json").write_text(result.layout.plan_json())


def test_autotune_under_two_ranks_solves_on_rank_0_and_shares_the_plan(tmp_path):
    spawn(tuned_rank, (str(tmp_path / "store"), str(tmp_path)), 2)
    layouts = [json.loads((tmp_path / f"layout{rank}.json").read_text()) for rank in (0, 1)]
    assert layouts[0] == layouts[1]
    assert [layer["kind"] for layer in layouts[0]["plan"]["layers"]] == [
        "head",
        *["body:LlamaDecoderLayer"] * 4,
        "tail",
    ]
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written == layouts[0] and written["spec"]["pipeline_parallel"] == 2
