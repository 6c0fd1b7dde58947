"""The papers' baselines: `megatron` (context-length packs, recomputation only when needed) and
`static-cp` (every sequence sharded over CP)."""

import pytest

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import FORWARD
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.planners.megatron import choose_recompute
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset

LENGTHS = [3000, 200, 90, 1500, 60, 800, 40, 4000, 7000, 120]


def request(model="qwen2.5-0.5b", scheme=ParallelScheme(dp=2, pp=2), context=8192, gpus=4):
    m, c = MODEL_PRESETS[model], cluster_preset("h100", gpus)
    return PlanRequest(lengths=LENGTHS, model=m, cluster=c, scheme=scheme, cost=CostModel(model=m, cluster=c),
                       context_length=context)


def test_megatron_packs_context_length_micro_batches_without_recompute_when_they_fit():
    req = request()
    plan = get_planner("megatron")(req)
    validate_plan(plan, req.cost)
    assert plan.options["recompute"] == "none"
    assert all(c.num_tokens <= 8192 for p in plan.pipelines for c in p.chunks)
    assert sum(c.num_tokens for p in plan.pipelines for c in p.chunks) == sum(LENGTHS)
    assert all(a.recompute_layers == 0 for p in plan.pipelines for st in p.stages for a in st)


def test_megatron_recomputes_every_layer_only_when_no_recompute_does_not_fit():
    req = request(model="qwen2.5-7b", scheme=ParallelScheme(dp=1, tp=4, pp=1), context=131072)
    assert choose_recompute(req.cost, req.scheme, 131072) == "full"
    assert choose_recompute(req.cost, req.scheme, 1024) == "none"
    plan = get_planner("megatron")(req)
    layers = req.model.num_layers
    forwards = [a for p in plan.pipelines for st in p.stages for a in st if a.kind == FORWARD]
    assert forwards and all(a.recompute_layers == layers for a in forwards)


def test_megatron_refuses_a_scheme_that_cannot_hold_one_context_length_pack():
    req = request(scheme=ParallelScheme(dp=1, tp=1, pp=1), context=2**23, gpus=1)
    with pytest.raises(UserError, match="even with full recomputation"):
        get_planner("megatron")(req)


def test_static_cp_shards_every_sequence_over_the_cp_group():
    req = request(scheme=ParallelScheme(dp=1, pp=2, cp=2))
    plan = get_planner("static-cp")(req)
    validate_plan(plan, req.cost)
    assert all(s.cp_rank == -1 for p in plan.pipelines for c in p.chunks for s in c.segments)
