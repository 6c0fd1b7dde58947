"""The hydraulis planner (hydraulis.txt §5-§7, appendices B-E): valid heterogeneous plans, MaxLen
respected, the §7 proposal, Algorithm 1 dispatch and eq. 1 packing (MILP vs greedy)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lengthwise.cost import CostModel, Profile, SchemeFit
from lengthwise.errors import UserError
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.hydraulis.cost import Scheme, make_scheme, paper_max_len, plan_exchange, scheme_space
from lengthwise.planners.hydraulis.arrays import PipelineArrays
from lengthwise.planners.hydraulis.dispatch import dispatch
from lengthwise.planners.hydraulis.packing import (
    PipelineLoad,
    estimate,
    greedy_pack,
    lpt_bins,
    micro_batch_range,
    milp_bins,
)
from lengthwise.planners.hydraulis.strategy import Histogram, propose, round_proposal
from lengthwise.planners.packing_utils import best_fit_decreasing
from lengthwise.sim.inputs import plan_inputs
from lengthwise.specs import MODEL_PRESETS, ClusterSpec, ParallelScheme, cluster_preset

K = 1024
CONTEXT = 32 * K
MODEL = MODEL_PRESETS["llama2-7b"]


def tp_costly_profile() -> Profile:
    """Measured-style fits where TP costs communication: per-token time falls slower than 1/tp,
    so short sequences are cheapest on small TP and long ones need large TP for memory."""
    schemes = {}
    for tp in (1, 2, 4, 8):
        slow = 1 + 0.25 * np.log2(tp)
        fwd = (2.5e-12 / tp, 2.0e-7 * slow / tp, 2e-5)
        schemes[f"tp{tp}-cp1"] = SchemeFit(fwd=fwd, bwd=tuple(2 * x for x in fwd), head_fwd=(4e-7 / tp, 1e-5),
                                           head_bwd=(8e-7 / tp, 1e-5))
    return Profile(device="test", model=MODEL.name, schemes=schemes)


def request(lengths, *, gpus=16, cluster=None, cost_profile=None, seed=0, **options) -> PlanRequest:
    cluster = cluster or cluster_preset("a800", gpus)
    cost = CostModel(model=MODEL, cluster=cluster, profile=cost_profile)
    return PlanRequest(lengths=list(lengths), model=MODEL, cluster=cluster, scheme=ParallelScheme(dp=cluster.num_gpus),
                       cost=cost, context_length=CONTEXT, seed=seed, options=options)


def plan(lengths, **kw):
    req = request(lengths, **kw)
    out = get_planner("hydraulis")(req)
    validate_plan(out, req.cost)
    return out, req


def heterogeneous_request(lengths) -> PlanRequest:
    """Cheap links (the exchange is negligible) and costly TP: a mixed strategy pays off."""
    cluster = ClusterSpec(name="fast-links", num_gpus=16, gpu_memory_gb=80, peak_tflops=312,
                          intra_bw_gbps=1e6, inter_bw_gbps=1e6)
    return request(lengths, cluster=cluster, cost_profile=tp_costly_profile())


def tokens_per_sequence(p) -> list[int]:
    counts = [0] * len(p.lengths)
    for pipe in p.pipelines:
        for chunk in pipe.chunks:
            for seg in chunk.segments:
                counts[seg.seq_id] += seg.num_tokens
    return counts


# ---- validity on random and adversarial batches ----

long_tail = st.one_of(st.integers(1, 600), st.integers(1, 4 * K), st.integers(1, CONTEXT))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(long_tail, min_size=1, max_size=60), seed=st.integers(0, 3),
       gpus=st.sampled_from([8, 16, 24]))
def test_every_token_planned_once_on_random_batches(lengths, seed, gpus):
    p, _ = plan(lengths, gpus=gpus, seed=seed, trials=8)
    assert tokens_per_sequence(p) == lengths
    assert p.num_gpus <= gpus


ADVERSARIAL = {
    "all-equal": [2048] * 40,
    "one-giant-outlier": [CONTEXT] + [37] * 60,
    "single-sequence": [5000],
    "all-length-one": [1] * 33,
    "fewer-than-pipelines": [300, 7],
    "all-at-context": [CONTEXT] * 5,
    "long-tail": [31000, 17000, 9000, 4100, 2050] + [900, 300, 120, 60, 2] * 12,
}


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_every_token_planned_once_on_adversarial_batches(case):
    p, _ = plan(ADVERSARIAL[case])
    assert tokens_per_sequence(p) == ADVERSARIAL[case]


def test_heterogeneous_plan_mixes_schemes_and_validates():
    lengths = [24000, 20000] + [int(x) for x in np.random.default_rng(0).integers(50, 2000, 150)]
    req = heterogeneous_request(lengths)
    p = get_planner("hydraulis")(req)
    validate_plan(p, req.cost)
    assert len({(q.tp, q.pp, q.cp) for q in p.pipelines}) > 1, p.metrics["strategy"]
    assert p.num_gpus <= 16 and p.zero == 1
    # §5.2's exchange is charged to every pipeline of a heterogeneous strategy, from the plan's
    # shape (the simulator's gradient term), not as extra communication
    assert all(max(i.grad_sync) > 0 and i.extra_comm == 0 for i in plan_inputs(p, req.cost))


def simulator_exchange(p, cost) -> list[float]:
    """What the simulator charges each pipeline for the exchange: its slowest stage's gradient
    reduction or exchange plus its extra communication (sim/simulate.py's step end)."""
    return [max(i.grad_sync) + i.extra_comm for i in plan_inputs(p, cost)]


@pytest.mark.parametrize("pipelines", [
    "tp2-pp1-cp2,tp2-pp1-cp2,tp1-pp2,tp1-pp2,tp1-pp1,tp1-pp1,tp1-pp1,tp1-pp1",  # cp > 1, across nodes
    "tp4-pp2,tp2-pp2,tp2-pp2",  # stage groups within one node and across
    "tp2-pp2,tp2-pp2,tp2-pp2,tp2-pp2",  # homogeneous: no LNK
])
def test_planner_charges_exactly_the_simulators_exchange(pipelines):
    lengths = [9000, 6000] + [int(x) for x in np.random.default_rng(1).integers(50, 3000, 60)]
    p, req = plan(lengths, pipelines=pipelines)
    pipes = [(q.tp, q.pp, q.cp) for q in p.pipelines]
    schemes = [make_scheme(req.cost, tp=tp, pp=pp, cp=cp, num_gpus=16, threshold=0.85) for tp, pp, cp in pipes]
    charged = simulator_exchange(p, req.cost)
    assert plan_exchange(req.cost, schemes, num_gpus=16) == charged
    assert p.metrics["exchange_s"] == max(charged)
    assert all(q.extra_comm_s == 0 for q in p.pipelines)


def test_a_heterogeneous_plan_is_charged_the_executors_exchange_not_an_all_reduce():
    """Each GPU of a heterogeneous plan pushes the bf16 gradients of what it holds and does not
    own to the owners (each element owned by one of its holders) and pulls their weights back:
    held - owned elements each way, the volume of a ring all-reduce among each element's holders.
    The cost model's count equals the executor's layout
    (runtime/parallel/hetero_layout.ExchangeLayout) within rounding, priced as two all-to-alls among the holders; no all-reduce on top (the
    simulator once charged both)."""
    import lengthwise.cost.memory as mem
    from lengthwise.runtime.parallel.hetero_layout import ExchangeLayout
    from lengthwise.runtime.parallel.hetero_reducer import plan_pipelines, strategy_holdings, whole_shapes

    lengths = [9000, 6000] + [int(x) for x in np.random.default_rng(1).integers(50, 3000, 60)]
    p, req = plan(lengths, pipelines="tp4-pp2,tp2-pp2,tp2-pp2")
    cm, world = req.cost, p.num_gpus
    shapes = whole_shapes(cm.model)
    holdings, dims = strategy_holdings(cm.model, plan_pipelines(p), list(shapes))
    layout = ExchangeLayout(shapes, holdings, dims=dims)
    holders = cm.hetero_holders([(q.tp, q.pp, q.cp) for q in p.pipelines])
    assert holders.split == 3
    rank = 0
    for q, inputs in zip(p.pipelines, plan_inputs(p, cm)):
        layers = q.stage_layers(cm.model.num_layers)
        for s, n in enumerate(layers):
            stage = dict(layers=n, tp=q.tp, first=s == 0, last=s == q.pp - 1)
            held, owned = layout.local_size[rank], layout.shard_size[rank]  # the stage's TP rank 0
            assert held == mem.stage_params(cm.model, **stage)
            # within rounding: 3 holders share each 1024-column band of a row-parallel weight,
            # 342 or 341 columns each, every row
            assert cm.hetero_owned(**stage, holders=holders) == pytest.approx(owned, rel=1e-3)
            sent = cm.exchange_bytes(**stage, holders=holders)
            assert sent == pytest.approx(2 * (held - owned) * 2, rel=1e-3)
            # about 2 (d - 1) / d of the held bf16 bytes, d = 3 holders of the split weights
            assert sent == pytest.approx(2 * 2 / 3 * held * 2, rel=1e-3)
            seconds = 2 * cm.collective_time("all_to_all", sent / 2 * 3 / 2, ranks=3, inter_node=world > 8)
            assert inputs.grad_sync[s] == pytest.approx(seconds)
            rank += q.tp * q.cp


def test_a_strategy_switch_is_charged_when_the_previous_batch_ran_another():
    """With the `previous` option (the training loop passes the strategy the last batch ran), a
    candidate with other pipelines pays the switch: the optimizer state's move to the new owners
    and the new layout's weight pull (cost.switch_time); the previous strategy itself pays
    nothing."""
    from lengthwise.planners.hydraulis.cost import parse_pipelines, pipelines_name, switch_time

    lengths = [9000, 6000] + [int(x) for x in np.random.default_rng(1).integers(50, 3000, 60)]
    first, req = plan(lengths)
    chosen = pipelines_name(first.pipelines)
    assert first.metrics["switch_s"] == 0
    same, _ = plan(lengths, previous=chosen)
    assert pipelines_name(same.pipelines) == chosen and same.metrics["switch_s"] == 0
    assert same.metrics["estimated_step_s"] == first.metrics["estimated_step_s"]
    other = "tp8-pp2" if chosen != "tp8-pp2" else "tp4-pp4"
    moved, _ = plan(lengths, previous=other)
    now = [(q.tp, q.pp, q.cp) for q in moved.pipelines]
    charge = switch_time(req.cost, parse_pipelines(other), now, num_gpus=16)
    assert (charge > 0) == (pipelines_name(moved.pipelines) != other)
    assert moved.metrics["switch_s"] == charge
    assert moved.metrics["estimated_step_s"] == pytest.approx(
        max(moved.metrics["estimated_pipeline_s"]) + moved.metrics["exchange_s"] + charge)
    # at least the 12 bytes of every element one GPU owns, at the inter-node link's bandwidth
    owned = req.cost.hetero_owned(layers=MODEL.num_layers // 2, tp=8, first=True, holders=req.cost.hetero_holders(
        parse_pipelines(other)))
    assert switch_time(req.cost, parse_pipelines(other), [(2, 2, 1)] * 4, num_gpus=16) > \
        12 * owned / (req.cluster.inter_bw_gbps * 1e9)
    # every GPU holding the same pieces in both (CP ranks hold the whole stage): owners unchanged,
    # nothing moves, only the new layout's pull is charged
    cp2, dp8 = [(2, 1, 2)] * 4, [(2, 1, 1)] * 8
    pull = req.cost.exchange_time(layers=MODEL.num_layers, tp=2, first=True, last=True,
                                  holders=req.cost.hetero_holders(dp8), inter_node=True) / 2
    assert switch_time(req.cost, cp2, dp8, num_gpus=16) == pytest.approx(pull)


