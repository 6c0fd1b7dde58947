"""The papers' own baselines: Megatron-LM as they ran it, and DeepSpeed-Ulysses-style static CP.

- `megatron`: what ChunkFlow §6, InfiniPipe §7, SlimPack §6 and Hydraulis §6 compare against. The
  scheme is fixed by the user (or the compare search); each global batch is packed best-fit-
  decreasing into micro-batches of the context length (Megatron's packed-sample data loader),
  the same number of packs per DP rank, run with plain 1F1B. Recomputation is chosen as a Megatron
  user does: none when a context-length micro-batch fits every stage under 1F1B (and the
  simulated peak of the plan fits), otherwise full recomputation of every layer
  (`--recompute-granularity full`), otherwise the scheme is refused. Selective recomputation
  and the cost floor's recompute-choice helper (planned by the cost-model work) are not used yet.
- `static-cp`: Skrull §6's DeepSpeed baseline (Ulysses sequence parallelism): the same packed
  context-length micro-batches, every sequence sharded over the whole CP group whatever its
  length. Our IR prices CP as one ring/all-gather of K/V for both, so on the same scheme it plans
  exactly as `megatron`; it is kept as its own name so reports show the baseline Skrull compared
  with, at the scheme its own search picks (at cp = 1 it is Megatron without CP).

Neither takes options.
"""

from __future__ import annotations

import random
import time

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import FORWARD, Action, PipelinePlan, StepPlan
from lengthwise.cost.model import split_layers
from lengthwise.planners.base import PlanRequest, check_lengths, finish_plan, pipelines_from_chunks, take_options
from lengthwise.planners.baselines import deal, packed_chunk
from lengthwise.planners.packing_utils import best_fit_decreasing, split_to_multiple
from lengthwise.sim import simulate_plan
from lengthwise.specs import ParallelScheme

RECOMPUTE_CHOICES = ("none", "full")


def fits_row(cost: CostModel, scheme: ParallelScheme, row_tokens: int, *, full_recompute: bool) -> bool:
    """Whether every stage holds its 1F1B in-flight micro-batches (pp - s on stage s) of
    `row_tokens` tokens each, sharded over cp, next to its model states."""
    s_, pp = scheme, scheme.pp
    for s, n in enumerate(split_layers(cost.model.num_layers, pp)):
        first, last = s == 0, s == pp - 1
        free = cost.capacity_bytes - cost.model_state_bytes(layers=n, tp=s_.tp, dp=s_.dp, zero=s_.zero,
                                                             first=first, last=last)
        per_token = cost.activation_bytes_per_token(layers=n, tp=s_.tp, head=last,
                                                    recompute_layers=n if full_recompute else 0)
        if free <= 0 or per_token * row_tokens * (pp - s) / s_.cp > free:
            return False
    return True


def choose_recompute(cost: CostModel, scheme: ParallelScheme, row_tokens: int) -> str:
    """The fastest recomputation that fits (none before full), or a UserError."""
    for choice in RECOMPUTE_CHOICES:
        if fits_row(cost, scheme, row_tokens, full_recompute=choice == "full"):
            return choice
    raise UserError(f"a {row_tokens}-token micro-batch does not fit {scheme} even with full "
                    "recomputation: raise --tp, --pp or --cp")


def with_full_recompute(pipe: PipelinePlan, num_layers: int) -> PipelinePlan:
    """Every forward of every stage keeps only its layers' inputs (full recomputation)."""
    layers = pipe.stage_layers(num_layers)
    pipe.stages = [[Action(a.kind, a.chunk, layers[s]) if a.kind == FORWARD else a for a in acts]
                   for s, acts in enumerate(pipe.stages)]
    return pipe


def _packed_plan(request: PlanRequest, planner: str) -> StepPlan:
    started = time.perf_counter()
    take_options(request, planner, {})
    check_lengths(request)
    row, lengths, dp = request.context_length, request.lengths, request.scheme.dp
    recompute = choose_recompute(request.cost, request.scheme, row)
    bins = split_to_multiple(best_fit_decreasing(lengths, row), lengths, dp)
    random.Random(request.seed).shuffle(bins)
    chunks = deal([packed_chunk(b, lengths) for b in bins], dp)
    plan = _build(request, planner, chunks, recompute, started)
    # The row count above ignores K/V and transients; the simulated peak decides, as a user
    # who sees an out-of-memory run switches recomputation on.
    if recompute == "none" and not simulate_plan(plan, request.cost).fits:
        recompute, plan = "full", _build(request, planner, chunks, "full", started)
    if recompute == "full":
        result = simulate_plan(plan, request.cost)
        if not result.fits:
            peak = max(p for row in result.peak_memory for p in row)
            raise UserError(f"{request.scheme}: {row}-token micro-batches peak at {peak / 2**30:.1f} GiB even with "
                            f"full recomputation > {request.cost.capacity_bytes / 2**30:.1f} GiB: raise --tp, --pp or --cp")
    return plan


def _build(request: PlanRequest, planner: str, chunks: list, recompute: str, started: float) -> StepPlan:
    pipelines = pipelines_from_chunks(request, chunks)
    if recompute == "full":
        pipelines = [with_full_recompute(p, request.model.num_layers) for p in pipelines]
    return finish_plan(request, pipelines, planner=planner, started=started,
                       options={"pack_tokens": request.context_length, "recompute": recompute})


def plan_megatron(request: PlanRequest) -> StepPlan:
    """Megatron-LM: context-length packs, 1F1B, no or full recomputation."""
    return _packed_plan(request, "megatron")


def plan_static_cp(request: PlanRequest) -> StepPlan:
    """DeepSpeed-Ulysses-style: every sequence sharded over all cp ranks, context-length packs."""
    return _packed_plan(request, "static-cp")
