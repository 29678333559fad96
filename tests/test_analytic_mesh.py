"""`profiler.estimate.analytic` for one rank of an N-D job: the collectives each layer runs, their time on the links
given and what of it is exposed (`profiler.estimate.collectives`), on top of `solver.parallel.model_parallel`'s memory."""

from __future__ import annotations

import pytest

from profiler.estimate.analytic import analytic_profile, shape_from_config
from profiler.estimate.collectives import Network
from simulator import InputError
from solver.parallel.model_parallel import token_copies_ratio
from solver.vocabulary.profile import FULL, NONE, SELECTIVE

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
SEQ, BATCH, P = 32, 2, 4  # fp32
TOKENS = SEQ * BATCH
HIDDEN = TOKENS * 64 * P  # one micro-batch's hidden state
LINK, FLOPS = 1e9, 1e12


def estimate(config=LLAMA, network=None, **layout):
    shape = shape_from_config(config, sequence=SEQ, micro_batch_size=BATCH, dtype="float32", **layout)
    return analytic_profile(shape, flops_per_second=FLOPS, network=network)


def ring_ms(operation, ranks, total_bytes, calls=1, latency=0.0, link=LINK):
    share = (ranks - 1) / ranks * (2 if operation == "all-reduce" else 1)
    return 1e3 * (share * total_bytes / link + calls * latency)


def by_kind(layer):
    return {(c.dimension, c.operation, c.per): c for c in layer.collectives}


def test_without_a_network_no_collective_is_stated_and_times_are_the_split_work():
    one_d, rank = estimate(), estimate(tensor_parallel=2)
    assert all(not layer.collectives for layer in rank.layers)
    assert [layer.forward_ms for layer in rank.layers] == [layer.forward_ms / 2 for layer in one_d.layers]


def test_tensor_parallel_blocks_reduce_twice_forward_and_five_times_backward():
    base = estimate(tensor_parallel=2)
    rank = estimate(network=Network(link_bytes_per_second=LINK, latency_s=1e-5), tensor_parallel=2)
    block, was = rank.layers[1], base.layers[1]
    forward, backward = ring_ms("all-reduce", 2, 2 * HIDDEN, 2, 1e-5), ring_ms("all-reduce", 2, 5 * HIDDEN, 5, 1e-5)
    collective = by_kind(block)[("tensor", "all-reduce", "micro-batch")]
    assert (collective.calls, collective.bytes) == (7, 7 * HIDDEN)
    assert collective.ms == pytest.approx(forward + backward) and collective.exposed_ms == collective.ms
    assert block.forward_ms == pytest.approx(was.forward_ms + forward)
    assert block.backward_ms == pytest.approx(was.backward_ms + backward)
    assert block.weight_ms == was.weight_ms  # the input gradients' reductions are the I half's
    # a recompute runs the forward again, its reductions with it
    assert block.recompute[FULL].extra_ms == pytest.approx(was.recompute[FULL].extra_ms + forward)
    assert block.recompute[SELECTIVE].extra_ms == pytest.approx(was.recompute[SELECTIVE].extra_ms + forward)
    assert block.recompute[NONE].extra_ms == 0
    head, tail = by_kind(rank.layers[0]), by_kind(rank.layers[-1])
    assert head[("tensor", "all-reduce", "micro-batch")].bytes == HIDDEN  # the embedding's partial sums
    logits = TOKENS * 512 * P
    assert tail[("tensor", "all-gather", "micro-batch")].bytes == logits  # whole logits: no loss parallel
    assert tail[("tensor", "all-reduce", "micro-batch")].bytes == HIDDEN  # the LM head's input gradient


def test_sequence_parallel_gathers_and_scatters_what_it_splits():
    rank = estimate(network=Network(link_bytes_per_second=LINK), tensor_parallel=2, sequence_parallel=True)
    block = by_kind(rank.layers[1])
    assert block[("tensor", "all-gather", "micro-batch")].calls == 4  # 2 forward, 2 backward
    assert block[("tensor", "reduce-scatter", "micro-batch")].calls == 2
    assert block[("tensor", "all-reduce", "micro-batch")].calls == 5
    assert by_kind(rank.layers[0])[("tensor", "reduce-scatter", "micro-batch")].calls == 1