def test_chosen_heterogeneous_strategy_is_estimated_with_the_simulators_exchange():
    lengths = [24000, 20000] + [int(x) for x in np.random.default_rng(0).integers(50, 2000, 150)]
    req = heterogeneous_request(lengths)
    p = get_planner("hydraulis")(req)
    assert len({(q.tp, q.pp, q.cp) for q in p.pipelines}) > 1, p.metrics["strategy"]
    charged = max(simulator_exchange(p, req.cost))
    assert p.metrics["exchange_s"] == charged
    assert p.metrics["estimated_step_s"] == max(p.metrics["estimated_pipeline_s"]) + charged


def test_homogeneous_plan_is_charged_an_all_reduce():
    p, req = plan([20000, 9000, 3000] + [500] * 40, pipelines="tp2-pp2,tp2-pp2,tp2-pp2,tp2-pp2")
    cm, half = req.cost, req.cost.model.num_layers // 2
    for inputs in plan_inputs(p, cm):
        reduce = {cm.grad_sync_time(layers=half, tp=2, dp=4, zero=p.zero, inter_node=inter, first=True)
                  for inter in (False, True)}
        assert inputs.grad_sync[0] in reduce and inputs.extra_comm == 0


# ---- MaxLen ----

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(long_tail, min_size=1, max_size=50), hetero=st.booleans())
def test_no_sequence_on_a_pipeline_whose_max_len_is_below_it(lengths, hetero):
    req = heterogeneous_request(lengths) if hetero else request(lengths)
    p = get_planner("hydraulis")(req)
    validate_plan(p, req.cost)
    for pipe, limit in zip(p.pipelines, p.metrics["pipeline_max_len"]):
        paper = paper_max_len(req.cost, tp=pipe.tp, pp=pipe.pp, cp=pipe.cp, num_gpus=req.cluster.num_gpus)
        ours = req.cost.max_seq_len(tp=pipe.tp, pp=pipe.pp, cp=pipe.cp, dp=len(p.pipelines), zero=1)
        assert limit == min(paper, ours)
        for chunk in pipe.chunks:
            assert chunk.num_tokens <= limit
            assert all(p.lengths[s.seq_id] <= limit for s in chunk.segments)


