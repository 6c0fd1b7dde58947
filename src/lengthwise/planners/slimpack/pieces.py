"""SlimPack's forward MicroPacks and backward units of many streams at once, by numpy
(slimpack.txt §4.1.1 Phase 2, §4.1.2), from the cuts of `cuts.py`: the sweep's path.

The streams are laid end to end (each one's cuts shifted by the tokens before it) and cut at
every sample start and forward and backward boundary into elementary intervals, each one
segment; the same MicroPacks as the pointer walks of `cuts.py` (forward_chunks,
backward_units_ready), which a stream with an empty MicroPack still takes. Read off the same
sorted positions come what the simulator would otherwise re-derive from the segments: the
PackFlow readiness, the slice dependencies and the split sequences (a SliceStructure per
stream), so most candidates' Segment and Chunk objects are never made (LazyChunks).

Its own module because it is a second, vectorised implementation of what `cuts.py` defines
one stream at a time, with bookkeeping (object arrays, per-stream offsets) of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lengthwise.plan.ir import Chunk, Segment
from lengthwise.plan.schedules import Dependencies
from lengthwise.planners.slimpack.cuts import Stream, backward_units_ready, forward_chunks
from lengthwise.sim.inputs import SliceStructure
from lengthwise.sim.memory import SplitArrays


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
