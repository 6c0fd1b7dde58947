"""InfiniPipe's sequence processor: workload-balanced chunking (infinipipe.txt §3.2, Algorithm 1).

    fit = SliceCost.from_cost(cost, layers=8, tp=8)      # backward seconds = a*keys + b*tokens + c
    batch = balanced_chunking(lengths, num_slices=4, fit=fit)
    batch.units       # one unit per split sequence (its split chunks + its hybrid chunk), one per batched chunk

Steps, each a function below:

1. `balanced_mesh` (line 1, `M.split`): the longest sequence is cut into N slices of equal
   backward time. The cumulative backward work of tokens [0, x) is G(x) = a*x(x+1)/2 + b*x
   (infinipipe eq. 1: quadratic attention plus linear GEMMs), so boundary i is the root of the
   quadratic G(x) = i/N * G(longest); no token-by-token search. Every slice then costs
   G(longest)/N + c seconds: the time threshold T_t. The first slice has the most tokens (the
   later ones attend to more context): the token threshold T_m.
2. `split_by_mesh` (line 2): every sequence longer than the first boundary is cut at the
   boundaries below its length into *split chunks* plus a variable-length *tail slice*; a mesh
   {8K, 4K, 2K} cuts a 13K sequence into [0:8K], [8K:12K] and the tail [12K:13K].
3. `pack_buckets` (lines 3-16): buckets are seeded with one tail slice each; short sequences,
   longest-time first, go into the bucket with the lowest seconds per token (the share of
   long-sequence work in it) that stays under both thresholds. When none does, T_t is raised to
   the least value that admits one (line 16's perturbation), so buckets stay balanced in length
   as well as time (infinipipe Table 2). A bucket holds at most one tail slice.
4. `make_units` (line 17): a bucket with a tail slice becomes a *hybrid chunk* (tail first),
   the others *batched chunks*.

`even_chunking` is the "w/o wbc" ablation (§5.5): sequences are cut into equal-token slices
and short sequences packed by tokens only (no time threshold).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from lengthwise.cost.flops import causal_keys
from lengthwise.plan.ir import Chunk, Segment


@dataclass(frozen=True, kw_only=True)
class SliceCost:
    """Backward seconds of a chunk on one stage: a * attention pairs + b * tokens + c (eq. 1)."""

    a: float
    """Seconds per causal (query, key) pair."""
    b: float
    """Seconds per token (GEMMs)."""
    c: float
    """Seconds per chunk (fixed overheads, eq. 1's beta_1 / d_p)."""

    @classmethod
    def from_cost(cls, cost, *, layers: int, tp: int = 1, cp: int = 1) -> SliceCost:
        """Read (a, b, c) off the cost model with three probe chunks (it is exactly of this
        form: attention is linear in pairs, GEMM time linear in tokens plus a constant)."""
        probes = [(0, 1), (0, 4096), (1 << 20, (1 << 20) + 4096)]
        rows = [[causal_keys(s, e), e - s, 1.0] for s, e in probes]
        times = [cost.backward_time(Chunk((Segment(0, s, e),)), layers=layers, tp=tp, cp=cp)
                 for s, e in probes]
        a, b, c = np.linalg.solve(np.array(rows, float), np.array(times, float))
        return cls(a=max(float(a), 0.0), b=max(float(b), 0.0), c=max(float(c), 0.0))

    def work(self, start: int, stop: int) -> float:
        """Seconds of a segment without the per-chunk constant."""
        return self.a * causal_keys(start, stop) + self.b * (stop - start)

    def cumulative(self, x: float) -> float:
        """G(x): work of tokens [0, x)."""
        return self.a * x * (x + 1) / 2 + self.b * x

    def inverse_cumulative(self, target: float) -> float:
        """The x >= 0 with G(x) = target (positive root of a quadratic)."""
        qa, qb = self.a / 2, self.a / 2 + self.b
        if qa == 0:
            return target / qb
        return (-qb + math.sqrt(qb * qb + 4 * qa * target)) / (2 * qa)


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """Slice boundaries of the longest sequence and the thresholds they imply (line 1)."""

    bounds: tuple[int, ...]
    """0 = x_0 < x_1 < ... < x_N = longest, tokens."""
    time_threshold: float
    """T_t: backward seconds of one slice of the longest sequence."""
    token_threshold: int
    """T_m: tokens of its first (largest) slice."""


def balanced_mesh(longest: int, num_slices: int, fit: SliceCost) -> Mesh | None:
    """N slices of equal backward time (line 1); None when N exceeds what the tokens allow."""
    total = fit.cumulative(longest)
    bounds = [0] + [round(fit.inverse_cumulative(total * i / num_slices)) for i in range(1, num_slices)]
    bounds.append(longest)
    if any(x >= y for x, y in pairwise(bounds)):
        return None
    slice_time = max(fit.work(x, y) for x, y in pairwise(bounds)) + fit.c
    return Mesh(bounds=tuple(bounds), time_threshold=slice_time, token_threshold=bounds[1])


def even_mesh(longest: int, num_slices: int, fit: SliceCost) -> Mesh | None:
    """The ablation's mesh: N slices of equal tokens; T_t unbounded (token-only packing)."""
    size = -(-longest // num_slices)
    bounds = list(range(0, longest, size)) + [longest]
    if size < 1 or len(bounds) - 1 != num_slices:
        return None
    return Mesh(bounds=tuple(bounds), time_threshold=math.inf, token_threshold=size)


def split_by_mesh(lengths: list[int], mesh: Mesh) -> tuple[dict[int, list[Segment]], list[int]]:
    """Line 2: seq_id -> its slices (the last is the tail slice) for long sequences, and the
    ids of short sequences (not longer than the first boundary)."""
    inner = list(mesh.bounds[1:-1])   # ascending: the cuts below n are a prefix
    sizes = np.asarray(lengths, dtype=np.int64)
    # how many inner boundaries lie below each length (bisect_left), none at or below the first
    cut = np.where(sizes > mesh.bounds[1], np.searchsorted(np.asarray(inner, dtype=np.int64), sizes, side="left"), 0)
    split = {}
    for seq_id, k, n in zip(*(x.tolist() for x in (np.flatnonzero(cut), cut[cut > 0], sizes[cut > 0]))):
        edges = [0] + inner[:k] + [n]
        split[seq_id] = [Segment(seq_id, s, e) for s, e in pairwise(edges)]
    return split, np.flatnonzero(cut == 0).tolist()


@dataclass(kw_only=True)
class Bucket:
    """A chunk being packed: at most one tail slice, then short sequences."""

    segments: list[Segment]
    """The tail slice (if any) first, then whole short sequences."""
    time: float
    """Predicted backward seconds on one stage."""
    tokens: int
    """Tokens of all its segments."""
    order: int
    """Creation index (ties)."""

    @property
    def has_tail(self) -> bool:
        return self.segments[0].start > 0

    def add(self, seg: Segment, seconds: float) -> None:
        self.segments.append(seg)
        self.time += seconds
        self.tokens += seg.num_tokens


def pack_buckets(tails: list[Segment], short: list[int], lengths: list[int], mesh: Mesh,
                 fit: SliceCost, whole: list[Segment] | None = None) -> tuple[list[Bucket], float]:
    """Lines 3-16: best fit of short sequences (longest time first) into tail-seeded buckets.
    Returns the buckets and T_t after line 16's perturbations. `whole`: Segment(i, 0,
    lengths[i]) for every i, made once for every N the search tries (segments are immutable).

    Line 9 picks, among buckets with room for the sequence's tokens (T_m) and time (T_t), the
    lowest time per token. Sequences come longest first, so the room a bucket needs only
    shrinks (and T_t only rises): a bucket that admits one sequence admits every later one until
    it is picked. So every bucket is in exactly one place: `admitting` (room in tokens and time
    for the current sequence, sorted by line 9's key: time per token, then creation order),
    `need_tokens` (a heap by tokens) or `need_time` (room in tokens, a heap by time). A bucket
    changes only when it is picked, so heap entries never go stale, and each sequence costs
    O(log buckets) instead of a scan of every bucket; the buckets are the same.
    """
    buckets = [Bucket(segments=[t], time=fit.work(t.start, t.stop) + fit.c, tokens=t.num_tokens, order=i)
               for i, t in enumerate(tails)]
    need_tokens = [(b.tokens, b.order, b) for b in buckets]
    heapq.heapify(need_tokens)
    need_time: list[tuple[float, int, Bucket]] = []
    admitting: list[tuple[float, int, Bucket]] = []   # (time / tokens, order, bucket), sorted
    threshold = mesh.time_threshold
    ids = np.asarray(short, dtype=np.int64)
    sizes = np.asarray(lengths, dtype=np.int64)[ids]
    order = np.lexsort((ids, -sizes))            # longest first (time grows with length), then by id
    ids, sizes = ids[order].tolist(), sizes[order]
    # fit.work(0, n) for every n at once: the same float operations on the same integers
    times = (fit.a * (sizes * (sizes + 1) // 2) + fit.b * sizes).tolist()
    push, pop, insort, c, room = heapq.heappush, heapq.heappop, bisect.insort, fit.c, mesh.token_threshold
    sizes = sizes.tolist()
    nexts = list(zip(sizes[1:], times[1:])) + [(None, None)]

    for seq_id, n, seconds, (n_next, s_next) in zip(ids, sizes, times, nexts):
        seg = whole[seq_id] if whole is not None else Segment(seq_id, 0, n)
        while need_tokens and need_tokens[0][0] <= room - n:     # now room in tokens
            b = pop(need_tokens)[2]
            push(need_time, (b.time, b.order, b))
        while need_time and need_time[0][0] + seconds <= threshold:   # and in time
            b = pop(need_time)[2]
            insort(admitting, (b.time / b.tokens, b.order, b))   # orders differ: buckets never compared
        if not admitting and not need_time:     # line 7: not even the emptiest bucket has room
            b = Bucket(segments=[seg], time=seconds + c, tokens=n, order=len(buckets))
            buckets.append(b)
        else:
            if not admitting:   # line 16: raise T_t to the least value that admits a bucket
                threshold = need_time[0][0] + seconds
                while need_time and need_time[0][0] + seconds <= threshold:
                    b = pop(need_time)[2]
                    insort(admitting, (b.time / b.tokens, b.order, b))
            b = admitting.pop(0)[2]     # line 9
            b.segments.append(seg)
            b.time += seconds
            b.tokens += n
        # where the next sequence's admission would move the changed bucket (straight there,
        # skipping the heaps it would pass through)
        if n_next is None or b.tokens > room - n_next:
            push(need_tokens, (b.tokens, b.order, b))
        elif b.time + s_next > threshold:
            push(need_time, (b.time, b.order, b))
        else:
            insort(admitting, (b.time / b.tokens, b.order, b))
    return buckets, threshold


@dataclass(kw_only=True)
class Unit:
    """Chunks that must share one 1F1B pipeline: a split sequence (its split chunks, then its
    hybrid chunk), or one batched chunk."""

    chunks: list[Chunk]
    """In forward order; a split sequence's slices in token order."""
    seq_id: int = -1
    """The split sequence, or -1 for a batched chunk."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


@dataclass(kw_only=True)
class ChunkedBatch:
    """What the sequence processor hands the chunk scheduler."""

    units: list[Unit]
    """Split sequences longest first, then batched chunks."""
    mesh: Mesh
    """The slice boundaries of the longest sequence (line 1)."""
    num_slices: int
    """N."""
    time_threshold: float
    """T_t after line 16's perturbations, seconds."""
    stats: dict = field(default_factory=dict)
    """Counts for the plan's metrics."""


def make_units(split: dict[int, list[Segment]], buckets: list[Bucket]) -> list[Unit]:
    """Line 17: hybrid chunks close their sequence's unit; batched chunks are units of their own."""
    tails = [b.has_tail for b in buckets]
    hybrid = {b.segments[0].seq_id: b for b, tail in zip(buckets, tails) if tail}
    units = []
    for seq_id in sorted(split, key=lambda i: (-split[i][-1].stop, i)):
        chunks = [Chunk((seg,)) for seg in split[seq_id][:-1]]
        chunks.append(Chunk(tuple(hybrid[seq_id].segments)))
        units.append(Unit(chunks=chunks, seq_id=seq_id))
    units += [Unit(chunks=[Chunk(tuple(b.segments))]) for b, tail in zip(buckets, tails) if not tail]
    return units


def balanced_chunking(lengths: list[int], num_slices: int, fit: SliceCost, *, balanced: bool = True,
                      whole: list[Segment] | None = None) -> ChunkedBatch | None:
    """Algorithm 1 for one slice number N (balanced=False: the even-split ablation); `whole` as
    in `pack_buckets`."""
    mesh = (balanced_mesh if balanced else even_mesh)(max(lengths), num_slices, fit)
    if mesh is None:
        return None
    split, short = split_by_mesh(lengths, mesh)
    tails = [split[i][-1] for i in sorted(split)]
    buckets, threshold = pack_buckets(tails, short, lengths, mesh, fit, whole)
    units = make_units(split, buckets)
    return ChunkedBatch(units=units, mesh=mesh, num_slices=num_slices, time_threshold=threshold,
                        stats={"split_sequences": len(split), "chunks": sum(u.num_chunks for u in units)})
