"""The cost model: FLOPs formulas, memory terms, alpha-beta fits, limits."""

import dataclasses

import numpy as np
import pytest

import lengthwise.cost.memory as mem
from lengthwise.cost import CostModel, Profile, SchemeFit
from lengthwise.cost.comm import SKRULL_H100_TABLE_US, SKRULL_SIZES_MB
from lengthwise.cost.flops import causal_keys
from lengthwise.errors import UserError
from lengthwise.plan.ir import SHARDED, Chunk, Segment
from lengthwise.specs import MODEL_PRESETS, ModelSpec, cluster_preset


def cost(name="qwen2.5-7b", gpus=8):
    return CostModel(model=MODEL_PRESETS[name], cluster=cluster_preset("h100", gpus))


def one(seq, start, stop):
    return Chunk((Segment(seq, start, stop),))


def test_slices_attention_sums_to_whole_sequence():
    cm = cost()
    whole = cm.forward_flops(one(0, 0, 9000), layers=4)
    parts = sum(cm.forward_flops(one(0, a, b), layers=4) for a, b in [(0, 3000), (3000, 7000), (7000, 9000)])
    assert parts == pytest.approx(whole, rel=1e-12)


def test_causal_keys_counts_pairs():
    assert causal_keys(0, 1) == 1
    assert causal_keys(0, 4) == 1 + 2 + 3 + 4
    assert causal_keys(2, 4) == 3 + 4


def test_linear_flops_match_parameter_count():
    # With no attention, forward FLOPs are 2 * (layer matmul params) per token (skrull A.2).
    m = MODEL_PRESETS["llama2-7b"]
    cm = CostModel(model=m, cluster=cluster_preset("h100"))
    lin = cm.forward_flops(one(0, 0, 1), layers=1) - 4 * m.q_dim * 1
    norms = 2 * m.hidden
    assert lin == pytest.approx(2 * (m.params_per_layer - norms))


def test_backward_ratios_apply_per_part():
    cm = cost()
    ch = one(0, 0, 4096)
    f, b = cm.forward_flops(ch, layers=2), cm.backward_flops(ch, layers=2)
    assert 2.0 * f < b < 2.5 * f


def test_packing_is_cheaper_than_one_long_sequence():
    cm = cost()
    packed = Chunk(tuple(Segment(i, 0, 1024) for i in range(8)))
    assert cm.forward_time(packed, layers=28) < cm.forward_time(one(0, 0, 8192), layers=28)


def test_padding_costs_the_padded_rows():
    cm = cost()
    padded = Chunk((Segment(0, 0, 100), Segment(1, 0, 1000)), pad_to=2000)
    assert cm.forward_flops(padded, layers=1) == pytest.approx(2 * cm.forward_flops(one(0, 0, 1000), layers=1))


def test_time_falls_with_tp_but_efficiency_drops():
    """A long chunk runs faster on tp 8, less than 8x; a short one gains nothing once the
    per-layer collectives' start-up latency is paid."""
    cm = cost()
    long, short = one(0, 0, 8192), one(0, 0, 128)
    t1, t8 = cm.forward_time(long, layers=4, tp=1), cm.forward_time(long, layers=4, tp=8)
    assert t8 < t1 < 8 * t8
    assert cm.forward_time(short, layers=4, tp=8) > cm.forward_time(short, layers=4, tp=1) / 2


def test_recompute_trades_memory_for_time():
    cm = cost()
    ch = one(0, 0, 4096)
    assert cm.activation_bytes(ch, layers=7, recompute_layers=7) < cm.activation_bytes(ch, layers=7) / 10
    assert cm.backward_time(ch, layers=7, recompute_layers=7) > cm.backward_time(ch, layers=7)


