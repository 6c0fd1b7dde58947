"""The slimpack planner (slimpack.txt §4-§5): Phase 1 balance and DP-Merge, equal-FLOPs forward
and backward MicroPacks with exact slice boundaries, the backward nesting rule, FIFO/FILO order,
the PackFlow schedule and the simulated sweep over the MicroPack count."""

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, SHARDED, Chunk, Segment, StepPlan
from lengthwise.plan.schedule_checks import check_schedule
from lengthwise.plan.validate import memory_overflow, validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.slimpack.build import build_pipeline, flops_models
from lengthwise.plan.validate import check_backward_units
from lengthwise.planners.slimpack.cuts import PrefixCost
from lengthwise.planners.slimpack.dp import RankGroup
from lengthwise.planners.slimpack.planner import sweep_counts
from lengthwise.sim import simulate_plan
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset
from lengthwise.workloads import get_profile

K = 1024


def request(lengths, *, dp=2, tp=1, pp=2, context=64 * K, model="qwen2.5-0.5b", **options):
    scheme = ParallelScheme(dp=dp, tp=tp, pp=pp)
    cluster = cluster_preset("h100", scheme.num_gpus)
    cost = CostModel(model=MODEL_PRESETS[model], cluster=cluster)
    return PlanRequest(lengths=list(lengths), model=cost.model, cluster=cluster, scheme=scheme,
                       cost=cost, context_length=context, options=options)


def plan(lengths, **kw) -> tuple[StepPlan, PlanRequest]:
    req = request(lengths, **kw)
    out = get_planner("slimpack")(req)
    validate_plan(out, req.cost)
    for pipe in out.pipelines:
        if pipe.backward_chunks is not None:
            check_backward_units(pipe.chunks, pipe.backward_chunks)
    return out, req


def sample(profile, n, context, seed=0):
    return [int(x) for x in get_profile(profile).sample(n, np.random.default_rng(seed), below=context + 1)]


def one_token_flops(g: PrefixCost, lengths) -> float:
    """FLOPs of the most expensive single token of the batch: the tolerance of a cut."""
    return float(g.slice(max(lengths) - 1, max(lengths)))


# ---- exact slice boundaries ----

def test_prefix_cost_matches_the_cost_model_on_any_slice():
    req = request([1])
    gf, gb = flops_models(req)
    layers = req.model.num_layers
    for start, stop in [(0, 1), (0, 4096), (1000, 1001), (12_345, 65_536), (500_000, 1_048_576)]:
        chunk = Chunk((Segment(0, start, stop),))
        assert gf.slice(start, stop) == pytest.approx(req.cost.forward_flops(chunk, layers=layers, head=True), rel=1e-12)
        assert gb.slice(start, stop) == pytest.approx(req.cost.backward_flops(chunk, layers=layers, head=True), rel=1e-12)


def test_slice_end_solves_the_quadratic_exactly():
    gf, _ = flops_models(request([1]))
    x = np.array([0, 1, 2, 17, 4096, 100_000, 1_048_576], dtype=np.float64)
    assert np.allclose(gf.inverse(gf.of(x)), x, rtol=0, atol=1e-6 * np.maximum(x, 1))


# ---- validity on random and adversarial batches ----

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 60_000), min_size=1, max_size=40), dp=st.sampled_from([1, 2, 3]),
       pp=st.sampled_from([1, 2, 4]), count=st.integers(1, 24), asymmetric=st.booleans())
@example(lengths=[35015, 60000], dp=1, pp=1, count=1, asymmetric=False)  # one MicroPack of both: 0.4 MB over
@example(lengths=[60_000] * 40, dp=1, pp=1, count=1, asymmetric=True)
def test_every_plan_validates(lengths, dp, pp, count, asymmetric):
    out, _ = plan(lengths, dp=dp, tp=2, pp=pp, context=60_000, num_micropacks=count, asymmetric=asymmetric)
    assert sum(p.num_gpus for p in out.pipelines) <= dp * 2 * pp


