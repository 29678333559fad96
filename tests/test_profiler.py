"""The profiler on models no one here wrote: transformers' Llama, GPT-2 and Qwen2-MoE from small configs."""

from __future__ import annotations

import time
import weakref

import pytest
import torch
from profiler_cases import BATCH, GPT2, LLAMA, SEQ, batch, gpt2, llama, moe, profiled, train_step

from profiler import LayerProfiler, find_blocks
from profiler.recompute import checkpoint_state_bytes
from sapp_hook.pipelining.stages import loss_tail
from simulator import InputError
from solver import PipelineSpec, solve
from solver.vocabulary.profile import ModelProfile

FP32 = 4
# what every checkpointed call keeps beside its saved tensors on the CPU (5,056 bytes in torch 2.13)
CHECKPOINT_STATE = checkpoint_state_bytes(torch.device("cpu"))


def unique_parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() skips tied duplicates


@pytest.fixture(scope="module")
def llama_run():
    model = llama()
    profiler = profiled(model, steps=2)
    return model, profiler, profiler.profile()


@pytest.fixture(scope="module")
def gpt2_run():
    model = gpt2()
    profiler = profiled(model, steps=1)
    return model, profiler, profiler.profile()


# -- finding the layers --------------------------------------------------------------------------


def test_blocks_found_from_transformers_hints():
    assert [b.name for b in find_blocks(llama())] == [f"model.layers.{i}" for i in range(4)]
    assert [b.name for b in find_blocks(gpt2())] == [f"transformer.h.{i}" for i in range(4)]
    assert {b.kind for b in find_blocks(gpt2())} == {"body:GPT2Block"}


def test_dense_and_moe_blocks_are_two_kinds_in_model_order():
    kinds = [b.kind for b in find_blocks(moe())]
    assert (
        kinds
        == ["body:Qwen2MoeDecoderLayer/Qwen2MoeMLP"] * 2 + ["body:Qwen2MoeDecoderLayer/Qwen2MoeSparseMoeBlock"] * 2
    )


def test_largest_repeated_module_list_without_hints():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    assert [b.name for b in find_blocks(Net())] == ["blocks.0", "blocks.1", "blocks.2"]


def test_the_blocks_of_a_sequential_are_its_longest_run_of_one_type():
    # torch.distributed.pipelining's own examples: the embedding, the blocks and the head in one Sequential
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), *[torch.nn.Linear(16, 16) for _ in range(3)], torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )
    assert [b.name for b in find_blocks(model)] == ["0", "1", "2", "3"]  # four Linears in a row
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 16),
        *[torch.nn.TransformerEncoderLayer(16, 2) for _ in range(3)],
        torch.nn.Linear(16, 10),
    )
    assert [b.name for b in find_blocks(model)] == ["1", "2", "3"]
    mixed = torch.nn.Module()
    mixed.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.ReLU()])
    with pytest.raises(InputError, match="found no repeated blocks"):  # a ModuleList is taken whole or not at all
        find_blocks(mixed)


def test_patterns_pick_the_outermost_matching_modules():
    blocks = find_blocks(llama(), ["model.layers.*"])
    assert [b.name for b in blocks] == [f"model.layers.{i}" for i in range(4)]


def test_no_repeated_blocks_is_a_clear_error():
    with pytest.raises(InputError, match="found no repeated blocks") as caught:
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    assert caught.value.field == "layers"


def test_a_pattern_matching_nothing_is_a_clear_error():
    with pytest.raises(InputError, match=r"'decoder.blocks.*' matches no module") as caught:
        LayerProfiler(llama(), layers=["decoder.blocks.*"])
    assert caught.value.field == "layers"


# -- accuracy ------------------------------------------------------------------------------------


def test_layers_in_model_order(llama_run):
    _, _, profile = llama_run
    assert [layer.name for layer in profile.layers] == ["head", *(f"model.layers.{i}" for i in range(4)), "tail"]
    assert profile.micro_batch == {"size": BATCH, "sequence": SEQ}
    assert profile.dtype == "float32" and profile.source == "measured"