def test_every_pipeline_holds_its_model_states():
    # llama-32b on 64 GPUs: tp2 fits only when the optimizer is sharded widely enough, so a
    # strategy's leftover small pipelines must not overflow under its own pipeline count.
    model = MODEL_PRESETS["llama-32b"]
    cluster = cluster_preset("a800", 64)
    cost = CostModel(model=model, cluster=cluster)
    lengths = [31000, 18000, 9000] + [int(x) for x in np.random.default_rng(6).integers(20, 4000, 60)]
    req = PlanRequest(lengths=lengths, model=model, cluster=cluster, scheme=ParallelScheme(dp=64), cost=cost,
                      context_length=CONTEXT)
    p = get_planner("hydraulis")(req)
    validate_plan(p, cost)
    for pipe in p.pipelines:
        for s, layers in enumerate(pipe.stage_layers(model.num_layers)):
            states = cost.model_state_bytes(layers=layers, tp=pipe.tp, dp=len(p.pipelines), zero=1, first=s == 0,
                                            last=s == pipe.pp - 1)
            assert states < cost.capacity_bytes


def test_sequence_longer_than_every_scheme_names_the_sequence_and_limit():
    req = request([100, 200, 900_000, 50], gpus=8)
    req.context_length = 1_000_000
    with pytest.raises(UserError, match=r"sequence 2 has 900000 tokens > \d+, the MaxLen"):
        get_planner("hydraulis")(req)