def test_num_micropacks_rises_to_the_smallest_count_whose_micropacks_fit():
    # each sample fits a GPU alone (Phase 1), but one MicroPack of all of them does not
    # ([35015, 60000], 2) and ([60_000] * 40, 31) until the LM head's loss was blocked
    # (`runtime/loss.head_loss_sum`) and stopped keeping 6 x vocab bytes a token;
    # ([64_000, 80_000], 2) and ([60_000] * 40, 19) until a layer kept the SwiGLU's gate and up
    # but not their product (`runtime/layer_ops.SwiGLUDown`)
    for lengths, fitting in [([88_000, 100_000], 2), ([60_000] * 40, 14)]:
        out, req = plan(lengths, dp=1, tp=2, pp=1, context=max(lengths), num_micropacks=1)
        assert out.metrics["micropacks"] == [fitting]
        models = flops_models(req)
        group = RankGroup(ranks=1, seq_ids=list(range(len(lengths))))
        fewer = build_pipeline(req, group, fitting - 1, models, models[0].of(np.array(lengths)), True)
        assert memory_overflow(fewer, req.cost, num_layers=req.model.num_layers, dp=1, zero=req.scheme.zero) is not None
    out, _ = plan([60_000] * 40, dp=1, tp=2, pp=1, context=60_000, num_micropacks=32)
    assert out.metrics["micropacks"] == [32]  # a count that fits is kept


def million_token_outlier_plan():
    lengths = [1 << 20] + sample("github", 127, 32 * K, seed=3)
    return plan(lengths, dp=8, tp=4, pp=4, context=1 << 20, model="llama2-7b", max_micropacks=32)


def test_single_million_token_outlier_is_merged_over_ranks_and_sharded():
    out, _ = million_token_outlier_plan()
    merged = [p for p in out.pipelines if p.cp > 1]
    assert len(merged) == 1 and merged[0].num_gpus == merged[0].cp * 4 * 4
    assert out.num_gpus == 128
    segs = [s for c in merged[0].chunks for s in c.segments]
    assert all(s.cp_rank == SHARDED for s in segs if s.seq_id == 0)
    assert all(s.cp_rank != SHARDED for s in segs if s.seq_id != 0)  # others stay whole on one CP rank
    assert out.metrics["dp_merge"] == [{"seq_ids": [0], "ranks": merged[0].cp, "cp": merged[0].cp}]


def test_merged_pipeline_is_charged_context_parallel_communication():
    out, req = million_token_outlier_plan()
    result = simulate_plan(out, req.cost)
    tl = result.timeline
    p = next(i for i, pipe in enumerate(out.pipelines) if pipe.cp > 1)
    assert tl.comm[tl.tasks.pipeline == p].sum() > 0
    assert result.fits


def test_all_short_batch_packs_whole_samples_without_merging():
    out, _ = plan(sample("tiny", 300, 512, seed=1), dp=2, pp=2, context=512, max_micropacks=16)
    assert out.metrics["dp_merge"] == [] and all(p.cp == 1 for p in out.pipelines)
    assert out.metrics["forms"]["slim"] == 0  # no sample outweighs a MicroPack's budget


def test_bimodal_chatqa2_batch_validates_and_balances():
    out, _ = plan(sample("chatqa2", 128, 64 * K, seed=2), dp=4, pp=2, context=64 * K, max_micropacks=32)
    flops = out.metrics["forward_flops_per_pipeline"]
    assert max(flops) / min(flops) < 1.05


def test_sequence_longer_than_the_context_is_a_user_error():
    with pytest.raises(UserError, match="sequence 1 has 5000 tokens > context length 4096"):
        plan([100, 5000], context=4096, num_micropacks=4)


# ---- budgets: forward and backward MicroPacks of equal FLOPs ----

def budget_errors(units: list[Chunk], g: PrefixCost) -> np.ndarray:
    flops = np.array([sum(float(g.slice(s.start, s.stop)) for s in u.segments) for u in units])
    return np.abs(flops - flops.sum() / len(flops))


@pytest.mark.parametrize("profile,context", [("github", 128 * K), ("commoncrawl", 64 * K), ("chatqa2", 64 * K)])
def test_forward_micropacks_hold_the_budget_to_one_token(profile, context):
    lengths = sample(profile, 200, context, seed=4)
    out, req = plan(lengths, dp=2, pp=4, context=context, model="llama2-7b", tp=4, num_micropacks=24)
    gf, _ = flops_models(req)
    for pipe in out.pipelines:
        assert len(pipe.chunks) == 24
        # every MicroPack, the last one included, within one token's FLOPs of the budget
        assert budget_errors(pipe.chunks, gf).max() <= one_token_flops(gf, lengths)


