"""validate_plan: each invariant of DESIGN.md accepted when kept and rejected, by name, when broken."""

from __future__ import annotations

import pytest

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import Action, Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.plan.schedules import make_schedule
from lengthwise.plan.validate import validate_plan
from lengthwise.specs import MODEL_PRESETS, cluster_preset

MODEL = MODEL_PRESETS["qwen2.5-7b"]
CLUSTER = cluster_preset("h100", 8)


def chunks(*texts: str) -> list[Chunk]:
    return [Chunk.parse(t) for t in texts]


def pipeline(texts: list[str], pp: int = 2, **kw) -> PipelinePlan:
    """Chunks with a 1F1B schedule, or, when the chunks are not a schedulable set, all
    forwards then all backwards in reverse (so the token checks are what fails)."""
    cs = chunks(*texts)
    try:
        stages = make_schedule("1f1b", cs, pp)
    except UserError:
        n = len(cs)
        stages = [[Action("F", c) for c in range(n)] + [Action("B", c) for c in reversed(range(n))]
                  for _ in range(pp)]
    return PipelinePlan(chunks=cs, stages=stages, **kw)


def plan(lengths: list[int], *pipes: PipelinePlan, **kw) -> StepPlan:
    return StepPlan(planner="test", model=MODEL, cluster=CLUSTER, lengths=lengths,
                    pipelines=list(pipes), **kw)


def rejected(p: StepPlan, *fragments: str, cost: CostModel | None = None) -> str:
    with pytest.raises(UserError) as err:
        validate_plan(p, cost)
    for fragment in fragments:
        assert fragment in str(err.value)
    return str(err.value)


def test_packed_and_split_plan_is_valid():
    p = plan([100, 300, 50],
             pipeline(["0[0:100]+2[0:50]"]),
             pipeline(["1[0:128]", "1[128:256]", "1[256:300]"]))
    validate_plan(p)
    validate_plan(p, CostModel(model=MODEL, cluster=CLUSTER))


def test_token_planned_twice_is_rejected():
    p = plan([100, 50], pipeline(["0[0:60]+1[0:50]", "0[40:100]"]))
    rejected(p, "sequence 0", "[40:60)", "twice")


def test_missing_tokens_are_rejected():
    rejected(plan([100, 50], pipeline(["0[0:100]"])), "sequence 1", "[0:50)", "missing")
    rejected(plan([100], pipeline(["0[0:90]"])), "sequence 0", "[90:100)", "missing")


def test_segment_past_sequence_end_is_rejected():
    rejected(plan([100], pipeline(["0[0:120]"])), "pipeline 0 chunk 0", "0[0:120]", "<= 100")


def test_segment_of_unknown_sequence_is_rejected():
    rejected(plan([100], pipeline(["0[0:100]+3[0:5]"])), "sequence 3", "the batch has 1")


def test_cp_rank_outside_group_is_rejected():
    cs = [Chunk((Segment(0, 0, 100, cp_rank=2),))]
    p = plan([100], PipelinePlan(chunks=cs, stages=make_schedule("1f1b", cs, 1), cp=2))
    rejected(p, "CP rank 2", "cp=2")


def test_slices_in_two_pipelines_are_rejected():
    p = plan([200], pipeline(["0[0:100]"]), pipeline(["0[100:200]"]))
    rejected(p, "sequence 0", "pipelines 0 and 1")


def test_slices_forwarded_out_of_order_are_rejected():
    cs = chunks("0[100:200]", "0[0:100]")
    stages = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
    rejected(plan([200], PipelinePlan(chunks=cs, stages=stages)), "pipeline 0")


def test_split_sequence_backward_in_forward_order_is_rejected():
    cs = chunks("0[0:100]", "0[100:200]")
    stages = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
    rejected(plan([200], PipelinePlan(chunks=cs, stages=stages)), "pipeline 0", "ERROR HERE")


def test_chunk_never_backwarded_on_a_stage_is_rejected():
    p = pipeline(["0[0:100]", "1[0:100]"])
    p.stages[1] = [a for a in p.stages[1] if str(a) != "B1"]
    rejected(plan([100, 100], p), "pipeline 0", "pipeline 0 stage 1 never runs B1")


def test_deadlocked_schedule_is_rejected_with_grid():
    cs = chunks("0[0:10]", "1[0:10]")
    stages = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
              [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]]
    message = rejected(plan([10, 10], PipelinePlan(chunks=cs, stages=stages)), "pipeline 0", "deadlock")
    assert "<-- ERROR HERE" in message


def test_empty_chunk_is_rejected():
    p = pipeline(["0[0:10]"])
    p.chunks.append(Chunk(()))
    rejected(plan([10], p), "pipeline 0 chunk 1", "no segments")


def test_empty_pipeline_is_valid():
    validate_plan(plan([10], pipeline(["0[0:10]"]), pipeline([])))


def test_zero_length_sequence_is_rejected():
    rejected(plan([10, 0], pipeline(["0[0:10]"])), "sequence 1", "length 0")


