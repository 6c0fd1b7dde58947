"""A strategy's pipelines as parallel numpy arrays: what both dispatchers read (the
longest-first rows of `dispatch.py` and the random trials of `trials.py`), in a module of its
own so that neither dispatcher imports the other for it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from lengthwise.planners.hydraulis.cost import Scheme


@dataclass(frozen=True)
class PipelineArrays:
    """The pipelines of one strategy as parallel arrays, MaxLen descending (§6.2's P_1..P_D);
    [rows, pipelines] when strategies are stacked for dispatch."""

    attn_s: np.ndarray
    token_s: np.ndarray
    chunk_s: np.ndarray
    depth: np.ndarray
    max_len: np.ndarray
    """Longest micro-batch per pipeline, tokens (the strategy-level MaxLen)."""

    @classmethod
    def of(cls, schemes: list[Scheme], max_lens: list[int]) -> PipelineArrays:
        assert all(a >= b for a, b in itertools.pairwise(max_lens)), "pipelines must come MaxLen descending"
        pick = lambda xs: np.asarray(xs, dtype=np.float64)
        return cls(pick([s.attn_s for s in schemes]), pick([s.token_s for s in schemes]),
                   pick([s.chunk_s for s in schemes]), pick([s.pp for s in schemes]), pick(max_lens))

    @property
    def size(self) -> int:
        return len(self.max_len)

    def take(self, rows: np.ndarray) -> PipelineArrays:
        """The stacked rows `rows` (see _stack)."""
        return PipelineArrays(self.attn_s[rows], self.token_s[rows], self.chunk_s[rows], self.depth[rows],
                              self.max_len[rows])

    def seq_time(self, lengths: np.ndarray) -> np.ndarray:
        """w_j(l) for every (row, pipeline): lengths broadcast against the pipeline axis."""
        l = lengths[..., None].astype(np.float64)
        return self.attn_s * l * (l + 1) / 2 + self.token_s * l
