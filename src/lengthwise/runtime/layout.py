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

Also here: each layout's mask as SDPA's additive bias (cached while small), the packing of
a segment's keys from its context pieces and the row's own K/V (the `reference` backend's
copy), and `RowIndex`, the index tensors of a row's flash calls, built once per chunk on its
device and read by every layer. No backend lives here (`attention.py` dispatches to them).

Tensor legend: T query tokens of the row, K keys (contexts included), G K/V heads, E head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

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

    @property
    def context_segments(self) -> tuple[int, ...]:
        """Segments with a context (each gets its own call over its context keys)."""
        return tuple(i for i, c in enumerate(self.ctx_lens) if c)

    def mask(self, device) -> torch.Tensor:
        """Boolean [T, K], True where a query may attend a key."""
        seg_q = _segment_ids(self.q_lens, device)
        seg_k = _segment_ids(self.k_lens, device)
        q_index = _index_within(self.q_lens, device)
        k_index = _index_within(self.k_lens, device)
        ctx = _ints(self.ctx_lens, device)[seg_q]
        same_segment = seg_q[:, None] == seg_k[None, :]
        return same_segment & (k_index[None, :] <= (ctx + q_index)[:, None])

    @property
    def store_lens(self) -> tuple[int, ...]:
        """Context tokens of each segment that come from the state store: its context less the
        row's earlier slices of its sequence, which end it."""
        q_lens = self.q_lens
        return tuple(c - sum(q_lens[j] for j in rows) for c, rows in zip(self.ctx_lens, self.row_context))

    def dense_mask(self, device) -> torch.Tensor:
        """Boolean [T, C + T], True where a query may attend a key, over the keys laid out as
        `flash_cpu.dense_row` joins them: every segment's store context (C tokens, segment
        after segment), then the row's own keys as they are. A query sees its segment's store
        context, the row's earlier slices of its sequence, and its own slice's keys up to itself.
        Example, `7[4:6]+2[0:3]`: C = 4; query 0 of 7 sees keys 0..4, query 1 sees 0..5, query 0
        of 2 sees key 6 only (as `mask`, whose columns are ordered [context_0, own_0, ...])."""
        seg_q = _segment_ids(self.q_lens, device)
        seg_store = _segment_ids(self.store_lens, device)
        num = len(self.q_lens)
        earlier = _ints([int(j in rows) for rows in self.row_context for j in range(num)], device).view(num, num)
        rows = torch.arange(sum(self.q_lens), device=device)
        own = ((seg_q[:, None] == seg_q[None, :]) & (rows[None, :] <= rows[:, None])) | earlier.bool()[seg_q][:, seg_q]
        return torch.cat([seg_q[:, None] == seg_store[None, :], own], dim=1)

    @property
    def dense_entries(self) -> int:
        """Entries of `dense_mask`: queries x (store context + queries)."""
        tokens = sum(self.q_lens)
        return tokens * (sum(self.store_lens) + tokens)

    def dense_bias(self, device, dtype: torch.dtype) -> torch.Tensor:
        """`dense_mask` as an additive bias, cached as `bias` is."""
        device = torch.device(device)
        if self.dense_entries > _BIAS_CACHE_ENTRIES:
            return self._build_bias(device, dtype, dense=True)
        return _cached_bias(self, device, dtype, dense=True)

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

    def _build_bias(self, device, dtype: torch.dtype, dense: bool = False) -> torch.Tensor:
        mask = self.dense_mask(device) if dense else self.mask(device)
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))


_BIAS_CACHE_SIZE = 64
"""Layouts whose biases are kept: more than the chunks (or cpu-flash's groups of short
documents) a pipeline usually has in flight, so a step's backward still finds its forward's."""
_BIAS_CACHE_ENTRIES = 1 << 20
"""Largest bias cached: 1M entries (4 MiB in float32), e.g. a 1K-token row."""


@functools.lru_cache(maxsize=_BIAS_CACHE_SIZE)
def _cached_bias(layout: ChunkLayout, device: torch.device, dtype: torch.dtype, dense: bool = False) -> torch.Tensor:
    return layout._build_bias(device, dtype, dense)


def clear_bias_cache() -> None:
    """Forget every cached bias (a run under fake tensors must not keep or reuse them)."""
    _cached_bias.cache_clear()


def _segment_ids(lens, device) -> torch.Tensor:
    # output_size: the length is known, so the shape does not depend on data (fake tensors)
    return torch.repeat_interleave(torch.arange(len(lens), device=device),
                                   _ints(lens, device), output_size=sum(lens))


def _index_within(lens, device) -> torch.Tensor:
    """0..len-1 for each segment, concatenated."""
    starts = _ints([0, *accumulate(lens)][:-1], device)
    total = sum(lens)
    return torch.arange(total, device=device) - torch.repeat_interleave(starts, _ints(lens, device),
                                                                               output_size=total)