def test_sequence_over_the_context_length_is_user_error():
    with pytest.raises(UserError, match="sequence 1 has 40000 tokens > context length"):
        get_planner("hydraulis")(request([10, 40_000]))


def test_unknown_or_bad_options_are_user_errors():
    with pytest.raises(UserError, match="has no option chunk_size"):
        get_planner("hydraulis")(request([10], chunk_size=4))
    with pytest.raises(UserError, match="trials must be a positive integer"):
        get_planner("hydraulis")(request([10], trials=0))


def test_same_seed_gives_the_same_plan():
    lengths = ADVERSARIAL["long-tail"]
    a, b = plan(lengths, seed=3)[0], plan(lengths, seed=3)[0]
    for p in (a, b):
        p.metrics.pop("planning_ms")
    assert a.to_json() == b.to_json()


def test_candidates_are_reported_with_the_chosen_one_least():
    p, _ = plan(ADVERSARIAL["long-tail"])
    rows = p.metrics["candidates"]
    assert rows and p.metrics["strategy"] in [r["strategy"] for r in rows]
    seen = [x for r in rows for x in (r["screen_s"], r["estimate_s"]) if x is not None]
    assert min(seen) == pytest.approx(p.metrics["estimated_step_s"], abs=1e-6)
    for r in rows:
        if r["estimate_s"] is not None:  # all trials include the screening one
            assert r["lower_bound_s"] <= r["estimate_s"] + 1e-6 and r["estimate_s"] <= r["screen_s"] + 1e-6
        elif r["screen_s"] is not None:  # pruned: its bound cannot beat the best screened plan
            assert r["lower_bound_s"] >= min(x["screen_s"] for x in rows if x["screen_s"] is not None) - 1e-6


