"""InfiniPipe (infinipipe.txt §3): elastic pipeline parallelism with workload-balanced chunks and
co-optimised pipeline schedule and checkpointing.

    from lengthwise.planners import get_planner
    plan = get_planner("infinipipe")(request)                                    # N tuned, adaptive ckpt
    plan = get_planner("infinipipe")(replace(request, options={"num_slices": 6}))
    plan = get_planner("infinipipe")(replace(request, options={"checkpointing": "full",
                                                                "balanced_chunking": False}))  # Fig. 11 ablations

Steps, each a function below or in a helper module:

1. Workload-balanced chunking (§3.2, Algorithm 1; infinipipe/chunking.py): the longest
   sequence is cut into N slices of equal backward time, every long sequence is cut by that mesh
   into split chunks and a tail slice, and short sequences are packed into tail-seeded buckets
   under a time and a token threshold. A sequence becomes one *unit* with its chunks.
2. Data parallelism (our addition; the paper runs one pipeline of d_s-way SP stages): units go
   to the scheme's dp pipelines balanced by predicted seconds; a unit never spans pipelines.
3. Sequence grouping (§3.3.2, eq. 14), per pipeline: units are classed by how many chunks they
   have; consecutive classes form one 1F1B pipeline *group*, and dp[i+1] = min_k dp[k] + delta +
   T_ckpt(classes k..i), delta being one warm-up/cool-down ((pp - 1) chunk passes) and T_ckpt
   the group's recomputation. More groups keep short sequences out of long ones' deep windows
   (less recomputation) at the price of more warm-ups. Groups run one after another.
4. Stage-aware chunk-level adaptive checkpointing (§3.3.3, Algorithm 2, eq. 15-20;
   infinipipe/ckpt.py): per group, an MILP over n + pp - 1 integers solved by HiGHS picks the
   layers each chunk recomputes on each stage, written to the F actions (`F3.r2`).
5. N (§3.2: "automatically tuned"; infinipipe/search.py): a ladder N = 1, 2, 3, 4, 6, 9, ...
   then bisection around the best rung, each N scored by the DP's estimate (steps 1-4, no plan
   objects); N whose chunks cannot fit memory are skipped. With score "simulate" (the default)
   the SIMULATED best N by estimate are then built and simulated, and the fastest is kept.

Cost, for n sequences, P data-parallel pipelines and the N_t values of N the search tries
(N_t <= slice_candidates, 10; the six bench cases try 3-10):

- per N: chunking O(n log n + S) for S segments (sorting, cuts by a search per sequence, then
  O(log buckets) heap work per short sequence); chunk works (tokens, attention pairs) and the
  split units' K/V rows by numpy over all S segments, chunk seconds and activation bytes by
  the cost model's elementwise forms (works_time; without CP, else one call per distinct chunk
  work); Karmarkar-Karp / LPT over the u units, O(u log u) plus O(log P) per merge;
- memory: a split unit is checked alone (Algorithm 2's overflow test) only when its chunks'
  activations and K/V do not fit all at once; a pipeline whose window's largest activations
  plus all its K/V fit every stage (one sort of all chunks per stage shape, O(c log c) for
  all pipelines together) is one group needing no recomputation; otherwise one group problem,
  O(m log m) for its m chunks, and only when that group needs recomputation eq. 14's DP below;
- simulation: SIMULATED plans simulated once each (the simulator's own cost, linear in
  actions), not one per N tried.

So a batch costs O(N_t (n log n + S + P)) plus SIMULATED simulations: near-linear in sequences
and linear in pipelines. Where the paper forces worse: eq. 14 is a DP over the C distinct chunk
counts of a pipeline (C <= N) that prices O(C^2) candidate groups, and each group's
recomputation is Algorithm 2's MILP (NP-hard in general; HiGHS under milp_time_limit_s per
solve). Groups are built lazily in bound order and most never reach HiGHS (grouping.py), and on
the bench cases no pipeline needs recomputation, so no MILP runs; a memory-bound batch still
pays O(C^2) group problems and up to that many MILPs per pipeline. N itself is a search because
§3.2 gives no closed form for it: each N tried re-chunks the whole batch.

Options: `InfiniPipeOptions` in planners/options.py (each with its default and meaning).

Metrics added: num_slices, mesh (boundaries), time_threshold_s, groups (per pipeline: prefill,
chunks, checkpointing status, recompute seconds), recompute_layer_chunks, candidates (N ->
score or why dropped), predicted_step_time_s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.metrics import PLANNING_MS, PREDICTED_STEP_TIME_S
from lengthwise.plan.ir import PipelinePlan, Segment, StepPlan
from lengthwise.planners.base import (
    PlanRequest,
    check_lengths,
    finish_plan,
    take_options,
)
from lengthwise.planners.infinipipe.chunking import (
    ChunkedBatch,
    SliceCost,
    Unit,
    balanced_chunking,
    balanced_mesh,
    even_mesh,
)
from lengthwise.planners.infinipipe.ckpt import GroupPlan, with_recompute
from lengthwise.planners.infinipipe.grouping import (
    SolverOptions,
    chunk_stage_seconds,
    group_by_classes,
    layout,
    unit_need,
)
from lengthwise.planners.infinipipe.search import SliceSearch, tune
from lengthwise.planners.packing_utils import greedy_balance, karmarkar_karp
from lengthwise.sim import simulate_plan

PLANNER = "infinipipe"
MAX_SEQUENCES = 1 << 20
"""Most sequences one batch may have: every slice number the search tries chunks, balances and
schedules the whole batch, and the shortlist is simulated (measured at 4096 GPUs x 131,072
sequences: 0.30 GB resident, 6 CPU seconds, both about linear in sequences). Larger batches are
refused before any work."""
SCHEDULE = "elastic-1f1b"
SIMULATED = 2
"""With score "simulate": how many of the best N by the DP's estimate are simulated. On 18
workloads (6 length profiles x 3 scales) the better of the two best by estimate was the fastest
of the three best in all but one (0.15% slower), and the simulated best of the old full search
(every N simulated) in all but one (0.9% faster)."""
MAX_SLICES = 256
"""Largest N the search tries: a 1M-token sequence in 4K-token slices; finer slices only lose
GEMM efficiency, and a split sequence's memory barely shrinks with N (all its chunks are alive
at its first backward)."""


@dataclass(kw_only=True)
class Settings:
    """The planner's options, read and checked."""

    num_slices: int | None
    slice_candidates: int
    balanced: bool
    checkpointing: str
    score: str
    milp_time_limit_s: float

    @property
    def solver(self) -> SolverOptions:
        return SolverOptions(mode=self.checkpointing, time_limit_s=self.milp_time_limit_s)


