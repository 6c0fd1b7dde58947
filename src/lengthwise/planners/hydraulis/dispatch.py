"""Hydraulis' sequence dispatching across pipelines (hydraulis §6.2, eq. 2-3, appendix D).

Each pipeline j of a strategy gets a set of whole sequences; its propagation latency is bounded
below by eq. 2, which we evaluate with the cost split of hydraulis/cost.py (c once per micro-batch):

    LB_j = sum_i w_j(l_i) + c_j ceil(sum_i l_i / MaxLen_j) + T_j(max_i l_i) (PP_j - 1)

(the packed micro-batches' work, at least ceil(tokens / MaxLen) of them, and the fill and drain
of the longest micro-batch; an empty pipeline costs 0). Eq. 3 minimises
the largest LB_j over assignments that respect MaxLen; Algorithm 1 solves it approximately: in a
random order, give each sequence to the admissible pipeline that least raises the current
maximum; repeat T times and keep the best trial.

All trials of all candidate strategies run at once as numpy rows ([strategies x trials,
pipelines] arrays, narrower strategies padded with pipelines that hold nothing), one sequence
position per step: the step count is the batch's sequence count whatever the number of trials
and candidates. Two choices of ours, both only able to help since the best trial is kept:
trial 0 takes the sequences longest first (the LPT order), and among pipelines tying on the new
maximum the one left least loaded wins (Algorithm 1 takes the first). The trial count is cut so
that sequences x pipelines x trials x strategies stays within `work_budget`.

Cost: Algorithm 1 weighs every admissible pipeline for every sequence, so one trial of one
strategy is O(n D) (n sequences, D pipelines); the paper's algorithm allows no less, as the
pipeline that least raises the maximum bound depends on every pipeline's state. The work budget
cuts trials, never below one per strategy, so a pass is O(n D S) for S strategies, vectorised
over D and S (one numpy step per sequence).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from lengthwise.planners.hydraulis.cost import Scheme


@dataclass(frozen=True)
class PipelineArrays:
    """The pipelines of one strategy as parallel arrays, MaxLen descending (§6.2's P_1..P_D);
    [rows, pipelines] when strategies are stacked for dispatch."""

    attn_s: np.ndarray
    token_s: np.ndarray
    chunk_s: np.ndarray
    depth: np.ndarray
    max_len: np.ndarray
    """Longest micro-batch per pipeline, tokens (the strategy-level MaxLen)."""

    @classmethod
    def of(cls, schemes: list[Scheme], max_lens: list[int]) -> PipelineArrays:
        assert all(a >= b for a, b in itertools.pairwise(max_lens)), "pipelines must come MaxLen descending"
        pick = lambda xs: np.asarray(xs, dtype=np.float64)
        return cls(pick([s.attn_s for s in schemes]), pick([s.token_s for s in schemes]),
                   pick([s.chunk_s for s in schemes]), pick([s.pp for s in schemes]), pick(max_lens))

    @property
    def size(self) -> int:
        return len(self.max_len)

    def seq_time(self, lengths: np.ndarray) -> np.ndarray:
        """w_j(l) for every (row, pipeline): lengths broadcast against the pipeline axis."""
        l = lengths[..., None].astype(np.float64)
        return self.attn_s * l * (l + 1) / 2 + self.token_s * l


@dataclass(frozen=True)
class Dispatch:
    """Which pipeline runs each sequence, and the eq. 3 objective that choice reaches."""

    owner: np.ndarray
    """Pipeline index of each sequence (int)."""
    objective_s: float
    """max_j LB_j (eq. 2), seconds."""
    trials: int
    """Trials run (Algorithm 1's T after the work budget)."""


def _orders(lengths: np.ndarray, trials: int, rng: np.random.Generator) -> np.ndarray:
    """Row 0 longest first (ties by seq id), the others random permutations (Algorithm 1 l. 3)."""
    first = np.lexsort((np.arange(len(lengths)), -lengths))
    rest = [rng.permutation(len(lengths)) for _ in range(trials - 1)]
    return np.stack([first] + rest)


def _stack(candidates: list[PipelineArrays], trials: int) -> PipelineArrays:
    """One row per (candidate, trial), columns padded to the widest candidate with pipelines
    that hold nothing (MaxLen 0.5 tokens)."""
    d = max(c.size for c in candidates)

    def rows(name: str, pad: float) -> np.ndarray:
        each = [np.pad(getattr(c, name), (0, d - c.size), constant_values=pad) for c in candidates]
        return np.repeat(np.stack(each), trials, axis=0)

    return PipelineArrays(rows("attn_s", 0.0), rows("token_s", 0.0), rows("chunk_s", 0.0), rows("depth", 1.0),
                          rows("max_len", 0.5))


def trials_within(n: int, sizes: list[int], trials: int, work_budget: float) -> int:
    """Trials per strategy that dispatch_many runs for n sequences on strategies of `sizes`
    pipelines: `trials`, cut so n x widest x strategies x trials stays within `work_budget`,
    never below one (the longest-first order)."""
    return int(max(1, min(trials, work_budget // max(n * max(sizes) * len(sizes), 1))))


def dispatch_many(lengths, candidates: list[PipelineArrays], *, trials: int, work_budget: float,
                  rng: np.random.Generator) -> list[Dispatch]:
    """Algorithm 1 for several strategies, all their trials at once (one numpy row each)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n, d = len(lengths), max(c.size for c in candidates)
    assert all(lengths.max() <= c.max_len.max() for c in candidates), "a sequence no pipeline holds"
    trials = trials_within(n, [c.size for c in candidates], trials, work_budget)
    p = _stack(candidates, trials)
    orders = np.concatenate([_orders(lengths, trials, rng) for _ in candidates])
    state = _Trials(len(orders), d)
    owner = np.zeros((len(orders), n), dtype=np.int64)
    block = max(1, min(n, (1 << 20) // max(orders.shape[0] * d, 1)))  # w(l) of ~1M entries at a time
    for k in range(n):
        if k % block == 0:  # what depends only on the sequences, for `block` steps at once
            pre = Precomputed.of(p, lengths[orders[:, k:k + block]].T)
        seq = orders[:, k]
        owner[state.rows, seq] = state.place(p, lengths[seq], pre.step(k % block))
    out = []
    for c in range(len(candidates)):
        best = c * trials + int(np.argmin(state.first[c * trials:(c + 1) * trials]))
        out.append(Dispatch(owner=owner[best], objective_s=float(state.first[best]), trials=trials))
    return out


def dispatch(lengths, p: PipelineArrays, *, trials: int, work_budget: float,
             rng: np.random.Generator) -> Dispatch:
    """Algorithm 1 (greedy dispatch with random trials) for one strategy."""
    return dispatch_many(lengths, [p], trials=trials, work_budget=work_budget, rng=rng)[0]


@dataclass(frozen=True)
class Precomputed:
    """Terms of `_Trials.place` that depend on the sequences placed, not on the state, for a
    block of steps (leading axis), computed with the same arithmetic as place's own."""

    w: np.ndarray
    """p.seq_time(l)."""
    w_plus_c: np.ndarray
    """w + p.chunk_s."""
    admissible: np.ndarray
    """p.max_len >= l."""

    @classmethod
    def of(cls, p: PipelineArrays, lengths: np.ndarray) -> Precomputed:
        w = p.seq_time(lengths)
        return cls(w=w, w_plus_c=w + p.chunk_s, admissible=p.max_len >= lengths[..., None].astype(np.float64))

    def step(self, i: int) -> Precomputed:
        return Precomputed(w=self.w[i], w_plus_c=self.w_plus_c[i], admissible=self.admissible[i])


class _Trials:
    """Running eq. 2 terms of every (row, pipeline), and each row's largest bound."""

    def __init__(self, rows: int, d: int):
        self.sum_w, self.sum_l, self.longest, self.fill = (np.zeros((rows, d)) for _ in range(4))
        self.rows, self.cols = np.arange(rows), np.arange(d)
        self.first = np.zeros(rows)
        self.depth_less_one: np.ndarray | None = None

    def place(self, p: PipelineArrays, l: np.ndarray, pre: Precomputed | None = None) -> np.ndarray:
        """Put each row's sequence (length l) on the admissible pipeline where the largest bound
        grows least (Alg. 1 l. 7-14); returns the pipelines chosen. `pre`: the terms that depend
        on l only, when the caller has them already."""
        col = l[:, None].astype(np.float64)
        pre = pre or Precomputed.of(p, l)
        w = pre.w
        fill = np.where(col > self.longest, pre.w_plus_c, self.fill)  # T(longest) after adding
        if self.depth_less_one is None:
            self.depth_less_one = p.depth - 1
        new = self.sum_w + w + p.chunk_s * np.ceil((self.sum_l + col) / p.max_len) + fill * self.depth_less_one
        # The pipeline raising the largest bound least, ties to the least new bound (then the
        # lowest index), is the admissible one with the least new bound: bounds only grow, so
        # the top pipeline's new bound is at least the row's largest, and any other's largest
        # after the move is max(its new bound, the row's largest) -- both orders agree, and so
        # does the lowest index among equal new bounds.
        pick = np.where(pre.admissible, new, np.inf).argmin(axis=1)
        at = (self.rows, pick)
        self.sum_w[at] += w[at]
        self.sum_l[at] += l
        self.longest[at] = np.maximum(self.longest[at], l)
        self.fill[at] = fill[at]
        self._raise(pick, new[at])
        return pick

    def _raise(self, pick: np.ndarray, value: np.ndarray) -> None:
        self.first = np.maximum(self.first, value)  # bounds only grow: the row's largest


def lower_bound(lengths, schemes: list[Scheme], counts: list[int], max_lens: list[int]) -> float:
    """A bound no dispatch of the strategy beats: GPU-seconds of the cheapest admissible scheme
    per sequence over the strategy's GPUs, or the longest sequence alone on its fastest scheme."""
    lengths = np.asarray(lengths, dtype=np.int64)
    fit = np.array([[m >= x for x in lengths] for m in max_lens])
    gpu_s = np.stack([s.num_gpus * s.seq_time(lengths) for s in schemes])
    work = np.where(fit, gpu_s, np.inf).min(axis=0).sum()
    gpus = sum(s.num_gpus * n for s, n in zip(schemes, counts))
    longest = int(lengths.max())
    alone = min((s.chunk_time([longest]) * s.pp for s, m in zip(schemes, max_lens) if m >= longest),
                default=np.inf)
    return max(work / gpus, alone)
