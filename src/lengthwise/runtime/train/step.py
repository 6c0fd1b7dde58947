"""One global batch's forward and backward for training, and the memory it took.

    with PeakMemory(model) as peak:
        loss = forward_backward(model, plan, token_ids, backend="reference")
    peak.bytes, peak.kind

Plans run on the executor (`runtime.execute.run_step`), except padded ones (a chunk whose
`pad_to` exceeds its tokens: the padding and sorted baselines). The executor treats `pad_to` as
bookkeeping and runs only real tokens, so a padded plan would cost what packing costs. A
trainer that pads really computes the pads:
here each sequence of a padded micro-batch of k sequences runs as one row of pad_to / k
tokens, its own tokens then pad tokens (one row of a [k, pad_to / k] padded batch; the same
FLOPs as the batched call). Pads come after the sequence's tokens in its causal block, so no
real token attends to them, and they carry the IGNORE label: loss and gradients equal
unpacked training, only the time grows.

Tensor legend: T tokens in the row.
"""

from __future__ import annotations

from typing import Self

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk, StepPlan
from lengthwise.runtime.attention import ChunkLayout
from lengthwise.runtime.execute import run_step
from lengthwise.runtime.loss import IGNORE, chunk_labels
from lengthwise.runtime.memory import SavedTensorMeter
from lengthwise.runtime.model import CausalLM

PAD_ID = 0
"""Token id of a pad: any id works, nothing reads a pad's output or attends to it."""


def forward_backward(model: CausalLM, plan: StepPlan, token_ids: list[torch.Tensor], *,
                     backend: str) -> torch.Tensor:
    """Loss of the global batch (float64 scalar, mean over its loss tokens), gradients added
    to the parameters' .grad."""
    if is_padded(plan):
        return padded_forward_backward(model, plan, token_ids, backend=backend)
    return run_step(model, plan, token_ids, backend=backend)


def is_padded(plan: StepPlan) -> bool:
    """Whether some micro-batch of the plan is padded beyond its tokens (Chunk.pad_to)."""
    return any(chunk.pad_to > chunk.num_tokens for pipe in plan.pipelines for chunk in pipe.chunks)


def padded_forward_backward(model: CausalLM, plan: StepPlan, token_ids: list[torch.Tensor], *,
                            backend: str) -> torch.Tensor:
    """Every chunk's sequences as padded rows of the chunk's slot width, one at a time."""
    loss = torch.zeros((), dtype=torch.float64)
    for pipe in plan.pipelines:
        for chunk in pipe.chunks:
            width = slot_width(chunk)
            for segment in chunk.segments:
                if segment.start != 0 or segment.stop != plan.lengths[segment.seq_id]:
                    raise UserError(f"padded chunk {chunk} holds the slice {segment}: padded micro-batches "
                                    "run whole sequences only")
                part = _padded_row_loss(model, Chunk((segment,)), width, token_ids, backend)
                (part / plan.loss_tokens).backward()
                loss += part.detach().double().cpu() / plan.loss_tokens
    return loss


def slot_width(chunk: Chunk) -> int:
    """Tokens each sequence of a padded micro-batch occupies: pad_to / k, at least the longest."""
    longest = max(s.num_tokens for s in chunk.segments)
    return max(chunk.row_tokens // len(chunk.segments), longest)


def sequence_loss_sum(model: CausalLM, row: Chunk, token_ids: list[torch.Tensor], *,
                      backend: str) -> torch.Tensor:
    """Sum of token cross-entropies of a one-segment row holding a whole sequence, unpadded
    (the held-out evaluation runs each sequence this way, under no_grad)."""
    return _padded_row_loss(model, row, row.segments[0].num_tokens, token_ids, backend)


def _padded_row_loss(model: CausalLM, row: Chunk, width: int, token_ids: list[torch.Tensor],
                     backend: str) -> torch.Tensor:
    """Sum of token cross-entropies of one sequence padded to `width` tokens."""
    param = next(model.parameters())
    segment = row.segments[0]
    num_pads = width - segment.num_tokens
    tokens_T = torch.cat([token_ids[segment.seq_id], token_ids[segment.seq_id].new_full((num_pads,), PAD_ID)])
    labels_T = torch.cat([chunk_labels(row, token_ids), tokens_T.new_full((num_pads,), IGNORE)])
    layout = ChunkLayout(q_lens=(width,), ctx_lens=(0,), row_context=((),))
    h_TD = model.embed(tokens_T.to(param.device))
    rope = model.rope(torch.arange(width, device=param.device), param.dtype)
    contexts = [[[]] for _ in range(model.spec.num_layers)]
    h_TD, _ = model.run_layers(h_TD, layers=range(model.spec.num_layers), rope=rope, layout=layout,
                               contexts=contexts, backend=backend)
    return model.head_loss(h_TD, labels_T.to(param.device))


class PeakMemory:
    """Peak memory of the `with` block: CUDA's max_memory_allocated on a GPU, else the bytes
    autograd saved for backward (runtime/memory.py; parameters left out)."""

    def __init__(self, model: CausalLM):
        self.device = next(model.parameters()).device
        self.kind = "cuda_max_allocated" if self.device.type == "cuda" else "saved_for_backward"
        self._meter = None if self.device.type == "cuda" else SavedTensorMeter(exclude=model.parameters())
        self.bytes = 0

    def __enter__(self) -> Self:
        if self._meter is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._meter is None:
            self.bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._meter.__exit__(*exc)
            self.bytes = self._meter.peak_bytes
