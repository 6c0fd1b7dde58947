"""The held-out slice of the corpus and its loss.

    train_source, held = hold_out(source, count=16, seed=0)     # held: corpus indices
    loss = held_out_loss(model, train_source_or_source, held, backend="auto")
    batch, token_ids = held_out_batch(source, held)      # across processes: one more planned batch
    plan = plan_held_out(setup, batch, options=...)      # run sharded by the executor, gradients dropped

The held-out sequences are chosen by a seeded permutation of their own (independent of the
sampler's epochs) and taken out of the source the sampler draws from, so no step trains on
them. Their loss is the same quantity as the training loss (summed next-token cross-entropy /
labelled tokens), each sequence run alone, unpacked, without gradients.

Across processes no rank holds the whole model, so the held-out sequences are planned as one more
global batch (`plan_held_out`: the run's planner and degrees, its strategy fixed for a Hydraulis
run) and run on the training mesh by the rank executor (`train/dist.py`), each rank its own
stage and shards; the plan's loss is the same quantity. That step also runs the backward, whose
gradients are dropped: the executor has no forward-only schedule.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk, Segment, StepPlan
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.train.step import sequence_loss_sum
from lengthwise.specs import cluster_preset
from lengthwise.workloads.sampler import GlobalBatch
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


def held_out_batch(source: LengthSource, seq_ids: tuple[int, ...]) -> tuple[GlobalBatch, list[torch.Tensor]]:
    """The held-out sequences with a next token to predict (two tokens or more) as a global
    batch, and their token ids."""
    token_ids = [torch.as_tensor(source.tokens(i), dtype=torch.long) for i in seq_ids]
    kept = [(i, ids) for i, ids in zip(seq_ids, token_ids) if ids.numel() >= 2]
    batch = GlobalBatch(index=0, seq_ids=tuple(i for i, _ in kept), lengths=tuple(int(t.numel()) for _, t in kept))
    return batch, [ids for _, ids in kept]


def plan_held_out(setup, batch: GlobalBatch, *, options: dict | None = None) -> StepPlan:
    """`batch` planned as `setup.plan` plans a training batch (run's planner, degrees, seed),
    without touching the planning thread's state (a Hydraulis run's previous strategy):
    `options` fix what must not change (its current pipelines)."""
    config = setup.config
    cluster = cluster_preset(config.cluster, config.num_ranks)
    cost = CostModel(model=setup.spec, cluster=cluster, sequence_parallel=config.sequence_parallel)
    request = PlanRequest(lengths=list(batch.lengths), model=setup.spec, cluster=cluster, scheme=setup.scheme,
                          cost=cost, context_length=config.context_length, seed=config.seed,
                          options={**config.options, **(options or {})})
    plan = setup.planner(request)
    validate_plan(plan, cost)
    return plan
