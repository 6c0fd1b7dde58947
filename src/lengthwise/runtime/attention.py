"""Attention over one chunk: per-document causal masking, with each slice's K/V context.

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

Backends, chosen by `backend=`:
- `reference`: torch SDPA with that explicit boolean mask; runs everywhere, any dtype. (SDPA's
  own `is_causal` aligns top-left when queries are fewer than keys, wrong for a slice with
  context, hence the mask.) Its scores [T, keys] are recomputed in backward instead of kept,
  so saved memory is O(T) plus the context pieces (which are the K/V state itself), like a
  flash kernel's.
- `varlen`: `torch.nn.attention.varlen.varlen_attn` (flash attention), CUDA, bf16/fp16.
- `auto`: varlen where it runs, else reference.

Tensor legend: T query tokens of the row, K keys (contexts included), H query heads, G K/V
heads, E head dim.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk

BACKENDS = ("auto", "reference", "varlen")


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
        """Boolean [T, K], True where a query may attend a key. Built once per chunk, not per
        layer: rebuilding it in every layer's forward and recompute made a slice cost 9 ms of
        CPU more than its share (benchmarks/bench_split_overhead.py)."""
        return _layout_mask(self, torch.device(device))

    def _build_mask(self, device) -> torch.Tensor:
        seg_q = _segment_ids(self.q_lens, device)
        seg_k = _segment_ids(self.k_lens, device)
        q_index = _index_within(self.q_lens, device)
        k_index = _index_within(self.k_lens, device)
        ctx = torch.tensor(self.ctx_lens, device=device)[seg_q]
        same_segment = seg_q[:, None] == seg_k[None, :]
        return same_segment & (k_index[None, :] <= (ctx + q_index)[:, None])


@functools.lru_cache(maxsize=4)  # a few chunks in flight; a 32K-row mask is 1 GiB, so keep few
def _layout_mask(layout: ChunkLayout, device: torch.device) -> torch.Tensor:
    return layout._build_mask(device)


def _segment_ids(lens, device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lens), device=device),
                                   torch.tensor(lens, device=device))


def _index_within(lens, device) -> torch.Tensor:
    """0..len-1 for each segment, concatenated."""
    starts = torch.tensor([0, *accumulate(lens)][:-1], device=device)
    total = sum(lens)
    return torch.arange(total, device=device) - torch.repeat_interleave(starts, torch.tensor(lens, device=device))


def pack_keys(own_TGE: torch.Tensor, context, layout: ChunkLayout) -> torch.Tensor:
    """[context_0, own_0, context_1, own_1, ...] along tokens: the key (or value) row."""
    offsets = layout.q_offsets
    parts = []
    for i, pieces in enumerate(context):
        parts.extend(pieces)
        parts.extend(own_TGE[offsets[j]:offsets[j + 1]] for j in layout.row_context[i])
        parts.append(own_TGE[offsets[i]:offsets[i + 1]])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def attend(q_THE, k_TGE, v_TGE, context, layout: ChunkLayout, *, backend: str = "auto") -> torch.Tensor:
    """Attention output [T, H, E] of one chunk.

    `context[i]` lists segment i's earlier (k, v) pieces [c, G, E] from other chunks, oldest
    first; with the row's own earlier slices (layout.row_context) they make layout.ctx_lens[i]
    tokens."""
    if callable(backend):  # a distributed attention (runtime/distributed/cp.py) that calls back here
        return backend(q_THE, k_TGE, v_TGE, context, layout)
    backend = resolve_backend(backend, q_THE.device, q_THE.dtype)
    if backend == "varlen":
        return _varlen(q_THE, k_TGE, v_TGE, context, layout)
    num_pieces = tuple(len(pieces) for pieces in context)
    flat = [t for pieces in context for kv in pieces for t in kv]
    return _RecomputedSDPA.apply(layout, num_pieces, q_THE, k_TGE, v_TGE, *flat)


def resolve_backend(backend: str, device, dtype: torch.dtype) -> str:
    """`auto` -> varlen where it runs, else reference; a forced one that cannot run -> UserError."""
    if backend not in BACKENDS:
        raise UserError(f"unknown attention backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "varlen" if varlen_unavailable_reason(device, dtype) is None else "reference"
    if backend == "varlen":
        reason = varlen_unavailable_reason(device, dtype)
        if reason:
            raise UserError(f"attention backend varlen is unavailable: {reason}; use --backend reference")
    return backend


def varlen_unavailable_reason(device, dtype) -> str | None:
    """Why the varlen kernel cannot run here, or None when it can."""
    if _varlen_fn() is None:
        return f"this torch ({torch.__version__}) has no torch.nn.attention.varlen.varlen_attn"
    if torch.device(device).type != "cuda":
        return f"it needs a CUDA device, the model is on {torch.device(device).type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it needs bfloat16 or float16, the model is {str(dtype).removeprefix('torch.')}"
    return None


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen(q_THE, k_TGE, v_TGE, context, layout: ChunkLayout) -> torch.Tensor:
    """Flash varlen attention; each segment is one 'sequence' of the kernel, with its context
    prepended to its keys. Flash aligns causal masks bottom-right, which is what a slice with
    context needs."""
    fn = _varlen_fn()
    k_KGE = pack_keys(k_TGE, [[kv[0] for kv in p] for p in context], layout)
    v_KGE = pack_keys(v_TGE, [[kv[1] for kv in p] for p in context], layout)
    cu_q, cu_k = layout.cu_seqlens(q_THE.device)
    params = inspect.signature(fn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q_THE.shape[1] != k_KGE.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older kernels need as many K/V heads as query heads
            repeat = q_THE.shape[1] // k_KGE.shape[1]
            k_KGE, v_KGE = k_KGE.repeat_interleave(repeat, 1), v_KGE.repeat_interleave(repeat, 1)
    return fn(q_THE, k_KGE, v_KGE, cu_q, cu_k, max(layout.q_lens), max(layout.k_lens), **kwargs)


def _sdpa_masked(layout: ChunkLayout, num_pieces, q_THE, k_TGE, v_TGE, *flat) -> torch.Tensor:
    context = _unflatten(flat, num_pieces)
    k_KGE = pack_keys(k_TGE, [[kv[0] for kv in p] for p in context], layout)
    v_KGE = pack_keys(v_TGE, [[kv[1] for kv in p] for p in context], layout)
    out_1HTE = F.scaled_dot_product_attention(
        q_THE.transpose(0, 1)[None], k_KGE.transpose(0, 1)[None], v_KGE.transpose(0, 1)[None],
        attn_mask=layout.mask(q_THE.device), enable_gqa=q_THE.shape[1] != k_KGE.shape[1])
    return out_1HTE[0].transpose(0, 1)


def _unflatten(flat, num_pieces) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    context, at = [], 0
    for n in num_pieces:
        context.append([(flat[at + 2 * j], flat[at + 2 * j + 1]) for j in range(n)])
        at += 2 * n
    return context


class _RecomputedSDPA(torch.autograd.Function):
    """Masked SDPA that saves only its inputs and recomputes scores in backward, so a chunk
    holds O(T) attention memory whatever its context length (as flash kernels do)."""

    @staticmethod
    def forward(ctx, layout, num_pieces, q_THE, k_TGE, v_TGE, *flat):
        ctx.layout, ctx.num_pieces = layout, num_pieces
        ctx.save_for_backward(q_THE, k_TGE, v_TGE, *flat)
        with torch.no_grad():
            return _sdpa_masked(layout, num_pieces, q_THE, k_TGE, v_TGE, *flat)

    @staticmethod
    def backward(ctx, grad_THE):
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[2:])]
        # The recomputed graph lives only inside this backward, like a fused kernel's
        # workspace: identity hooks keep it out of any saved-tensor accounting around us.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out_THE = _sdpa_masked(ctx.layout, ctx.num_pieces, *inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out_THE, wanted, grad_THE))
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
