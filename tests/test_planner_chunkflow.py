"""The chunkflow planner (chunkflow.txt §4-§5): chunk construction, placement, state-aware
scheduling, the (ChunkSize, K) grid search and the memory property of table 5."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import (
    BACKWARD,
    FORWARD,
    FORWARD_NOGRAD,
    Chunk,
    Segment,
    StepPlan,
)
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.chunkflow.build import (
    construct_chunks,
    default_chunk_size,
    group_seconds,
    packed_rate,
    split_sequence,
)
from lengthwise.sim import simulate_plan
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset
from lengthwise.workloads import get_profile

K = 1024


def request(lengths, *, dp=1, tp=4, pp=1, context=32 * K, model="qwen2.5-7b", **options):
    scheme = ParallelScheme(dp=dp, tp=tp, pp=pp)
    cluster = cluster_preset("h100", scheme.num_gpus)
    cost = CostModel(model=MODEL_PRESETS[model], cluster=cluster)
    return PlanRequest(lengths=list(lengths), model=cost.model, cluster=cluster, scheme=scheme,
                       cost=cost, context_length=context, options=options)


def plan(lengths, **kw) -> StepPlan:
    req = request(lengths, **kw)
    out = get_planner("chunkflow")(req)
    validate_plan(out, req.cost)
    return out


def long_tail(n, context, seed=0):
    return [int(x) for x in get_profile("chunkflow-eval").sample(n, np.random.default_rng(seed),
                                                                   below=context + 1)]


# ---- chunk construction (Algorithm 1) ----

def test_long_sequences_split_into_chunk_size_pieces_with_remainder_last():
    cs = construct_chunks([0, 1, 2], [10_000, 300, 4096], 4096)
    assert [[(c.segments[0].start, c.segments[0].stop) for c in g] for g in cs.groups] == \
        [[(0, 4096), (4096, 8192), (8192, 10_000)]]
    assert [len(c.segments) for g in cs.groups for c in g] == [1, 1, 1]  # remainder stays alone


def test_short_sequences_stay_whole_and_fill_at_most_chunk_size():
    lengths = long_tail(400, 8 * K, seed=1)
    cs = construct_chunks(list(range(len(lengths))), lengths, 8 * K)
    packed = [s for c in cs.standalone for s in c.segments]
    assert all(s.start == 0 and s.stop == lengths[s.seq_id] for s in packed)
    assert all(c.num_tokens <= 8 * K for c in cs.standalone)
    assert sorted(s.seq_id for s in packed) == [i for i, n in enumerate(lengths) if n <= 8 * K]


def test_packing_reaches_the_bin_count_lower_bound_on_long_tail_batches():
    for seed in range(5):
        lengths = [n for n in long_tail(512, 32 * K, seed) if n <= 4 * K]
        cs = construct_chunks(list(range(len(lengths))), lengths, 4 * K)
        assert cs.packed_lower_bound == -(-sum(lengths) // (4 * K))
        assert len(cs.standalone) == cs.packed_lower_bound


# ---- the plan ----

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=40),
       dp=st.sampled_from([1, 2, 3]), pp=st.sampled_from([1, 2, 4]),
       chunk_size=st.sampled_from([None, 1000, 4096, 8192]), k=st.integers(1, 3))
def test_every_plan_validates(lengths, dp, pp, chunk_size, k):
    out = plan(lengths, dp=dp, pp=pp, context=40_000, chunk_size=chunk_size, k=k)
    assert len(out.pipelines) == dp
    assert all(c.num_tokens <= out.metrics["chunk_size"] for p in out.pipelines for c in p.chunks)


@pytest.mark.parametrize("lengths", [
    [1], [32 * K] * 3, [32 * K - 1, 2, 1], [1] * 300, [20_000, 20_001, 3, 3, 3, 9_999],
])
def test_adversarial_batches_validate(lengths):
    for pp, dp in [(1, 1), (4, 2), (2, 5)]:
        plan(lengths, dp=dp, pp=pp, chunk_size=8 * K, k=2)


def test_same_request_gives_the_same_plan():
    lengths = long_tail(256, 256 * K, seed=3) + [200_000, 70_000]
    a = plan(lengths, dp=4, pp=2, context=256 * K, chunk_size=8 * K, k=2)
    b = plan(lengths, dp=4, pp=2, context=256 * K, chunk_size=8 * K, k=2)
    assert a.to_dict()["pipelines"] == b.to_dict()["pipelines"]


def test_a_long_sequence_runs_in_one_pipeline_in_order():
    lengths = [100_000, 90_000] + [500] * 200
    out = plan(lengths, dp=3, pp=1, context=128 * K, chunk_size=16 * K)
    for seq in (0, 1):
        owners = [p for p, pipe in enumerate(out.pipelines) for c in pipe.chunks
                  for s in c.segments if s.seq_id == seq]
        assert len(set(owners)) == 1 and len(owners) == -(-lengths[seq] // (16 * K))


def test_pipelines_are_balanced_in_predicted_seconds():
    lengths = long_tail(512, 32 * K, seed=4) + [16_000, 12_000, 9_000]
    req = request(lengths, dp=4, context=32 * K, chunk_size=4 * K, k=1)
    loads = get_planner("chunkflow")(req).metrics["predicted_pipeline_s"]
    longest = group_seconds(split_sequence(512, 16_000, 4 * K), 1, req)
    mean = sum(loads) / len(loads)
    assert longest < mean  # so an even split exists; the greedy finds one within 2%
    assert max(loads) <= 1.02 * mean and min(loads) >= 0.98 * mean


def test_state_aware_schedule_reruns_the_first_n_minus_k_forwards():
    lengths = [10 * 2 * K, 300, 200]
    for k in (1, 3, 10):
        out = plan(lengths, dp=1, pp=1, context=64 * K, chunk_size=2 * K, k=k)
        (stage,) = out.pipelines[0].stages
        nograd = [a.chunk for a in stage if a.kind == FORWARD_NOGRAD]
        assert nograd == list(range(10 - k))
        # pp = 1 is gradient accumulation: the group's forwards in order, backwards in reverse.
        group_bwd = [a.chunk for a in stage if a.kind == BACKWARD and a.chunk < 10]
        assert group_bwd == list(range(9, -1, -1))
        assert sum(a.kind == FORWARD for a in stage) == len(out.pipelines[0].chunks)


def test_packed_rate_recovers_per_token_and_per_pair_seconds():
    req = request([1], chunk_size=8 * K)
    rate = packed_rate(req, 8 * K)
    assert rate.per_token > 0 and rate.per_key > 0
    full = Chunk((Segment(0, 0, 8 * K),))
    layers = req.model.num_layers
    exact = (req.cost.forward_time(full, layers=layers, tp=4, head=True)
             + req.cost.backward_time(full, layers=layers, tp=4, head=True))
    assert rate.seconds(8 * K) == pytest.approx(exact, rel=1e-9)


# ---- ChunkSize and K ----

def test_default_chunk_size_is_a_power_of_two_that_fits():
    for context, pp in [(32 * K, 1), (256 * K, 4)]:
        req = request(long_tail(64, context) + [context], pp=pp, context=context)
        size = default_chunk_size(req, 1)
        assert size & (size - 1) == 0 and size <= context
        plan(req.lengths, pp=pp, context=context)  # validates against memory


def test_chunk_size_that_overflows_memory_is_a_user_error():
    with pytest.raises(UserError, match="chunk_size 1048576 with k=4 overflows stage 0"):
        plan([1_000_000], context=1 << 20, chunk_size=1 << 20, k=4)


@pytest.mark.parametrize("options, message", [
    ({"chunk_size": 0}, "chunk_size must be a positive number of tokens or 'auto'"),
    ({"chunk_size": "big"}, "chunk_size must be"),
    ({"k": 0}, "option k must be a positive integer"),
    ({"kk": 2}, "planner chunkflow has no option kk"),
])
def test_bad_options_are_user_errors(options, message):
    with pytest.raises(UserError, match=message):
        plan([100, 200], **options)


def test_sequence_over_the_context_length_is_a_user_error():
    with pytest.raises(UserError, match="sequence 1 has 40000 tokens > context length 32768"):
        plan([100, 40_000])


def test_grid_search_picks_the_fastest_candidate_that_fits():
    lengths = long_tail(128, 128 * K, seed=5) + [120_000]
    out = plan(lengths, dp=1, pp=4, context=128 * K, chunk_size="auto")
    fitting = [r for r in out.metrics["grid"] if r["fits"]]
    best = min(fitting, key=lambda r: (r["step_time_s"], r["k"], r["chunk_size"]))
    assert (out.metrics["chunk_size"], out.metrics["k"]) == (best["chunk_size"], best["k"])
    assert out.options["chosen_chunk_size"] == best["chunk_size"]
    assert {r["chunk_size"] for r in out.metrics["grid"]} == {2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K}


@pytest.mark.parametrize("chunk_size", [2 * K, 4 * K, 8 * K])
def test_peak_memory_differs_between_contexts_only_by_the_kv_state(chunk_size):
    """chunkflow table 5: at fixed ChunkSize and K, a 256K-context batch needs more memory than a
    32K-context one only for the K/V state (and its gradient) of the longer split sequence."""
    shorts = [700, 300, 1500, 90, 2000] * 20
    peaks, cost = {}, None
    for context in (32 * K, 256 * K):
        req = request(shorts + [context], context=context, chunk_size=chunk_size, k=1)
        cost = req.cost
        peaks[context] = max(simulate_plan(get_planner("chunkflow")(req), cost).peak_memory[0])
    layers = MODEL_PRESETS["qwen2.5-7b"].num_layers
    # K/V of the context before the last piece, plus its gradient buffer of the same size.
    kv = lambda length: 2 * cost.kv_bytes(length - chunk_size, layers=layers, tp=4)
    assert peaks[256 * K] - peaks[32 * K] == pytest.approx(kv(256 * K) - kv(32 * K), rel=1e-9)


def test_peak_memory_grows_by_one_chunk_per_extra_k():
    """chunkflow §4.2: K bounds the activations a group keeps, whatever its length."""
    lengths = [700, 300, 1500] * 10 + [32 * K]
    peaks = {}
    for k in (1, 4):
        req = request(lengths, chunk_size=4 * K, k=k)
        peaks[k] = max(simulate_plan(get_planner("chunkflow")(req), req.cost).peak_memory[0])
    piece = Chunk((Segment(0, 0, 4 * K),))
    act = req.cost.activation_bytes(piece, layers=MODEL_PRESETS["qwen2.5-7b"].num_layers, tp=4, head=True)
    assert peaks[4] - peaks[1] == pytest.approx(3 * act, rel=1e-9)


def test_default_chunk_size_leaves_about_two_chunks_per_stage_with_pipelining():
    lengths = long_tail(256, 256 * K, seed=6)
    req = request(lengths, dp=2, pp=4, context=256 * K)
    size = default_chunk_size(req, 1)
    per_pipeline = sum(lengths) / 2
    assert size <= per_pipeline / 8 < 2 * size or size == 2 * K


def test_the_workload_grid_point_fits_every_batch_at_the_lowest_mean_step():
    """chunkflow §5's once-per-workload (ChunkSize, K): a point that fits only one batch is out
    even when it is that batch's fastest; among the rest the lowest mean step time wins."""
    from types import SimpleNamespace

    from lengthwise.metrics import STEP_TIME_S
    from lengthwise.planners.chunkflow.tune import workload_grid_point

    def plan(*rows):
        return SimpleNamespace(metrics={"grid": [{"chunk_size": c, "k": k, "fits": f, STEP_TIME_S: t}
                                                 for c, k, f, t in rows]})

    first = plan((2048, 1, True, 1.0), (4096, 1, True, 0.9), (8192, 1, True, 0.5))
    second = plan((2048, 1, True, 1.0), (4096, 1, True, 1.2), (8192, 1, False, 0.1))
    requests = [request([1000, 3000]), request([2000, 500])]
    assert workload_grid_point([first, second], requests) == (2048, 1)  # means 1.0 < 1.05; 8192 fits one
    assert workload_grid_point([second], requests[1:]) == (2048, 1)
    assert workload_grid_point([plan((2048, 1, False, 1.0))], requests[:1]) is None
