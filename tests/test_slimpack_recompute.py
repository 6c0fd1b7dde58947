"""SlimPack's activation recomputation (option `recompute`, slimpack §6.1): when no MicroPack
count fits (the longest sequence's activations are a floor, all its slices are forwarded before
its backward), "auto" plans again with each stage's forwards recomputing part or all of its
layers; otherwise it is exactly the plan without recomputation.

The tight cases, one pipeline (dp 1, cp 1) of two stages, two layers a stage. No MicroPack count
fits either without recomputation. TIGHT: the 4-layer `tiny` model on GPUs of 0.0165 GiB
(0.019 until the LM head's loss was blocked, `runtime/loss.head_loss_sum`, and stopped keeping
6 x vocab bytes a token; 0.0175 until a layer kept the SwiGLU's gate and up but not their
product, `runtime/layer_ops.SwiGLUDown`);
recomputing one layer of each stage fits only at 32 MicroPacks and both layers (8 MicroPacks)
are faster. PARTIAL: the narrower SMALL model with a 512-token vocabulary on GPUs of 0.00255 GiB
(one layer a stage fits from 0.00251 GiB, none from 0.00258; 0.00264 until a layer kept gate and
up alone), where one layer a stage fits and is faster than both. (PARTIAL was `tiny` on 0.018 GiB until the simulator counted the gradients from
each stage's first backward and freed SlimPack's cells one by one: `tiny`'s gradients, 8% of such
a GPU, then left no memory at which the planner's floor, which counts them all step, passes and
the simulator still needs recomputation. It was SMALL itself, 64 tokens of vocabulary, on 0.00259
GiB until the simulator charged the LM head's forward working block at each forward on the last
stage: SMALL then has no memory at which one layer a stage fits and is faster than both.)"""

from __future__ import annotations

import dataclasses

import pytest

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import FORWARD, SHARDED
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.slimpack.build import flops_models, phase1_variants, prepare_stream
from lengthwise.planners.slimpack.planner import recompute_levels, simulate_candidates
from lengthwise.sim import simulate_plan
from lengthwise.specs import MODEL_PRESETS, ClusterSpec, ModelSpec, ParallelScheme, cluster_preset

TIGHT_LENGTHS = [1024, 1000, 750, 500]
TIGHT_GIB = 0.0165
PARTIAL_LENGTHS = [1024] + [200] * 20
PARTIAL_GIB = 0.00255
SMALL = ModelSpec(name="small", num_layers=4, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=48,
                  vocab=64)
"""For the executor (the tight case again, on fewer tokens)."""
PARTIAL_MODEL = dataclasses.replace(SMALL, vocab=512)
"""For PARTIAL."""


def request(lengths, *, memory_gib=None, model="tiny", dp=1, tp=1, pp=2, cp=1, **options) -> PlanRequest:
    scheme = ParallelScheme(dp=dp, tp=tp, pp=pp, cp=cp)
    cluster = (cluster_preset("h100", scheme.num_gpus) if memory_gib is None else
               ClusterSpec(name="small", num_gpus=scheme.num_gpus, gpu_memory_gb=memory_gib))
    cost = CostModel(model=model if isinstance(model, ModelSpec) else MODEL_PRESETS[model], cluster=cluster)
    return PlanRequest(lengths=list(lengths), model=cost.model, cluster=cluster, scheme=scheme, cost=cost,
                       context_length=max(lengths), options=options)


def tight(**options) -> PlanRequest:
    return request(TIGHT_LENGTHS, memory_gib=TIGHT_GIB, **options)


def partial(**options) -> PlanRequest:
    return request(PARTIAL_LENGTHS, memory_gib=PARTIAL_GIB, model=PARTIAL_MODEL, **options)


def forward_recompute(plan) -> set[tuple[int, int]]:
    """(stage, recomputed layers) of every forward action of the plan."""
    return {(s, a.recompute_layers) for pipe in plan.pipelines for s, acts in enumerate(pipe.stages)
            for a in acts if a.kind == FORWARD}


def comparable(plan) -> dict:
    d = plan.to_dict()
    d["metrics"].pop("planning_ms")
    return d