def test_parameter_gradient_and_optimizer_bytes_are_the_models(llama_run):
    model, profiler, profile = llama_run
    parameter_bytes = unique_parameter_bytes(model)
    assert sum(layer.parameter_bytes for layer in profile.layers) == parameter_bytes
    assert sum(layer.gradient_bytes for layer in profile.layers) == parameter_bytes
    state_bytes = sum(
        t.numel() * t.element_size() for state in profiler.optimizer.state.values() for t in state.values()
    )
    assert sum(layer.optimizer_bytes for layer in profile.layers) == state_bytes
    block = model.model.layers[1]
    assert profile.layers[2].parameter_bytes == sum(p.numel() * FP32 for p in block.parameters())


def test_tied_embedding_and_lm_head_are_found_and_counted_by_both(gpt2_run):
    model, _, profile = gpt2_run
    (tied,) = profile.tied_parameters
    assert tied.names == ("transformer.wte.weight", "lm_head.weight")
    assert tied.layers == ("head", "tail")
    assert tied.bytes == GPT2["vocab_size"] * GPT2["n_embd"] * FP32
    counted = sum(layer.parameter_bytes for layer in profile.layers)
    assert counted - tied.bytes == unique_parameter_bytes(model)


def llama_block_bytes() -> int:
    """A hand count of what transformers' Llama block (SDPA, fp32, on the CPU) saves for backward."""
    b, s, h, f = BATCH, SEQ, LLAMA["hidden_size"], LLAMA["intermediate_size"]
    heads, kv_heads = LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"]
    d = h // heads
    elements = (
        2 * b * s * h  # block input and the attention residual sum: the two RMSNorm inputs
        + 2 * b * s  # their rsqrt
        + 2 * b * s * h  # the normalised x, and x * weight flattened for the projections (both norms)
        + 2 * b * s * h  # the normalised x * weight for q/k/v and for gate/up: the matmul inputs
        + b * s * heads * d
        + 2 * b * s * kv_heads * d  # q, k (after rotary) and v
        + b * s * heads * d  # the attention output
        + 4 * b * s * f  # gate, up, silu(gate) and silu(gate) * up
    )
    logsumexp = b * heads * s  # kept in fp32 by the attention kernel
    return (elements + logsumexp) * FP32


