"""The held-out slice of the corpus and its loss.

    train_source, held = hold_out(source, count=16, seed=0)     # held: corpus indices
    loss = held_out_loss(model, train_source_or_source, held, backend="auto")

The held-out sequences are chosen by a seeded permutation of their own (independent of the
sampler's epochs) and taken out of the source the sampler draws from, so no step trains on
them. Their loss is the same quantity as the training loss (summed next-token cross-entropy /
labelled tokens), each sequence run alone, unpacked, without gradients.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk, Segment
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.train.step import sequence_loss_sum
from lengthwise.workloads.source import LengthSource

HOLD_OUT_STREAM = 1
"""Second word of the held-out permutation's seed ([seed, 1]); the sampler's epochs use [seed, e]
of their own generator, so the two never share draws by construction of default_rng."""


def hold_out(source: LengthSource, *, count: int, seed: int) -> tuple[LengthSource, tuple[int, ...]]:
    """`source` less `count` sequences, and those sequences' corpus indices (sorted)."""
    size = source.lengths.size
    if count >= size:
        raise UserError(f"--eval-sequences {count} would hold out all {size} documents of {source.name}; "
                        f"give fewer, or more documents")
    rows = np.random.default_rng([seed, HOLD_OUT_STREAM]).permutation(size)
    held, kept = np.sort(rows[:count]), np.sort(rows[count:])
    remaining = dataclasses.replace(source, lengths=source.lengths[kept], seq_ids=source.seq_ids[kept])
    return remaining, tuple(int(i) for i in source.seq_ids[held])


@torch.no_grad()
def held_out_loss(model: CausalLM, source: LengthSource, seq_ids: tuple[int, ...], *, backend: str) -> float:
    """Mean token cross-entropy (nats) of the held-out sequences under `model`."""
    token_ids = [torch.as_tensor(source.tokens(i), dtype=torch.long) for i in seq_ids]
    total, labelled = 0.0, 0
    for index, ids in enumerate(token_ids):
        length = int(ids.numel())
        if length < 2:
            continue  # a one-token sequence has no next token to predict
        row = Chunk((Segment(index, 0, length),))
        total += float(sequence_loss_sum(model, row, token_ids, backend=backend))
        labelled += length - 1
    return total / labelled if labelled else float("nan")