@pytest.mark.parametrize("make", [tight, partial])
def test_without_recompute_the_tight_batches_fit_no_count(make):
    with pytest.raises(UserError, match="pipeline 0 fits no MicroPack count") as err:
        get_planner("slimpack")(make(recompute="none"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("make,level,name", [(tight, [2, 2], "full"), (partial, [1, 1], "partial")])
def test_auto_keeps_the_fastest_recompute_level_that_fits_and_the_plan_is_valid(make, level, name):
    req = make()  # recompute defaults to auto
    plan = get_planner("slimpack")(req)
    validate_plan(plan, req.cost)
    # tiny has 4 layers, 2 per stage: the levels are none, 1 of 2 and 2 of 2
    assert recompute_levels(req, "auto") == [[0, 0], [1, 1], [2, 2]]
    tried = plan.metrics["recompute_levels"]
    assert [t["recompute_layers"] for t in tried] == [[0, 0], [1, 1], [2, 2]]
    assert [t["fits"] for t in tried] == [False, True, True]
    fastest = min(tried[1:], key=lambda t: t["step_time_s"])
    assert fastest["recompute_layers"] == level == plan.metrics["recompute_layers"]
    assert fastest["step_time_s"] == plan.metrics["predicted_step_time_s"]
    assert plan.options["recompute"] == name
    assert forward_recompute(plan) == {(0, level[0]), (1, level[1])}
    assert any(f".r{level[0]}" in text for pipe in plan.to_dict()["pipelines"] for text in pipe["stages"])
    result = simulate_plan(plan, req.cost)
    assert result.fits and max(max(row) for row in result.peak_memory) <= req.cost.capacity_bytes
    assert result.step_time_s == plan.metrics["predicted_step_time_s"]


def test_full_recomputes_every_layer_of_every_stage():
    req = tight(recompute="full")
    plan = get_planner("slimpack")(req)
    validate_plan(plan, req.cost)
    assert plan.options["recompute"] == "full" and plan.metrics["recompute_layers"] == [2, 2]
    assert forward_recompute(plan) == {(0, 2), (1, 2)}
    assert simulate_plan(plan, req.cost).fits


def test_mlp_recomputes_the_mlp_block_of_every_layer_and_fits_where_none_does_not():
    """recompute "mlp": every forward recomputes its stage's MLP blocks (F3.m2), no whole layer;
    on the tight batch, which fits no count without recomputation, the plan fits, holds less
    than it would without (same count) and more than recomputing whole layers."""
    req = tight(recompute="mlp")
    plan = get_planner("slimpack")(req)
    validate_plan(plan, req.cost)
    assert plan.options["recompute"] == "mlp"
    assert plan.metrics["recompute_mlp_layers"] == [2, 2] and plan.metrics["recompute_layers"] == [0, 0]
    assert {(s, a.recompute_layers, a.recompute_mlp) for pipe in plan.pipelines for s, acts in enumerate(pipe.stages)
            for a in acts if a.kind == FORWARD} == {(0, 0, 2), (1, 0, 2)}
    result = simulate_plan(plan, req.cost)
    assert result.fits and result.step_time_s == plan.metrics["predicted_step_time_s"]
    [count], lean = plan.metrics["micropacks"], plan.pipelines[0].schedule.endswith("-lean")
    models = flops_models(req)
    variants, flops = phase1_variants(req, models, True)
    groups = variants[0]
    prepared = [prepare_stream(req, g, flops) for g in groups]

    def one(**recompute):
        return simulate_candidates(req, groups, [count], models, flops, True, lean, prepared, **recompute)[0]

    plain, mlp, full = one(), one(mlp=[2, 2]), one(recompute=[2, 2])
    assert plain["peak"][0] > mlp["peak"][0] > full["peak"][0]
    assert plain[STEP] < mlp[STEP] < full[STEP]


def test_fixed_count_with_full_recomputes_its_forwards():
    req = tight(recompute="full", num_micropacks=8)
    plan = get_planner("slimpack")(req)
    validate_plan(plan, req.cost)
    assert forward_recompute(plan) == {(0, 2), (1, 2)}
    # auto with a fixed count never recomputes
    assert forward_recompute(get_planner("slimpack")(tight(num_micropacks=8))) == {(0, 0), (1, 0)}


def test_the_sweep_simulates_the_recompute_it_plans():
    """At one count (the one auto keeps), the recomputing candidate holds less memory and takes
    longer: the sweep's simulation reads the recompute off the candidate's actions."""
    req = tight()
    kept = get_planner("slimpack")(req)
    [count], lean = kept.metrics["micropacks"], kept.pipelines[0].schedule.endswith("-lean")
    models = flops_models(req)
    variants, flops = phase1_variants(req, models, True)
    groups = variants[0]
    prepared = [prepare_stream(req, g, flops) for g in groups]

    def one(recompute):
        return simulate_candidates(req, groups, [count], models, flops, True, lean, prepared,
                                   recompute=recompute)[0]

    plain, half, full = one(None), one([1, 1]), one([2, 2])
    assert plain["peak"][0] > half["peak"][0] > full["peak"][0]
    assert plain[STEP] < half[STEP] < full[STEP]
    assert not plain["fits"] and full["fits"]


STEP = "step_time_s"


@pytest.mark.parametrize("lengths,kw", [
    ([3000, 900, 700, 500, 300, 200, 100, 50], dict(model="tiny", pp=2, dp=2)),
    ([60_000, 9000, 7000, 5000, 3000, 2000, 1000, 500], dict(model="qwen2.5-0.5b", pp=2, dp=2)),
])
def test_auto_is_the_plan_without_recompute_whenever_that_fits(lengths, kw):
    auto = get_planner("slimpack")(request(lengths, **kw))
    none = get_planner("slimpack")(request(lengths, recompute="none", **kw))
    assert auto.options["recompute"] == "none" and auto.metrics["recompute_layers"] == [0, 0]
    assert comparable(auto) == comparable(none)
    assert {r for _, r in forward_recompute(auto)} == {0}


def test_recompute_levels_round_up_shares_of_each_stages_layers():
    req = request([100], model="llama2-13b", pp=4)  # 40 layers, 10 a stage
    assert recompute_levels(req, "auto") == [[0] * 4, [3] * 4, [5] * 4, [8] * 4, [10] * 4]
    assert recompute_levels(req, "full") == [[10] * 4]
    assert recompute_levels(req, "none") == [[0] * 4]
    uneven = request([100], model="tiny", pp=3)  # 4 layers as 2, 1, 1
    assert recompute_levels(uneven, "auto") == [[0, 0, 0], [1, 1, 1], [2, 1, 1]]


@pytest.mark.parametrize("value", ["some", "", True, 3])
def test_bad_recompute_is_a_user_error(value):
    with pytest.raises(UserError, match="recompute must be one of none, mlp, full, auto"):
        get_planner("slimpack")(tight(recompute=value))


def test_recompute_in_a_merged_pipeline_lands_on_cp_sharded_micropacks():
    """A DP-Merged outlier's MicroPacks are CP-sharded; the distributed executor refuses to
    recompute those (runtime/distributed/cp_stage.py), so such a plan is for the simulator and
    the one-process executor only. This pins down that the planner does produce it."""
    req = request([30_000, 500, 400, 300, 200, 100], memory_gib=None, model="tiny", pp=2, dp=2,
                  recompute="full")
    plan = get_planner("slimpack")(req)
    validate_plan(plan, req.cost)
    merged = [p for p in plan.pipelines if p.cp > 1]
    assert merged
    sharded = {c for p in merged for c, chunk in enumerate(p.chunks)
               if any(s.cp_rank == SHARDED for s in chunk.segments)}
    assert sharded
    assert all(a.recompute_layers == 2 for p in merged for acts in p.stages for a in acts if a.kind == FORWARD)


def test_tight_recompute_plan_trains_exactly():
    """The one-process executor runs the recomputing plan: loss and gradients as transformers'
    (or the unpacked model's) on each sequence alone, within float64's tolerance (verify_plan's)."""
    torch = pytest.importorskip("torch")
    from lengthwise.runtime.verify import verify_plan

    req = request([300, 280, 200, 100], memory_gib=0.00088, model=SMALL)
    with pytest.raises(UserError, match="fits no MicroPack count"):
        get_planner("slimpack")(request([300, 280, 200, 100], memory_gib=0.00088, model=SMALL, recompute="none"))
    plan = get_planner("slimpack")(req)
    validate_plan(plan, req.cost)
    assert plan.metrics["recompute_layers"] == [2, 2] and len(plan.pipelines[0].chunks) > 1
    result = verify_plan(plan, dtype=torch.float64, seed=0)
    assert result.passed, result.to_dict()


def test_auto_fitting_nowhere_says_it_recomputed_every_layer():
    req = request(TIGHT_LENGTHS, memory_gib=0.0155)
    with pytest.raises(UserError, match=r"\(also recomputing every layer\)$") as err:
        get_planner("slimpack")(req)
    assert "\n" not in str(err.value)
