"""Skrull: dynamic data scheduling for long-context SFT (skrull.txt §4, appendices A and B).

Skrull keeps one fixed dp x cp scheme and decides, for every global batch, which data-parallel
rank and micro-batch each sequence goes to (Global Data Scheduling, GDS, §4.2) and, inside each
micro-batch, which sequences are sharded over the CP group and which stay whole on one CP rank
(Distributed-Aware Context Parallelism, DACP, §4.1; `skrull/dacp.py`). Sequences are never split
along their tokens except by CP sharding, so every chunk holds whole sequences.

The formulas the text extraction lost, rebuilt from the prose (L layers, d hidden, d_q = heads x
head_dim, d_kv = kv_heads x head_dim, P_mm = d (2 d_q + 2 d_kv) + 3 d ffn matmul weights a layer):

- Memory per sequence (A.1 eq. 12): M(s) = alpha * s + beta with beta ~ 0, alpha the activation
  bytes one token keeps over all layers plus the LM head's logits
  (`CostModel.activation_bytes_per_token(layers=L, head=True)`).
- BucketSize (A.1): C = floor((GPU capacity - model states) / alpha), the tokens one GPU of the
  CP group holds for activations = `CostModel.max_seq_len(tp, pp, cp=1, dp, zero)` (with pp > 1
  it also counts the pp micro-batches 1F1B keeps alive on the first stage). A micro-batch may
  hold up to c x C tokens, and no CP rank more than C (DACP eq. 7).
- FLOPs estimate (A.2 eq. 13-14): per layer forward FLOPs(s) = 2 P_mm s + 2 d_q s (s + 1) (causal
  attention: QK^T and PV over s (s + 1) / 2 pairs), backward 2x the linear and 2.5x the attention
  part (flash attention recomputes); the LM head adds 2 d vocab s forward. T_comp = FLOPs over an
  achieved throughput (`CostModel.forward_time`/`backward_time`).
- Communication volume (A.3 eq. 15-16): Vol(s) = 2 d_kv s bf16 values per layer (K and V of every
  token of a distributed sequence), all-gathered over the CP group in forward and about twice
  that in backward; T_comm(V) = alpha + V / beta fitted to skrull table 3 (`cp_comm_time`).
- DACP objective (eq. 1-7): see `skrull/dacp.py`; T_r = max(T_comm, T_comp(local of r)) +
  T_comp(distributed / c), minimised over the classification D and the assignment A.
- Joint objective (eq. 8-11): minimise max over DP ranks j of sum over micro-batches k of
  T_DACP(micro-batch j,k), each sequence in exactly one micro-batch, each micro-batch feasible
  for DACP. The plan's metric `predicted_step_time_s` evaluates it.

GDS (Algorithm 2, as §4.3.2 describes it):
1. estimate each sequence's training FLOPs and split the batch over the DP ranks balancing FLOPs
   (Karmarkar-Karp bin balancing, `packing_utils.karmarkar_karp`);
2. per rank, start from the fewest micro-batches memory allows, ceil(tokens / (c x C));
3. sort the rank's sequences by length and deal them to the micro-batches in snake order
   (0, 1, .., k-1, k-1, .., 0, ...), so long sequences spread out and each micro-batch also gets
   short ones to run locally next to the sharded ones;
4. run DACP on every micro-batch; when one fails, roll back: one more micro-batch, go to 3.

Cost, n sequences over D data-parallel ranks: FLOPs estimates O(n), Karmarkar-Karp O(n log n)
in the usual case (packing_utils), per rank a sort O(n_r log n_r) and DACP per micro-batch
(shortest first, O(m log m) for m sequences and c ranks kept in arrays). The rollback of step 4
re-deals a rank's sequences with one more micro-batch each time DACP fails, so a rank that needs
R rollbacks costs R times its first attempt: the paper's algorithm, which we keep; R stays small
because step 2 starts at the memory lower bound.

Options: `SkrullOptions` in planners/options.py (each with its default and meaning).
Deterministic; the seed is unused (no random choice).
"""

from __future__ import annotations

import time
from typing import Any

from lengthwise.errors import UserError
from lengthwise.metrics import PREDICTED_STEP_TIME_S
from lengthwise.plan.ir import SHARDED, Chunk, Segment, StepPlan
from lengthwise.planners.base import (
    PlanRequest,
    check_request,
    finish_plan,
    pipelines_from_chunks,
    take_options,
)
from lengthwise.planners.packing_utils import karmarkar_karp
from lengthwise.planners.skrull.dacp import (
    DacpCost,
    dacp,
    dacp_chunk,
    refine_by_objective,
    shard_tokens,
)