def read_settings(request: PlanRequest) -> Settings:
    opts = take_options(request, PLANNER)
    return Settings(num_slices=opts.num_slices,
                    slice_candidates=opts.slice_candidates,
                    balanced=opts.balanced_chunking, checkpointing=opts.checkpointing,
                    score=opts.score, milp_time_limit_s=float(opts.milp_time_limit_s))


# ---- step 2: units over data-parallel pipelines ----

def split_over_pipelines(units: list[Unit], seconds: list[float], dp: int) -> list[list[int]]:
    """Karmarkar-Karp or LPT by predicted seconds, whichever has the lighter heaviest pipeline."""
    if dp == 1:
        return [list(range(len(units)))]
    heaviest = lambda parts: max(sum(seconds[i] for i in p) for p in parts)
    return [sorted(p) for p in min(karmarkar_karp(seconds, dp), greedy_balance(seconds, dp), key=heaviest)]


# ---- one candidate N ----

@dataclass(kw_only=True)
class Candidate:
    """A complete schedule for one slice number."""

    batch: ChunkedBatch
    pipelines: list[list[GroupPlan]]
    estimate_s: float
    """The DP's estimate: slowest pipeline's stage work plus its groups' delta and T_ckpt."""


def plan_candidate(batch: ChunkedBatch, request: PlanRequest, settings: Settings) -> Candidate | None:
    """Steps 2-4 for one chunked batch; None when some pipeline cannot fit memory. A split
    sequence that overflows alone makes every group holding it overflow: checked first (exactly
    only for the units a bound does not clear), so that no pipeline's DP runs in vain."""
    dp = request.scheme.dp
    lay = layout(request, dp)
    lay.costs.prepare([u.chunks for u in batch.units])
    if any(unit_need(u, request, lay, settings.solver)[0] > request.cost.capacity_bytes
           for u, clear in zip(batch.units, lay.costs.alone_surely_fits()) if u.num_chunks > 1 and not clear):
        return None
    flat = chunk_seconds([c for u in batch.units for c in u.chunks], lay.costs.keys, request, lay.stages[0])
    chunk_s, at = [], 0
    for u in batch.units:
        chunk_s.append(flat[at:at + u.num_chunks])
        at += u.num_chunks
    seconds = [sum(row) for row in chunk_s]
    pipelines, estimate = [], 0.0
    shares = split_over_pipelines(batch.units, seconds, dp)
    for share, fits in zip(shares, lay.costs.surely_fit(shares)):
        grouped = group_by_classes([batch.units[i] for i in share], request, lay, settings.solver,
                                   [t for i in share for t in chunk_s[i]], fits)
        if grouped is None:
            return None
        pipelines.append(grouped[0])
        estimate = max(estimate, sum(seconds[i] for i in share) + grouped[1])
    return Candidate(batch=batch, pipelines=pipelines, estimate_s=estimate)


