"""ChunkFlow (chunkflow.txt §4-§5): uniform chunks, state-aware 1F1B, a grid over ChunkSize and K.

    from lengthwise.planners import get_planner
    plan = get_planner("chunkflow")(request)                                   # default ChunkSize, K = 1
    plan = get_planner("chunkflow")(replace(request, options={"chunk_size": 8192, "k": 4}))
    plan = get_planner("chunkflow")(replace(request, options={"chunk_size": "auto"}))  # §5 grid search

Steps, each a function below:

1. Placement over data parallelism (our addition: the paper trains one pipeline, and with
   Megatron's data parallelism each rank builds chunks from its own share of the batch). A
   sequence longer than ChunkSize is one unit costing the predicted forward + backward seconds
   of its pieces on the whole model, plus the re-run forwards of the first N - K of its N
   pieces (§4.2); a short sequence costs the seconds it adds to a full packed chunk
   (`packed_rate`). Units go to the dp pipelines by LPT, or by Karmarkar-Karp when that leaves
   the heaviest pipeline lighter (tried only when LPT is over 1% above the lower bound), so a
   long sequence is never split across pipelines. Balancing sequences rather than finished
   chunks matters on long-tail batches: 512 sequences of chunkflow-eval hold about 200K
   tokens, i.e. 7 chunks of 32K for 16 pipelines.
2. Chunk construction (§4.1, Algorithm 1, `construct_chunks`), per pipeline. A sequence longer
   than ChunkSize is cut into ChunkSize pieces, the last piece holding the remainder; its pieces
   form one *group* of dependent chunks. Our reading of the paper: Algorithm 1 appends every
   piece of a long sequence, remainder included, to the result as a chunk of its own (figure 4:
   sequence 6 becomes chunks 4-7) and bin-packs only the sequences not longer than ChunkSize.
   So a remainder piece is never topped up with short sequences, and every standalone chunk
   holds whole sequences. The paper raises the bin count from 1 until a packing succeeds; we
   pack best-fit-decreasing (packing_utils) and record how close it came in plan.metrics:
   `packed_chunks` against `packed_chunks_lower_bound`, the sum over pipelines of
   ceil(short tokens / ChunkSize), below which no packing exists (on long-tail batches BFD
   meets it), and `packed_chunks_global_lower_bound`, the same bound for the batch as a whole
   (the gap to it, at most dp - 1, is the price of giving every pipeline its own chunks).
3. State-aware scheduling (§4.2 Algorithm 2, §4.3): each pipeline runs its groups, then its
   packed chunks, under make_schedule("state-aware-1f1b", chunks, pp, k=K); with pp = 1 that
   is plain gradient accumulation: forwards of a group in order, backwards in reverse, the
   first N - K forwards run once without grad (keeping only K/V) and again before their backward.
4. ChunkSize and K (§5, chunkflow/planner.py): with chunk_size="auto" every (ChunkSize, K) of a
   grid is planned and simulated, and the fastest one whose simulated peak memory fits wins.

How the options' defaults are chosen (`ChunkFlowOptions` in planners/options.py):

- `chunk_size`: tokens per chunk (int), or "auto" for the §5 grid search. Default: the largest
  power of two (at least 256) whose chunks in flight per stage (as many as the schedule this
  planner emits for the batch holds at once, `inflight_chunks`), one chunk's working set, plus
  the K/V state (and its gradient) of the batch's longest sequence, fit beside the model
  states; capped at the context
  length rounded up to a power of two (§5: without pipelining, ChunkSize as large as memory
  allows) and, with pp > 1, at the power of two below one pipeline's tokens / (2 pp) (at least
  2K), so each stage sees about 2 pp chunks (memory alone would leave long-tail batches 2-4
  chunks per pipeline and mostly bubbles; chunk_size=auto records every grid point's simulated
  step in plan.metrics["grid"] to check the default against).
- `k`: chunks of a group whose activations are kept at once (int >= 1, §4.2). Default 1; with
  chunk_size="auto" and no k, K is searched too.

Cost per plan, n sequences and D pipelines: sorting and LPT placement O(n log n + n log D)
(a heap of pipeline loads), Karmarkar-Karp when tried O(n log n) in the usual case, chunk
construction best-fit-decreasing O(n log n) per pipeline, scheduling linear in chunks (one
schedule per distinct pipeline shape). chunk_size="auto" multiplies this by the grid's points
(about 6 chunk sizes x log2 of the longest group's chunk count) and adds a simulation per point.

Metrics added to plan.metrics: chunk_size, k, dependent_groups, dependent_chunks,
packed_chunks, packed_chunks_lower_bound, packed_chunks_global_lower_bound,
predicted_pipeline_s (per pipeline: the sum of its units' costs, seconds), and after the grid
search `grid` (every candidate's simulated step time, peak memory and whether it fits).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from lengthwise.cost.flops import causal_keys
from lengthwise.errors import UserError
from lengthwise.metrics import GIB, PLANNING_MS
from lengthwise.plan.ir import Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.plan.schedules import held_chunks, make_schedule
from lengthwise.planners.base import (
    PlanRequest,
    finish_plan,
    whole,
)
from lengthwise.planners.packing_utils import (
    best_fit_decreasing,
    greedy_balance,
    karmarkar_karp,
)

SCHEDULE = "state-aware-1f1b"
MIN_CHUNK_SIZE = 256
"""Smallest default ChunkSize, tokens: below it a layer pass's fixed costs outweigh its GEMMs
(cost/time.py Throughput), so a model that leaves less memory is better served by more tp/pp."""
FILL_FLOOR = 2048
"""Smallest ChunkSize the pipeline-filling cap of the default goes down to, tokens (the grid's
smallest): below it GEMM efficiency costs more than the bubbles it removes."""
BALANCE_SLACK = 1.01
"""LPT placement within this factor of the lower bound is kept without trying Karmarkar-Karp."""


@dataclass(kw_only=True)
class ChunkSet:
    """What Algorithm 1 builds from one pipeline's share of the batch."""

    groups: list[list[Chunk]]
    """Dependent chunks: the pieces of each sequence longer than ChunkSize, in sequence order."""
    standalone: list[Chunk]
    """Packed chunks of whole sequences of at most ChunkSize tokens."""
    packed_lower_bound: int
    """ceil(tokens of the short sequences / ChunkSize): no packing needs fewer standalone chunks."""


