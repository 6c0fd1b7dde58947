"""The `cpu-flash` attention backend's kernels: PyTorch's CPU flash attention, scoring only the
keys each query may see (the row's structure, shared with the varlen backend, is `flash_row.py`).

PyTorch's CPU flash-attention kernel (the operator SDPA runs on a CPU) returns each query's
log-sum-exp with its output, and with `is_causal` skips the blocks above a square's diagonal.
The own call of a row (every segment causal over its own keys) is cut into kernel calls
(`_own_calls`):

- a segment alone: one causal call over its own keys (a square, so the kernel's top-left
  alignment is the right one);
- consecutive short segments, at most `GROUP_TOKENS` together: one call under their
  block-diagonal bias (one call beats many tiny ones). A segment with context groups too: its
  own call covers only its own keys, and its context call (one kernel call without a mask) is
  merged with its rows afterwards.

In a chained region (`model._run_chain`) a small row is traced instead: `dense_row`, one
masked call over [every segment's store context, the row's own keys] (`ChunkLayout.dense_mask`,
built once per chunk), which the compiler sees whole, so the region calls no operator and no
Python runs between its layers; larger rows keep the calls above, inside the region's
operator (`row_op`).

The kernel is a private PyTorch operator: `unavailable_reason` checks it is there and takes
grouped-query heads, and `auto` uses the reference backend where it does not.

Tensor legend: T query tokens of the row, t of one call, K keys, H query heads, G K/V heads,
E head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lengthwise.runtime.layout import ChunkLayout, ContextCall, RowIndex

GROUP_TOKENS = 256
"""Consecutive segments without context share one masked call while they total at most this
many tokens: a row of many short documents would otherwise be a call each."""


DENSE_ENTRIES = 1 << 16
"""Largest dense mask (queries x keys, store context included) a chained region attends in one
masked call (`dense_row`): 256 queries over 256 keys. Below it one call, with no merge and no
operator around it, beats the two or more calls a split row makes (as `GROUP_TOKENS` groups
short documents), though masked blocks are computed rather than skipped; above it the mask's
memory and the work above the diagonal grow with the row, and the calls above win."""


@dataclass(frozen=True)
class _Call:
    """One kernel call of the own call: queries [lo, hi) of the row against keys lo:hi."""

    lo: int
    hi: int
    group: ChunkLayout | None = None
    """Several segments without context: their layout, whose bias masks the call; None: one
    segment, causal."""

    @property
    def causal(self) -> bool:
        return self.group is None


class CPUKernels:
    """`flash_row.Kernels` from CPU flash-attention calls."""

    def own(self, q_THE, k_TGE, v_TGE, index: RowIndex):
        q_1HTE, k_1GTE, v_1GTE = _heads_first(q_THE), _heads_first(k_TGE), _heads_first(v_TGE)
        parts = [_kernel(_rows(q_1HTE, call), _rows(k_1GTE, call), _rows(v_1GTE, call), call)
                 for call in _own_calls(index.layout)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts], dim=1)

    def own_backward(self, g_THE, q_THE, k_TGE, v_TGE, out_THE, lse_HT, index: RowIndex):
        calls = _own_calls(index.layout)
        if len(calls) == 1:  # the kernel's gradients are the row's: no zeros to add them into
            grads = _kernel_backward(*(_heads_first(x) for x in (g_THE, q_THE, k_TGE, v_TGE, out_THE)), lse_HT, calls[0])
            return tuple(x[0].transpose(0, 1) for x in grads)
        dq, dk, dv = torch.zeros_like(q_THE), torch.zeros_like(k_TGE), torch.zeros_like(v_TGE)
        # heads-first views, each taken once (`_rows`); the sums into dq, dk, dv go through them
        ins = [_heads_first(x) for x in (g_THE, q_THE, k_TGE, v_TGE, out_THE)]
        grads = [_heads_first(x) for x in (dq, dk, dv)]
        for call in calls:
            g, q, k, v, out = (_rows(x, call) for x in ins)
            for grad, part in zip(grads, _kernel_backward(g, q, k, v, out, lse_HT[:, call.lo:call.hi], call)):
                _rows(grad, call).add_(part)
        return dq, dk, dv

    def context(self, q_tHE, k_KGE, v_KGE, call: ContextCall):
        return _kernel(_heads_first(q_tHE), _heads_first(k_KGE), _heads_first(v_KGE), _UNMASKED)

    def context_backward(self, g_tHE, q_tHE, k_KGE, v_KGE, out_tHE, lse_Ht, call: ContextCall, index: RowIndex):
        gq, gk, gv = _kernel_backward(*(_heads_first(x) for x in (g_tHE, q_tHE, k_KGE, v_KGE, out_tHE)),
                                      lse_Ht, _UNMASKED)
        return (x[0].transpose(0, 1) for x in (gq, gk, gv))


_UNMASKED = None
"""A context call's `_Call`: no mask, not causal (`_kernel` reads None so)."""


