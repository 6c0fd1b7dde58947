"""The varlen backend's indexing, run on a CPU: `flash_row` with `VarlenKernels` whose operators
are a reference implementation of the varlen flash operators' contract (written out here from
their definition: per sequence of cu_seqlens, softmax attention, causal aligned bottom-right,
log-sum-exp [H, T]; backward from a given output and log-sum-exp). Against the `reference`
backend in float64: packed rows, slices with a store context, a row holding two slices of one
sequence, grouped-query heads.

Also: the compiled decoder layer equals the eager one and transformers."""

from __future__ import annotations

import math

import pytest
import torch

from lengthwise.plan.ir import Chunk
from lengthwise.runtime.attention import attend
from lengthwise.runtime.flash_row import attend as flash_attend
from lengthwise.runtime.flash_varlen import VarlenKernels
from lengthwise.runtime.layout import ChunkLayout, RowIndex


def _spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()  # a test's reference may read the index on the host
    return list(zip(bounds[:-1], bounds[1:]))


def _scores(q_tHE, k_sGE, causal: bool):
    """Scaled scores [H, t, s] with grouped heads, causal aligned bottom-right."""
    groups = q_tHE.shape[1] // k_sGE.shape[1]
    k_sHE = k_sGE.repeat_interleave(groups, 1)
    s_Hts = torch.einsum("the,she->hts", q_tHE, k_sHE) / math.sqrt(q_tHE.shape[-1])
    if causal:
        t, s = q_tHE.shape[0], k_sGE.shape[0]
        allowed = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
        s_Hts = s_Hts.masked_fill(~allowed, float("-inf"))
    return s_Hts


def reference_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal):
    out, lse = torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]))
    assert max_q == max(b - a for a, b in _spans(cu_q)) and max_k == max(b - a for a, b in _spans(cu_k))
    for (qa, qb), (ka, kb) in zip(_spans(cu_q), _spans(cu_k)):
        s = _scores(q[qa:qb], k[ka:kb], is_causal)
        groups = q.shape[1] // k.shape[1]
        out[qa:qb] = torch.einsum("hts,she->the", s.softmax(-1), v[ka:kb].repeat_interleave(groups, 1))
        lse[:, qa:qb] = s.logsumexp(-1)
    return out, lse, torch.zeros(2)


def reference_varlen_backward(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    groups = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1])
    for (qa, qb), (ka, kb) in zip(_spans(cu_q), _spans(cu_k)):
        p = torch.exp(_scores(q[qa:qb], k[ka:kb], is_causal) - lse[:, qa:qb, None])  # [H, t, s]
        v_sHE, k_sHE = (x[ka:kb].repeat_interleave(groups, 1) for x in (v, k))
        dp = torch.einsum("the,she->hts", g[qa:qb], v_sHE)
        delta = (g[qa:qb] * out[qa:qb]).sum(-1).transpose(0, 1)[:, :, None]  # [H, t, 1]
        ds = p * (dp - delta) * scale
        dq[qa:qb] = torch.einsum("hts,she->the", ds, k_sHE)
        dk[ka:kb] = torch.einsum("hts,the->she", ds, q[qa:qb]).unflatten(1, (-1, groups)).sum(2)
        dv[ka:kb] = torch.einsum("hts,the->she", p, g[qa:qb]).unflatten(1, (-1, groups)).sum(2)
    return dq, dk, dv


REFERENCE_VARLEN = VarlenKernels(forward=reference_varlen_forward, backward=reference_varlen_backward)

CASES = {
    "packed": "0[0:5]+1[0:3]+2[0:4]",
    "slices-with-context": "7[4:6]+2[0:3]+5[3:7]",
    "two-slices-of-one-sequence": "3[2:4]+1[0:2]+3[4:7]",
}


