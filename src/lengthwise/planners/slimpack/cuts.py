"""SlimPack MicroPacks: one rank's samples cut into forward MicroPacks of equal forward FLOPs and
backward MicroPacks of equal backward FLOPs (slimpack.txt §4.1.1 Phase 2, §4.1.2, §4.2).

The stream. A rank's samples are laid end to end in descending forward FLOPs (§4.2) and the
stream is cut into N pieces of equal forward FLOPs. A piece holds a slice of one long sample
(*Slim*), a sample's tail slice plus whole or sliced others (*Mix*), or only whole samples
(*Pack*); every sample's slices stay in order, and a sample spans as many MicroPacks as its
FLOPs need.

Exact boundaries. Tokens [0, x) of one sequence cost G(x) = lin * x + attn * x(x+1)/2 FLOPs
(the linear layers and LM head per token, attention per causal (query, key) pair; infinipipe
eq. 1 gives a slice [a, b) the difference G(b) - G(a)). The cut for a cumulative target T lands
in the sample whose cumulative range holds T, at the root of the quadratic G(x) = T - (FLOPs of
the samples before it), rounded to the nearest token. Targets are k * total / N, so rounding
never accumulates: every MicroPack is within one token's FLOPs (at its two cuts) of the budget.

Backward (§4.1.2, §4.2). The backward stream visits the same samples in the same order (FIFO
across samples) but each sample from its last token down to its first (FILO within a sample:
a slice's K/V gradients come from the later slices). It is cut at equal backward FLOPs the same
way, with G_b (attention 2.5x, GEMMs 2x the forward). The rule every backward unit keeps, and
`check_backward_units` enforces: each of its segments is a whole forward segment or a sub-range
of one (same sequence, same CP placement), so a backward unit reads the activations of whole
forward MicroPacks and never stitches one segment out of two. A unit may hold several adjacent
segments of one sequence (one per forward MicroPack it reaches into); they are listed in token
order.

Two implementations, the same MicroPacks: the pointer walks (forward_chunks,
backward_units_ready: one stream, O(samples + pieces)) and numpy over many streams at once
(streams_cuts, streams_pieces: every sample start and every forward and backward boundary of
every stream sorted into elementary intervals, each one segment; the sweep's path, which also
hands the simulator the slice structure it would otherwise re-derive from the segments).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lengthwise.plan.ir import SHARDED, Chunk, Segment
from lengthwise.plan.schedules import Dependencies
from lengthwise.sim.inputs import SliceStructure
from lengthwise.sim.memory import SplitArrays


@dataclass(frozen=True, kw_only=True)
class PrefixCost:
    """FLOPs of a sequence's first x tokens: G(x) = lin * x + attn * x(x+1)/2 (whole model)."""

    lin: float
    """FLOPs per token: GEMMs of every layer plus the LM head."""
    attn: float
    """FLOPs per causal (query, key) pair, all layers."""

    @classmethod
    def from_cost(cls, cost, *, layers: int, backward: bool) -> PrefixCost:
        """Two one-token probes of the cost model: [0, 1) has 1 pair, [1, 2) has 2 pairs."""
        flops = cost.backward_flops if backward else cost.forward_flops
        first = flops(Chunk((Segment(0, 0, 1),)), layers=layers, head=True)
        second = flops(Chunk((Segment(0, 1, 2),)), layers=layers, head=True)
        return cls(lin=2.0 * first - second, attn=second - first)

    def of(self, x):
        """G(x), for numbers or arrays of token counts."""
        x = np.asarray(x, dtype=np.float64)
        return self.lin * x + self.attn * x * (x + 1.0) / 2.0

    def slice(self, start, stop):
        """FLOPs of tokens [start, stop) with context [0, start)."""
        return self.of(stop) - self.of(start)

    def inverse(self, y):
        """The real x >= 0 with G(x) = y: root of attn/2 x^2 + (lin + attn/2) x - y = 0, written
        2y / (beta + sqrt(beta^2 + 2 attn y)) so it stays exact when attn is tiny."""
        y = np.maximum(np.asarray(y, dtype=np.float64), 0.0)
        beta = self.lin + self.attn / 2.0
        return 2.0 * y / (beta + np.sqrt(beta * beta + 2.0 * self.attn * y))


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One rank's samples laid end to end, in the order they run."""

    seq_ids: np.ndarray
    """int64 [S] sequence ids in stream order."""
    lengths: np.ndarray
    """int64 [S] their lengths, tokens."""
    offsets: np.ndarray
    """int64 [S + 1] stream position of each sample's first token (and the total at the end)."""

    @classmethod
    def of(cls, seq_ids: list[int], lengths: list[int]) -> Stream:
        lens = np.asarray([lengths[i] for i in seq_ids], dtype=np.int64)
        return cls(seq_ids=np.asarray(seq_ids, dtype=np.int64), lengths=lens,
                   offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))

    @property
    def total_tokens(self) -> int:
        return int(self.offsets[-1])


