"""What a chunk feeds the model (tokens, positions, labels) and the loss it contributes.

Labels across a cut: position p of sequence s predicts token p + 1 of s, wherever the sequence
was cut, so the last position of slice [0:4096) predicts token 4096, the first token of the
next slice, exactly as in the uncut sequence. A sequence's last token predicts nothing
(label IGNORE), and no label ever comes from another document of the row.

Loss: the sum of token cross-entropies of the whole global batch divided by
`StepPlan.loss_tokens` (every token but each sequence's last). Each chunk contributes its
own sum divided by that global count, so the step's loss and gradients equal those of
training every sequence unpacked, whatever the packing, splitting, accumulation or data
parallelism (replicas' gradients are then summed, not averaged).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import lengthwise.cost.memory as mem
from lengthwise.plan.ir import Chunk
from lengthwise.runtime.compile import compiled

IGNORE = -100
"""Label of a position that predicts nothing (cross_entropy's ignore_index)."""


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A chunk's input made on the host (`chunk_tokens`, `chunk_labels`, `chunk_positions`) on
    `device`: to a GPU through pinned memory, not waited for. A blocking host-to-device copy
    synchronises the stream (the host waits until the device has run everything queued): a
    chunk's tokens and its labels each stopped the host there, twice a chunk. Made on the host,
    a row of many documents costs no kernel per document (a slice, a pad, a range each). Under
    fake tensors (a dry run), or to any other device, a plain copy."""
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu" and torch._guards.detect_fake_mode() is None:
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def chunk_tokens(chunk: Chunk, token_ids: list[torch.Tensor]) -> torch.Tensor:
    """Token ids of the row [T]."""
    return torch.cat([token_ids[s.seq_id][s.start:s.stop] for s in chunk.segments])


def chunk_positions(chunk: Chunk, device) -> torch.Tensor:
    """Position of each token within its own sequence [T]: rotary angles restart per document
    and continue across a cut. Made on the host in one pass (each token's index in the row,
    shifted by its segment's start less the segment's offset in the row), then `to_device`."""
    starts = np.fromiter((s.start for s in chunk.segments), np.int64, len(chunk.segments))
    lens = np.fromiter((s.num_tokens for s in chunk.segments), np.int64, len(chunk.segments))
    shift = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return to_device(torch.from_numpy(np.arange(len(shift), dtype=np.int64) + shift), device)


def chunk_labels(chunk: Chunk, token_ids: list[torch.Tensor]) -> torch.Tensor:
    """Next-token labels of the row [T], IGNORE at each sequence's last token."""
    parts = []
    for s in chunk.segments:
        seq = token_ids[s.seq_id]
        labels = seq[s.start + 1:s.stop + 1]
        if labels.numel() < s.num_tokens:  # the segment holds the sequence's last token
            labels = torch.cat([labels, labels.new_full((1,), IGNORE)])
        parts.append(labels)
    return torch.cat(parts)


@dataclass(frozen=True)
class VocabShard:
    """Logits split by vocabulary over a tensor-parallel group: this rank holds columns
    [start, start + its width), of which the first `real` are the model's (the rest pad a
    vocabulary tp does not divide; None: all of them)."""

    group: object
    start: int
    real: int | None = None


def token_loss_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor, shard: VocabShard | None = None) -> torch.Tensor:
    """Sum of cross-entropies over labelled positions, in at least float32. `shard`: the
    logits are this rank's vocabulary columns (tensor parallelism); every rank of the group
    gets the whole sum. The loss of logits already made (the reference's, `verify.py`); the
    executor's LM head never makes them whole but uses `head_loss_sum`."""
    return _TokenCrossEntropy.apply(logits_TV, labels_T, shard)