def test_mlp_recomputation_sits_between_none_and_full():
    """Recomputing every layer's MLP block keeps less than keeping everything and more than
    full recomputation, and costs a backward less than full recomputation does: the level
    between them. What a layer drops is its SwiGLU's gate and up (2 ffn / tp values), the
    post-attention norm's output (whole) and one fp32 per row (/ tp with sequence parallelism);
    the backward re-materialises that and the product one block at a time and reruns the gate
    and up projections (and under sequence parallelism one all-gather)."""
    for sp in (True, False):
        cm = dataclasses.replace(cost(), sequence_parallel=sp)
        q = cm.model
        ch = one(0, 0, 4096)
        for tp in (1, 4):
            kept = [cm.activation_bytes(ch, layers=7, tp=tp, **kw)
                    for kw in ({}, {"recompute_mlp": 7}, {"recompute_layers": 7})]
            assert kept[0] > kept[1] > kept[2], (sp, tp)
            dropped = 2 * q.ffn * 2 / tp + q.hidden * 2 + 4 / (tp if sp else 1)
            assert kept[0] - kept[1] == pytest.approx(7 * 4096 * dropped, rel=1e-12)
            assert cm.recompute_transient_bytes(ch, tp=tp, recompute_mlp=7) == \
                pytest.approx(4096 * (dropped + q.ffn * 2 / tp), rel=1e-12)
            # a whole layer re-materialised is the larger transient when both levels are in one forward
            assert cm.recompute_transient_bytes(ch, tp=tp, recompute_layers=1, recompute_mlp=6) == \
                cm.recompute_transient_bytes(ch, tp=tp, recompute_layers=1)
            times = [cm.backward_time(ch, layers=7, tp=tp, **kw)
                     for kw in ({}, {"recompute_mlp": 7}, {"recompute_layers": 7})]
            assert times[0] < times[1] < times[2], (sp, tp)
            budget = cm.stage_budget(stage=0, tp=tp, pp=4)
            assert budget.mlp_recomputed_per_token == cm.activation_bytes_per_token(layers=7, tp=tp, recompute_mlp=7)
        limits = [cm.max_seq_len(pp=4, recompute=level) for level in ("none", "mlp", "full")]
        assert limits[0] < limits[1] < limits[2]


def test_zero_stages_shrink_model_states():
    cm = cost()
    sizes = [cm.model_state_bytes(layers=28, dp=8, zero=z, first=True, last=True) for z in (0, 1, 2, 3)]
    params = MODEL_PRESETS["qwen2.5-7b"].num_params
    # bf16 weights (2), fp32 gradients accumulated over the step (4), fp32 master and Adam (12)
    assert sizes[0] == pytest.approx(18 * params)
    # ZeRO-1 shards the 12; the executor accumulates the gradients unsharded at every stage, so
    # ZeRO-2 holds what ZeRO-1 does; ZeRO-3 shards the bf16 weights too
    assert sizes[1] == sizes[2] == pytest.approx((2 + 4 + 12 / 8) * params)
    assert sizes[3] == pytest.approx((2 / 8 + 4 + 12 / 8) * params)


def test_kv_state_replicates_heads_beyond_tp():
    cm = cost()  # 4 K/V heads
    assert cm.kv_bytes(1000, layers=1, tp=8) == cm.kv_bytes(1000, layers=1, tp=4)
    assert cm.kv_bytes(1000, layers=1, tp=2) == 2 * cm.kv_bytes(1000, layers=1, tp=4)


def test_max_seq_len_grows_with_parallelism_and_fits_exactly():
    cm = cost(gpus=32)
    small, big = cm.max_seq_len(dp=8), cm.max_seq_len(tp=4, pp=2, dp=4)
    assert big > small > 0
    seq = one(0, 0, small)
    used = cm.model_state_bytes(layers=28, dp=8, first=True, last=True) + cm.activation_bytes(seq, layers=28, head=True)
    assert used <= cm.capacity_bytes


def test_states_that_do_not_fit_say_how_much():
    cm = cost("qwen2.5-72b")
    with pytest.raises(UserError, match="GiB"):
        cm.check_states_fit(tp=1, pp=1, dp=1, zero=0)


def test_alpha_beta_fit_reproduces_skrull_table():
    cm = cost()
    for kind, row in SKRULL_H100_TABLE_US.items():
        for mb, us in list(zip(SKRULL_SIZES_MB, row))[-4:]:  # large messages, where the fit is linear
            got = cm.collective_time(kind, mb * 2**20, ranks=8, inter_node=False) * 1e6
            assert got == pytest.approx(us, rel=0.1)