def chunk_seconds(chunks: list, keys: list, request: PlanRequest, shape) -> list[float]:
    """`chunk_stage_seconds` of every chunk on this stage, once per key (`UnitCosts.keys`: the
    chunk's work without context parallelism, where equal work costs equal seconds)."""
    cost, kw = request.cost, {"layers": shape.layers, "tp": request.scheme.tp, "head": shape.head}
    if (request.scheme.cp == 1 and type(cost).forward_time is CostModel.forward_time
            and type(cost).backward_time is CostModel.backward_time and all(type(k[0]) is int for k in keys)):
        # forward_time + backward_time of (tokens, pairs) works elementwise: the same floats
        tokens, pairs = np.array(keys, dtype=np.float64).reshape(len(keys), 2).T
        return (cost.works_time(tokens, pairs, backward=False, **kw)
                + cost.works_time(tokens, pairs, backward=True, **kw)).tolist()
    memo: dict = {}
    out = []
    for c, k in zip(chunks, keys):
        v = memo.get(k)
        if v is None:
            v = memo[k] = chunk_stage_seconds(c, request, shape)
        out.append(v)
    return out


def to_pipeline(groups: list[GroupPlan], request: PlanRequest) -> PipelinePlan:
    """Groups one after another: chunk indices offset, recomputation on the F actions."""
    chunks, stages = [], [[] for _ in range(request.scheme.pp)]
    for g in groups:
        offset = len(chunks)
        chunks += g.schedule.chunks
        for s, acts in enumerate(with_recompute(g.schedule, g.ckpt.recompute, offset)):
            stages[s] += acts
    return PipelinePlan(chunks=chunks, stages=stages, tp=request.scheme.tp, cp=request.scheme.cp,
                        schedule=SCHEDULE)


def candidate_plan(cand: Candidate, request: PlanRequest, settings: Settings, started: float,
                   pipelines: list[PipelinePlan] | None = None) -> StepPlan:
    """The candidate's StepPlan with its metrics (`pipelines`: its to_pipeline ones, when built)."""
    pipelines = pipelines or [to_pipeline(groups, request) for groups in cand.pipelines]
    options = {"num_slices": cand.batch.num_slices, "balanced_chunking": settings.balanced,
               "checkpointing": settings.checkpointing}
    plan = finish_plan(request, pipelines, planner=PLANNER, started=started, options=options)
    plan.metrics.update(candidate_metrics(cand))
    return plan


def bare_plan(cand: Candidate, request: PlanRequest) -> StepPlan:
    """The candidate's pipelines as a StepPlan without metrics: what the simulator reads
    (candidate_plan's metrics are made for the shortlist's winner only)."""
    return StepPlan(planner=PLANNER, model=request.model, cluster=request.cluster, lengths=list(request.lengths),
                    pipelines=[to_pipeline(groups, request) for groups in cand.pipelines], zero=request.scheme.zero)


def candidate_metrics(cand: Candidate) -> dict:
    groups = [[{"prefill": g.schedule.prefill, "chunks": len(g.schedule.chunks), "ckpt": g.ckpt.status,
                "recompute_s": g.ckpt.seconds} for g in pipe] for pipe in cand.pipelines]
    recomputed = sum(1 for pipe in cand.pipelines for g in pipe for row in g.ckpt.recompute for r in row if r)
    return {"num_slices": cand.batch.num_slices, "mesh": list(cand.batch.mesh.bounds),
            "time_threshold_s": cand.batch.time_threshold, "groups": groups,
            "recompute_layer_chunks": recomputed, "estimate_s": cand.estimate_s, **cand.batch.stats}


# ---- step 5: the slice number ----

