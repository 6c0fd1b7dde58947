"""Every registered planner emits valid plans (each token once, runnable schedules, fits memory) on
random and adversarial batches; the packing helpers keep every item; the baselines do what they
claim (padding to the longest, equal packs per rank, similar lengths together, balanced tokens)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PLANNER_NAMES, PLANNERS, PlanRequest, get_planner
from lengthwise.planners.options import PLANNER_OPTIONS
from lengthwise.planners.packing_utils import (
    best_fit_decreasing, greedy_balance, karmarkar_karp, split_to_multiple,
)
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset

BASELINES = ("padding", "packing", "megatron", "static-cp", "sorted", "token-balanced")
MODEL = MODEL_PRESETS["qwen2.5-1.5b"]
CONTEXT = 32768
SCHEMES = {
    "dp4-pp2": ParallelScheme(dp=4, pp=2),     # 35.5K tokens fit a pipeline under 1F1B
    "dp2-pp2-cp2": ParallelScheme(dp=2, pp=2, cp=2),
}
ADVERSARIAL = {
    "all-equal": [2048] * 24,
    "one-giant-outlier": [CONTEXT] + [37] * 40,
    "single-sequence": [5000],
    "all-length-one": [1] * 17,
    "fewer-than-dp": [300, 7],
    "long-tail": [31000, 17000, 9000, 4100, 2050] + [900, 300, 120, 60, 2] * 8,
}


def request(lengths: list[int], scheme_name: str = "dp4-pp2", seed: int = 0, **options) -> PlanRequest:
    scheme = SCHEMES[scheme_name]
    cluster = cluster_preset("h100", scheme.num_gpus)
    return PlanRequest(lengths=list(lengths), model=MODEL, cluster=cluster, scheme=scheme,
                       cost=CostModel(model=MODEL, cluster=cluster), context_length=CONTEXT,
                       seed=seed, options=options)




def tokens_per_sequence(plan, *, backward: bool = False) -> list[int]:
    counts = [0] * len(plan.lengths)
    for pipe in plan.pipelines:
        for chunk in (pipe.bwd_units if backward else pipe.chunks):
            for seg in chunk.segments:
                counts[seg.seq_id] += seg.num_tokens
    return counts


def assert_valid(plan, req: PlanRequest) -> None:
    validate_plan(plan, req.cost)
    assert tokens_per_sequence(plan) == list(req.lengths)
    assert tokens_per_sequence(plan, backward=True) == list(req.lengths)
    assert len(plan.pipelines) <= req.scheme.num_gpus


# ---- every planner, every batch ----

long_tail = st.one_of(st.integers(1, 512), st.integers(1, 4096), st.integers(1, CONTEXT))


@pytest.mark.parametrize("name", PLANNER_NAMES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(long_tail, min_size=1, max_size=48), seed=st.integers(0, 3))
def test_every_token_planned_once_on_random_batches(name, lengths, seed):
    planner = get_planner(name)
    req = request(lengths, seed=seed)
    assert_valid(planner(req), req)


@pytest.mark.parametrize("scheme_name", SCHEMES)
@pytest.mark.parametrize("case", ADVERSARIAL)
@pytest.mark.parametrize("name", PLANNER_NAMES)
def test_every_token_planned_once_on_adversarial_batches(name, case, scheme_name):
    planner = get_planner(name)
    req = request(ADVERSARIAL[case], scheme_name)
    assert_valid(planner(req), req)


@pytest.mark.parametrize("name", PLANNER_NAMES)
def test_same_seed_gives_the_same_plan(name):
    planner = get_planner(name)
    lengths = ADVERSARIAL["long-tail"]
    a, b = planner(request(lengths, seed=3)), planner(request(lengths, seed=3))
    for plan in (a, b):
        plan.metrics.pop("planning_ms")
    assert a.to_json() == b.to_json()


@pytest.mark.parametrize("name", PLANNER_NAMES)
def test_plan_metrics_are_filled(name):
    plan = get_planner(name)(request(ADVERSARIAL["long-tail"]))
    m = plan.metrics
    assert m["planning_ms"] >= 0 and 0 <= m["padding_fraction"] < 1
    assert len(m["chunks_per_pipeline"]) == len(plan.pipelines) == len(m["forward_flops_per_pipeline"])
    assert sum(m["tokens_per_pipeline"]) == sum(plan.lengths)
    assert all(f >= 0 for f in m["forward_flops_per_pipeline"])


@pytest.mark.parametrize("name", ["padding", "static-cp", "chunkflow", "slimpack"])
def test_plan_metrics_over_arrays_are_the_chunk_by_chunk_ones(name):
    # padded rows, CP-placed and split segments: the array pass (base._array_metrics) gives the
    # numbers of the loop a cost model of its own falls back to, float for float
    from lengthwise.planners.base import plan_metrics

    class Own(CostModel):
        def forward_flops(self, chunk, *, layers, head=False):
            return CostModel.forward_flops(self, chunk, layers=layers, head=head)

    req = request(ADVERSARIAL["long-tail"])
    plan = get_planner(name)(req)
    own = Own(model=req.cost.model, cluster=req.cost.cluster)
    assert plan_metrics(plan, req.cost) == plan_metrics(plan, own)


# ---- registry ----

def test_registry_lists_every_planner_once_with_its_options_class():
    assert set(BASELINES) <= set(PLANNER_NAMES)
    assert list(PLANNERS) == list(PLANNER_NAMES) == list(PLANNER_OPTIONS)
    assert PLANNERS["packing"] is get_planner("packing")


def test_unknown_planner_names_the_valid_ones():
    with pytest.raises(UserError, match="unknown planner 'nope': use one of padding, packing"):
        get_planner("nope")


@pytest.mark.parametrize("name", BASELINES)
def test_unknown_option_is_rejected(name):
    with pytest.raises(UserError, match=f"planner {name} has no option bogus"):
        get_planner(name)(request([10, 20], bogus=1))


# ---- what each baseline promises ----

def test_padding_pads_each_micro_batch_to_its_longest_in_sampler_order():
    lengths = [100, 700, 30, 400, 50, 60, 5]
    plan = get_planner("padding")(request(lengths, micro_batch_size=3))
    chunks = [c for pipe in plan.pipelines for c in pipe.chunks]
    assert sorted(tuple(s.seq_id for s in c.segments) for c in chunks) == [(0, 1, 2), (3, 4, 5), (6,)]
    for c in chunks:
        assert c.row_tokens == len(c.segments) * max(s.num_tokens for s in c.segments)
    assert plan.metrics["padding_fraction"] == pytest.approx(1 - sum(lengths) / (3 * 700 + 3 * 400 + 5))


def test_padding_micro_batch_over_memory_is_rejected():
    with pytest.raises(UserError, match="micro_batch_size 8 pads micro-batch 0 to 8 x 20000"):
        get_planner("padding")(request([20000] * 8, micro_batch_size=8))


def test_padding_default_micro_batch_fills_memory_with_the_longest():
    req = request([3000] * 40)
    limit = req.cost.max_seq_len(pp=2, dp=4)
    assert get_planner("padding")(req).options["micro_batch_size"] == limit // 3000


def test_packing_gives_every_rank_the_same_number_of_packs():
    plan = get_planner("packing")(request(ADVERSARIAL["long-tail"] + [5000] * 9))
    counts = {len(p.chunks) for p in plan.pipelines}
    assert len(counts) == 1
    assert all(c.num_tokens <= CONTEXT for p in plan.pipelines for c in p.chunks)


def test_sorted_micro_batches_hold_consecutive_lengths():
    lengths = ADVERSARIAL["long-tail"]
    plan = get_planner("sorted")(request(lengths))
    ranges = sorted((min(s.num_tokens for s in c.segments), max(s.num_tokens for s in c.segments))
                    for p in plan.pipelines for c in p.chunks)
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi <= lo  # no two micro-batches interleave in length
    assert all(c.row_tokens <= CONTEXT for p in plan.pipelines for c in p.chunks)


def test_token_balanced_ranks_differ_by_at_most_one_sequence():
    lengths = ADVERSARIAL["long-tail"][1:] * 3
    tokens = get_planner("token-balanced")(request(lengths)).metrics["tokens_per_pipeline"]
    assert max(tokens) - min(tokens) <= max(lengths)


@pytest.mark.parametrize("name", BASELINES)
def test_sequence_over_context_length_is_named(name):
    with pytest.raises(UserError, match=f"sequence 1 has {CONTEXT + 1} tokens > context length {CONTEXT}"):
        get_planner(name)(request([10, CONTEXT + 1]))


@pytest.mark.parametrize("name", BASELINES)
def test_sequence_over_pipeline_memory_names_the_limit(name):
    req = request([10, 50000], "dp4-pp2", recompute="none")
    req.context_length = 65536
    limit = req.cost.max_seq_len(pp=2, dp=4)
    with pytest.raises(UserError, match=f"sequence 1 has 50000 tokens > {limit}, the longest one pipeline"):
        get_planner(name)(req)


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_recompute_only_as_much_as_the_longest_sequence_needs(name):
    """recompute=auto: the cheapest level that fits the longest sequence, none while it fits,
    then every layer's MLP block (44.0K tokens fit without, 122K with it), then every layer
    whole (323K); the plan fits the simulator's memory at each level. megatron's auto, the
    papers' Megatron-LM, has no MLP level: full for either."""
    from lengthwise.sim import simulate_plan

    short = request([10, 3000, 700])
    plan = get_planner(name)(short)
    assert plan.options["recompute"] == "none"
    assert all(a.recompute_layers == a.recompute_mlp == 0 for p in plan.pipelines for st in p.stages for a in st)
    none, mlp, full = (short.cost.max_seq_len(pp=2, dp=4, recompute=level) for level in ("none", "mlp", "full"))
    assert none < 45000 <= mlp < 200000 <= full
    for longest, level in ((45000, "mlp"), (200000, "full")):
        level = "full" if name == "megatron" else level
        req = request([10, longest, 700], "dp4-pp2")
        req.context_length = 262144
        plan = get_planner(name)(req)
        assert plan.options["recompute"] == level
        layers = plan.pipelines[0].stage_layers(MODEL.num_layers)
        for p in plan.pipelines:
            for s, acts in enumerate(p.stages):
                marks = (layers[s], 0) if level == "full" else (0, layers[s])
                assert all((a.recompute_layers, a.recompute_mlp) == marks for a in acts if a.kind == "F")
        assert_valid(plan, req)
        assert simulate_plan(plan, req.cost).fits