def test_inter_node_is_slower_and_single_rank_free():
    cm = cost()
    assert cm.collective_time("all_reduce", 2**28, ranks=8, inter_node=True) > \
        cm.collective_time("all_reduce", 2**28, ranks=8, inter_node=False)
    assert cm.collective_time("all_reduce", 2**28, ranks=1, inter_node=True) == 0.0
    with pytest.raises(UserError, match="unknown collective"):
        cm.collective_time("broadcast", 1, ranks=2, inter_node=False)


def test_cp_comm_only_for_sharded_segments():
    cm = cost()
    local = Chunk((Segment(0, 0, 4096, cp_rank=1),))
    shard = Chunk((Segment(0, 0, 4096, cp_rank=SHARDED),))
    assert cm.cp_comm_time(local, layers=4, cp=4) == 0.0
    assert cm.cp_comm_time(shard, layers=4, cp=4) > 0.0
    assert cm.cp_grad_comm_time(local, layers=4, cp=4) == 0.0
    assert cm.cp_grad_comm_time(shard, layers=4, cp=1) == 0.0


def test_cp_gradient_reduce_scatter_prices_the_gathered_kv_bytes():
    """The backward's reduce-scatter of the K/V gradients: per layer the whole K/V of the
    sharded segments' own tokens (a slice's context is not in it), priced as a reduce-scatter
    over the CP group, across nodes when the group spans them."""
    cm = cost()
    chunk = Chunk((Segment(0, 1024, 5120, cp_rank=SHARDED), Segment(1, 0, 300, cp_rank=2)))
    per_layer = 4096 * mem.kv_bytes_per_token_layer(cm.model, 2)
    assert cm.cp_kv_layer_bytes(chunk, tp=2) == per_layer
    for inter in (False, True):
        assert cm.cp_grad_comm_time(chunk, layers=4, tp=2, cp=4, inter_node=inter) == pytest.approx(
            4 * cm.collective_time("reduce_scatter", per_layer, ranks=4, inter_node=inter))


def test_profile_overrides_analytic_time_and_round_trips():
    fit = SchemeFit(fwd=(1e-9, 1e-6, 1e-4), bwd=(2e-9, 2e-6, 2e-4))
    prof = Profile(device="test", schemes={"tp1-cp1": fit})
    prof = Profile.from_dict(prof.to_dict())
    cm = CostModel(model=MODEL_PRESETS["qwen2.5-0.5b"], cluster=cluster_preset("h100"), profile=prof)
    ch = one(0, 0, 1000)
    assert cm.forward_time(ch, layers=2) == pytest.approx(2 * (1e-9 * causal_keys(0, 1000) + 1e-6 * 1000 + 1e-4))
    # A scheme the profile lacks falls back to the analytic model.
    assert cm.forward_time(ch, layers=2, tp=2) > 0


def test_model_spec_validation_shows_arithmetic():
    bad = ModelSpec(num_layers=2, hidden=64, num_heads=6, num_kv_heads=4, head_dim=8, ffn=64, vocab=10)
    with pytest.raises(UserError, match=r"num_heads\(6\) % num_kv_heads\(4\)"):
        bad.validate()


def test_cp_time_and_memory_follow_the_busiest_rank():
    # Skrull's local sequences: two whole on rank 0, nothing on rank 1, so rank 0 sets the pace.
    cm = cost()
    skewed = Chunk((Segment(0, 0, 4096, cp_rank=0), Segment(1, 0, 4096, cp_rank=0)))
    balanced = Chunk((Segment(0, 0, 4096, cp_rank=0), Segment(1, 0, 4096, cp_rank=1)))
    assert cm.forward_time(skewed, layers=4, cp=2) > cm.forward_time(balanced, layers=4, cp=2)
    assert cm.activation_bytes(skewed, layers=4, cp=2) == 2 * cm.activation_bytes(balanced, layers=4, cp=2)
    sharded = Chunk((Segment(0, 0, 8192),))
    # as many tokens per rank; each layer of the sharded one also keeps the K/V its all-gather
    # assembled, whole (all 8,192 tokens' k and v), for its backward
    gathered = 8192 * mem.kv_bytes_per_token_layer(cm.model)
    assert cm.cp_kv_layer_bytes(sharded) == gathered and cm.cp_kv_layer_bytes(balanced) == 0
    assert cm.activation_bytes(sharded, layers=4, cp=2) == cm.activation_bytes(balanced, layers=4, cp=2) + 4 * gathered


