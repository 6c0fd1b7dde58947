"""Hydraulis' vectorised steps (planners/hydraulis/dispatch.py, trials.py, packing.lpt_bounds)
give the plain algorithms' numbers and choices bit for bit."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lengthwise.planners.hydraulis.arrays import PipelineArrays
from lengthwise.planners.hydraulis.dispatch import Precomputed, _least, _SchemeTerms, _stack
from lengthwise.planners.hydraulis.packing import (
    PipelineLoad,
    _estimate,
    _estimate_floor,
    greedy_pack,
    lpt_bins,
    lpt_bounds,
    lpt_first,
    micro_batch_range,
)
from lengthwise.planners.hydraulis.trials import RaggedRows, random_trials

FIELDS = ("attn_s", "token_s", "chunk_s", "depth", "max_len")


def random_strategies(rng, sizes) -> list[PipelineArrays]:
    """Strategies of a few distinct schemes each (pipelines repeat their scheme), MaxLen descending."""
    out = []
    for n in sizes:
        kinds = rng.integers(0, 3, n)
        table = [rng.random(3) * 1e-9, rng.random(3) * 1e-6, rng.random(3) * 1e-3,
                 rng.integers(1, 5, 3).astype(float), np.sort(rng.integers(100, 9000, 3))[::-1] * 1.0]
        kinds = np.sort(kinds)  # MaxLen descending: scheme 0 has the largest
        out.append(PipelineArrays(*(col[kinds] for col in table)))
    return out


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 30), data=st.data())
def test_least_k_bounds_are_the_stable_sorts_first_k(rows, cols, data):
    """dispatch._least picks each row's k least bounds, ties to the lower pipeline, as the stable
    argsort it replaces (bounds repeat, and inadmissible pipelines are inf)."""
    k = data.draw(st.integers(1, cols))
    values = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.0, np.inf]), min_size=rows * cols,
                                         max_size=rows * cols))).reshape(rows, cols)
    expected = np.sort(np.argsort(values, axis=1, kind="stable")[:, :k], axis=1)
    assert np.array_equal(_least(values, k), expected)


def test_scheme_terms_per_length_are_precomputeds_own():
    """The longest-first dispatch's w(l), w(l) + c and admissibility per run, from each distinct
    scheme's, are Precomputed.of's numbers for every (row, pipeline)."""
    rng = np.random.default_rng(0)
    schemes = [PipelineArrays(rng.random(n) * 1e-9, rng.random(n) * 1e-6, rng.random(n) * 1e-3,
                              rng.integers(1, 5, n).astype(float), np.sort(rng.integers(100, 9000, n))[::-1] * 1.0)
               for n in (3, 7, 5)]
    stacked = _stack([PipelineArrays(*(np.repeat(getattr(s, f)[:2], 3) for f in FIELDS)) for s in schemes], 1)
    runs = (1, 77, 4096, 8999)
    terms = _SchemeTerms(stacked, np.asarray(runs, dtype=np.int64))
    for i, l in enumerate(runs):
        want = Precomputed.of(stacked, np.full(stacked.max_len.shape[0], l))
        got = terms.at(i, float(l))
        assert np.array_equal(got.w, want.w) and np.array_equal(got.w_plus_c, want.w_plus_c)
        assert np.array_equal(got.admissible, want.admissible)


def test_ragged_rows_block_is_precomputeds_own():
    """The random trials' lengths, w(l), w(l) + c and admissibility per (step, row, pipeline),
    rows end to end and w from each row's distinct schemes, are Precomputed.of's numbers on the
    padded rows bit for bit."""
    rng = np.random.default_rng(1)
    strategies = random_strategies(rng, (3, 7, 5))
    row_of = np.array([0, 1, 1, 2, 0, 2])
    padded = _stack([strategies[c] for c in row_of], [1] * len(row_of))
    lengths = rng.integers(1, 9000, (11, len(row_of)))
    want = Precomputed.of(padded, lengths)
    ls, w, w_plus_c, admissible = RaggedRows(strategies, row_of).block(lengths)
    live = np.concatenate([np.arange(strategies[c].size) + r * padded.max_len.shape[1] for r, c in enumerate(row_of)])
    flat = lambda x: x.reshape(len(lengths), -1)[:, live]
    assert np.array_equal(w, flat(want.w)) and np.array_equal(w_plus_c, flat(want.w_plus_c))
    assert np.array_equal(admissible, flat(want.admissible))
    assert np.array_equal(ls, np.repeat(lengths, [strategies[c].size for c in row_of], axis=1))


def plain_algorithm_1(p: PipelineArrays, lengths, order) -> tuple[list[int], float]:
    """One trial of Algorithm 1 in `order`, one pipeline at a time in Python floats: each sequence
    onto the admissible pipeline with the least new eq. 2 bound (the least raise of the largest;
    ties to the lowest index), the bound's terms added in the vectorised steps' order."""
    d = p.size
    sum_w, sum_l, fill = [0.0] * d, [0.0] * d, [0.0] * d
    owner, first = [0] * len(lengths), 0.0
    for i in order:
        l = float(lengths[i])
        best = None
        for j in range(d):
            if not p.max_len[j] >= l:
                continue
            w = float(p.attn_s[j]) * l * (l + 1) / 2 + float(p.token_s[j]) * l
            fill_j = max(fill[j], w + float(p.chunk_s[j]))
            new = sum_w[j] + w + float(p.chunk_s[j]) * float(np.ceil((sum_l[j] + l) / p.max_len[j]))
            new += fill_j * (float(p.depth[j]) - 1)
            if best is None or new < best[0]:
                best = (new, j, w, fill_j)
        new, j, w, fill_j = best
        sum_w[j], sum_l[j], fill[j] = sum_w[j] + w, sum_l[j] + l, fill_j
        owner[i], first = j, max(first, new)
    return owner, first


def test_random_trials_are_plain_algorithm_1_per_row():
    """Rows of strategies of different widths, each in its own random order, end to end: every
    row's owners and largest bound are the plain algorithm's, bit for bit."""
    rng = np.random.default_rng(2)
    strategies = random_strategies(rng, (1, 4, 9))
    lengths = np.r_[rng.integers(1, 9000, 30), [50] * 6, [7] * 4]
    row_of = np.array([2, 0, 1, 1, 2, 0, 2])
    orders = np.stack([rng.permutation(len(lengths)) for _ in row_of])
    lengths = np.minimum(lengths, int(min(s.max_len.max() for s in strategies)))
    owner, first = random_trials(strategies, row_of, lengths, orders)
    for r, c in enumerate(row_of):
        want_owner, want_first = plain_algorithm_1(strategies[c], lengths, orders[r])
        assert owner[r].tolist() == want_owner and first[r] == want_first


def test_lpt_bounds_are_each_loads_own_lpt_estimate():
    """lpt_bounds over loads of different sizes, micro-batch ranges and schemes side by side (one
    empty, one LPT cannot pack): each load's plain LPT estimate at the count of the lowest
    floor, inf where LPT finds no room, 0 for the empty load; never below greedy_pack's."""
    rng = np.random.default_rng(4)
    loads = []
    for size, cap in ((40, 4000), (3, 9000), (0, 100), (17, 2500), (90, 30000), (4, 1000)):
        lengths = rng.integers(1, min(cap, 3000), size)
        if cap == 1000:  # 2 micro-batches by the range (UtilLen = MaxLen); LPT leaves 500 no room
            lengths = np.array([600, 600, 500, 300])
        attn, token, chunk = rng.random() * 1e-10, rng.random() * 1e-6, rng.random() * 1e-3
        work = attn * lengths * (lengths + 1) / 2 + token * lengths
        loads.append(PipelineLoad(seq_ids=tuple(range(size)), lengths=lengths, work=work, chunk_s=chunk,
                                  depth=int(rng.integers(1, 5)), max_len=cap,
                                  util_len=cap if cap == 1000 else int(rng.integers(50, 400))))
    got = lpt_bounds(loads)
    for load, bound in zip(loads, got):
        if not load.seq_ids:
            assert bound == 0.0
            continue
        vs = micro_batch_range(load)
        floor = _estimate_floor(load, max(vs))
        bins = lpt_bins(load, min(vs, key=lambda v: floor[v - 1]))
        assert bound == (np.inf if bins is None else _estimate(load, load.work.tolist(), bins))
        assert bound >= greedy_pack(load).estimate_s
    assert np.isinf(got[5]) and np.isfinite(got).sum() == 4 and (got == 0).sum() == 1


