"""The segments of many chunks as int64 arrays, and the split sequences of many units found from
them at once: the vectorised form of `unit_costs.split_slices` and `unit_costs.kv_events`
(the same slices and the same sums, `tests/test_planner_infinipipe.py` checks it bit for bit).
Its own module because it is array bookkeeping on chunks alone, no costs: `UnitCosts.prepare`
walks every segment of a batch's units once through it instead of unit by unit in Python.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import Chunk

_SEGMENTS, _FIELDS = operator.attrgetter("segments"), operator.attrgetter("seq_id", "start", "stop")


@dataclass(frozen=True, kw_only=True)
class SegmentArrays:
    """Every segment of a list of chunks, chunk by chunk, as int64 arrays."""

    counts: np.ndarray
    """[chunk] its segments."""
    seq_id: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    @classmethod
    def of(cls, chunks: list[Chunk]) -> SegmentArrays:
        segments = list(itertools.chain.from_iterable(map(_SEGMENTS, chunks)))
        flat = np.fromiter(itertools.chain.from_iterable(map(_FIELDS, segments)), dtype=np.int64,
                           count=3 * len(segments)).reshape(len(segments), 3)
        return cls(counts=np.fromiter(map(len, map(_SEGMENTS, chunks)), dtype=np.int64, count=len(chunks)),
                   seq_id=flat[:, 0], start=flat[:, 1], stop=flat[:, 2])

    def works(self) -> tuple[list[int], list[int]] | None:
        """(Chunk.num_tokens, Chunk.attention_pairs) of every chunk, as int64 sums (exact: the
        same integers); None where a sum could leave int64."""
        start, stop = self.start, self.stop
        if len(stop) and int(stop.max()) ** 2 * len(stop) >= 2**62:
            return None
        ends = np.concatenate([[0], np.cumsum(self.counts)])
        per_chunk = lambda x: np.diff(np.concatenate([[0], np.cumsum(x)])[ends])
        return per_chunk(stop - start).tolist(), per_chunk((stop * (stop + 1) - start * (start + 1)) // 2).tolist()

    def split_parts(self, sizes: np.ndarray) -> SplitParts:
        """`split_slices` of every unit of more than one chunk (`sizes`: chunks per unit, the
        chunks being the units' in order), flat: sequences by unit, then by first appearance
        in it, each one's slices by (start, tokens, chunk), as `kv_events` walks them."""
        col = np.repeat(np.arange(len(self.counts)), self.counts)
        unit = np.repeat(np.arange(len(sizes)), sizes)[col]
        idx = np.flatnonzero(sizes[unit] > 1)
        by_seq = idx[np.lexsort((idx, self.seq_id[idx], unit[idx]))]
        heads = np.flatnonzero(_changes(unit[by_seq]) | _changes(self.seq_id[by_seq]))
        parts = np.diff(np.r_[heads, len(by_seq)])
        first_seen = np.repeat(by_seq[heads], parts)       # each segment's sequence's first segment in its unit
        keep = np.repeat(parts > 1, parts)
        sel, rank = by_seq[keep], first_seen[keep]
        tokens = self.stop[sel] - self.start[sel]
        order = np.lexsort((col[sel], tokens, self.start[sel], rank))
        sel, rank, tokens = sel[order], rank[order], tokens[order]
        starts = _changes(rank)
        heads = np.flatnonzero(starts)
        lasts = np.r_[heads[1:], len(sel)][:len(heads)] - 1
        earlier = np.ones(len(sel), dtype=bool)
        earlier[lasts] = False
        group = np.cumsum(starts) - 1
        return SplitParts(col=col[sel][earlier], tokens=tokens[earlier], group=group[earlier],
                          context=self.start[sel][lasts], last=col[sel][lasts], first=col[sel][heads])


def _changes(x: np.ndarray) -> np.ndarray:
    """bool [n]: where x differs from the element before (True at 0)."""
    out = np.ones(len(x), dtype=bool)
    out[1:] = x[1:] != x[:-1]
    return out


@dataclass(frozen=True, kw_only=True)
class SplitParts:
    """The slices of the split sequences of many units (SegmentArrays.split_parts)."""

    col: np.ndarray
    """[slice] chunk (column) of each slice but its sequence's last."""
    tokens: np.ndarray
    """[slice] its tokens."""
    group: np.ndarray
    """[slice] its sequence (0, 1, ... in order)."""
    context: np.ndarray
    """[sequence] start of its last slice."""
    last: np.ndarray
    """[sequence] chunk of its last slice."""
    first: np.ndarray
    """[sequence] chunk of its first slice."""

    def kv_rows(self, kv: np.ndarray, out: np.ndarray) -> None:
        """Add `kv_events` of every sequence (`kv`: float64 [sequence] K/V bytes of its context)
        into out[3, chunks], in kv_events' order (the same sums)."""
        g = self.group
        np.add.at(out[0], self.col, kv[g] * self.tokens / self.context[g])
        np.add.at(out[1], self.last, kv)
        np.add.at(out[2], self.first, -(2 * kv))