def test_tensor_parallelism_pays_its_activation_collectives():
    """Sequence-parallel TP moves 2 all-gathers and 2 reduce-scatters of tokens x hidden bf16
    values per layer, forward and backward; without that term tp 8 looked free."""
    from lengthwise.plan.ir import Chunk, Segment
    from lengthwise.specs import cluster_preset, model_preset

    spec = model_preset("llama2-7b")
    cost = CostModel(model=spec, cluster=cluster_preset("h100", 8))
    chunk = Chunk((Segment(0, 0, 8192),))
    nbytes = 8192 * spec.hidden * 2
    per_layer = 2 * (cost.collective_time("all_gather", nbytes, ranks=8, inter_node=False)
                     + cost.collective_time("reduce_scatter", nbytes, ranks=8, inter_node=False))
    assert cost.tp_comm_time(8192, tp=8) == pytest.approx(per_layer)
    hidden = dataclasses.replace(cost, tp_comm_overlap=1.0)
    for fn in ("forward_time", "backward_time"):
        exposed = getattr(cost, fn)(chunk, layers=4, tp=8) - getattr(hidden, fn)(chunk, layers=4, tp=8)
        assert exposed == pytest.approx(4 * per_layer)
    assert cost.forward_time(chunk, layers=4, tp=1) == hidden.forward_time(chunk, layers=4, tp=1)


def test_tensor_parallelism_pays_the_embedding_and_head_collectives():
    """The first stage's embedding reduce-scatters its vocabulary-parallel output to the ranks'
    rows (backward: all-gathers the gradient), the last stage's LM head all-gathers its input
    (backward: reduce-scatters its gradient), each one collective of tokens x hidden bf16
    values per forward or backward; a middle stage pays neither, tp 1 nothing."""
    from lengthwise.specs import cluster_preset, model_preset

    spec = model_preset("llama2-7b")
    cost = CostModel(model=spec, cluster=cluster_preset("h100", 8))
    hidden = dataclasses.replace(cost, tp_comm_overlap=1.0)
    chunk = Chunk((Segment(0, 0, 8192),))
    nbytes = 8192 * spec.hidden * 2
    gather = cost.collective_time("all_gather", nbytes, ranks=8, inter_node=False)
    scatter = cost.collective_time("reduce_scatter", nbytes, ranks=8, inter_node=False)
    layers = 4 * cost.tp_comm_time(8192, tp=8)
    for fn, (head_s, embed_s) in (("forward_time", (gather, scatter)), ("backward_time", (scatter, gather))):
        for head, embed, edge in ((False, False, 0.0), (True, False, head_s), (False, True, embed_s),
                                  (True, True, head_s + embed_s)):
            kw = {"layers": 4, "tp": 8, "head": head, "embed": embed}
            exposed = getattr(cost, fn)(chunk, **kw) - getattr(hidden, fn)(chunk, **kw)
            assert exposed == pytest.approx(layers + edge), (fn, head, embed)
            assert cost.sp_edge_comm_time(8192, tp=8, head=head, embed=embed,
                                          backward=fn == "backward_time") == pytest.approx(edge)
        assert getattr(cost, fn)(chunk, layers=4, tp=1, head=True, embed=True) == \
            getattr(hidden, fn)(chunk, layers=4, tp=1, head=True, embed=True)


