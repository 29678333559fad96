"""A user's own multi-token-prediction (MTP) module measured as a layer of kind body:mtp, after the decoder
layers, and the plan made from it written into MindFormers (`mtp_depth`) and Megatron-LM (`--mtp-num-layers`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from torch import nn
from torch.nn import functional
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

import tests.profiler_cases  # noqa: F401  (offline, one thread, quiet transformers)
from basics.errors import InputError
from profiler import LayerProfiler
from profiler.layers import find_blocks
from sapp_hook import layout_of, write_config
from sapp_hook.writeback.errors import PlanMismatch
from solver import PipelineSpec, solve
from solver.vocabulary.profile import MTP_KIND, NONE

FIXTURES = Path(__file__).parent / "fixtures"
BATCH, SEQ, VOCAB = 2, 32, 512
DEEPSEEK = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=VOCAB, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    moe_intermediate_size=32, n_group=2, topk_group=1, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip


class Mtp(nn.Module):
    """DeepSeek-V3's MTP module: the hidden state and the next tokens' embedding, each normalised, concatenated
    and projected 2h -> h, one decoder layer, its own norm, the shared LM head and the loss of the token after."""

    def __init__(self, config: transformers.DeepseekV3Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.hnorm, self.enorm, self.norm = (DeepseekV3RMSNorm(h) for _ in range(3))
        self.projection = nn.Linear(2 * h, h, bias=False)
        # dense (layer 0's kind), so that what it saves does not vary with the routing of random weights
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=0)

    def forward(self, hidden, ids, embed, rotary, head):  # type: ignore[no-untyped-def]
        # position i: the main model's state and token i+1's embedding predict token i+2
        x = torch.cat([self.hnorm(hidden[:, :-2]), self.enorm(embed(ids[:, 1:-1]))], dim=-1)
        x = self.projection(x)
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        x = self.layer(x, position_ids=positions, position_embeddings=rotary(x, positions))
        logits = head(self.norm(x))
        return functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())


class DeepseekWithMtp(nn.Module):
    """A tiny DeepSeek-V3 with one MTP module, which shares the embedding and the LM head (handed to it, not
    owned); `mtp_first`: the MTP module runs before the main LM head."""

    _no_split_modules = ("DeepseekV3DecoderLayer",)

    def __init__(self, mtp_first: bool = False) -> None:
        super().__init__()
        config = transformers.DeepseekV3Config(**DEEPSEEK)
        self.lm = transformers.DeepseekV3ForCausalLM(config)
        self.mtp = nn.ModuleList([Mtp(config)])
        self.mtp_first = mtp_first

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=ids, use_cache=False).last_hidden_state
        inner = self.lm.model
        mtp = lambda: self.mtp[0](hidden, ids, inner.embed_tokens, inner.rotary_emb, self.lm.lm_head)  # noqa: E731
        extra = mtp() if self.mtp_first else None
        logits = self.lm.lm_head(hidden)
        loss = functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        extra = mtp() if extra is None else extra
        return loss + 0.3 * extra


def _profiled(model: nn.Module, **options: object) -> LayerProfiler:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with LayerProfiler(model, optimizer, steps=1, **options) as profiler:
        while not profiler.done:
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(profiler.steps_done))
            model(ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            profiler.step()
    return profiler


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _mtp_saved_bytes(model: DeepseekWithMtp) -> int:
    """What autograd saves in the MTP module's forward that nothing saved before it, counted on its own."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(99))
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: set[int] = set()
    inside = [False]
    kept = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in excluded and key not in seen:
            seen.add(key)
            if inside[0]:
                kept[key] = storage.nbytes()
        return tensor

    pre = model.mtp[0].register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    post = model.mtp[0].register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids)
    pre.remove()
    post.remove()
    return sum(kept.values())


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    model = DeepseekWithMtp()
    return model, _profiled(model).profile()


