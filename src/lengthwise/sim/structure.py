"""What the simulator reads off a pipeline's segments: its slice dependencies, its split
sequences and its cells, for every pipeline of a plan at once (numpy over all segments).

A SliceStructure is either handed over by a planner that knows it from its own cuts, or derived
here (`derived_structures`); `segment_cells` finds which backward unit holds which part of which
forward chunk when the backward units are not the chunks (SlimPack §4.1.2).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import Chunk, PipelinePlan
from lengthwise.plan.schedules import Dependencies
from lengthwise.sim.memory import SplitArrays


@dataclass(frozen=True, kw_only=True)
class SliceStructure:
    """What the simulator would otherwise read off one pipeline's segments, handed over by a
    planner that knows it from its own cuts: the slice dependencies, the split sequences and
    every segment's token range. Its chunks must be unpadded (pad_to 0)."""

    deps: Dependencies
    """dependencies(chunks, backward_chunks)."""
    splits: SplitArrays
    """split_sequences(chunks, backward units), as arrays."""
    fwd_counts: np.ndarray
    """int64 [chunk] segments of each forward chunk."""
    fwd_bounds: np.ndarray
    """int64 [segment, 2] (start, stop) of every forward segment, chunk by chunk, in order."""
    bwd_counts: np.ndarray
    """int64 [unit] segments of each backward unit."""
    bwd_bounds: np.ndarray
    """int64 [segment, 2] (start, stop) of every backward segment, unit by unit, in order."""
    cells: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """(chunk, unit, tokens) int64 arrays of every cell, the part of a forward chunk one backward
    unit holds, by chunk then unit (the order of the (chunk, unit) reads), where the backward
    units are not the chunks; None: read off the segments when needed."""



_SEGMENT_FIELDS = operator.attrgetter("seq_id", "start", "stop")