def test_tensor_parallelism_without_sequence_parallelism_all_reduces_whole_activations():
    """Without sequence parallelism a layer's forward all-reduces its two row-parallel outputs
    and its backward the two blocks' input gradients (each block's projections share one
    Replicate input: `lengthwise dryrun --no-sequence-parallel` counts them, tests/test_dryrun.py); the
    embedding's output is all-reduced in forward, the head's input gradient in backward; each
    tokens x hidden bf16 values. tp 1 pays nothing."""
    spec = MODEL_PRESETS["llama2-7b"]
    cost = CostModel(model=spec, cluster=cluster_preset("h100", 8), sequence_parallel=False)
    hidden = dataclasses.replace(cost, tp_comm_overlap=1.0)
    chunk = Chunk((Segment(0, 0, 8192),))
    reduce = cost.collective_time("all_reduce", 8192 * spec.hidden * 2, ranks=8, inter_node=False)
    assert cost.tp_comm_time(8192, tp=8) == pytest.approx(2 * reduce)
    assert cost.tp_comm_time(8192, tp=8, backward=True) == pytest.approx(2 * reduce)
    for fn, count, head_s, embed_s in (("forward_time", 2, 0.0, reduce), ("backward_time", 2, reduce, 0.0)):
        backward = fn == "backward_time"
        for head, embed, edge in ((False, False, 0.0), (True, False, head_s), (False, True, embed_s),
                                  (True, True, head_s + embed_s)):
            kw = {"layers": 4, "tp": 8, "head": head, "embed": embed}
            exposed = getattr(cost, fn)(chunk, **kw) - getattr(hidden, fn)(chunk, **kw)
            assert exposed == pytest.approx(4 * count * reduce + edge), (fn, head, embed)
            assert cost.sp_edge_comm_time(8192, tp=8, head=head, embed=embed, backward=backward) == pytest.approx(edge)
        assert getattr(cost, fn)(chunk, layers=4, tp=1, head=True, embed=True) == \
            getattr(hidden, fn)(chunk, layers=4, tp=1, head=True, embed=True)


def test_without_sequence_parallelism_activations_are_whole_on_every_tp_rank():
    """Every TP-dependent memory term without sequence parallelism against with it: larger at
    tp > 1 (the norms, the recomputed layer's input, the head's norm and the stage boundary
    whole), the same at tp 1; the backward's largest working set is then a norm's on whole rows
    (Qwen2.5-7B at tp 4: 22 bytes per hidden value less the freed SwiGLU tensors); rows tp does
    not divide are not padded."""
    sp, nosp = cost(), dataclasses.replace(cost(), sequence_parallel=False)
    q = sp.model
    chunk = one(0, 0, 4099)
    for tp in (1, 2, 4, 8):
        terms = [lambda cm: cm.activation_bytes_per_token(layers=7, tp=tp),
                 lambda cm: cm.activation_bytes_per_token(layers=7, tp=tp, recompute_layers=7),
                 lambda cm: cm.activation_bytes_per_token(layers=7, tp=tp, head=True),
                 lambda cm: cm.boundary_bytes(chunk, tp=tp)]
        for term in terms:
            assert (term(nosp) > term(sp)) if tp > 1 else (term(nosp) == term(sp)), tp
        # the residual stream's gradient beside a layer's backward is whole; from tp 3 on the
        # norm's backward also outgrows the SwiGLU's (ffn / tp < 2.2 hidden); at tp 2 the SwiGLU
        # and down projection's is the larger with SP, beside its gathered output gradient
        work = [cm.backward_work_bytes(chunk, layers=7, tp=tp) for cm in (nosp, sp)]
        assert (work[0] > work[1]) if tp > 2 else (work[0] < work[1]) if tp == 2 else (work[0] == work[1]), tp
        layer = [mem.layer_backward_bytes_per_token(q, tp, sp=False), mem.layer_backward_bytes_per_token(q, tp)]
        assert (layer[0] > layer[1]) if tp > 2 else (layer[0] < layer[1]) if tp == 2 else (layer[0] == layer[1]), tp
    assert mem.activation_bytes_per_token_layer(q, 4, sp=False) == \
        ((2 * q.q_dim + 2 * q.kv_dim + 2 * q.ffn) * 2 + q.num_heads * 4) / 4 + 4 * q.hidden * 2 + 2 * 4
    assert mem.layer_backward_bytes_per_token(q, 4, sp=False) == 22 * q.hidden + 12 - 2 * q.ffn * 2 / 4
    # the SwiGLU and down projection's with SP, beside its gathered output gradient
    assert mem.layer_backward_bytes_per_token(q, 4) == q.hidden * 2 + 3 * q.ffn * 2 / 4
    assert nosp.boundary_bytes(chunk, tp=4) == 4099 * q.hidden * 2
    assert nosp.attention_pad_bytes(4099, tp=4) == 0 < sp.attention_pad_bytes(4099, tp=4)
    assert nosp.max_seq_len(tp=4, pp=4) < sp.max_seq_len(tp=4, pp=4)