def test_activation_bytes_of_a_plain_block_match_a_hand_count(llama_run):
    _, _, profile = llama_run
    for layer in profile.layers:
        if layer.is_body:
            assert layer.recompute["none"].activation_bytes == llama_block_bytes()
            # the block's input is the tensor it is handed (which torch's receive buffers hold)
            assert all(cost.saved_input_bytes == profile.stage_output_bytes for cost in layer.recompute.values())
    # cos and sin, computed once before the blocks and kept by the first: each stage keeps its own
    assert profile.stage_shared_bytes == 2 * SEQ * (LLAMA["hidden_size"] // LLAMA["num_attention_heads"]) * FP32


def test_the_models_output_is_the_logits_and_the_loss(llama_run):
    """What torch's pipeline engine keeps on the last stage per micro-batch in flight."""
    _, _, profile = llama_run
    assert profile.model_output_bytes == (BATCH * SEQ * LLAMA["vocab_size"] + 1) * FP32
    assert profile.loss_bytes == FP32  # of which the loss, which torch's engine keeps to the step's end


def test_full_recompute_keeps_only_the_block_input(llama_run, gpt2_run):
    for _, _, profile in (llama_run, gpt2_run):
        hidden = BATCH * SEQ * 64 * FP32
        assert profile.stage_output_bytes == hidden  # what a stage sends on, and the engine keeps
        for layer in profile.layers:
            if layer.is_body:  # and the checkpoint's copy of the CPU generator's state
                assert layer.recompute["full"].activation_bytes == hidden + CHECKPOINT_STATE
        assert profile.checkpoint_state_bytes == CHECKPOINT_STATE


def test_a_checkpoint_holds_the_cpu_generators_state_until_its_backward():
    """What the allocator holds after a checkpointed forward, beside its output, with the state kept and
    without: the bytes `checkpoint_state_bytes` adds to every recomputed layer's activations."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    linear, x = torch.nn.Linear(64, 64), torch.randn(8, 64, requires_grad=True)

    def held_after_forward(preserve_rng_state: bool) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = checkpoint(lambda t: linear(t).sin(), x, use_reentrant=False, preserve_rng_state=preserve_rng_state)
        held = sum(event.cpu_memory_usage for event in prof.events() if event.name == "[memory]")
        out.sum().backward()
        return held

    assert held_after_forward(True) - held_after_forward(False) == CHECKPOINT_STATE
    assert checkpoint_state_bytes(torch.device("meta")) == 0  # a CPU tensor: not on an accelerator


class Linears(torch.nn.Module):
    """Blocks of one bias-free Linear each on (batch, width) inputs: what each backward allocates can be
    counted by hand."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_on_the_cpu_working_sets_are_counted_op_by_op_in_untimed_steps():
    """The CPU keeps no allocator counters: one more step per mode counts what ops allocate. A bias-free
    Linear's backward allocates its input's gradient and its weight's, whatever the mode (full
    recompute's rebuilt output is freed before them); those steps add no times."""
    rows, width = 8, 16
    model = Linears(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LayerProfiler(model, optimizer, steps=2, modes=("none", "full")) as profiler:
        while not profiler.done:
            model(torch.randn(rows, width)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            profiler.step()
    assert profiler.total_steps == 1 + 2 * 2 + 2
    assert [profiler.describe_step(step) for step in (0, 4, 5, 6)] == [
        "warm-up",
        "recompute full",
        "recompute none, counting memory",
        "recompute full, counting memory",
    ]
    profile = profiler.profile()
    for index, layer in enumerate(profile.layers[1:], start=1):  # block 0's input needs no gradient: no hook ends it
        for mode in ("none", "full"):
            assert layer.recompute[mode].working_bytes == (rows * width + width * width) * FP32
            assert len(profiler.samples[index].forward_ms[mode]) == 2  # the timed steps' only
            assert len(profiler.samples[index].backward_peak_bytes[mode]) == 1


class PairsOfLinears(torch.nn.Module):
    """Blocks of two bias-free Linears each: the second's weight gradient is made before the first's
    backward allocates, so whether it stays (a new .grad) or goes (added in place) shows in the peak."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.Linear(width, width, bias=False))
            for _ in range(3)
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("to_none", [True, False])
def test_a_new_gradient_is_not_counted_in_the_working_set(to_none):
    """Whether the loop zeroes gradients to None (the backward creates them) or in place (it adds into
    them), a layer's working set is the same, one Linear's input and weight gradients: the gradients
    themselves are static bytes. Counted as they stay, the second Linear's new weight gradient read
    2 KiB where the in-place run reads 1.5."""
    rows, width = 8, 16
    torch.manual_seed(0)
    model = PairsOfLinears(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LayerProfiler(model, optimizer, steps=1, modes=("none",)) as profiler:
        while not profiler.done:
            model(torch.randn(rows, width)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=to_none)
            profiler.step()
    for layer in profiler.profile().layers[1:]:  # block 0's input needs no gradient: no hook ends it
        assert layer.recompute["none"].working_bytes == (rows * width + width * width) * FP32


def test_the_tail_and_head_working_sets_hold_their_gradients(llama_run):
    """The loss and LM head's backward allocates the logits' gradient (what it frees on the way, the
    log-softmax it saved, makes the peak less than the sum of all it allocates); the embedding's, its
    weight's gradient."""
    _, _, profile = llama_run
    vocab, hidden = LLAMA["vocab_size"], LLAMA["hidden_size"]
    assert profile.layers[-1].recompute["none"].working_bytes >= BATCH * SEQ * vocab * FP32
    assert profile.layers[0].recompute["none"].working_bytes >= vocab * hidden * FP32


def selective_block_bytes() -> int:
    """What a Llama block under selective recompute keeps: its input; the q, k, v, o projections; gate,
    up, down; the attention output and its logsumexp."""
    b, s, h, f = BATCH, SEQ, LLAMA["hidden_size"], LLAMA["intermediate_size"]
    kv = LLAMA["num_key_value_heads"] * h // LLAMA["num_attention_heads"]
    return (b * s * (h + h + 2 * kv + h + 2 * f + h + h)) * FP32 + b * LLAMA["num_attention_heads"] * s * FP32


def test_selective_keeps_the_input_and_matmul_and_attention_outputs(llama_run):
    _, _, profile = llama_run
    for layer in profile.layers[1:-1]:
        assert layer.recompute["selective"].activation_bytes == selective_block_bytes() + CHECKPOINT_STATE
        assert layer.recompute["full"].extra_ms >= 0 and layer.recompute["selective"].extra_ms >= 0


def test_selective_kept_bytes_are_counted_where_the_policy_sees_no_output(monkeypatch):
    """torch before `ctx.op_output` (2.11, on a GPU machine) calls the policy before the op: what selective
    mode keeps is counted all the same."""
    from torch.utils import checkpoint

    from profiler import recompute

    original = checkpoint.SelectiveCheckpointContext.__init__
    monkeypatch.setattr(
        checkpoint.SelectiveCheckpointContext,
        "__init__",
        lambda self, *, is_recompute, op_output=None: original(self, is_recompute=is_recompute),
    )
    monkeypatch.setattr(recompute, "POLICY_SEES_OUTPUT", False)
    profile = profiled(llama(), steps=1, modes=("none", "selective")).profile()
    for layer in profile.layers[1:-1]:
        assert layer.recompute["selective"].activation_bytes == selective_block_bytes() + CHECKPOINT_STATE


def test_what_selective_recompute_keeps_in_its_cache_is_counted_as_held(llama_run):
    """Saved-tensor hooks do not see selective checkpointing's own cache: `HeldActivations.keep`, handed
    each tensor it keeps (as validate's run does through `set_recompute`), counts it until it is freed.
    (validate read a tiny-moe rank whose plan recomputed one MoE block selectively 31% low without it.)"""
    from profiler.measure.held import HeldActivations
    from profiler.recompute import set_recompute

    model, _, _ = llama_run
    block = model.model.layers[0]
    hidden = torch.randn(BATCH, SEQ, LLAMA["hidden_size"], requires_grad=True)
    positions = torch.arange(SEQ)[None]
    tables = model.model.rotary_emb(hidden, positions)
    held = HeldActivations([*block.parameters(), hidden, *tables])
    undo = set_recompute(block, "selective", on_kept=held.keep)
    try:
        with held:
            out = block(hidden.clone(), position_embeddings=tables, position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
            assert held.live_bytes == selective_block_bytes()
            out.sum().backward()
            del out
            assert held.live_bytes == 0
    finally:
        undo()
        block.zero_grad(set_to_none=True)


def test_layer_times_add_up_to_the_step(llama_run):
    """Per step, the layers' forward and backward times cover the whole forward and backward."""
    model, _, _ = llama_run
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ratios = []
    with LayerProfiler(model, optimizer, steps=3, modes=("none",), pool=False, split_backward=False) as profiler:
        while not profiler.done:
            ids = batch(profiler.steps_done)
            start = time.perf_counter()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            step_ms = (time.perf_counter() - start) * 1e3
            optimizer.step()
            optimizer.zero_grad()
            before = {slot: len(s.forward_ms.get("none", [])) for slot, s in profiler.samples.items()}
            profiler.step()
            if profiler.warmup_steps < profiler.steps_done <= profiler.timed_steps_end:
                layers_ms = sum(
                    s.forward_ms["none"][-1] + s.backward_ms["none"][-1]
                    for slot, s in profiler.samples.items()
                    if len(s.forward_ms["none"]) > before.get(slot, 0)
                )
                ratios.append(layers_ms / step_ms)
    assert len(ratios) == 3
    # the layers' times lie within the step; a step the machine preempted between layers covers less
    assert all(ratio <= 1.0 for ratio in ratios) and max(ratios) >= 0.85, ratios


def test_pooled_layers_of_a_kind_share_their_times(llama_run):
    _, profiler, profile = llama_run
    body = [layer for layer in profile.layers if layer.is_body]
    assert len({(layer.forward_ms, layer.backward_ms, layer.weight_ms, layer.input_ms) for layer in body}) == 1
    # the shares are timed (a loaded machine can time them at 0); the formulas are what must hold
    split = profiler.backward_splits[body[0].kind]
    assert body[0].weight_ms == min(body[0].backward_ms * split.weight_share, body[0].backward_ms)
    assert body[0].input_ms == body[0].backward_ms * split.input_share
    assert all(layer.recompute[mode].pending_bytes == split.pending_bytes for layer in body for mode in layer.modes)
    # what each half holds while it runs, measured without recompute; with it, the whole backward's stands
    assert all(
        (layer.recompute[mode].input_working_bytes, layer.recompute[mode].weight_working_bytes)
        == ((split.input_working_bytes, split.weight_working_bytes) if mode == "none" else (None, None))
        for layer in body
        for mode in layer.modes
    )
    # what a block's I holds until the stage's I ends and what it frees of the gradient handed to it,
    # measured without recompute like its pending bytes and applied to every mode alike
    assert all(
        (layer.recompute[mode].input_held_bytes, layer.recompute[mode].output_gradient_freed_bytes)
        == (split.input_held_bytes, split.output_gradient_freed_bytes)
        for layer in body
        for mode in layer.modes
    )
    # what its W frees before its stage's W ends: measured without recompute; with it, its pending bytes
    assert all(
        layer.recompute[mode].weight_freed_bytes == (split.weight_freed_bytes if mode == "none" else None)
        for layer in body
        for mode in layer.modes
    )
    assert split.weight_freed_bytes > split.pending_bytes  # and part of what it saved
    assert profile.layers[0].weight_ms == profile.layers[0].backward_ms  # the head takes token ids
    assert profile.layers[0].input_ms is None and profile.layers[-1].input_ms is None


def test_each_kind_of_a_mixed_model_is_timed_on_its_own():
    profile = profiled(moe(), steps=1, modes=("none", "full")).profile()
    kinds = [layer.kind for layer in profile.layers]
    assert kinds == ["head"] + ["body:Qwen2MoeDecoderLayer/Qwen2MoeMLP"] * 2 + [
        "body:Qwen2MoeDecoderLayer/Qwen2MoeSparseMoeBlock"
    ] * 2 + ["tail"]
    assert profile.layers[1].forward_ms == profile.layers[2].forward_ms
    assert profile.layers[3].forward_ms == profile.layers[4].forward_ms
    assert profile.modes == ("none", "full")


def test_the_profile_round_trips_and_solves(llama_run, tmp_path):
    _, _, profile = llama_run
    profile.save(tmp_path / "profile.json")
    again = ModelProfile.from_dict(__import__("json").loads((tmp_path / "profile.json").read_text()))
    assert again == profile
    plan = solve(profile, PipelineSpec(pipeline_parallel=2, micro_batches=4, schedule="1F1B"), time_limit_s=10)
    assert plan.status == "optimal" and sum(plan.stage_layer_counts) == len(profile.layers)


# -- no side effects -----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2-with-dropout"])
def test_losses_and_weights_are_bit_identical_with_and_without_the_profiler(make):
    plain, watched = make(), make()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    watched_optimizer = torch.optim.AdamW(watched.parameters(), lr=1e-3)
    torch.manual_seed(1)
    plain_losses = [train_step(plain, plain_optimizer, step) for step in range(9)]
    torch.manual_seed(1)
    watched_losses = []
    # 1 warm-up + none, selective, full, timed + the three counting memory, then the split backward's
    # measurements, alone
    with LayerProfiler(watched, watched_optimizer, steps=1, tail=loss_tail(watched)) as profiler:
        assert profiler.total_steps == 7
        for step in range(9):  # two more steps after the profiler let go
            watched_losses.append(train_step(watched, watched_optimizer, step))
            if not profiler.done:
                profiler.step()
    assert profiler.done and "tail" in profiler.backward_splits
    assert watched_losses == plain_losses
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def hooks_left(model: torch.nn.Module) -> list[str]:
    """Hooks, wrapped forwards and checkpointing switches the profiler may have left (a fresh model has none)."""
    fresh = dict(llama().named_modules())
    left = []
    for name, module in model.named_modules():
        for attribute in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, attribute):
                left.append(f"{name}.{attribute}")
        for attribute in ("forward", "gradient_checkpointing", "_gradient_checkpointing_func"):
            if module.__dict__.get(attribute) != fresh[name].__dict__.get(attribute):
                left.append(f"{name}.{attribute}")
    for name, param in model.named_parameters():
        if getattr(param, "_post_accumulate_grad_hooks", None):
            left.append(f"{name}._post_accumulate_grad_hooks")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        left.append("saved_tensors_hooks")
    return left


def test_no_hook_is_left_behind(llama_run):
    model, profiler, _ = llama_run
    assert hooks_left(model) == []
    assert not profiler.optimizer._optimizer_step_post_hooks


@pytest.mark.parametrize("fail_at", [0, 2, 3])
def test_a_step_that_raises_leaves_no_hook(fail_at):
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="boom"), LayerProfiler(model, optimizer, steps=1) as profiler:
        while not profiler.done:
            if profiler.steps_done == fail_at:  # 2: under selective recompute, 3: under full
                ids = batch(0)
                model(input_ids=ids, labels=ids, use_cache=False)
                raise RuntimeError("boom")
            train_step(model, optimizer, profiler.steps_done)
            profiler.step()
    assert hooks_left(model) == []
    assert not optimizer._optimizer_step_post_hooks
    train_step(model, optimizer, 0)  # trains as before


def test_evaluation_forwards_inside_the_window_are_ignored():
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with LayerProfiler(model, optimizer, steps=1, modes=("none",)) as profiler:
        while not profiler.done:
            with torch.no_grad():
                model(input_ids=batch(9), use_cache=False)
            train_step(model, optimizer, profiler.steps_done)
            profiler.step()
    assert all(len(s.forward_ms["none"]) == 1 for s in profiler.samples.values())


def test_without_an_optimizer_there_is_no_optimizer_state():
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with LayerProfiler(model, None, steps=1, modes=("none",)) as profiler:
        while not profiler.done:
            train_step(model, optimizer, profiler.steps_done)
            profiler.step()
    assert all(layer.optimizer_bytes == 0 for layer in profiler.profile().layers)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"modes": ("full",)}, "modes"),
        ({"modes": ("none", "comm")}, "modes"),
    ],
)
def test_bad_options_are_clear_errors(options, field):
    with pytest.raises(InputError) as caught:
        LayerProfiler(llama(), **options)
    assert caught.value.field == field


