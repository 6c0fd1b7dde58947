"""The segment invariants of a plan (validate.py's 2, 3, 4 and 6) as arrays over every segment at
once: a pass that says whether they all hold, so a valid plan is not walked segment by segment
in Python (at 1024 GPUs x 32,768 sequences that walk was about half of validation).

It answers True only when every one of validate.py's checks of these invariants would pass
(the same conditions, written over arrays); anything else, including input it does not expect,
is False, and validate.py then runs its own checks, which name what is wrong. So the errors
and their order are validate.py's alone.
"""

from __future__ import annotations

import numpy as np

from lengthwise.plan.arrays import segment_fields
from lengthwise.plan.ir import SHARDED, StepPlan


def segments_hold(plan: StepPlan) -> bool:
    """Whether every chunk and backward unit is non-empty and unpadded below zero, every segment
    in its sequence and on a CP rank of its pipeline, a sequence's slices ascend within a row,
    all slices of a sequence are in one pipeline, the forward chunks (and the backward units)
    hold every token once, and the chunks hold the batch's loss tokens."""
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    if not len(lengths) or int(lengths.min()) < 1 or int(lengths.max()) >= 2**40:
        return False
    fwd = _table(plan, backward=False)
    if fwd is None or not _each_segment_fits(plan, fwd, lengths) or not _covers(fwd, lengths):
        return False
    if any(p.backward_chunks is not None for p in plan.pipelines):
        bwd = _table(plan, backward=True)
        if bwd is None or not _each_segment_fits(plan, bwd, lengths) or not _covers(bwd, lengths):
            return False
        owners = np.concatenate([fwd[1], bwd[1]]), np.concatenate([fwd[0], bwd[0]])
    else:
        owners = fwd[1], fwd[0]
    if not _one_pipeline_each(*owners):
        return False
    seq, start, stop = fwd[1], fwd[2], fwd[3]
    loss = np.maximum(0, np.minimum(stop, lengths[seq] - 1) - start).sum()
    recorded = plan.metrics.get("loss_tokens")
    return int(loss) == plan.loss_tokens and (recorded is None or recorded == plan.loss_tokens)


def _table(plan: StepPlan, *, backward: bool):
    """(pipeline, sequence, start, stop, CP rank, row) of every segment of the forward chunks
    (or of every pipeline's backward units), row numbered over all pipelines; None where a row
    is empty or padded below zero."""
    rows = [c for p in plan.pipelines for c in (p.bwd_units if backward else p.chunks)]
    counts, fields = segment_fields(rows)
    if (counts == 0).any() or any(c.pad_to < 0 for c in rows):
        return None
    per_pipe = [len(p.bwd_units if backward else p.chunks) for p in plan.pipelines]
    row = np.repeat(np.arange(len(rows)), counts)
    pipe = np.repeat(np.repeat(np.arange(len(plan.pipelines)), per_pipe), counts)
    return pipe, fields[:, 0], fields[:, 1], fields[:, 2], fields[:, 3], row


def _each_segment_fits(plan: StepPlan, table, lengths: np.ndarray) -> bool:
    """validate._check_segment and _check_slices_ascend_in_chunk for every segment."""
    pipe, seq, start, stop, rank, row = table
    if len(seq) and (int(seq.min()) < 0 or int(seq.max()) >= len(lengths)):
        return False
    cp = np.array([p.cp for p in plan.pipelines], dtype=np.int64)[pipe]
    if not ((0 <= start) & (start < stop) & (stop <= lengths[seq])).all():
        return False
    if not ((rank == SHARDED) | ((0 <= rank) & (rank < cp))).all():
        return False
    # within a row, each slice of a sequence starts at or after the previous one's stop
    order = np.lexsort((seq, row))            # by row, then sequence, in segment order (stable)
    same = (row[order][1:] == row[order][:-1]) & (seq[order][1:] == seq[order][:-1])
    return bool((start[order][1:][same] >= stop[order][:-1][same]).all())


def _covers(table, lengths: np.ndarray) -> bool:
    """validate._check_coverage: each sequence's slices, sorted, tile [0, length) exactly."""
    _, seq, start, stop, _, _ = table
    order = np.lexsort((stop, start, seq))
    seq, start, stop = seq[order], start[order], stop[order]
    if len(np.unique(seq)) != len(lengths):
        return False
    first = np.r_[True, seq[1:] != seq[:-1]]
    last = np.r_[seq[1:] != seq[:-1], True]
    follows = start[1:][~first[1:]] == stop[:-1][~first[1:]]
    return bool((start[first] == 0).all() and follows.all() and (stop[last] == lengths[seq[last]]).all())


def _one_pipeline_each(seq: np.ndarray, pipe: np.ndarray) -> bool:
    """validate._check_one_pipeline_per_sequence: every segment of a sequence in one pipeline."""
    lo = np.full(int(seq.max(initial=-1)) + 1, np.iinfo(np.int64).max)
    hi = np.full(len(lo), -1)
    np.minimum.at(lo, seq, pipe)
    np.maximum.at(hi, seq, pipe)
    used = hi >= 0
    return bool((lo[used] == hi[used]).all())