def test_without_sequence_parallelism_tp_1_simulates_the_same_step():
    """At tp 1 the setting changes nothing: the same plan simulates to the same floats."""
    from lengthwise.sim import simulate_plan
    from test_simulator import make_plan, split

    plan = make_plan([split(0, [0, 96, 160]), [one(1, 0, 200)]], pp=2)
    cm = CostModel(model=plan.model, cluster=plan.cluster)
    a, b = simulate_plan(plan, cm), simulate_plan(plan, dataclasses.replace(cm, sequence_parallel=False))
    assert (a.step_time_s, a.peak_memory) == (b.step_time_s, b.peak_memory)


@pytest.mark.parametrize("fitted,sequence_parallel", [(False, True), (True, True), (False, False)])
def test_works_time_is_the_scalar_time_to_the_bit(fitted, sequence_parallel):
    """CostModel.works_time (the simulator's whole-pipeline tables at cp = 1) gives exactly the
    floats forward_time / backward_time give chunk by chunk, padded and empty rows included,
    with and without sequence parallelism, with K/V projections split and replicated over TP."""
    import numpy as np
    cm = dataclasses.replace(cost(), sequence_parallel=sequence_parallel)
    if fitted:
        cm = dataclasses.replace(cm, profile=Profile(schemes={"tp1-cp1": SchemeFit(
            fwd=(1e-12, 3e-7, 2e-5), bwd=(2.5e-12, 6e-7, 4e-5), head_fwd=(1e-6, 1e-5), head_bwd=(2e-6, 2e-5))}))
    rng = np.random.default_rng(3)
    chunks = [Chunk(tuple(Segment(i * 10 + k, int(a), int(a) + int(n)) for k, (a, n) in
                          enumerate(zip(rng.integers(0, 9000, 3), rng.integers(1, 5000, 3)))))
              for i in range(40)]
    chunks += [Chunk((Segment(500, 0, 7), Segment(501, 0, 3)), pad_to=64), Chunk(())]
    tokens = [max(c.num_tokens, c.pad_to) for c in chunks]
    from lengthwise.cost.flops import chunk_work
    keys = [chunk_work(c).keys if c.segments else 0 for c in chunks]
    for tp in (1, 2, 8):  # 8: above Qwen2.5-7B's 4 K/V heads, replicated (cost/memory.kv_replicated)
        for layers, head, embed in ((7, False, False), (7, True, False), (0, True, False), (0, False, False),
                                    (7, False, True), (7, True, True), (0, False, True)):
            for backward, fn in ((False, cm.forward_time), (True, cm.backward_time)):
                got = cm.works_time(tokens, keys, layers=layers, tp=tp, head=head, embed=embed, backward=backward)
                want = [fn(c, layers=layers, tp=tp, head=head, embed=embed) for c in chunks]
                assert (got + 0.0).tolist() == want