def memory_bucket_size(request: PlanRequest) -> int:
    """Skrull A.1 BucketSize: tokens one GPU of the CP group holds after model states."""
    s = request.scheme
    return int(request.cost.max_seq_len(tp=s.tp, pp=s.pp, cp=1, dp=s.dp * s.cp, zero=s.zero))


def choose_bucket_size(request: PlanRequest, option: int | None) -> int:
    """The option when given (and within memory), else the memory model's BucketSize."""
    s = request.scheme
    request.cost.check_states_fit(tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, zero=s.zero)
    limit = memory_bucket_size(request)
    if option is not None and option > limit:
        raise UserError(
            f"option bucket_size {option} > {limit} tokens that one GPU holds for activations "
            f"under {s} zero{s.zero}: lower bucket_size or leave it unset"
        )
    return option or limit


def kv_bucket_ratio(request: PlanRequest) -> float:
    """Bucket tokens per token of a distributed sequence for the K/V every layer keeps whole
    after its all-gather (`CostModel.activation_bytes`): on each stage, those bytes over the
    per-token bytes BucketSize is counted in (`CostModel.max_seq_len` at cp 1); 0 without CP."""
    s = request.scheme
    if s.cp <= 1:
        return 0.0
    ratios = []
    for b in request.cost.stage_budgets(tp=s.tp, pp=s.pp, replicas=s.dp * s.cp, zero=s.zero):
        held = s.pp - b.stage
        ratios.append(held * b.kv_per_token / (b.activation_per_token * held + b.backward_work_per_token))
    return max(ratios)


def longest_in_cp_group(cp: int, bucket: int, kv_ratio: float = 0.0) -> int:
    """The longest sequence the CP group holds sharded (`shard_tokens` within BucketSize)."""
    longest = int(bucket / (1 / cp + kv_ratio))
    while shard_tokens(longest + 1, cp, kv_ratio) <= bucket:
        longest += 1
    while longest > 0 and shard_tokens(longest, cp, kv_ratio) > bucket:
        longest -= 1
    return longest


def check_fits_cp_group(lengths: list[int], cp: int, bucket: int, kv_ratio: float = 0.0) -> None:
    """A sequence must fit the CP group sharded: ceil(s / c), plus the K/V of the whole sequence
    every layer keeps after its all-gather, <= BucketSize."""
    for seq_id, n in enumerate(lengths):
        if shard_tokens(n, cp, kv_ratio) > bucket:
            longest = longest_in_cp_group(cp, bucket, kv_ratio)
            raise UserError(
                f"sequence {seq_id} has {n} tokens > {longest} tokens one CP group holds (cp({cp}) x "
                f"BucketSize({bucket}), less the sequence's K/V every rank keeps whole after each layer's "
                f"all-gather): raise --cp or --tp, or use a splitting planner (chunkflow)"
            )


def sequence_flops(request: PlanRequest) -> list[float]:
    """Skrull A.2 eq. 13-14: forward plus backward FLOPs of each whole sequence."""
    cost, layers = request.cost, request.model.num_layers
    out = []
    for i, n in enumerate(request.lengths):
        chunk = Chunk((Segment(i, 0, n),))
        out.append(cost.forward_flops(chunk, layers=layers, head=True)
                   + cost.backward_flops(chunk, layers=layers, head=True))
    return out