def test_greedy_pack_from_known_first_lpt_is_greedy_packs_own():
    """greedy_pack given lpt_first's estimate and micro-batch count (the LPT packing it tries
    first, not packed again unless it wins) gives the same packing, estimate and method, LPT
    winners and loads LPT cannot pack included."""
    rng = np.random.default_rng(5)
    loads = []
    for _ in range(60):
        size, cap = int(rng.integers(1, 40)), int(rng.choice([1000, 4000, 30000]))
        lengths = rng.integers(1, min(cap, 3000) + 1, size)
        attn, token, chunk = rng.random() * 1e-10, rng.random() * 1e-6, rng.random() * 1e-3
        loads.append(PipelineLoad(seq_ids=tuple(range(size)), lengths=lengths,
                                  work=attn * lengths * (lengths + 1) / 2 + token * lengths, chunk_s=chunk,
                                  depth=int(rng.integers(1, 5)), max_len=cap, util_len=int(rng.integers(50, 2000))))
    estimates, used = lpt_first(loads)
    methods = set()
    for load, first in zip(loads, zip(estimates.tolist(), used.tolist())):
        want, got = greedy_pack(load), greedy_pack(load, first_lpt=first)
        assert (got.bins, got.estimate_s, got.method) == (want.bins, want.estimate_s, want.method)
        methods.add(want.method)
    assert {"lpt", "kk"} <= methods and np.isinf(estimates).any()