def test_asking_for_the_profile_too_early_says_how_far_it_got():
    model = llama()
    profiler = LayerProfiler(model, steps=1)
    with profiler, pytest.raises(RuntimeError, match="profiled 0 of 7 steps"):  # 1 warm-up, 3 timed, 3 counting memory
        profiler.profile()
    with pytest.raises(RuntimeError, match="outside the profiling window"):
        profiler.step()


def test_a_block_that_never_runs_is_named():
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(InputError, match=r"never ran in the warm-up step: model.layers.3") as caught:
        with LayerProfiler(model, optimizer, steps=1) as profiler:
            ids = batch(0)
            model.model.layers = model.model.layers[:3]  # the last block no longer runs
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            profiler.step()
    assert caught.value.field == "layers"


class ThreeLinears(torch.nn.Module):
    """Three blocks, run as `order(blocks, x)` says: a plain model of the tests' own."""

    def __init__(self, order) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.order = order

    def forward(self, x):
        return self.order(self.blocks, x).pow(2).mean()


def test_a_block_that_runs_twice_in_one_forward_is_named():
    def shared(blocks, x):
        for block in [*blocks, blocks[0]]:  # block 0's weights serve two layers
            x = block(x)
        return x

    model = ThreeLinears(shared)
    with pytest.raises(InputError, match=r"ran more than once in one forward of the model: blocks.0") as caught:
        with LayerProfiler(model, steps=1) as profiler:
            model(torch.randn(2, 4)).backward()
            profiler.step()
    assert caught.value.field == "layers"