@pytest.mark.parametrize("profile,context", [("github", 128 * K), ("commoncrawl", 64 * K), ("chatqa2", 64 * K)])
def test_backward_micropacks_hold_the_backward_budget_to_one_token(profile, context):
    lengths = sample(profile, 200, context, seed=5)
    out, req = plan(lengths, dp=2, pp=4, context=context, model="llama2-7b", tp=4, num_micropacks=24)
    _, gb = flops_models(req)
    for pipe in out.pipelines:
        assert len(pipe.backward_chunks) == 24
        assert budget_errors(pipe.backward_chunks, gb).max() <= one_token_flops(gb, lengths)


def test_asymmetric_partitioning_balances_the_backward_that_forward_packs_skew():
    lengths = sample("github", 200, 128 * K, seed=6)
    out, req = plan(lengths, dp=1, pp=4, context=128 * K, model="llama2-7b", tp=8, num_micropacks=16)
    _, gb = flops_models(req)
    pipe = out.pipelines[0]
    budget = sum(float(gb.slice(s.start, s.stop)) for c in pipe.chunks for s in c.segments) / 16
    # the forward MicroPacks' own backward FLOPs spread far wider than the regrouped units'
    assert budget_errors(pipe.chunks, gb).max() > 100 * budget_errors(pipe.backward_chunks, gb).max()
    assert budget_errors(pipe.chunks, gb).max() > 0.01 * budget


# ---- the backward grouping rule and order ----

def test_backward_segments_nest_inside_forward_segments():
    chunks = [Chunk((Segment(0, 0, 10),)), Chunk((Segment(0, 10, 20), Segment(1, 0, 5)))]
    check_backward_units(chunks, [Chunk((Segment(0, 12, 20), Segment(1, 0, 5))), Chunk((Segment(0, 10, 12),)),
                                  Chunk((Segment(0, 0, 10),))])
    with pytest.raises(UserError, match="not inside one forward segment"):
        check_backward_units(chunks, [Chunk((Segment(0, 5, 15),))])
    with pytest.raises(UserError, match="same CP placement"):
        check_backward_units(chunks, [Chunk((Segment(1, 0, 5, cp_rank=1),))])


def test_backward_is_filo_within_a_sample_and_fifo_across_samples():
    lengths = sample("github", 120, 128 * K, seed=7)
    out, _ = plan(lengths, dp=2, pp=2, context=128 * K, model="llama2-7b", tp=4, num_micropacks=20)
    for pipe in out.pipelines:
        first_fwd, first_bwd, starts = {}, {}, {}
        for c, chunk in enumerate(pipe.chunks):
            for s in chunk.segments:
                first_fwd.setdefault(s.seq_id, c)
        for u, unit in enumerate(pipe.backward_chunks):
            for s in unit.segments:
                first_bwd.setdefault(s.seq_id, u)
                starts.setdefault(s.seq_id, []).append((u, s.start))
        for pairs in starts.values():  # a later unit never holds a later slice of the sample
            ordered = sorted(pairs, key=lambda p: (p[0], -p[1]))
            assert [p[1] for p in ordered] == sorted((p[1] for p in pairs), reverse=True)
        by_fwd = sorted(first_fwd, key=lambda q: first_fwd[q])
        assert [first_bwd[q] for q in by_fwd] == sorted(first_bwd[q] for q in by_fwd)


def test_backward_unit_waits_for_all_forwards_of_its_samples():
    out, _ = plan(sample("github", 80, 128 * K, seed=8), dp=1, pp=4, context=128 * K, model="llama2-7b", tp=4,
                  num_micropacks=16)
    pipe = out.pipelines[0]
    last_fwd = {}
    for c, chunk in enumerate(pipe.chunks):
        for s in chunk.segments:
            last_fwd[s.seq_id] = c
    for acts in pipe.stages:
        done = set()
        for a in acts:
            if a.kind == FORWARD:
                done.add(a.chunk)
            else:
                seqs = {s.seq_id for s in pipe.backward_chunks[a.chunk].segments}
                assert all(last_fwd[q] in done for q in seqs)
    check_schedule(pipe.stages, pipe.chunks, pipe.backward_chunks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 64), st.booleans())