KERNELS = CPUKernels()


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
def _own_calls(layout: ChunkLayout) -> tuple[_Call, ...]:
    """The kernel calls of a row's own call (every segment over its own keys only, whether or
    not it has a context: that is merged separately): runs of short segments grouped."""
    q_lens, offsets = layout.q_lens, layout.q_offsets
    calls, i = [], 0
    while i < len(q_lens):
        lo = offsets[i]
        end = i + 1
        while end < len(q_lens) and offsets[end + 1] - lo <= GROUP_TOKENS:
            end += 1
        group = None if end == i + 1 else ChunkLayout(
            q_lens=q_lens[i:end], ctx_lens=(0,) * (end - i), row_context=((),) * (end - i))
        calls.append(_Call(lo, offsets[end], group))
        i = end
    return tuple(calls)


def _kernel(q_1HtE, k_1GKE, v_1GKE, call: _Call | None):
    """Output [t, H, E] and log-sum-exp [H, t] of one call (inputs heads first); `call` None:
    no mask, not causal."""
    bias = None if call is None or call.group is None else call.group.bias(q_1HtE.device, q_1HtE.dtype)
    causal = call is not None and call.causal
    out_1HtE, lse_1Ht = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_1HtE, k_1GKE, v_1GKE, 0.0, causal, attn_mask=bias)
    return out_1HtE[0].transpose(0, 1), lse_1Ht[0]


def _kernel_backward(g_1HtE, q_1HtE, k_1GKE, v_1GKE, out_1HtE, lse_Ht, call: _Call | None):
    """Gradients of q, k, v of one call, heads first, given the merged output and
    log-sum-exp (inputs heads first)."""
    bias = None if call is None or call.group is None else call.group.bias(q_1HtE.device, q_1HtE.dtype)
    causal = call is not None and call.causal
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g_1HtE, q_1HtE, k_1GKE, v_1GKE, out_1HtE, lse_Ht[None].contiguous(), 0.0, causal, attn_mask=bias)


def dense_bias(kernels, layout: ChunkLayout, context, device, dtype: torch.dtype) -> torch.Tensor | None:
    """The bias under which a chained region traces the row's attention (`dense_row`), or None
    and the region holds the operator: kernels other than these (the varlen ones), a row above
    `DENSE_ENTRIES`, or store pieces (`context`: per segment, its (k, v) pieces) other than the
    layout's (their lengths are host ints: the check reads no tensor)."""
    if kernels is not KERNELS or layout.dense_entries > DENSE_ENTRIES:
        return None
    if [sum(k.shape[0] for k, _ in pieces) for pieces in context] != list(layout.store_lens):
        return None
    return layout.dense_bias(device, dtype)


def dense_row(q_THE, k_TGE, v_TGE, flat, bias_TK):
    """Output [T, H, E] of a row in one masked kernel call, from plain operations a compiler
    traces (no structure of the row but the shapes: the bias carries it). `flat`: the store's
    context pieces k0, v0, k1, v1, ... segment after segment (`layout.unflatten_context`),
    joined before the row's own keys as `ChunkLayout.dense_mask` lays them out; `bias_TK` its
    bias (`dense_bias`). The copy of the context is the dense path's price, small by its bound."""
    k_KGE = torch.cat([*flat[0::2], k_TGE]) if flat else k_TGE
    v_KGE = torch.cat([*flat[1::2], v_TGE]) if flat else v_TGE
    out_1HTE, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q_THE), _heads_first(k_KGE), _heads_first(v_KGE), 0.0, False, attn_mask=bias_TK)
    return out_1HTE[0].transpose(0, 1)


def _heads_first(x_TNE: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] -> the kernel's [1, heads, tokens, dim], a view (it takes strides)."""
    return x_TNE.transpose(0, 1)[None]


def _rows(x_1NTE: torch.Tensor, call: _Call) -> torch.Tensor:
    """The call's rows lo:hi of a heads-first view: the same view as `_heads_first(x[lo:hi])`,
    taken once per row instead of three views per call (each view is an operation, which a
    dry run's fake tensors make the cost that matters); the view itself for a call over the
    whole row."""
    if call.lo == 0 and call.hi == x_1NTE.shape[2]:
        return x_1NTE
    return x_1NTE.narrow(2, call.lo, call.hi - call.lo)
