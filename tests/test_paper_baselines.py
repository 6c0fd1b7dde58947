"""The papers' own baselines (planners/baselines.py): Megatron-LM with best-fit packing and
per-batch partial recomputation (SlimPack's), DeepSpeed ZeRO-2 reducing gradients after every
micro-batch (Skrull's), and the paper models' presets accepting the papers' baseline schemes."""

from __future__ import annotations

import pytest

from lengthwise.cost import CostModel
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.baselines import micro_batch_reduction_s
from lengthwise.sim import simulate_plan
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset

MODEL = MODEL_PRESETS["qwen2.5-1.5b"]


def request(lengths, scheme: ParallelScheme, context: int, **options) -> PlanRequest:
    cluster = cluster_preset("h100", scheme.num_gpus)
    return PlanRequest(lengths=list(lengths), model=MODEL, cluster=cluster, scheme=scheme,
                       cost=CostModel(model=MODEL, cluster=cluster), context_length=context, options=options)


def rows(plan) -> set[frozenset[int]]:
    return {frozenset(s.seq_id for s in c.segments) for p in plan.pipelines for c in p.chunks}


def test_megatron_packs_next_fit_by_default_and_best_fit_as_slimpacks_baseline():
    """Hand-packed at 8192 tokens a row: next-fit takes sequences as they come and opens a row
    whenever the next does not fit (3 rows); best-fit decreasing puts each, longest first, in the
    fullest row it fits (2 rows, the second exactly full)."""
    lengths = [5000, 3750, 3000, 2500, 1250, 692]
    scheme = ParallelScheme(dp=1, pp=2)
    next_fit = get_planner("megatron")(request(lengths, scheme, 8192, recompute="none"))
    assert rows(next_fit) == {frozenset({0}), frozenset({1, 2}), frozenset({3, 4, 5})}
    assert next_fit.options["packing"] == "next-fit"
    req = request(lengths, scheme, 8192, recompute="none", packing="best-fit")
    best_fit = get_planner("megatron")(req)
    assert rows(best_fit) == {frozenset({0, 2}), frozenset({1, 3, 4, 5})}
    assert best_fit.options["packing"] == "best-fit"
    validate_plan(best_fit, req.cost)