@dataclass(frozen=True, kw_only=True, eq=False)
class ContextCall:
    """A flash call of one segment's queries against every key of its context (no mask: each
    of its queries sees all of them)."""

    segment: int
    lo: int
    """Row position of the segment's first query."""
    hi: int
    num_keys: int
    """Context tokens (ChunkLayout.ctx_lens of the segment): the call's max key length."""
    cu_q: torch.Tensor | None
    """[0, hi - lo] (int32, on the row's device; varlen kernels only)."""
    cu_k: torch.Tensor | None
    """[0, num_keys] (likewise)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RowIndex:
    """What a row's flash calls need beyond q, k and v, built once per chunk and passed to
    every layer: the layer loop then builds no index tensor and copies nothing to the device.

    A flash row is one causal call over the row's own keys (cu_seqlens = cu_q for queries and
    keys: a segment's own keys are its own rows, so k is the row's k as it is, no packing) and,
    per segment with a context, one call against that context (the state store's view of the
    sequence's K/V buffer, `state.py`), merged by log-sum-exp. Example, `7[4:6]+2[0:3]`:

        cu_q = [0, 2, 5], max_q = 3            own call: causal, queries and keys alike
        context_calls = (segment 0: rows 0:2 against 4 context keys, cu_q [0, 2], cu_k [0, 4])

    Max lengths are Python ints from the plan, so no kernel call reads a device tensor on the
    host. On a CPU (`cu_q` None) the kernels take the same calls from the layout."""

    layout: ChunkLayout
    cu_q: torch.Tensor | None
    """Cumulative query lengths [S + 1] (int32, on the row's device; varlen kernels only)."""
    max_q: int
    """Longest segment of the row."""
    context_calls: tuple[ContextCall, ...]
    rng_state: torch.Tensor | None
    """The flash kernels' dropout RNG state (unused: no dropout), allocated once per row."""

    @classmethod
    def build(cls, layout: ChunkLayout, device, *, varlen: bool) -> RowIndex:
        """All of the row's index tensors from one host list, in one (pinned, asynchronous) copy."""
        device = torch.device(device)
        offsets = layout.q_offsets
        segments = layout.context_segments
        if varlen:
            host = [offsets] + [part for i in segments for part in ([0, layout.q_lens[i]], [0, layout.ctx_lens[i]])]
            cu_q, *pairs = _index_tensors(host, device)
        else:
            cu_q, pairs = None, [None] * (2 * len(segments))
        calls = tuple(ContextCall(segment=i, lo=offsets[i], hi=offsets[i + 1], num_keys=layout.ctx_lens[i],
                                  cu_q=pairs[2 * n], cu_k=pairs[2 * n + 1]) for n, i in enumerate(segments))
        rng = torch.zeros(2, dtype=torch.uint64, device=device) if varlen else None
        return cls(layout=layout, cu_q=cu_q, max_q=max(layout.q_lens, default=0), context_calls=calls, rng_state=rng)


def _index_tensors(host: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int32 tensors on `device` from lists of host ints, in one copy (through pinned memory to
    a GPU, so the copy does not wait for the device). Under fake tensors (a dry run): fake
    tensors that carry their values (`.constant`), so FLOP counters can read the lengths."""
    mode = torch._guards.detect_fake_mode()
    if mode is not None:
        with unset_fake_temporarily():
            reals = [torch.tensor(values, dtype=torch.int32) for values in host]
        return [mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True) for real in reals]
    flat = torch.tensor([v for values in host for v in values], dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        flat = flat.to(device)
    sizes = [len(values) for values in host]
    return list(flat.split(sizes))


def _ints(values, device) -> torch.Tensor:
    """int64 tensor on `device` from host ints, copied as `_index_tensors` copies (not waited for)."""
    return _index_tensors([list(values)], torch.device(device))[0].long()


def as_index(layout, device, *, varlen: bool) -> RowIndex:
    """`layout` itself when it is already a RowIndex (built by the stage), else one built now
    (a caller outside the executor, e.g. a test or the profiler)."""
    if isinstance(layout, RowIndex):
        return layout
    return RowIndex.build(layout, device, varlen=varlen)


def layout_of(layout) -> ChunkLayout:
    """The ChunkLayout of a ChunkLayout or RowIndex."""
    return layout.layout if isinstance(layout, RowIndex) else layout


class LayerContext:
    """One layer's context pieces per segment (`attention.attend`'s `context`) in an opaque
    holder: a compiled layer (`compile.py`) hands it to attention without looking inside, so
    it guards on nothing of a chunk's structure and does not recompile per plan."""

    __slots__ = ("pieces",)

    def __init__(self, pieces):
        self.pieces = pieces


def context_pieces(context) -> list:
    """The per-segment pieces of a LayerContext or of a plain list."""
    return context.pieces if isinstance(context, LayerContext) else context


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