def _cut_targets(whole: np.ndarray, pieces: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal-FLOPs targets k * total / pieces (k = 1..pieces-1): the sample each lands in and
    the FLOPs left over inside that sample."""
    cum = np.concatenate([[0.0], np.cumsum(whole)])
    targets = cum[-1] * np.arange(1, pieces) / pieces
    j = np.clip(np.searchsorted(cum, targets, side="right") - 1, 0, len(whole) - 1)
    return j, targets - cum[j], cum


def forward_cuts(stream: Stream, g: PrefixCost, pieces: int) -> np.ndarray:
    """Stream positions [0, p_1, ..., total]: forward MicroPack k is [p_k, p_k+1)."""
    j, rest, _ = _cut_targets(g.of(stream.lengths), pieces)
    x = np.clip(np.rint(g.inverse(rest)), 0, stream.lengths[j]).astype(np.int64)
    return np.concatenate([[0], stream.offsets[j] + x, [stream.total_tokens]])


def backward_cuts(stream: Stream, g: PrefixCost, pieces: int) -> np.ndarray:
    """Backward-stream positions [0, q_1, ..., total]; position offset_j + r is token
    length_j - r of sample j (each sample is walked from its end)."""
    whole = g.of(stream.lengths)
    j, rest, _ = _cut_targets(whole, pieces)
    x = np.clip(np.rint(g.inverse(whole[j] - rest)), 0, stream.lengths[j]).astype(np.int64)
    return np.concatenate([[0], stream.offsets[j] + stream.lengths[j] - x, [stream.total_tokens]])


def streams_cuts(streams: list[Stream], g: PrefixCost, pieces: list[int], *, backward: bool,
                 memo: list[dict]) -> list[np.ndarray]:
    """forward_cuts (backward_cuts with `backward`) of several streams, elementwise over all of
    them at once (the same operations on the same numbers, so the same cuts); only the search
    for the sample each target lands in runs stream by stream. `memo[i]`: stream i's prefix
    sums of whole-sample FLOPs by cost model, shared by its counts."""
    wholes, cums = [], []
    for st, m in zip(streams, memo):
        key = ("prefix", g)
        if key not in m:
            whole = g.of(st.lengths)
            m[key] = (whole, np.concatenate([[0.0], np.cumsum(whole)]))
        wholes.append(m[key][0])
        cums.append(m[key][1])
    n = np.asarray(pieces, dtype=np.int64) - 1  # targets per stream
    pipe = np.repeat(np.arange(len(streams)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.concatenate([[0], np.cumsum(n)[:-1]]), n) + 1
    totals = np.array([c[-1] for c in cums], dtype=np.float64)
    targets = totals[pipe] * k / np.asarray(pieces, dtype=np.int64)[pipe]
    bounds = np.concatenate([[0], np.cumsum(n)]).tolist()
    j = np.concatenate([np.searchsorted(c, targets[a:b], side="right") for c, a, b in
                        zip(cums, bounds[:-1], bounds[1:])]).astype(np.int64) - 1 if len(pipe) else \
        np.zeros(0, np.int64)
    sizes = np.array([len(st.lengths) for st in streams], dtype=np.int64)
    j = np.clip(j, 0, sizes[pipe] - 1)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])[pipe] + j  # global sample
    whole, cum = np.concatenate(wholes), np.concatenate([c[:-1] for c in cums])
    lengths, offsets = np.concatenate([st.lengths for st in streams]), np.concatenate([st.offsets[:-1] for st in streams])
    rest = targets - cum[first]
    if backward:
        x = np.clip(np.rint(g.inverse(whole[first] - rest)), 0, lengths[first]).astype(np.int64)
        at = offsets[first] + lengths[first] - x
    else:
        x = np.clip(np.rint(g.inverse(rest)), 0, lengths[first]).astype(np.int64)
        at = offsets[first] + x
    return [np.concatenate([[0], at[a:b], [st.total_tokens]]).astype(np.int64)
            for st, a, b in zip(streams, bounds[:-1], bounds[1:])]


def _overlaps(offsets: list[int], lo: int, hi: int, j: int) -> tuple[list[tuple[int, int, int]], int]:
    """(sample j, a, b) for the part [a, b) of each sample's own positions inside stream range
    [lo, hi), and the sample holding `lo`. `j` is a sample at or before the one holding `lo`
    (the cuts are sorted, so one pointer walks the stream once: O(samples + pieces) per stream)."""
    last = len(offsets) - 1
    while j < last and offsets[j + 1] <= lo:
        j += 1
    first, out = j, []
    while j < last and offsets[j] < hi:
        off = offsets[j]
        a, b = max(lo, off) - off, min(hi, offsets[j + 1]) - off
        if b > a:
            out.append((j, a, b))
        j += 1
    return out, first


def forward_chunks(stream: Stream, cuts: np.ndarray, made: dict | None = None) -> list[Chunk]:
    """Forward MicroPacks from the cut positions (empty ones dropped). `made`, when given,
    holds segments by (sample, start, stop): those found there are reused, new ones added (for
    backward_units_ready and other counts of the same stream: segments are frozen, and a
    sample held whole is one object wherever it appears)."""
    offsets, ids = stream.offsets.tolist(), stream.seq_ids.tolist()
    chunks, j = [], 0
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        parts, j = _overlaps(offsets, lo, hi, j)
        if parts:
            if made is None:
                segs = tuple(Segment(ids[k], a, b) for k, a, b in parts)
            else:
                segs = tuple(made.get(part) or made.setdefault(part, Segment(ids[part[0]], part[1], part[2]))
                             for part in parts)
            chunks.append(Chunk(segs))
    return chunks


def _forward_bounds(offsets: list[int], fcuts: list[int]) -> dict[int, list[int]]:
    """Per sample cut inside: the token positions where its forward segments end inside it
    (ascending, as the cuts are)."""
    bounds: dict[int, list[int]] = {}
    j, last = 0, len(offsets) - 1
    for p in fcuts:
        while j < last and offsets[j + 1] <= p:
            j += 1
        if j < last and offsets[j] < p:
            bounds.setdefault(j, []).append(p - offsets[j])
    return bounds


def backward_units(stream: Stream, bcuts: np.ndarray, fcuts: np.ndarray) -> list[Chunk]:
    """Backward MicroPacks from backward-stream cuts, each token range split at the forward
    MicroPack boundaries so every backward segment lies in one forward segment."""
    return backward_units_ready(stream, bcuts, fcuts)[0]


def backward_units_ready(stream: Stream, bcuts: np.ndarray, fcuts: np.ndarray,
                         made: dict | None = None) -> tuple[list[Chunk], list[int]]:
    """backward_units, and per unit how many forward MicroPacks (a prefix) must have run before
    it (schedule.forwards_needed, read off the cuts: each backward segment lies in the forward
    MicroPack holding its first token). `made`: forward_chunks' segments, reused where equal."""
    made = made or {}
    offsets, ids, cuts = stream.offsets.tolist(), stream.seq_ids.tolist(), fcuts.tolist()
    bounds = _forward_bounds(offsets, cuts)
    index, kept = [], 0  # forward MicroPack index of each cut interval (empty intervals are dropped)
    for lo, hi in itertools.pairwise(cuts):
        index.append(kept)
        kept += hi > lo
    units, ready, need, j = [], [], 0, 0
    for lo, hi in zip(bcuts[:-1].tolist(), bcuts[1:].tolist()):
        parts, j = _overlaps(offsets, lo, hi, j)
        segs = []
        for k, ra, rb in parts:
            n = offsets[k + 1] - offsets[k]
            start, stop = n - rb, n - ra  # reversed walk: backward positions -> tokens
            inside = bounds.get(k)
            edges = [start, stop]
            if inside:
                edges[1:1] = inside[bisect.bisect_right(inside, start):bisect.bisect_left(inside, stop)]
            for a, b in itertools.pairwise(edges):
                seg = made.get((k, a, b))
                segs.append(seg if seg is not None else Segment(ids[k], a, b))
                if b > a:
                    need = max(need, index[bisect.bisect_right(cuts, offsets[k] + a) - 1] + 1)
        if segs:
            units.append(Chunk(tuple(segs)))
            ready.append(need)
    return units, ready


Pieces = tuple[list[Chunk], list[Chunk], list[int], "SliceStructure | None"]
"""(forward MicroPacks, backward units, per unit the forward MicroPacks it waits for, the
SliceStructure for the simulator)."""


def stream_pieces(stream: Stream, fcuts: np.ndarray, bcuts: np.ndarray, made: dict | None = None) -> Pieces:
    """forward_chunks and backward_units_ready in one go, plus the SliceStructure the simulator
    would otherwise read off the segments (streams_pieces of one stream)."""
    return streams_pieces([stream], [fcuts], [bcuts], [{} if made is None else made])[0]


def streams_pieces(streams: list[Stream], fcuts: list[np.ndarray], bcuts: list[np.ndarray],
                   made: list[dict]) -> list[Pieces]:
    """stream_pieces of several streams (the pipelines of one candidate count) by numpy over
    all of them at once: the streams laid end to end (each one's cuts shifted by the tokens
    before it), cut at every sample start and forward and backward boundary into elementary
    intervals, each one segment. A stream whose forward cuts repeat a position (an empty
    MicroPack) takes the pointer walks instead, without a SliceStructure. `made[i]`: stream i's
    whole-sample segments, shared with its other counts."""
    out: list[Pieces | None] = [None] * len(streams)
    batch = []
    for i, (stream, fc) in enumerate(zip(streams, fcuts)):
        if len(fc) > 1 and not np.all(fc[1:] > fc[:-1]):
            out[i] = (forward_chunks(stream, fc, made[i]), *backward_units_ready(stream, bcuts[i], fc, made[i]), None)
        else:
            batch.append(i)
    if batch:
        for i, pieces in zip(batch, _pieces([streams[i] for i in batch], [fcuts[i] for i in batch],
                                            [bcuts[i] for i in batch], [made[i] for i in batch])):
            out[i] = pieces
    return out


def _pieces(streams: list[Stream], fcuts: list[np.ndarray], bcuts: list[np.ndarray], made: list[dict]) -> list[Pieces]:
    P = len(streams)
    totals = np.array([st.total_tokens for st in streams], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(totals)]).astype(np.int64)
    nS = np.array([len(st.lengths) for st in streams], dtype=np.int64)
    # every sample start of every stream, then the end of the last: global sample k
    offs = np.concatenate([st.offsets[:-1] + b for st, b in zip(streams, base[:-1].tolist())] + [base[-1:]])
    lens = np.diff(offs)
    wholes = []
    for st, m in zip(streams, made):
        w = m.get("whole")
        if w is None:  # one Segment per whole sample, shared by every count of the stream
            w = m["whole"] = _objects([Segment(q, 0, n) for q, n in zip(st.seq_ids.tolist(), st.lengths.tolist())])
        wholes.append(w)
    wholes = np.concatenate(wholes)
    ids = np.concatenate([st.seq_ids for st in streams])
    FC = np.concatenate([fc[:-1] + b for fc, b in zip(fcuts, base[:-1].tolist())] + [base[-1:]])
    BC = np.concatenate([bc[:-1] + b for bc, b in zip(bcuts, base[:-1].tolist())] + [base[-1:]])
    nC = np.array([len(fc) - 1 for fc in fcuts], dtype=np.int64)
    cstart = np.concatenate([[0], np.cumsum(nC)]).astype(np.int64)
    # forward: each elementary interval is one segment; forward cuts strictly increase, so
    # every piece is a MicroPack
    e_fwd = _union(FC, offs)
    lo, hi = e_fwd[:-1], e_fwd[1:]
    fk = np.searchsorted(offs, lo, side="right") - 1
    fc = np.searchsorted(FC, lo, side="right") - 1
    fa, fb = lo - offs[fk], hi - offs[fk]
    # backward positions: offset_k + r is token length_k - r; forward cuts inside a sample split it too
    ck = np.minimum(np.searchsorted(offs, FC, side="right") - 1, len(lens) - 1)
    inside = offs[ck] < FC
    mapped = offs[ck[inside]] + offs[ck[inside] + 1] - FC[inside]
    e = _union(BC, offs, mapped)
    lo, hi = e[:-1], e[1:]
    bk = np.searchsorted(offs, lo, side="right") - 1
    kept = np.cumsum(BC[1:] > BC[:-1]) - 1  # empty backward pieces are dropped
    bu = kept[np.searchsorted(BC, lo, side="right") - 1]
    ba, bb = offs[bk + 1] - hi, offs[bk + 1] - lo
    bc = np.searchsorted(FC, offs[bk] + ba, side="right") - 1  # forward MicroPack of its first token
    order = np.lexsort((-lo, bk, bu))  # unit by unit, samples in stream order, tokens ascending
    nU = np.bincount(np.searchsorted(base[1:], BC[np.flatnonzero(BC[1:] > BC[:-1])], side="right"),
                     minlength=P).astype(np.int64)
    ustart = np.concatenate([[0], np.cumsum(nU)]).astype(np.int64)
    fcount = np.bincount(fc, minlength=int(cstart[-1]))
    sk, sa, sb, su = bk[order], ba[order], bb[order], bu[order]
    bcount = np.bincount(su, minlength=int(ustart[-1]))
    fb_start = np.concatenate([[0], np.cumsum(fcount)])
    bb_start = np.concatenate([[0], np.cumsum(bcount)])
    # per unit the forward MicroPacks it waits for: a running maximum (later streams' chunks
    # all come after earlier streams', so one running maximum serves every stream)
    unit_pipe = np.repeat(np.arange(P), nU)
    top = np.full(int(ustart[-1]), -1, dtype=np.int64)
    np.maximum.at(top, bu, bc)
    ready = (np.maximum.accumulate(top + 1) - cstart[unit_pipe]).tolist()
    deps, splits = _slice_structures(ids, fk, fa, fb, fc, bk, ba, bu, bc, cstart, ustart, np.concatenate(
        [[0], np.cumsum(nS)]))
    fbounds, bbounds = np.stack([fa, fb], axis=1), np.stack([sa, sb], axis=1)
    # the forward segment holding each backward one (the backward segment is that object where equal)
    fi = np.searchsorted(e_fwd, offs[sk] + sa, side="right") - 1
    segs = _Segments(wholes=wholes, ids=ids, part=(fa > 0) | (fb < lens[fk]), fk=fk, fa=fa, fb=fb, fcount=fcount,
                     fi=fi, bpart=(fa[fi] != sa) | (fb[fi] != sb), sk=sk, sa=sa, sb=sb, bcount=bcount)
    # cells (the part of a MicroPack one backward unit holds: the simulator frees each with its
    # unit), by chunk then unit over all streams: each backward segment lies in forward segment fi
    cell_key, at = np.unique(fc[fi] * max(int(ustart[-1]), 1) + su, return_inverse=True)
    cell_tokens = np.bincount(at, weights=sb - sa, minlength=len(cell_key)).astype(np.int64)
    cell_chunk, cell_unit = cell_key // max(int(ustart[-1]), 1), cell_key % max(int(ustart[-1]), 1)
    cell_start = np.searchsorted(cell_chunk, cstart)
    out = []
    for p in range(P):
        c0, c1, u0, u1 = int(cstart[p]), int(cstart[p + 1]), int(ustart[p]), int(ustart[p + 1])
        f0, f1, b0, b1 = int(fb_start[c0]), int(fb_start[c1]), int(bb_start[u0]), int(bb_start[u1])
        k0, k1 = int(cell_start[p]), int(cell_start[p + 1])
        known = SliceStructure(deps=deps[p], splits=splits[p], fwd_counts=fcount[c0:c1],
                               fwd_bounds=fbounds[f0:f1], bwd_counts=bcount[u0:u1], bwd_bounds=bbounds[b0:b1],
                               cells=(cell_chunk[k0:k1] - c0, cell_unit[k0:k1] - u0, cell_tokens[k0:k1]))
        chunks = LazyChunks(c1 - c0, lambda c0=c0, c1=c1, f0=f0, f1=f1: segs.forward(c0, c1, f0, f1))
        units = LazyChunks(u1 - u0, lambda c0=c0, u0=u0, u1=u1, f0=f0, b0=b0, b1=b1, chunks=chunks:
                           segs.backward(chunks, u0, u1, f0, b0, b1))
        out.append((chunks, units, ready[u0:u1], known))
    return out