def fewest_micro_batches(seq_ids: list[int], lengths: list[int], cp: int, bucket: int) -> int:
    """Algorithm 2's starting point: as few micro-batches as the group's memory allows."""
    total = sum(lengths[i] for i in seq_ids)
    return max(1, -(-total // (cp * bucket)))


def interleave(seq_ids: list[int], lengths: list[int], k: int) -> list[list[int]]:
    """Sort longest first and deal in snake order, pairing long and short (Algorithm 2 line 7)."""
    order = sorted(seq_ids, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = [[] for _ in range(k)]
    for pos, seq in enumerate(order):
        lap, slot = divmod(pos, k)
        groups[slot if lap % 2 == 0 else k - 1 - slot].append(seq)
    return groups


def try_micro_batches(groups: list[list[int]], lengths: dict[int, int], flops: dict[int, float],
                      bucket: int, model: DacpCost, refine: bool) -> list[Chunk] | None:
    """DACP on every micro-batch; None as soon as one fails (Algorithm 2 line 8)."""
    chunks = []
    for group in groups:
        placement = dacp(group, lengths, flops, cp=model.cp, bucket_size=bucket, kv_ratio=model.kv_ratio)
        if placement is None:
            return None
        if refine:
            placement = refine_by_objective(placement, lengths, model, bucket)
        chunks.append(dacp_chunk(placement, lengths))
    return chunks


def schedule_dp_rank(seq_ids: list[int], lengths: list[int], flops: list[float], bucket: int,
                     model: DacpCost, refine: bool) -> tuple[list[Chunk], int]:
    """One DP rank's micro-batches (Algorithm 2 lines 3-9) and how many roll-backs it took."""
    if not seq_ids:
        return [], 0
    mine_len = {i: lengths[i] for i in seq_ids}
    mine_flops = {i: flops[i] for i in seq_ids}
    first = fewest_micro_batches(seq_ids, lengths, model.cp, bucket)
    for k in range(first, len(seq_ids) + 1):
        groups = interleave(seq_ids, lengths, k)
        chunks = try_micro_batches(groups, mine_len, mine_flops, bucket, model, refine)
        if chunks is not None:
            return chunks, k - first
    # One sequence per micro-batch always fits once check_fits_cp_group passed.
    raise AssertionError("DACP failed with one sequence per micro-batch")


def dacp_cost(request: PlanRequest) -> DacpCost:
    """The DACP objective's cost terms for the scheme's CP groups (all layers: pp = 1 view)."""
    s = request.scheme
    return DacpCost(cost=request.cost, layers=request.model.num_layers, tp=s.tp, cp=s.cp,
                    inter_node=s.tp * s.cp > request.cluster.gpus_per_node, kv_ratio=kv_bucket_ratio(request))


def global_data_scheduling(request: PlanRequest, bucket: int, refine: bool) -> tuple[list[list[Chunk]], int]:
    """Skrull Algorithm 2: FLOPs-balanced DP ranks, each cut into DACP-feasible micro-batches."""
    flops = sequence_flops(request)
    model = dacp_cost(request)
    per_rank, roll_backs = [], 0
    for share in karmarkar_karp(flops, request.scheme.dp):
        chunks, extra = schedule_dp_rank(share, request.lengths, flops, bucket, model, refine)
        per_rank.append(chunks)
        roll_backs += extra
    return per_rank, roll_backs


def skrull_metrics(request: PlanRequest, plan: StepPlan, bucket: int, roll_backs: int) -> dict[str, Any]:
    """BucketSize, sharded share of tokens, GDS roll-backs and the predicted step (eq. 8)."""
    model = dacp_cost(request)
    per_pipeline = [sum(model.time(c) for c in p.chunks) for p in plan.pipelines]
    segs = [seg for p in plan.pipelines for c in p.chunks for seg in c.segments]
    total = sum(seg.num_tokens for seg in segs)
    sharded = sum(seg.num_tokens for seg in segs if seg.cp_rank == SHARDED)
    return {
        "bucket_size": bucket,
        "sharded_token_fraction": sharded / total if total else 0.0,
        "sharded_sequences": sum(1 for seg in segs if seg.cp_rank == SHARDED),
        "gds_roll_backs": roll_backs,
        PREDICTED_STEP_TIME_S: max(per_pipeline, default=0.0),
    }


def plan_skrull(request: PlanRequest) -> StepPlan:
    """Skrull GDS + DACP over the request's dp x cp scheme (pp > 1 runs 1F1B)."""
    started = time.perf_counter()
    opts = take_options(request, "skrull")
    bucket = choose_bucket_size(request, opts.bucket_size)
    check_fits_cp_group(request.lengths, request.scheme.cp, bucket, kv_bucket_ratio(request))
    check_request(request)
    refine = opts.refine
    per_rank, roll_backs = global_data_scheduling(request, bucket, refine)
    pipelines = pipelines_from_chunks(request, per_rank)
    plan = finish_plan(request, pipelines, planner="skrull", started=started,
                       options={"bucket_size": bucket, "refine": refine})
    plan.metrics.update(skrull_metrics(request, plan, bucket, roll_backs))
    return plan
