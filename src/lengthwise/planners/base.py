"""What every planner takes (`PlanRequest`) and the steps every planner shares.

A planner is a function `PlanRequest -> StepPlan`, deterministic for a given seed. The shared
steps here check that a batch can be planned at all (`check_request`), turn per-pipeline chunk
lists into 1F1B pipelines (`pipelines_from_chunks`), read planner options strictly into the
planner's options object (`take_options`) and fill the plan's predicted metrics (`finish_plan`).
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.cost.flops import head_forward_flops, matmul_params_per_layer, work_key
from lengthwise.errors import UserError
from lengthwise.metrics import PLANNING_MS
from lengthwise.plan.arrays import causal_pairs, row_sums, segment_fields
from lengthwise.plan.ir import FORWARD, Action, Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.plan.schedules import make_schedule
from lengthwise.planners.options import Options, build_options, given_options
from lengthwise.specs import ClusterSpec, ModelSpec, ParallelScheme


@dataclass(kw_only=True)
class PlanRequest:
    """One global batch to plan, with everything a planner may consult."""

    lengths: list[int]
    """Token count of each sequence of the global batch; seq_id is the index."""
    model: ModelSpec
    """The model being trained."""
    cluster: ClusterSpec
    """The GPUs; num_gpus equals scheme.num_gpus."""
    scheme: ParallelScheme
    """dp x tp x pp x cp (a planner may choose other degrees per pipeline, e.g. hydraulis)."""
    cost: CostModel
    """Cost model of `model` on `cluster`."""
    context_length: int
    """Longest sequence allowed, tokens; also the bin size of packing planners."""
    seed: int = 0
    """Seed for any random choice the planner makes."""
    options: dict[str, Any] | Options = field(default_factory=dict)
    """Planner-specific options: by name (chunk_size, k, ...), the fields of the planner's class
    in planners/options.py with defaults left out, as plan files store them; or an instance of
    that class (`ChunkFlowOptions(chunk_size=4096)`)."""


Planner = Callable[[PlanRequest], StepPlan]


def collector_paused(planner: Planner) -> Planner:
    """`planner` with Python's cyclic garbage collector paused while it runs (restored after,
    also on error). A plan allocates some 10^5-10^6 small objects (segments, chunks, actions)
    and none of them in cycles, yet each allocation burst triggers collections that walk all
    of them: pausing saves about a fifth of the planning time at 32K sequences. Nested calls
    (auto running the others) leave the collector to the outermost."""

    @functools.wraps(planner)
    def run(request: PlanRequest) -> StepPlan:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return planner(request)
        finally:
            if was_enabled:
                gc.enable()

    return run


def take_options(request: PlanRequest, planner: str) -> Any:
    """The planner's options object (its class in planners/options.py), built from the request's
    dict or taken as given; an unknown option or a value its field's check refuses is a
    UserError. Planners read its typed fields."""
    return build_options(planner, request.options)


def seq_len_limit(request: PlanRequest) -> int:
    """Longest sequence (and largest packed chunk) one pipeline of the scheme can hold, tokens."""
    s = request.scheme
    return int(request.cost.max_seq_len(tp=s.tp, pp=s.pp, cp=s.cp, dp=s.dp, zero=s.zero))


def check_lengths(request: PlanRequest) -> None:
    """Degrees valid, model states fit, the batch non-empty, every length positive and within the
    context length. Planners that split long sequences need no more than this."""
    s = request.scheme
    s.validate(request.model)
    request.cost.check_states_fit(tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, zero=s.zero)
    if not request.lengths:
        raise UserError("the global batch is empty: give at least one sequence")
    for seq_id, n in enumerate(request.lengths):
        if n < 1:
            raise UserError(f"sequence {seq_id} has length {n}: lengths must be at least 1 token")
        if n > request.context_length:
            raise UserError(f"sequence {seq_id} has {n} tokens > context length {request.context_length}: "
                            "raise --context-length or use --overlong truncate|drop")


def check_request(request: PlanRequest) -> int:
    """Model states fit; every length positive, within the context length and within one
    pipeline's memory under 1F1B (cost.max_seq_len).

    Returns that per-pipeline sequence limit (tokens) so planners can size chunks by it.
    """
    check_lengths(request)
    limit = seq_len_limit(request)
    longest = max(range(len(request.lengths)), key=lambda i: request.lengths[i], default=None)
    if longest is not None and request.lengths[longest] > limit:
        raise UserError(
            f"sequence {longest} has {request.lengths[longest]} tokens > {limit}, the longest one "
            f"pipeline of {request.scheme} can hold: raise --tp, --pp or --cp, or use a splitting planner"
        )
    return limit


def whole(seq_ids: list[int], lengths: list[int]) -> tuple[Segment, ...]:
    """Whole sequences as segments, in the given order."""
    return tuple(Segment(i, 0, lengths[i]) for i in seq_ids)


def pipelines_from_chunks(request: PlanRequest, per_pipeline: list[list[Chunk]],
                          schedule: str = "1f1b") -> list[PipelinePlan]:
    """One PipelinePlan per chunk list, each stage's actions from the named schedule."""
    s = request.scheme
    return [
        PipelinePlan(chunks=chunks, stages=make_schedule(schedule, chunks, s.pp), tp=s.tp, cp=s.cp,
                     schedule=schedule)
        for chunks in per_pipeline
    ]


