"""A decoder layer's arithmetic in six autograd nodes instead of about forty, for the host time
of short chunks (issue 26).

On a short chunk a layer costs what its operations cost the host, not the device: autograd
records a node for every operation of the plain expressions (a linear layer three: the
product, the weight's transpose, the heads view; the rotary embedding eight per tensor) and
runs each of them in backward. Here a layer (`model.DecoderLayer.fused`) is:

    RMSNorm            input norm (`model._RMSNorm`, one node as before)
    qkv                q/k/v projections, rotary embedding               -> q, k, v
    (attention)        its own node (`attention.attend`, any backend)
    output_norm        h + o_proj(out), and the post-attention norm of it
    gate_up            gate and up projections
    swiglu_down        h + down_proj(silu(gate) * up)

Memory: each Function saves exactly the tensors those operations saved (the cost model's
activation bytes, `cost/memory.py`: the norms' inputs, outputs and reciprocal RMS, q, k, v,
the SwiGLU's gate and up), but one: the SwiGLU's product, which the down projection's matmul
would keep for its weight's gradient, is made again from gate and up in `SwiGLUDown`'s
backward and freed before the product's gradient is made ([tokens, ffn] values a layer less
to keep, for one silu and one multiplication more in backward). The node boundaries are where
autograd freed the tensors, so the SwiGLU's gate and up are gone before the post-attention
norm's backward (tests/test_dryrun.py measures the peaks exactly). Operations and dtypes are
autograd's own, so results equal the plain expressions' up to the order in which a tensor's
several gradients are summed (the input norm's output feeds three projections).

A layer whose tensors are made again in backward (under `torch.utils.checkpoint`: full-layer
or MLP recomputation) keeps the product's two nodes instead (`SiluMul`, `LinearResidual`):
the down projection's matmul saves the product before it computes, so the checkpoint's
rerun stops there, without the down projection's GEMM (`cost/flops.py`), which
`SwiGLUDown` (saving after its whole forward, as every autograd Function does) would run.

Rotary tables are (cos, sin with its first half negated), each [T, 1, E]: Hugging Face's
rotate_half(x) * sin equals roll(x, E / 2) * signed sin bit for bit (a negation is exact), one
operation instead of four, and no per-layer broadcast view.

Tensor legend: T tokens, D hidden, H query heads, G key/value heads, E head dim, F SwiGLU width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of norms and rotary tables: at least float32, like Hugging Face's."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype), without the call when it is already that dtype (float32 and float64 norms)."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float):
    """weight * x / sqrt(mean(x^2) + eps), reduced in at least float32; returns it and the
    per-token reciprocal RMS [T, 1] (what the backward keeps)."""
    wide_TD = _as(x_TD, compute_dtype(x_TD.dtype))
    rstd_T1 = torch.rsqrt(wide_TD.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * _as(wide_TD * rstd_T1, x_TD.dtype), rstd_T1


def rms_norm_backward(grad_TD, x_TD, weight_D, rstd_T1):
    """Gradients of `rms_norm`'s input and weight: the operations autograd would run on it."""
    wide_TD = _as(x_TD, compute_dtype(x_TD.dtype))
    normed_TD = _as(wide_TD * rstd_T1, x_TD.dtype)
    grad_weight = (grad_TD * normed_TD).sum_to_size(weight_D.shape)
    grad_normed_TD = _as(grad_TD * weight_D, wide_TD.dtype)
    grad_rstd_T1 = (grad_normed_TD * wide_TD).sum(-1, keepdim=True)
    grad_mean_T1 = -0.5 * grad_rstd_T1 * rstd_T1.pow(3)
    grad_wide_TD = grad_normed_TD * rstd_T1 + grad_mean_T1 / wide_TD.shape[-1] * (2.0 * wide_TD)
    return _as(grad_wide_TD, x_TD.dtype), grad_weight


