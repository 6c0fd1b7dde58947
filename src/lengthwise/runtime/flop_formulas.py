"""FlopCounterMode formulas for the attention kernels a dry run calls (`dryrun.py`), which
torch's counter does not know or counts otherwise: the CPU flash kernel, and the varlen flash
operators counted causal-aware. Also which attention path a plan's device runs.

Convention (the cost model's): 4 x head_dim FLOPs per visible (query, key) pair and query head
forward, 2.5 times that backward.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.flash_varlen import varlen_ops


DRYRUN_ATTENTION = ("cpu-flash", "varlen")
"""Attention paths a dry run can take: the CPU kernels', or the CUDA varlen operators' (their
fake implementations give the real operators' output shapes)."""


def plan_attention(plan: StepPlan) -> str:
    """The attention path the plan's device would run: varlen on a GPU cluster, cpu-flash on
    the `cpu` one."""
    return "cpu-flash" if plan.cluster.name == "cpu" else "varlen"


def varlen_flop_formulas() -> dict:
    """FlopCounterMode formulas for the varlen flash operators, causal-aware like the CPU
    kernel's (torch's own count every causal pair twice). They read the cu_seqlens, which the
    dry run's RowIndex builds as fake tensors carrying their values (`layout._index_tensors`)."""
    ops = varlen_ops()
    if ops is None:
        return {}

    def forward_flops(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, *args, out_val=None, **kwargs) -> int:
        return _varlen_flops(q, k, cu_q, cu_k, is_causal)

    def backward_flops(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, *args, out_val=None,
                       **kwargs) -> int:
        return int(2.5 * _varlen_flops(q, k, cu_q, cu_k, is_causal))

    for formula in (forward_flops, backward_flops):
        formula._get_raw = True  # the counter passes the tensors themselves, not their shapes
    return {ops[0]: forward_flops, ops[1]: backward_flops}


def _varlen_flops(q, k, cu_q, cu_k, is_causal: bool) -> int:
    """Per sequence of the call, `_attention_flops` of its queries and keys (causal aligned
    bottom-right, as flash does: the same count as top-left for the square calls it gets)."""
    bounds_q, bounds_k = (getattr(cu, "constant", None) for cu in (cu_q, cu_k))
    if bounds_q is None or bounds_k is None:
        raise AssertionError("varlen call without host-known cu_seqlens (RowIndex builds them with values)")
    with unset_fake_temporarily():
        bounds_q, bounds_k = bounds_q.tolist(), bounds_k.tolist()
    total = 0
    for i in range(len(bounds_q) - 1):
        queries, keys = bounds_q[i + 1] - bounds_q[i], bounds_k[i + 1] - bounds_k[i]
        pairs = queries * keys
        if is_causal:  # query j sees keys - queries + j + 1 keys, when positive
            pairs = (queries * (keys - queries + 1) + queries * (queries - 1) // 2 if queries <= keys
                     else keys * (keys + 1) // 2)
        total += 4 * q.shape[-1] * q.shape[1] * pairs
    return total


def cpu_flash_flop_formulas() -> dict:
    """FlopCounterMode formulas for the CPU flash-attention kernel and its backward."""
    forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return {}

    # The counter hands these the shapes of tensor arguments and looks operators up by packet.
    def forward_flops(q_shape, k_shape, v_shape, dropout_p=0.0, is_causal=False, *args, out_shape=None,
                      **kwargs) -> int:
        return _attention_flops(q_shape, k_shape, is_causal)

    def backward_flops(g_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, dropout_p, is_causal, *args,
                       out_shape=None, **kwargs) -> int:
        return int(2.5 * _attention_flops(q_shape, k_shape, is_causal))

    return {forward: forward_flops, backward: backward_flops}


def _attention_flops(q_shape, k_shape, is_causal: bool) -> int:
    """4 * head_dim FLOPs per (query, key) pair and query head (QK^T and PV). Queries and keys
    are [batch, heads, tokens, head_dim]; a causal call aligns them top-left, as the kernel does."""
    batch, heads, queries, head_dim = q_shape
    keys = k_shape[2]
    pairs = queries * keys
    if is_causal:
        below = min(queries, keys)
        pairs = below * (below + 1) // 2 + max(0, queries - keys) * keys
    return 4 * head_dim * batch * heads * pairs
