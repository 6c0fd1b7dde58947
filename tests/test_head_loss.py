"""The blocked LM head + cross-entropy (`loss.head_loss_sum`, the executor's loss) against the
plain loss of whole logits (`loss.token_loss_sum`): loss and the gradients of the head's input
and weight, float64, with blocks smaller than the chunk (several run in forward and backward),
IGNORE labels (each sequence's last token, sequence parallelism's padding rows), and the
vocabulary split over 2 gloo ranks with a padded vocabulary (one rank's last column padding)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.loss import IGNORE, VocabShard, block_rows, head_loss_sum, token_loss_sum

from tolerance import normwise_error, reduction_tolerance

TOKENS, HIDDEN, VOCAB = 37, 16, 53


def _inputs(vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (TOKENS,), generator=gen)
    labels[::5] = IGNORE
    labels[-3:] = IGNORE
    return x, w, labels


def _tolerance() -> float:
    # sums over the vocabulary (exponentials, logit gradients) and over the hidden width
    return reduction_tolerance(torch.float64, VOCAB + HIDDEN + TOKENS)


@pytest.mark.parametrize(("rows", "compile_backend"), [
    (1, None), (4, None), (10, None), (48, None),  # 48 rows: one block holds every token
    # compiled blocks (the fused softmax gradient of backward): traced (aot_eager) at
    # every block size, and once through inductor's generated kernels
    (1, "aot_eager"), (4, "aot_eager"), (48, "aot_eager"), (10, "inductor")])
def test_blocked_head_equals_the_plain_loss(rows, compile_backend):
    x, w, labels = _inputs()
    block = rows * VOCAB * 8  # `rows` rows of float64 logits a block in forward
    assert block_rows(VOCAB, torch.float64, block) == rows
    plain = token_loss_sum(x @ w.t(), labels)
    gx, gw = torch.autograd.grad(1.5 * plain, (x, w))
    blocked = head_loss_sum(x, w, labels, block_bytes=block, compile_backend=compile_backend)
    bx, bw = torch.autograd.grad(1.5 * blocked, (x, w))
    assert blocked.dtype == torch.float64
    tol = _tolerance()
    assert abs((blocked - plain).item()) <= tol * abs(plain.item())
    assert normwise_error(bx, gx) <= tol
    assert normwise_error(bw, gw) <= tol
    assert (bx[labels == IGNORE] == 0).all()  # a row that predicts nothing gets no gradient


def test_every_label_ignored_gives_zero_loss_and_gradients():
    x, w, labels = _inputs()
    labels[:] = IGNORE
    loss = head_loss_sum(x, w, labels, block_bytes=3 * VOCAB * 8)
    bx, bw = torch.autograd.grad(loss, (x, w))
    assert loss.item() == 0.0 and not bx.any() and not bw.any()


def _tp2_worker(rank: int, compile_backend: str | None = None) -> dict:
    """Rank r holds vocabulary rows [r * 27, r * 27 + 27) of a 53-token vocabulary padded to 54
    (rank 1's last row padding: its logit is -inf in the loss)."""
    x, w, labels = _inputs()
    width = -(-VOCAB // 2)
    start = rank * width
    padded = torch.cat([w.detach(), torch.zeros(2 * width - VOCAB, HIDDEN, dtype=torch.float64)])
    w_local = padded[start:start + width].clone().requires_grad_(True)
    shard = VocabShard(group=dist.group.WORLD, start=start, real=VOCAB - start)
    loss = head_loss_sum(x, w_local, labels, shard, block_bytes=4 * width * 8, compile_backend=compile_backend)
    gx, gw = torch.autograd.grad(1.5 * loss, (x, w_local))
    dist.all_reduce(gx)  # each rank's input gradient is its columns' partial sum
    parts = [torch.empty_like(gw) for _ in range(2)]
    dist.all_gather(parts, gw)
    return {"loss": loss.detach(), "gx": gx, "gw": torch.cat(parts)}


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_vocabulary_parallel_blocked_head_equals_the_plain_loss(compile_backend):
    got = spawn(functools.partial(_tp2_worker, compile_backend=compile_backend), 2, timeout_s=120)
    x, w, labels = _inputs()
    plain = token_loss_sum(x @ w.t(), labels)
    gx, gw = torch.autograd.grad(1.5 * plain, (x, w))
    tol = _tolerance()
    assert abs((got["loss"] - plain).item()) <= tol * abs(plain.item())
    assert normwise_error(got["gx"], gx) <= tol
    assert normwise_error(got["gw"][:VOCAB], gw) <= tol
    assert not got["gw"][VOCAB:].any()  # the padding row gets no gradient


def test_the_blocks_wide_logits_are_bounded():
    """Qwen2.5's vocabulary at the default bound: 441 rows of float32 logits fit a forward
    block, 432 are taken (a multiple of 16); 2,048 columns of 32K tokens a backward block, and
    of an odd 23,845 tokens 2,688 (2,814 fit: a multiple of 128, as the matmul kernels want a
    block's leading dimension); a block is never below one row."""
    from lengthwise.cost.memory import HEAD_BLOCK_BYTES, head_block

    assert 441 * 151_936 * 4 <= HEAD_BLOCK_BYTES < 442 * 151_936 * 4
    assert block_rows(151_936, torch.float32) == 432
    assert block_rows(32_768, torch.float32) == 2048
    assert 2814 * 23_845 * 4 <= HEAD_BLOCK_BYTES < 2815 * 23_845 * 4
    assert block_rows(23_845, torch.float32) == 2688
    assert block_rows(10**12, torch.float32) == 1
    assert [head_block(n) for n in (1, 15, 16, 31, 1023, 1024, 1151)] == [1, 15, 16, 16, 1008, 1024, 1024]
    assert head_block(np.array([0.5, 17.0, 2814.0])).tolist() == [1, 16, 2688]


def _all_padding_worker(rank: int) -> dict:
    """A 5-token vocabulary over 4 ranks of 2 columns: rank 2 holds column 4 and a padding one,
    rank 3 only padding (its `real` is below zero: its forward adds nothing)."""
    x, w, labels = _inputs(vocab=5)
    width, tp = 2, 4
    padded = torch.cat([w.detach(), torch.zeros(width * tp - 5, HIDDEN, dtype=torch.float64)])
    w_local = padded[rank * width:(rank + 1) * width].clone().requires_grad_(True)
    shard = VocabShard(group=dist.group.WORLD, start=rank * width, real=5 - rank * width)
    loss = head_loss_sum(x, w_local, labels, shard, block_bytes=8 * width * 8)
    gx, gw = torch.autograd.grad(loss, (x, w_local))
    dist.all_reduce(gx)
    parts = [torch.empty_like(gw) for _ in range(tp)]
    dist.all_gather(parts, gw)
    return {"loss": loss.detach(), "gx": gx, "gw": torch.cat(parts)}


def test_a_rank_whose_vocabulary_columns_are_all_padding_adds_nothing():
    got = spawn(_all_padding_worker, 4, timeout_s=120)
    x, w, labels = _inputs(vocab=5)
    plain = token_loss_sum(x @ w.t(), labels)
    gx, gw = torch.autograd.grad(plain, (x, w))
    tol = reduction_tolerance(torch.float64, 5 + HIDDEN + TOKENS)
    assert abs((got["loss"] - plain).item()) <= tol * abs(plain.item())
    assert normwise_error(got["gx"], gx) <= tol
    assert normwise_error(got["gw"][:5], gw) <= tol
    assert not got["gw"][5:].any()
