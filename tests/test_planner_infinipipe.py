"""The infinipipe planner (infinipipe.txt §3): workload-balanced chunking (Algorithm 1), eq. 14
grouping, the stage-aware adaptive checkpointing MILP (Algorithm 2) against the simulator's
memory replay and against brute force, ablation options."""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, Chunk, Segment, StepPlan
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.infinipipe import planner as ip
from lengthwise.planners.infinipipe import grouping
from lengthwise.planners.infinipipe.chunking import (
    SliceCost,
    balanced_chunking,
    balanced_mesh,
    pack_buckets,
    split_by_mesh,
)
from lengthwise.planners.infinipipe.ckpt import (
    MIP_GAP,
    Checkpointing,
    GroupPlan,
    brute_force_checkpointing,
    checkpointing_problem,
    solve_checkpointing,
)
from lengthwise.planners.infinipipe.schedule import group_memory, group_schedule
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset
from lengthwise.workloads import get_profile

K = 1024


def request(lengths, *, dp=1, tp=8, pp=4, context=None, model="llama2-7b", memory_gb=80.0, **options):
    scheme = ParallelScheme(dp=dp, tp=tp, pp=pp)
    cluster = dataclasses.replace(cluster_preset("h100", scheme.num_gpus), gpu_memory_gb=memory_gb)
    cost = CostModel(model=MODEL_PRESETS[model], cluster=cluster)
    options.setdefault("score", "estimate")   # the simulator is exercised by the tests that need it
    return PlanRequest(lengths=list(lengths), model=cost.model, cluster=cluster, scheme=scheme, cost=cost,
                       context_length=context or max(lengths), options=options)


def tiny_request(lengths, *, memory_gb, pp=2, dp=1, **options):
    """The 4-layer tiny model on GPUs of a few MiB, so that memory binds at a few K tokens."""
    return request(lengths, dp=dp, tp=1, pp=pp, model="tiny", memory_gb=memory_gb, **options)


def plan(req) -> StepPlan:
    out = get_planner("infinipipe")(req)
    validate_plan(out, req.cost)
    return out


def sample(profile, n, context, seed=0):
    return [int(x) for x in get_profile(profile).sample(n, np.random.default_rng(seed), below=context + 1)]


