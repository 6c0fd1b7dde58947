"""What the cost model and the simulator predict for one rank of a plan: the simulated side of
`lengthwise dryrun`, which measures the same three quantities on the executor's real code.

    predict = rank_prediction(plan, CostModel(model=plan.model, cluster=plan.cluster), rank=5)
    predict.peak_memory_bytes, predict.flops, predict.comm_bytes["send"]

- Peak memory: the simulator's peak of the rank's stage (model states, activations, K/V state
  and K/V gradients replayed along the timeline, `sim/memory.py`).
- FLOPs: the cost model's forward FLOPs of every F and N action of the stage (N without the
  LM head, which the executor's no-grad forward skips), its backward FLOPs of every B, and what
  the backward reruns of the forward of the layers an `F.rN` action checkpoints (all but the
  down projection: `cost.flops.recompute_forward_flops`) and of the MLP blocks an `F.mN` action
  checkpoints (gate and up: `cost.flops.mlp_recompute_flops`); each CP rank's share of the work
  (`rank_works`), over tp, plus the K/V projections' remaining (1 - 1/tp) when tp exceeds the
  K/V heads and every TP rank computes them whole (`cost.flops.replicated_kv_flops`).
- Communication, bytes this rank hands to each kind of operation (the logical volume, not one
  algorithm's wire traffic): `send` the activations and activation gradients to neighbour
  stages; under FSDP2 (`fsdp_sharded`) `reduce_scatter` the stage's fp32 gradients and
  `all_gather` its weight shard in bf16, once a step (or around every action under ZeRO-3;
  neither over a shard group of one rank, dp = cp = 1);
  replicated, `all_reduce` the gradient buffers over the replicas holding the stage (data
  parallel pipelines times CP ranks). K/V projections replicated over TP (tp above the K/V
  heads, `cost.memory.kv_replicated`) are whole in the stage's parameters, so in those bytes;
  their gradients, each TP rank's covering only its K/V head, are also summed over TP with a
  c10d `all_reduce` (`parallel/dp.reduction_classes`): under FSDP2 each rank's fp32 shard
  (1/replicas of them) once a step, replicated without FSDP2 the whole fp32 gradients, in the
  data-parallel all-reduce when there are replicas. Context parallelism (`cp_comm_bytes`): `all_gather` also
  counts the K/V a CP rank contributes to each forward's gathers, `reduce_scatter` the K/V
  gradients each backward hands to their reduce-scatter.
  Tensor parallelism with sequence parallelism (the cost model's `tp_comm_time`), counted
  apart as the dry run sees DTensor's collectives: per decoder layer and direction
  `SP_COLLECTIVES_PER_LAYER` all-gathers (`tp_all_gather`, this rank's 1/tp share of the
  gathered rows) and as many reduce-scatters (`tp_reduce_scatter`, the whole input), each of
  `sp_collective_bytes(tokens)`; the embedding's lookup reduce-scatter (first stage) and the LM
  head's input gather (last stage) once per forward that runs them, transposed in backward
  (priced by `sp_edge_comm_time`);
  layers an `F.rN` recomputes gather again (`SP_RECOMPUTE_ALL_GATHERS`) and scatter the
  attention block's output again (`SP_RECOMPUTE_REDUCE_SCATTERS`: the rerun stops before the
  MLP's down projection, whose reduce-scatter it never reaches), and layers an `F.mN` recomputes
  the MLP of gather its input again (`SP_MLP_RECOMPUTE_ALL_GATHERS`, nothing else). `tp_all_reduce`: the
  sequence-parallel norms' partial weight gradients summed over TP once a step, in fp32. (The
  executor pads a row to a multiple of tp; those at most tp - 1 rows are not counted.)
  Without sequence parallelism (`CostModel.sequence_parallel` False, `nosp_comm_bytes`):
  `tp_all_reduce` the whole activations, per decoder layer `NOSP_FORWARD_ALL_REDUCES` in a
  forward (`NOSP_RECOMPUTE_ALL_REDUCES` more per recomputed layer, none per recomputed MLP block) and
  `NOSP_BACKWARD_ALL_REDUCES` in a backward, the embedding's output once per
  forward and the LM head's input gradient once per backward; stage-to-stage sends whole.
  Heterogeneous plans (`runtime/train/dist_hetero.py`): `all_to_all` the push of bf16 gradients
  to their owners and the pull of bf16 weights from them (`CostModel.exchange_sent_bytes`),
  `all_reduce` the gradient norm's one fp64 value, `tp_all_reduce` in bf16 (the stage's own dtype), no reduce-scatter.
  Their peak is the larger of the simulator's and the step end's (`step_end_bytes`).

Ranks are numbered as the executor lays them out (`runtime/distributed/mesh.py`): pipeline by
pipeline, stage by stage, CP rank innermost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lengthwise.cost import CostModel
from lengthwise.cost.flops import (
    HEAD_RECOMPUTE,
    head_forward_flops,
    layer_forward_flops,
    mlp_recompute_flops,
    recompute_forward_flops,
    replicated_kv_flops,
)
from lengthwise.cost.memory import GRAD_BYTES_PER_PARAM, kv_params_per_layer, kv_replicated, stage_params
from lengthwise.cost.flops import rank_works
from lengthwise.cost.model_comm import (
    NOSP_BACKWARD_ALL_REDUCES,
    NOSP_FORWARD_ALL_REDUCES,
    NOSP_RECOMPUTE_ALL_REDUCES,
    SP_COLLECTIVES_PER_LAYER,
    SP_MLP_RECOMPUTE_ALL_GATHERS,
    SP_RECOMPUTE_ALL_GATHERS,
    SP_RECOMPUTE_REDUCE_SCATTERS,
)
from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD, StepPlan

ELEMENT_BYTES = 2
"""The cost model counts activations, weights and K/V in 16-bit elements; gradients are reduced
in fp32 (`MixedPrecisionPolicy(reduce_dtype=float32)`, `cost.memory.GRAD_BYTES_PER_PARAM`)."""
NORM_REDUCE_BYTES = 8
"""A heterogeneous plan's executor all-reduces the square of the gradient norm, one fp64 value."""
LOSS_REDUCE_BYTES = 12
"""Per token, the vocabulary-parallel loss all-reduces three fp32 values over TP."""