# ---- §7 proposal ----

def test_profile_proposal_is_computed_once_per_dataset_setting():
    first = [int(x) for x in np.random.default_rng(4).integers(100, 3000, 40)] + [20000]
    second = first[::-1][:-2] + [first[0] + first[1]]  # other lengths, the same token count
    before = propose.cache_info()
    plan(first, profile="commoncrawl")
    plan(second, profile="commoncrawl")
    after = propose.cache_info()
    # Same token count to two digits: the second batch reuses the first's proposal.
    assert after.hits - before.hits >= 1 and after.misses - before.misses <= 1


def space(gpus=16, cost=None):
    cost = cost or CostModel(model=MODEL, cluster=cluster_preset("a800", gpus))
    return tuple(scheme_space(cost, num_gpus=gpus, context_length=CONTEXT, max_tp=8, max_pp=8, max_cp=8,
                              threshold=0.85))


def test_proposal_of_many_short_sequences_approaches_the_continuous_optimum():
    # Many short sequences, no single one dominating: the relaxed DP's latency tends to the
    # fluid optimum, the cheapest GPU-seconds per sequence spread over all N GPUs.
    schemes = tuple(s for s in space() if s.pp == 1)
    lengths = np.random.default_rng(1).integers(64, 1024, 4000)
    hist = Histogram.of(lengths)
    (prop,) = propose(schemes, hist, 16, (int(lengths.max()),), float(lengths.sum()), 128, 0.001,
                      (tuple(True for _ in schemes),))
    fluid = np.stack([s.num_gpus * s.dp_time(lengths) for s in schemes]).min(axis=0).sum() / 16
    assert fluid <= prop.latency_s <= fluid * 1.01


def test_previous_strategy_estimate_is_unchanged_under_the_builtin_curve():
    """The `previous` option moves other candidates' bounds, so other candidates pass the screen:
    the previous strategy's estimate must not change with them (was 3.251 s vs 3.203 s when
    the candidates drew their random dispatch orders from one shared stream)."""
    from lengthwise.planners.hydraulis.cost import pipelines_name

    lengths = [9000, 6000] + [int(x) for x in np.random.default_rng(1).integers(50, 3000, 60)]
    first, _ = plan(lengths)
    same, _ = plan(lengths, previous=pipelines_name(first.pipelines))
    assert same.metrics["estimated_step_s"] == first.metrics["estimated_step_s"]


