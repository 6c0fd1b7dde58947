"""Hydraulis' data distribution-aware strategy proposal (hydraulis §7, eq. 4).

A heterogeneous strategy S = sum_k d_k x P_k runs d_k pipelines of scheme P_k (§5.1). The proposal
finds, for every maximum length L, the strategy S*[N][L] that minimises the latency of training
the sequences of length <= L on N GPUs, when each pipeline serves one length interval; the
candidate set is the union over L, each rounded to whole pipelines.

Eq. 4 is a dynamic programme t[n][l] over GPUs n and lengths l. We solve the same recurrence in
its dual form, which needs no grid over n (that grid would be N / 0.1 wide):

    g_tau[m] = min over scheme k (MaxLen(P_k) >= the interval's longest), m' < m of
               g_tau[m'] + N(P_k) * d,   d = ceil_0.1( C_k(m', m] / (tau - T(top, P_k) (PP_k - 1)) )

is the fewest GPUs that finish all data of length bins (0, m] within latency tau, and
t[N][L] = min{tau : g_tau[L] <= N} is found by bisection (feasibility is monotone in tau).
C_k(m', m] is the summed cost of the interval's sequences on P_k (prefix sums over bins) and
d is kept continuous in steps of `pipeline_step` (§7's continuous relaxation, step 0.1).

Two terms of eq. 2 enter the interval latency where §7 has only C / d, because a sequence
cannot be split over pipelines and a deep pipeline fills and drains: the interval's longest
sequence adds T(top, P_k) (PP_k - 1), and latency tau is feasible only if that sequence alone
fits, T(top, P_k) PP_k <= tau. Without them (tau large against single sequences, PP = 1) the
recurrence is exactly §7's. The exchange between optimization and propagation (§5.2) is not
part of tau; the planner runs this proposal once per cap on it (hydraulis.py).

Length bins follow the paper's 128-token step up to 1280 tokens and grow by 10% above (the
paper's uniform step would give 256 bins at 32K and 1024 at 128K); every scheme's MaxLen is a bin
edge, so "MaxLen(P_k) >= l" is exact.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from lengthwise.planners.hydraulis.cost import Scheme

GRID_RATIO = 1.1
"""Relative width of length bins above 10 steps (see the module docstring)."""
BISECTION_STEPS = 8
"""Geometric bisection steps on tau: the bracket [tau, 2 tau] shrinks to 2^(1/256), 0.3%."""


@dataclass(frozen=True)
class Strategy:
    """S = sum_k d_k x P_k: how many pipelines of each scheme (hydraulis §5.1)."""

    parts: tuple[tuple[Scheme, int], ...]
    """(scheme, pipelines) pairs with pipelines >= 1, widest MaxLen first."""

    @classmethod
    def of(cls, counts: dict[Scheme, int]) -> Strategy:
        parts = [(s, n) for s, n in counts.items() if n > 0]
        return cls(tuple(sorted(parts, key=lambda p: (-p[0].max_len, p[0].num_gpus, p[0].pp, p[0].tp))))

    @property
    def num_gpus(self) -> int:
        return sum(s.num_gpus * n for s, n in self.parts)

    @property
    def num_pipelines(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def max_len(self) -> int:
        return max(s.max_len for s, _ in self.parts)

    def __str__(self) -> str:
        return " + ".join(f"{n}x{s}" for s, n in self.parts)


@dataclass(frozen=True, kw_only=True)
class Histogram:
    """Sequences to propose for: unique lengths and how many of each (hashable, for caching)."""

    lengths: tuple[int, ...]
    """Distinct sequence lengths, ascending (tokens)."""
    counts: tuple[float, ...]
    """How many sequences have each length (a weight; profile samples are rescaled)."""

    @classmethod
    def of(cls, lengths) -> Histogram:
        values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
        return cls(lengths=tuple(int(v) for v in values), counts=tuple(float(c) for c in counts))

    @property
    def num_tokens(self) -> float:
        return float(np.dot(self.lengths, self.counts))


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """S*[N][L] of §7 before rounding."""

    max_len: int
    """L: the longest sequence the proposal is for (tokens)."""
    latency_s: float
    """t[N][L]: the DP's latency (seconds)."""
    pipelines: tuple[tuple[Scheme, float], ...]
    """Continuous pipelines per scheme (the relaxation's non-integer d)."""