@pytest.mark.parametrize("name", BASELINES)
def test_sequence_over_memory_even_with_recomputation_is_named(name):
    req = request([10, 600000], "dp4-pp2")
    req.context_length = 1 << 20
    limit = req.cost.max_seq_len(pp=2, dp=4, recompute="full")
    assert 600000 > limit
    with pytest.raises(UserError, match=f"600000 tokens > {limit}, .* even with full recomputation"):
        get_planner(name)(req)


@pytest.mark.parametrize("name", BASELINES)
def test_zero_length_is_rejected(name):
    with pytest.raises(UserError, match="sequence 2 has length 0"):
        get_planner(name)(request([5, 6, 0]))


# ---- packing helpers ----

sizes_st = st.lists(st.integers(1, 1000), max_size=60)


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, capacity=st.integers(1000, 3000))
def test_best_fit_decreasing_keeps_every_item_within_capacity(sizes, capacity):
    bins = best_fit_decreasing(sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= capacity for b in bins)
    # Any-fit rule: no two bins are both at most half full (the second would not have opened).
    assert len(bins) <= 2 * sum(sizes) / capacity + 1


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, k=st.integers(1, 9))
def test_balancers_keep_every_item_and_stay_within_one_item(sizes, k):
    for groups in (karmarkar_karp(sizes, k), greedy_balance(sizes, k)):
        assert len(groups) == k
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        sums = [sum(sizes[i] for i in g) for g in groups]
        assert max(sums) - min(sums) <= max(sizes, default=0)


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, k=st.integers(1, 9))
def test_equal_count_karmarkar_karp_gives_equal_counts(sizes, k):
    groups = karmarkar_karp(sizes, k, equal_count=True)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    counts = [len(g) for g in groups]
    assert max(counts) - min(counts) <= 1


