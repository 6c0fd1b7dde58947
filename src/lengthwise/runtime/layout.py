"""How a chunk's packed row is laid out for attention: which keys each query may see.

A chunk packs segments end to end. Segment i has q_i query tokens and a context of c_i earlier
tokens of its own sequence (c_i = segment.start, whose K/V come from the state store). Its keys
are laid out as [context_i, own_i], c_i + q_i of them, and query j of the segment sees keys
0 .. c_i + j: causal, aligned bottom-right (the last query sees every key). Nothing crosses
segments. Example, segments `7[4:6]+2[0:3]`:

    q_lens   = (2, 3)      cu_q = [0, 2, 5]
    ctx_lens = (4, 0)      cu_k = [0, 6, 9]     keys: 4 context + 2 own, then 3 own
    query 0 of 7 sees keys 0..4, query 1 sees 0..5; query 0 of 2 sees key 6 only.

When a row holds two slices of one sequence (`3[0:4]+3[4:6]`), the later one's context ends
with the earlier one's own K/V from the same row (`row_context`), so its keys are
[store pieces, earlier slices of this row, own].

Also here: each layout's mask as SDPA's additive bias (cached while small) and the packing of
a segment's keys from its context pieces and the row's own K/V. No backend lives here
(`attention.py` dispatches to them).

Tensor legend: T query tokens of the row, K keys (contexts included), G K/V heads, E head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch

from lengthwise.plan.ir import Chunk


@dataclass(frozen=True, kw_only=True)
class ChunkLayout:
    """Where each segment of a chunk sits in the packed row."""

    q_lens: tuple[int, ...]
    """Query tokens of each segment, in row order."""
    ctx_lens: tuple[int, ...]
    """Context tokens (earlier tokens of the same sequence) of each segment."""
    row_context: tuple[tuple[int, ...], ...]
    """Per segment, the earlier segments of the same row and sequence (indices), which
    end its context."""

    @classmethod
    def from_chunk(cls, chunk: Chunk) -> ChunkLayout:
        segs = chunk.segments
        return cls(q_lens=tuple(s.num_tokens for s in segs), ctx_lens=tuple(s.start for s in segs),
                   row_context=tuple(tuple(j for j in range(i) if segs[j].seq_id == s.seq_id)
                                     for i, s in enumerate(segs)))

    @property
    def k_lens(self) -> tuple[int, ...]:
        return tuple(q + c for q, c in zip(self.q_lens, self.ctx_lens))

    @property
    def q_offsets(self) -> list[int]:
        """Row position of each segment's first token, and the row length last."""
        return [0, *accumulate(self.q_lens)]

    def cu_seqlens(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Cumulative query and key lengths (int32), the varlen kernels' description."""
        cu_q = torch.tensor([0, *accumulate(self.q_lens)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *accumulate(self.k_lens)], dtype=torch.int32, device=device)
        return cu_q, cu_k

    def mask(self, device) -> torch.Tensor:
        """Boolean [T, K], True where a query may attend a key."""
        seg_q = _segment_ids(self.q_lens, device)
        seg_k = _segment_ids(self.k_lens, device)
        q_index = _index_within(self.q_lens, device)
        k_index = _index_within(self.k_lens, device)
        ctx = torch.tensor(self.ctx_lens, device=device)[seg_q]
        same_segment = seg_q[:, None] == seg_k[None, :]
        return same_segment & (k_index[None, :] <= (ctx + q_index)[:, None])

    def bias(self, device, dtype: torch.dtype) -> torch.Tensor:
        """The mask as SDPA's additive bias [T, K]: 0 where a query may attend, -inf elsewhere
        (what SDPA would turn a boolean mask into on every call).

        Small biases are cached per layout, since all layers of a chunk, forward and backward,
        use the same one: rebuilding the mask in every layer made a short slice cost 9 ms of
        CPU more than its share (benchmarks/bench_split_overhead.py). Large ones are rebuilt,
        which costs little next to their attention and bounds the cache at
        `_BIAS_CACHE_SIZE` x `_BIAS_CACHE_ENTRIES` entries."""
        device = torch.device(device)
        if sum(self.q_lens) * sum(self.k_lens) > _BIAS_CACHE_ENTRIES:
            return self._build_bias(device, dtype)
        return _cached_bias(self, device, dtype)

    def _build_bias(self, device, dtype: torch.dtype) -> torch.Tensor:
        bias = torch.zeros(sum(self.q_lens), sum(self.k_lens), dtype=dtype, device=device)
        return bias.masked_fill_(~self.mask(device), float("-inf"))


_BIAS_CACHE_SIZE = 64
"""Layouts whose biases are kept: more than the chunks (or cpu-flash's groups of short
documents) a pipeline usually has in flight, so a step's backward still finds its forward's."""
_BIAS_CACHE_ENTRIES = 1 << 20
"""Largest bias cached: 1M entries (4 MiB in float32), e.g. a 1K-token row."""


@functools.lru_cache(maxsize=_BIAS_CACHE_SIZE)
def _cached_bias(layout: ChunkLayout, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return layout._build_bias(device, dtype)


def clear_bias_cache() -> None:
    """Forget every cached bias (a run under fake tensors must not keep or reuse them)."""
    _cached_bias.cache_clear()


def _segment_ids(lens, device) -> torch.Tensor:
    # output_size: the length is known, so the shape does not depend on data (fake tensors)
    return torch.repeat_interleave(torch.arange(len(lens), device=device),
                                   torch.tensor(lens, device=device), output_size=sum(lens))


def _index_within(lens, device) -> torch.Tensor:
    """0..len-1 for each segment, concatenated."""
    starts = torch.tensor([0, *accumulate(lens)][:-1], device=device)
    total = sum(lens)
    return torch.arange(total, device=device) - torch.repeat_interleave(starts, torch.tensor(lens, device=device),
                                                                               output_size=total)


def pack_keys(own_TGE: torch.Tensor, context, layout: ChunkLayout) -> torch.Tensor:
    """[context_0, own_0, context_1, own_1, ...] along tokens: the key (or value) row."""
    return cat_tokens([part for i, pieces in enumerate(context) for part in key_parts(own_TGE, pieces, layout, i)])


def key_parts(own_TGE: torch.Tensor, pieces, layout: ChunkLayout, i: int) -> list[torch.Tensor]:
    """Segment i's keys (or values): its context pieces from the store, the row's earlier
    slices of its sequence, its own."""
    offsets = layout.q_offsets
    return [*pieces, *(own_TGE[offsets[j]:offsets[j + 1]] for j in layout.row_context[i]),
            own_TGE[offsets[i]:offsets[i + 1]]]


def cat_tokens(parts: list[torch.Tensor]) -> torch.Tensor:
    """Tensors joined along tokens (no copy for one)."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unflatten_context(flat, num_pieces) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per segment, its (k, v) context pieces, from the flat list an autograd Function takes
    (k0, v0, k1, v1, ... segment after segment) and each segment's number of pieces."""
    context, at = [], 0
    for n in num_pieces:
        context.append([(flat[at + 2 * j], flat[at + 2 * j + 1]) for j in range(n)])
        at += 2 * n
    return context