def length_edges(max_len: int, step: int, extra: list[int]) -> np.ndarray:
    """Bin edges e_0 = 0 < e_1 < ... < e_M = max_len (see the module docstring)."""
    edges, e = [0], step
    while e < max_len:
        edges.append(e)
        e = max(e + step, math.ceil(e * GRID_RATIO / step) * step)
    edges += [x for x in extra if 0 < x < max_len] + [max_len]
    return np.unique(np.asarray(edges, dtype=np.int64))


@dataclass(frozen=True)
class _Tables:
    """Per-bin data the recurrence reads; k indexes schemes, m bins 1..M (0 is empty)."""

    prefix: np.ndarray  # [K, M+1] cumulative cost of bins <= m on scheme k, seconds
    tokens: np.ndarray  # [M+1] cumulative tokens of bins <= m
    filled: np.ndarray  # [M+1] bin m holds a sequence
    ok: np.ndarray  # [K, M+1] MaxLen(P_k) >= the longest sequence of bin m
    top: np.ndarray  # [K, M+1] T(longest of bin m, P_k): a lone micro-batch, seconds
    gpus: np.ndarray  # [K] N(P_k)
    depth: np.ndarray  # [K] PP(P_k)


def _tables(schemes, hist: Histogram, edges: np.ndarray) -> _Tables:
    lengths, counts = np.asarray(hist.lengths), np.asarray(hist.counts)
    bins = np.searchsorted(edges, lengths, side="left")
    size = len(edges)
    cost = np.stack([np.bincount(bins, counts * s.dp_time(lengths), minlength=size) for s in schemes])
    longest = np.zeros(size, dtype=np.int64)
    np.maximum.at(longest, bins, lengths)
    top = np.stack([np.where(longest > 0, s.seq_time(longest) + s.chunk_s, 0.0) for s in schemes])
    return _Tables(prefix=np.cumsum(cost, axis=1), tokens=np.cumsum(np.bincount(bins, counts * lengths,
                                                                               minlength=size)),
                   filled=longest > 0, ok=np.array([[s.max_len >= x for x in longest] for s in schemes]),
                   top=top, gpus=np.array([s.num_gpus for s in schemes], dtype=np.float64),
                   depth=np.array([s.pp for s in schemes], dtype=np.float64))


@dataclass(frozen=True)
class _Problems:
    """Q instances of Problem 1 solved side by side: a longest length and a scheme subset each."""

    last: np.ndarray  # [Q] bin of the target L
    scale: np.ndarray  # [Q] batch tokens over the tokens of bins <= last
    allowed: np.ndarray  # [Q, K] schemes the problem may use


def _dual_pass(t: _Tables, pr: _Problems, tau: np.ndarray, step: float):
    """g_tau[m] for every problem at once (problem q stops at bin last[q]); returns g and the
    choice (scheme k, interval start m') per bin, k = -1 meaning "bin empty, carry"."""
    q_n, size = len(tau), int(pr.last.max()) + 1
    g = np.full((q_n, size), np.inf)
    g[:, 0] = 0.0
    pick_k = np.full((q_n, size), -1, dtype=np.int64)
    pick_m = np.zeros((q_n, size), dtype=np.int64)
    for m in range(1, size):
        if not t.filled[m]:
            g[:, m], pick_m[:, m] = g[:, m - 1], m - 1
            continue
        _relax_bin(t, pr, m, g, pick_k, pick_m, tau, step)
    return g, pick_k, pick_m


def _relax_bin(t: _Tables, pr: _Problems, m: int, g, pick_k, pick_m, tau, step) -> None:
    """One step of the recurrence: the last interval (m', m] on some scheme k."""
    span = t.prefix[:, m:m + 1] - t.prefix[:, :m]  # [K, m] cost of (m', m]
    room = tau[:, None] - t.top[None, :, m] * (t.depth - 1)  # [Q, K]
    fits = pr.allowed & t.ok[None, :, m] & (tau[:, None] >= t.top[None, :, m] * t.depth)
    need = pr.scale[:, None, None] * span[None] / np.where(fits, room, 1.0)[:, :, None]
    pipes = np.ceil(need / step - 1e-9) * step
    total = g[:, None, :m] + t.gpus[None, :, None] * pipes
    total = np.where(fits[:, :, None], total, np.inf).reshape(len(tau), -1)
    best = total.argmin(axis=1)
    g[:, m] = total[np.arange(len(tau)), best]
    pick_k[:, m], pick_m[:, m] = np.divmod(best, m)