@example([1, 1, 1], 7, False)
@example([4000], 64, True)
def test_readiness_read_off_the_cuts_is_the_dependency_scan(lengths, count, merged):
    """backward_units_ready's per-unit forward prefix equals schedule.forwards_needed's scan of
    the chunks, and its units equal backward_units' (the planner schedules from the former)."""
    from lengthwise.planners.slimpack.cuts import (Stream, backward_cuts, backward_units, backward_units_ready,
                                                   forward_chunks, forward_cuts)
    from lengthwise.planners.slimpack.schedule import forwards_needed
    gf, gb = flops_models(request([1]))
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if merged else list(range(len(lengths)))
    stream = Stream.of(order, lengths)
    n = min(count, stream.total_tokens)
    fcuts, bcuts = forward_cuts(stream, gf, n), backward_cuts(stream, gb, n)
    chunks = forward_chunks(stream, fcuts)
    units, ready = backward_units_ready(stream, bcuts, fcuts)
    assert units == backward_units(stream, bcuts, fcuts)
    check_backward_units(chunks, units)
    assert ready == forwards_needed(chunks, units)
    assert sorted((s.seq_id, s.start, s.stop) for c in chunks for s in c.segments if s.stop > s.start) == \
        sorted((s.seq_id, s.start, s.stop) for c in chunks for s in c.segments)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=12),
       st.lists(st.sampled_from([1.0, 2.0, 3.0, 1e9, 7e9, 0.1, 1e-3]), min_size=1, max_size=60))
def test_weighted_lpt_by_heaps_is_the_scan(ranks, sizes):
    """dp._weighted_lpt (a heap per group size) places every sample where the plain scan over
    all groups by ((load + f) / ranks, index) does, ties included."""
    from lengthwise.planners.slimpack.dp import _weighted_lpt
    flops = np.asarray(sizes + [5.0] * len(ranks))
    pre = list(range(len(sizes), len(flops)))  # one preloaded sample per merged group, as outliers are
    groups = [RankGroup(ranks=r, seq_ids=[pre[g]] if r > 1 else []) for g, r in enumerate(ranks)]
    order = sorted(range(len(sizes)), key=lambda i: (-flops[i], i))
    _weighted_lpt(groups, order, flops)
    want = [RankGroup(ranks=r, seq_ids=[pre[g]] if r > 1 else []) for g, r in enumerate(ranks)]
    loads = [w.load(flops) for w in want]
    for i in order:
        g = min(range(len(want)), key=lambda k: ((loads[k] + flops[i]) / want[k].ranks, k))
        want[g].seq_ids.append(i)
        loads[g] += float(flops[i])
    assert [g.seq_ids for g in groups] == [w.seq_ids for w in want]


