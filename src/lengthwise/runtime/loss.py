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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lengthwise.plan.ir import Chunk

IGNORE = -100
"""Label of a position that predicts nothing (cross_entropy's ignore_index)."""


def chunk_tokens(chunk: Chunk, token_ids: list[torch.Tensor]) -> torch.Tensor:
    """Token ids of the row [T]."""
    return torch.cat([token_ids[s.seq_id][s.start:s.stop] for s in chunk.segments])


def chunk_positions(chunk: Chunk, device) -> torch.Tensor:
    """Position of each token within its own sequence [T]: rotary angles restart per document
    and continue across a cut."""
    return torch.cat([torch.arange(s.start, s.stop, device=device) for s in chunk.segments])


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
    [start, start + its width)."""

    group: object
    start: int


def token_loss_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor, shard: VocabShard | None = None) -> torch.Tensor:
    """Sum of cross-entropies over labelled positions, in at least float32. `shard`: the
    logits are this rank's vocabulary columns (tensor parallelism); every rank of the group
    gets the whole sum."""
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
