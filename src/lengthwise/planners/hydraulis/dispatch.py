"""Hydraulis' sequence dispatching across pipelines (hydraulis §6.2, eq. 2-3, appendix D).

Each pipeline j of a strategy gets a set of whole sequences; its propagation latency is bounded
below by eq. 2, which we evaluate with the cost split of hydraulis/cost.py (c once per micro-batch):

    LB_j = sum_i w_j(l_i) + c_j ceil(sum_i l_i / MaxLen_j) + T_j(max_i l_i) (PP_j - 1)

(the packed micro-batches' work, at least ceil(tokens / MaxLen) of them, and the fill and drain
of the longest micro-batch; an empty pipeline costs 0). Eq. 3 minimises
the largest LB_j over assignments that respect MaxLen; Algorithm 1 solves it approximately: in a
random order, give each sequence to the admissible pipeline that least raises the current
maximum; repeat T times and keep the best trial.

All trials of all candidate strategies run at once as numpy rows: the longest-first rows as
[strategies, pipelines] arrays, narrower strategies padded with pipelines that hold nothing, the
random ones end to end, each row exactly its strategy's pipelines (hydraulis/trials.py). Two choices of
ours, both only able to help since the best trial is kept: trial 0 takes the sequences longest
first (the LPT order), and among pipelines tying on the new maximum the one left least loaded
wins (Algorithm 1 takes the first). Each strategy's trial count is cut so that sequences x its
pipelines x trials x `share` stays within `work_budget` (`share`: how many strategies split the
budget, fixed by the caller), so a pass of at most `share` strategies stays within it.

A strategy's result depends on the batch, the random generator's seed, its own pipelines and
`share` only, never on which other strategies are dispatched beside it: every strategy takes
the same orders (trial t is the t-th permutation drawn from one fresh generator, common random
numbers), rows never interact, and the padding pipelines are never admissible. The planner
relies on this: the previous batch's strategy is estimated alike whatever else is screened.

Cost: Algorithm 1 weighs every admissible pipeline for every sequence, so one trial of one
strategy is O(n D) (n sequences, D pipelines); the paper's algorithm allows no less, as the
pipeline that least raises the maximum bound depends on every pipeline's state. The work budget
cuts trials, never below one per strategy, so a pass is O(n D S) for S strategies, vectorised
over D and S. The longest-first trials (one per strategy, all a pass runs on large batches)
take a run of equal lengths per numpy step (`_longest_first`: an exact k-way merge, O(D + k m)
per row for a run of k, m ~ k / D + 1), so they cost one numpy step per distinct length (a few
thousand on 32K-sequence batches), not per sequence; random trials take one numpy step per
sequence position (`trials.random_trials`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from lengthwise.planners.hydraulis.arrays import PipelineArrays
from lengthwise.planners.hydraulis.cost import Scheme
from lengthwise.planners.hydraulis.trials import random_trials


@dataclass(frozen=True)
class Dispatch:
    """Which pipeline runs each sequence, and the eq. 3 objective that choice reaches."""

    owner: np.ndarray
    """Pipeline index of each sequence (int)."""
    objective_s: float
    """max_j LB_j (eq. 2), seconds."""
    trials: int
    """Trials run (Algorithm 1's T after the work budget)."""
    trial: int = 0
    """The trial kept (0: the longest-first order)."""


def _orders(lengths: np.ndarray, trials: int, rng: np.random.Generator) -> np.ndarray:
    """Row 0 longest first (ties by seq id), the others random permutations (Algorithm 1 l. 3)."""
    first = np.lexsort((np.arange(len(lengths)), -lengths))
    rest = [rng.permutation(len(lengths)) for _ in range(trials - 1)]
    return np.stack([first] + rest)


def _stack(candidates: list[PipelineArrays], trials: list[int]) -> PipelineArrays:
    """trials[c] rows for candidate c, columns padded to the widest candidate with pipelines
    that hold nothing (MaxLen 0.5 tokens)."""
    d = max(c.size for c in candidates)

    def rows(name: str, pad: float) -> np.ndarray:
        each = [np.pad(getattr(c, name), (0, d - c.size), constant_values=pad) for c in candidates]
        return np.repeat(np.stack(each), trials, axis=0)

    return PipelineArrays(rows("attn_s", 0.0), rows("token_s", 0.0), rows("chunk_s", 0.0), rows("depth", 1.0),
                          rows("max_len", 0.5))


def trials_for(n: int, size: int, trials: int, work_budget: float, share: int) -> int:
    """Trials dispatch_many runs for n sequences on a strategy of `size` pipelines when `share`
    strategies split `work_budget`: `trials`, cut so n x size x trials x share stays within the
    budget, never below one (the longest-first order)."""
    return int(max(1, min(trials, work_budget // max(n * size * share, 1))))


def dispatch_many(lengths, candidates: list[PipelineArrays], *, trials: int, work_budget: float,
                  rng: np.random.Generator, share: int | None = None,
                  known: list[Dispatch | None] | None = None) -> list[Dispatch]:
    """Algorithm 1 for several strategies, all their trials at once (one numpy row each): the
    longest-first rows by runs of equal lengths (`_longest_first`), the random ones a sequence
    per step (`trials.random_trials`). `share` (default: the strategies given) splits the work budget (see
    trials_for); `rng` draws the orders every strategy shares (see the module docstring).
    `known[c]`: candidate c's longest-first trial from an earlier pass on the same batch (rows
    never interact, so it is the row `_longest_first` would compute again, bit for bit)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    assert all(lengths.max() <= c.max_len.max() for c in candidates), "a sequence no pipeline holds"
    counts = [trials_for(n, c.size, trials, work_budget, share or len(candidates)) for c in candidates]
    p = _stack(candidates, [1] * len(candidates))  # the longest-first row of each
    common = _orders(lengths, max(counts), rng)
    orders = np.concatenate([common[:t] for t in counts])
    starts = np.cumsum([0] + counts[:-1])  # row 0 of each candidate: the longest-first order
    owner = np.zeros((len(orders), n), dtype=np.int64)
    first = np.zeros(len(orders))
    known = known or [None] * len(candidates)
    todo = np.asarray([c for c, k in enumerate(known) if k is None], dtype=np.int64)
    for c, k in enumerate(known):
        if k is not None:
            owner[starts[c]], first[starts[c]] = k.owner, k.objective_s
    if todo.size:
        owner[starts[todo]], first[starts[todo]] = _longest_first(p.take(todo), lengths, common[0])
    rand = np.setdiff1d(np.arange(len(orders)), starts)
    if rand.size:
        row_of = np.repeat(np.arange(len(candidates)), counts)[rand]
        owner[rand], first[rand] = random_trials(candidates, row_of, lengths, orders[rand])
    out = []
    for start, t in zip(starts.tolist(), counts):
        best = start + int(np.argmin(first[start:start + t]))
        out.append(Dispatch(owner=owner[best], objective_s=float(first[best]), trials=t, trial=best - start))
    return out


PLAIN_RUN = 2
"""Runs of equal lengths up to this long are placed a sequence per step (fewer numpy calls)."""


def _longest_first(p: PipelineArrays, lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 for rows that all take the sequences in one order, a run of equal lengths
    per numpy step; the same assignment as `trials.random_trials` in that order, bit for bit.

    For a run of k sequences of length l, each pipeline's successive bounds if it took 1, 2,
    ... of them are fixed by its own state (eq. 2 with the same arithmetic as `random_trials`)
    and never fall. Placing the run one sequence at a time onto the least new bound (ties to the
    lowest pipeline) is then a k-way merge of those streams: the run's i-th sequence goes to the
    i-th smallest (bound, pipeline, position) over all admissible pipelines. Only the k
    pipelines with the least first bound can take any (their k first bounds are already k
    candidates); we compute the first m bounds of their streams and keep the k smallest; if
    some pipeline had all m taken, its next bound might be among them too and m doubles (each
    takes about one: m starts at ceil(k / D) + 1). A run of one is one step of `random_trials`."""
    rows, d = p.max_len.shape
    n = len(order)
    ls = lengths[order]
    starts = np.flatnonzero(np.r_[True, ls[1:] != ls[:-1]])
    sizes = np.diff(np.r_[starts, n])
    # a run of up to PLAIN_RUN sequences costs fewer numpy calls one sequence at a time
    starts = np.flatnonzero(np.r_[True, ls[1:] != ls[:-1]] | (np.repeat(sizes, sizes) <= PLAIN_RUN))
    stops = np.r_[starts[1:], n]
    # A padding pipeline's bound is inf on its own (c = inf, PP - 1 = 1: 0 + inf + 0), so the
    # admissibility mask is applied only to lengths some real pipeline cannot hold.
    real = p.max_len >= 1
    chunk_s, depth_less_one = np.where(real, p.chunk_s, np.inf), np.where(real, p.depth - 1, 1.0)
    all_fit = float(p.max_len[real].min())
    sum_w, sum_l, fill = (np.zeros((rows, d)) for _ in range(3))
    flat_w, flat_l, flat_fill = sum_w.reshape(-1), sum_l.reshape(-1), fill.reshape(-1)  # views
    first = np.zeros(rows)
    owner = np.zeros((rows, n), dtype=np.int64)
    row_ids = np.arange(rows)
    base = row_ids * d
    at_row = row_ids[:, None]
    terms = _SchemeTerms(p, ls[starts])
    fill_term = np.empty((rows, d))
    for i, (a, b) in enumerate(zip(starts.tolist(), stops.tolist())):
        l, k = float(ls[a]), b - a
        w, w_plus_c = terms.w_at(i)
        # T(longest) after taking l: Algorithm 1's "w + c if l > longest else fill" is this maximum,
        # as fill is T of the longest held (0 when empty) and T grows with l
        fill_after = np.maximum(fill, w_plus_c)
        # each pipeline's bound if it took one sequence of the run, as random_trials computes
        # it: sum_w + w + c ceil((sum_l + l) / MaxLen) + fill (PP - 1), left to right
        new1 = sum_w + w
        np.add(sum_l, l, out=fill_term)
        fill_term /= p.max_len
        np.ceil(fill_term, out=fill_term)
        fill_term *= chunk_s
        new1 += fill_term
        np.multiply(fill_after, depth_less_one, out=fill_term)
        new1 += fill_term
        admissible = None if l <= all_fit else p.max_len >= l
        if admissible is not None:
            new1 = np.where(admissible, new1, np.inf)
        if k == 1:
            idx = base + new1.argmin(axis=1)
            owner[row_ids, order[a]] = idx - base
            first = np.maximum(first, new1.ravel()[idx])
            flat_w[idx] += w.ravel()[idx]
            flat_l[idx] += l
            flat_fill[idx] = fill_after.ravel()[idx]
            continue
        # Only the k pipelines with the least first bound can take any of the run (those k first
        # bounds are k candidates already); kept in pipeline order for the tie-break.
        kk = min(k, d)
        cand = _least(new1, kk)
        at = (at_row, cand)
        w, c, cap, held_l = w[at], chunk_s[at], p.max_len[at], sum_l[at]
        fill_c, start_w = fill_term[at], sum_w[at]
        admissible = None if admissible is None else admissible[at][..., None]
        m = min(k, -(-k // kk) + 1)
        while True:
            # sum_w after taking 0..m of the run: the same left-to-right additions as random_trials'
            sums = np.empty((rows, kk, m + 1))
            sums[..., 0], sums[..., 1:] = start_w, w[..., None]
            np.cumsum(sums, axis=-1, out=sums)
            tokens = held_l[..., None] + _count(m) * l
            new = sums[..., 1:] + c[..., None] * np.ceil(tokens / cap[..., None]) + fill_c[..., None]
            flat = (new if admissible is None else np.where(admissible, new, np.inf)).reshape(rows, kk * m)
            taken = np.argsort(flat, axis=1, kind="stable")[:, :k]  # (bound, pipeline, position)
            slot = taken // m
            took = np.bincount((at_row * kk + slot).ravel(), minlength=rows * kk).reshape(rows, kk)
            if m == k or not (took == m).any():
                break
            m = min(k, 2 * m)
        owner[at_row, order[a:b]] = cand[at_row, slot]
        first = np.maximum(first, flat[row_ids, taken[:, -1]])
        sum_w[at] = sums.reshape(rows * kk, m + 1)[_index(rows * kk), took.ravel()].reshape(rows, kk)
        sum_l[at] = held_l + took * l
        fill[at] = np.where(took > 0, fill_after[at], fill[at])
    return owner, first


def _least(values: np.ndarray, k: int) -> np.ndarray:
    """[row, k] the columns of each row's k least values, ties to the lower column, ascending:
    np.sort(np.argsort(values, axis=1, kind="stable")[:, :k], axis=1) by one partition per row
    (the k-th least value), not a sort (values are bounds or inf, never NaN)."""
    rows, d = values.shape
    if k >= d:
        return np.broadcast_to(np.arange(d), values.shape).copy()
    kth = np.partition(values, k - 1, axis=1)[:, k - 1:k]
    keep = values <= kth
    if np.count_nonzero(keep) > rows * k:
        # some row has more than k values up to its k-th: of those equal to it, the lowest
        # columns fill what the values below leave of k
        at = values == kth
        keep &= ~at | (np.cumsum(at, axis=1) <= k - (values < kth).sum(axis=1, keepdims=True))
    return (np.flatnonzero(keep) % d).reshape(rows, k)


@functools.lru_cache(maxsize=64)
def _count(m: int) -> np.ndarray:
    """1, 2, ..., m as floats (read-only, shared)."""
    out = np.arange(1, m + 1, dtype=np.float64)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _index(n: int) -> np.ndarray:
    """0, 1, ..., n - 1 (read-only, shared)."""
    out = np.arange(n)
    out.flags.writeable = False
    return out


def dispatch(lengths, p: PipelineArrays, *, trials: int, work_budget: float,
             rng: np.random.Generator) -> Dispatch:
    """Algorithm 1 (greedy dispatch with random trials) for one strategy."""
    return dispatch_many(lengths, [p], trials=trials, work_budget=work_budget, rng=rng)[0]


@dataclass(frozen=True)
class Precomputed:
    """Terms of Algorithm 1's step that depend on the sequences placed, not on the state, for
    a block of steps (leading axis): the reference arithmetic that `_SchemeTerms` and
    `trials.RaggedRows.block` reproduce bit for bit."""

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


class _SchemeTerms:
    """Precomputed's terms for one length on every (row, pipeline) of stacked rows whose rows all
    take the same length: w(l) and w(l) + c once per distinct (attn_s, token_s, chunk_s) (a
    strategy has a few schemes, repeated over its pipelines), then spread by index; the same
    operations on the same numbers as `Precomputed.of`, so the same floats."""

    def __init__(self, p: PipelineArrays, lengths: np.ndarray | None = None):
        table = np.stack([p.attn_s.ravel(), p.token_s.ravel(), p.chunk_s.ravel()], axis=1)
        uniq, inverse = np.unique(table, axis=0, return_inverse=True)
        attn_s, token_s, chunk_s = uniq[:, 0], uniq[:, 1], uniq[:, 2]
        self.attn_s, self.token_s, self.chunk_s = attn_s, token_s, chunk_s
        self.inverse = inverse.reshape(p.max_len.shape)
        self.max_len = p.max_len
        if lengths is None:
            return
        # w(l) and w(l) + c of every length the caller steps through, [length, scheme], at once:
        # the same elementwise operations in the same order as PipelineArrays.seq_time's
        l = np.asarray(lengths, dtype=np.float64)[:, None]
        self.w = attn_s * l * (l + 1) / 2 + token_s * l
        self.w_plus_c = self.w + chunk_s

    def w_at(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """w and w + c for the caller's i-th length."""
        return self.w[i].take(self.inverse), self.w_plus_c[i].take(self.inverse)

    def at(self, i: int, l: float) -> Precomputed:
        """The terms for the caller's i-th length, l."""
        w, w_plus_c = self.w_at(i)
        return Precomputed(w=w, w_plus_c=w_plus_c, admissible=self.max_len >= l)


def lower_bound(lengths, schemes: list[Scheme], counts: list[int], max_lens: list[int]) -> float:
    """A bound no dispatch of the strategy beats: GPU-seconds of the cheapest admissible scheme
    per sequence over the strategy's GPUs, or the longest sequence alone on its fastest scheme."""
    lengths = np.asarray(lengths, dtype=np.int64)
    fit = np.asarray(max_lens, dtype=np.int64)[:, None] >= lengths[None, :]
    gpu_s = np.stack([s.num_gpus * s.seq_time(lengths) for s in schemes])
    work = np.where(fit, gpu_s, np.inf).min(axis=0).sum()
    gpus = sum(s.num_gpus * n for s, n in zip(schemes, counts))
    longest = int(lengths.max())
    alone = min((s.chunk_time([longest]) * s.pp for s, m in zip(schemes, max_lens) if m >= longest),
                default=np.inf)
    return max(work / gpus, alone)