def test_karmarkar_karp_beats_greedy_on_a_long_tail():
    sizes = [3000, 2900, 2100, 2000, 1100, 900, 700, 640, 600, 500, 450, 420, 400, 350, 300, 250]
    spread = [max(s) - min(s) for s in (
        [sum(sizes[i] for i in g) for g in karmarkar_karp(sizes, 3)],
        [sum(sizes[i] for i in g) for g in greedy_balance(sizes, 3)])]
    assert spread[0] <= spread[1]


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, k=st.integers(1, 9))
def test_split_to_multiple_keeps_items_and_reaches_a_multiple(sizes, k):
    bins = split_to_multiple(best_fit_decreasing(sizes, 2000), sizes, k)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert len(bins) % k == 0 or all(len(b) == 1 for b in bins)


def test_auto_validates_the_best_plan_first_and_falls_back_when_it_is_invalid(monkeypatch):
    """auto validates lazily, best simulated plan first; an invalid best plan loses to the next."""
    import lengthwise.planners.auto as auto

    req = request([3000, 900, 300, 120, 60, 2] * 4, candidates=["packing", "token-balanced", "sorted"])
    honest = get_planner("auto")(req)
    checked = []

    def picky(plan, cost=None):
        checked.append(plan.planner)
        if plan.planner == honest.metrics["chosen_planner"]:
            raise UserError("planted defect")
        validate_plan(plan, cost)

    monkeypatch.setattr(auto, "validate_plan", picky)
    fallback = get_planner("auto")(req)
    assert checked[0] == honest.metrics["chosen_planner"]  # the best is checked first ...
    assert fallback.metrics["chosen_planner"] not in (honest.metrics["chosen_planner"], None)
    assert len(checked) == 2  # ... and only the runner-up after it
    assert "planted defect" in fallback.metrics["auto"][honest.metrics["chosen_planner"]]["error"]