def test_rounding_finds_a_strategy_under_the_builtin_curve():
    """tp8 x 0.7 (the one scheme that holds 30000) beside tp1 x 9.2: every floor/ceiling
    combination holding 30000 needs 17 GPUs of 16, so the rounding takes the closest whole
    strategy that fits (one tp8 pipeline kept, tp1 cut below its floor)."""
    schemes = space()
    lengths = [30000, 12000] + [700] * 200
    props = propose(schemes, Histogram.of(lengths), 16, (30000,), float(sum(lengths)), 128, 0.1,
                    (tuple(True for _ in schemes),))
    strategies = [s for prop in props for s in round_proposal(prop, schemes, 16)]
    assert strategies
    for s in strategies:
        assert s.num_gpus == 16 and s.max_len >= 30000


def test_closest_rounding_moves_the_fewest_gpus():
    """When no floor/ceiling combination fits, the whole strategy chosen moves the fewest GPUs
    from the proposal (sum N(P) |n - d|), checked against every whole strategy by brute force."""
    from itertools import product

    from lengthwise.planners.hydraulis.strategy import Proposal

    by_tp = {s.tp: s for s in space() if s.pp == 1 and s.cp == 1}
    big, mid, one = by_tp[8], by_tp[2], by_tp[1]
    prop = Proposal(max_len=big.max_len, latency_s=1.0, pipelines=((one, 9.2), (mid, 0.6), (big, 0.7)))
    (got,) = round_proposal(prop, (one, mid, big), 16)
    moved = lambda counts: sum(s.num_gpus * abs(n - d) for (s, d), n in zip(prop.pipelines, counts))
    fits = [c for c in product(range(17), range(9), range(3))
            if sum(s.num_gpus * n for (s, _), n in zip(prop.pipelines, c)) <= 16 and c[2] >= 1]
    best = min(moved(c) for c in fits)
    counts = dict(got.parts)
    assert moved([counts.get(s, 0) for s, _ in prop.pipelines]) == pytest.approx(best)
    assert got.num_gpus == 16 and counts[big] >= 1


def test_a_candidate_dispatches_alike_whatever_is_dispatched_beside_it():
    """dispatch_many: a strategy's trials (same orders, same count for a fixed share) and so its
    best dispatch do not depend on the other strategies of the pass nor their order."""
    from lengthwise.planners.hydraulis.dispatch import dispatch_many

    schemes = [s for s in space() if s.pp == 1 and s.tp in (8, 2, 1)]
    a = PipelineArrays.of(sorted([schemes[2]] + [schemes[0]] * 8, key=lambda s: -s.max_len),
                          sorted([schemes[2].max_len] + [schemes[0].max_len] * 8, reverse=True))
    b = PipelineArrays.of([schemes[1]] * 4, [schemes[1].max_len] * 4)
    lengths = np.array([20000] + [int(x) for x in np.random.default_rng(3).integers(10, 3000, 50)])
    runs = lambda cs: dispatch_many(lengths, cs, trials=20, work_budget=1e9, rng=np.random.default_rng(7), share=2)
    alone, first, second = runs([a])[0], runs([a, b])[0], runs([b, a])[1]
    for got in (first, second):
        assert got.trials == alone.trials == 20
        assert got.owner.tolist() == alone.owner.tolist() and got.objective_s == alone.objective_s


def test_no_candidate_holding_the_longest_is_a_one_line_user_error():
    """A fixed strategy whose pipelines cannot hold the batch's longest sequence: a UserError
    naming the sequence and the limit, not an assertion."""
    with pytest.raises(UserError, match=r"^sequence 0 has 30000 tokens > \d+, the longest micro-batch.*: give "):
        get_planner("hydraulis")(request([30000, 100], pipelines=",".join(["tp1-pp1"] * 16)))


# ---- Algorithm 1 ----

def test_dispatch_respects_max_len_and_more_trials_never_hurt():
    schemes = [s for s in space() if s.pp == 1 and s.tp in (8, 2, 1)]
    pipes = sorted([schemes[2]] + [schemes[1]] * 2 + [schemes[0]] * 4, key=lambda s: -s.max_len)
    arrays = PipelineArrays.of(pipes, [s.max_len for s in pipes])
    lengths = np.array([28000, 15000, 9000] + [int(x) for x in np.random.default_rng(2).integers(10, 3000, 80)])
    one = dispatch(lengths, arrays, trials=1, work_budget=1e9, rng=np.random.default_rng(0))
    many = dispatch(lengths, arrays, trials=50, work_budget=1e9, rng=np.random.default_rng(0))
    assert many.objective_s <= one.objective_s
    for d in (one, many):
        assert (lengths <= arrays.max_len[d.owner]).all()


