"""Algorithm 1's random trials (hydraulis §6.2, appendix D) for many strategies at once, one
sequence position per numpy step, each trial a row in its own random order.

The rows are laid end to end ("ragged"): a row holds exactly its strategy's pipelines, so a
2-pipeline strategy's trial costs 2 entries per step, not the widest strategy's count (auto's
proxy at 1024 GPUs x 32K sequences dispatches 280 trials whose strategies have 2 to 63
pipelines: 1,414 entries per step instead of 280 x 63 = 17,640 padded ones). Each row's choice,
the admissible pipeline with the least new bound, lowest index on ties, is found with a
segmented minimum (`np.minimum.reduceat`) and the first entry equal to it, the choice `argmin`
makes on a padded row. The arithmetic per entry is `dispatch.Precomputed`'s and the running eq. 2
terms' of the padded layout, in the same order, so the same floats and the same picks.
"""

from __future__ import annotations

import numpy as np

from lengthwise.planners.hydraulis.arrays import PipelineArrays

BLOCK_ENTRIES = 1 << 20
"""w(l) is precomputed for about this many (step, row, pipeline) entries at a time."""


class RaggedRows:
    """Rows of stacked strategies end to end: row r holds the pipelines of strategy row_of[r]."""

    def __init__(self, strategies: list[PipelineArrays], row_of: np.ndarray):
        widths = np.asarray([strategies[c].size for c in row_of], dtype=np.int64)
        self.rows = len(row_of)
        self.starts = np.r_[0, np.cumsum(widths)[:-1]].astype(np.int64)
        self.seg = np.repeat(np.arange(self.rows), widths)
        """Row of every entry."""
        pick = lambda name: np.concatenate([getattr(strategies[c], name) for c in row_of])
        self.chunk_s, self.max_len = pick("chunk_s"), pick("max_len")
        self.depth_less_one = pick("depth") - 1
        # each row's distinct (attn_s, token_s, chunk_s), end to end: w(l) is worked out once per
        # (step, row, scheme of the row), then spread to the row's pipelines by index
        local = [np.unique(np.stack([s.attn_s, s.token_s, s.chunk_s], axis=1), axis=0, return_inverse=True)
                 for s in strategies]
        schemes = np.asarray([len(local[c][0]) for c in row_of], dtype=np.int64)
        first_scheme = np.r_[0, np.cumsum(schemes)[:-1]]
        table = np.concatenate([local[c][0] for c in row_of])
        self.attn_s, self.token_s, self.scheme_chunk_s = table[:, 0], table[:, 1], table[:, 2]
        self.scheme_row = np.repeat(np.arange(self.rows), schemes)
        self.column = np.concatenate([first_scheme[r] + local[c][1].ravel() for r, c in enumerate(row_of)])
        """The (row, scheme) column of every entry."""

    @property
    def size(self) -> int:
        return len(self.seg)

    def block(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For lengths [step, row]: each entry's length, w(l), w(l) + c and admissibility
        [step, entry], w per (step, row's scheme) then spread by index (the elementwise
        arithmetic of PipelineArrays.seq_time, so the same floats)."""
        lengths = lengths.astype(np.float64)
        l = lengths.take(self.scheme_row, axis=1)
        w = self.attn_s * l * (l + 1) / 2 + self.token_s * l
        w_plus_c = w + self.scheme_chunk_s
        at_entry = lengths.take(self.seg, axis=1)
        return (at_entry, w.take(self.column, axis=1), w_plus_c.take(self.column, axis=1),
                self.max_len >= at_entry)


def random_trials(strategies: list[PipelineArrays], row_of: np.ndarray, lengths: np.ndarray,
                  orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 for rows of `strategies` (row r: strategy row_of[r], sequences in orders[r]):
    each sequence onto the admissible pipeline whose eq. 2 bound it raises least, which is the
    admissible pipeline with the least new bound, lowest index on ties (bounds only grow, so the
    top pipeline's new bound is at least the row's largest and any other's largest after the
    move is max(its new bound, the row's largest): both orders agree). Returns the owner
    (pipeline index within the row's strategy) of every sequence per row and each row's largest
    bound."""
    g = RaggedRows(strategies, row_of)
    rows, n = orders.shape
    sum_w, sum_l, fill = (np.zeros(g.size) for _ in range(3))
    first = np.zeros(rows)
    owner = np.zeros((rows, n), dtype=np.int64)
    row_ids = np.arange(rows)
    block = max(1, min(n, BLOCK_ENTRIES // max(g.size, 1)))
    chunks = np.empty(g.size)
    for k0 in range(0, n, block):
        seqs = orders[:, k0:k0 + block].T.copy()  # [step, row]
        ls, ws, wcs, admissible = g.block(lengths[seqs])
        all_fit = admissible.all(axis=1).tolist()
        picks = np.empty(seqs.shape, dtype=np.int64)
        for s in range(len(seqs)):
            # T(longest) after adding: max(fill, w + c), as fill is T of the longest held (0 when
            # empty) and T grows with l; then sum_w + w + c ceil((sum_l + l) / MaxLen) + fill (PP - 1)
            fill_new = np.maximum(fill, wcs[s])
            with_w = sum_w + ws[s]
            tokens = sum_l + ls[s]
            np.divide(tokens, g.max_len, out=chunks)
            np.ceil(chunks, out=chunks)
            chunks *= g.chunk_s
            new = with_w + chunks
            np.multiply(fill_new, g.depth_less_one, out=chunks)
            new += chunks
            if not all_fit[s]:
                new = np.where(admissible[s], new, np.inf)
            least = np.minimum.reduceat(new, g.starts)
            hits = np.flatnonzero(new == least[g.seg])
            pick = picks[s] = hits[np.searchsorted(hits, g.starts)]  # the first entry at its row's least
            sum_w[pick], sum_l[pick], fill[pick] = with_w[pick], tokens[pick], fill_new[pick]
            first = np.maximum(first, least)
        owner[row_ids, seqs] = picks - g.starts
    return owner, first