def test_blocks_rerun_by_their_own_checkpointing_are_not_counted_twice():
    def checkpointed(blocks, x):
        for block in blocks:  # each block runs again in the backward, to recompute
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x

    model = ThreeLinears(checkpointed)
    with LayerProfiler(model, steps=1, modes=("none",)) as profiler:
        while not profiler.done:
            model(torch.randn(2, 4)).backward()
            profiler.step()
    assert [layer.name for layer in profiler.profile().layers if layer.is_body] == ["blocks.0", "blocks.1", "blocks.2"]


class FakeEvent:
    """Stands in for a device event: `elapsed_time` from host timestamps, as a device would report."""

    def __init__(self) -> None:
        import time

        self.at = time.perf_counter()

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at - self.at) * 1e3


class FakeDeviceMemory:
    """An allocator whose peak over each backward (a block's, the tail's, the head's) is 1 MiB above where it started,
    and which has freed 2 MiB (the saved activations) by the time the next one starts."""

    def __init__(self) -> None:
        self.resets = 0
        self.current = 64 * 2**20
        self.top = self.current

    def allocated(self) -> int:
        return self.current

    def forget(self, tensor: torch.Tensor) -> None:
        """Nothing, as an accelerator's counters (`clock.DeviceMemory.forget`)."""

    def reset_peak(self) -> None:
        if self.resets:
            self.current -= 2 * 2**20
        self.resets += 1
        self.top = self.current

    def peak(self) -> int:
        return self.top + 2**20