def tune_slices(request: PlanRequest, settings: Settings, fit: SliceCost, started: float) -> StepPlan:
    """Step 5: the fixed N, or the best N of the search (infinipipe/search.py).

    The search compares N by the DP's estimate, which needs no plan objects; with score
    "simulate" the SIMULATED best N by estimate are then built and simulated, and the fastest
    simulated one is kept (the estimate leaves out gradient reduction and the exact bubbles, so
    N within a few percent by estimate can swap places in the simulator)."""
    cands: dict[int, Candidate] = {}
    whole = [Segment(i, 0, n) for i, n in enumerate(request.lengths)]

    def evaluate(n: int) -> float | str:
        cand, why = candidate_for(n, request, settings, fit, whole)
        if cand is None:
            return why
        cands[n] = cand
        return cand.estimate_s

    def too_many(n: int) -> bool:
        return n > MAX_SLICES or mesh_for(n, request, settings, fit) is None

    if settings.num_slices:
        search = SliceSearch(score=evaluate, budget=1)
        search.at(settings.num_slices)
    else:
        search = tune(evaluate, too_many, settings.slice_candidates)
    if search.best is None:
        raise infeasible_error(request, settings, fit, max(search.tried))
    feasible = sorted(cands, key=lambda n: (cands[n].estimate_s, n))
    shortlist = feasible[:SIMULATED] if settings.score == "simulate" else feasible[:1]
    bare, scores = {}, {}
    for n in shortlist:
        bare[n] = bare_plan(cands[n], request)
        scores[n] = score(bare[n], cands[n], request, settings)
    won = min(shortlist, key=lambda n: (scores[n], n))
    best = candidate_plan(cands[won], request, settings, started, bare[won].pipelines)
    best.metrics[PREDICTED_STEP_TIME_S] = scores[won]
    best.metrics["candidates"] = {str(k): v for k, v in sorted(search.tried.items())}
    if settings.score == "simulate":
        best.metrics["simulated_candidates"] = {str(n): scores[n] for n in sorted(shortlist)}
    best.metrics[PLANNING_MS] = (time.perf_counter() - started) * 1e3
    return best


def score(plan: StepPlan, cand: Candidate, request: PlanRequest, settings: Settings) -> float:
    if settings.score == "estimate":
        return cand.estimate_s
    return simulate_plan(plan, request.cost).step_time_s


def mesh_for(n: int, request: PlanRequest, settings: Settings, fit: SliceCost):
    return (balanced_mesh if settings.balanced else even_mesh)(max(request.lengths), n, fit)


def candidate_for(n: int, request: PlanRequest, settings: Settings, fit: SliceCost,
                  whole: list[Segment] | None = None) -> tuple[Candidate | None, str]:
    """Steps 1-4 for one N, or None and why it has no plan (`whole` as in `pack_buckets`)."""
    batch = balanced_chunking(request.lengths, n, fit, balanced=settings.balanced, whole=whole)
    if batch is None:
        return None, "too many slices"
    cand = plan_candidate(batch, request, settings)
    if cand is None:
        return None, "does not fit memory"
    return cand, ""


def infeasible_error(request: PlanRequest, settings: Settings, fit: SliceCost, last_n: int) -> UserError:
    """Why nothing fits, shown for the longest sequence at the finest N tried."""
    longest = max(range(len(request.lengths)), key=lambda i: request.lengths[i])
    batch = balanced_chunking(request.lengths, last_n, fit, balanced=settings.balanced)
    unit = next(u for u in batch.units if longest in {s.seq_id for c in u.chunks for s in c.segments})
    need, stage = unit_need(unit, request, layout(request, request.scheme.dp), settings.solver)
    how = "with no recomputation" if settings.checkpointing == "none" else "even with every layer recomputed"
    return UserError(
        f"{PLANNER}: no slice number N <= {last_n} fits memory: sequence {longest} ({request.lengths[longest]} "
        f"tokens, cut into {unit.num_chunks} chunks) needs {need / 2**30:.3g} GiB on stage {stage} of "
        f"{request.scheme} {how} (its chunks' checkpoints, K/V state and K/V gradients), above the "
        f"{request.cost.capacity_bytes / 2**30:.3g} GiB a GPU has: raise --tp, --pp or --cp, "
        "or lower --context-length")


def plan_infinipipe(request: PlanRequest) -> StepPlan:
    """InfiniPipe for one global batch (infinipipe §3); options: `InfiniPipeOptions` (planners/options.py).
    The registry runs it with the garbage collector paused (planners/base.py `collector_paused`)."""
    started = time.perf_counter()
    if len(request.lengths) > MAX_SEQUENCES:
        raise UserError(f"{PLANNER} plans at most {MAX_SEQUENCES:,} sequences a batch, not {len(request.lengths):,}: "
                        "each slice number it tries re-chunks and schedules the whole batch: lower --batch-size "
                        "or split the batch")
    settings = read_settings(request)
    check_lengths(request)
    s = request.scheme
    fit = SliceCost.from_cost(request.cost, layers=request.model.num_layers // s.pp, tp=s.tp, cp=s.cp)
    return tune_slices(request, settings, fit, started)
