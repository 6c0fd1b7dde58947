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
(streams_cuts, and `pieces.streams_pieces`: every sample start and every forward and backward
boundary of every stream sorted into elementary intervals, each one segment; the sweep's path,
which also hands the simulator the slice structure it would otherwise re-derive from the
segments).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import SHARDED, Chunk, Segment


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
