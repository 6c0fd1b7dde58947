"""SlimPack (slimpack.txt §4-§5): MicroPacks of equal FLOPs, asymmetric backward grouping,
DP-Merge for outliers, the MicroPack count chosen by simulation.

    from lengthwise.planners import get_planner
    plan = get_planner("slimpack")(request)                                  # sweep the MicroPack count
    plan = get_planner("slimpack")(replace(request, options={"num_micropacks": 16}))

    lengthwise plan --planner slimpack --profile github --batch-size 512 --context-length 131072 \\
        --overlong drop --model llama2-7b --dp 8 --tp 4 --pp 4
    lengthwise plan --planner slimpack --option num_micropacks=8 --profile tiny --batch-size 64 \\
        --model tiny --cluster cpu

Steps, each a function here or in a slimpack_* helper:

1. Phase 1 (§4.1.1, slimpack/dp.py): each sample's forward FLOPs (cost.forward_flops of the
   whole sequence, LM head included); samples onto DP ranks for equal forward FLOPs; a sample
   heavier than a rank's share B = total / ranks, or whose activations and K/V state overflow
   one rank's pipeline, is merged over several ranks (DP-Merge): one pipeline whose cp is the
   number of merged ranks, the outlier's segments SHARDED over them (the simulator charges
   cost.cp_comm_time), every other sample of that pipeline kept whole on one CP rank (no CP
   communication: §4.1.3 "other samples continue under the standard schedule"). The
   scheme's cp is not applied to every sample: its dp x cp pipelines of tp x pp GPUs are all
   DP ranks, and CP appears only where DP-Merge puts it (§4.1.3: slicing "reduces the need for
   costly, communication-intensive context parallelism"; sharding every slice would re-gather
   its whole K/V context per MicroPack, cost.cp_comm_time).
2. Phase 2 (§4.1.1, slimpack/cuts.py): per pipeline, samples in descending FLOPs cut into N
   forward MicroPacks of equal forward FLOPs (Slim / Mix / Pack), boundaries exact to a token
   by solving the slice-cost quadratic.
3. Asymmetric partitioning (§4.1.2, slimpack/cuts.py): the same samples, FIFO across samples
   and FILO within one, cut into N backward MicroPacks of equal backward FLOPs; each backward
   segment is a whole forward segment or a sub-range of one. The plan carries them as
   PipelinePlan.backward_chunks.
4. PackFlow schedule (§4.2, slimpack/schedule.py): 1F1B over the forward MicroPacks and the
   backward units, forwards injected where a unit's slices have not all run forward.
5. MicroPack count (§5.1, §4.3, slimpack/planner.py): N on a log-spaced sweep from pp to
   max_micropacks (ratio sqrt 2, rounded, duplicates dropped: the integer steps are dense where
   the budget changes fastest); every candidate is simulated (lengthwise.sim) in increasing N until two fitting
   ones in a row are slower than the best before them, and each pipeline keeps the N that
   finishes it soonest among those whose simulated peak memory fits (§4.1.1: "each DP replica
   may choose a different N"). When DP-Merge merged a compute outlier, the variant that merges
   only memory outliers is swept too and the faster step wins (merging costs CP communication).

Simulated step times and planning times against the other planners on the papers' workloads:
benchmarks/results/compare_suite.json (written by benchmarks/compare_suite.py).

Options: `SlimPackOptions` in planners/options.py (each with its default and meaning).

Metrics added to plan.metrics: micropacks (per pipeline), forward_budget_flops and
backward_budget_flops (per pipeline), forms (Slim / Mix / Pack counts), dp_merge (merged
outliers), micropack_rsd (relative standard deviation of MicroPack forward and backward seconds
and of tokens, as infinipipe table 2 reports), and with the sweep: sweep (every candidate's
simulated step time and peak), predicted_step_time_s, phase1_variants (each DP-Merge
variant's simulated step).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from lengthwise.errors import UserError
from lengthwise.metrics import GIB
from lengthwise.plan.ir import Chunk, PipelinePlan, StepPlan
from lengthwise.plan.schedules import make_schedule
from lengthwise.plan.validate import memory_overflow
from lengthwise.sim.inputs import SliceStructure
from lengthwise.planners.options import SlimPackOptions
from lengthwise.planners.base import (
    PlanRequest,
    take_options,
)
from lengthwise.plan.validate import check_backward_units
from lengthwise.planners.slimpack.cuts import (
    PrefixCost,
    Stream,
    forward_chunks,
    place_segments,
    streams_cuts,
)
from lengthwise.planners.slimpack.pieces import materialized, streams_pieces
from lengthwise.planners.slimpack.dp import RankGroup, assign_ranks, memory_ranks, merge_sizes
from lengthwise.planners.slimpack.schedule import packflow_schedule, packflow_stages_many

HOLD_SHARES = (0.75, 0.5, 0.25)
"""Share of a GPU's memory that model states plus one sample's activations, K/V state and K/V
gradients may take; a sample needing more is merged over ranks, and the rest is left to the
MicroPacks in flight beside it. When no MicroPack count fits in simulation, the next, smaller
share is tried (memory outliers merge over more ranks)."""


# ---- costs ----

def flops_models(request: PlanRequest) -> tuple[PrefixCost, PrefixCost]:
    """(forward, backward) prefix-cost models of the whole model, LM head included."""
    layers = request.model.num_layers
    return (PrefixCost.from_cost(request.cost, layers=layers, backward=False),
            PrefixCost.from_cost(request.cost, layers=layers, backward=True))


def memory_share_per_token(request: PlanRequest, hold: float) -> float:
    """Share of a stage's free memory (`hold` of capacity, less model states) one token of a sample
    takes while the whole sample is in flight (activations, K/V state and K/V gradients), on the
    tightest stage (CostModel.stage_budgets; every pipeline's dp x cp ranks hold a replica)."""
    s, cost = request.scheme, request.cost
    worst = 0.0
    for b in cost.stage_budgets(tp=s.tp, pp=s.pp, replicas=s.dp * s.cp, zero=s.zero):
        free = b.capacity * hold - b.states
        if free <= 0:
            raise UserError(f"stage {b.stage} model states take {b.states / GIB:.1f} GiB, more than {hold:.0%} "
                            f"of the {b.capacity / GIB:.1f} GiB usable: raise --tp/--pp or the ZeRO stage")
        # K/V by the cost model's kv_bytes, which a measured profile may override
        per_token = b.activation_per_token + 2 * cost.kv_bytes(1, layers=b.layers, tp=s.tp)
        worst = max(worst, per_token / free)
    return worst


# ---- one pipeline ----

def stream_order(group: RankGroup, flops: np.ndarray) -> list[int]:
    """§4.2: a replica's samples in descending forward FLOPs (ties by id)."""
    return sorted(group.seq_ids, key=lambda i: (-flops[i], i))


def cp_placement(chunks: list[Chunk], group: RankGroup, g: PrefixCost) -> dict[int, int]:
    """CP rank of every non-outlier sequence of a merged pipeline: per MicroPack, unplaced
    sequences go largest first to the least-loaded rank; a sequence keeps its rank in every
    MicroPack it spans (its K/V context stays local). Empty for an unmerged pipeline."""
    if group.ranks == 1:
        return {}
    outliers, rank_of = set(group.outliers), {}
    for chunk in chunks:
        loads = [0.0] * group.ranks
        segs = [s for s in chunk.segments if s.seq_id not in outliers]
        for s in sorted(segs, key=lambda s: (s.seq_id not in rank_of, -g.slice(s.start, s.stop), s.seq_id)):
            r = rank_of.setdefault(s.seq_id, min(range(group.ranks), key=lambda k: (loads[k], k)))
            loads[r] += float(g.slice(s.start, s.stop))
    return rank_of


def prepare_stream(request: PlanRequest, group: RankGroup, flops: np.ndarray) -> tuple[Stream, dict]:
    """What every count's build of one pipeline shares: its stream (§4.2 order) and the
    segments made so far, by (sample, start, stop) (a sample most counts keep whole is one
    Segment object across all of them)."""
    return Stream.of(stream_order(group, flops), request.lengths), {}


def build_pipeline(request: PlanRequest, group: RankGroup, count: int, models, flops: np.ndarray,
                   asymmetric: bool, lean: bool = False, *, check: bool = True,
                   prepared: tuple[Stream, dict] | None = None) -> PipelinePlan:
    """Phase 2, asymmetric partitioning and the PackFlow schedule for one pipeline (`check`:
    check_backward_units on it, the sweep checks only the pipelines it keeps; `prepared`:
    prepare_stream's result for this group, shared by the sweep's counts)."""
    return build_candidate(request, group, count, models, flops, asymmetric, lean, check=check,
                           prepared=prepared)[0]


def build_candidate(request: PlanRequest, group: RankGroup, count: int, models, flops: np.ndarray,
                    asymmetric: bool, lean: bool = False, *, check: bool = True,
                    prepared: tuple[Stream, dict] | None = None) -> tuple[PipelinePlan, SliceStructure | None]:
    """build_pipeline, and the pipeline's SliceStructure for the simulator (None where it is
    left to the simulator: without asymmetric partitioning, or with an empty MicroPack)."""
    pipe, known = build_candidates(request, [group], count, models, flops, asymmetric, lean, check=check,
                                   prepared=[prepared or prepare_stream(request, group, flops)])[0]
    return materialize(pipe), known


def materialize(pipe: PipelinePlan) -> PipelinePlan:
    """The pipeline with plain lists of chunks (build_candidates leaves them LazyChunks)."""
    pipe.chunks = materialized(pipe.chunks)
    if pipe.backward_chunks is not None:
        pipe.backward_chunks = materialized(pipe.backward_chunks)
    return pipe


def build_candidates(request: PlanRequest, groups: list[RankGroup], count: int, models, flops: np.ndarray,
                     asymmetric: bool, lean: bool = False, *, check: bool = True,
                     prepared: list[tuple[Stream, dict]]) -> list[tuple[PipelinePlan, SliceStructure | None]]:
    """build_candidate of every group at one count, the MicroPacks of all of them cut at once
    (pieces.streams_pieces); their chunks may be LazyChunks, made on first use (`materialize`)."""
    gf, gb = models
    s = request.scheme
    streams = [stream for stream, _ in prepared]
    counts = [max(1, min(count, stream.total_tokens)) for stream in streams]
    memo = [made for _, made in prepared]
    fcuts = streams_cuts(streams, gf, counts, backward=False, memo=memo)
    if not asymmetric:
        out = []
        for group, (stream, made), fc in zip(groups, prepared, fcuts):
            chunks = forward_chunks(stream, fc, made)
            chunks = place_segments(chunks, cp_placement(chunks, group, gf))
            out.append((PipelinePlan(chunks=chunks, stages=make_schedule("1f1b", chunks, s.pp), tp=s.tp,
                                     cp=group.ranks, schedule="1f1b"), None))
        return out
    bcuts = streams_cuts(streams, gb, counts, backward=True, memo=memo)
    pieces = streams_pieces(streams, fcuts, bcuts, [made for _, made in prepared])
    # the PackFlow schedules of every pipeline with backward units at once
    some = [k for k, (_, _, ready, _) in enumerate(pieces) if ready]
    schedules = dict(zip(some, packflow_stages_many([len(pieces[k][0]) for k in some], [pieces[k][2] for k in some],
                                                    s.pp, lean=lean)))
    out = []
    for k, (group, (chunks, units, ready, known)) in enumerate(zip(groups, pieces)):
        rank_of = cp_placement(chunks, group, gf)
        chunks, units = place_segments(chunks, rank_of), place_segments(units, rank_of)
        if check:
            check_backward_units(chunks, units)
        stages = schedules.get(k) or packflow_schedule(chunks, units, s.pp, lean=lean, ready=ready)
        out.append((PipelinePlan(chunks=chunks, stages=stages, tp=s.tp, cp=group.ranks, backward_chunks=units,
                                 schedule="packflow-1f1b" + ("-lean" if lean else "")), known))
    return out


def fitting_pipeline(request: PlanRequest, p: int, group: RankGroup, count: int, models, flops: np.ndarray,
                     asymmetric: bool, lean: bool, *, pipelines: int) -> PipelinePlan:
    """build_pipeline at the smallest count >= `count` at which every forward MicroPack fits its
    stage's GPUs alone, by validate_plan's own bound (memory_overflow, model states sharded over
    the plan's `pipelines`). Phase 1 only checks samples one by one; a small count packs several
    into one MicroPack. UserError when no count fits (one pipeline `p` of the plan)."""
    cost, layers, zero = request.cost, request.model.num_layers, request.scheme.zero
    tokens = sum(request.lengths[i] for i in group.seq_ids)
    n = max(count, min_fitting_count(request, tokens, group.ranks, pipelines))
    prepared = prepare_stream(request, group, flops)
    while True:
        pipe = build_pipeline(request, group, n, models, flops, asymmetric, lean, prepared=prepared)
        over = memory_overflow(pipe, cost, num_layers=layers, dp=pipelines, zero=zero)
        if over is None:
            return pipe
        if len(pipe.chunks) >= tokens:
            raise UserError(f"slimpack: pipeline {p} fits no MicroPack count: at {len(pipe.chunks)} its "
                            f"{over.describe(pipe, cost)}: raise --tp, --pp or --dp")
        n = len(pipe.chunks) + 1


def min_fitting_count(request: PlanRequest, tokens: int, cp: int, pipelines: int) -> int:
    """A lower bound on the MicroPacks a pipeline of `tokens` tokens over `cp` merged ranks needs
    for each to fit alone: a MicroPack's busiest rank holds at least 1/cp of its tokens, each
    taking its activations on the tightest stage (K/V context only adds)."""
    s, cost = request.scheme, request.cost
    most = float("inf")  # tokens one rank can hold beside its model states
    for b in cost.stage_budgets(tp=s.tp, pp=s.pp, replicas=pipelines * s.cp, zero=s.zero):
        per_token = b.activation_per_token
        most = min(most, b.free / per_token if per_token > 0 else float("inf"))
    if most <= 0:
        return 1  # nothing fits: fitting_pipeline reports the overflow
    return max(1, math.floor(tokens / (cp * most)))


def bare_plan(request: PlanRequest, pipes: list[PipelinePlan]) -> StepPlan:
    return StepPlan(planner="slimpack", model=request.model, cluster=request.cluster,
                    lengths=list(request.lengths), pipelines=pipes, zero=request.scheme.zero)


# ---- metrics (micropack_metrics: slimpack/metrics.py) ----

def merge_metrics(groups: list[RankGroup]) -> list[dict]:
    return [{"seq_ids": g.outliers, "ranks": g.ranks, "cp": g.ranks} for g in groups if g.ranks > 1]


# ---- the planner ----

def read_options(request: PlanRequest) -> SlimPackOptions:
    """The request's options with max_micropacks resolved (default 32 x pp, at least pp)."""
    opts = take_options(request, "slimpack")
    pp = request.scheme.pp
    top = opts.max_micropacks or 32 * pp
    if top < pp:
        raise UserError(f"slimpack option max_micropacks={top} is below pp={pp}: a pipeline needs at least "
                        "one MicroPack per stage to fill")
    return dataclasses.replace(opts, max_micropacks=top)


def phase1_variants(request: PlanRequest, models, merge: bool,
                    hold: float = HOLD_SHARES[0]) -> tuple[list[list[RankGroup]], np.ndarray]:
    """Phase 1: forward FLOPs per sample and the rank groups; with DP-Merge, the paper's groups
    (compute and memory outliers merged) and, when it differs, the memory-only variant."""
    lengths = np.asarray(request.lengths, dtype=np.int64)
    flops = models[0].of(lengths)
    want = memory_ranks(lengths, memory_share_per_token(request, hold))
    floor = memory_ranks(lengths, memory_share_per_token(request, 1.0))
    ranks = request.scheme.dp * request.scheme.cp
    if not merge:
        variants = [assign_ranks(flops, want, floor, ranks, merge=False)]
    else:
        # the two variants differ exactly when their merged groups do: only then place twice
        paper = merge_sizes(flops, want, floor, ranks, by_flops=True)
        memory = merge_sizes(flops, want, floor, ranks, by_flops=False)
        variants = [assign_ranks(flops, want, floor, ranks, merge=True, merged=paper)]
        if memory != paper:
            variants.append(assign_ranks(flops, want, floor, ranks, merge=True, merged=memory))
    return [[g for g in groups if g.seq_ids] for groups in variants], flops