def test_stage_budget_is_the_one_answer_to_what_fits_a_stage():
    """`CostModel.stage_budgets` deals layers as `split_layers` does (28 layers over pp 3: 10, 9,
    9), shards model states over dp x cp replicas, and InfiniPipe's layout, ChunkFlow's memory
    rows, the baselines' limits and the validator read their states from it (InfiniPipe's layout
    once gave every stage 28 // 3 layers)."""
    from lengthwise.planners import PlanRequest
    from lengthwise.planners.chunkflow.build import stage_memory_bytes
    from lengthwise.planners.infinipipe.grouping import layout
    from lengthwise.specs import ParallelScheme

    cm = cost(gpus=24)
    budgets = cm.stage_budgets(tp=2, pp=3, replicas=4 * 1, zero=1)
    assert [b.layers for b in budgets] == [10, 9, 9]
    assert [(b.first, b.last) for b in budgets] == [(True, False), (False, False), (False, True)]
    for b in budgets:
        assert b.states == cm.model_state_bytes(layers=b.layers, tp=2, dp=4, zero=1, first=b.first, last=b.last)
        assert b.free == pytest.approx(cm.capacity_bytes - b.states)
        assert b.remat_per_token == pytest.approx(cm.activation_bytes_per_token(layers=1, tp=2)
                                                  - cm.activation_bytes_per_token(layers=1, tp=2, recompute_layers=1)
                                                  + cm.model.ffn * 2 / 2)  # and the product
    # the loss's backward on the last stage, one layer's SwiGLU and down projection's backward
    # (beside its gathered output gradient) beside the residual stream's gradient (this rank's
    # rows) elsewhere (per token; the blocked loss's bounded block and weight gradient come per chunk)
    assert budgets[-1].backward_work_per_token == mem.backward_work_bytes_per_token(cm.model, 2, layers=9, head=True)
    assert budgets[-1].backward_work_per_token >= 6 * cm.model.hidden
    assert budgets[0].backward_work_per_token == 3 * cm.model.ffn * 2 / 2 + cm.model.hidden * 2 + cm.model.hidden * 2 / 2
    # fp32 gradients of the stage's parameters, the first stage's embedding whole on both TP ranks
    for b in budgets:
        whole_table = cm.model.vocab * cm.model.hidden / 2 if b.first else 0
        held = mem.stage_params(cm.model, layers=b.layers, tp=2, first=b.first, last=b.last)
        assert b.grads == pytest.approx(4 * (held + whole_table), rel=1e-12)
    request = PlanRequest(lengths=[1000] * 8, cost=cm, model=cm.model, cluster=cm.cluster, scheme=ParallelScheme(dp=4, tp=2, pp=3), context_length=4096)
    lay = layout(request, 4)
    assert [(st.layers, st.states) for st in lay.stages] == [(b.layers, b.states) for b in budgets]
    assert [row[0] for row in stage_memory_bytes(request, 1024, 1, 1000)] == [b.states for b in budgets]


def test_rows_tp_does_not_divide_keep_a_padded_copy_of_the_attention_output():
    """Under tensor parallelism a row is padded to a multiple of tp, and the output projection
    keeps a zero-padded copy of the attention output beside the unpadded one flash attention
    keeps: q_dim / tp bf16 values per padded row and layer that keeps its activations (the
    Qwen2.5-7B packing rank of 27,459 tokens measured 0.64 GiB above the simulator over its 7
    layers before the cost model counted it). Even rows, CP and tp = 1 keep none."""
    cm = CostModel(model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster_preset("h100", 8))
    odd, even = Chunk((Segment(0, 0, 27459),)), Chunk((Segment(0, 0, 27460),))
    per_token = cm.activation_bytes_per_token(layers=7, tp=2)
    copy = 27460 * cm.model.q_dim * 2 / 2
    assert cm.activation_bytes(odd, layers=7, tp=2) == pytest.approx(per_token * 27459 + 7 * copy, rel=1e-12)
    assert 7 * copy / 2**30 == pytest.approx(0.6416, abs=1e-4)
    assert cm.activation_bytes(even, layers=7, tp=2) == per_token * 27460
    assert cm.activation_bytes(odd, layers=7, tp=1) == cm.activation_bytes_per_token(layers=7) * 27459
    # recomputed layers keep only their input; the one a backward re-materialises has its copy
    assert cm.activation_bytes(odd, layers=7, tp=2, recompute_layers=3) == pytest.approx(
        cm.activation_bytes_per_token(layers=7, tp=2, recompute_layers=3) * 27459 + 4 * copy, rel=1e-12)
    assert cm.recompute_transient_bytes(odd, tp=2, recompute_layers=3) == pytest.approx(
        cm.recompute_transient_bytes_per_token(tp=2, recompute_layers=3) * 27459 + copy, rel=1e-12)
    # the simulator's elementwise form gives the same floats
    rows = cm.activation_bytes_rows(np.array([27459.0, 27460.0]), layers=7, tp=2)
    assert rows.tolist() == [cm.activation_bytes(odd, layers=7, tp=2), cm.activation_bytes(even, layers=7, tp=2)]