def test_mtp_modules_are_found_by_name_or_pattern_after_the_decoder_blocks():
    torch.manual_seed(0)
    model = DeepseekWithMtp()
    found = [(block.name, block.kind) for block in find_blocks(model, mtp=None)]
    assert [name for name, _ in found] == ["lm.model.layers.0", "lm.model.layers.1", "lm.model.layers.2", "mtp.0"]
    assert found[-1][1] == MTP_KIND and MTP_KIND not in {kind for _, kind in found[:-1]}
    # without MTP patterns, its decoder layer is a fourth decoder block, as before
    assert [block.name for block in find_blocks(model)][-1] == "mtp.0.layer"
    assert [block.name for block in find_blocks(model, ["lm.model.layers.*"], mtp=["mtp.*"])][-1] == "mtp.0"
    with pytest.raises(InputError, match="pattern 'nextn' matches no module") as caught:
        find_blocks(model, mtp=["nextn"])
    assert caught.value.field == "mtp_layers"


def test_a_measured_mtp_module_is_a_layer_after_the_decoder_layers(measured):
    model, profile = measured
    names = [layer.name for layer in profile.layers]
    assert names == ["head", "lm.model.layers.0", "lm.model.layers.1", "lm.model.layers.2", "mtp.0", "tail"]
    mtp, tail = profile.layers[-2], profile.layers[-1]
    assert [layer.kind for layer in profile.layers].count(MTP_KIND) == 1 and mtp.kind == MTP_KIND
    assert list(mtp.recompute) == [NONE]  # the frameworks recompute no MTP layer
    assert set(profile.layers[1].recompute) == {"none", "selective", "full"}
    # its own parameters only: the embedding and the LM head it is handed stay the head's and the tail's
    assert mtp.parameter_bytes == _bytes(model.mtp) == mtp.gradient_bytes
    assert mtp.optimizer_bytes == 2 * _bytes(model.mtp) + 4 * mtp.parameter_tensors  # AdamW's moments and step
    assert profile.layers[0].parameter_bytes == _bytes(model.lm.model.embed_tokens)
    assert tail.parameter_bytes == _bytes(model.lm.lm_head) + _bytes(model.lm.model.norm)
    assert mtp.recompute[NONE].activation_bytes == _mtp_saved_bytes(model) > 0
    # the tail's times leave out the MTP module's, which runs inside them: a decoder layer and the head again
    # (its backward some ten times the tail's own here; the forwards are too close to compare on a busy machine)
    assert tail.forward_ms > 0 and 0 < tail.backward_ms < mtp.backward_ms
    assert mtp.weight_ms is not None and mtp.input_ms is not None  # its backward split, measured alone


def test_an_mtp_module_run_before_the_lm_head_is_placed_last_all_the_same(measured):
    _, profile = measured
    torch.manual_seed(0)
    first = _profiled(DeepseekWithMtp(mtp_first=True), modes=(NONE,)).profile()
    assert [(layer.name, layer.kind, layer.parameter_bytes) for layer in first.layers] == [
        (layer.name, layer.kind, layer.parameter_bytes) for layer in profile.layers
    ]
    assert 0 < first.layers[-1].backward_ms < first.layers[-2].backward_ms


def _plan(profile):  # type: ignore[no-untyped-def]
    spec = PipelineSpec(pipeline_parallel=2, micro_batches=2, schedule="1F1B")
    plan = solve(profile, spec, time_limit_s=20)
    assert plan.layer_kinds[-2:] == (MTP_KIND, "tail")
    return plan


