"""Hydraulis' sequence packing within one pipeline (hydraulis §6.1 eq. 1, appendix C).

Given the U sequences a pipeline of scheme P received and a number of micro-batches V, eq. 1
packs them so that the slowest micro-batch is as fast as possible while no micro-batch exceeds
MaxLen(P) tokens; the pipeline then takes about

    (max_j T(micro-batch j) + ... ) x (PP(P) - 1 + V),   T(micro-batch) = sum of w(l_i) + c

(hydraulis/cost.py: c is paid once per micro-batch). V is enumerated over appendix C's range
[max(sum l / MaxLen, 1), min(sum l / UtilLen, U)]: fewer micro-batches raise the bubble share,
shorter ones under-use the GEMMs.

Eq. 1 is solved two ways and the better packing kept:
- greedy: for every V of the range, largest-w-first onto the least-loaded micro-batch with
  token room (LPT with a capacity) and Karmarkar-Karp differencing on w (kept when it respects
  MaxLen; much closer to balanced when few micro-batches hold many sequences), and also
  best-fit-decreasing packing to MaxLen (the fixed-length packing of §8.4's baseline) -- so the
  result is never worse than fixed-length packing;
- `milp_pack`: eq. 1 as a MILP (binary o_ij, continuous max load z, micro-batches ordered by
  load to break their symmetry) for scipy.optimize.milp (HiGHS) under a time limit.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from lengthwise.planners.packing_utils import best_fit_decreasing, karmarkar_karp

MAX_V_TRIED = 16
"""Micro-batch counts tried per pipeline; a wider appendix-C range is sampled evenly."""
KK_TRIES = 1
"""Micro-batch counts (LPT's best) at which Karmarkar-Karp is tried as well."""
KK_MIN_PER_BIN = 3
"""Karmarkar-Karp is tried for V micro-batches only with at least this many sequences per
micro-batch; with fewer it matches LPT on our batches and costs more."""
MILP_MIN_GAIN = 0.01
"""A MILP is solved for a V only if eq. 1's bound for that V leaves at least this relative gain."""
MILP_MAX_VARIABLES = 1500
"""Larger eq. 1 instances (U x V binaries) keep the greedy packing: HiGHS rarely improves
them within the time limit, and many small sequences leave LPT little to gain."""


@dataclass(frozen=True, kw_only=True)
class PipelineLoad:
    """What packing needs to know of one pipeline: its sequences and its scheme's costs."""

    seq_ids: tuple[int, ...]
    """Sequences dispatched to the pipeline."""
    lengths: np.ndarray
    """Their lengths, tokens."""
    work: np.ndarray
    """Their w(l), seconds on the slowest stage."""
    chunk_s: float
    """c: seconds per micro-batch."""
    depth: int
    """PP of the pipeline."""
    max_len: int
    """Most tokens per micro-batch."""
    util_len: int
    """UtilLen of the scheme (appendix C)."""


@dataclass(frozen=True, kw_only=True)
class Packing:
    """Micro-batches of one pipeline and eq. 1's latency for them."""

    bins: tuple[tuple[int, ...], ...]
    """Positions into PipelineLoad.seq_ids, one tuple per micro-batch, heaviest first."""
    estimate_s: float
    """(max_j T(micro-batch j)) x (PP - 1 + V), seconds; 0 for an empty pipeline."""
    method: str
    """"bfd" (fixed-length packing), "lpt" or "kk" (greedy eq. 1), or "milp"."""


def estimate(load: PipelineLoad, bins) -> float:
    """Eq. 1's objective for a packing."""
    return _estimate(load, load.work.tolist(), bins)


def _estimate(load: PipelineLoad, work: list[float], bins) -> float:
    bins = [b for b in bins if len(b)]
    if not bins:
        return 0.0
    heaviest = max(sum(work[i] for i in b) for b in bins)
    return (heaviest + load.chunk_s) * (load.depth - 1 + len(bins))


def _packing(load: PipelineLoad, bins, method: str) -> Packing:
    work = load.work.tolist()
    bins = sorted((tuple(b) for b in bins if len(b)), key=lambda b: (-sum(work[i] for i in b), b))
    return Packing(bins=tuple(bins), estimate_s=_estimate(load, work, bins), method=method)


def micro_batch_range(load: PipelineLoad) -> list[int]:
    """Appendix C's pruned V range (at most MAX_V_TRIED values, evenly spread)."""
    tokens, n = int(load.lengths.sum()), len(load.seq_ids)
    lo = max(1, math.ceil(tokens / load.max_len))
    hi = max(lo, min(tokens // max(load.util_len, 1), n))
    return list(_spread(lo, hi))


@functools.lru_cache(maxsize=4096)
def _spread(lo: int, hi: int) -> tuple[int, ...]:
    """At most MAX_V_TRIED counts from lo to hi, evenly spread (the pipelines of a batch share
    a few ranges: each is worked out once)."""
    return tuple(sorted({int(v) for v in np.linspace(lo, hi, min(hi - lo + 1, MAX_V_TRIED)).round()}))


def lpt_bins(load: PipelineLoad, v: int) -> list[list[int]] | None:
    """Largest w first onto the least-loaded of v micro-batches with token room; None if some
    sequence finds no room."""
    work, lengths = load.work.tolist(), load.lengths.tolist()
    order = sorted(range(len(work)), key=lambda i: (-work[i], -lengths[i], i))
    return _lpt(order, work, lengths, v, load.max_len)


def _lpt(order: list[int], work: list[float], lengths: list[int], v: int, cap: int) -> list[list[int]] | None:
    """Each sequence onto the least-busy bin (ties: lowest index) with room for it. Bins short
    of room for the current sequence wait in a heap by room and come back once a sequence fits
    them, so a full bin is not re-examined for every sequence (O(n log v), not O(n v))."""
    heap = [(0.0, j) for j in range(v)]
    parked: list[tuple[int, float, int]] = []   # (-room, busy, j)
    bins, room = [[] for _ in range(v)], [cap] * v
    for i in order:
        while parked and -parked[0][0] >= lengths[i]:
            _, busy, j = heapq.heappop(parked)
            heapq.heappush(heap, (busy, j))
        while heap and room[heap[0][1]] < lengths[i]:
            busy, j = heapq.heappop(heap)
            heapq.heappush(parked, (-room[j], busy, j))
        if not heap:
            return None
        busy, j = heapq.heappop(heap)
        bins[j].append(i)
        room[j] -= lengths[i]
        heapq.heappush(heap, (busy + work[i], j))
    return [b for b in bins if b]


def greedy_pack(load: PipelineLoad, *, kk: bool = True, first_lpt: tuple[float, int] | None = None) -> Packing:
    """Best of fixed-length packing (BFD to MaxLen), LPT over the pruned V range, and
    Karmarkar-Karp at the micro-batch count(s) where LPT did best. kk=False leaves out the
    Karmarkar-Karp step: the result then bounds the full one from above (which only replaces
    it when strictly better). `first_lpt`: LPT's estimate and micro-batches used at the count
    tried first (`lpt_first`'s, the same numbers), so that packing is redone only if it wins."""
    if not load.seq_ids:
        return Packing(bins=(), estimate_s=0.0, method="lpt")
    work, lengths = load.work.tolist(), load.lengths.tolist()
    ids = np.arange(len(work))
    # LPT's order (work, then length, descending; ties by position) and BFD's (length
    # descending, ties by position), as sorted() on those keys gives them
    order = np.lexsort((ids, -load.lengths, -load.work)).tolist()
    by_length = np.lexsort((ids, -load.lengths)).tolist()
    # Entries are keyed by their place in the textbook order (BFD, LPT for each V ascending,
    # then KK): among equal estimates the earliest wins, whatever order they are computed in.
    tried = {0: ("bfd", best_fit_decreasing(lengths, load.max_len, order=by_length))}
    estimates = {0: _estimate(load, work, tried[0][1])}
    counts = micro_batch_range(load)
    floor = _estimate_floor(load, max(counts))
    # LPT at v bins cannot beat floor[v - 1]: counts are tried from the lowest floor up and
    # skipped once their floor is above the best estimate found, which leaves the choice as
    # trying them all would
    for n, (v, pos) in enumerate(sorted(((v, pos) for pos, v in enumerate(counts, start=1)),
                                        key=lambda vp: floor[vp[0] - 1])):
        if floor[v - 1] > min(estimates.values()) * (1 + 1e-9):
            break
        if n == 0 and first_lpt is not None:  # known: its bins (None) only if it is chosen
            if np.isfinite(first_lpt[0]):
                tried[pos], estimates[pos] = ("lpt", None), first_lpt[0]
            continue
        bins = _lpt(order, work, lengths, v, load.max_len)
        if bins is not None:
            tried[pos], estimates[pos] = ("lpt", bins), _estimate(load, work, bins)
    first_kk = len(counts) + 1
    for _, k in sorted((e, k) for k, e in estimates.items())[:KK_TRIES if kk else 0]:
        v = first_lpt[1] if tried[k][1] is None else len(tried[k][1])
        if len(work) >= KK_MIN_PER_BIN * v:
            bins = _within(karmarkar_karp(work, v), lengths, load.max_len)
            if bins is not None:
                tried[first_kk], estimates[first_kk] = ("kk", bins), _estimate(load, work, bins)
            first_kk += 1
    # Each packing's estimate once (it sums every sequence's work); the first of equal ones wins.
    best = min(estimates, key=lambda k: (estimates[k], k))
    method, bins = tried[best]
    if bins is None:
        bins = _lpt(order, work, lengths, counts[best - 1], load.max_len)
    return _packing(load, bins, method)


def _estimate_floor(load: PipelineLoad, top: int) -> np.ndarray:
    """[v - 1]: a lower bound on eq. 1 for LPT's packing into v micro-batches, v = 1..top. With
    at least v sequences LPT leaves no micro-batch empty (the first v sequences each find an
    empty one: it is the least busy and has room for any sequence), and the heaviest of v holds
    at least max(total / v, largest w); so the estimate is at least (that + c) (depth - 1 + v).
    With fewer sequences than v only b <= n bins fill: the minimum over b <= v is taken there."""
    b = np.arange(1, top + 1, dtype=np.float64)
    total, largest = float(load.work.sum()), float(load.work.max())
    floor = (np.maximum(total / b, largest) + load.chunk_s) * (load.depth - 1 + b)
    n = len(load.seq_ids)
    if top > n:
        floor[n:] = np.minimum.accumulate(floor)[n:]
    return floor


def lpt_bounds(loads: list[PipelineLoad]) -> np.ndarray:
    """`lpt_first`'s estimates."""
    return lpt_first(loads)[0]


def lpt_first(loads: list[PipelineLoad]) -> tuple[np.ndarray, np.ndarray]:
    """An upper bound on `greedy_pack(load).estimate_s` for every load, all loads at once: LPT's
    estimate at the micro-batch count of the range with the lowest floor (the count greedy_pack
    tries first; its LPT packing is one of those greedy_pack takes the best of), inf where LPT
    finds no room. One numpy step per sequence of the largest load, over the loads that still
    have a sequence to place (the loads sorted by size, so a leading slice), with the
    arithmetic of `_lpt` and `_estimate` (so a bound equal to the greedy estimate is equal to it
    bit for bit); and the micro-batches that packing uses (greedy_pack's `first_lpt`)."""
    out, used_bins = np.zeros(len(loads)), np.zeros(len(loads), dtype=np.int64)
    busy_loads = sorted((j for j, load in enumerate(loads) if load.seq_ids), key=lambda j: -len(loads[j].seq_ids))
    if not busy_loads:
        return out, used_bins
    counts = []
    for j in busy_loads:
        vs = micro_batch_range(loads[j])
        floor = _estimate_floor(loads[j], max(vs))
        counts.append(min(vs, key=lambda v: floor[v - 1]))  # the first of equal floors, as sorted() keeps
    p, width = len(busy_loads), max(counts)
    sizes = np.asarray([len(loads[j].seq_ids) for j in busy_loads])
    # [step, pipeline], each pipeline's sequences in greedy_pack's order
    work = np.zeros((sizes[0], p))
    tokens = np.zeros((sizes[0], p), dtype=np.int64)
    for r, j in enumerate(busy_loads):
        load = loads[j]
        order = np.lexsort((np.arange(sizes[r]), -load.lengths, -load.work))
        work[:sizes[r], r], tokens[:sizes[r], r] = load.work[order], load.lengths[order]
    cap = np.asarray([loads[j].max_len for j in busy_loads], dtype=np.int64)
    busy = np.where(np.arange(width) < np.asarray(counts)[:, None], 0.0, np.inf)
    room = np.repeat(cap[:, None], width, axis=1)
    live = np.searchsorted(-sizes, -np.arange(sizes[0]), side="left")  # loads with a sequence at step t
    rows = np.arange(p)
    for t, n in enumerate(live.tolist()):
        # least busy with room, lowest index on ties; with no room anywhere bin 0's room goes
        # negative, which marks the pipeline as one LPT cannot pack
        b, left = busy[:n], room[:n]
        pick = np.where(left >= tokens[t, :n, None], b, np.inf).argmin(axis=1)
        b[rows[:n], pick] += work[t, :n]
        left[rows[:n], pick] -= tokens[t, :n]
    used = room < cap[:, None]
    heaviest = np.where(used, busy, -np.inf).max(axis=1)
    chunk = np.asarray([loads[j].chunk_s for j in busy_loads])
    depth = np.asarray([loads[j].depth for j in busy_loads], dtype=np.float64)
    est = (heaviest + chunk) * (depth - 1 + used.sum(axis=1))
    fits = (room >= 0).all(axis=1)
    out[busy_loads] = np.where(fits, est, np.inf)
    used_bins[busy_loads] = used.sum(axis=1)
    return out, used_bins


def _within(bins: list[list[int]], lengths: list[int], cap: int) -> list[list[int]] | None:
    """The bins if every one holds at most `cap` tokens, else None."""
    return bins if all(sum(lengths[i] for i in b) <= cap for b in bins) else None


def milp_bins(load: PipelineLoad, v: int, *, time_limit_s: float, node_limit: int) -> list[list[int]] | None:
    """Eq. 1 for a fixed V as a MILP (HiGHS); None when no feasible packing was found within
    the limits. The node limit keeps results deterministic; the time limit is a safety net
    (a solve it cuts short may differ between runs)."""
    n = len(load.seq_ids)
    w = load.work / (float(load.work.max()) or 1.0)  # seconds rescaled to O(1) for the solver
    objective = np.zeros(n * v + 1)
    objective[-1] = 1.0  # minimise z, the heaviest micro-batch
    z_floor = max(float(w.max()), float(w.sum()) / v)
    bounds = Bounds(np.r_[np.zeros(n * v), z_floor], np.r_[np.ones(n * v), np.inf])
    res = milp(objective, integrality=np.r_[np.ones(n * v), 0], bounds=bounds,
               constraints=_constraints(w, load.lengths, load.max_len, n, v),
               options={"time_limit": time_limit_s, "node_limit": node_limit, "disp": False})
    if res.x is None:
        return None
    pick = res.x[:-1].reshape(n, v).argmax(axis=1)
    bins = [[i for i in range(n) if pick[i] == j] for j in range(v)]
    if any(load.lengths[b].sum() > load.max_len for b in bins):
        return None
    return [b for b in bins if b]


def _constraints(w: np.ndarray, lengths: np.ndarray, cap: int, n: int, v: int) -> LinearConstraint:
    """Eq. 1's constraints over x = (o_00 .. o_{n-1,v-1}, z)."""
    o, z, inf = np.arange(n * v).reshape(n, v), n * v, np.inf
    rows = [(o[i], np.ones(v), 1.0, 1.0) for i in range(n)]  # each sequence in one micro-batch
    rows += [(np.r_[o[:, j], z], np.r_[w, -1.0], -inf, 0.0) for j in range(v)]  # load_j <= z
    rows += [(o[:, j], lengths.astype(float), -inf, float(cap)) for j in range(v)]  # tokens_j <= MaxLen
    # Loads non-increasing in j: any packing can be relabelled so; breaks the V! symmetry.
    rows += [(np.r_[o[:, j], o[:, j + 1]], np.r_[w, -w], 0.0, inf) for j in range(v - 1)]
    r = np.concatenate([np.full(len(cols), k) for k, (cols, _, _, _) in enumerate(rows)])
    c = np.concatenate([cols for cols, _, _, _ in rows])
    vals = np.concatenate([coef for _, coef, _, _ in rows])
    a = coo_matrix((vals, (r, c)), shape=(len(rows), n * v + 1)).tocsr()
    return LinearConstraint(a, [row[2] for row in rows], [row[3] for row in rows])


def milp_pack(load: PipelineLoad, incumbent: Packing, *, solves: int, time_limit_s: float,
              node_limit: int) -> tuple[Packing, int]:
    """Eq. 1 by MILP for each V of the range that could beat `incumbent` (at most `solves`
    solves); returns the better packing and the solves used."""
    best, used = incumbent, 0
    n = len(load.seq_ids)
    for v in micro_batch_range(load):
        floor = (max(float(load.work.max()), float(load.work.sum()) / v) + load.chunk_s) * (load.depth - 1 + v)
        if n * v > MILP_MAX_VARIABLES or floor >= best.estimate_s * (1 - MILP_MIN_GAIN) or v > n:
            continue
        if used == solves:
            break
        used += 1
        bins = milp_bins(load, v, time_limit_s=time_limit_s, node_limit=node_limit)
        if bins is not None:
            cand = _packing(load, bins, "milp")
            best = cand if cand.estimate_s < best.estimate_s * (1 - 1e-9) else best
    return best, used