def fit_7b(pp=4, tp=8):
    cost = request([1]).cost
    return cost, SliceCost.from_cost(cost, layers=32 // pp, tp=tp)


def one(seq, start, stop):
    return Chunk((Segment(seq, start, stop),))


# ---- Algorithm 1: the mesh, the split, the buckets ----

def test_slice_cost_reproduces_the_cost_model():
    cost, fit = fit_7b()
    for start, stop in [(0, 100), (0, 30_000), (70_000, 90_000)]:
        exact = cost.backward_time(one(0, start, stop), layers=8, tp=8)
        assert fit.work(start, stop) + fit.c == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("longest,n", [(200_000, 5), (1 << 20, 12), (9_000, 3)])
def test_mesh_slices_have_equal_backward_time(longest, n):
    cost, fit = fit_7b()
    mesh = balanced_mesh(longest, n, fit)
    times = [cost.backward_time(one(0, a, b), layers=8, tp=8) for a, b in itertools.pairwise(mesh.bounds)]
    assert len(times) == n and mesh.bounds[-1] == longest
    # Boundaries are rounded to whole tokens: one token's worth of the last slice's slope.
    slope = fit.a * longest + fit.b
    assert max(times) - min(times) <= 2 * slope
    assert mesh.time_threshold == pytest.approx(max(times), rel=1e-9)
    lengths = np.diff(mesh.bounds)
    assert mesh.token_threshold == lengths[0] and all(np.diff(lengths) <= 0)  # later slices have more context


def test_long_sequences_are_cut_by_the_mesh_and_end_in_a_tail_slice():
    _, fit = fit_7b()
    mesh = balanced_mesh(100_000, 4, fit)
    x1, x2 = mesh.bounds[1], mesh.bounds[2]
    lengths = [100_000, x1, x1 + 1, x2 + 7, 50]
    split, short = split_by_mesh(lengths, mesh)
    assert sorted(short) == [1, 4]
    assert [(s.start, s.stop) for s in split[2]] == [(0, x1), (x1, x1 + 1)]
    assert [(s.start, s.stop) for s in split[3]] == [(0, x1), (x1, x2), (x2, x2 + 7)]
    assert [(s.start, s.stop) for s in split[0]] == list(itertools.pairwise(mesh.bounds))


def test_buckets_hold_one_tail_at_most_and_respect_the_token_threshold():
    _, fit = fit_7b()
    lengths = sample("github", 512, 128 * K, seed=3)
    mesh = balanced_mesh(max(lengths), 6, fit)
    split, short = split_by_mesh(lengths, mesh)
    buckets, _ = pack_buckets([split[i][-1] for i in sorted(split)], short, lengths, mesh, fit)
    assert all(sum(s.start > 0 for s in b.segments) <= 1 for b in buckets)
    assert all(b.tokens <= mesh.token_threshold for b in buckets)
    placed = sorted(s.seq_id for b in buckets for s in b.segments if s.start == 0)
    assert placed == sorted(short)


def test_short_sequences_go_to_the_bucket_with_the_least_time_per_token():
    _, fit = fit_7b()
    mesh = balanced_mesh(40_000, 2, fit)
    x1 = mesh.bounds[1]
    # Two tails of equal tokens: the one deeper in its sequence costs more per token.
    lengths = [40_000, x1 + 3_000, 1_000]
    split, short = split_by_mesh(lengths, mesh)
    deep, shallow = split[0][-1], split[1][-1]
    buckets, _ = pack_buckets([deep, shallow], short, lengths, mesh, fit)
    home = next(b for b in buckets if any(s.seq_id == 2 for s in b.segments))
    assert home.segments[0] == shallow


def test_a_new_bucket_opens_only_when_no_bucket_has_token_room():
    _, fit = fit_7b()
    lengths = [20_000] + [5_000] * 8
    mesh = balanced_mesh(20_000, 1, fit)     # N = 1: nothing is split, T_m = 20K
    split, short = split_by_mesh(lengths, mesh)
    buckets, _ = pack_buckets([], short, lengths, mesh, fit)
    assert not split and sorted(b.tokens for b in buckets) == [20_000] * 3


def test_the_time_threshold_yields_to_token_balance():
    """Line 16: a short sequence that fits a bucket's tokens but not T_t raises T_t."""
    _, fit = fit_7b()
    mesh = balanced_mesh(100_000, 2, fit)
    tail_tokens = split_by_mesh([100_000], mesh)[0][0][-1].num_tokens
    half = min(mesh.bounds[1] // 2, mesh.token_threshold - tail_tokens)  # fits beside the tail by tokens
    lengths = [100_000, half, half]
    split, short = split_by_mesh(lengths, mesh)
    tail = split[0][-1]
    assert tail.num_tokens + half <= mesh.token_threshold            # fits by tokens ...
    assert fit.work(tail.start, tail.stop) + fit.work(0, half) + fit.c > mesh.time_threshold  # ... not by time
    buckets, _ = pack_buckets([tail], short, lengths, mesh, fit)
    assert [s.seq_id for s in buckets[0].segments] == [0, 1] and len(buckets) == 2


# ---- whole plans ----

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 6_000), min_size=1, max_size=30), dp=st.sampled_from([1, 2]),
       pp=st.sampled_from([1, 2, 4]), ckpt=st.sampled_from(["adaptive", "none", "full"]),
       balanced=st.booleans())
def test_every_plan_validates(lengths, dp, pp, ckpt, balanced):
    req = tiny_request(lengths, memory_gb=0.5, pp=pp, dp=dp, checkpointing=ckpt, balanced_chunking=balanced,
                       slice_candidates=2)
    out = plan(req)
    assert len(out.pipelines) == dp