def _row(spec: str):
    """A CASES row in float64: layout, q, k, v, per-segment store context, the leaves to
    differentiate and an output gradient."""
    gen = torch.Generator().manual_seed(0)
    layout = ChunkLayout.from_chunk(Chunk.parse(CASES[spec]))
    T, H, G, E = sum(layout.q_lens), 4, 2, 8
    q, k, v = (torch.randn(T, n, E, generator=gen, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    context = [[tuple(torch.randn(c, G, E, generator=gen, dtype=torch.float64, requires_grad=True)
                      for _ in range(2))] if c and not layout.row_context[i] else []
               for i, c in enumerate(layout.ctx_lens)]
    # a slice after an earlier one of the same row: store context [0:start of the earlier one)
    for i, rows in enumerate(layout.row_context):
        if rows:
            earlier = layout.ctx_lens[rows[0]]
            context[i] = [tuple(torch.randn(earlier, G, E, generator=gen, dtype=torch.float64, requires_grad=True)
                                for _ in range(2))] if earlier else []
            context[rows[0]] = context[i]  # the same store view for both slices
    leaves = [q, k, v, *{id(t): t for pieces in context for kv in pieces for t in kv}.values()]
    g = torch.randn(T, H, E, generator=gen, dtype=torch.float64)
    return layout, q, k, v, context, leaves, g


def _outputs_and_grads(fn, leaves, g):
    out = fn()
    return out.detach(), torch.autograd.grad(out, leaves, g)


@pytest.mark.parametrize("path", ["function", "operator", "operator-compiled"])
@pytest.mark.parametrize("spec", list(CASES))
def test_varlen_indexing_matches_the_reference_backend(spec, path):
    """`path`: the autograd Function the eager layers call; the operator a chained region holds
    (`row_op.flash_row`, its backward an operator too), called eagerly and inside a region
    compiled with aot_eager (dynamic shapes, the handle a graph input)."""
    layout, q, k, v, context, leaves, g = _row(spec)

    def run(fn):
        return _outputs_and_grads(fn, leaves, g)

    index = RowIndex.build(layout, "cpu", varlen=True)
    num_pieces = tuple(len(p) for p in context)
    flat = [t for pieces in context for kv in pieces for t in kv]
    if path == "function":
        got, got_grads = run(lambda: flash_attend(REFERENCE_VARLEN, index, num_pieces, q, k, v, *flat))
    else:
        from lengthwise.runtime import row_op

        call = row_op.register(REFERENCE_VARLEN, index, num_pieces)

        def region(q, k, v, flat, handle):
            return row_op.flash_row(q * 1, k, v, flat, handle)[0] * 1

        fn = region if path == "operator" else torch.compile(region, backend="aot_eager", dynamic=True)
        got, got_grads = run(lambda: fn(q, k, v, flat, call.handle))
    want, want_grads = run(lambda: attend(q, k, v, context, layout, backend="reference"))
    assert (got - want).abs().max() <= 1e-12
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() <= 1e-12


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("spec", list(CASES))
def test_a_dense_row_matches_the_reference_backend(spec, compiled, monkeypatch):
    """`flash_cpu.dense_row`, a small row's attention in a chained region on a CPU: one masked
    kernel call over the store context and the row's own keys under `ChunkLayout.dense_mask`,
    eagerly and compiled with aot_eager (dynamic shapes): output and every gradient, the store
    pieces' included, equal the reference backend's. No bias (the region holds the operator):
    for the varlen kernels, a row above `DENSE_ENTRIES`, store pieces of other lengths."""
    from lengthwise.runtime import flash_cpu

    layout, q, k, v, context, leaves, g = _row(spec)
    flat = [t for pieces in context for kv in pieces for t in kv]
    bias = flash_cpu.dense_bias(flash_cpu.KERNELS, layout, context, "cpu", torch.float64)
    fn = torch.compile(flash_cpu.dense_row, backend="aot_eager", dynamic=True) if compiled else flash_cpu.dense_row
    got, got_grads = _outputs_and_grads(lambda: fn(q * 1, k, v, flat, bias), leaves, g)
    want, want_grads = _outputs_and_grads(lambda: attend(q, k, v, context, layout, backend="reference"), leaves, g)
    assert (got - want).abs().max() <= 1e-12
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() <= 1e-12
    tokens = sum(layout.q_lens)
    assert bias.shape == (tokens, layout.dense_entries // tokens)
    assert flash_cpu.dense_bias(REFERENCE_VARLEN, layout, context, "cpu", torch.float64) is None
    if any(context):
        short = [[(k_[1:], v_[1:]) for k_, v_ in pieces] for pieces in context]
        assert flash_cpu.dense_bias(flash_cpu.KERNELS, layout, short, "cpu", torch.float64) is None
    monkeypatch.setattr(flash_cpu, "DENSE_ENTRIES", layout.dense_entries - 1)
    assert flash_cpu.dense_bias(flash_cpu.KERNELS, layout, context, "cpu", torch.float64) is None


def test_row_index_is_built_from_the_plan_with_host_max_lengths():
    layout = ChunkLayout.from_chunk(Chunk.parse("7[4:6]+2[0:3]"))
    index = RowIndex.build(layout, "cpu", varlen=True)
    assert index.cu_q.tolist() == [0, 2, 5] and index.max_q == 3 and isinstance(index.max_q, int)
    (call,) = index.context_calls
    assert (call.segment, call.lo, call.hi, call.num_keys) == (0, 0, 2, 4)
    assert call.cu_q.tolist() == [0, 2] and call.cu_k.tolist() == [0, 4]
    assert RowIndex.build(layout, "cpu", varlen=False).cu_q is None