@dataclass(frozen=True, kw_only=True)
class RankPlace:
    """Which part of the plan one rank runs."""

    pipeline: int
    stage: int
    cp_rank: int


@dataclass(kw_only=True)
class RankPrediction:
    """The simulated side of one rank (bytes and FLOPs)."""

    rank: int
    place: RankPlace
    peak_memory_bytes: float
    flops: float
    comm_bytes: dict[str, float] = field(default_factory=dict)


def rank_places(plan: StepPlan) -> list[RankPlace]:
    """Place of every rank, indexed by rank."""
    return [RankPlace(pipeline=p, stage=s, cp_rank=r) for p, pipe in enumerate(plan.pipelines)
            for s in range(pipe.pp) for r in range(pipe.cp) for _ in range(pipe.tp)]


def rank_prediction(plan: StepPlan, cost: CostModel, *, rank: int, peak_memory: list[list[float]]) -> RankPrediction:
    """Predictions for `rank`; `peak_memory` is the simulator's [pipeline][stage] peak
    (`simulate_plan(plan, cost).peak_memory`), computed once for all ranks."""
    place = rank_places(plan)[rank]
    return RankPrediction(rank=rank, place=place, peak_memory_bytes=max(peak_memory[place.pipeline][place.stage],
                                                                         step_end_bytes(plan, cost, place)),
                          flops=stage_flops(plan, cost, place), comm_bytes=stage_comm_bytes(plan, cost, place))