def test_lean_schedule_holds_fewer_forwards_in_flight_than_steady():
    lengths = sample("github", 120, 128 * K, seed=9)

    def most_in_flight(schedule):
        out, _ = plan(lengths, dp=1, pp=4, context=128 * K, model="llama2-7b", tp=4, num_micropacks=32,
                      schedule=schedule)
        acts = out.pipelines[0].stages[0]
        counts = np.cumsum([1 if a.kind == FORWARD else 0 for a in acts])
        backs = np.cumsum([1 if a.kind == BACKWARD else 0 for a in acts])
        return (counts - backs).max(), (counts - backs)[len(acts) // 2]

    steady, lean = most_in_flight("steady"), most_in_flight("lean")
    assert steady[0] == lean[0]          # the first sample's run-ahead is the same
    assert lean[1] < steady[1]           # but lean gives it back, steady keeps it


# ---- Phase 1 and DP-Merge ----

def test_phase1_gives_every_rank_equal_forward_flops():
    out, _ = plan(sample("commoncrawl", 512, 64 * K, seed=10), dp=8, pp=1, context=64 * K, num_micropacks=8)
    flops = out.metrics["forward_flops_per_pipeline"]
    assert max(flops) / min(flops) < 1.01


def test_outlier_heavier_than_a_rank_share_merges_ceil_of_its_share():
    gf, _ = flops_models(request([1]))
    lengths = [60_000] + [2000] * 200
    flops = gf.of(np.array(lengths))
    share = flops[0] / (flops.sum() / 4)
    assert 1 < share < 2
    out, _ = plan(lengths, dp=4, tp=2, pp=1, context=64 * K, num_micropacks=8)
    assert out.metrics["dp_merge"] == [{"seq_ids": [0], "ranks": int(np.ceil(share)), "cp": int(np.ceil(share))}]
    assert out.num_gpus == 4 * 2


def test_dp_merge_off_keeps_the_outlier_on_one_rank():
    out, _ = plan([60_000] + [2000] * 200, dp=4, tp=2, pp=1, context=64 * K, num_micropacks=8, dp_merge=False)
    assert all(p.cp == 1 for p in out.pipelines) and len(out.pipelines) == 4


def test_compute_merge_is_kept_only_when_the_simulator_finds_it_faster():
    out, _ = plan([60_000] + [2000] * 200, dp=4, tp=2, pp=1, context=64 * K, max_micropacks=8)
    variants = out.metrics["phase1_variants"]
    assert [len(v["dp_merge"]) for v in variants] == [1, 0]  # the paper's merge, then memory-only
    best = min(variants, key=lambda v: v["step_time_s"])
    assert out.metrics["dp_merge"] == best["dp_merge"]
    assert out.metrics["predicted_step_time_s"] == best["step_time_s"]


# ---- the MicroPack count sweep ----

def test_sweep_counts_are_log_spaced_from_pp():
    assert sweep_counts(4, 128) == [4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128]
    assert sweep_counts(1, 5) == [1, 2, 3, 4, 5]


def test_sweep_keeps_per_pipeline_the_fastest_count_that_fits():
    lengths = sample("github", 160, 64 * K, seed=11)
    out, req = plan(lengths, dp=2, pp=4, context=64 * K, model="llama2-7b", tp=4, max_micropacks=32)
    table = out.metrics["sweep"]
    swept = [r["micropacks"] for r in table if not r["lean"]]
    assert swept == sweep_counts(4, 32)[:len(swept)]  # in order, maybe stopped early past the best
    result = simulate_plan(out, req.cost)
    assert result.fits
    fitting = [r["step_time_s"] for r in table if r["fits"]]
    assert result.step_time_s <= min(fitting) * (1 + 1e-9)
    assert out.metrics["predicted_step_time_s"] == pytest.approx(result.step_time_s)


@pytest.mark.parametrize("seed", [1, 5, 6])  # batches whose pipelines keep different counts (3 keeps one since
# the built-in curve was fitted to the H200 profiles, 7 since a layer keeps gate and up, not their product)
def test_mixed_counts_step_time_is_composed_exactly(seed):
    """Pipelines that keep different counts: the predicted step is composed from each pipeline's
    own candidate simulation, and equals simulating the mixed plan, to the bit."""
    out, req = plan(sample("github", 120, 64 * K, seed=seed), dp=4, pp=2, context=64 * K, model="llama2-7b", tp=4)
    assert len(set(out.metrics["micropacks"])) > 1
    assert out.metrics["predicted_step_time_s"] == simulate_plan(out, req.cost).step_time_s


def test_plans_are_deterministic():
    lengths = sample("chatqa2", 64, 64 * K, seed=12)

    def as_json(p):
        d = p.to_dict()
        d["metrics"].pop("planning_ms")
        return json.dumps(d, sort_keys=True)

    assert as_json(plan(lengths, dp=2, tp=2, max_micropacks=16)[0]) == as_json(plan(lengths, dp=2, tp=2, max_micropacks=16)[0])


def test_micropack_time_rsd_is_reported_per_pipeline():
    out, _ = plan(sample("github", 200, 128 * K, seed=13), dp=2, pp=4, context=128 * K, model="llama2-7b", tp=4,
                  num_micropacks=24)
    rsd = out.metrics["micropack_rsd"]
    assert set(rsd) == {"forward_time_pct", "backward_time_pct", "tokens_pct"}
    assert 0 <= rsd["forward_time_pct"] < rsd["tokens_pct"]  # equal work, unequal tokens


# ---- options ----

@pytest.mark.parametrize("options,message", [
    ({"chunk_size": 4}, "no option chunk_size"),
    ({"schedule": "fast"}, "schedule must be one of"),
    ({"max_micropacks": 1}, "below pp=2"),
    ({"asymmetric": "yes"}, "asymmetric must be true or false"),
    ({"num_micropacks": 0}, "num_micropacks must be a positive integer"),
])
def test_bad_options_are_user_errors(options, message):
    with pytest.raises(UserError, match=message):
        get_planner("slimpack")(request([100, 200], **options))


def test_dp_merge_shares_a_merged_group_when_long_samples_outnumber_the_ranks():
    from lengthwise.planners.slimpack.dp import merge_sizes

    # five samples that each need 2 merged ranks, dp = 4: two groups of 2, the rest join them
    flops = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.1, 0.1])
    floor = np.array([2, 2, 2, 2, 2, 1, 1])
    groups = merge_sizes(flops, floor, floor, 4, by_flops=False)
    assert sorted(i for ids, _ in groups for i in ids) == [0, 1, 2, 3, 4]
    assert sum(m for _, m in groups) <= 4 and all(m >= 2 for _, m in groups)