class _TokenCrossEntropy(torch.autograd.Function):
    """Cross-entropy that keeps one widened copy of the logits and nothing else: forward turns
    it into the softmax in place (kept for backward), backward turns the softmax into the
    logits' gradient in place and hands it back in the logits' dtype. Autograd's
    log_softmax + nll_loss keeps the same 4 bytes per logit, but its backward works on two
    more fp32 [tokens, vocab] buffers (the log-probabilities' and the logits' gradients); this
    holds at most the bf16 gradient beside the softmax (`cost/memory.py`). Vocabulary-parallel
    logits (Megatron's cross-entropy) reduce the row maxima, exponential sums and target logits
    over the group."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, shard):
        wide = torch.float64 if logits_TV.dtype == torch.float64 else torch.float32
        x_TV = logits_TV.to(wide, copy=True)
        ctx.start, ctx.dtype = (0 if shard is None else shard.start), logits_TV.dtype
        rows_T, local_T, mine_T = _targets(labels_T, ctx.start, x_TV)
        max_T = x_TV.max(-1).values if x_TV.shape[-1] else x_TV.new_full((x_TV.shape[0],), float("-inf"))
        _all_reduce(max_T, shard, dist.ReduceOp.MAX)
        x_TV.sub_(max_T[:, None])
        target_T = x_TV[rows_T, local_T] * mine_T
        _all_reduce(target_T, shard, dist.ReduceOp.SUM)
        x_TV.exp_()
        sum_T = x_TV.sum(-1)
        _all_reduce(sum_T, shard, dist.ReduceOp.SUM)
        x_TV.div_(sum_T[:, None])
        ctx.save_for_backward(x_TV, labels_T)
        return ((sum_T.log() - target_T) * (labels_T != IGNORE)).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax_TV, labels_T = ctx.saved_tensors
        rows_T, local_T, mine_T = _targets(labels_T, ctx.start, softmax_TV)
        softmax_TV.index_put_((rows_T, local_T), -mine_T.to(softmax_TV.dtype), accumulate=True)
        softmax_TV.mul_((grad * (labels_T != IGNORE))[:, None])
        return softmax_TV.to(ctx.dtype), None, None


def _targets(labels_T: torch.Tensor, start: int, x_TV: torch.Tensor):
    """Row index, column in this rank's logits (clamped in range) and whether this rank holds
    the label's column, per token; no data-dependent shapes (they run on fake tensors too)."""
    local_T = labels_T - start
    mine_T = (labels_T != IGNORE) & (local_T >= 0) & (local_T < x_TV.shape[-1])
    rows_T = torch.arange(x_TV.shape[0], device=x_TV.device)
    return rows_T, local_T.clamp(0, max(x_TV.shape[-1] - 1, 0)), mine_T


def _all_reduce(tensor: torch.Tensor, shard: VocabShard | None, op) -> None:
    if shard is not None:
        dist.all_reduce(tensor, op=op, group=shard.group)


def head_loss_sum(x_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor,
                  shard: VocabShard | None = None, *, block_bytes: int | None = None,
                  compile_backend: str | None = None) -> torch.Tensor:
    """`token_loss_sum(x_TD @ weight_VD.T, labels_T, shard)` without ever holding the logits
    [T, V] (`_BlockedHeadLoss`): the LM head (normed hidden states x, this rank's vocabulary
    rows of the head's weight) and its loss in one, a block of at most `block_bytes` of wide
    logits at a time (default `cost.memory.HEAD_BLOCK_BYTES`). Plain tensors: the caller hands
    this rank's local pieces (`model.LMHead`). `compile_backend`: backward's elementwise work
    per block (the softmax gradient) fused by `torch.compile` under that backend
    (`_BlockedHeadLoss`); None: eager."""
    return _BlockedHeadLoss.apply(x_TD, weight_VD, labels_T, shard, block_bytes or mem.HEAD_BLOCK_BYTES,
                                  compile_backend)