def algorithm_1_one_trial(lengths, pipes: list[Scheme], max_lens: list[int]) -> list[int]:
    """Algorithm 1 written plainly for one trial in longest-first order, eq. 2 bounds recomputed
    from scratch (ties: smallest own bound, then lowest index)."""
    def bound(j, ids):
        if not ids:
            return 0.0
        s, ls = pipes[j], [lengths[i] for i in ids]
        micro = -(-sum(ls) // max_lens[j])
        return float(np.sum(s.seq_time(ls))) + s.chunk_s * micro + s.chunk_time([max(ls)]) * (s.pp - 1)

    owned: list[list[int]] = [[] for _ in pipes]
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        best = None
        for j in range(len(pipes)):
            if lengths[i] > max_lens[j]:
                continue
            mine = bound(j, owned[j] + [i])
            worst = max([mine] + [bound(k, owned[k]) for k in range(len(pipes)) if k != j])
            if best is None or (worst, mine) < best[:2]:
                best = (worst, mine, j)
        owned[best[2]].append(i)
        owner[i] = best[2]
    return owner


def test_vectorised_dispatch_equals_plain_algorithm_1():
    schemes = [s for s in space() if s.pp in (1, 2) and s.tp in (4, 1)]
    pipes = sorted(schemes + schemes[:1], key=lambda s: -s.max_len)
    lengths = [int(x) for x in np.random.default_rng(5).integers(1, 12000, 40)]
    arrays = PipelineArrays.of(pipes, [s.max_len for s in pipes])
    got = dispatch(np.array(lengths), arrays, trials=1, work_budget=1e9, rng=np.random.default_rng(0))
    assert got.owner.tolist() == algorithm_1_one_trial(lengths, pipes, [s.max_len for s in pipes])


# ---- eq. 1 packing ----

def load_of(lengths, scheme: Scheme, depth=None) -> PipelineLoad:
    lengths = np.asarray(lengths, dtype=np.int64)
    return PipelineLoad(seq_ids=tuple(range(len(lengths))), lengths=lengths, work=scheme.seq_time(lengths),
                        chunk_s=scheme.chunk_s, depth=depth or scheme.pp, max_len=scheme.max_len,
                        util_len=scheme.util_len)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 9000), min_size=2, max_size=8), v=st.integers(1, 4))
def test_milp_is_never_worse_than_greedy_on_small_instances(lengths, v):
    scheme = next(s for s in space() if s.tp == 2 and s.pp == 2)
    load = load_of(lengths, scheme)
    greedy = lpt_bins(load, v)
    exact = milp_bins(load, v, time_limit_s=5.0, node_limit=100_000)
    if greedy is not None:
        assert exact is not None
        assert estimate(load, exact) <= estimate(load, greedy) * (1 + 1e-9)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 20000), min_size=1, max_size=40))
def test_packing_is_never_worse_than_fixed_length_packing(lengths):
    scheme = next(s for s in space() if s.tp == 4 and s.pp == 2)
    load = load_of(lengths, scheme)
    fixed = estimate(load, best_fit_decreasing(lengths, scheme.max_len))
    packed = greedy_pack(load)
    assert packed.estimate_s <= fixed * (1 + 1e-12)
    assert sorted(i for b in packed.bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= scheme.max_len for b in packed.bins)


def test_micro_batch_range_follows_appendix_c():
    scheme = next(s for s in space() if s.tp == 1 and s.pp == 4)
    load = load_of([scheme.util_len] * 10, scheme)
    tokens = 10 * scheme.util_len
    assert micro_batch_range(load)[0] == max(1, -(-tokens // scheme.max_len))
    assert micro_batch_range(load)[-1] == 10