def _bracket(t: _Tables, pr: _Problems, num_gpus: int) -> np.ndarray:
    """A lower bound on t[N][L] per problem: GPU-seconds over N, or the longest sequence alone
    (inf when the problem's schemes cannot hold some sequence)."""
    usable = pr.allowed[:, :, None] & t.ok[None]  # [Q, K, M+1]
    per_bin = np.diff(t.prefix, axis=1, prepend=0.0) * t.gpus[:, None]
    gpu_s = np.cumsum(np.where(usable, per_bin[None], np.inf).min(axis=1), axis=1)
    alone = np.maximum.accumulate(np.where(usable, (t.top * t.depth[:, None])[None], np.inf).min(axis=1), axis=1)
    rows = np.arange(len(pr.last))
    return np.maximum(gpu_s[rows, pr.last] * pr.scale / num_gpus, alone[rows, pr.last])


def _solve(t: _Tables, pr: _Problems, num_gpus: int, step: float):
    """Geometric bisection on tau per problem; returns the feasible tau and its choices."""
    lo = _bracket(t, pr, num_gpus)
    assert np.isfinite(lo).all(), "a problem whose schemes cannot hold its sequences"
    hi = lo * 2
    rows = np.arange(len(lo))
    feasible = lambda tau: _dual_pass(t, pr, tau, step)[0][rows, pr.last] <= num_gpus + 1e-9
    ok = feasible(hi)
    while not ok.all():
        lo, hi = np.where(ok, lo, hi), np.where(ok, hi, hi * 2)
        ok = feasible(hi)
    for _ in range(BISECTION_STEPS):
        mid = np.sqrt(lo * hi)
        ok = feasible(mid)
        lo, hi = np.where(ok, lo, mid), np.where(ok, mid, hi)
    return hi, _dual_pass(t, pr, hi, step)


def _backtrack(t: _Tables, q: int, m: int, tau: float, scale: float, step: float,
               pick_k, pick_m) -> dict[int, float]:
    """Continuous pipelines per scheme index along problem q's optimal intervals."""
    pipes: dict[int, float] = {}
    while m > 0:
        k, start = int(pick_k[q, m]), int(pick_m[q, m])
        if k >= 0:
            room = tau - t.top[k, m] * (t.depth[k] - 1)
            need = scale * (t.prefix[k, m] - t.prefix[k, start]) / room
            pipes[k] = pipes.get(k, 0.0) + math.ceil(need / step - 1e-9) * step
        m = start
    return pipes


@functools.lru_cache(maxsize=16)
def propose(schemes: tuple[Scheme, ...], hist: Histogram, num_gpus: int, targets: tuple[int, ...],
            batch_tokens: float, length_step: int, pipeline_step: float,
            subsets: tuple[tuple[bool, ...], ...]) -> tuple[Proposal, ...]:
    """S*[N][L] for every L in `targets` (§7, Problem 1) and every scheme subset (a mask over
    `schemes`), for batches of `batch_tokens` tokens drawn from `hist` below L. Pairs whose
    subset cannot hold L are skipped. Cached: a dataset profile is proposed for once."""
    edges = length_edges(max(max(targets), hist.lengths[-1]), length_step,
                         [s.max_len for s in schemes] + list(targets))
    t = _tables(schemes, hist, edges)
    pairs = [(mask, L) for mask in subsets for L in targets]
    last = np.searchsorted(edges, np.asarray([L for _, L in pairs]), side="left")
    pr = _Problems(last=last, scale=batch_tokens / np.maximum(t.tokens[last], 1.0),
                   allowed=np.asarray([mask for mask, _ in pairs], dtype=bool).reshape(len(pairs), len(schemes)))
    keep = np.isfinite(_bracket(t, pr, num_gpus))
    if not keep.any():
        return ()
    pr = _Problems(last=pr.last[keep], scale=pr.scale[keep], allowed=pr.allowed[keep])
    pairs = [p for p, k in zip(pairs, keep) if k]
    tau, (_, pick_k, pick_m) = _solve(t, pr, num_gpus, pipeline_step)
    out = []
    for q, (_, target) in enumerate(pairs):
        pipes = _backtrack(t, q, int(pr.last[q]), float(tau[q]), float(pr.scale[q]), pipeline_step, pick_k, pick_m)
        out.append(Proposal(max_len=int(target), latency_s=float(tau[q]),
                            pipelines=tuple((schemes[k], d) for k, d in sorted(pipes.items()))))
    return tuple(out)


