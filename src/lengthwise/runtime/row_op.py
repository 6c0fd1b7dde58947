"""A row's flash attention as a PyTorch operator, so a compiled region can hold several layers.

`attention.attend` is left out of every compiled graph (`compile.py`): its backends loop in
Python over a row's calls, which depend on the plan, and tracing them would guard on each
chunk's structure. As an operator (`torch.library.custom_op`) it is one opaque node that
dynamo and AOTAutograd trace through without looking inside: the region runs from one layer's
attention input to the next layer's and on, the operator's backward (another operator) sits in
the region's backward graph, and a layer costs one compiled call per few layers instead of two
each (`model._run_chain`). It serves the varlen kernels and a CPU's larger rows; a CPU's small
row is traced whole instead (`flash_cpu.dense_row`), which needs no operator at all.

What the operator cannot take as an argument, the row's structure (its `RowIndex`, the
kernels, the number of context pieces per segment), it finds by a *handle*, an int registered
for the chunk (`register`). The handle is a graph input like the token count (a symbolic int
under `dynamic=True`: a chunk with another handle runs the same graph), and AOTAutograd keeps
it for the backward graph. Handles start at 2: dynamo specialises the ints 0 and 1.

The registry holds a `RowCall` weakly; whoever runs the region keeps it alive as long as a
backward may still ask for it: `model._run_chain` puts it in the metadata of the region's
backward node, which autograd frees after the backward has run (or with the graph, if it never
runs).

The arithmetic is `flash_row`'s (`row_forward`, `row_backward`), the same calls in the same
order as the autograd Function the eager path runs; only copies differ: an operator's outputs
may not alias each other or its inputs and must have the strides its fake implementation
promises, so the output is made contiguous (the CPU kernel's is a heads-first view) and so is
each gradient. The saved tensors are the Function's: q, k, v, output, log-sum-exp and the
context pieces.

Tensor legend: T query tokens of the row, H query heads, G K/V heads, E head dim.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from lengthwise.runtime.flash_row import Kernels, row_backward, row_forward
from lengthwise.runtime.layout import RowIndex


@dataclass(eq=False)
class RowCall:
    """A chunk's row structure for the operator, found by `handle`."""

    kernels: Kernels
    index: RowIndex
    num_pieces: tuple[int, ...]
    """Context pieces (k, v pairs) of each segment, as `layout.unflatten_context` reads them."""
    handle: int = 0


_CALLS: weakref.WeakValueDictionary[int, RowCall] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(2)


def register(kernels: Kernels, index: RowIndex, num_pieces: tuple[int, ...]) -> RowCall:
    """A new handle for the row; the caller keeps the returned RowCall alive while it is needed."""
    call = RowCall(kernels, index, num_pieces, next(_HANDLES))
    _CALLS[call.handle] = call
    return call


def _lookup(handle: int) -> RowCall:
    call = _CALLS.get(handle)
    if call is None:  # an executor bug, not a user's: the region's node dropped its RowCall
        raise RuntimeError(f"flash_row operator: row {handle} is no longer registered")
    return call


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' log-sum-exp dtype: float32, float64 for a float64 row (CPU flash)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("lengthwise::flash_row", mutates_args=())
def flash_row(q: Tensor, k: Tensor, v: Tensor, flat: list[Tensor], handle: int) -> tuple[Tensor, Tensor]:
    """Output [T, H, E] and log-sum-exp [H, T] of the row registered as `handle`; `flat`: the
    context pieces k0, v0, k1, v1, ... segment after segment."""
    call = _lookup(handle)
    out_THE, lse_HT = row_forward(call.kernels, call.index, call.num_pieces, q, k, v, flat)
    return out_THE.contiguous(), lse_HT.contiguous()


@flash_row.register_fake
def _flash_row_fake(q, k, v, flat, handle):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("lengthwise::flash_row_backward", mutates_args=())
def flash_row_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, flat: list[Tensor],
                       handle: int) -> list[Tensor]:
    """dq, dk, dv, then the gradient of each context piece (`flat`'s order)."""
    call = _lookup(handle)
    dq, dk, dv, dflat = row_backward(call.kernels, call.index, call.num_pieces, g, q, k, v, out, lse, flat)
    return _apart([dq, dk, dv, *dflat])


@flash_row_backward.register_fake
def _flash_row_backward_fake(g, q, k, v, out, lse, flat, handle):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, *flat)]


def _apart(tensors: list[Tensor]) -> list[Tensor]:
    """Each contiguous and in storage of its own (the pieces of one context's gradient are
    split from one tensor)."""
    out, seen = [], set()
    for t in tensors:
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


def _setup_context(ctx, inputs, output):
    q, k, v, flat, handle = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *flat)
    ctx.handle = handle


def _backward(ctx, g_out, g_lse):
    q, k, v, out, lse, *flat = ctx.saved_tensors
    dq, dk, dv, *dflat = flash_row_backward(g_out, q, k, v, out, lse, flat, ctx.handle)
    return dq, dk, dv, dflat, None


flash_row.register_autograd(_backward, setup_context=_setup_context)