def rotate(x_TNE: torch.Tensor, cos_T1E: torch.Tensor, signed_sin_T1E: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x) * signed sin."""
    return x_TNE * cos_T1E + x_TNE.roll(x_TNE.shape[-1] // 2, -1) * signed_sin_T1E


def unrotate(grad_TNE: torch.Tensor, cos_T1E: torch.Tensor, signed_sin_T1E: torch.Tensor) -> torch.Tensor:
    """The gradient of `rotate`'s input: grad * cos + the inverse roll of grad * signed sin."""
    return grad_TNE * cos_T1E + (grad_TNE * signed_sin_T1E).roll(-(grad_TNE.shape[-1] // 2), -1)


def heads(x_TX: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[T, heads * E] -> [T, heads, E] (also for T = 0, where view(T, -1, E) is ambiguous)."""
    return x_TX.view(x_TX.shape[0], x_TX.shape[1] // head_dim, head_dim)


def _linear_backward(grad_TO, x_TI, weight_OI):
    """Input and weight gradients of F.linear, as autograd's mm backward computes them."""
    return grad_TO.mm(weight_OI), grad_TO.t().mm(x_TI)


class QKV(torch.autograd.Function):
    """The q/k/v projections (optional biases) of the normed input and the rotary embedding of
    q and k. Saves the projections' input and the rotary tables (shared by every layer of the
    chunk), as the plain expressions do."""

    @staticmethod
    def forward(ctx, x_TD, cos_T1E, sin_T1E, head_dim, wq, bq, wk, bk, wv, bv):
        q_THE = rotate(heads(F.linear(x_TD, wq, bq), head_dim), cos_T1E, sin_T1E)
        k_TGE = rotate(heads(F.linear(x_TD, wk, bk), head_dim), cos_T1E, sin_T1E)
        v_TGE = heads(F.linear(x_TD, wv, bv), head_dim)
        ctx.save_for_backward(x_TD, cos_T1E, sin_T1E, wq, wk, wv)
        ctx.biased = bq is not None, bk is not None, bv is not None
        return q_THE, k_TGE, v_TGE

    @staticmethod
    def backward(ctx, dq_THE, dk_TGE, dv_TGE):
        x_TD, cos_T1E, sin_T1E, wq, wk, wv = ctx.saved_tensors
        grads = [unrotate(dq_THE, cos_T1E, sin_T1E).flatten(1), unrotate(dk_TGE, cos_T1E, sin_T1E).flatten(1),
                 dv_TGE.flatten(1)]
        dx_TD, weight_grads = None, []
        for grad, weight, biased in zip(grads, (wq, wk, wv), ctx.biased):
            dx, dw = _linear_backward(grad, x_TD, weight)
            if dx_TD is None:
                dx_TD = dx
            else:
                dx_TD += dx
            weight_grads += [dw, grad.sum(0) if biased else None]
        return dx_TD, None, None, None, *weight_grads


class OutputNorm(torch.autograd.Function):
    """h + out [T, H, E] @ o_proj^T and the post-attention norm of it: returns both. Saves what the
    projection and the norm save (out, which the attention keeps too; the sum and the
    reciprocal RMS); the norm's backward runs first, as autograd's would, with nothing more
    alive."""

    @staticmethod
    def forward(ctx, h_TD, out_THE, weight_DX, norm_D, eps):
        out_TX = out_THE.flatten(1)
        h_TD = h_TD + F.linear(out_TX, weight_DX)
        x_TD, rstd_T1 = rms_norm(h_TD, norm_D, eps)
        ctx.save_for_backward(out_TX, weight_DX, h_TD, norm_D, rstd_T1)
        ctx.head_dim = out_THE.shape[-1]
        return h_TD, x_TD

    @staticmethod
    def backward(ctx, grad_h_TD, grad_x_TD):
        out_TX, weight_DX, h_TD, norm_D, rstd_T1 = ctx.saved_tensors
        dh_TD, dnorm_D = rms_norm_backward(grad_x_TD, h_TD, norm_D, rstd_T1)
        dh_TD += grad_h_TD
        dout_TX, dweight_DX = _linear_backward(dh_TD, out_TX, weight_DX)
        return dh_TD, heads(dout_TX, ctx.head_dim), dweight_DX, dnorm_D, None


class LinearResidual(torch.autograd.Function):
    """h + x @ weight^T (the down projection of a recomputed layer with its residual addition,
    module docstring). Saves x and the weight, as the projection does; the residual's gradient
    passes through."""

    @staticmethod
    def forward(ctx, h_TD, x_TX, weight_DX):
        ctx.save_for_backward(x_TX, weight_DX)
        return h_TD + F.linear(x_TX, weight_DX)

    @staticmethod
    def backward(ctx, grad_TD):
        x_TX, weight_DX = ctx.saved_tensors
        dx_TX, dweight_DX = _linear_backward(grad_TD, x_TX, weight_DX)
        return grad_TD, dx_TX, dweight_DX


class GateUp(torch.autograd.Function):
    """The gate and up projections of one input (the SwiGLU's product is the next node's,
    `SwiGLUDown` or `SiluMul`, so that its gate and up are freed before these projections'
    backward, as with autograd's nodes). Saves the input, as the two projections do."""

    @staticmethod
    def forward(ctx, x_TD, gate_FD, up_FD):
        ctx.save_for_backward(x_TD, gate_FD, up_FD)
        return F.linear(x_TD, gate_FD), F.linear(x_TD, up_FD)

    @staticmethod
    def backward(ctx, dgate_TF, dup_TF):
        x_TD, gate_FD, up_FD = ctx.saved_tensors
        dx_TD, dw_up = _linear_backward(dup_TF, x_TD, up_FD)
        dx_gate, dw_gate = _linear_backward(dgate_TF, x_TD, gate_FD)
        dx_TD += dx_gate
        return dx_TD, dw_gate, dw_up


class SiluMul(torch.autograd.Function):
    """silu(gate) * up keeping gate and up for backward and recomputing silu there (what a
    fused SwiGLU keeps), not also autograd's copy of silu(gate); the down projection after it
    keeps the product. Same operations as autograd's on the expression. The layers whose
    tensors are made again in backward use it (module docstring); the others `SwiGLUDown`."""

    @staticmethod
    def forward(ctx, gate_TF, up_TF):
        ctx.save_for_backward(gate_TF, up_TF)
        return F.silu(gate_TF) * up_TF

    @staticmethod
    def backward(ctx, grad_TF):
        gate_TF, up_TF = ctx.saved_tensors
        return swiglu_backward(grad_TF, gate_TF, up_TF)


def swiglu_backward(grad_TF, gate_TF, up_TF):
    """Gradients of silu(gate) * up's gate and up, as autograd computes them: silu's backward
    of grad * up, and grad * silu(gate). The up gradient first, so that at most three
    [T, F] buffers exist at once (grad, silu(gate), up's gradient; then grad, up's gradient,
    grad * up; then up's gradient, grad * up, gate's gradient) when the caller lets go of
    grad (`SwiGLUDown`); the values do not depend on the order."""
    grad_up_TF = grad_TF * F.silu(gate_TF)
    scaled_TF = grad_TF * up_TF
    del grad_TF
    return torch.ops.aten.silu_backward(scaled_TF, gate_TF), grad_up_TF


class SwiGLUDown(torch.autograd.Function):
    """h + (silu(gate) * up) @ weight^T (the SwiGLU and the down projection; without h, the
    projection alone, as tensor parallelism's row-parallel down projection computes its
    partial sum). Saves gate, up and the weight, not the product: the backward makes the
    product again for the weight's gradient and frees it before it makes the product's
    gradient and from it those of gate and up (`swiglu_backward`), with the operations
    autograd runs on the plain expressions, so the values are theirs."""

    @staticmethod
    def forward(ctx, h_TD, gate_TF, up_TF, weight_DF):
        ctx.save_for_backward(gate_TF, up_TF, weight_DF)
        ctx.residual = h_TD is not None
        out_TD = F.linear(F.silu(gate_TF) * up_TF, weight_DF)
        return out_TD if h_TD is None else h_TD + out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        gate_TF, up_TF, weight_DF = ctx.saved_tensors
        product_TF = F.silu(gate_TF) * up_TF
        dweight_DF = grad_TD.t().mm(product_TF)
        del product_TF
        dgate_TF, dup_TF = swiglu_backward(grad_TD.mm(weight_DF), gate_TF, up_TF)
        return grad_TD if ctx.residual else None, dgate_TF, dup_TF, dweight_DF