def test_a_single_million_token_outlier_is_split_and_planned():
    lengths = [1 << 20] + sample("commoncrawl", 63, 8 * K, seed=1)
    # 96 GB GPUs: on 80 GB the last stage's K/V state and gradients of the million tokens, with
    # the gathered norm outputs tp8 keeps whole, leave under 3 GiB for anything else
    out = plan(request(lengths, slice_candidates=2, memory_gb=96.0))
    pieces = [s for p in out.pipelines for c in p.chunks for s in c.segments if s.seq_id == 0]
    assert len(pieces) == out.metrics["num_slices"] > 1
    assert [s.start for s in sorted(pieces)] == out.metrics["mesh"][:-1]


def test_an_all_short_batch_needs_no_split_and_no_recomputation():
    lengths = sample("commoncrawl", 256, 2 * K, seed=2)
    out = plan(request(lengths, dp=2, pp=2, slice_candidates=2))
    assert all(s.start == 0 and s.stop == lengths[s.seq_id] for p in out.pipelines for c in p.chunks
               for s in c.segments if out.metrics["num_slices"] == 1)
    assert out.metrics["recompute_layer_chunks"] == 0


def test_a_bimodal_batch_validates_and_balances_chunk_time():
    lengths = sample("chatqa2", 256, 99 * K, seed=4)
    req = request(lengths, dp=2, pp=4, num_slices=4)
    out = plan(req)
    cost, layers = req.cost, 8
    split = [c for p in out.pipelines for c in p.chunks if len(c.segments) == 1 and c.segments[0].stop > 0
             and c.segments[0].stop < lengths[c.segments[0].seq_id]]
    times = [cost.backward_time(c, layers=layers, tp=8) for c in split]
    assert times and max(times) <= out.metrics["time_threshold_s"] * (1 + 1e-9)


def test_slices_of_a_sequence_run_forward_in_order_and_backward_in_reverse():
    lengths = [300_000, 120_000] + sample("github", 40, 4 * K, seed=5)
    out = plan(request(lengths, num_slices=5))
    for pipe in out.pipelines:
        for acts in pipe.stages:
            for seq in (0, 1):
                chunks = [c for c, ch in enumerate(pipe.chunks) if any(s.seq_id == seq for s in ch.segments)]
                fwd = [a.chunk for a in acts if a.kind == FORWARD and a.chunk in chunks]
                bwd = [a.chunk for a in acts if a.kind == BACKWARD and a.chunk in chunks]
                start = {c: next(s.start for s in pipe.chunks[c].segments if s.seq_id == seq) for c in chunks}
                assert [start[c] for c in fwd] == sorted(start.values())
                assert [start[c] for c in bwd] == sorted(start.values(), reverse=True)


def test_plans_are_deterministic():
    lengths = sample("github", 128, 64 * K, seed=6)
    a, b = (plan(request(lengths, dp=2, slice_candidates=3)) for _ in range(2))
    strip = lambda p: {k: v for k, v in p.to_dict().items() if k != "metrics"}
    assert strip(a) == strip(b)


# ---- grouping (eq. 14) ----

def test_grouping_dp_is_no_worse_than_any_contiguous_partition():
    req = tiny_request([3000, 2600, 2000, 1500, 900] + [200] * 20, memory_gb=0.05, num_slices=4)
    settings_ = ip.read_settings(req)
    fit = SliceCost.from_cost(req.cost, layers=2)
    batch = balanced_chunking(req.lengths, 4, fit)
    lay = grouping.layout(req, 1)
    grouped = grouping.group_by_classes(batch.units, req, lay, settings_.solver)
    assert grouped is not None
    classes = sorted({u.num_chunks for u in batch.units})
    mean = sum(grouping.chunk_stage_seconds(c, req, lay.stages[0]) for u in batch.units for c in u.chunks) / \
        sum(u.num_chunks for u in batch.units)
    best = np.inf
    for cuts in itertools.product([False, True], repeat=len(classes) - 1):
        edges = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(classes)]
        total = 0.0
        for a, b in itertools.pairwise(edges):
            g = grouping.plan_group([u for u in batch.units if u.num_chunks in classes[a:b]], req, lay,
                                    settings_.solver)
            total += np.inf if g.ckpt.status == "infeasible" else (req.scheme.pp - 1) * mean + g.ckpt.seconds
        best = min(best, total)
    assert grouped[1] == pytest.approx(best, rel=1e-9)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), pp=st.sampled_from([1, 2, 4]), num_slices=st.integers(1, 5))