def stage_flops(plan: StepPlan, cost: CostModel, place: RankPlace) -> float:
    """FLOPs one rank of the stage computes in the step (its CP share, 1/tp of it, and the
    replicated K/V projections' remainder when tp exceeds the K/V heads)."""
    pipe = plan.pipelines[place.pipeline]
    layers = pipe.stage_layers(plan.model.num_layers)[place.stage]
    last = place.stage == pipe.pp - 1
    total = replicated = 0.0
    for action in pipe.stages[place.stage]:
        works = rank_works(_unit(pipe, action), pipe.cp)  # one entry when every rank's share is equal
        work = works[place.cp_rank] if len(works) > 1 else works[0]
        lin, attn = layer_forward_flops(plan.model, work)
        kv = replicated_kv_flops(plan.model, work.tokens, pipe.tp)
        # the executor's no-grad forward (N) keeps K/V only and never runs the head
        head = head_forward_flops(plan.model, work.tokens) if last and action.kind != FORWARD_NOGRAD else 0.0
        if action.kind == BACKWARD:
            total += layers * (lin * cost.bwd_linear_ratio + attn * cost.bwd_attn_ratio) \
                + head * (cost.bwd_linear_ratio + HEAD_RECOMPUTE)
            replicated += layers * kv * cost.bwd_linear_ratio
        else:
            reruns, mlp_reruns = _reruns(action, layers)
            total += layers * (lin + attn) + reruns * sum(recompute_forward_flops(plan.model, work)) + head
            total += mlp_reruns * mlp_recompute_flops(plan.model, work.tokens)
            replicated += (layers + reruns) * kv  # the rerun computes the K/V projections again
    return total / pipe.tp + replicated


def stage_comm_bytes(plan: StepPlan, cost: CostModel, place: RankPlace) -> dict[str, float]:
    """Bytes this rank hands to sends and collectives in the step, by kind."""
    pipe = plan.pipelines[place.pipeline]
    layers = pipe.stage_layers(plan.model.num_layers)[place.stage]
    first, last = place.stage == 0, place.stage == pipe.pp - 1
    send = sum(cost.boundary_bytes(_unit(pipe, a), tp=pipe.tp, cp=pipe.cp, cp_rank=place.cp_rank) for a in pipe.stages[place.stage]
               if (a.kind == BACKWARD and not first) or (a.kind != BACKWARD and not last))
    replicas = sum(p.cp for p in plan.pipelines if p.pp == pipe.pp)
    params = stage_params(plan.model, layers=layers, tp=pipe.tp, first=first, last=last)
    grads = params * GRAD_BYTES_PER_PARAM
    # replicated K/V projections' gradients, whole, summed over TP (module docstring)
    kv_tp = (layers * kv_params_per_layer(plan.model) * GRAD_BYTES_PER_PARAM
             if pipe.tp > 1 and kv_replicated(plan.model, pipe.tp) else 0.0)
    gathered, kv_grads = cp_comm_bytes(plan, cost, place)
    # the vocabulary-parallel loss (runtime/loss.py) all-reduces three fp32 values per token
    # over TP (row maximum, target logit, exponential sum) in every forward that runs the head
    loss = sum(LOSS_REDUCE_BYTES * _rank_tokens(pipe, a, place) for a in pipe.stages[place.stage]
               if a.kind == FORWARD) if last and pipe.tp > 1 else 0.0
    tp = tp_comm_bytes(plan, cost, place)
    reduced = loss  # c10d all-reduces: the loss's
    norms = bool(tp) and cost.sequence_parallel  # tp_all_reduce holds the norms' partial gradients
    if len({(p.tp, p.pp, p.cp) for p in plan.pipelines}) > 1:
        # heterogeneous pipelines (runtime/train/dist_hetero.py): bf16 gradients pushed to their
        # owners among the holders and bf16 weights pulled back, one all-to-all each way, and one
        # fp64 all-reduce of the gradient norm's square; the TP norms' partial gradients are
        # summed in bf16
        exchange = cost.exchange_sent_bytes(held=params, owned=stage_owned(plan, cost, place))
        if norms:
            tp["tp_all_reduce"] *= ELEMENT_BYTES / GRAD_BYTES_PER_PARAM
        return {"send": send, "all_reduce": reduced + NORM_REDUCE_BYTES, "all_gather": gathered,
                "reduce_scatter": kv_grads, "all_to_all": exchange, **tp}
    if fsdp_sharded(plan):
        # FSDP2 (runtime/parallel/fsdp.py): the unsharded gradients go to one reduce-scatter in
        # fp32 at the stage's last backward; the bf16 compute copy of the weights is gathered
        # from the shards once a step, or around every action under ZeRO-3 when every replica
        # runs the same actions
        per_action = plan.zero >= 3 and len({_structure(p, place.stage) for p in plan.pipelines}) == 1
        if norms and sum(a.kind == BACKWARD for a in pipe.stages[place.stage]) == 1:
            # one backward: the norms' partial gradients are summed over TP as they come, in
            # bf16; with more, FSDP2 accumulates them in fp32 first and the sum runs on those
            tp["tp_all_reduce"] *= ELEMENT_BYTES / GRAD_BYTES_PER_PARAM
        gathers = len(pipe.stages[place.stage]) if per_action else 1
        if replicas == 1:  # a shard group of one rank: FSDP2 gathers and reduces nothing
            gathers, grads = 0, 0.0
        return {"send": send, "all_reduce": reduced + kv_tp / replicas, "reduce_scatter": grads + kv_grads,
                "all_gather": gathered + gathers * params / replicas * ELEMENT_BYTES, **tp}
    return {"send": send, "all_reduce": (grads if replicas > 1 else kv_tp) + reduced, "all_gather": gathered,
            "reduce_scatter": kv_grads, **tp}