def test_the_plan_is_written_into_mindformers_with_mtp_depth(measured, tmp_path):
    _, profile = measured
    plan = _plan(profile)
    counts = [plan.stage_layer_counts[0] - 1, plan.stage_layer_counts[1] - 1]  # body layers: head and tail out
    assert sum(counts) == 4 and counts[-1] >= 1  # the MTP layer on the last stage
    config = tmp_path / "deepseek3.yaml"
    text = (FIXTURES / "mindformers" / "deepseek3_4layer_interleaved.yaml").read_text()
    config.write_text(
        text.replace("model_parallel: 2", "model_parallel: 1")
        .replace("expert_parallel: 2", "expert_parallel: 1")
        .replace("data_parallel: 2", "data_parallel: 1")
    )
    write_config("mindformers", config, layout_of(plan))
    model = yaml.safe_load(config.read_text())["model"]["model_config"]
    # MindFormers spreads num_layers + mtp_depth = 4 layers, 2 a stage, the MTP layer last
    offset = [counts[0] - 2, counts[1] - 2]
    assert model["offset"] == offset or (model["offset"] == 0 and offset == [0, 0])
    assert (model["num_layers"], model["mtp_depth"]) == (3, 1)


def test_the_plan_is_written_into_megatron_with_mtp_num_layers(measured, tmp_path):
    _, profile = measured
    plan = _plan(profile)
    counts = [plan.stage_layer_counts[0] - 1, plan.stage_layer_counts[1] - 1]
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\ntorchrun pretrain_gpt.py --num-layers 3 --mtp-num-layers 1 --pipeline-model-parallel-size 2 "
        "--micro-batch-size 2 --global-batch-size 4\n"
    )
    write_config("megatron", script, layout_of(plan))
    words = shlex.split(script.read_text().splitlines()[-1])
    layout = words[words.index("--pipeline-model-parallel-layout") + 1]
    # Megatron's layout: the MTP layer m in the last stage, before the loss
    stages = ["E" + "t" * counts[0], "t" * (counts[1] - 1) + "mL"]
    assert re.sub(r"t\*(\d+)", lambda m: "t" * int(m[1]), layout) == "|".join(stages)


def test_megatron_refuses_a_plan_whose_mtp_layer_its_script_does_not_declare(measured, tmp_path):
    _, profile = measured
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\ntorchrun pretrain_gpt.py --num-layers 4 --pipeline-model-parallel-size 2\n")
    with pytest.raises(PlanMismatch) as caught:
        write_config("megatron", script, layout_of(_plan(profile)))
    assert caught.value.detail == (
        f"places 1 multi-token-prediction layers (body:mtp); {script} has --mtp-num-layers 0, whose layers "
        "Megatron-LM places after the decoder layers"
    )


def test_autotune_plans_mtp_modules_its_patterns_name():
    from sapp_hook import autotune

    torch.manual_seed(0)
    model = DeepseekWithMtp()
    model.next_tokens = model.mtp  # the same module under a name the default (`mtp*`) does not find
    del model.mtp
    optimizer = torch.optim.AdamW(model.parameters())
    tuner = autotune(model, optimizer, pipeline_parallel=2, micro_batches=4, mtp_layers=["next_tokens"], quiet=True)
    names = ["lm.model.layers.0", "lm.model.layers.1", "lm.model.layers.2", "next_tokens.0"]
    assert [block.name for block in tuner.profiler.blocks] == names
    assert [block.kind == MTP_KIND for block in tuner.profiler.blocks] == [False, False, False, True]
    tuner = autotune(model, optimizer, pipeline_parallel=2, micro_batches=4, quiet=True)
    assert [block.name for block in tuner.profiler.blocks][-1] == "next_tokens.0.layer"  # a fourth decoder layer
    model.mtp = model.next_tokens  # found by its name, unless no MTP module is asked for
    del model.next_tokens
    assert (
        autotune(model, optimizer, pipeline_parallel=2, micro_batches=4, quiet=True).profiler.blocks[-1].name == "mtp.0"
    )
    tuner = autotune(model, optimizer, pipeline_parallel=2, micro_batches=4, mtp_layers=(), quiet=True)
    assert [block.kind == MTP_KIND for block in tuner.profiler.blocks] == [False] * 4
    with pytest.raises(InputError) as caught:
        autotune(model, optimizer, pipeline_parallel=2, micro_batches=4, mtp_layers="next_tokens")
    assert caught.value.field == "mtp_layers"