def test_the_no_recomputation_bound_is_above_every_level(seed, pp, num_slices):
    """`held_at_most` (a window's largest activations plus all K/V) bounds every backward-start
    level of the memory model without recomputation, on every stage, prepared or not; the
    all-pipelines form agrees with the per-pipeline one."""
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(50, 3000, size=int(rng.integers(3, 30)))]
    req = tiny_request(lengths, memory_gb=1.0, pp=pp, dp=2, num_slices=num_slices)
    batch = balanced_chunking(lengths, num_slices, SliceCost.from_cost(req.cost, layers=4 // pp))
    if batch is None:
        return
    halves = [list(range(0, len(batch.units), 2)), list(range(1, len(batch.units), 2))]
    for prepared in (False, True):
        lay = grouping.layout(req, 2)
        if prepared:
            lay.costs.prepare([u.chunks for u in batch.units])
            assert lay.costs.surely_fit(halves) == [
                bool(share) and grouping.surely_fits([batch.units[i] for i in share], lay) for share in halves]
        for share in halves:
            units = [batch.units[i] for i in share]
            if not units:
                continue
            memory = grouping.group_problem(units, req, lay).memory
            for s in range(pp):
                bound = lay.costs.held_at_most(s, [u.chunks for u in units])
                assert memory.stages[s].levels().max() <= bound * (1 + 1e-12)


def test_grouping_by_the_bound_equals_grouping_by_the_memory_model():
    """A pipeline the bound clears gets the same single group, checkpointing and cost as the
    memory model gives it."""
    lengths = sample("github", 60, 16 * K, seed=3)
    req = request(lengths, dp=2, num_slices=4)
    batch = balanced_chunking(lengths, 4, fit_7b()[1])
    settings_ = ip.read_settings(req)
    lay = grouping.layout(req, 2)
    lay.costs.prepare([u.chunks for u in batch.units])
    assert grouping.surely_fits(batch.units, lay)
    fast = grouping.group_by_classes(batch.units, req, lay, settings_.solver)
    exact = grouping.group_by_classes(batch.units, req, lay, settings_.solver, fits=False)
    assert len(fast[0]) == len(exact[0]) == 1 and fast[1] == exact[1]
    assert dataclasses.asdict(fast[0][0].ckpt) == dataclasses.asdict(exact[0][0].ckpt)
    assert fast[0][0].schedule.chunks == exact[0][0].schedule.chunks
    assert fast[0][0].schedule.stages == exact[0][0].schedule.stages


def test_the_simulated_pick_is_the_fastest_of_the_best_by_estimate():
    """With score simulate, the SIMULATED best N by the DP's estimate are simulated and the
    plan is the fastest of them."""
    lengths = sample("github", 96, 32 * K, seed=4)
    out = plan(request(lengths, dp=2, score="simulate", slice_candidates=5))
    est = {int(n): v for n, v in out.metrics["candidates"].items() if isinstance(v, float)}
    sims = {int(n): v for n, v in out.metrics["simulated_candidates"].items()}
    assert sorted(sims) == sorted(sorted(est, key=lambda n: (est[n], n))[:ip.SIMULATED])
    assert out.metrics["num_slices"] == min(sims, key=lambda n: (sims[n], n))
    assert out.metrics["predicted_step_time_s"] == min(sims.values())


# ---- checkpointing (Algorithm 2) ----

def tight_group(memory_gb=0.038, pp=2):
    """A small group whose memory binds: two split sequences and a few batched chunks."""
    req = tiny_request([2400, 1600, 300, 300, 250, 200], memory_gb=memory_gb, pp=pp, num_slices=3)
    fit = SliceCost.from_cost(req.cost, layers=4 // pp)
    batch = balanced_chunking(req.lengths, 3, fit)
    lay = grouping.layout(req, 1)
    group = group_schedule([u.chunks for u in batch.units], pp)
    return req, lay, group, group_memory(group, lay.costs, first_group=True)  # the pipeline's only group


def test_milp_finds_the_cheapest_feasible_recomputation():
    """The MILP's answer fits (`Problem.fits`, the exact levels) and is within the MIP gap of the
    cheapest answer to its linear rows (`Problem.rows`), found here by enumeration. Those rows
    charge each backward's own chunk a line in its recomputed layers (`StageMemory.own_costs`),
    exact at none and one and above the exact level's kept bytes plus one re-materialised layer
    beyond, so the exact optimum can be cheaper where such a row binds (at 0.025 GB, since the cost model charges every stage's backward its
    working set 0.03 GB, and since it charges the LM head's forward its working set 0.035 GB, and
    since it counts the stage's output, rotary tables and residual gradient 0.036 GB: there the
    enumerated optimum breaks only a first-stage backward row, by its own chunk's bytes);
    elsewhere the two agree."""
    for gb in (0.02, 0.025, 0.03, 0.035, 0.036, 0.038, 0.04):
        _, _, group, memory = tight_group(gb)
        ckpt = solve_checkpointing(group, memory)
        brute = brute_force_checkpointing(group, memory)
        problem = checkpointing_problem(group, memory)
        cols, a, ub = problem.rows()
        linear = min((float(np.dot(problem.weights, v)) for v in itertools.product(
            *(range(int(h) + 1) for h in problem.upper)) if np.all(a @ np.asarray(v, float)[cols] <= ub + 1e-9)),
            default=np.inf)
        if ckpt.status == "infeasible":
            assert brute == np.inf
        elif linear == np.inf:  # the rows forbid even full recomputation, which the levels allow
            assert problem.fits(problem.upper) and ckpt.values == problem.upper.tolist()
        else:
            assert problem.fits(ckpt.values)
            assert brute <= linear <= ckpt.seconds <= linear * (1 + MIP_GAP) + 1e-12
        if gb >= 0.038:
            assert ckpt.seconds == pytest.approx(brute)


def test_the_tight_group_needs_some_but_not_full_recomputation():
    _, _, group, memory = tight_group()
    ckpt = solve_checkpointing(group, memory)
    assert ckpt.status == "milp" and 0 < sum(ckpt.values) < len(ckpt.values) * 2


def simulate_group(req, group, recompute):
    """The simulator's result for one group run alone with the given recomputation."""
    from lengthwise.sim import simulate_plan

    ckpt = Checkpointing(values=[], recompute=recompute, seconds=0.0, status="given")
    pipe = ip.to_pipeline([GroupPlan(schedule=group, ckpt=ckpt)], req)
    sp = StepPlan(planner="infinipipe", model=req.model, cluster=req.cluster, lengths=req.lengths,
                  pipelines=[pipe], zero=req.scheme.zero)
    return simulate_plan(sp, req.cost)


def test_milp_memory_model_agrees_with_the_simulators_replay():
    req, lay, group, memory = tight_group()
    ckpt = solve_checkpointing(group, memory)
    result = simulate_group(req, group, ckpt.recompute)
    for s in range(group.pp):
        mine = memory.peak(s, ckpt.recompute[s]) + lay.stages[s].states
        assert result.peak_memory[0][s] == pytest.approx(mine, rel=1e-9)
    assert result.fits


def test_memory_model_charges_the_reruns_end_when_every_layer_is_recomputed():
    """LLaMA-2-7B at tp 8 with sequence parallelism: a recomputed layer's backward runs the
    product's own nodes, whose largest moment is the rerun's end beside the gathered output
    gradient (`mem.rerun_bytes_per_token`), in place of the plain layer's SwiGLUDown backward,
    which the simulator charges a chunk whose every layer is recomputed. The MILP's exact
    levels charge that moment (its `rerun` row, per token the difference of the two; first
    stage: equal to the simulator's replay), and its linear rows equal the levels without
    recomputation and bound them from above with it."""
    import lengthwise.cost.memory as mem

    req = request([24000, 16000, 3000, 3000, 2500, 2000], tp=8, pp=2, num_slices=3)
    end = mem.rerun_bytes_per_token(req.model, 8)
    assert mem.layer_backward_bytes_per_token(req.model, 8, rerun=True) == end
    assert end != mem.layer_backward_bytes_per_token(req.model, 8)
    batch = balanced_chunking(req.lengths, 3, SliceCost.from_cost(req.cost, layers=16, tp=8))
    lay = grouping.layout(req, 1)
    group = group_schedule([u.chunks for u in batch.units], 2)
    memory = group_memory(group, lay.costs, first_group=True)
    first = memory.stages[0]
    tokens = np.array([sum(s.stop - s.start for s in c.segments) for c in group.chunks], dtype=float)
    per_token = end - mem.layer_backward_bytes_per_token(req.model, 8)
    assert first.layers == 16 and first.rerun == pytest.approx(per_token * tokens, rel=1e-12)
    problem = checkpointing_problem(group, memory)
    rows = len(first.rows)
    for values in (problem.upper, np.minimum(problem.upper, 3), np.minimum(problem.upper, 1), 0 * problem.upper):
        r = problem.recompute(values)[0]
        recompute = problem.recompute(values).astype(int).tolist()
        simulated = simulate_group(req, group, recompute).peak_memory[0][0]
        assert simulated == pytest.approx(memory.peak(0, recompute[0]) + lay.stages[0].states, rel=1e-12)
        linear = (first.levels() - first.savings() @ r)[:rows]
        assert np.all(linear >= first.levels(r)[:rows] - 1e-6 * first.levels(r)[:rows])
        if not r.any():
            assert np.array_equal(linear, first.levels(r)[:rows])


def test_no_cheaper_recomputation_fits_the_simulator():
    """Brute force over every C of eq. 15 (all wave assignments), feasibility judged by the
    simulator's own memory replay rather than by the MILP's rows."""
    req, _, group, memory = tight_group()
    problem = checkpointing_problem(group, memory)
    ckpt = solve_checkpointing(group, memory)
    cheapest = np.inf
    for values in itertools.product(*(range(int(h) + 1) for h in problem.upper)):
        if simulate_group(req, group, problem.recompute(values).astype(int).tolist()).fits:
            cheapest = min(cheapest, float(np.dot(problem.weights, values)))
    assert 0 < cheapest <= ckpt.seconds <= cheapest * (1 + MIP_GAP) + 1e-12


@pytest.mark.parametrize("dp,pp", [(1, 2), (2, 2), (1, 4)])
def test_every_planned_stage_peak_is_the_simulators_peak(dp, pp):
    """Whole plans (several groups, some recomputing): each stage's simulated peak equals the
    largest peak the MILP's memory rows predict over that pipeline's groups, and fits."""
    from lengthwise.sim import simulate_plan

    lengths = [3000, 2500, 1800, 1200, 900] + sample("tiny", 40, 512, seed=9)
    req = tiny_request(lengths, memory_gb=0.04, pp=pp, dp=dp, num_slices=4)
    settings_ = ip.read_settings(req)
    batch = balanced_chunking(lengths, 4, SliceCost.from_cost(req.cost, layers=4 // pp))
    cand = ip.plan_candidate(batch, req, settings_)
    out = ip.candidate_plan(cand, req, settings_, started=0.0)
    validate_plan(out, req.cost)
    result = simulate_plan(out, req.cost)
    lay = grouping.layout(req, dp)
    assert any(r for groups in cand.pipelines for g in groups for row in g.ckpt.recompute for r in row)
    for p, groups in enumerate(cand.pipelines):
        for s in range(pp):
            # the pipeline's first group makes the gradients in its first backward on each stage
            predicted = max(group_memory(g.schedule, lay.costs, first_group=i == 0).peak(s, g.ckpt.recompute[s])
                            for i, g in enumerate(groups))
            assert result.peak_memory[p][s] == pytest.approx(predicted + lay.stages[s].states, rel=1e-9)
    assert result.fits


# ---- ablations and options ----

def test_full_checkpointing_recomputes_every_layer_of_every_chunk():
    req = tiny_request([2400, 1600, 300, 300, 250, 200], memory_gb=0.05, num_slices=3, checkpointing="full")
    out = plan(req)
    assert {a.recompute_layers for p in out.pipelines for acts in p.stages for a in acts if a.kind == FORWARD} == {2}


def test_no_checkpointing_never_recomputes():
    req = tiny_request([2400, 1600, 300, 300, 250, 200], memory_gb=0.04, checkpointing="none")
    out = plan(req)
    assert all(a.recompute_layers == 0 for p in out.pipelines for acts in p.stages for a in acts)


def test_even_chunking_cuts_equal_token_slices():
    lengths = [100_000, 60_000] + sample("github", 30, 4 * K, seed=8)
    out = plan(request(lengths, num_slices=4, balanced_chunking=False))
    pieces = sorted(s for p in out.pipelines for c in p.chunks for s in c.segments if s.seq_id == 0)
    assert [s.num_tokens for s in pieces] == [25_000] * 4


def test_bad_options_are_user_errors():
    for bad in ({"checkpointing": "some"}, {"num_slices": 0}, {"balanced_chunking": "yes"},
                {"milp_time_limit_s": -1}, {"chunk_size": 4096}):
        with pytest.raises(UserError):
            get_planner("infinipipe")(request([1000, 2000], **bad))


def test_a_sequence_that_cannot_fit_names_itself():
    with pytest.raises(UserError, match=r"sequence 1 \(4000000 tokens.* needs .* GiB on stage"):
        get_planner("infinipipe")(tiny_request([100, 4_000_000], memory_gb=0.05, pp=2))


def test_rows_no_recomputation_relieves_make_the_group_infeasible():
    """A stage over its limit where no wave can recompute anything (the chunks alive there save
    nothing) is infeasible: an infinite bound and no solution, not a numpy error (chunkflow's
    256K setting reached this once recomputation re-materialised one layer at a time)."""
    import numpy as np

    from lengthwise.planners.infinipipe.ckpt import Problem, row_bound

    class Rows:
        upper, weights, relaxed = np.array([3.0]), np.array([1.0]), None

        def rows(self):
            return np.zeros(0, dtype=int), np.zeros((2, 0)), np.array([-1.0, -2.0])

    assert row_bound(Rows()) == np.inf
    assert Problem.solve(Rows(), integral=True) == (None, np.inf)


@st.composite
def unit_lists(draw):
    """Units of chunks holding slices of sequences cut anywhere (several split sequences per unit,
    slices of two sequences in one chunk, slices out of token order), and whole sequences."""
    units, seq = [], 0
    for _ in range(draw(st.integers(1, 6))):
        chunks = [[] for _ in range(draw(st.integers(1, 4)))]
        for _ in range(draw(st.integers(1, 3))):
            length = draw(st.integers(2, 3000))
            cuts = sorted(set(draw(st.lists(st.integers(1, length - 1), max_size=len(chunks) - 1))))
            edges = [0] + cuts + [length]
            places = draw(st.permutations(range(len(chunks))))
            for (a, b), c in zip(itertools.pairwise(edges), places):
                chunks[c].append(Segment(seq, a, b))
            seq += 1
        units.append([Chunk(tuple(c)) for c in chunks if c])
    return units


@settings(max_examples=60, deadline=None)
@given(units=unit_lists(), cp=st.sampled_from([1, 2]))
def test_kv_rows_of_all_units_at_once_are_each_units_own(units, cp):
    """UnitCosts.prepare's K/V rows (every split unit at once) are kv_events of each unit, bit for
    bit, on every stage shape."""
    from lengthwise.planners.infinipipe.unit_costs import kv_events, split_slices

    req = request([4 * K] * 4, pp=4, tp=8)
    lay = grouping.layout(req, 1)
    costs = type(lay.costs)(req.cost, lay.stages, tp=8, cp=cp)
    costs.prepare(units)
    for stage in range(len(lay.stages)):
        at = 0
        table = costs.columns(stage, units)
        for u in units:
            own = kv_events(split_slices(u), costs, stage, len(u)) if len(u) > 1 else np.zeros((3, 1))
            assert np.array_equal(table[3:, at:at + len(u)], own)
            at += len(u)
