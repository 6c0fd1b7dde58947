"""The Hugging Face transformers baselines of bench_gpu_finetune.py: one global batch's forward and
backward with transformers' own Qwen2/Llama model, no flash-attn package.

- `hf-padded`: micro-batches of consecutive sequences (sampler order), each right-padded to its
  longest sequence with an attention mask (SDPA, transformers' default); a micro-batch grows
  while (sequences x longest) stays within `budget` padded tokens (the context length: the
  memory any micro-batch with a context-length sequence needs anyway), so long sequences run
  alone and short ones in groups, as a length-unaware trainer with a token budget does.
- `hf-packed`: padding-free packing via position_ids: whole sequences best-fit-decreasing into
  rows of the context length (what lengthwise's `packing` planner does before its memory
  check), each passed as one row with position_ids restarting at 0 for every document and no
  attention mask. transformers versions whose masking_utils has `find_packed_sequence_indices`
  (5.17 on the H200, 5.24 here) read the restarts as document boundaries and AND a
  same-document term into the causal mask of whichever attention implementation runs; older
  ones would attend across documents, so `check_packing_supported` refuses them. It also needs
  `use_cache=False` (with a cache it silently attends across documents).

Which attention implementation the packed rows use (`packed_attention`): without flash-attn,
transformers offers `sdpa` (the mask becomes a dense rows x rows boolean tensor: every
cross-document block is computed and masked, O(row^2) time and a 1 GB mask per 32K row) and
`flex_attention` (the same mask as a BlockMask: blocks wholly outside a document are skipped,
so a row of short documents costs what its documents cost). flex_attention is the best path a
transformers user has here, so it is the anchor wherever it can train: torch's FlexAttention
has no backward on CPU (torch 2.13), so there the rows fall back to sdpa and the JSON says why.
transformers compiles flex_attention on first use; `warm_up_flex` runs that compilation (static
and dynamic row lengths) before the timed steps, as the first steps of a real run would.

Both use the loss of runtime/loss.py (sum of token cross-entropies in float32 / the batch's
loss tokens), so their losses equal lengthwise's on the same weights and tokens.
"""

from __future__ import annotations

import time

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


# ---- the packed rows' attention implementation -------------------------------------------------

PACKED_ATTENTION = ("auto", "flex_attention", "sdpa")
"""--hf-attention choices: auto = flex_attention where it trains on this device, else sdpa."""


def flex_unavailable(device: torch.device) -> str | None:
    """Why flex_attention cannot train here (None when it can): a tiny eager forward and
    backward on `device`, which fails on CPU (no backward) or without torch's FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
        from transformers.utils import is_torch_flex_attn_available
    except ImportError as exc:
        return f"flex_attention unavailable: {exc}"
    if not is_torch_flex_attn_available():
        return f"transformers does not offer flex_attention with torch {torch.__version__}"
    q_BHLD = torch.randn(1, 1, 128, 16, device=device, requires_grad=True)
    try:
        flex_attention(q_BHLD, q_BHLD, q_BHLD).sum().backward()
    except (NotImplementedError, RuntimeError) as exc:
        return f"flex_attention cannot train on {device.type} with torch {torch.__version__}: " \
               + str(exc).splitlines()[0][:200]
    return None


def packed_attention(requested: str, device: torch.device) -> tuple[str, str | None]:
    """(implementation, why not flex_attention or None) for the packed rows."""
    if requested == "sdpa":
        return "sdpa", "sdpa requested (--hf-attention sdpa)"
    reason = flex_unavailable(device)
    if reason is None:
        return "flex_attention", None
    if requested == "flex_attention":
        raise UserError(f"{reason}: use --hf-attention sdpa or auto")
    return "sdpa", reason


def set_attention(hf, implementation: str) -> None:
    """Switch a built transformers model's attention (masks follow the config's choice)."""
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(implementation)
    else:
        hf.config._attn_implementation = implementation


def warm_up_flex(hf, vocab: int) -> float:
    """Seconds spent compiling flex_attention (and its BlockMask) on two small packed rows of
    different lengths: the first compiles, the second makes the row length dynamic, so the
    timed steps' rows of other lengths reuse the kernels instead of recompiling."""
    device = next(hf.parameters()).device
    start = time.perf_counter()
    with torch._dynamo.config.patch(assume_static_by_default=False):
        for docs in ((700, 300), (900, 500, 200)):
            lengths = list(docs)
            ids = [torch.randint(0, vocab, (n,)) for n in lengths]
            hf_packed_step(hf, packed_rows(lengths, sum(lengths)), lengths, ids)
    hf.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def configure_attention(hf, system: str, requested: str, vocab: int) -> dict:
    """Set the attention an hf row runs with; the row's JSON fields saying which and why.
    A flex_attention compilation failure falls back to sdpa (the reason recorded), so one
    toolchain problem does not cost the transformers anchor."""
    if system == "hf-padded":
        return {"attn_implementation": "sdpa"}
    implementation, reason = packed_attention(requested, next(hf.parameters()).device)
    info = {}
    if implementation == "flex_attention":
        set_attention(hf, implementation)
        try:
            info["compile_warmup_s"] = warm_up_flex(hf, vocab)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: record it, use sdpa
            if "out of memory" in str(exc).lower():
                raise
            hf.zero_grad(set_to_none=True)
            implementation = "sdpa"
            reason = f"flex_attention failed to compile: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            set_attention(hf, implementation)
    info["attn_implementation"] = implementation
    if reason:
        info["attn_fallback_reason"] = reason
    return info