def test_dp_merge_refuses_only_when_no_group_holds_the_floor():
    from lengthwise.planners.slimpack.dp import merge_sizes

    flops = np.array([5.0, 4.0])
    # the floor-3 sample takes 3 of 4 ranks first; the floor-2 one then shares its group
    assert merge_sizes(flops, np.array([2, 3]), np.array([2, 3]), 4, by_flops=False) == [([1, 0], 3)]
    with pytest.raises(UserError, match="needs 3 merged DP ranks"):
        merge_sizes(flops, np.array([2, 3]), np.array([2, 3]), 2, by_flops=False)


# ---- the numpy MicroPacks are the pointer walks' ----

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=40), count=st.integers(1, 80),
       seed=st.integers(0, 2**16))
@example(lengths=[3, 1, 2], count=7, seed=0)  # more MicroPacks than one token's FLOPs allow: equal cuts
def test_stream_pieces_match_the_walks_and_the_simulators_derivations(lengths, count, seed):
    from lengthwise.plan.schedules import dependencies
    from lengthwise.planners.slimpack.cuts import (Stream, backward_cuts, backward_units_ready, forward_chunks,
                                                   forward_cuts)
    from lengthwise.planners.slimpack.pieces import stream_pieces
    from lengthwise.sim.memory import split_sequences

    req = request([1])
    gf, gb = flops_models(req)
    ids = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    stream = Stream.of(ids, lengths)
    fcuts, bcuts = forward_cuts(stream, gf, count), backward_cuts(stream, gb, count)
    chunks, units, ready, known = stream_pieces(stream, fcuts, bcuts, {})
    assert chunks == forward_chunks(stream, fcuts)
    assert (units, ready) == backward_units_ready(stream, bcuts, fcuts)
    if known is None:  # only where two cuts coincide
        assert np.any(np.diff(fcuts) == 0)
        return
    assert known.deps == dependencies(chunks, units)
    assert known.splits.sequences() == split_sequences(chunks, units)
    for pieces, counts, bounds in ((chunks, known.fwd_counts, known.fwd_bounds),
                                   (units, known.bwd_counts, known.bwd_bounds)):
        assert counts.tolist() == [len(c.segments) for c in pieces]
        assert bounds.tolist() == [[s.start, s.stop] for c in pieces for s in c.segments]
    # the cells (a MicroPack's part one backward unit holds) the simulator frees one by one
    from lengthwise.sim.inputs import segment_cells
    assert [x.tolist() for x in known.cells] == [x.tolist() for x in segment_cells(chunks, units)]
    assert known.cells[2].sum() == sum(c.num_tokens for c in chunks)


def test_sweep_simulates_with_the_planners_slice_structure_as_without():
    from lengthwise.planners.slimpack.build import build_candidate, prepare_stream
    from lengthwise.planners.slimpack.build import bare_plan, phase1_variants

    req = request(sample("github", 48, 32 * K), dp=3, pp=2, context=32 * K)
    models = flops_models(req)
    variants, flops = phase1_variants(req, models, True)
    groups = variants[0]
    for count in (2, 5, 11):
        built = [build_candidate(req, g, count, models, flops, True, check=False,
                                 prepared=prepare_stream(req, g, flops)) for g in groups]
        assert any(k is not None for _, k in built)
        step = bare_plan(req, [p for p, _ in built])
        a = simulate_plan(step, req.cost, known=[k for _, k in built])
        b = simulate_plan(step, req.cost)
        assert a.to_dict() == b.to_dict()
        assert np.array_equal(a.timeline.memory.level, b.timeline.memory.level)