def test_the_accelerator_path_uses_events_and_allocator_peaks(monkeypatch):
    """The recorder's device branch, on the CPU with stand-ins: events marked at hooks and read after
    one synchronize per step; the allocator's peak over each layer's backward becomes its working set, read
    before the next backward resets it (the gradient between two blocks fires both their hooks), the head's
    as its gradients land."""
    from profiler.measure import clock, layer_profiler

    synchronized = []
    memory = FakeDeviceMemory()
    monkeypatch.setattr(clock.EventClock, "mark", lambda self: FakeEvent())
    monkeypatch.setattr(clock.EventClock, "synchronize", lambda self: synchronized.append(1))
    monkeypatch.setattr(layer_profiler, "clock_for", lambda device: clock.EventClock(device))
    monkeypatch.setattr(layer_profiler, "memory_for", lambda device: memory)
    profiler = profiled(llama(), steps=1, modes=("none", "full"), split_backward=False)
    profile = profiler.profile()
    assert len(synchronized) == profiler.total_steps
    assert memory.resets == (4 + 2) * 2  # each block's, the tail's and the head's backward, in each measured step
    for layer in profile.layers[1:-1]:
        assert layer.recompute["none"].working_bytes == 2**20 == layer.recompute["full"].working_bytes
        assert layer.forward_ms > 0 and layer.backward_ms > 0
    assert profile.layers[-1].recompute["none"].working_bytes == 2**20  # the tail: loss, LM head, final norm
    assert profile.layers[0].recompute["none"].working_bytes == 2**20  # the head: the embedding's gradient


