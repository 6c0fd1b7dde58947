"""Flash attention over one chunk, shared by the `cpu-flash` and `varlen` backends: the row's
own keys in one causal call, each segment's context in one more call, merged by log-sum-exp.

    out, lse = own call over the row          causal per segment, k = the row's k as it is
    for each segment with a context:          rows lo:hi against its context keys, no mask
        out, lse[lo:hi] = merge(context call, own call's rows)

The context keys are the state store's view of the sequence's K/V buffer (`state.py`) as
they are: nothing is concatenated per layer, neither the context to the row's keys nor the
row's segments to each other. Only a context of several parts (a row's earlier slice of the
same sequence, or a CP segment's gathered prefix, after the store's view) is joined. Merge:
lse = logaddexp(lse_1, lse_2), out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2 (the
identity ring attention rests on). Backward runs each call's backward with the merged output
and log-sum-exp, which yields that call's exact share of the gradients (its probabilities are
rebuilt as exp(score - merged lse)), so the work is what causality asks and the memory saved
is O(T): inputs, output and log-sum-exp.

The calls' index tensors come from the chunk's `RowIndex` (built once per chunk, read by
every layer). The kernels differ by device (`Kernels`): CPU flash calls per segment or group
of short segments (`flash_cpu.py`), or the varlen flash op on CUDA (`flash_varlen.py`); the
structure above, and so the indexing, is the same, which is how CPU tests exercise the CUDA
path's (with a reference varlen op, tests/test_flash_row.py).

Tensor legend: T query tokens of the row, t of one call, K keys, H query heads, G K/V heads,
E head dim.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Protocol

import torch

from lengthwise.runtime.layout import ContextCall, RowIndex, cat_tokens, key_parts, unflatten_context


class Kernels(Protocol):
    """One device's flash calls. Outputs [t, H, E], log-sum-exps [H, t]."""

    def own(self, q_THE, k_TGE, v_TGE, index: RowIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """Every segment causal over its own keys."""
        ...

    def own_backward(self, g_THE, q_THE, k_TGE, v_TGE, out_THE, lse_HT, index: RowIndex):
        """dq, dk, dv of the own call, given the merged output and log-sum-exp."""
        ...

    def context(self, q_tHE, k_KGE, v_KGE, call: ContextCall) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment's queries against all of its context keys."""
        ...

    def context_backward(self, g_tHE, q_tHE, k_KGE, v_KGE, out_tHE, lse_Ht, call: ContextCall, index: RowIndex):
        ...


def attend(kernels: Kernels, index: RowIndex, num_pieces: tuple[int, ...], q_THE, k_TGE, v_TGE, *flat):
    """Attention output [T, H, E]; `flat` holds each segment's context (k, v) pieces in order
    (`layout.unflatten_context`)."""
    return _FlashRow.apply(kernels, index, num_pieces, q_THE, k_TGE, v_TGE, *flat)


def merge_into(out_tHE, lse_Ht, other) -> None:
    """Merge another call's (output, log-sum-exp) over disjoint keys of the same queries into
    `out_tHE` and `lse_Ht` (rows of the own call's, written in place). The weighted sum runs in
    the log-sum-exp's dtype (type promotion widens a bf16 output) and is rounded once, on the
    write."""
    out_b, lse_b = other
    lse = torch.logaddexp(lse_Ht, lse_b)
    weight_a, weight_b = ((x - lse).exp_().t().unsqueeze(-1) for x in (lse_Ht, lse_b))
    out_tHE.copy_(weight_a * out_tHE + weight_b * out_b)
    lse_Ht.copy_(lse)


def _context_keys(call: ContextCall, index: RowIndex, own_TGE, pieces) -> torch.Tensor:
    """The segment's context keys (or values): the store's pieces, then the row's earlier
    slices of the sequence; one view when there is one part (the usual case)."""
    if len(pieces) == 1 and not index.layout.row_context[call.segment]:
        return pieces[0]
    return cat_tokens(key_parts(own_TGE, pieces, index.layout, call.segment)[:-1])


def row_forward(kernels: Kernels, index: RowIndex, num_pieces: tuple[int, ...], q_THE, k_TGE, v_TGE, flat):
    """Output [T, H, E] and log-sum-exp [H, T] of the row: the own call, each context call
    merged into its rows."""
    context = unflatten_context(flat, num_pieces)
    out_THE, lse_HT = kernels.own(q_THE, k_TGE, v_TGE, index)  # fresh: the merge writes rows of them
    for call in index.context_calls:
        pieces = context[call.segment]
        k = _context_keys(call, index, k_TGE, [kv[0] for kv in pieces])
        v = _context_keys(call, index, v_TGE, [kv[1] for kv in pieces])
        lo, hi = call.lo, call.hi
        merge_into(out_THE[lo:hi], lse_HT[:, lo:hi], kernels.context(q_THE[lo:hi], k, v, call))
    return out_THE, lse_HT


def row_backward(kernels: Kernels, index: RowIndex, num_pieces: tuple[int, ...], g_THE, q_THE, k_TGE, v_TGE,
                 out_THE, lse_HT, flat):
    """dq, dk, dv and the context pieces' gradients (`flat`'s order) given the output's
    gradient and the merged output and log-sum-exp."""
    g_THE = g_THE if g_THE.is_contiguous() else g_THE.contiguous()
    dq, dk, dv = kernels.own_backward(g_THE, q_THE, k_TGE, v_TGE, out_THE, lse_HT, index)
    context = unflatten_context(flat, num_pieces)
    first_piece = [2 * n for n in accumulate(num_pieces, initial=0)]
    dflat: list[torch.Tensor | None] = [None] * len(flat)
    for call in index.context_calls:
        lo, hi, pieces = call.lo, call.hi, context[call.segment]
        k = _context_keys(call, index, k_TGE, [kv[0] for kv in pieces])
        v = _context_keys(call, index, v_TGE, [kv[1] for kv in pieces])
        gq, gk, gv = kernels.context_backward(g_THE[lo:hi], q_THE[lo:hi], k, v, out_THE[lo:hi],
                                              lse_HT[:, lo:hi], call, index)
        dq[lo:hi] += gq
        _context_grads(call, index, pieces, gk, gv, dk, dv, dflat, first_piece[call.segment])
    return dq, dk, dv, dflat


class _FlashRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels, index, num_pieces, q_THE, k_TGE, v_TGE, *flat):
        out_THE, lse_HT = row_forward(kernels, index, num_pieces, q_THE, k_TGE, v_TGE, flat)
        ctx.kernels, ctx.index, ctx.num_pieces = kernels, index, num_pieces
        ctx.save_for_backward(q_THE, k_TGE, v_TGE, out_THE, lse_HT, *flat)
        return out_THE

    @staticmethod
    def backward(ctx, g_THE):
        q_THE, k_TGE, v_TGE, out_THE, lse_HT, *flat = ctx.saved_tensors
        dq, dk, dv, dflat = row_backward(ctx.kernels, ctx.index, ctx.num_pieces, g_THE, q_THE, k_TGE, v_TGE,
                                         out_THE, lse_HT, flat)
        return None, None, None, dq, dk, dv, *dflat


def _context_grads(call: ContextCall, index: RowIndex, pieces, gk_KGE, gv_KGE, dk_TGE, dv_TGE, dflat, at: int):
    """Hand a context call's dk, dv to its parts: the store's pieces (their slots of `dflat`,
    set once: a segment has one context call) and the row's earlier slices (added into dk, dv)."""
    layout = index.layout
    if len(pieces) == 1 and not layout.row_context[call.segment]:  # the usual case: the store's view alone
        dflat[at], dflat[at + 1] = gk_KGE, gv_KGE
        return
    sizes = [kv[0].shape[0] for kv in pieces] + [layout.q_lens[j] for j in layout.row_context[call.segment]]
    gk_parts, gv_parts = gk_KGE.split(sizes), gv_KGE.split(sizes)
    for j in range(len(pieces)):
        dflat[at + 2 * j], dflat[at + 2 * j + 1] = gk_parts[j], gv_parts[j]
    offsets = layout.q_offsets
    for j, row in enumerate(layout.row_context[call.segment]):
        dk_TGE[offsets[row]:offsets[row + 1]] += gk_parts[len(pieces) + j]
        dv_TGE[offsets[row]:offsets[row + 1]] += gv_parts[len(pieces) + j]