def test_loss_tokens_count_every_position_but_each_last():
    p = plan([1, 5, 3], pipeline(["0[0:1]+1[0:2]", "1[2:5]+2[0:3]"]))
    validate_plan(p)
    assert p.loss_tokens == 0 + 4 + 2


def test_recorded_loss_tokens_mismatch_is_rejected():
    p = plan([5, 3], pipeline(["0[0:5]+1[0:3]"]), metrics={"loss_tokens": 8})
    rejected(p, "loss normalisation", "= 6")


def test_backward_units_regrouping_same_tokens_are_valid():
    cs = chunks("0[0:100]+1[0:40]")
    units = chunks("0[0:100]", "1[0:40]")
    stages = [[Action("F", 0), Action("B", 1), Action("B", 0)]]
    validate_plan(plan([100, 40], PipelinePlan(chunks=cs, stages=stages, backward_chunks=units)))


def test_backward_units_missing_tokens_are_rejected():
    cs = chunks("0[0:100]+1[0:40]")
    units = chunks("0[0:100]")
    stages = [[Action("F", 0), Action("B", 0)]]
    p = plan([100, 40], PipelinePlan(chunks=cs, stages=stages, backward_chunks=units))
    rejected(p, "sequence 1", "missing from backward")


def test_layers_per_stage_must_sum_to_model_layers():
    p = pipeline(["0[0:10]"], layers_per_stage=[10, 10])
    rejected(plan([10], p), "pipeline 0", "summing to 28")


def test_more_gpus_than_the_cluster_is_rejected():
    p = plan([10] * 5, *[pipeline([f"{i}[0:10]"], pp=2) for i in range(5)])
    rejected(p, "10 GPUs", "has 8")


def _one_chunk_plan(tokens: int, pp: int, **kw) -> StepPlan:
    cs = [Chunk((Segment(0, 0, tokens),))]
    return StepPlan(planner="test", model=MODEL, cluster=CLUSTER, lengths=[tokens],
                    pipelines=[PipelinePlan(chunks=cs, stages=make_schedule("1f1b", cs, pp), **kw)])


def test_chunk_a_lone_pipeline_holds_is_accepted():
    cost = CostModel(model=MODEL, cluster=CLUSTER)
    alone = cost.max_seq_len(pp=2, dp=1, inflight=1)
    validate_plan(_one_chunk_plan(alone, pp=2), cost)


def test_chunk_over_memory_names_pipeline_stage_and_chunk():
    """A lone chunk is checked against what its stage holds before the first backward (the
    states without their gradients), the most it can have."""
    cost = CostModel(model=MODEL, cluster=CLUSTER)
    budget = cost.stage_budget(stage=1, pp=2)
    too_many = int((budget.capacity - budget.states + budget.grads) / budget.activation_per_token * 1.05)
    message = rejected(_one_chunk_plan(too_many, pp=2), "pipeline 0 stage", "chunk 0", "GiB capacity",
                       cost=cost)
    assert "\n" not in message


def test_only_chunks_forwarded_before_the_first_backward_are_spared_the_gradients():
    """The stage's first backward makes the gradients: a chunk forwarded before it fits beside
    the states without them, the same chunk forwarded after it (F0 B0 F1 B1) does not."""
    model = MODEL_PRESETS["qwen2.5-1.5b"]   # whose states fit one GPU
    cost = CostModel(model=model, cluster=CLUSTER)
    budget = cost.stage_budget(stage=0, pp=1)
    tokens = int((budget.free + 0.5 * budget.grads) / budget.activation_per_token)
    assert tokens * budget.activation_per_token > budget.free  # over, were the gradients charged
    one = [Chunk((Segment(0, 0, tokens),))]
    validate_plan(StepPlan(planner="test", model=model, cluster=CLUSTER, lengths=[tokens],
                           pipelines=[PipelinePlan(chunks=one, stages=make_schedule("1f1b", one, 1))]), cost)
    cs = [Chunk((Segment(0, 0, tokens),)), Chunk((Segment(1, 0, tokens),))]
    twice = StepPlan(planner="test", model=model, cluster=CLUSTER, lengths=[tokens, tokens],
                     pipelines=[PipelinePlan(chunks=cs, stages=make_schedule("1f1b", cs, 1))])
    assert rejected(twice, "pipeline 0 stage 0 chunk 1", cost=cost)


