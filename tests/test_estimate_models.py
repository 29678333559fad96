"""`profile --estimate` for decoder-only models outside the Llama family: parameters counted on the meta
device against the totals their authors publish, activations traced on fake tensors against the
measured profile of the same architecture scaled down, and against the Llama formulas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from profiler.estimate.analytic import analytic_profile, shape_from_config
from profiler.estimate.generic import parameter_report, traced_profile
from profiler.estimate.meta_model import build_config
from sapp_hook.cli import main
from sapp_hook.models import profile_example
from solver import load_profile
from solver.vocabulary.profile import FULL, NONE, SELECTIVE

FIXTURES = Path(__file__).parent / "fixtures" / "estimate"
torch.set_num_threads(1)


def published(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_deepseek_v3_parameters_match_its_model_card():
    # github.com/deepseek-ai/DeepSeek-V3 README_WEIGHTS.md: main model 671B total, 36.6B activated
    # (0.9B of it the output head); MTP module 11.5B unique (its decoder layer); 685B on Hugging Face
    # (main model plus the MTP module with its own copies of the embedding and head)
    count = parameter_report(published("deepseek-v3"))
    assert count.total(mtp=False) == 671_026_404_352
    assert abs(count.total(mtp=False) / 671e9 - 1) < 0.005
    assert abs(count.active(mtp=False) / 36.6e9 - 1) < 0.005
    mtp = [part for part in count.parts if part.kind == "mtp"]
    assert [part.name for part in mtp] == ["mtp.0"]
    layer = next(part for part in count.parts if part.name == "layers.60")
    assert layer.parameters == 11_507_286_016  # the MTP module's decoder layer: "11.5B"
    assert mtp[0].parameters == layer.parameters + 3 * 7168 + 2 * 7168 * 7168
    stored = count.total() + count.parts[0].parameters + count.parts[-1].parameters
    assert abs(stored / 685e9 - 1) < 0.005
    assert [part.kind for part in count.parts[1:5]] == ["body:dense"] * 3 + ["body:moe"]  # first_k_dense_replace


def test_gemma2_9b_and_phi3_mini_and_llama3_parameters_match_their_publications():
    # Gemma 2 report (arXiv 2408.00118), Table 2: 9B has 8,324,201,984 non-embedding parameters
    gemma = parameter_report(published("gemma-2-9b"))
    assert gemma.tied_embeddings
    assert gemma.total() - gemma.parts[0].parameters == 8_324_201_984
    assert gemma.total() == 9_241_705_984
    assert {part.kind for part in gemma.parts[1:-1]} == {"body:dense-sliding", "body:dense-full"}
    # Phi-3 report (arXiv 2404.14219): phi-3-mini, 3.8B parameters (3.82B on its Hugging Face card)
    phi = parameter_report(published("phi-3-mini-4k"))
    assert phi.total() == 3_821_079_552
    assert abs(phi.total() / 3.82e9 - 1) < 0.005
    llama = parameter_report(
        dict(
            model_type="llama",
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        )
    )
    assert {part.parameters for part in llama.parts[1:-1]} == {218_112_000}
    assert llama.total() == 8_030_261_248  # Llama-3-8B: "8.03B"


TINY = {
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=512, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        moe_intermediate_size=32, n_group=2, topk_group=1, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
    ),
    "gemma2": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, sliding_window=16, query_pre_attn_scalar=16, max_position_embeddings=128,
    ),
    "phi3": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=512, pad_token_id=0, max_position_embeddings=128,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_traced_activations_equal_the_measured_profile_scaled_down(model_type):
    fields = {"model_type": model_type, "tie_word_embeddings": False, **TINY[model_type]}
    estimate = traced_profile(fields, sequence=32, micro_batch_size=2, dtype="float32")
    measured = profile_example(build_config(fields), steps=1, warmup_steps=1, micro_batch_size=2, seq_len=32)
    assert len(estimate.layers) == len(measured.layers)
    state = measured.checkpoint_state_bytes  # the CPU generator's state a checkpoint keeps, stated apart
    for ours, theirs in zip(estimate.layers, measured.layers, strict=True):
        assert ours.parameter_bytes == theirs.parameter_bytes
        assert ours.recompute[NONE].activation_bytes == theirs.recompute[NONE].activation_bytes
        for mode in (SELECTIVE, FULL):
            if mode in ours.recompute:
                assert ours.recompute[mode].activation_bytes == theirs.recompute[mode].activation_bytes - state


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_traced_llama_equals_the_analytic_formulas(dtype):
    fields = dict(
        model_type="llama", hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    traced = traced_profile(fields, sequence=256, micro_batch_size=2, dtype=dtype)
    formulas = analytic_profile(shape_from_config(fields, sequence=256, micro_batch_size=2, dtype=dtype))
    assert traced.stage_shared_bytes == formulas.stage_shared_bytes
    for ours, theirs in zip(traced.layers[1:-1], formulas.layers[1:-1], strict=True):
        assert ours.forward_ms == pytest.approx(theirs.forward_ms, rel=1e-12)
        assert ours.parameter_bytes == theirs.parameter_bytes
        for mode in (NONE, SELECTIVE, FULL):
            assert ours.recompute[mode].activation_bytes == theirs.recompute[mode].activation_bytes
            assert ours.recompute[mode].saved_input_bytes == theirs.recompute[mode].saved_input_bytes
            assert ours.recompute[mode].pending_bytes == theirs.recompute[mode].pending_bytes
    assert traced.layers[-1].recompute[NONE].activation_bytes == pytest.approx(
        formulas.layers[-1].recompute[NONE].activation_bytes, abs=16
    )


def test_cli_estimates_a_model_outside_the_llama_family(tmp_path, capsys):
    out = tmp_path / "phi3.json"
    code = main(
        ["profile", "--model", str(FIXTURES / "phi-3-mini-4k.json"), "--estimate", "--dtype", "bfloat16",
         "--seq-len", "4096", "--out", str(out), "--quiet"]
    )  # fmt: skip
    assert code == 0
    profile = load_profile(str(out))
    assert [layer.kind for layer in profile.layers] == ["head", *["body:dense"] * 32, "tail"]
    assert profile.source == "traced"
    assert profile.layers[1].parameter_bytes == 2 * 113_252_352
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        main(
            ["profile", "--model", str(FIXTURES / "phi-3-mini-4k.json"), "--estimate", "--tensor-parallel", "2",
             "--out", str(out)]
        )  # fmt: skip
    assert exit_code.value.code == 2
    assert capsys.readouterr().err == (
        "sapp-hook profile: error: --tensor-parallel: the traced estimate of 'phi3' is for one rank of no model "
        "parallelism and states no collectives; leave --tensor-parallel out (solve --data-parallel shards its "
        "memory)\n"
    )