def finish_plan(request: PlanRequest, pipelines: list[PipelinePlan], *, planner: str,
                started: float, options: dict[str, Any] | None = None) -> StepPlan:
    """Wrap pipelines into a StepPlan with its predicted metrics.

    `started` is the planner's `time.perf_counter()` at entry; planning time is measured up to
    here (validation is the caller's and not included).
    """
    plan = StepPlan(planner=planner, model=request.model, cluster=request.cluster,
                    lengths=list(request.lengths), pipelines=pipelines, zero=request.scheme.zero,
                    options=given_options(request.options if options is None else options))
    plan.metrics = plan_metrics(plan, request.cost)
    plan.metrics[PLANNING_MS] = (time.perf_counter() - started) * 1e3
    return plan


def plan_metrics(plan: StepPlan, cost: CostModel) -> dict[str, Any]:
    """Per-pipeline chunks, tokens and forward FLOPs (whole model), and the padding fraction."""
    fast = _array_metrics(plan, cost)
    if fast is not None:
        return fast
    layers = plan.model.num_layers
    row = sum(c.row_tokens for p in plan.pipelines for c in p.chunks)
    real = sum(c.num_tokens for p in plan.pipelines for c in p.chunks)
    flops: dict[tuple, float] = {}  # by work_key: equal work, equal FLOPs

    def forward_flops(c: Chunk) -> float:
        key = work_key(c)
        if key not in flops:
            flops[key] = cost.forward_flops(c, layers=layers, head=True)
        return flops[key]

    return {
        "chunks_per_pipeline": [len(p.chunks) for p in plan.pipelines],
        "tokens_per_pipeline": [sum(c.num_tokens for c in p.chunks) for p in plan.pipelines],
        "forward_flops_per_pipeline": [sum(forward_flops(c) for c in p.chunks) for p in plan.pipelines],
        "padding_fraction": (row - real) / row if row else 0.0,
        "loss_tokens": plan.loss_tokens,
    }


def _array_metrics(plan: StepPlan, cost: CostModel) -> dict[str, Any] | None:
    """plan_metrics over the segments as arrays (plan/arrays.py): the same integers, and each
    chunk's FLOPs by CostModel.forward_flops' arithmetic elementwise (the same floats), summed
    chunk by chunk in order as before; None where the cost model is another's or a count could
    leave int64's exact range."""
    if type(cost).forward_flops is not CostModel.forward_flops:
        return None
    chunks = [c for p in plan.pipelines for c in p.chunks]
    counts, fields = segment_fields(chunks)
    start, stop = fields[:, 1], fields[:, 2]
    if len(stop) and (int(stop.max()) >= 2**31 or float(stop.max()) ** 2 * len(stop) >= 2**62):
        return None
    tokens, keys = row_sums(counts, stop - start), row_sums(counts, causal_pairs(start, stop))
    pad = np.fromiter((c.pad_to for c in chunks), dtype=np.int64, count=len(chunks))
    padded = (pad > tokens) & (counts > 0)  # chunk_work's padded rows: k segments of pad_to // k tokens
    work_tokens = np.where(padded, pad, tokens)
    per = pad // np.maximum(counts, 1)
    work_keys = np.where(padded, counts * ((per * (per + 1)) // 2), keys)
    model, layers = plan.model, plan.model.num_layers
    lin = 2.0 * matmul_params_per_layer(model) * work_tokens.astype(np.float64)
    attn = 4.0 * model.q_dim * work_keys.astype(np.float64)
    flops = (layers * (lin + attn) + head_forward_flops(model, work_tokens.astype(np.float64))).tolist()
    bounds = np.cumsum([0] + [len(p.chunks) for p in plan.pipelines]).tolist()
    per_pipe = np.r_[0, np.cumsum(tokens)][bounds]
    row, real = int(np.maximum(tokens, pad).sum()), int(tokens.sum())
    return {
        "chunks_per_pipeline": [len(p.chunks) for p in plan.pipelines],
        "tokens_per_pipeline": np.diff(per_pipe).tolist(),
        "forward_flops_per_pipeline": [sum(flops[a:b]) for a, b in zip(bounds[:-1], bounds[1:])],
        "padding_fraction": (row - real) / row if row else 0.0,
        "loss_tokens": plan.loss_tokens,
    }


def recompute_forwards(pipelines: list[PipelinePlan], layers: list[int] | None,
                       mlp: list[int] | None = None) -> list[PipelinePlan]:
    """The pipelines, every forward on stage s recomputing `layers[s]` of that stage's layers
    whole and the MLP block of `mlp[s]` more (`F3.r5`, `F3.m7`; in place). None or all zeros
    leave them as they are."""
    layers = layers or [0] * len(mlp or [])
    mlp = mlp or [0] * len(layers)
    if any(layers) or any(mlp):
        for pipe in pipelines:
            pipe.stages = [[Action(FORWARD, a.chunk, layers[s], mlp[s]) if a.kind == FORWARD else a for a in actions]
                           for s, actions in enumerate(pipe.stages)]
    return pipelines