def test_split_slice_counts_its_context_kv_state():
    """Later slices of a long sequence also hold their context's K/V: half a lone row fits, but
    not once the context's K/V outgrows what stage 0 has left beside one row's activations."""
    cost = CostModel(model=MODEL, cluster=CLUSTER)
    row = cost.max_seq_len(pp=4, dp=1, inflight=1) // 2
    layers = MODEL.num_layers // 4
    budget = cost.stage_budget(stage=0, pp=4)
    # the most stage 0 has beside one row: the states without the gradients its first backward makes
    free = budget.capacity - (budget.states - budget.grads) - cost.activation_bytes_per_token(layers=layers) * row
    rows = int(free // cost.kv_bytes(row, layers=layers)) + 2
    slices = [f"0[{a}:{a + row}]" for a in range(0, rows * row, row)]
    message = rejected(plan([rows * row], pipeline(slices, pp=4)), "K/V context", cost=cost)
    assert "pipeline 0 stage" in message and "chunk 0 " not in message


def test_recompute_more_layers_than_the_stage_has_is_rejected():
    p = pipeline(["0[0:10]"])
    p.stages[0] = [Action("F", 0, recompute_layers=20) if a.kind == "F" else a for a in p.stages[0]]
    rejected(plan([10], p), "F0.r20", "has 14", cost=CostModel(model=MODEL, cluster=CLUSTER))


def test_recompute_whole_and_mlp_layers_beyond_the_stage_are_rejected():
    """`.r` and `.m` share the stage's layers: 14 whole and 1 MLP block of a 14-layer stage is one too many."""
    p = pipeline(["0[0:10]"])
    p.stages[0] = [Action("F", 0, recompute_layers=14, recompute_mlp=1) if a.kind == "F" else a for a in p.stages[0]]
    rejected(plan([10], p), "F0.r14.m1", "the MLP of 1 more", "has 14")
    rejected(plan([10], p), "F0.r14.m1", "has 14", cost=CostModel(model=MODEL, cluster=CLUSTER))


def test_mlp_recomputation_fits_a_chunk_that_does_not_fit_without():
    """A lone chunk over what stage 1 holds keeping every activation fits once each layer
    recomputes its MLP block (`F0.m14`): the validator counts what that forward keeps."""
    cost = CostModel(model=MODEL, cluster=CLUSTER)
    budget = cost.stage_budget(stage=1, pp=2)
    tokens = int((budget.capacity - budget.states + budget.grads) / budget.activation_per_token * 1.05)
    assert budget.mlp_recomputed_per_token * tokens < budget.activation_per_token * tokens / 2
    mlp = _one_chunk_plan(tokens, pp=2)
    rejected(mlp, "pipeline 0 stage", "GiB capacity", cost=cost)
    mlp.pipelines[0].stages = [[Action("F", 0, recompute_mlp=14) if a.kind == "F" else a for a in acts]
                               for acts in mlp.pipelines[0].stages]
    validate_plan(mlp, cost)


def test_recompute_marks_survive_a_json_round_trip():
    """F3.r2.m5 and F3.m5 are written and read back as they were; a plan file without `.m`
    (every file before MLP recomputation) reads with none."""
    for text in ("F3", "F3.r2", "F3.m5", "F3.r2.m5"):
        assert str(Action.parse(text)) == text
    assert Action.parse("F3.r2.m5") == Action("F", 3, 2, 5) and Action.parse("F3.r2").recompute_mlp == 0
    p = pipeline(["0[0:100]", "1[0:50]"])
    p.stages = [[Action("F", a.chunk, 1, 3) if a.kind == "F" else a for a in acts] for acts in p.stages]
    again = StepPlan.from_dict(plan([100, 50], p).to_dict())
    assert again.pipelines[0].stages == p.stages and "F0.r1.m3" in again.to_dict()["pipelines"][0]["stages"][0]
    with pytest.raises(UserError, match="bad action 'F3.m5.r2'"):
        Action.parse("F3.m5.r2")


def test_plan_is_still_valid_after_a_json_round_trip():
    p = plan([100, 300, 50], pipeline(["0[0:100]+2[0:50]"]), pipeline(["1[0:150]", "1[150:300]"]))
    validate_plan(StepPlan.from_dict(p.to_dict()))


def test_slices_of_one_sequence_out_of_order_inside_a_chunk_are_rejected():
    rejected(plan([100], pipeline(["0[50:100]+0[0:50]"])), "pipeline 0 chunk 0", "0[0:50]", "token")
    validate_plan(plan([100], pipeline(["0[0:50]+0[50:100]"])))


@pytest.mark.parametrize("heavy", [0, 1])
def test_every_cp_rank_load_is_checked(heavy):
    """A segment placed whole on one CP rank weighs on that rank alone: over capacity on rank
    `heavy` (0 or 1) is rejected either way, while the same tokens sharded over both ranks fit."""
    cost = CostModel(model=MODEL, cluster=CLUSTER)
    budget = cost.stage_budget(stage=1, pp=2, replicas=2)
    over = int((budget.capacity - budget.states + budget.grads) / budget.activation_per_token * 1.05)
    placed = [Chunk((Segment(0, 0, over, cp_rank=heavy), Segment(1, 0, 100, cp_rank=1 - heavy)))]
    p = plan([over, 100], PipelinePlan(chunks=placed, stages=make_schedule("1f1b", placed, 2), cp=2))
    rejected(p, "pipeline 0 stage", "chunk 0", "GiB capacity", cost=cost)
    sharded = [Chunk((Segment(0, 0, over), Segment(1, 0, 100, cp_rank=1 - heavy)))]
    validate_plan(plan([over, 100], PipelinePlan(chunks=sharded, stages=make_schedule("1f1b", sharded, 2),
                                                 cp=2)), cost)