def segment_cells(chunks: list[Chunk], units: list[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk, unit, tokens) of every cell of these forward chunks and backward units, by chunk
    then unit: every backward segment lies in one forward segment of its sequence
    (`plan.validate.check_backward_units`), found by (sequence, start) order."""
    def table(xs):
        counts = np.fromiter((len(x.segments) for x in xs), dtype=np.int64, count=len(xs))
        flat = np.fromiter(itertools.chain.from_iterable(map(_SEGMENT_FIELDS, (s for x in xs for s in x.segments))),
                           dtype=np.int64, count=3 * int(counts.sum())).reshape(-1, 3)
        return np.repeat(np.arange(len(xs)), counts), flat
    owner_f, fwd = table(chunks)
    owner_b, bwd = table(units)
    order = np.lexsort((fwd[:, 1], fwd[:, 0]))
    keys = fwd[order, 0] * 2**32 + fwd[order, 1]
    holder = order[np.searchsorted(keys, bwd[:, 0] * 2**32 + bwd[:, 1], side="right") - 1]
    cell = owner_f[holder] * max(len(units), 1) + owner_b
    uniq, at = np.unique(cell, return_inverse=True)
    tokens = np.bincount(at, weights=(bwd[:, 2] - bwd[:, 1]).astype(np.float64), minlength=len(uniq))
    return uniq // max(len(units), 1), uniq % max(len(units), 1), tokens


def derived_structures(pipes: list[PipelinePlan], known: list[SliceStructure | None]) -> list[SliceStructure | None]:
    """The SliceStructure of every pipeline without one in `known` whose backward units are its
    chunks and whose chunks are unpadded, read off all of their segments at once: the same
    Dependencies as plan.schedules.dependencies and the same split sequences as
    sim.memory.split_sequences (as arrays). None elsewhere, and for a pipeline whose segments
    dependencies rejects (a slice continuing no other), which is left to it."""
    todo = [i for i, (p, k) in enumerate(zip(pipes, known))
            if k is None and p.backward_chunks is None and not any(c.pad_to for c in p.chunks)]
    out: list[SliceStructure | None] = [None] * len(pipes)
    if not todo:
        return out
    segs = _segment_table([pipes[i].chunks for i in todo])
    if segs is None:
        return out
    continuing = np.flatnonzero(segs.start > 0)
    previous, broken = _previous_slices(segs, continuing)
    splits = _split_arrays(segs, continuing)
    by_pipe: dict[int, list[int]] = {}
    for g in previous:                                            # ascending chunks, pipeline by pipeline
        by_pipe.setdefault(int(segs.chunk_pipe[g]), []).append(g)
    for k, i in enumerate(todo):
        if k in broken:
            continue
        lo, hi = segs.chunk_bounds[k], segs.chunk_bounds[k + 1]
        deps = _dependencies(int(segs.num_chunks[k]), lo, {g: previous[g] for g in by_pipe.get(k, ())})
        bounds = segs.fields[segs.segment_bounds[k]:segs.segment_bounds[k + 1], 1:]
        own = segs.counts[lo:hi]
        out[i] = SliceStructure(deps=deps, splits=splits[k], fwd_counts=own, fwd_bounds=bounds, bwd_counts=own,
                                bwd_bounds=bounds)
    return out


@dataclass(kw_only=True)
class _Segments:
    """Every segment of the chunks of some pipelines, pipeline by pipeline, chunk by chunk."""

    num_chunks: np.ndarray
    """int64 [pipeline] chunks."""
    counts: np.ndarray
    """int64 [chunk, over all pipelines] segments of each chunk."""
    fields: np.ndarray
    """int64 [segment, 3] (sequence, start, stop)."""
    chunk_pipe: np.ndarray
    """int64 [chunk, over all pipelines] its pipeline."""
    global_chunk: np.ndarray
    """int64 [segment] its chunk over all pipelines."""
    pipe: np.ndarray
    """int64 [segment] its pipeline."""
    chunk: np.ndarray
    """int64 [segment] its chunk within its pipeline."""
    seq_key: np.ndarray
    """int64 [segment] its (pipeline, sequence), as one number."""
    ends: int
    """One past the largest stop: (seq_key, token) pairs as seq_key * ends + token."""
    chunk_bounds: list[int]
    """[pipeline + 1] where each pipeline's chunks start in the chunk arrays."""
    segment_bounds: list[int]
    """[pipeline + 1] where each pipeline's segments start in the segment arrays."""

    @property
    def seq(self) -> np.ndarray:
        return self.fields[:, 0]

    @property
    def start(self) -> np.ndarray:
        return self.fields[:, 1]

    @property
    def stop(self) -> np.ndarray:
        return self.fields[:, 2]


def _segment_table(chunk_lists: list[list[Chunk]]) -> _Segments | None:
    """The segments of these pipelines' chunks as arrays; None where the (pipeline, sequence,
    token) keys would not fit int64 (or a sequence id is negative)."""
    chunks = [c for x in chunk_lists for c in x]
    num_chunks = np.array([len(x) for x in chunk_lists], dtype=np.int64)
    counts = np.fromiter(map(len, map(_SEGMENTS, chunks)), dtype=np.int64, count=len(chunks))
    segs = list(itertools.chain.from_iterable(map(_SEGMENTS, chunks)))
    fields = np.fromiter(itertools.chain.from_iterable(map(_SEGMENT_FIELDS, segs)), dtype=np.int64,
                         count=3 * len(segs)).reshape(len(segs), 3)
    seq, stop = fields[:, 0], fields[:, 2]
    chunk_pipe = np.repeat(np.arange(len(chunk_lists)), num_chunks)
    global_chunk = np.repeat(np.arange(len(chunks)), counts)
    pipe = chunk_pipe[global_chunk]
    seqs, ends = int(seq.max(initial=0)) + 1, int(stop.max(initial=0)) + 1
    if len(segs) and (int(seq.min()) < 0 or len(chunk_lists) * seqs * ends >= 2**62):
        return None
    chunk_bounds = np.r_[_first(num_chunks), len(chunks)].tolist()
    return _Segments(num_chunks=num_chunks, counts=counts, fields=fields, chunk_pipe=chunk_pipe,
                     global_chunk=global_chunk, pipe=pipe, chunk=global_chunk - _first(num_chunks)[pipe],
                     seq_key=pipe * seqs + seq, ends=ends, chunk_bounds=chunk_bounds,
                     segment_bounds=np.r_[0, np.cumsum(counts)][chunk_bounds].tolist())


def _previous_slices(segs: _Segments, continuing: np.ndarray) -> tuple[dict[int, list[int]], set[int]]:
    """({chunk over all pipelines: the chunks holding its slices' previous slices}, pipelines
    where a slice continues none). A continuing slice's previous one is the segment of its
    sequence that ends where it starts (the last such chunk, as dependencies' dictionary keeps
    it); a chunk holding both slices depends on nothing for it."""
    end_key = segs.seq_key * segs.ends + segs.stop
    order = np.argsort(end_key, kind="stable")
    want = segs.seq_key[continuing] * segs.ends + segs.start[continuing]
    at = np.searchsorted(end_key[order], want, side="right") - 1
    found = (at >= 0) & (end_key[order][np.maximum(at, 0)] == want)
    broken = set(segs.pipe[continuing[~found]].tolist())
    previous: dict[int, list[int]] = {}
    for g, c, p in zip(segs.global_chunk[continuing[found]].tolist(), segs.chunk[continuing[found]].tolist(),
                       segs.chunk[order[at[found]]].tolist()):
        if p != c:
            preds = previous.setdefault(g, [])
            if p not in preds:
                preds.append(p)
    return previous, broken


def _split_arrays(segs: _Segments, continuing: np.ndarray) -> list[SplitArrays]:
    """Per pipeline its split sequences (SplitArrays): those with a slice starting after token 0
    in the pipeline and two or more slices there, in order of first appearance; each one's
    slices by (start, stop, chunk), the last one its own (its context: where it starts)."""
    chunk, start, stop, seq_key = segs.chunk, segs.start, segs.stop, segs.seq_key
    cut = np.flatnonzero(np.isin(seq_key, seq_key[continuing]))
    cut = cut[np.lexsort((cut, seq_key[cut]))]                    # by sequence, then first appearance
    heads = np.flatnonzero(_changed(seq_key[cut]))
    parts = np.diff(np.r_[heads, len(cut)])
    seen = np.repeat(cut[heads], parts)                           # each slice's sequence's first segment
    many = np.repeat(parts >= 2, parts)
    cut, seen = cut[many], seen[many]
    cut = cut[np.lexsort((chunk[cut], stop[cut], start[cut], seen))]
    seen = np.sort(seen, kind="stable")
    heads = np.flatnonzero(_changed(seen))                        # each split sequence's first slice
    lasts = np.r_[heads[1:], len(cut)][:len(heads)] - 1           # ... and its last
    earlier = np.ones(len(cut), dtype=bool)
    earlier[lasts] = False
    group = np.cumsum(_changed(seen)) - 1
    width = int(segs.num_chunks.max(initial=0)) + 1
    held_q, held_c = np.divmod(np.unique(group * width + chunk[cut]), width)   # distinct (sequence, chunk)
    q_pipe = segs.pipe[cut[heads]]
    pipes = np.arange(len(segs.num_chunks) + 1)
    qb = np.searchsorted(q_pipe, pipes).tolist()
    sb = np.searchsorted(segs.pipe[cut[earlier]], pipes).tolist()
    hb = np.searchsorted(q_pipe[held_q], pipes).tolist()
    seq_id, context = segs.seq[cut[heads]], start[cut[lasts]]
    slices = np.diff(np.r_[heads, len(cut)]) - 1
    holders = np.bincount(held_q, minlength=len(heads))
    slice_chunk, slice_tokens = chunk[cut[earlier]], (stop - start)[cut[earlier]]
    return [SplitArrays(seq_id=seq_id[qb[k]:qb[k + 1]], context=context[qb[k]:qb[k + 1]],
                        slices=slices[qb[k]:qb[k + 1]], slice_chunk=slice_chunk[sb[k]:sb[k + 1]],
                        slice_tokens=slice_tokens[sb[k]:sb[k + 1]], holders=holders[qb[k]:qb[k + 1]],
                        holder_unit=held_c[hb[k]:hb[k + 1]])
            for k in range(len(segs.num_chunks))]


def _dependencies(num_chunks: int, base: int, previous: dict[int, list[int]]) -> Dependencies:
    """One pipeline's Dependencies from its chunks' previous-slice chunks (`previous`, keyed by
    chunk over all pipelines, `base` the pipeline's first): each backward unit is its chunk."""
    after = [()] * num_chunks
    nexts: list[list[int]] = [[] for _ in range(num_chunks)]
    for g, preds in previous.items():
        after[g - base] = tuple(preds)
        for p in preds:
            nexts[p].append(g - base)
    return Dependencies(fwd_after=tuple(after), bwd_after=tuple(tuple(n) for n in nexts),
                        bwd_needs=_self_needs(num_chunks))


_SEGMENTS = operator.attrgetter("segments")


def _changed(x: np.ndarray) -> np.ndarray:
    """bool [n]: where x differs from the element before (True at 0)."""
    out = np.ones(len(x), dtype=bool)
    out[1:] = x[1:] != x[:-1]
    return out


def _self_needs(n: int) -> tuple[tuple[int, ...], ...]:
    """bwd_needs when the backward units are the chunks: each reads its own."""
    return tuple((u,) for u in range(n))


def _first(sizes: np.ndarray) -> np.ndarray:
    """Where each block of `sizes` starts."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
