"""The `varlen` attention backend's kernels: PyTorch's varlen flash-attention operators (CUDA,
bf16/fp16), in the row structure of `flash_row.py`.

The operators are those behind `torch.nn.attention.varlen.varlen_attn`:
`torch.ops.torch_attn._varlen_attn` returns the output [T, H, E] and the log-sum-exp [H, T]
(float32) that the public function keeps to itself, and `_varlen_attn_backward` takes a given
output and log-sum-exp, which is what merging a context call with the own call needs. Both
take grouped-query heads as they are (the flash kernel reads K/V head h // (H / G)), and both
have fake implementations, so a dry run under fake tensors runs this path's allocations.

Index tensors (cu_seqlens) and max lengths come from the chunk's `RowIndex`: built once per
chunk, max lengths as Python ints, so a layer makes no host-to-device copy and no call waits
on the device. Flash aligns a causal mask bottom-right; the own call is square per segment
and the context call unmasked, so either alignment would do.

`VarlenKernels(forward=..., backward=...)` takes other operators of the same signature: the
tests run this path's indexing on a CPU with a reference implementation of them.

Tensor legend: T query tokens of the row, t of one call, K keys, H query heads, G K/V heads,
E head dim.
"""

from __future__ import annotations

import torch

from lengthwise.runtime.layout import ContextCall, RowIndex


def varlen_ops():
    """(forward, backward) varlen flash operators of this torch, or None."""
    try:
        import torch.nn.attention.varlen  # noqa: F401  (registers the torch_attn operators)
    except ImportError:
        return None
    ops = getattr(torch.ops, "torch_attn", None)
    forward = getattr(ops, "_varlen_attn", None) if ops is not None else None
    backward = getattr(ops, "_varlen_attn_backward", None) if ops is not None else None
    return None if forward is None or backward is None else (forward, backward)


class VarlenKernels:
    """`flash_row.Kernels` from the varlen flash operators (or stand-ins of their signature)."""

    def __init__(self, forward=None, backward=None):
        if forward is None or backward is None:
            forward, backward = varlen_ops()
        self.forward_op, self.backward_op = forward, backward

    def own(self, q_THE, k_TGE, v_TGE, index: RowIndex):
        out, lse, _ = self.forward_op(q_THE, k_TGE, v_TGE, index.cu_q, index.cu_q, index.max_q, index.max_q, True)
        return out, lse

    def own_backward(self, g_THE, q_THE, k_TGE, v_TGE, out_THE, lse_HT, index: RowIndex):
        return self.backward_op(g_THE, q_THE, k_TGE, v_TGE, out_THE, lse_HT, index.cu_q, index.cu_q,
                                index.max_q, index.max_q, True, index.rng_state)

    def context(self, q_tHE, k_KGE, v_KGE, call: ContextCall):
        out, lse, _ = self.forward_op(q_tHE, k_KGE, v_KGE, call.cu_q, call.cu_k, call.hi - call.lo,
                                      call.num_keys, False)
        return out, lse

    def context_backward(self, g_tHE, q_tHE, k_KGE, v_KGE, out_tHE, lse_Ht, call: ContextCall, index: RowIndex):
        return self.backward_op(g_tHE, q_tHE, k_KGE, v_KGE, out_tHE, lse_Ht.contiguous(), call.cu_q, call.cu_k,
                                call.hi - call.lo, call.num_keys, False, index.rng_state)