def test_ring_attention_hides_behind_the_attention_it_feeds():
    slow = Network(link_bytes_per_second=1e3)
    rank = estimate(network=slow, context_parallel=2)
    passes = by_kind(rank.layers[1])[("context", "send-receive", "micro-batch")]
    kv = 2 * (TOKENS // 2) * 2 * 16 * P  # a rank's keys and values: 2 KV heads of 16
    assert (passes.calls, passes.bytes) == (3, 3 * kv)  # one chunk forward, chunk and gradient backward
    attention_ms = 1e3 * 2 * (TOKENS // 2) * SEQ * 64 / 2 / FLOPS
    exposed = 1e3 * kv / 1e3 - attention_ms + 1e3 * 2 * kv / 1e3 - 2 * attention_ms
    assert passes.exposed_ms == pytest.approx(exposed)
    fast = by_kind(estimate(network=Network(link_bytes_per_second=1e15), context_parallel=2).layers[1])
    assert fast[("context", "send-receive", "micro-batch")].exposed_ms == 0


@pytest.mark.parametrize("tokens", ["balanced", "dropless"])
def test_expert_parallel_dispatches_and_combines_each_way(tokens):
    network = Network(link_bytes_per_second=LINK, data_parallel=8)
    rank = estimate(MIXTRAL, network=network, expert_parallel=8, expert_tokens=tokens)
    busiest = max(1.0, token_copies_ratio(tokens, 8, 2, 8))
    sent = TOKENS * 2 * 64 * P * busiest
    a2a = by_kind(rank.layers[1])[("expert", "all-to-all", "micro-batch")]
    assert (a2a.calls, a2a.bytes) == (4, 4 * sent)
    assert a2a.ms == pytest.approx(ring_ms("all-to-all", 8, 4 * sent))


def test_data_parallel_collectives_run_once_a_step_outside_the_layer_times():
    base = estimate()
    for zero, operations in (
        (0, {"all-reduce"}),
        (1, {"all-reduce", "all-gather"}),
        (2, {"reduce-scatter", "all-gather"}),
    ):
        rank = estimate(network=Network(link_bytes_per_second=LINK, data_parallel=4, zero_stage=zero))
        block = rank.layers[1]
        assert {c.operation for c in block.collectives} == operations and {c.per for c in block.collectives} == {"step"}
        assert block.forward_ms == base.layers[1].forward_ms and block.backward_ms == base.layers[1].backward_ms
        gradients = by_kind(block)[("data", "reduce-scatter" if zero == 2 else "all-reduce", "step")]
        assert gradients.bytes == block.gradient_bytes
    # the data link, not the node's
    slow = estimate(network=Network(link_bytes_per_second=LINK, data_link_bytes_per_second=LINK / 10, data_parallel=4))
    assert by_kind(slow.layers[1])[("data", "all-reduce", "step")].ms == pytest.approx(
        ring_ms("all-reduce", 4, slow.layers[1].gradient_bytes, link=LINK / 10)
    )


def test_fsdp_gathers_once_a_step_or_in_every_forward_and_backward():
    base = estimate().layers[1]
    kept = estimate(network=Network(link_bytes_per_second=LINK, data_parallel=4, fsdp=True)).layers[1]
    assert {(c.operation, c.per) for c in kept.collectives} == {("reduce-scatter", "step"), ("all-gather", "step")}
    again = estimate(
        network=Network(link_bytes_per_second=LINK, data_parallel=4, fsdp=True, reshard_after_forward=True)
    ).layers[1]
    gather = ring_ms("all-gather", 4, base.parameter_bytes)
    assert by_kind(again)[("data", "all-gather", "micro-batch")].calls == 2
    assert again.forward_ms == pytest.approx(base.forward_ms + gather)  # no forward prefetch
    assert again.backward_ms == pytest.approx(base.backward_ms + max(0.0, gather - base.backward_ms))  # prefetched
    assert again.recompute[FULL].extra_ms == base.recompute[FULL].extra_ms  # the backward's gather serves it


def test_routed_experts_reduce_over_the_ranks_holding_them():
    # Mixtral's layout: 8 data-parallel ranks, expert parallel 8: each expert lives on one rank, nothing to reduce
    rank = estimate(
        MIXTRAL, network=Network(link_bytes_per_second=LINK, data_parallel=8, zero_stage=1), expert_parallel=8
    )
    block = rank.layers[1]
    reduced = by_kind(block)[("data", "all-reduce", "step")]
    assert reduced.bytes == pytest.approx(
        block.gradient_bytes * (1 - block.expert_parameter_bytes / block.parameter_bytes)
    )


def test_a_layout_no_engine_runs_is_refused_with_its_field():
    with pytest.raises(InputError, match="needs fsdp") as caught:
        Network(reshard_after_forward=True)
    assert caught.value.field == "fsdp_reshard_after_forward"
    with pytest.raises(InputError) as caught:
        estimate(MIXTRAL, network=Network(data_parallel=2), expert_parallel=8)
    assert caught.value.field == "expert_parallel"
    with pytest.raises(InputError) as caught:
        estimate(sequence_parallel=True)
    assert caught.value.field == "sequence_parallel"
    with pytest.raises(InputError) as caught:
        estimate(expert_parallel=2, expert_tokens="most")
    assert caught.value.field == "expert_tokens"