# ---- step 2: chunk construction (chunkflow §4.1, Algorithm 1), per pipeline ----

def split_sequence(seq_id: int, length: int, chunk_size: int) -> list[Chunk]:
    """Pieces [0, C), [C, 2C), ... of one long sequence; the last one holds the remainder."""
    return [Chunk((Segment(seq_id, start, min(start + chunk_size, length)),))
            for start in range(0, length, chunk_size)]


def pack_short_sequences(seq_ids: list[int], lengths: list[int], chunk_size: int) -> list[Chunk]:
    """Whole sequences into as few chunks of at most chunk_size tokens as best-fit-decreasing finds."""
    bins = best_fit_decreasing([lengths[i] for i in seq_ids], chunk_size)
    return [Chunk(whole(sorted(seq_ids[j] for j in b), lengths)) for b in bins]


def construct_chunks(seq_ids: list[int], lengths: list[int], chunk_size: int) -> ChunkSet:
    """Algorithm 1 on some sequences of the batch: split those longer than chunk_size, pack the rest."""
    long_ids = [i for i in seq_ids if lengths[i] > chunk_size]
    short_ids = [i for i in seq_ids if lengths[i] <= chunk_size]
    short_tokens = sum(lengths[i] for i in short_ids)
    return ChunkSet(groups=[split_sequence(i, lengths[i], chunk_size) for i in long_ids],
                    standalone=pack_short_sequences(short_ids, lengths, chunk_size),
                    packed_lower_bound=-(-short_tokens // chunk_size))


# ---- step 1a: the predicted seconds that placement balances ----

def pass_seconds(chunk: Chunk, request: PlanRequest) -> tuple[float, float]:
    """(forward, backward) seconds of a chunk through the whole model, LM head included."""
    s, layers, cost = request.scheme, request.model.num_layers, request.cost
    return (cost.forward_time(chunk, layers=layers, tp=s.tp, cp=s.cp, head=True),
            cost.backward_time(chunk, layers=layers, tp=s.tp, cp=s.cp, head=True))


def group_seconds(group: list[Chunk], k: int, request: PlanRequest) -> float:
    """Forward + backward seconds of a long sequence's chunks, re-run forwards included."""
    times = [pass_seconds(c, request) for c in group]
    # chunkflow §4.2: the first N - K chunks of a group run forward twice.
    return sum(f + b for f, b in times) + sum(f for f, _ in times[:max(len(times) - k, 0)])


@dataclass(frozen=True, kw_only=True)
class PackedRate:
    """Seconds a short sequence adds to a full packed chunk: per token and per attention pair."""

    per_token: float
    """Seconds per token (GEMMs at a full chunk's efficiency, fixed costs spread over the chunk)."""
    per_key: float
    """Seconds per causal (query, key) pair."""

    def seconds(self, length: int) -> float:
        return self.per_token * length + self.per_key * causal_keys(0, length)


def packed_rate(request: PlanRequest, chunk_size: int) -> PackedRate:
    """Two probes of chunk_size tokens, one sequence vs two halves, separate the two rates.

    Exact when a chunk's time is f(tokens) + g * attention pairs, which holds for the analytic
    model (efficiency depends on the chunk's tokens) and for profiled a*keys + b*tokens + c."""
    half = max(chunk_size // 2, 1)   # a 1-token chunk size still probes two 1-token halves
    one = sum(pass_seconds(Chunk((Segment(0, 0, 2 * half),)), request))
    two = sum(pass_seconds(Chunk((Segment(0, 0, half), Segment(1, 0, half))), request))
    keys_diff = causal_keys(0, 2 * half) - 2 * causal_keys(0, half)
    per_key = max(one - two, 0.0) / keys_diff if keys_diff else 0.0
    per_token = (one - per_key * causal_keys(0, 2 * half)) / (2 * half)
    return PackedRate(per_token=per_token, per_key=per_key)


# ---- step 1b: placement over data-parallel pipelines ----

def balance_units(seconds: list[float], dp: int) -> list[list[int]]:
    """Units onto dp pipelines by LPT; when LPT's heaviest pipeline is over 1% above the lower
    bound max(mean load, largest unit), Karmarkar-Karp too, keeping the lighter heaviest."""
    if dp == 1:
        return [list(range(len(seconds)))]

    def heaviest(parts: list[list[int]]) -> float:
        return max(sum(seconds[i] for i in p) for p in parts)

    lpt = greedy_balance(seconds, dp)
    bound = max(sum(seconds) / dp, max(seconds, default=0.0))
    if heaviest(lpt) <= BALANCE_SLACK * bound:
        return lpt  # KK costs ~20 ms at 512 units and 16 pipelines and could gain under 1%
    return min(karmarkar_karp(seconds, dp), lpt, key=heaviest)


def place_sequences(request: PlanRequest, chunk_size: int, k: int) -> list[list[int]]:
    """Sequence ids per pipeline, balancing predicted seconds; a long sequence is one unit."""
    lengths = request.lengths
    rate = packed_rate(request, chunk_size)
    seconds = [group_seconds(split_sequence(i, n, chunk_size), k, request) if n > chunk_size
               else rate.seconds(n) for i, n in enumerate(lengths)]
    return [sorted(share) for share in balance_units(seconds, request.scheme.dp)]


# ---- memory: the default ChunkSize ----

def inflight_chunks(request: PlanRequest, chunk_size: int, k: int) -> list[int]:
    """Per stage, the most chunks whose activations any pipeline's schedule holds at once, for
    the chunks and state-aware 1F1B schedules this planner builds from the batch at
    (chunk_size, k) (`held_chunks`). Read off the schedule rather than assumed, so the memory
    model cannot drift from it (with the groups first, as here, at most max(K, pp - stage))."""
    return pipelines_inflight(build_pipelines(request, chunk_size, k)[1], request.scheme.pp)


def pipelines_inflight(pipelines: list[PipelinePlan], pp: int) -> list[int]:
    """Per stage, the most chunks any of the pipelines' schedules holds at once."""
    held = [0] * pp
    for pipe in pipelines:
        held = [max(h, held_chunks(stage)) for h, stage in zip(held, pipe.stages)]
    return held


def stage_memory_bytes(request: PlanRequest, chunk_size: int, k: int, longest: int,
                       inflight: list[int] | None = None) -> list[tuple[float, ...]]:
    """Per stage: (model states, K/V state + its gradient, activations of the chunks in flight
    and one chunk's working set).

    A stage keeps `inflight[stage]` chunks' activations (default `inflight_chunks`: as many as
    the emitted schedule holds; each counted as a full chunk of chunk_size tokens), the largest
    transient of one chunk beside them (its backward's working set, or on the last stage the LM
    head's forward logits), and the K/V of the longest split sequence with a gradient buffer of
    the same size (chunkflow §6.3.1: "we directly save all key/value tensors").
    """
    s, cost = request.scheme, request.cost
    if inflight is None:
        inflight = inflight_chunks(request, chunk_size, k)
    chunk = Chunk((Segment(0, 0, chunk_size),))
    rows = []
    for b in cost.stage_budgets(tp=s.tp, pp=s.pp, replicas=s.dp * s.cp, zero=s.zero):
        kv = 2 * cost.kv_bytes(longest, layers=b.layers, tp=s.tp, cp=s.cp) if longest > chunk_size else 0.0
        work = max(cost.backward_work_bytes(chunk, layers=b.layers, tp=s.tp, cp=s.cp, head=b.last),
                   cost.head_forward_bytes(chunk, tp=s.tp, cp=s.cp) if b.last else 0.0)
        act = inflight[b.stage] * cost.activation_bytes(chunk, layers=b.layers, tp=s.tp, cp=s.cp, head=b.last)
        rows.append((b.states, kv, act + work))
    return rows


def fits(request: PlanRequest, chunk_size: int, k: int) -> bool:
    longest = max(request.lengths)
    return all(sum(row) <= request.cost.capacity_bytes
               for row in stage_memory_bytes(request, chunk_size, k, longest))


def default_chunk_size(request: PlanRequest, k: int) -> int:
    """Largest power of two that fits memory, capped at the context length's power of two and,
    with pp > 1, at one pipeline's tokens over 2 pp (chunkflow §5: few chunks leave bubbles)."""
    cap = 1 << max(math.ceil(math.log2(request.context_length)), 0)
    s = request.scheme
    if s.pp > 1:
        per_pipeline = sum(request.lengths) / (s.dp * 2 * s.pp)
        cap = min(cap, max(FILL_FLOOR, 1 << int(math.log2(max(per_pipeline, 1)))))
    size = cap
    while size > MIN_CHUNK_SIZE and not fits(request, size, k):
        size //= 2
    return size


def check_chunk_size_fits(request: PlanRequest, chunk_size: int, k: int, inflight: list[int] | None = None) -> None:
    """UserError with the arithmetic when chunk_size and k overflow some stage's memory
    (`inflight`: chunks held per stage, when the pipelines are built already)."""
    rows = stage_memory_bytes(request, chunk_size, k, max(request.lengths), inflight)
    for stage, (states, kv, act) in enumerate(rows):
        if states + kv + act > request.cost.capacity_bytes:
            raise UserError(
                f"chunkflow chunk_size {chunk_size} with k={k} overflows stage {stage}: model states "
                f"{states / GIB:.1f} + K/V state {kv / GIB:.1f} + activations and working set {act / GIB:.1f} GiB > "
                f"{request.cost.capacity_bytes / GIB:.1f} GiB capacity: lower chunk_size or k, or raise --tp/--pp"
            )


# ---- the planner ----

def build_pipelines(request: PlanRequest, chunk_size: int, k: int) -> tuple[list[ChunkSet], list[PipelinePlan]]:
    """Placement and Algorithm 1 per pipeline, then each pipeline's schedule (steps 1-3)."""
    shares = place_sequences(request, chunk_size, k)
    chunk_sets = [construct_chunks(share, request.lengths, chunk_size) for share in shares]
    return chunk_sets, [build_pipeline(request, cs, k) for cs in chunk_sets]


def build_pipeline(request: PlanRequest, chunk_set: ChunkSet, k: int) -> PipelinePlan:
    """One pipeline's chunks, its long sequences' groups first, under state-aware 1F1B (§4.3)."""
    s = request.scheme
    chunks = [c for group in chunk_set.groups for c in group] + chunk_set.standalone
    return PipelinePlan(chunks=chunks, stages=make_schedule(SCHEDULE, chunks, s.pp, k=k),
                        tp=s.tp, cp=s.cp, schedule=SCHEDULE)


def build_plan(request: PlanRequest, chunk_size: int, k: int, started: float,
               built: tuple[list[ChunkSet], list[PipelinePlan]] | None = None) -> StepPlan:
    """Placement, Algorithm 1 per pipeline and state-aware 1F1B for one (ChunkSize, K)
    (`built`: `build_pipelines`' answer, when the caller has it)."""
    chunk_sets, pipelines = built or build_pipelines(request, chunk_size, k)
    plan = finish_plan(request, pipelines, planner="chunkflow", started=started,
                       options={"chunk_size": chunk_size, "k": k})
    plan.metrics.update(chunk_metrics(request, chunk_sets, chunk_size, k))
    plan.metrics[PLANNING_MS] = (time.perf_counter() - started) * 1e3
    return plan


def chunk_metrics(request: PlanRequest, chunk_sets: list[ChunkSet], chunk_size: int, k: int) -> dict:
    short_tokens = sum(n for n in request.lengths if n <= chunk_size)
    return {
        "chunk_size": chunk_size, "k": k,
        "dependent_groups": sum(len(cs.groups) for cs in chunk_sets),
        "dependent_chunks": sum(len(g) for cs in chunk_sets for g in cs.groups),
        "packed_chunks": sum(len(cs.standalone) for cs in chunk_sets),
        "packed_chunks_lower_bound": sum(cs.packed_lower_bound for cs in chunk_sets),
        "packed_chunks_global_lower_bound": -(-short_tokens // chunk_size),
        "predicted_pipeline_s": [
            sum(group_seconds(g, k, request) for g in cs.groups + [[c] for c in cs.standalone])
            for cs in chunk_sets],
    }