def test_a_split_backward_holds_the_gradients_of_weighted_outputs_from_i_to_w():
    """Measured as torch's pipeline stages run it, on a copy of an input; the gradients training has
    accumulated and the random state are left as they were."""
    from profiler.measure.split import measure_split_backward

    block = torch.nn.Sequential(torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(12, 6, bias=False))
    first = block[0].weight
    first.grad = torch.ones_like(first)
    accumulated = first.grad
    inputs = (torch.randn(5, 8, requires_grad=True),)
    state = torch.random.get_rng_state()
    split = measure_split_backward(block, inputs, {}, torch.device("cpu"))
    # the first layer's output gradient, which its weight gradient needs (the second's is the gradient
    # handed in), and the input's, which torch leaves on the input
    assert split.pending_bytes == (5 * 12 + 5 * 8) * 4
    # I holds nothing more than what it leaves pending; W adds each weight gradient in place (12 x 8,
    # then 6 x 12 floats), holding the first's until it ends, and frees the first layer's output
    # gradient (5 x 12) once that weight gradient is made
    assert split.input_working_bytes == split.pending_bytes
    assert split.input_held_bytes == split.pending_bytes  # the output's side of the graph saved nothing I alone needs
    assert split.output_gradient_freed_bytes == 0  # the second Linear's weight gradient needs it
    assert split.weight_working_bytes == (12 * 8 + 6 * 12 - 5 * 12) * 4
    # where a layer after it keeps the graph alive, W frees that output gradient, the first Linear's
    # output (which only the second's weight gradient uses) and the gradient handed in (which it
    # needs too); the input's gradient stays on the input
    assert split.weight_freed_bytes == (5 * 12 + 5 * 12 + 5 * 6) * 4
    assert split.input_share >= 0 and split.weight_share >= 0  # timed: a loaded machine can time 0
    assert first.grad is accumulated and torch.equal(accumulated, torch.ones_like(first))
    assert block[1].weight.grad is None and inputs[0].grad is None
    assert torch.equal(torch.random.get_rng_state(), state)
    assert measure_split_backward(block, (torch.randn(5, 8),), {}, torch.device("cpu")) is None  # no input gradient


