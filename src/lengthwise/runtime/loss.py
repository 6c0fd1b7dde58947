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

import torch
import torch.nn.functional as F

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


def token_loss_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies over labelled positions, in at least float32."""
    if logits_TV.dtype in (torch.float16, torch.bfloat16):
        logits_TV = logits_TV.float()
    return F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE, reduction="sum")