def block_rows(columns: int, dtype: torch.dtype, block_bytes: int | None = None) -> int:
    """Rows of a [rows, columns] block of `dtype` that fit in `block_bytes` (at least one),
    rounded down for the matmul kernels' alignment (`cost.memory.head_block`)."""
    return mem.head_block((block_bytes or mem.HEAD_BLOCK_BYTES) // max(1, columns * dtype.itemsize))


class _BlockedHeadLoss(torch.autograd.Function):
    """LM head + cross-entropy, blocked: the logits exist one block at a time.

    Forward, per block of rows: the block's logits x W^T in the compute dtype, padded columns
    set to -inf, their log-softmax in the wide dtype (float32, float64 for float64), then per
    row this rank's log-sum-exp and the label's logit (`_row_statistics`); the [T, V] logits
    are never held, only three [T] vectors. Under tensor parallelism (`shard`: W is this rank's
    vocabulary rows) the rows' local log-sum-exps (standing for maxima, with sums of 1) are
    all-reduced (MAX) and the rescaled exponential sums with the label logits
    (SUM, one stacked call) once for the whole chunk after the last block: two collectives a
    chunk whatever the number of blocks. Forward keeps x (the head's input, already kept by the
    linear layer it replaces), the labels and the rows' log-sum-exp.

    Backward recomputes the logits, one block of vocabulary columns at a time (all rows): the
    softmax is exp(logit - log-sum-exp), the label's column loses one, rows scaled by the
    incoming gradient; the block's weight gradient is then complete in one matmul over every
    row (written in place into the [V, D] gradient, rounded once as the unblocked head's), and
    the input gradient is accumulated over the column blocks in the wide dtype ([T, D]). No
    collective in backward (the log-sum-exp saved is the group's); the input gradient is this
    rank's partial sum, which the caller's DTensor layout sums over TP.

    Why recompute (one more T x V x D matmul, the head's FLOPs 8 T V D instead of 6) rather
    than making both gradients during forward and keeping them for backward: a chunk's forward
    on the last stage may run long before its backward (pipeline warm-up, ChunkFlow's K
    chunks in flight, SlimPack's backward units), and gradients made in forward would have to
    be kept until then, a [V, D] weight gradient per chunk in flight (0.47 GB in bf16 for
    Qwen2.5-1.5B) plus [T, D]; recomputation keeps only the [T] log-sum-exp beyond the input
    the head keeps anyway, and its peak is one block. Column blocks in backward (rather than
    row blocks) so that the weight gradient is never accumulated: an fp32 accumulator of
    [V, D] would cost 4 V D bytes, the [T, D] one of the input gradient is V / T times smaller
    at the lengths where the head matters.

    Block size: rows (forward) or columns (backward) such that one block's wide logits take at
    most `block_bytes` (`cost.memory.HEAD_BLOCK_BYTES`, 256 MiB: 432 rows of Qwen2.5's 151,936
    float32 logits, 2,048 columns at 32K tokens; counts rounded down for alignment,
    `cost.memory.head_block`); beside it the block's wide log-softmax (forward) or its
    compute-dtype gradient (backward). Block bounds come from shapes only: no host sync.

    Compiled (`compile_backend`, set by `runtime.compile.compile_layers`): backward only. The
    matmuls stay cuBLAS calls, and each column block's elementwise work between them (widen,
    exponentiate, subtract the label, scale, narrow) is one compiled function
    (`_fused_softmax_grad`), so the block's logits are read in the compute dtype once and the
    wide copy is never written: on an H200 the head's backward of Qwen2.5-0.5B (V = 151,936)
    went from 3.50 to 2.16 us a token at 16K tokens (profiles in
    benchmarks/results/gpu-2026-11-28-nvidia-h200/). The forward's row statistics stay eager:
    compiled (dynamic rows, a reduction over 151,936 columns per row) they measured slower on the
    same GPU, 2.99 against 1.99 us a token. The same arithmetic in the same dtypes; only the
    order of the row sums may differ."""

    @staticmethod
    def forward(ctx, x_TD, weight_VD, labels_T, shard, block_bytes, compile_backend):
        wide = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
        tokens, columns = x_TD.shape[0], weight_VD.shape[0]
        real = columns if shard is None or shard.real is None else max(0, min(columns, shard.real))
        start = 0 if shard is None else shard.start
        local_T, mine_T = _label_columns(labels_T, start, columns)
        max_T = x_TD.new_empty(tokens, dtype=wide)
        sum_T = x_TD.new_empty((2, tokens), dtype=wide)  # exponential sums, label logits
        rows = block_rows(columns, wide, block_bytes)
        for r0 in range(0, tokens, rows):  # eager whatever compile_backend says (see the class docstring)
            r1 = min(tokens, r0 + rows)
            if real <= 0:  # this rank's columns are all padding: nothing to add
                max_T[r0:r1], sum_T[:, r0:r1] = 0, 0
                continue
            max_T[r0:r1], sum_T[0, r0:r1], sum_T[1, r0:r1] = _row_statistics(x_TD[r0:r1], weight_VD, real,
                                                                             local_T[r0:r1], mine_T[r0:r1], wide)
        if shard is not None:
            top_T = max_T.clone()
            dist.all_reduce(top_T, op=dist.ReduceOp.MAX, group=shard.group)
            sum_T[0].mul_((max_T - top_T).exp())
            dist.all_reduce(sum_T, op=dist.ReduceOp.SUM, group=shard.group)
            max_T = top_T
        lse_T = sum_T[0].log().add_(max_T)
        ctx.block_bytes, ctx.real, ctx.start, ctx.compile_backend = block_bytes, real, start, compile_backend
        ctx.save_for_backward(x_TD, weight_VD, labels_T, lse_T)
        return ((lse_T - sum_T[1]) * (labels_T != IGNORE)).sum()

    @staticmethod
    def backward(ctx, grad):
        x_TD, weight_VD, labels_T, lse_T = ctx.saved_tensors
        wide, tokens, columns = lse_T.dtype, x_TD.shape[0], weight_VD.shape[0]
        local_T, mine_T = _label_columns(labels_T, ctx.start, columns)
        scale_T = (labels_T != IGNORE).to(wide) * grad.to(wide)
        rows_T = torch.arange(tokens, device=x_TD.device)
        grad_x = x_TD.new_zeros(x_TD.shape, dtype=wide)
        grad_w = torch.empty_like(weight_VD)
        step = block_rows(tokens, wide, ctx.block_bytes)
        fused = None if ctx.compile_backend is None else compiled(_fused_softmax_grad, ctx.compile_backend)
        for c0 in range(0, columns, step):
            c1 = min(columns, c0 + step)
            w_CD = weight_VD[c0:c1]
            hit_T = mine_T & (local_T >= c0) & (local_T < c1)
            if fused is not None:
                g_TC = fused(_padded_logits(x_TD, w_CD, ctx.real - c0), lse_T, local_T - c0, hit_T, scale_T, wide)
            else:
                g_TC = _softmax_grad_in_place(_padded_logits(x_TD, w_CD, ctx.real - c0).to(wide), lse_T, local_T - c0,
                                              hit_T, scale_T, rows_T, x_TD.dtype)  # the narrow logits freed
            torch.mm(g_TC.t(), x_TD, out=grad_w[c0:c1])
            _add_product(grad_x, g_TC, w_CD)
            del g_TC
        return grad_x.to(x_TD.dtype), grad_w, None, None, None, None


def _add_product(acc_TD: torch.Tensor, a_TC: torch.Tensor, b_CD: torch.Tensor) -> None:
    """acc += a @ b, in place. Where acc is wider than a and b (float32 against bf16 on a GPU)
    the matmul writes into acc in its own dtype (cuBLAS's mixed-precision GEMM, `out_dtype`),
    rather than making a bf16 product and adding it with a separate, mixed-dtype elementwise
    pass: on an H200 that add took 10.7 ms of a 294 ms Qwen2.5-0.5B step and each block's
    product was rounded to bf16 before it was added. Where the device has no such GEMM (a CPU),
    the product and the add as before."""
    if acc_TD.dtype == a_TC.dtype:
        acc_TD.addmm_(a_TC, b_CD)
    elif _widening_addmm(acc_TD.device.type, a_TC.dtype, acc_TD.dtype):
        torch.addmm(acc_TD, a_TC, b_CD, out_dtype=acc_TD.dtype, out=acc_TD)
    else:
        acc_TD.add_(a_TC @ b_CD)


@functools.cache
def _widening_addmm(device_type: str, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(..., out_dtype=)` runs on this kind of device for these dtypes (a
    CUDA build of PyTorch 2.8 or later; not on CPU), tried once on 8 x 8 tensors."""
    if device_type == "cpu" or device_type == "meta":
        return False
    a = torch.zeros(8, 8, dtype=dtype, device=device_type)
    acc = torch.zeros(8, 8, dtype=out_dtype, device=device_type)
    try:
        torch.addmm(acc, a, a, out_dtype=out_dtype, out=acc)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _padded_logits(x_BD: torch.Tensor, weight_CD: torch.Tensor, real: int) -> torch.Tensor:
    """One block's logits in the compute dtype, -inf on the columns from `real` on (vocabulary
    padding)."""
    x_BC = x_BD @ weight_CD.t()
    if real < x_BC.shape[1]:
        x_BC[:, max(real, 0):] = float("-inf")
    return x_BC


def _row_statistics(x_BD: torch.Tensor, weight_CD: torch.Tensor, real: int, local_B: torch.Tensor,
                    mine_B: torch.Tensor, wide: torch.dtype):
    """Per row of a block of rows of x: this rank's log-sum-exp of the logits x W^T (`real`
    columns of them, at least one), 1, and the label's logit where this rank holds it (else
    0), all in `wide`: the (maximum, sum of exponentials relative to it, label logit) that the
    caller combines over ranks, the log-sum-exp standing for the maximum.

    The block's logits are made in the compute dtype and widened once (the compute-dtype block
    freed here, before the next allocation), then one pass of PyTorch's log-softmax kernel on
    the wide block; per row lse = logit - log-probability at one real column, the label's where
    this rank holds it, else the first. At most two wide blocks at once (`cost.memory.
    head_forward_bytes`). Before, four passes over the wide block in place (maximum, subtract,
    exponentiate, sum): on an H200, at 23,845 tokens of Qwen2.5-0.5B, they took about 35 ms of
    a 294 ms step; with the log-softmax kernel, 26 ms (the widening copy included;
    benchmarks/results/gpu-2026-11-28-nvidia-h200/breakdown/)."""
    x_BC = _padded_logits(x_BD, weight_CD, real).to(wide)  # the compute-dtype logits, a temporary
    column_B = torch.where(mine_B, local_B, 0)[:, None]
    logit_B = x_BC.gather(1, column_B).squeeze(1)
    logp_BC = torch.log_softmax(x_BC, -1)
    del x_BC
    lse_B = logit_B - logp_BC.gather(1, column_B).squeeze(1)
    del logp_BC
    return lse_B, torch.ones_like(lse_B), torch.where(mine_B, logit_B, torch.zeros_like(logit_B))


def _fused_softmax_grad(x_TC: torch.Tensor, lse_T: torch.Tensor, local_T: torch.Tensor, hit_T: torch.Tensor,
                        scale_T: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """The loss's gradient with respect to a block of logits (compute dtype in and out):
    (softmax - one-hot of the label) x the row's scale, computed in `wide`. Compiled only: the
    one-hot is a comparison with the column index, which fuses into one pass but would, eager,
    make a [T, C] mask the memory model does not count."""
    g_TC = (x_TC.to(wide) - lse_T[:, None]).exp()
    columns_C = torch.arange(x_TC.shape[1], device=x_TC.device)
    label_TC = (columns_C[None, :] == local_T[:, None]) & hit_T[:, None]
    return ((g_TC - label_TC.to(wide)) * scale_T[:, None]).to(x_TC.dtype)


def _softmax_grad_in_place(g_TC: torch.Tensor, lse_T: torch.Tensor, local_T: torch.Tensor, hit_T: torch.Tensor,
                           scale_T: torch.Tensor, rows_T: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_fused_softmax_grad`'s value, eager, in `dtype`: computed in place on `g_TC`, the block's
    logits already widened (the memory model's one wide block; the caller widens them in its
    own expression so that the narrow block is freed first), the label's column lowered by one
    with an indexed add (`local_T` clamped into the block; rows whose label is elsewhere add zero)."""
    g_TC.sub_(lse_T[:, None]).exp_()
    g_TC.index_put_((rows_T, local_T.clamp(0, g_TC.shape[1] - 1)), -hit_T.to(g_TC.dtype), accumulate=True)
    return g_TC.mul_(scale_T[:, None]).to(dtype)


def _label_columns(labels_T: torch.Tensor, start: int, columns: int):
    """Per token: the label's column among this rank's `columns` (clamped in range) and whether
    this rank holds it (IGNORE: never); static shapes (they run on fake tensors too)."""
    local_T = labels_T - start
    mine_T = (labels_T != IGNORE) & (local_T >= 0) & (local_T < columns)
    return local_T.clamp(0, max(columns - 1, 0)), mine_T