class LazyChunks(Sequence):
    """A list of chunks made on first use (len() needs none): the sweep simulates every
    candidate from its SliceStructure and keeps few, so most candidates' Segment and Chunk
    objects are never made. `materialize` (or any access but len) makes them."""

    def __init__(self, n: int, make):
        self._n, self._make, self._items = n, make, None

    def materialize(self) -> list[Chunk]:
        if self._items is None:
            self._items, self._make = self._make(), None
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self.materialize()[i]

    def __iter__(self):
        return iter(self.materialize())

    def __eq__(self, other) -> bool:
        return self.materialize() == (other.materialize() if isinstance(other, LazyChunks) else other)

    def __repr__(self) -> str:
        return repr(self.materialize())


def materialized(chunks):
    """A plain list of `chunks` (LazyChunks made; anything else as it is)."""
    return chunks.materialize() if isinstance(chunks, LazyChunks) else chunks


@dataclass(frozen=True, kw_only=True)
class _Segments:
    """Segment and Chunk objects of one streams_pieces batch, made stream by stream on demand:
    whole samples are the stream's shared objects, slices are made; a backward segment equal
    to the forward segment holding it is that object."""

    wholes: np.ndarray
    ids: np.ndarray
    part: np.ndarray
    fk: np.ndarray
    fa: np.ndarray
    fb: np.ndarray
    fcount: np.ndarray
    fi: np.ndarray
    bpart: np.ndarray
    sk: np.ndarray
    sa: np.ndarray
    sb: np.ndarray
    bcount: np.ndarray
    objects: dict = field(default_factory=dict)
    """Forward segment objects by the stream's first segment, for its backward units."""

    def forward(self, c0: int, c1: int, f0: int, f1: int) -> list[Chunk]:
        obj = self.wholes[self.fk[f0:f1]]
        part = np.flatnonzero(self.part[f0:f1]) + f0
        obj[part - f0] = _objects(list(map(Segment, self.ids[self.fk[part]].tolist(), self.fa[part].tolist(),
                                           self.fb[part].tolist())))
        self.objects[f0] = obj
        return _chunks(obj.tolist(), self.fcount[c0:c1])

    def backward(self, chunks: LazyChunks, u0: int, u1: int, f0: int, b0: int, b1: int) -> list[Chunk]:
        chunks.materialize()  # its segment objects
        obj = self.objects[f0][self.fi[b0:b1] - f0]
        part = np.flatnonzero(self.bpart[b0:b1]) + b0
        obj[part - b0] = _objects(list(map(Segment, self.ids[self.sk[part]].tolist(), self.sa[part].tolist(),
                                           self.sb[part].tolist())))
        return _chunks(obj.tolist(), self.bcount[u0:u1])