def cp_comm_bytes(plan: StepPlan, cost: CostModel, place: RankPlace) -> tuple[float, float]:
    """(all-gather, reduce-scatter) bytes this rank hands to context parallelism in the step:
    per layer, its 1/cp share of the K/V of every sharded segment of each forward (F and N), and
    in each backward the whole K/V gradient of its unit's sharded segments
    (`CostModel.cp_kv_layer_bytes`, the volumes `cp_comm_time` and `cp_grad_comm_time` price)."""
    pipe = plan.pipelines[place.pipeline]
    if pipe.cp <= 1:
        return 0.0, 0.0
    layers = pipe.stage_layers(plan.model.num_layers)[place.stage]
    gathered = scattered = 0.0
    for action in pipe.stages[place.stage]:
        volume = layers * cost.cp_kv_layer_bytes(_unit(pipe, action), tp=pipe.tp)
        if action.kind == BACKWARD:
            scattered += volume
        else:
            gathered += volume / pipe.cp
    return gathered, scattered


def step_end_bytes(plan: StepPlan, cost: CostModel, place: RankPlace) -> float:
    """Bytes a rank of a heterogeneous plan holds at its step end, after every activation is
    freed: its model states and the exchange's working set (`CostModel.exchange_transient_bytes`),
    which the simulator's timeline does not carry. 0 for other plans."""
    if len({(p.tp, p.pp, p.cp) for p in plan.pipelines}) <= 1:
        return 0.0
    pipe = plan.pipelines[place.pipeline]
    layers = pipe.stage_layers(plan.model.num_layers)[place.stage]
    first, last = place.stage == 0, place.stage == pipe.pp - 1
    held = stage_params(plan.model, layers=layers, tp=pipe.tp, first=first, last=last)
    holders = cost.hetero_holders([(p.tp, p.pp, p.cp) for p in plan.pipelines])
    states = cost.hetero_state_bytes(layers=layers, tp=pipe.tp, first=first, last=last, holders=holders)
    return states + cost.exchange_transient_bytes(held=held, owned=stage_owned(plan, cost, place))


def stage_owned(plan: StepPlan, cost: CostModel, place: RankPlace) -> float:
    """Parameter elements a rank of a heterogeneous plan owns (`CostModel.hetero_owned`: about
    1/d of what it holds, d holders of each element)."""
    pipe = plan.pipelines[place.pipeline]
    layers = pipe.stage_layers(plan.model.num_layers)[place.stage]
    holders = cost.hetero_holders([(p.tp, p.pp, p.cp) for p in plan.pipelines])
    return cost.hetero_owned(layers=layers, tp=pipe.tp, first=place.stage == 0, last=place.stage == pipe.pp - 1,
                             holders=holders)


