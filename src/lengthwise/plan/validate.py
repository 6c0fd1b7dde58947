"""The invariants every StepPlan must satisfy, checked before a plan is simulated or executed.

    validate_plan(plan)          # structure, token coverage, schedules
    validate_plan(plan, cost)    # ... and every chunk fits its stage's memory

1. Degrees: pp, tp, cp >= 1; tp divides the heads; stage layers sum to the model's layers.
2. Segments: 0 <= start < stop <= length; cp_rank is SHARDED or in [0, cp); no empty chunk.
3. Each token of each sequence appears exactly once over all pipelines' forward chunks, and
   once again over the backward units when a pipeline groups its backward separately.
4. All slices of a sequence live in one pipeline (their K/V context never crosses pipelines).
5. Each pipeline's schedule forwards every chunk and backwards every unit once on every stage,
   slices forward in order and backward in reverse, and runs to the end without deadlock
   (`schedule_checks.check_schedule`, which replays it in lock-step), and every pipeline link
   carries its messages in one order at both ends (`schedule_checks.check_message_order`: NCCL matches
   point-to-point messages by order, not by tag), and the executor's batched posting of those
   messages cannot stall under NCCL's rendezvous rule, a send completing only once the peer
   posted its receive (`rendezvous.check_rendezvous`).
6. Loss normalisation: the positions that predict a next token, counted over the chunks, equal
   the batch's loss tokens sum(max(L - 1, 0)) (and the count recorded in the metrics, if any).
7. With a cost model: model states plus one chunk's activations plus the K/V state of its
   context fit every stage's GPU (the states without their gradients for a chunk forwarded
   before the stage's first backward, which allocates them). This is the bound of that chunk
   alone in the pipeline, so a plan a 1F1B pipeline could run is never rejected; the simulator
   checks the peak over time.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lengthwise.errors import UserError
from lengthwise.metrics import GIB
from lengthwise.plan.ir import (
    BACKWARD,
    FORWARD,
    FORWARD_NOGRAD,
    SHARDED,
    Action,
    Chunk,
    PipelinePlan,
    Segment,
    StepPlan,
)
from lengthwise.plan.rendezvous import check_rendezvous
from lengthwise.plan.segment_checks import segments_hold
from lengthwise.plan.schedule_checks import check_message_order, check_schedule

if TYPE_CHECKING:
    from lengthwise.cost import CostModel



def validate_plan(plan: StepPlan, cost: CostModel | None = None) -> None:
    """Raise UserError naming the pipeline, stage, action or chunk that breaks an invariant."""
    _check_lengths(plan)
    if plan.num_gpus > plan.cluster.num_gpus:
        raise UserError(f"plan uses {plan.num_gpus} GPUs but cluster {plan.cluster.name} has "
                        f"{plan.cluster.num_gpus}")
    # invariants 2, 3, 4 and 6 over arrays first; only a plan that breaks one is walked segment
    # by segment below, which names what is wrong (plan/segment_checks.py)
    walk = not segments_hold(plan)
    for p, pipe in enumerate(plan.pipelines):
        _check_degrees(plan, p, pipe)
        for unit_name, units in _unit_lists(pipe) if walk else ():
            _check_segments(plan, p, unit_name, units, pipe.cp)
    _check_no_dropped_stage(plan)
    _check_layer_splits_agree(plan)
    if walk:
        _check_one_pipeline_per_sequence(plan)
        _check_coverage(plan, backward=False)
        if any(pipe.backward_chunks is not None for pipe in plan.pipelines):
            _check_coverage(plan, backward=True)
    for p, pipe in enumerate(plan.pipelines):
        if pipe.backward_chunks is not None:
            check_backward_units(pipe.chunks, pipe.backward_chunks, where=f"pipeline {p}: ")
        _check_action_counts(p, pipe)
        check_recompute(plan, p, pipe)
        try:
            check_schedule(pipe.stages, pipe.chunks, pipe.backward_chunks)
            check_message_order(pipe.stages)
        except UserError as exc:
            raise UserError(f"pipeline {p}: {exc}") from None
        check_rendezvous(pipe.stages, pipeline=p)
    if walk:
        _check_loss_tokens(plan)
    if cost is not None:
        _check_memory(plan, cost)


def _check_lengths(plan: StepPlan) -> None:
    for seq_id, n in enumerate(plan.lengths):
        if n < 1:
            raise UserError(f"sequence {seq_id} has length {n}: lengths must be at least 1 token")


def _check_degrees(plan: StepPlan, p: int, pipe: PipelinePlan) -> None:
    if pipe.pp < 1 or pipe.tp < 1 or pipe.cp < 1:
        raise UserError(f"pipeline {p}: degrees must be >= 1, got pp={pipe.pp} tp={pipe.tp} cp={pipe.cp}")
    if plan.model.num_heads % pipe.tp:
        raise UserError(f"pipeline {p}: tp({pipe.tp}) does not divide the heads: "
                        f"{plan.model.name} has {plan.model.num_heads}")
    layers = pipe.stage_layers(plan.model.num_layers)
    if len(layers) != pipe.pp or sum(layers) != plan.model.num_layers or min(layers) < 0:
        raise UserError(f"pipeline {p}: layers_per_stage {layers} must give each of its {pipe.pp} "
                        f"stages >= 0 layers summing to {plan.model.num_layers}")


def _check_no_dropped_stage(plan: StepPlan) -> None:
    """Pipelines of different shapes (Hydraulis' heterogeneous strategy) use every GPU of the
    cluster; fewer means a pipeline lost stages or ranks (a plan file edited by hand)."""
    shapes = {(q.tp, q.pp, q.cp) for q in plan.pipelines}
    if len(shapes) > 1 and plan.num_gpus < plan.cluster.num_gpus:
        sizes = ", ".join(f"pipeline {p} tp{q.tp}-pp{q.pp}-cp{q.cp}" for p, q in enumerate(plan.pipelines))
        raise UserError(f"the pipelines differ in shape ({sizes}) and use {plan.num_gpus} of the cluster's "
                        f"{plan.cluster.num_gpus} GPUs: a pipeline lost a stage or ranks; plan the batch again")


def _check_layer_splits_agree(plan: StepPlan) -> None:
    """Pipelines of one (tp, pp, cp) shape are data-parallel replicas and hold the same layers on
    each stage: the executor shards and reduces stage s of all of them together."""
    first: dict[tuple[int, int, int], tuple[int, list[int]]] = {}
    for p, pipe in enumerate(plan.pipelines):
        layers = pipe.stage_layers(plan.model.num_layers)
        q, seen = first.setdefault((pipe.tp, pipe.pp, pipe.cp), (p, layers))
        if seen != layers:
            raise UserError(f"pipeline {p} splits its layers {layers} over its stages, pipeline {q} of the same "
                            f"tp/pp/cp {seen}: replicas must hold the same layers on each stage")


def _unit_lists(pipe: PipelinePlan) -> list[tuple[str, list[Chunk]]]:
    out = [("chunk", pipe.chunks)]
    if pipe.backward_chunks is not None:
        out.append(("backward unit", pipe.backward_chunks))
    return out


def _check_segments(plan: StepPlan, p: int, unit_name: str, units: list[Chunk], cp: int) -> None:
    for c, chunk in enumerate(units):
        where = f"pipeline {p} {unit_name} {c}"
        if not chunk.segments:
            raise UserError(f"{where} has no segments")
        if chunk.pad_to < 0:
            raise UserError(f"{where} has pad_to {chunk.pad_to} < 0")
        for seg in chunk.segments:
            _check_segment(plan, where, seg, cp)
        _check_slices_ascend_in_chunk(where, chunk)


def _check_slices_ascend_in_chunk(where: str, chunk: Chunk) -> None:
    """Two slices of one sequence in one row must come in token order (causal within the row)."""
    last_stop: dict[int, int] = {}
    for seg in chunk.segments:
        if seg.start < last_stop.get(seg.seq_id, 0):
            raise UserError(f"{where}: segment {seg} comes after a later slice of sequence {seg.seq_id} "
                            "in the same chunk; order a sequence's slices by token")
        last_stop[seg.seq_id] = seg.stop


def _check_segment(plan: StepPlan, where: str, seg: Segment, cp: int) -> None:
    if not 0 <= seg.seq_id < len(plan.lengths):
        raise UserError(f"{where}: segment {seg} names sequence {seg.seq_id}, but the batch has "
                        f"{len(plan.lengths)} (0..{len(plan.lengths) - 1})")
    length = plan.lengths[seg.seq_id]
    if not 0 <= seg.start < seg.stop <= length:
        raise UserError(f"{where}: segment {seg} needs 0 <= start < stop <= {length} "
                        f"(the length of sequence {seg.seq_id})")
    if seg.cp_rank != SHARDED and not 0 <= seg.cp_rank < cp:
        raise UserError(f"{where}: segment {seg} is placed on CP rank {seg.cp_rank}, but the "
                        f"pipeline has cp={cp} (ranks 0..{cp - 1}, or sharded)")


def _check_one_pipeline_per_sequence(plan: StepPlan) -> None:
    owner: dict[int, int] = {}
    for p, pipe in enumerate(plan.pipelines):
        for _, units in _unit_lists(pipe):
            for chunk in units:
                for seg in chunk.segments:
                    first = owner.setdefault(seg.seq_id, p)
                    if first != p:
                        raise UserError(f"sequence {seg.seq_id} has slices in pipelines {first} and {p}: "
                                        "all slices of a sequence must run in one pipeline")


def _check_coverage(plan: StepPlan, *, backward: bool) -> None:
    """Each token of each sequence exactly once: sort each sequence's slices, walk 0..length."""
    label = "backward" if backward else "forward"
    spans: dict[int, list[tuple[int, int, str]]] = {i: [] for i in range(len(plan.lengths))}
    for p, pipe in enumerate(plan.pipelines):
        units, name = (pipe.bwd_units, "backward unit") if backward else (pipe.chunks, "chunk")
        for c, chunk in enumerate(units):
            for seg in chunk.segments:
                spans[seg.seq_id].append((seg.start, seg.stop, f"pipeline {p} {name} {c}"))
    for seq_id, slices in spans.items():
        _walk_slices(seq_id, plan.lengths[seq_id], sorted(slices), label)


def _walk_slices(seq_id: int, length: int, slices: list[tuple[int, int, str]], label: str) -> None:
    covered, last_where = 0, ""
    for start, stop, where in slices:
        if start < covered:
            raise UserError(f"sequence {seq_id}: tokens [{start}:{min(stop, covered)}) appear twice in "
                            f"{label} ({last_where} and {where})")
        if start > covered:
            raise UserError(f"sequence {seq_id}: tokens [{covered}:{start}) are missing from {label}")
        covered, last_where = stop, where
    if covered < length:
        raise UserError(f"sequence {seq_id}: tokens [{covered}:{length}) are missing from {label}")


def _check_action_counts(p: int, pipe: PipelinePlan) -> None:
    """Per stage: each chunk one F (and at most one N), each backward unit one B."""
    sizes = {FORWARD: len(pipe.chunks), FORWARD_NOGRAD: len(pipe.chunks), BACKWARD: len(pipe.bwd_units)}
    for s, actions in enumerate(pipe.stages):
        counts = Counter((a.kind, a.chunk) for a in actions)
        for (kind, c), n in counts.items():
            if not 0 <= c < sizes[kind]:
                raise UserError(f"pipeline {p} stage {s} action {kind}{c}: index out of range "
                                f"(0..{sizes[kind] - 1})")
            if n > 1:
                raise UserError(f"pipeline {p} stage {s} runs {kind}{c} {n} times")
        for kind in (FORWARD, BACKWARD):
            missing = [f"{kind}{c}" for c in range(sizes[kind]) if (kind, c) not in counts]
            if missing:
                raise UserError(f"pipeline {p} stage {s} never runs {', '.join(missing[:8])}"
                                + (" ..." if len(missing) > 8 else ""))


def _check_loss_tokens(plan: StepPlan) -> None:
    """Positions predicting a next token over all chunks == the batch's loss tokens."""
    counted = sum(
        max(0, min(seg.stop, plan.lengths[seg.seq_id] - 1) - seg.start)
        for pipe in plan.pipelines for chunk in pipe.chunks for seg in chunk.segments
    )
    expected = plan.loss_tokens
    if counted != expected:
        raise UserError(f"loss normalisation: the chunks hold {counted} loss tokens but the batch has "
                        f"sum(max(L - 1, 0)) = {expected}")
    recorded = plan.metrics.get("loss_tokens")
    if recorded is not None and recorded != expected:
        raise UserError(f"loss normalisation: metrics record {recorded} loss tokens but the batch has "
                        f"sum(max(L - 1, 0)) = {expected}")


def _check_memory(plan: StepPlan, cost: CostModel) -> None:
    # ZeRO shards over every rank holding the stage: each pipeline's CP ranks (SlimPack's
    # DP-Merged pipelines have more than the others)
    replicas = sum(q.cp for q in plan.pipelines)
    budgets: dict = {}  # pipelines of one shape share their stages' budgets
    for p, pipe in enumerate(plan.pipelines):
        over = memory_overflow(pipe, cost, num_layers=plan.model.num_layers, dp=replicas, zero=plan.zero,
                               where=f"pipeline {p} ", budgets=budgets)
        if over is not None:
            raise UserError(f"pipeline {p} {over.describe(pipe, cost)}")


@dataclass(frozen=True)
class ChunkOverflow:
    """A forward chunk that does not fit its stage's GPU alone (invariant 7), in bytes."""

    stage: int
    chunk: int
    need: float
    activation: float
    kv: float
    states: float

    def describe(self, pipe: PipelinePlan, cost: CostModel) -> str:
        return (f"stage {self.stage} chunk {self.chunk} ({_short(pipe.chunks[self.chunk])}) needs "
                f"{self.need / GIB:.1f} GiB = activations {self.activation / GIB:.1f} + K/V context "
                f"{self.kv / GIB:.1f} + model states {self.states / GIB:.1f} > {cost.capacity_bytes / GIB:.1f} "
                "GiB capacity: split or shrink the chunk")


def memory_overflow(pipe: PipelinePlan, cost: CostModel, *, num_layers: int, dp: int, zero: int,
                    where: str = "", budgets: dict | None = None) -> ChunkOverflow | None:
    """The first forward chunk of `pipe` whose model states, activations and K/V context do not
    fit its stage's GPU alone (invariant 7), or None. `dp` is the number of ranks holding a
    replica of a stage (pipelines times CP ranks), over which ZeRO shards model states. Planners call this to keep their plans valid."""
    layers = pipe.stage_layers(num_layers)
    loads = [_cp_rank_loads(chunk, pipe.cp) for chunk in pipe.chunks]  # the same on every stage
    for s, actions in enumerate(pipe.stages):
        last = s == pipe.pp - 1
        key = (s, pipe.tp, pipe.pp, dp, zero, layers[s])
        budget = budgets.get(key) if budgets is not None else None
        if budget is None:  # (`budgets`: a memo of them by stage shape, when the caller keeps one)
            budget = cost.stage_budget(stage=s, tp=pipe.tp, pp=pipe.pp, replicas=dp, zero=zero, layers=layers[s])
            if budgets is not None:
                budgets[key] = budget
        # the gradients come into being in the stage's first backward (as the simulator and the
        # executor have them): a chunk forwarded before it holds the states without them
        first_b = next((i for i, a in enumerate(actions) if a.kind == BACKWARD), len(actions))
        early = {a.chunk for a in actions[:first_b] if a.kind == FORWARD}
        recompute = {a.chunk: (a.recompute_layers, a.recompute_mlp) for a in actions if a.kind == FORWARD}
        per_token: dict[tuple[int, int], float] = {}  # activation bytes per row token, by recomputed layers
        for c, chunk_loads in enumerate(loads):
            r, m = level = recompute.get(c, (0, 0))
            if r + m > layers[s]:
                raise UserError(f"{where}stage {s} {Action(FORWARD, c, r, m)}: recomputes {r} layers"
                                f"{f' and the MLP of {m} more' if m else ''} but the stage has {layers[s]}")
            if level not in per_token:
                per_token[level] = cost.activation_bytes_per_token(layers=layers[s], tp=pipe.tp, recompute_layers=r,
                                                                   recompute_mlp=m, head=last)
            act, kv = _fullest_cp_rank(cost, per_token[level], chunk_loads, layers[s], pipe.tp)
            states = budget.states - (budget.grads if c in early else 0.0)
            need = states + act + kv
            if need > cost.capacity_bytes:
                return ChunkOverflow(stage=s, chunk=c, need=need, activation=act, kv=kv, states=states)
    return None


def _fullest_cp_rank(cost: CostModel, per_token: float, loads: list[tuple[float, float]], layers: int,
                     tp: int) -> tuple[float, float]:
    """(activation, K/V-context) bytes of the chunk's fullest CP rank: every rank's load is
    checked, since a whole segment placed on rank 1 weighs on rank 1 alone."""
    _, act, kv = max(_chunk_bytes(cost, per_token, tokens, context, layers, tp) for tokens, context in loads)
    return act, kv


def _chunk_bytes(cost: CostModel, per_token: float, tokens: float, context: float, layers: int,
                 tp: int) -> tuple[float, float, float]:
    """(total, activation, K/V-context) bytes of one CP rank's share of a chunk, held alone.
    Activations grow with the rank's row tokens (`per_token`: CostModel.activation_bytes_per_token
    of the stage; at least one token); infinipipe eq. 9: earlier slices' K/V stay resident while
    this slice runs."""
    act = per_token * max(1, math.ceil(tokens))
    kv = cost.kv_bytes(math.ceil(context), layers=layers, tp=tp, cp=1) if context else 0.0
    return act + kv, act, kv


def _cp_rank_loads(chunk: Chunk, cp: int) -> list[tuple[float, float]]:
    """(row tokens, context tokens) per CP rank: sharded segments and padding split evenly,
    whole segments on their rank."""
    if cp == 1:
        return [(float(chunk.row_tokens), float(sum(seg.start for seg in chunk.segments)))]
    tokens, context = [0.0] * cp, [0.0] * cp
    for seg in chunk.segments:
        share = [seg.cp_rank] if seg.cp_rank != SHARDED and cp > 1 else range(cp)
        for r in share:
            tokens[r] += seg.num_tokens / len(share)
            context[r] += seg.start / len(share)
    pad = chunk.row_tokens - chunk.num_tokens
    return [(t + pad / cp, x) for t, x in zip(tokens, context)]


def _short(chunk: Chunk, limit: int = 3) -> str:
    segs = [str(s) for s in chunk.segments[:limit]]
    more = f"+...{len(chunk.segments) - limit} more" if len(chunk.segments) > limit else ""
    return "+".join(segs) + more + (f"/pad{chunk.pad_to}" if chunk.pad_to else "")


def check_backward_units(chunks: list[Chunk], units: list[Chunk], *, where: str = "") -> None:
    """UserError unless every backward segment is a whole forward segment or a sub-range of one
    with the same CP placement (the rule of this module's docstring). Coverage (each token once)
    is validate_plan's; this checks only the nesting."""
    fwd: dict[int, list[tuple[int, int, int]]] = {}
    for ch in chunks:
        for s in ch.segments:
            fwd.setdefault(s.seq_id, []).append((s.start, s.stop, s.cp_rank))
    for spans in fwd.values():
        spans.sort()
    for u, unit in enumerate(units):
        for s in unit.segments:
            spans = fwd.get(s.seq_id, [])
            k = bisect.bisect_right(spans, (s.start, float("inf"), 0)) - 1
            if k < 0 or not (spans[k][0] <= s.start and s.stop <= spans[k][1] and spans[k][2] == s.cp_rank):
                raise UserError(f"{where}backward unit {u}: segment {s} is not inside one forward segment "
                                f"of sequence {s.seq_id} with the same CP placement: a backward unit may only "
                                "hold whole forward segments or sub-ranges of one")


def check_recompute(plan: StepPlan, p: int, pipe: PipelinePlan) -> None:
    """A forward recomputes at most the layers its stage holds, whole (`.r`) and MLP only (`.m`)
    together (F3.r2 on a 1-layer stage is wrong, and so is F3.r1.m1)."""
    for s, (actions, layers) in enumerate(zip(pipe.stages, pipe.stage_layers(plan.model.num_layers))):
        for a in actions:
            if a.recompute_layers + a.recompute_mlp > layers:
                mlp = f" and the MLP of {a.recompute_mlp} more" if a.recompute_mlp else ""
                raise UserError(f"pipeline {p} stage {s} {a}: recomputes {a.recompute_layers} layers{mlp} "
                                f"but the stage has {layers}")


def load_plan(path: str | Path, cost: CostModel | None = None) -> StepPlan:
    """A plan file read with every field type-checked, then through `validate_plan`: what every
    reader of a PLAN.json uses, so a damaged or edited plan is a one-line error, not a result."""
    plan = StepPlan.load(path)
    try:
        validate_plan(plan, cost)
    except UserError as exc:
        raise UserError(f"{path}: invalid plan: {exc}") from None
    return plan