def test_partial_recomputation_is_decided_per_batch_with_the_fewest_layers_that_fit():
    """Context-length micro-batches that do not fit without recomputation: `auto` decides full
    once from the context, for every batch; `partial` recomputes nothing on a batch of short
    packs and, on a batch with a long one, the fewest layers with which the step fits."""
    scheme = ParallelScheme(dp=4, pp=2)
    cost = request([1], scheme, 1).cost
    context = int(cost.max_seq_len(pp=2, dp=4, recompute="full"))
    assert context > cost.max_seq_len(pp=2, dp=4)
    short = [900, 700, 500, 300] * 4
    auto = get_planner("megatron")(request(short, scheme, context))
    assert auto.options["recompute"] == "full"
    plan = get_planner("megatron")(request(short, scheme, context, recompute_per_batch=True))
    assert plan.options["recompute"] == "none" and not any(plan.metrics["recompute_layers"])
    long_batch = [context - 64] + short
    req = request(long_batch, scheme, context, recompute_per_batch=True)
    plan = get_planner("megatron")(req)
    level = plan.metrics["recompute_layers"]
    assert any(level) and simulate_plan(plan, req.cost).fits
    validate_plan(plan, req.cost)
    layers = [MODEL.num_layers // 2] * 2
    assert plan.options["recompute"] == ("full" if level == layers else "partial")
    assert context - 64 > cost.max_seq_len(pp=2, dp=4)  # without recomputation it would not fit


def test_static_cp_reducing_after_every_micro_batch_pays_one_reduction_per_micro_batch():
    """DeepSpeed ZeRO-2 (Skrull's baseline): with 4 micro-batches a DP rank, 3 reductions over
    dp x cp beyond the one the simulator charges after the last backward."""
    scheme = ParallelScheme(dp=2, cp=2, zero=2)
    lengths = [3000] * 8
    once = get_planner("static-cp")(request(lengths, scheme, 8192))
    every = get_planner("static-cp")(request(lengths, scheme, 8192, grad_reduce="micro-batch"))
    assert every.options["grad_reduce"] == "micro-batch"
    cost = request([1], scheme, 1).cost
    per = micro_batch_reduction_s(request(lengths, scheme, 8192))
    assert per > 0 and all(len(p.chunks) == 4 for p in every.pipelines)
    assert all(p.extra_comm_s == pytest.approx(3 * per) for p in every.pipelines)
    gap = simulate_plan(every, cost).step_time_s - simulate_plan(once, cost).step_time_s
    assert gap == pytest.approx(3 * per, rel=1e-9)


def test_static_cp_micro_batch_reduction_is_bf16():
    """DeepSpeed reduces a bf16 run's gradients in bf16 (its communication dtype defaults to the
    training dtype): 2 bytes a gradient, where the step's reduction sends fp32."""
    scheme = ParallelScheme(dp=2, cp=2, zero=2)
    req = request([3000] * 8, scheme, 8192)
    inter = scheme.num_gpus > req.cluster.gpus_per_node
    kwargs = dict(layers=MODEL.num_layers, dp=4, zero=2, inter_node=inter, first=True, last=True)
    bf16 = req.cost.grad_sync_time(**kwargs, bytes_per_grad=2)
    assert micro_batch_reduction_s(req) == pytest.approx(bf16, rel=1e-12)
    assert bf16 < req.cost.grad_sync_time(**kwargs)


@pytest.mark.parametrize("model, gpus, scheme", [
    # hydraulis.txt Table 3 (line 611): Megatron-LM's 32B schemes on 32 and 64 GPUs
    ("llama-32b", 32, "dp2-tp8-pp2"), ("llama-32b", 32, "dp2-tp16"),
    ("llama-32b", 64, "dp4-tp8-pp2"), ("llama-32b", 64, "dp4-tp16"),
    # its 7B and 13B ones (lines 601, 606)
    ("llama2-7b", 16, "dp2-tp4-pp2"), ("llama2-13b", 32, "dp4-tp8"),
    # infinipipe.txt line 354: Megatron-LM at TP 8, CP 2 (7B) or 4 (larger)
    ("llama2-7b", 32, "dp2-tp8-cp2"), ("llama2-13b", 32, "dp1-tp8-cp4"),
    # skrull.txt line 92: DeepSpeed at <DP=4, CP=8> and <DP=2, CP=16>
    ("qwen2.5-7b", 32, "dp4-cp8"), ("qwen2.5-7b", 32, "dp2-cp16"),
])
def test_each_papers_baseline_scheme_is_accepted_by_its_model(model, gpus, scheme):
    ParallelScheme.parse(scheme).validate(MODEL_PRESETS[model], gpus)


def test_slimpacks_models_are_its_table_3():
    """slimpack.txt lines 184-188: heads, groups, hidden, FFN, layers."""
    table = {"llama2-7b": (32, 32, 4096, 11008, 32), "llama2-13b": (40, 40, 5120, 13824, 40),
             "llama-70b": (64, 8, 8192, 28672, 80), "llama-150b": (96, 8, 12288, 32768, 96)}
    for name, dims in table.items():
        m = MODEL_PRESETS[name]
        assert (m.num_heads, m.num_kv_heads, m.hidden, m.ffn, m.num_layers) == dims, name


def test_per_batch_recomputation_refuses_a_fixed_recompute():
    from lengthwise.errors import UserError

    req = request([500] * 4, ParallelScheme(dp=4, pp=2), 8192, recompute="full", recompute_per_batch=True)
    with pytest.raises(UserError, match="recompute_per_batch decides the recomputation"):
        get_planner("megatron")(req)


@pytest.mark.parametrize("paper", ["chunkflow", "skrull", "slimpack", "infinipipe", "hydraulis"])
def test_each_papers_baseline_by_name_plans_a_valid_step(paper):
    """PAPER_BASELINES: the paper's name selects its baseline planner and options; the plan is
    valid and says it ran with them."""
    from lengthwise.planners.baselines import PAPER_BASELINES

    planner, options = PAPER_BASELINES[paper]
    req = request([3000, 200, 900, 40, 1500, 700, 5000, 60], ParallelScheme(dp=2, cp=2, zero=2), 8192, **options)
    plan = get_planner(planner)(req)
    validate_plan(plan, req.cost)
    for name in ("packing", "grad_reduce", "micro_batch_size"):
        if name in options:
            assert plan.options[name] == options[name]
