"""Deterministic, resumable global batches of sequences.

The sampler reads a stream of sequences and cuts it into global batches, either a fixed number
of sequences (`batch_size`) or as many as fit a token budget (`token_budget`, the way Hydraulis
§8 sizes an iteration by tokens). Its whole position is one integer, the stream cursor, so
`state_dict()` / `load_state_dict()` resume a run with no sequence skipped or repeated.

The stream, for a seed s:
- finite source of N sequences: epoch e is the permutation `default_rng([s, e]).permutation(N)`;
  position p is sequence perm_{p // N}[p % N]. Batches run across epoch boundaries.
- profile: block j of 1024 lengths is drawn with `default_rng([s, j])`; position p is entry
  p % 1024 of block p // 1024 and its seq_id is p itself.
Both depend only on (seed, position), never on how the stream was cut before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lengthwise.errors import UserError
from lengthwise.workloads.source import LengthSource

_BLOCK = 1024  # profile draws per random block; part of the stream definition above


@dataclass(frozen=True, kw_only=True)
class GlobalBatch:
    """One optimizer step's sequences."""

    index: int
    """Step number, counting from 0 at the start of the stream."""
    seq_ids: tuple[int, ...]
    """Index of each sequence in the file/corpus (profiles: its stream position)."""
    lengths: tuple[int, ...]
    """Length of each sequence (tokens)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


class GlobalBatchSampler:
    """Cuts a source's seeded stream into global batches by count or by token budget."""

    def __init__(self, source: LengthSource, *, seed: int = 0, batch_size: int | None = None,
                 token_budget: int | None = None):
        if (batch_size is None) == (token_budget is None):
            raise UserError("give exactly one of a batch size (sequences) or a token budget")
        size = batch_size if batch_size is not None else token_budget
        if size < 1:
            raise UserError(f"batch size / token budget {size} must be at least 1")
        if seed < 0:
            raise UserError(f"seed {seed} must be >= 0")
        self.source, self.seed = source, seed
        self.batch_size, self.token_budget = batch_size, token_budget
        self._cursor, self._num_batches = 0, 0
        self._cache: dict[tuple[str, int], np.ndarray] = {}
        self._check_budget_fits()

    def _check_budget_fits(self):
        if self.token_budget is None:
            return
        if self.source.is_finite:
            longest = int(self.source.lengths.max())
        else:
            longest = min(self.source.profile.max_length, self.source.context_length or 1 << 62)
        if longest > self.token_budget:
            raise UserError(f"token budget {self.token_budget} is below the longest sequence "
                            f"({longest} tokens); raise the budget or lower --context-length")

    def state_dict(self) -> dict:
        """Everything needed to resume: pass it to load_state_dict of a fresh sampler."""
        return {"cursor": self._cursor, "num_batches": self._num_batches, "seed": self.seed,
                "batch_size": self.batch_size, "token_budget": self.token_budget}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "token_budget"):
            if state[key] != getattr(self, key):
                raise UserError(f"checkpoint sampler has {key}={state[key]} but this run has "
                                f"{getattr(self, key)}; resume with the same value")
        self._cursor, self._num_batches = int(state["cursor"]), int(state["num_batches"])

    def __iter__(self):
        while True:
            yield self.next_batch()

    def next_batch(self) -> GlobalBatch:
        if self.batch_size is not None:
            count = self.batch_size
        else:
            count = self._count_within_budget()
        seq_ids, lengths = self._stream(self._cursor, self._cursor + count)
        batch = GlobalBatch(index=self._num_batches, seq_ids=tuple(int(i) for i in seq_ids),
                            lengths=tuple(int(n) for n in lengths))
        self._cursor += count
        self._num_batches += 1
        return batch

    def _count_within_budget(self) -> int:
        # Take sequences in stream order while the running total stays within the budget.
        count, used, window = 0, 0, 256
        while True:
            _, lengths = self._stream(self._cursor + count, self._cursor + count + window)
            totals = used + np.cumsum(lengths)
            fits = int(np.searchsorted(totals, self.token_budget, side="right"))
            count += fits
            if fits < window:
                return count
            used = int(totals[-1])

    def _stream(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(seq_ids, lengths) at stream positions [start, stop)."""
        positions = np.arange(start, stop)
        if not self.source.is_finite:
            lengths = np.concatenate([self._profile_block(j) for j in
                                      range(start // _BLOCK, (stop - 1) // _BLOCK + 1)])
            return positions, lengths[positions - (start // _BLOCK) * _BLOCK]
        size = self.source.lengths.size
        rows = np.concatenate([self._epoch_order(e) for e in
                               range(start // size, (stop - 1) // size + 1)])
        rows = rows[positions - (start // size) * size]
        return self.source.seq_ids[rows], self.source.lengths[rows]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return self._cached(("epoch", epoch), lambda: np.random.default_rng(
            [self.seed, epoch]).permutation(self.source.lengths.size))

    def _profile_block(self, block: int) -> np.ndarray:
        return self._cached(("block", block), lambda: self.source.draw(
            _BLOCK, np.random.default_rng([self.seed, block])))

    def _cached(self, key, make) -> np.ndarray:
        if key not in self._cache:
            if len(self._cache) > 8:  # only the last few epochs/blocks are ever re-read
                self._cache.clear()
            self._cache[key] = make()
        return self._cache[key]