def tp_comm_bytes(plan: StepPlan, cost: CostModel, place: RankPlace) -> dict[str, float]:
    """Bytes this rank hands to tensor parallelism's collectives in the step (none when tp is
    1; without sequence parallelism `nosp_comm_bytes`)."""
    pipe = plan.pipelines[place.pipeline]
    if pipe.tp == 1:
        return {}
    if not cost.sequence_parallel:
        return nosp_comm_bytes(plan, cost, place)
    layers = pipe.stage_layers(plan.model.num_layers)[place.stage]
    first, last = place.stage == 0, place.stage == pipe.pp - 1
    gathered = scattered = 0.0
    for action in pipe.stages[place.stage]:
        volume = cost.sp_collective_bytes(_rank_tokens(pipe, action, place))
        if action.kind == BACKWARD:  # the forward's collectives transposed
            gathers, scatters = SP_COLLECTIVES_PER_LAYER * layers + first, SP_COLLECTIVES_PER_LAYER * layers + last
        else:
            reruns, mlp_reruns = _reruns(action, layers)
            head = last and action.kind == FORWARD  # the no-grad forward never runs the head
            gathers = (SP_COLLECTIVES_PER_LAYER * layers + SP_RECOMPUTE_ALL_GATHERS * reruns
                       + SP_MLP_RECOMPUTE_ALL_GATHERS * mlp_reruns + head)
            scatters = SP_COLLECTIVES_PER_LAYER * layers + SP_RECOMPUTE_REDUCE_SCATTERS * reruns + first
        gathered += gathers * volume
        scattered += scatters * volume
    norms = 2 * layers + (1 if last else 0)
    return {"tp_all_gather": gathered / pipe.tp, "tp_reduce_scatter": scattered,
            "tp_all_reduce": norms * plan.model.hidden * GRAD_BYTES_PER_PARAM}


def nosp_comm_bytes(plan: StepPlan, cost: CostModel, place: RankPlace) -> dict[str, float]:
    """Bytes this rank hands to tensor parallelism's all-reduces in the step without sequence
    parallelism, each the whole tokens x hidden bf16 activations (`sp_collective_bytes`): per
    decoder layer `NOSP_FORWARD_ALL_REDUCES` in a forward (`NOSP_RECOMPUTE_ALL_REDUCES` again
    for each layer an `F.rN` recomputes) and `NOSP_BACKWARD_ALL_REDUCES` in a backward, the embedding's once per
    forward (first stage) and the LM head's input gradient once per backward (last stage).
    DTensor issues them all (`tp_all_reduce`; K/V projections replicated over TP mark their
    input gradients partial, summed in the block's). The norms' weights and gradients are whole
    and equal on every TP rank: nothing is summed for them."""
    pipe = plan.pipelines[place.pipeline]
    layers = pipe.stage_layers(plan.model.num_layers)[place.stage]
    first, last = place.stage == 0, place.stage == pipe.pp - 1
    dtensor = 0.0
    for action in pipe.stages[place.stage]:
        volume = cost.sp_collective_bytes(_rank_tokens(pipe, action, place))
        if action.kind == BACKWARD:
            dtensor += (NOSP_BACKWARD_ALL_REDUCES * layers + last) * volume
        else:
            reruns, _ = _reruns(action, layers)  # a rerun MLP block reaches no all-reduce
            dtensor += (NOSP_FORWARD_ALL_REDUCES * layers + NOSP_RECOMPUTE_ALL_REDUCES * reruns + first) * volume
    return {"tp_all_reduce": dtensor}


def _rank_tokens(pipe, action, place: RankPlace) -> float:
    """Tokens of the action's unit this rank computes (its CP share)."""
    works = rank_works(_unit(pipe, action), pipe.cp)
    return (works[place.cp_rank] if len(works) > 1 else works[0]).tokens


def fsdp_sharded(plan: StepPlan) -> bool:
    """Whether the executor shards this plan's weights with FSDP2 (ZeRO >= 1 and every
    pipeline of one shape) rather than replicating them."""
    return plan.zero > 0 and len({(p.pp, p.tp, p.cp) for p in plan.pipelines}) == 1


def _structure(pipe, stage: int) -> tuple:
    return tuple((a.kind, a.recompute_layers, a.recompute_mlp) for a in pipe.stages[stage])


def _reruns(action, layers: int) -> tuple[int, int]:
    """(layers, MLP blocks) the backward reruns of what an F action checkpointed on a stage of
    `layers` layers (none for N and B)."""
    if action.kind != FORWARD:
        return 0, 0
    whole = min(action.recompute_layers, layers)
    return whole, min(action.recompute_mlp, layers - whole)


def _unit(pipe, action):
    if action.kind == BACKWARD and pipe.backward_chunks is not None:
        return pipe.backward_chunks[action.chunk]
    return pipe.chunks[action.chunk]
