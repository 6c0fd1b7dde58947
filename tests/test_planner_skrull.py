"""Skrull (GDS + DACP): valid plans, the BucketSize bound per CP rank, selective sharding."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import SHARDED, Chunk, Segment
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.skrull.dacp import DacpCost, dacp, refine_by_objective
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset

QWEN = MODEL_PRESETS["qwen2.5-0.5b"]


def request(lengths, *, dp=1, cp=2, pp=1, bucket=None, model=QWEN, refine=True, context=1 << 20):
    scheme = ParallelScheme(dp=dp, cp=cp, pp=pp, zero=2)
    cluster = cluster_preset("h100", scheme.num_gpus)
    options = {"refine": refine} | ({"bucket_size": bucket} if bucket else {})
    return PlanRequest(lengths=list(lengths), model=model, cluster=cluster, scheme=scheme,
                       cost=CostModel(model=model, cluster=cluster), context_length=context, options=options)


def plan(*args, **kwargs):
    req = request(*args, **kwargs)
    out = get_planner("skrull")(req)
    validate_plan(out, req.cost)
    return out


def per_rank_tokens(chunk: Chunk, cp: int) -> list[int]:
    """Tokens each CP rank holds, counted independently of the planner (larger shard)."""
    held = [0] * cp
    for seg in chunk.segments:
        for r in range(cp) if seg.cp_rank == SHARDED else [seg.cp_rank]:
            held[r] += math.ceil(seg.num_tokens / cp) if seg.cp_rank == SHARDED else seg.num_tokens
    return held


def mixed_lengths(limit):
    short = st.integers(1, 400)
    return st.lists(st.one_of(short, short, st.integers(1, limit)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dp=st.integers(1, 3), cp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]),
       bucket=st.integers(500, 3000), refine=st.booleans())
def test_plans_validate_and_no_rank_exceeds_bucket_size(data, dp, cp, pp, bucket, refine):
    lengths = data.draw(mixed_lengths(cp * bucket))
    out = plan(lengths, dp=dp, cp=cp, pp=pp, bucket=bucket, refine=refine)
    assert out.metrics["bucket_size"] == bucket
    for pipe in out.pipelines:
        assert (pipe.cp, pipe.pp) == (cp, pp)
        for chunk in pipe.chunks:
            assert max(per_rank_tokens(chunk, cp)) <= bucket, str(chunk)


@pytest.mark.parametrize("lengths", [
    [8 * 2000] * 6,                     # every sequence exactly c x BucketSize
    [1] * 50,                           # nothing but one-token sequences
    [2000] * 17,                        # each exactly BucketSize
    [8 * 2000] + [3] * 40,              # one giant among crumbs
    [2001, 1999, 2000, 4000, 1, 7999],  # around the local / sharded boundary
])
def test_adversarial_batches_validate_within_bucket(lengths):
    out = plan(lengths, dp=2, cp=8, bucket=2000)
    for pipe in out.pipelines:
        for chunk in pipe.chunks:
            assert max(per_rank_tokens(chunk, 8)) <= 2000


def test_default_bucket_size_is_memory_model_limit():
    req = request([1000, 50_000, 300], dp=2, cp=4)
    out = get_planner("skrull")(req)
    validate_plan(out, req.cost)
    # model states shard over the dp x cp ranks holding replicas of the weights
    assert out.metrics["bucket_size"] == req.cost.max_seq_len(pp=1, cp=1, dp=2 * 4, zero=2)


def test_plans_at_memory_limit_pass_the_memory_check():
    req = request([1], dp=1, cp=4)
    bucket = req.cost.max_seq_len(pp=1, cp=1, dp=1 * 4, zero=2)  # states shard over dp x cp
    # the longest sequence the CP group holds sharded: less than 4 buckets, since every rank also
    # keeps the whole sequence's gathered K/V per layer
    longest = req.cost.max_seq_len(pp=1, cp=4, dp=1, zero=2)
    assert bucket < longest < 4 * bucket
    out = plan([longest, bucket, bucket // 2, bucket // 2, 17], dp=1, cp=4)
    assert out.metrics["bucket_size"] == bucket


def test_every_sequence_stays_whole():
    lengths = [9000, 12, 4000, 700, 3500, 1]
    out = plan(lengths, dp=2, cp=4, bucket=3000)
    segs = [s for p in out.pipelines for c in p.chunks for s in c.segments]
    assert sorted((s.seq_id, s.start, s.stop) for s in segs) == [(i, 0, n) for i, n in enumerate(lengths)]


def test_sequence_longer_than_cp_times_bucket_is_user_error():
    with pytest.raises(UserError, match=r"sequence 2 has 8001 tokens > cp\(4\) x BucketSize\(2000\) = 8000"):
        plan([10, 20, 8001], cp=4, bucket=2000)


def test_bucket_size_above_memory_is_user_error():
    with pytest.raises(UserError, match="bucket_size"):
        plan([10], cp=2, bucket=10**9)


def test_refine_option_must_be_boolean():
    with pytest.raises(UserError, match="refine must be true or false"):
        plan([10], cp=2, refine="no")


@pytest.mark.parametrize("refine", [True, False])
def test_short_sequences_stay_local_when_they_fit(refine):
    out = plan([100, 120, 90, 80, 110, 95, 105, 85], cp=8, bucket=4000, refine=refine)
    (chunk,) = out.pipelines[0].chunks
    assert all(s.cp_rank != SHARDED for s in chunk.segments)
    assert len({s.cp_rank for s in chunk.segments}) == 8  # spread, one per rank


def test_sequence_longer_than_bucket_is_sharded_and_short_ones_local():
    out = plan([5000, 40, 60, 30], cp=4, bucket=2000, refine=False)
    (chunk,) = out.pipelines[0].chunks
    place = {s.seq_id: s.cp_rank for s in chunk.segments}
    assert place[0] == SHARDED
    assert all(place[i] != SHARDED for i in (1, 2, 3))


def test_roll_back_shards_local_sequences_to_make_room():
    # cp=2, C=12: 4 -> rank 0, 8 -> rank 1; 12 needs 6 per rank, rank 1 has 4 left, so the
    # roll-back shards the 8, then the 4, and the 12 fits: [6+4+2, 6+4+2] = [12, 12].
    lengths = {0: 4, 1: 8, 2: 12}
    flops = {i: float(n) for i, n in lengths.items()}
    assert dacp([0, 1, 2], lengths, flops, cp=2, bucket_size=12) == {0: SHARDED, 1: SHARDED, 2: SHARDED}


def test_dacp_reports_failure_when_nothing_fits():
    lengths = {0: 10, 1: 10, 2: 2}  # 22 tokens > 2 x 10
    assert dacp([0, 1, 2], lengths, {i: float(n) for i, n in lengths.items()}, cp=2, bucket_size=10) is None


def test_gds_adds_a_micro_batch_when_dacp_fails():
    # 7 + 7 + 6 = 20 = c x C tokens, so GDS starts with one micro-batch; DACP cannot place it
    # (see test_dacp_reports_failure...), so GDS rolls back to two: [7] and [7, 6].
    out = plan([7, 7, 6], cp=2, bucket=10, model=MODEL_PRESETS["tiny"])
    assert len(out.pipelines[0].chunks) == 2
    assert out.metrics["gds_roll_backs"] == 1


def test_dp_ranks_get_balanced_flops():
    lengths = [30_000, 20_000, 20_000, 14_000, 10_000, 10_000, 8_000] + [500] * 60
    req = request(lengths, dp=4, cp=4, bucket=20_000)
    out = get_planner("skrull")(req)
    flops = out.metrics["forward_flops_per_pipeline"]
    one = [req.cost.forward_flops(Chunk((Segment(i, 0, n),)), layers=QWEN.num_layers, head=True)
           for i, n in enumerate(lengths)]
    # No split can beat the larger of the average and the heaviest single sequence.
    assert max(flops) <= 1.1 * max(sum(one) / 4, max(one))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 6000), min_size=1, max_size=24), cp=st.sampled_from([2, 4, 8]))
def test_refinement_never_worsens_the_dacp_objective(lengths, cp):
    req = request(lengths, cp=cp)
    bucket = 6000
    ids = {i: n for i, n in enumerate(lengths)}
    placement = dacp(list(ids), ids, {i: float(n) ** 1.5 for i, n in ids.items()}, cp=cp, bucket_size=bucket)
    if placement is None:
        return
    model = DacpCost(cost=req.cost, layers=QWEN.num_layers, tp=1, cp=cp, inter_node=False)
    refined = refine_by_objective(placement, ids, model, bucket)

    def chunk(p):
        return Chunk(tuple(Segment(i, 0, ids[i], p[i]) for i in sorted(p)))

    assert model.time(chunk(refined)) <= model.time(chunk(placement))
    assert max(per_rank_tokens(chunk(refined), cp)) <= bucket


def test_plan_is_deterministic():
    lengths = [5000, 12, 4000, 700, 3500, 1, 9000, 250]
    a, b = (plan(lengths, dp=2, cp=4, bucket=3000).to_dict() for _ in range(2))
    a["metrics"].pop("planning_ms"), b["metrics"].pop("planning_ms")
    assert a == b


def test_pipeline_stages_run_1f1b_with_pp():
    out = plan([3000, 200, 100, 2500, 50, 900], dp=2, cp=2, pp=2, bucket=2000)
    assert all(p.pp == 2 and p.schedule == "1f1b" for p in out.pipelines)


def test_cp_ranks_reduce_gradients_and_shard_model_states():
    """Each CP rank holds the whole stage's weights: a dp1 x cp8 plan pays a gradient reduction
    over its 8 ranks (as the executor's GradReducer runs it) and ZeRO shards its states over
    them, so it is charged like a dp8 plan of the same model, not 0 s and unsharded."""
    from lengthwise.sim import simulate_plan

    lengths = [30_000, 9000, 500, 120, 4000, 7000, 60]
    cp8, dp8 = request(lengths, dp=1, cp=8), request(lengths, dp=8, cp=1)
    cp_run = simulate_plan(get_planner("skrull")(cp8), cp8.cost)
    assert cp_run.grad_sync[0][0] == pytest.approx(cp8.cost.grad_sync_time(layers=QWEN.num_layers, dp=8, zero=2,
                                                                         inter_node=False, first=True, last=True))
    assert cp_run.grad_sync[0][0] > 0
    states = cp8.cost.model_state_bytes(layers=QWEN.num_layers, dp=8, zero=2, first=True, last=True)
    assert states == dp8.cost.model_state_bytes(layers=QWEN.num_layers, dp=8, zero=2, first=True, last=True)
    assert cp_run.peak_memory[0][0] >= states