def test_static_cp_gives_every_sequence_its_own_row_sharded_over_the_cp_group():
    req = request([700, 30, 2500, 90, 1200, 15], "dp2-pp2-cp2")
    plan = get_planner("static-cp")(req)
    assert_valid(plan, req)
    rows = [c for p in plan.pipelines for c in p.chunks]
    assert sorted(seg.seq_id for c in rows for seg in c.segments) == list(range(6))
    assert all(len(c.segments) == 1 and c.segments[0].cp_rank == -1 for c in rows)
    assert [[c.segments[0].seq_id for c in p.chunks] for p in plan.pipelines] == [[0, 2, 4], [1, 3, 5]]
    assert all(a.recompute_layers == 0 for p in plan.pipelines for st in p.stages for a in st)


def test_megatron_shrinks_its_micro_batches_to_what_full_recomputation_holds():
    """A Megatron-LM user whose context-length micro-batch does not fit even with full
    recomputation lowers --seq-length to the memory: packs of at most that many tokens, and the
    simulated plan fits."""
    from lengthwise.sim import simulate_plan

    req = request([1000] * 4, "dp4-pp2")
    limit = req.cost.max_seq_len(pp=2, dp=4, recompute="full")
    req.context_length = 2 * limit
    req.lengths = [limit - 5000, 3000, 4000, limit // 2, limit // 3, 700] * 2
    plan = get_planner("megatron")(req)
    assert plan.options["recompute"] == "full" and plan.options["micro_batch_tokens"] == limit
    assert max(c.num_tokens for p in plan.pipelines for c in p.chunks) <= limit
    assert_valid(plan, req)
    assert simulate_plan(plan, req.cost).fits


def test_megatron_micro_batch_size_runs_unpacked_sequences_in_sampler_order():
    """ChunkFlow's Megatron-LM (§6.1: micro-batch size 1): one sequence per micro-batch, dealt
    round-robin to the DP ranks, recomputation chosen for a context-length sequence."""
    lengths = [700, 300, 1500, 90, 2000, 5, 12000, 64]
    req = request(lengths, "dp4-pp2", micro_batch_size=1)
    plan = get_planner("megatron")(req)
    assert [[[s.seq_id for s in c.segments] for c in p.chunks] for p in plan.pipelines] == [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]
    fits_plain = req.context_length <= req.cost.max_seq_len(pp=2, dp=4)
    assert plan.options["recompute"] == ("none" if fits_plain else "full")
    assert_valid(plan, req)
    two = get_planner("megatron")(request(lengths, "dp4-pp2", micro_batch_size=2))
    assert [[c.row_tokens for c in p.chunks] for p in two.pipelines] == [[1400], [3000], [4000], [24000]]


def test_megatron_micro_batches_still_refuse_a_sequence_over_the_context():
    req = request([100, CONTEXT + 1], "dp4-pp2", micro_batch_size=2)
    with pytest.raises(UserError, match=f"sequence 1 has {CONTEXT + 1} tokens > context length"):
        get_planner("megatron")(req)


def test_megatron_recomputing_the_longest_row_tp_does_not_divide_fits():
    """Under full recomputation the re-materialised layer of a row tp does not divide keeps a
    padded copy of its attention output: the limit leaves room for it, so a recomputing
    micro-batch of the limit's length fits the simulated peak, also after the first backward."""
    from lengthwise.sim import simulate_plan

    scheme = ParallelScheme(dp=1, tp=4, pp=1)
    cluster = cluster_preset("h100", scheme.num_gpus)
    cost = CostModel(model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster)
    limit = cost.max_seq_len(tp=4, recompute="full")
    n = limit if limit % 4 else limit - 1
    # two: the second runs after the first backward has made the gradients
    req = PlanRequest(lengths=[n, n], model=cost.model, cluster=cluster, scheme=scheme, cost=cost,
                      context_length=2 * limit, options={"recompute": "full"})
    plan = get_planner("megatron")(req)
    assert plan.options["recompute"] == "full"
    assert simulate_plan(plan, cost).fits


def test_megatron_recomputes_mlp_blocks_when_asked():
    """`recompute mlp` gives megatron (whose auto has no MLP level) every layer's MLP block
    recomputed (`F3.m14`), sized by that level's limit."""
    req = request([10, 35500, 700], "dp4-pp2", recompute="mlp")
    req.context_length = 65536
    plan = get_planner("megatron")(req)
    assert plan.options["recompute"] == "mlp"
    assert plan.options["micro_batch_tokens"] == min(65536, req.cost.max_seq_len(pp=2, dp=4, recompute="mlp"))
    layers = plan.pipelines[0].stage_layers(MODEL.num_layers)
    assert all((a.recompute_layers, a.recompute_mlp) == (0, layers[s])
               for p in plan.pipelines for s, acts in enumerate(p.stages) for a in acts if a.kind == "F")
    assert_valid(plan, req)