def round_proposal(prop: Proposal, space: tuple[Scheme, ...], num_gpus: int) -> list[Strategy]:
    """§7's "nearby integer solutions" of a proposal within N GPUs: each d floored or ceiled,
    kept when the total fits and some scheme still holds the proposal's longest sequence; when
    none is kept (a holding scheme's ceiling pushes the total past N: tp8 x 0.7 beside tp1 x 9.2
    on 16 GPUs), the closest whole strategy that fits and holds (`_closest`). Leftover GPUs get
    more pipelines (`_fill`, §7's "adjust"). Empty only when no holding scheme fits N GPUs."""
    options = [sorted({math.floor(d + 1e-9), math.ceil(d - 1e-9)}) for _, d in prop.pipelines]
    nearby = []
    for counts in itertools.islice(itertools.product(*options), 256):
        chosen = {s: n for (s, _), n in zip(prop.pipelines, counts) if n > 0}
        if sum(s.num_gpus * n for s, n in chosen.items()) <= num_gpus and _holds(chosen, prop.max_len):
            nearby.append(chosen)
    if not nearby:
        nearby = [c for c in [_closest(prop, num_gpus)] if c is not None]
    wanted = dict(prop.pipelines)
    out = [Strategy.of(_fill(c, wanted, space, num_gpus - sum(s.num_gpus * n for s, n in c.items())))
           for c in nearby]
    return list(dict.fromkeys(out))


def _holds(chosen: dict[Scheme, int], max_len: int) -> bool:
    return any(s.max_len >= max_len for s, n in chosen.items() if n > 0)


def _closest(prop: Proposal, num_gpus: int) -> dict[Scheme, int] | None:
    """Whole pipelines n_k nearest the proposal's d_k in GPUs moved, sum_k N(P_k) |n_k - d_k|,
    subject to sum_k N(P_k) n_k <= N and at least one pipeline of a scheme holding the longest
    sequence: a MILP of 2K variables (n_k and |n_k - d_k|) for HiGHS. None when infeasible."""
    schemes = [s for s, _ in prop.pipelines]
    d = np.array([x for _, x in prop.pipelines])
    gpus = np.array([s.num_gpus for s in schemes], dtype=np.float64)
    holds = np.array([s.max_len >= prop.max_len for s in schemes], dtype=np.float64)
    k, eye, zero = len(schemes), np.eye(len(schemes)), np.zeros(len(schemes))
    constraints = [
        LinearConstraint(np.concatenate([gpus, zero])[None], -np.inf, num_gpus),  # GPUs used
        LinearConstraint(np.concatenate([holds, zero])[None], 1, np.inf),  # the longest is held
        LinearConstraint(np.hstack([eye, -eye]), -np.inf, d),  # e_k >= n_k - d_k
        LinearConstraint(np.hstack([-eye, -eye]), -np.inf, -d),  # e_k >= d_k - n_k
    ]
    res = milp(np.concatenate([zero, gpus]), constraints=constraints,
               integrality=np.concatenate([np.ones(k), zero]),
               bounds=Bounds(np.zeros(2 * k), np.concatenate([num_gpus // gpus, np.full(k, np.inf)])))
    if res.x is None:
        return None
    counts = np.rint(res.x[:k]).astype(int)
    return {s: int(n) for s, n in zip(schemes, counts) if n > 0}


def _fill(chosen: dict[Scheme, int], wanted: dict[Scheme, float], space, left: int) -> dict[Scheme, int]:
    """Spend leftover GPUs: a pipeline of the strategy's scheme furthest below its continuous
    share, else of the smallest scheme of the space that fits."""
    chosen = dict(chosen)
    while left > 0:
        inside = [s for s in chosen if s.num_gpus <= left]
        if inside:
            pick = max(inside, key=lambda s: (wanted.get(s, 0.0) - chosen[s], -s.num_gpus))
        else:
            small = [s for s in space if s.num_gpus <= left]
            if not small:
                break
            pick = small[0]
        chosen[pick] = chosen.get(pick, 0) + 1
        left -= pick.num_gpus
    return chosen


def homogeneous(scheme: Scheme, num_gpus: int) -> Strategy:
    """As many pipelines of one scheme as fit (the fallback when no proposal holds the batch's
    longest sequence, e.g. a profile's proposals below it)."""
    return Strategy.of({scheme: num_gpus // scheme.num_gpus})
