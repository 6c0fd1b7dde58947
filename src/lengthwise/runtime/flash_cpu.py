"""The `cpu-flash` attention backend: CPU flash attention over only the keys each query may see.

PyTorch's CPU flash-attention kernel (the operator SDPA runs on a CPU) returns each query's
log-sum-exp with its output, and with `is_causal` skips the blocks above a square's diagonal.
A row is cut into kernel calls (`_row_calls`):

- a segment without context: one causal call over its own keys (a square, so the kernel's
  top-left alignment is the right one);
- consecutive short segments without context, at most `GROUP_TOKENS` together: one call under
  their block-diagonal bias (one call beats many tiny ones);
- a segment with context: one call over its context keys without a mask (each of its queries
  sees all of them) and one causal call over its own keys, merged by their log-sum-exps. The
  context keys are the state store's view of the sequence's K/V buffer as they are, no copy;
  only a context of several parts (a row's earlier slice of the same sequence, or a CP
  segment's gathered prefix, after the store's view) is concatenated:
  lse = logaddexp(lse_1, lse_2), out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2 (the
  identity ring attention rests on).

So the work is what causality asks, where the `reference` backend scores every query of the
row against every key. Backward calls the kernel's backward per call with the merged output
and log-sum-exp, which yields that call's exact share of the gradients (the probabilities it
rebuilds are exp(score - merged lse)). Saved for backward: the inputs, the output and the
log-sum-exp, O(T) like any flash kernel; nothing is recomputed forward.

The kernel is a private PyTorch operator: `unavailable_reason` checks it is there and takes
grouped-query heads, and `auto` uses the reference backend where it does not.

Tensor legend: T query tokens of the row, t of one call, K keys, H query heads, G K/V heads,
E head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch

from lengthwise.runtime.layout import ChunkLayout, cat_tokens, key_parts, unflatten_context

GROUP_TOKENS = 256
"""Consecutive segments without context share one masked call while they total at most this
many tokens: a row of many short documents would otherwise be a call each."""


@dataclass(frozen=True)
class _Call:
    """One kernel call: queries [lo, hi) of the row against some keys."""

    lo: int
    hi: int
    segment: int
    """The segment whose context the keys are (`context`), else the first segment."""
    context: bool
    """Keys: the segment's context, every one visible (no mask); else the row's own keys lo:hi."""
    group: ChunkLayout | None = None
    """Several segments without context: their layout, whose bias masks the call."""

    @property
    def causal(self) -> bool:
        return not self.context and self.group is None


def attend(layout: ChunkLayout, num_pieces: tuple[int, ...], q_THE, k_TGE, v_TGE, *flat) -> torch.Tensor:
    """Attention output [T, H, E]; `flat` holds each segment's context (k, v) pieces in order."""
    return _FlashCPU.apply(layout, num_pieces, q_THE, k_TGE, v_TGE, *flat)


def unavailable_reason(device, dtype: torch.dtype) -> str | None:
    """Why cpu-flash cannot run here, or None when it can."""
    if torch.device(device).type != "cpu":
        return f"it runs on a CPU, the model is on {torch.device(device).type}"
    if not dtype.is_floating_point:
        return f"it needs a floating-point model, the model is {str(dtype).removeprefix('torch.')}"
    return _kernel_problem()


@functools.cache
def _kernel_problem() -> str | None:
    """None when this torch's CPU flash kernel exists and takes fewer K/V heads than query heads."""
    forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return f"this torch ({torch.__version__}) has no CPU flash-attention kernel"
    q, kv = torch.ones(1, 2, 2, 4), torch.ones(1, 1, 2, 4)
    try:
        out, lse = forward(q, kv, kv, 0.0, True)
        backward(out, q, kv, kv, out, lse, 0.0, True)
    except RuntimeError:
        return f"this torch's ({torch.__version__}) CPU flash-attention kernel lacks grouped-query heads"
    return None


@functools.lru_cache(maxsize=256)
def _row_calls(layout: ChunkLayout) -> tuple[tuple[_Call, ...], ...]:
    """The calls of a row, grouped by the query range they cover (one call, or the context and
    own calls of a segment with context, merged)."""
    q_lens, ctx_lens, offsets = layout.q_lens, layout.ctx_lens, layout.q_offsets
    ranges, i = [], 0
    while i < len(q_lens):
        lo, hi = offsets[i], offsets[i + 1]
        if ctx_lens[i]:
            ranges.append((_Call(lo, hi, i, context=True), _Call(lo, hi, i, context=False)))
            i += 1
            continue
        end = i + 1
        while end < len(q_lens) and not ctx_lens[end] and offsets[end + 1] - lo <= GROUP_TOKENS:
            end += 1
        group = None if end == i + 1 else ChunkLayout(
            q_lens=q_lens[i:end], ctx_lens=(0,) * (end - i), row_context=((),) * (end - i))
        ranges.append((_Call(lo, offsets[end], i, context=False, group=group),))
        i = end
    return tuple(ranges)


def _keys(call: _Call, layout: ChunkLayout, own_TGE: torch.Tensor, own_1GTE: torch.Tensor,
          pieces: list[torch.Tensor]) -> torch.Tensor:
    """The keys (or values) a call scores against, heads first [1, G, K, E]: the row's own
    (`own_1GTE`, the heads-first view of `own_TGE`) or the segment's context."""
    if not call.context:
        return _rows(own_1GTE, call)
    return _heads_first(cat_tokens(key_parts(own_TGE, pieces, layout, call.segment)[:-1]))


