"""The Hugging Face transformers baselines of bench_gpu_finetune.py: one global batch's forward and
backward with transformers' own Qwen2/Llama model (SDPA attention, no flash-attn package).

- `hf-padded`: micro-batches of consecutive sequences (sampler order), each right-padded to its
  longest sequence with an attention mask; a micro-batch grows while (sequences x longest)
  stays within `budget` padded tokens (the context length: the memory any micro-batch with a
  context-length sequence needs anyway), so long sequences run alone and short ones in
  groups, as a length-unaware trainer with a token budget does.
- `hf-packed`: padding-free packing via position_ids: whole sequences best-fit-decreasing into
  rows of the context length (what lengthwise's `packing` planner does before its memory
  check), each passed as one row with
  position_ids restarting at 0 for every document and no attention mask. transformers versions
  whose masking_utils has `find_packed_sequence_indices` (5.23 here) read the restarts as
  document boundaries and build a block-diagonal causal mask for SDPA; older ones would attend
  across documents, so `check_packing_supported` refuses them. It also needs `use_cache=False`
  (with a cache it silently attends across documents: logits off by ~1 on the tiny model).

Both use the loss of runtime/loss.py (sum of token cross-entropies in float32 / the batch's
loss tokens), so their losses equal lengthwise's on the same weights and tokens.
"""

from __future__ import annotations

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk, Segment
from lengthwise.planners.packing_utils import best_fit_decreasing
from lengthwise.runtime.loss import IGNORE, chunk_labels, chunk_positions, chunk_tokens, token_loss_sum
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.verify import build_hf_twin

PAD_ID = 0


def build_hf(model: CausalLM, *, checkpointing: bool):
    """transformers' model with `model`'s weights, on its device and dtype."""
    hf = build_hf_twin(model)
    hf.config.use_cache = False
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return hf.train()


def check_packing_supported() -> None:
    """UserError when this transformers cannot keep packed documents apart without flash-attn."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        import transformers

        raise UserError(f"transformers {transformers.__version__} cannot pack by position_ids with SDPA: "
                        "upgrade it (5.23 can)")


def padded_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sequence ids, a group growing while count x longest <= budget (>= 1 each)."""
    groups, current, longest = [], [], 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    return groups + ([current] if current else [])


def hf_padded_step(hf, lengths: list[int], token_ids: list[torch.Tensor], *, budget: int) -> torch.Tensor:
    """Forward and backward of every padded micro-batch; returns the batch's loss."""
    device = next(hf.parameters()).device
    loss_tokens = sum(n - 1 for n in lengths)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in padded_groups(lengths, budget):
        ids_BW, mask_BW, labels_BW = _padded_rows(group, lengths, token_ids)
        logits = hf(input_ids=ids_BW.to(device), attention_mask=mask_BW.to(device), use_cache=False).logits
        part = token_loss_sum(logits.flatten(0, 1), labels_BW.flatten().to(device)) / loss_tokens
        part.backward()
        total += part.detach().double()
    return total


def _padded_rows(group: list[int], lengths: list[int], token_ids: list[torch.Tensor]):
    width = max(lengths[i] for i in group)
    ids = torch.full((len(group), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    labels = torch.full((len(group), width), IGNORE, dtype=torch.long)
    for row, i in enumerate(group):
        n = lengths[i]
        ids[row, :n], mask[row, :n] = token_ids[i], 1
        labels[row, :n - 1] = token_ids[i][1:]
    return ids, mask, labels


def hf_packed_step(hf, rows: list[Chunk], lengths: list[int], token_ids: list[torch.Tensor]) -> torch.Tensor:
    """Forward and backward of every packed row of whole sequences; returns the batch's loss."""
    device = next(hf.parameters()).device
    loss_tokens = sum(n - 1 for n in lengths)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in rows:
        assert all(s.start == 0 and s.stop == lengths[s.seq_id] for s in chunk.segments), "whole sequences only"
        ids = chunk_tokens(chunk, token_ids)[None].to(device)
        positions = chunk_positions(chunk, device)[None]
        logits = hf(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        part = token_loss_sum(logits, chunk_labels(chunk, token_ids).to(device)) / loss_tokens
        part.backward()
        total += part.detach().double()
    return total


def packed_rows(lengths: list[int], context: int) -> list[Chunk]:
    """Whole sequences best-fit-decreasing into rows of `context` tokens."""
    return [Chunk(tuple(Segment(i, 0, lengths[i]) for i in b)) for b in best_fit_decreasing(lengths, context)]
