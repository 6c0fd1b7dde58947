"""Attention over one chunk: each segment causal over its context and itself, nothing across
segments (`layout.py` says how a row is laid out). One function, `attend`, several backends:

- `reference`: torch SDPA over the whole row with the row's explicit mask; runs everywhere,
  any dtype; the yardstick for the others. The kernel takes one packed K (and V) for the row,
  so a segment's context view is concatenated with the row's own keys here (`pack_keys`),
  a copy the other backends avoid. (SDPA's own `is_causal` aligns top-left when
  queries are fewer than keys, wrong for a slice with context, hence the mask.) It scores every
  query against every key of the row: twice the work causality needs for one document, far
  more for a row of many short ones. Its scores are recomputed in backward instead of kept, so
  saved memory is O(T) plus the context pieces (which are the K/V state itself).
- `cpu-flash` and `varlen`: flash attention in one row structure (`flash_row.py`): one causal
  call over the row's own keys, one call per segment with context over the state store's view
  of its K/V, merged by log-sum-exp; no packing copy. `cpu-flash` takes CPU flash-attention
  calls (`flash_cpu.py`; CPU, any float dtype); `varlen` PyTorch's varlen flash operators
  (`flash_varlen.py`; CUDA, bf16/fp16, and under fake tensors for a dry run).
- `auto`: varlen where it runs, else cpu-flash where it runs, else reference.

`layout` is the chunk's `ChunkLayout` or its `RowIndex` (`layout.py`): the executor builds the
index once per chunk and every layer reuses it; given a ChunkLayout, an index is built per call.

Tensor legend: T query tokens of the row, K keys (contexts included), H query heads, G K/V
heads, E head dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lengthwise.errors import UserError
import lengthwise.runtime.flash_cpu as flash_cpu
import lengthwise.runtime.flash_row as flash_row
from lengthwise.runtime.flash_varlen import VarlenKernels, varlen_ops
from lengthwise.runtime.layout import (ChunkLayout, RowIndex, as_index, context_pieces, layout_of, pack_keys,
                                      unflatten_context)

BACKENDS = ("auto", "reference", "cpu-flash", "varlen")


@torch.compiler.disable  # data-dependent Python over the row's calls; autograd Functions of private kernels
def attend(q_THE, k_TGE, v_TGE, context, layout: ChunkLayout | RowIndex, *, backend: str = "auto") -> torch.Tensor:
    """Attention output [T, H, E] of one chunk.

    `context[i]` lists segment i's earlier (k, v) pieces [c, G, E] from other chunks, oldest
    first; with the row's own earlier slices (layout.row_context) they make layout.ctx_lens[i]
    tokens. The stage passes at most one piece from its state store, a view of the
    sequence's K/V buffer (`state.py`); context parallelism may add the segment's gathered
    prefix as a second."""
    context = context_pieces(context)
    if callable(backend):  # a distributed attention (runtime/distributed/cp.py) that calls back here
        return backend(q_THE, k_TGE, v_TGE, context, layout)
    backend = resolve_backend(backend, q_THE.device, q_THE.dtype)
    num_pieces = tuple(len(pieces) for pieces in context)
    flat = [t for pieces in context for kv in pieces for t in kv]
    if backend in ("varlen", "cpu-flash"):
        varlen = backend == "varlen"
        index = as_index(layout, q_THE.device, varlen=varlen)
        kernels = _varlen_kernels() if varlen else flash_cpu.KERNELS
        return flash_row.attend(kernels, index, num_pieces, q_THE, k_TGE, v_TGE, *flat)
    return _RecomputedSDPA.apply(layout_of(layout), num_pieces, q_THE, k_TGE, v_TGE, *flat)


def row_kernels(backend, device, dtype: torch.dtype) -> flash_row.Kernels | None:
    """The flash-row kernels `backend` runs on (`cpu-flash`, `varlen`, or `auto` resolving to
    one), or None: the reference backend, or a distributed attention."""
    if callable(backend):
        return None
    backend = resolve_backend(backend, device, dtype)
    if backend == "varlen":
        return _varlen_kernels()
    return flash_cpu.KERNELS if backend == "cpu-flash" else None


def wants_varlen_index(attention) -> bool:
    """Whether a row attended by `attention` (a resolved backend name, or a distributed
    attention with a `backend`) needs the varlen index tensors in its RowIndex."""
    return (attention if isinstance(attention, str) else getattr(attention, "backend", None)) == "varlen"


def resolve_backend(backend: str, device, dtype: torch.dtype) -> str:
    """`auto` -> varlen, cpu-flash or reference, the first that runs here; a forced one that
    cannot run -> UserError. Under fake tensors (a dry run) varlen runs anywhere: its operators
    have fake implementations."""
    if backend not in BACKENDS:
        raise UserError(f"unknown attention backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if varlen_unavailable_reason(device, dtype) is None:
            return "varlen"
        return "cpu-flash" if flash_cpu.unavailable_reason(device, dtype) is None else "reference"
    if backend == "varlen" and varlen_ops() is not None and torch._guards.detect_fake_mode() is not None:
        return backend
    checks = {"varlen": varlen_unavailable_reason, "cpu-flash": flash_cpu.unavailable_reason}
    reason = checks[backend](device, dtype) if backend in checks else None
    if reason:
        raise UserError(f"attention backend {backend} is unavailable: {reason}; use --backend reference")
    return backend


def varlen_unavailable_reason(device, dtype) -> str | None:
    """Why the varlen kernel cannot run here, or None when it can."""
    if varlen_ops() is None:
        return f"this torch ({torch.__version__}) has no varlen flash-attention operators (torch.nn.attention.varlen)"
    if torch.device(device).type != "cuda":
        return f"it needs a CUDA device, the model is on {torch.device(device).type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it needs bfloat16 or float16, the model is {str(dtype).removeprefix('torch.')}"
    return None


@functools.cache
def _varlen_kernels() -> VarlenKernels:
    return VarlenKernels()


def _sdpa_masked(layout: ChunkLayout, num_pieces, q_THE, k_TGE, v_TGE, *flat) -> torch.Tensor:
    """The `reference` backend: one SDPA call over the whole row with the row's mask."""
    context = unflatten_context(flat, num_pieces)
    k_KGE = pack_keys(k_TGE, [[kv[0] for kv in p] for p in context], layout)
    v_KGE = pack_keys(v_TGE, [[kv[1] for kv in p] for p in context], layout)
    return _sdpa(q_THE, k_KGE, v_KGE, layout.bias(q_THE.device, q_THE.dtype), q_THE.shape[1] != k_KGE.shape[1])


def _sdpa(q_THE, k_KGE, v_KGE, bias, gqa: bool) -> torch.Tensor:
    """SDPA on [tokens, heads, dim] tensors; causal (square) when bias is None."""
    out_1HTE = F.scaled_dot_product_attention(
        q_THE.transpose(0, 1)[None], k_KGE.transpose(0, 1)[None], v_KGE.transpose(0, 1)[None],
        attn_mask=bias, is_causal=bias is None, enable_gqa=gqa)
    return out_1HTE[0].transpose(0, 1)


class _RecomputedSDPA(torch.autograd.Function):
    """The reference's masked SDPA, saving only its inputs and recomputing scores in backward,
    so a chunk holds O(T) attention memory whatever its context length (as flash kernels do)."""

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