def test_cell_sizes_batched_over_pipelines_are_each_pipelines_own(monkeypatch):
    """sim/cell_costs.py sizes every pipeline's cells in one pass per stage kind and
    sim/cell_inputs.py lays out their inputs together: every duration, hand-off and memory size
    is the one each pipeline's own `_PipelineCosts.build` gives, float for float."""
    import lengthwise.sim.inputs as inputs
    from lengthwise.planners.slimpack.build import bare_plan, build_candidate, phase1_variants, prepare_stream

    req = request(sample("github", 48, 32 * K), dp=3, pp=2, context=32 * K)
    models = flops_models(req)
    variants, flops = phase1_variants(req, models, True)
    built = [build_candidate(req, g, 5, models, flops, True, check=False, prepared=prepare_stream(req, g, flops))
             for g in variants[0]]
    step, known = bare_plan(req, [p for p, _ in built]), [k for _, k in built]
    seeded = []
    batched = inputs.batched_cell_sizes

    def recording(plan, cm, structures, tables):
        batched(plan, cm, structures, tables)
        seeded.extend(i for i, t in enumerate(tables) if any(k[0] == "cells batched" for k in t if isinstance(k, tuple)))

    built_together = []
    celled = inputs.celled_inputs
    monkeypatch.setattr(inputs, "batched_cell_sizes", recording)
    monkeypatch.setattr(inputs, "celled_inputs", lambda *args: built_together.append(celled(*args)) or built_together[-1])
    together = inputs.plan_inputs(step, req.cost, known)
    assert seeded, "no pipeline took the batched cell sizes"
    assert built_together[0], "no pipeline's inputs were built together"
    monkeypatch.setattr(inputs, "batched_cell_sizes", lambda *args: None)
    alone = inputs.plan_inputs(step, req.cost, known)
    # sim/cell_inputs.py builds these pipelines' inputs together; alone, `_PipelineCosts.build` does
    assert len(together) == len(alone)
    for a, b in zip(together, alone):
        for name in ("dur", "comm", "send"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert (a.grad_sync, a.step_end, a.extra_comm, a.model_flops, a.num_gpus) == \
            (b.grad_sync, b.step_end, b.extra_comm, b.model_flops, b.num_gpus)
        assert a.sizes.state == b.sizes.state and a.sizes.grads == b.sizes.grads
        assert [dict(x) for x in a.sizes.kv] == b.sizes.kv and [dict(x) for x in a.sizes.kv_grad] == b.sizes.kv_grad
        for name in ("activation", "recompute_extra", "nograd_transient", "backward_work", "forward_work",
                     "cell_activation"):
            rows_a, rows_b = getattr(a.sizes, name), getattr(b.sizes, name)
            assert len(rows_a) == len(rows_b)
            assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(rows_a, rows_b)), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams=st.lists(st.lists(st.integers(1, 2000), min_size=1, max_size=12), min_size=1, max_size=5),
       count=st.integers(1, 30))
def test_streams_cuts_and_pieces_of_several_streams_are_each_streams_own(streams, count):
    from lengthwise.planners.slimpack.cuts import Stream, backward_cuts, forward_cuts, streams_cuts
    from lengthwise.planners.slimpack.pieces import stream_pieces, streams_pieces

    gf, gb = flops_models(request([1]))
    lengths = [n for s in streams for n in s]
    ids = np.cumsum([0] + [len(s) for s in streams]).tolist()
    made = [Stream.of(list(range(a, b)), lengths) for a, b in zip(ids[:-1], ids[1:])]
    fcuts = [forward_cuts(s, gf, count) for s in made]
    bcuts = [backward_cuts(s, gb, count) for s in made]
    counts = [min(count + i, s.total_tokens) for i, s in enumerate(made)]  # counts may differ
    for g, backward, one in ((gf, False, forward_cuts), (gb, True, backward_cuts)):
        for s, n, cuts in zip(made, counts, streams_cuts(made, g, counts, backward=backward, memo=[{} for _ in made])):
            assert cuts.tolist() == one(s, g, n).tolist()
    together = streams_pieces(made, fcuts, bcuts, [{} for _ in made])
    for s, f, b, got in zip(made, fcuts, bcuts, together):
        alone = stream_pieces(s, f, b, {})
        assert got[:3] == alone[:3]
        assert (got[3] is None) == (alone[3] is None)
        if got[3] is not None:
            assert got[3].deps == alone[3].deps and got[3].splits.sequences() == alone[3].splits.sequences()
            for name in ("fwd_counts", "fwd_bounds", "bwd_counts", "bwd_bounds"):
                assert np.array_equal(getattr(got[3], name), getattr(alone[3], name))
            assert all(np.array_equal(x, y) for x, y in zip(got[3].cells, alone[3].cells))


