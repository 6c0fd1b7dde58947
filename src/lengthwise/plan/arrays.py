"""A plan's segments as int64 arrays, for the checks and metrics that read every segment of a
large plan (32,768 sequences and more): one pass over the Segment objects at C speed, then
numpy, instead of a Python loop per segment.

    counts, fields = segment_fields(chunks)   # counts [chunk]; fields [segment, 4]
    seq, start, stop, cp_rank = fields.T
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from lengthwise.plan.ir import Chunk

_SEGMENTS = operator.attrgetter("segments")
_FIELDS = operator.attrgetter("seq_id", "start", "stop", "cp_rank")


def segment_fields(rows: list[Chunk]) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [row] segments of each row, int64 [segment, 4] every segment's (sequence, start,
    stop, CP rank), row by row in order)."""
    counts = np.fromiter(map(len, map(_SEGMENTS, rows)), dtype=np.int64, count=len(rows))
    flat = itertools.chain.from_iterable(map(_FIELDS, itertools.chain.from_iterable(map(_SEGMENTS, rows))))
    return counts, np.fromiter(flat, dtype=np.int64, count=4 * int(counts.sum())).reshape(-1, 4)


def row_sums(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """int64 [row] the sum of each row's segments' `values` (int64 [segment]), exact."""
    ends = np.cumsum(np.r_[0, values], dtype=np.int64)
    bounds = np.r_[0, np.cumsum(counts)]
    return ends[bounds[1:]] - ends[bounds[:-1]]


def causal_pairs(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """int64 [segment] causal (query, key) pairs of each segment (flops.causal_keys), exact while
    stop < 2**31."""
    return (stop * (stop + 1) - start * (start + 1)) // 2
