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
    chunks = [c for i in todo for c in pipes[i].chunks]
    nc = np.array([len(pipes[i].chunks) for i in todo], dtype=np.int64)
    counts = np.fromiter(map(len, map(_SEGMENTS, chunks)), dtype=np.int64, count=len(chunks))
    segs = list(itertools.chain.from_iterable(map(_SEGMENTS, chunks)))
    flat = np.fromiter(itertools.chain.from_iterable(map(_SEGMENT_FIELDS, segs)), dtype=np.int64,
                       count=3 * len(segs)).reshape(len(segs), 3)
    seq, start, stop = flat[:, 0], flat[:, 1], flat[:, 2]
    chunk_pipe = np.repeat(np.arange(len(todo)), nc)
    gchunk = np.repeat(np.arange(len(chunks)), counts)           # each segment's chunk over all pipelines
    pipe = chunk_pipe[gchunk]
    chunk = gchunk - _first(nc)[pipe]                             # ... and within its pipeline
    seqs, ends = int(seq.max(initial=0)) + 1, int(stop.max(initial=0)) + 1
    if len(segs) and (int(seq.min()) < 0 or len(todo) * seqs * ends >= 2**62):
        return out
    seq_key = pipe * seqs + seq                                   # (pipeline, sequence)
    # each continuing slice's previous one: the chunk holding the segment of its sequence that ends
    # where it starts (the last such chunk, as dependencies' dictionary keeps it)
    end_key = seq_key * ends + stop
    order = np.argsort(end_key, kind="stable")
    cont = np.flatnonzero(start > 0)
    want = seq_key[cont] * ends + start[cont]
    at = np.searchsorted(end_key[order], want, side="right") - 1
    found = (at >= 0) & (end_key[order][np.maximum(at, 0)] == want)
    broken = set(pipe[cont[~found]].tolist())
    fwd_after: dict[int, list[int]] = {}                          # global chunk -> previous-slice chunks
    for g, c, p in zip(gchunk[cont[found]].tolist(), chunk[cont[found]].tolist(),
                       chunk[order[at[found]]].tolist()):
        if p != c:
            preds = fwd_after.setdefault(g, [])
            if p not in preds:
                preds.append(p)
    # split sequences: those with a slice starting after token 0 in the pipeline, with two or more
    # slices there, in order of first appearance; each one's slices by (start, stop, chunk)
    cut = np.flatnonzero(np.isin(seq_key, seq_key[cont]))
    cut = cut[np.lexsort((cut, seq_key[cut]))]                    # by sequence, then first appearance
    heads = np.flatnonzero(_changed(seq_key[cut]))
    parts = np.diff(np.r_[heads, len(cut)])
    seen = np.repeat(cut[heads], parts)                           # each slice's sequence's first segment
    many = np.repeat(parts >= 2, parts)
    cut, seen = cut[many], seen[many]
    cut = cut[np.lexsort((chunk[cut], stop[cut], start[cut], seen))]
    seen = np.sort(seen, kind="stable")
    heads = np.flatnonzero(_changed(seen))
    lasts = np.r_[heads[1:], len(cut)][:len(heads)] - 1
    earlier = np.ones(len(cut), dtype=bool)
    earlier[lasts] = False
    group = np.cumsum(_changed(seen)) - 1
    held = np.unique(group * (int(nc.max(initial=0)) + 1) + chunk[cut])   # distinct (sequence, chunk)
    held_q, held_c = np.divmod(held, int(nc.max(initial=0)) + 1)
    q_pipe = pipe[cut[heads]]
    qb = np.searchsorted(q_pipe, np.arange(len(todo) + 1)).tolist()
    sb = np.searchsorted(pipe[cut[earlier]], np.arange(len(todo) + 1)).tolist()
    hb = np.searchsorted(q_pipe[held_q], np.arange(len(todo) + 1)).tolist()
    seq_id, context = seq[cut[heads]], start[cut[lasts]]
    slices = np.diff(np.r_[heads, len(cut)]) - 1
    holders = np.bincount(held_q, minlength=len(heads))
    slice_chunk, slice_tokens = chunk[cut[earlier]], (stop - start)[cut[earlier]]
    cb = np.r_[_first(nc), len(chunks)].tolist()
    segb = np.r_[0, np.cumsum(counts)][cb].tolist()
    by_pipe: dict[int, list[int]] = {}
    for g in fwd_after:                                           # ascending chunks, pipeline by pipeline
        by_pipe.setdefault(int(chunk_pipe[g]), []).append(g)
    for k, i in enumerate(todo):
        if k in broken:
            continue
        C, base = int(nc[k]), cb[k]
        after = [()] * C
        nexts: list[list[int]] = [[] for _ in range(C)]
        for g in by_pipe.get(k, ()):
            after[g - base] = tuple(fwd_after[g])
            for p in fwd_after[g]:
                nexts[p].append(g - base)
        deps = Dependencies(fwd_after=tuple(after), bwd_after=tuple(tuple(n) for n in nexts),
                            bwd_needs=_self_needs(C))
        splits = SplitArrays(seq_id=seq_id[qb[k]:qb[k + 1]], context=context[qb[k]:qb[k + 1]],
                             slices=slices[qb[k]:qb[k + 1]], slice_chunk=slice_chunk[sb[k]:sb[k + 1]],
                             slice_tokens=slice_tokens[sb[k]:sb[k + 1]], holders=holders[qb[k]:qb[k + 1]],
                             holder_unit=held_c[hb[k]:hb[k + 1]])
        bounds = flat[segb[k]:segb[k + 1], 1:]
        own = counts[cb[k]:cb[k + 1]]
        out[i] = SliceStructure(deps=deps, splits=splits, fwd_counts=own, fwd_bounds=bounds, bwd_counts=own,
                                bwd_bounds=bounds)
    return out


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