def test_replicated_kv_projections_count_whole_on_each_tp_rank(monkeypatch):
    """Qwen2.5-7B has 4 K/V heads: at tp 8 the executor replicates the K/V projections
    (`mem.kv_replicated`), and a rank holds and computes them whole, exceeding the 1/tp figure
    by exactly (1 - 1/tp) of them; at tp <= 4 nothing changes, to the bit."""
    import lengthwise.cost.model_time as model_module
    from lengthwise.cost.flops import replicated_kv_flops

    cm = cost()
    m = cm.model
    assert m.num_kv_heads == 4 and m.qkv_bias
    kv_per_layer = 2 * m.kv_dim * (m.hidden + 1)  # k_proj and v_proj weights and biases
    assert mem.kv_params_per_layer(m) == kv_per_layer
    chunk = Chunk((Segment(0, 0, 3000), Segment(1, 0, 1000)))
    split = {}  # tp -> (params, forward s, backward s) with the K/V projections counted split
    with monkeypatch.context() as patch:
        patch.setattr(mem, "kv_replicated", lambda model, tp: False)
        for tp in (1, 2, 4, 8):
            split[tp] = (mem.stage_params(m, layers=7, tp=tp, first=True, last=True),
                         mem.grad_params(m, layers=7, tp=tp, first=True, last=True),
                         cm.forward_time(chunk, layers=7, tp=tp), cm.backward_time(chunk, layers=7, tp=tp))
    for tp in (1, 2, 4):
        assert not mem.kv_replicated(m, tp)
        assert replicated_kv_flops(m, 4000, tp) == 0.0
        assert (mem.stage_params(m, layers=7, tp=tp, first=True, last=True),
                mem.grad_params(m, layers=7, tp=tp, first=True, last=True),
                cm.forward_time(chunk, layers=7, tp=tp), cm.backward_time(chunk, layers=7, tp=tp)) == split[tp]
    assert mem.kv_replicated(m, 8)
    extra = 7 * kv_per_layer * (1 - 1 / 8)
    params, grads, fwd, bwd = split[8]
    assert mem.stage_params(m, layers=7, tp=8, first=True, last=True) == pytest.approx(params + extra, rel=1e-12)
    assert mem.grad_params(m, layers=7, tp=8, first=True, last=True) == pytest.approx(grads + extra, rel=1e-12)
    held = cm.model_state_bytes(layers=7, tp=8, dp=4, zero=1, first=True, last=True)
    with monkeypatch.context() as patch:
        patch.setattr(mem, "kv_replicated", lambda model, tp: False)
        assert held - cm.model_state_bytes(layers=7, tp=8, dp=4, zero=1, first=True, last=True) == \
            pytest.approx(extra * (2 + 4 + 12 / 4), rel=1e-9)  # bf16 weights, fp32 grads, sharded master + Adam
    # FLOPs: the K/V projections' 2 * hidden * 2 * kv_dim per token, (1 - 1/tp) of them beyond the split
    assert replicated_kv_flops(m, 4000, 8) == 2 * m.hidden * 2 * m.kv_dim * 4000 * (1 - 1 / 8)
    lin_eff = cm.throughput.linear_efficiency(4000, 8)
    peak = cm.cluster.peak_tflops * 1e12
    kv_s = 7 * replicated_kv_flops(m, 4000, 8) / (peak * lin_eff)
    assert kv_s > 0.01 * fwd
    assert cm.forward_time(chunk, layers=7, tp=8) == pytest.approx(fwd + kv_s, rel=1e-12)
    assert cm.backward_time(chunk, layers=7, tp=8) == pytest.approx(bwd + cm.bwd_linear_ratio * kv_s, rel=1e-12)
    assert model_module.mem is mem