def _chunks(segs: list[Segment], counts: np.ndarray) -> list[Chunk]:
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return [Chunk(tuple(segs[i:j])) for i, j in zip(bounds[:-1], bounds[1:])]


def _objects(items: list) -> np.ndarray:
    """A numpy object array holding `items` (for gathering and scattering them with numpy)."""
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def _union(*arrays: np.ndarray) -> np.ndarray:
    """Sorted distinct values of int64 arrays."""
    e = np.sort(np.concatenate(arrays))
    return e[np.concatenate([[True], e[1:] != e[:-1]])]


def _grouped(rows: np.ndarray, cols: np.ndarray, n: int) -> list[tuple[int, ...]]:
    """Distinct (row, col) pairs, sorted, as one tuple of columns per row 0..n-1."""
    key = np.unique(rows * (int(cols.max(initial=0)) + 1) + cols) if len(rows) else np.zeros(0, np.int64)
    width = int(cols.max(initial=0)) + 1
    cols_l = (key % width).tolist()
    bounds = np.searchsorted(key // width, np.arange(n + 1)).tolist()
    return [tuple(cols_l[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _slice_structures(ids: np.ndarray, fk, fa, fb, fc, bk, ba, bu, bc, cstart, ustart, sstart):
    """Per stream, (Dependencies, split sequences): plan.schedules.dependencies and
    sim.memory.split_sequences of its chunks, read off the segments' order. Forward segments
    (fk, fa, fb, fc: global sample, start, stop, chunk) come in stream order, backward ones
    (bk, ba, bu, bc: sample, start, unit, forward chunk) in backward-stream order; cstart,
    ustart, sstart: each stream's first chunk, unit and sample. A forward segment starting
    inside its sample continues the segment just before it, in the chunk before (it is its
    chunk's first); a backward one starting inside its sample continues the one just after it
    in the backward stream (the sample's earlier tokens); each backward segment reads the
    forward MicroPack holding it."""
    P, C, U = len(cstart) - 1, int(cstart[-1]), int(ustart[-1])
    chunk_pipe = np.repeat(np.arange(P), np.diff(cstart))
    unit_pipe = np.repeat(np.arange(P), np.diff(ustart))
    fwd_after: list[tuple[int, ...]] = [()] * C
    cont = np.flatnonzero(fa > 0)
    for c, p in zip(fc[cont].tolist(), (fc[cont - 1] - cstart[chunk_pipe[fc[cont]]]).tolist()):
        fwd_after[c] = (p,)
    bcont = np.flatnonzero(ba > 0)
    prev_u, this_u = bu[bcont + 1], bu[bcont]
    link = prev_u != this_u
    bwd_after = _grouped(prev_u[link], this_u[link] - ustart[unit_pipe[this_u[link]]], U)
    bwd_needs = _grouped(bu, bc - cstart[chunk_pipe[bc]], U)
    deps = [Dependencies(fwd_after=tuple(fwd_after[cstart[p]:cstart[p + 1]]),
                         bwd_after=tuple(bwd_after[ustart[p]:ustart[p + 1]]),
                         bwd_needs=tuple(bwd_needs[ustart[p]:ustart[p + 1]])) for p in range(P)]
    # split sequences: samples cut by a forward boundary, in stream order, stream by stream
    cut = np.unique(fk[cont])
    is_cut = np.zeros(int(sstart[-1]) + 1, dtype=bool)
    is_cut[cut] = True
    sel = is_cut[bk]
    held = np.unique(bk[sel] * U + bu[sel])  # distinct (sample, unit): each sample's units ascending
    held_k, held_u = held // U, held % U
    earlier = np.flatnonzero(fk[:-1] == fk[1:])  # every forward segment but its sample's last
    last = np.searchsorted(fk, cut, side="right") - 1
    cut_pipe = np.searchsorted(sstart, cut, side="right") - 1
    qb = np.searchsorted(cut_pipe, np.arange(P + 1)).tolist()  # each stream's split sequences
    sl_pipe = chunk_pipe[fc[earlier]]
    sb = np.searchsorted(sl_pipe, np.arange(P + 1)).tolist()
    hb = np.searchsorted(unit_pipe[held_u], np.arange(P + 1)).tolist() if len(held_u) else [0] * (P + 1)
    seq_id = ids[cut]
    context, slices = fa[last], np.bincount(np.searchsorted(cut, fk[earlier]), minlength=len(cut))
    holders = np.bincount(np.searchsorted(cut, held_k), minlength=len(cut))
    slice_chunk, slice_tokens = fc[earlier] - cstart[sl_pipe], (fb - fa)[earlier]
    holder_unit = held_u - ustart[unit_pipe[held_u]]
    splits = [SplitArrays(seq_id=seq_id[qb[p]:qb[p + 1]], context=context[qb[p]:qb[p + 1]],
                          slices=slices[qb[p]:qb[p + 1]], slice_chunk=slice_chunk[sb[p]:sb[p + 1]],
                          slice_tokens=slice_tokens[sb[p]:sb[p + 1]], holders=holders[qb[p]:qb[p + 1]],
                          holder_unit=holder_unit[hb[p]:hb[p + 1]]) for p in range(P)]
    return deps, splits


def place_segments(chunks: list[Chunk], rank_of: dict[int, int]) -> list[Chunk]:
    """The chunks with each segment's cp_rank set from rank_of (SHARDED when absent): the same
    chunks when rank_of is empty."""
    if not rank_of:
        return chunks
    return [Chunk(tuple(Segment(s.seq_id, s.start, s.stop, rank_of.get(s.seq_id, SHARDED))
                        for s in c.segments), c.pad_to) for c in chunks]


def micropack_form(chunk: Chunk, lengths: list[int]) -> str:
    """'pack' (whole samples only), 'slim' (one slice of one sample) or 'mix' (§4 forms)."""
    whole = [s.start == 0 and s.stop == lengths[s.seq_id] for s in chunk.segments]
    if all(whole):
        return "pack"
    return "slim" if len(chunk.segments) == 1 else "mix"