def _kernel(q_1HtE, k_1GKE, v_1GKE, call: _Call):
    """Output [t, H, E] and log-sum-exp [H, t] of one call (inputs heads first)."""
    bias = None if call.group is None else call.group.bias(q_1HtE.device, q_1HtE.dtype)
    out_1HtE, lse_1Ht = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_1HtE, k_1GKE, v_1GKE, 0.0, call.causal, attn_mask=bias)
    return out_1HtE[0].transpose(0, 1), lse_1Ht[0]


def _kernel_backward(g_1HtE, q_1HtE, k_1GKE, v_1GKE, out_1HtE, lse_Ht, call: _Call):
    """Gradients of q, k, v of one call, heads first, given the merged output and
    log-sum-exp (inputs heads first)."""
    bias = None if call.group is None else call.group.bias(q_1HtE.device, q_1HtE.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g_1HtE, q_1HtE, k_1GKE, v_1GKE, out_1HtE, lse_Ht[None].contiguous(), 0.0, call.causal, attn_mask=bias)


def _heads_first(x_TNE: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] -> the kernel's [1, heads, tokens, dim], a view (it takes strides)."""
    return x_TNE.transpose(0, 1)[None]


def _rows(x_1NTE: torch.Tensor, call: _Call) -> torch.Tensor:
    """The call's rows lo:hi of a heads-first view: the same view as `_heads_first(x[lo:hi])`,
    taken once per row instead of three views per call (each view is an operation, which a
    dry run's fake tensors make the cost that matters)."""
    return x_1NTE.narrow(2, call.lo, call.hi - call.lo)


def _merge(parts):
    """One output and log-sum-exp from two calls over disjoint keys of the same queries."""
    (out_a, lse_a), (out_b, lse_b) = parts
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (torch.exp(x - lse).transpose(0, 1)[:, :, None] for x in (lse_a, lse_b))
    out = weight_a * out_a.to(lse.dtype) + weight_b * out_b.to(lse.dtype)
    return out.to(out_a.dtype), lse


class _FlashCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, num_pieces, q_THE, k_TGE, v_TGE, *flat):
        context = unflatten_context(flat, num_pieces)
        q_1HTE, k_1GTE, v_1GTE = _heads_first(q_THE), _heads_first(k_TGE), _heads_first(v_TGE)
        outs, lses = [], []
        for calls in _row_calls(layout):
            parts = []
            for call in calls:
                pieces = context[call.segment]
                k = _keys(call, layout, k_TGE, k_1GTE, [kv[0] for kv in pieces])
                v = _keys(call, layout, v_TGE, v_1GTE, [kv[1] for kv in pieces])
                parts.append(_kernel(_rows(q_1HTE, call), k, v, call))
            out, lse = parts[0] if len(parts) == 1 else _merge(parts)
            outs.append(out)
            lses.append(lse)
        out_THE, lse_HT = cat_tokens(outs), torch.cat(lses, dim=1)
        ctx.layout, ctx.num_pieces = layout, num_pieces
        ctx.save_for_backward(q_THE, k_TGE, v_TGE, out_THE, lse_HT, *flat)
        return out_THE

    @staticmethod
    def backward(ctx, g_THE):
        q_THE, k_TGE, v_TGE, out_THE, lse_HT, *flat = ctx.saved_tensors
        layout, num_pieces = ctx.layout, ctx.num_pieces
        context = unflatten_context(flat, num_pieces)
        first_piece = [2 * n for n in accumulate(num_pieces, initial=0)]
        dq, dk, dv = torch.zeros_like(q_THE), torch.zeros_like(k_TGE), torch.zeros_like(v_TGE)
        # heads-first views, each taken once (`_rows`); the sums into dq, dk, dv go through them
        g_1HTE, q_1HTE, out_1HTE = _heads_first(g_THE), _heads_first(q_THE), _heads_first(out_THE)
        k_1GTE, v_1GTE = _heads_first(k_TGE), _heads_first(v_TGE)
        dq_1HTE, dk_1GTE, dv_1GTE = _heads_first(dq), _heads_first(dk), _heads_first(dv)
        dflat: list[torch.Tensor | None] = [None] * len(flat)
        for calls in _row_calls(layout):
            for call in calls:
                lo, hi, pieces = call.lo, call.hi, context[call.segment]
                k = _keys(call, layout, k_TGE, k_1GTE, [kv[0] for kv in pieces])
                v = _keys(call, layout, v_TGE, v_1GTE, [kv[1] for kv in pieces])
                gq, gk, gv = _kernel_backward(_rows(g_1HTE, call), _rows(q_1HTE, call), k, v, _rows(out_1HTE, call),
                                              lse_HT[:, lo:hi], call)
                _rows(dq_1HTE, call).add_(gq)
                if not call.context:
                    _rows(dk_1GTE, call).add_(gk)
                    _rows(dv_1GTE, call).add_(gv)
                    continue
                gk, gv = gk[0].transpose(0, 1), gv[0].transpose(0, 1)  # [K, G, E], as the context's pieces
                # Context keys: the store's pieces, then the row's earlier slices of the sequence.
                sizes = [kv[0].shape[0] for kv in pieces]
                sizes += [layout.q_lens[j] for j in layout.row_context[call.segment]]
                gk_parts, gv_parts = gk.split(sizes), gv.split(sizes)
                at = first_piece[call.segment]  # a segment has one context call: each slot set once
                for j in range(len(pieces)):
                    dflat[at + 2 * j], dflat[at + 2 * j + 1] = gk_parts[j], gv_parts[j]
                offsets = layout.q_offsets
                for j, row in enumerate(layout.row_context[call.segment]):
                    dk[offsets[row]:offsets[row + 1]] += gk_parts[len(pieces) + j]
                    dv[offsets[row]:offsets[row + 1]] += gv_parts[len(pieces) + j]
        return None, None, dq, dk, dv, *dflat