def test_memory_budgets_come_from_the_cost_models_stage_budgets():
    from lengthwise.planners.slimpack.build import memory_share_per_token, min_fitting_count

    req = request([1], dp=4, pp=2)
    cost, s = req.cost, req.scheme
    budgets = cost.stage_budgets(tp=s.tp, pp=s.pp, replicas=s.dp * s.cp, zero=s.zero)
    for hold in (1.0, 0.5):  # a HOLD share scales the capacity, model states are held whole
        want = max((b.activation_per_token + 2 * cost.kv_bytes(1, layers=b.layers, tp=s.tp))
                   / (b.capacity * hold - b.states) for b in budgets)
        assert memory_share_per_token(req, hold) == want
    # model states sharded over the plan's pipelines x cp ranks; one rank's tokens per MicroPack
    tokens, pipelines = 10**7, 3
    most = min(b.free / b.activation_per_token
               for b in cost.stage_budgets(tp=s.tp, pp=s.pp, replicas=pipelines * s.cp, zero=s.zero))
    assert min_fitting_count(req, tokens, 2, pipelines) == max(1, math.floor(tokens / (2 * most)))


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(1, 6), lean=st.booleans(), data=st.data())
def test_packflow_stages_at_once_are_each_stage_by_its_loop(pp, lean, data):
    from lengthwise.planners.slimpack.schedule import packflow_stage, packflow_stages

    chunks = data.draw(st.integers(1, 30))
    steps = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=40))
    ready = np.minimum(np.cumsum(steps), chunks).tolist()
    ready[-1] = chunks  # the last unit reads the last forward MicroPack
    assert packflow_stages(chunks, ready, pp, lean=lean) == [
        packflow_stage(chunks, ready, warmup=pp - s - 1, lean=lean) for s in range(pp)]


@st.composite
def packflow_pipelines(draw):
    """(forward MicroPacks, per backward unit the forward prefix it needs) of one pipeline."""
    chunks = draw(st.integers(1, 20))
    ready = sorted(draw(st.lists(st.integers(1, chunks), min_size=1, max_size=25)))
    ready[-1] = chunks
    return chunks, ready


@settings(max_examples=80, deadline=None)
@given(pipes=st.lists(packflow_pipelines(), min_size=1, max_size=8), pp=st.integers(1, 6), lean=st.booleans())
def test_packflow_schedules_of_many_pipelines_are_each_pipelines_own(pipes, pp, lean):
    from lengthwise.planners.slimpack.schedule import packflow_stages, packflow_stages_many

    many = packflow_stages_many([c for c, _ in pipes], [r for _, r in pipes], pp, lean=lean)
    assert many == [packflow_stages(c, r, pp, lean=lean) for c, r in pipes]


def test_fits_where_the_baselines_fit_under_dp_x_cp_with_zero2():
    """Skrull's 7B ChatQA2 setting (dp2 x cp16, ZeRO-2): SlimPack's pipelines are DP ranks, some
    DP-Merged, and ZeRO shards the states over all their CP ranks (the sum of the pipelines'
    cp, not pipelines x one pipeline's cp); its first MicroPack runs before any backward has made
    the gradients. The baselines fit this batch, and so must SlimPack (issue: a plan whenever
    another planner's fits the scheme)."""
    lengths = [14095, 2132, 107, 78, 21266, 26821, 13133, 17491, 11337, 28254, 21395, 66, 23572, 97, 17498,
               590, 23892, 11280, 3291, 8551, 91, 308, 15247, 14436, 13403, 6982, 32661, 31437, 15787, 14546,
               15894, 7272, 353, 17168, 10864, 3834, 9908, 25404, 28187, 5714]
    scheme = ParallelScheme(dp=2, cp=16, zero=2)
    cluster = cluster_preset("h100", scheme.num_gpus)
    cost = CostModel(model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster)
    req = PlanRequest(lengths=lengths, model=cost.model, cluster=cluster, scheme=scheme, cost=cost,
                      context_length=128 * K)
    assert simulate_plan(get_planner("static-cp")(req), cost).fits
    out = get_planner("slimpack")(req)
    validate_plan(out, cost)
    assert simulate_plan(out, cost).fits


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.one_of(st.integers(0, 10**6), st.floats(0, 1e12, allow_nan=False)), max_size=40),
                     max_size=30))
def test_mean_rsd_of_rows_taken_together_is_the_mean_of_each_rows(rows):
    from lengthwise.planners.slimpack.metrics import mean_rsd, rsd

    expected = float(np.mean([rsd(r) for r in rows])) if rows else 0.0
    assert mean_rsd(rows) == expected or (math.isnan(expected) and math.isnan(mean_rsd(rows)))