def test_the_tail_given_as_a_module_has_its_backward_split_too():
    """The last block's output, copied in a plain step, runs through the tail and its loss alone
    (`sapp_hook.pipelining.stages.loss_tail`): the tail gets its halves' times and what its I holds for W."""
    from profiler.measure.split import measure_split_backward

    model = llama()
    tail = loss_tail(model)
    profiler = profiled(model, steps=1, modes=("none",), tail=tail)
    split = profiler.backward_splits["tail"]
    layer = profiler.profile().layers[-1]
    assert layer.kind == "tail"
    assert layer.input_ms == layer.backward_ms * split.input_share
    assert layer.weight_ms == min(layer.backward_ms * split.weight_share, layer.backward_ms)

    def held(c):  # a SplitBackward or a RecomputeCost
        return (
            c.pending_bytes,
            c.input_working_bytes,
            c.weight_working_bytes,
            c.input_held_bytes,
            c.output_gradient_freed_bytes,
        )

    assert held(layer.recompute["none"]) == held(split)
    # bytes do not depend on the values: the copy had the last block's output's shape
    hidden = torch.randn(BATCH, SEQ, LLAMA["hidden_size"], requires_grad=True)
    assert held(measure_split_backward(tail, (hidden,), {}, torch.device("cpu"))) == held(split)
    # I forms the logits' gradient (for the LM head's weight gradient), the final norm's output
    # gradient (for its weight's) and the input's, which torch leaves on the input; then it frees
    # the loss's graph: its log-softmax (the logits' size), the labels (int64) and nll_loss's
    # total weight (one float)
    tokens, logits_bytes = BATCH * SEQ, BATCH * SEQ * LLAMA["vocab_size"] * 4
    assert split.input_held_bytes == logits_bytes + 2 * tokens * LLAMA["hidden_size"] * 4
    assert split.pending_bytes == split.input_held_bytes - (logits_bytes + 8 * tokens + 4)
    assert split.output_gradient_freed_bytes == 4  # the loss's gradient, one float: nothing keeps it
    assert profiler.recorder.captured_tail_input is None  # dropped once measured


def test_a_block_whose_weight_gradients_do_not_need_its_output_gradient_frees_it():
    """A Linear scaled after: its weight gradient needs the scaled gradient, not the one handed in,
    which I frees (so a block before it in a stage does not keep what it hands back)."""
    from profiler.measure.split import measure_split_backward

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 12, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.linear(x)

    split = measure_split_backward(Scaled(), (torch.randn(5, 8, requires_grad=True),), {}, torch.device("cpu"))
    assert split.output_gradient_freed_bytes == 5 * 12 * 4
    assert split.pending_bytes == (5 * 12 + 5 * 8) * 4  # the scaled gradient and the input's
    assert split.input_held_bytes == split.pending_bytes


def test_torch_split_backward_keeps_nothing_after_w(llama_run):
    """torch's W frees every tensor a layer saved, under the hooks that count them too. (Hooks that held
    the tensor they were handed, grad_fn and all, closed a cycle through the graph wherever it was an
    output the op saved: a split backward, which keeps the graph past its I, then leaked it for good:
    29% of a Llama block, 60% of two, read as what W keeps; validate's peaks agreed, being measured
    the same way.)"""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from profiler.measure.held import HeldActivations

    model, _, profile = llama_run
    assert all(cost.retained_bytes == 0 for layer in profile.layers for cost in layer.recompute.values())
    blocks = model.model.layers[:2]
    params = [p for block in blocks for p in block.parameters()]
    hidden = torch.randn(BATCH, SEQ, LLAMA["hidden_size"])
    positions = torch.arange(SEQ)[None]
    tables = model.model.rotary_emb(hidden, positions)
    with HeldActivations(params) as held:
        for _ in range(2):
            x = hidden.clone().requires_grad_(True)
            out = x
            for block in blocks:
                out = block(out, position_embeddings=tables, position_ids=positions)
                out = out[0] if isinstance(out, tuple) else out
            assert held.live_bytes > 0
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
            stage_backward_weight(iter(params), groups)
            assert held.live_bytes == 0

    # the profiler's own hooks, which run inside a user's training: an output the op saved (exp's) is
    # not kept alive by them once W has run
    weight = torch.nn.Parameter(torch.randn(8, 8))
    with LayerProfiler(llama()):
        x = torch.randn(4, 8, requires_grad=True)
        y = torch.exp(x @ weight)
        alive = weakref.ref(y)
        loss = y.sum()
        del y
        _, groups = stage_backward_input([loss], None, [x], iter([weight]))
        stage_backward_weight(iter([weight]), groups)
        del loss, groups
        assert alive() is None
