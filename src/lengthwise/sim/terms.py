"""Where a simulated step's time goes, term by term, on each stage (for fidelity reports).

    terms = stage_time_terms(plan, cm)     # [pipeline][stage] {"layers": s, "head": s, ...}
    busiest = step_time_terms(plan, cm)    # the terms of the stage with the most busy time

Terms (cost/time.py): `layers` (every layer pass, the host floor included where it is the
longer; recomputed layers too), `head` (LM head and loss, last stage), `embed` (first stage),
`host` (per-chunk host overhead), `comm` (tensor- and context-parallel communication inside the
actions; without a profile everything is `layers`), and once per step
`grad_norm` and `optimizer` (the stage's share). Busy time only: bubbles and exposed gradient
reduction are the simulator's (`SimResult`). A one-stage plan's step time is exactly their sum
when no reduction is exposed.

Host ahead of the device (`host_overlap`): a profile's layer pass takes the longer of the host
floor and the device's work, each measured with the device idle around it. Within a step the
host does not wait for the device (no host syncs in the hot path), so on a stage whose actions
mix host-bound passes (small chunks, many documents) with device-bound ones, the host issues the
former while the device still runs the latter: the stage's layer time is the longer of its host
sum and its device sum, not the sum of each pass's longer one. The simulator scales each
action's layer time on that stage by that ratio (<= 1; exactly the stage's layer time on one
stage, an approximation of where it goes in a pipeline's timeline).
"""

from __future__ import annotations

import lengthwise.cost.memory as mem
from lengthwise.cost import CostModel
from lengthwise.cost.flops import chunk_work
from lengthwise.cost.flops import rank_works
from lengthwise.cost.time import layer_seconds
from lengthwise.plan.ir import BACKWARD, FORWARD, StepPlan
from lengthwise.plan.schedules import dependencies

TERMS = ("layers", "head", "embed", "host", "comm", "grad_norm", "optimizer")


def stage_time_terms(plan: StepPlan, cm: CostModel) -> list[list[dict[str, float]]]:
    """[pipeline][stage] seconds per term of that stage's actions and step end."""
    out = []
    for pipe in plan.pipelines:
        layers = pipe.stage_layers(plan.model.num_layers)
        dp = sum(p.cp for p in plan.pipelines)
        rows = []
        for s, actions in enumerate(pipe.stages):
            first, last = s == 0, s == pipe.pp - 1
            terms = dict.fromkeys(TERMS, 0.0)
            factor, fmax, bmax = host_overlap(cm, pipe, s, layers[s])
            unit_reruns = backward_reruns(pipe, s)
            for action in actions:
                backward = action.kind == BACKWARD
                chunk = (pipe.bwd_units if backward else pipe.chunks)[action.chunk]
                reruns = unit_reruns[action.chunk] if backward else (0, 0)
                total = (cm.backward_time(chunk, layers=layers[s], tp=pipe.tp, cp=pipe.cp, head=last, embed=first,
                                          recompute_layers=reruns[0], recompute_mlp=reruns[1]) if backward else
                         cm.forward_time(chunk, layers=layers[s], tp=pipe.tp, cp=pipe.cp, head=last, embed=first))
                saved = (1.0 - factor) * (bmax if backward else fmax)[action.chunk] if factor < 1.0 else 0.0
                _split(cm, terms, chunk, layers[s], reruns, pipe, first, last, backward, total - saved, saved)
            _step_end(cm, terms, layers[s], pipe.tp, dp, plan.zero, first, last)
            rows.append(terms)
        out.append(rows)
    return out


def backward_reruns(pipe, stage: int) -> list[tuple[int, int]]:
    """[backward unit] (layers, MLP blocks) its B reruns on `stage`: what the F actions of the
    chunks it reads checkpoint, the most of each, as the simulator charges them
    (`sim/action_times.py`)."""
    level = {a.chunk: (a.recompute_layers, a.recompute_mlp) for a in pipe.stages[stage] if a.kind == FORWARD}
    if not any(r or m for r, m in level.values()):
        return [(0, 0)] * len(pipe.bwd_units)
    needs = dependencies(pipe.chunks, pipe.backward_chunks).bwd_needs
    return [(max((level.get(c, (0, 0))[0] for c in reads), default=0),
             max((level.get(c, (0, 0))[1] for c in reads), default=0)) for reads in needs]


def step_time_terms(plan: StepPlan, cm: CostModel) -> dict[str, float]:
    """The terms of the stage whose terms add up to the most."""
    stages = [t for rows in stage_time_terms(plan, cm) for t in rows]
    return max(stages, key=lambda t: sum(t.values()), default=dict.fromkeys(TERMS, 0.0))


def host_overlap(cm: CostModel, pipe, stage: int, layers: int) -> tuple[float, list[float], list[float]]:
    """(factor, per chunk the forward's layer time, per backward unit the backward's): the
    stage's layer time is factor x the sum of its actions' (module docstring); factor 1.0
    without a profile's host floor or with CP (not modelled there)."""
    fit = cm.profile.fit_for(pipe.tp, 1) if cm.profile else None
    if fit is None or not fit.has_floor or pipe.cp > 1 or not layers:
        return 1.0, [], []
    parts = {}
    for backward, chunks in ((False, pipe.chunks), (True, pipe.bwd_units)):
        work_fit, floor = (fit.bwd, fit.bwd_floor) if backward else (fit.fwd, fit.fwd_floor)
        seg = fit.bwd_segment_tokens if backward else 0.0
        rows = []
        for c in chunks:
            w = chunk_work(c)
            host = layers * (floor[0] + floor[1] * w.segments)
            device = layers * layer_seconds(work_fit, (0.0, 0.0), w.keys, w.tokens, w.segments, seg)
            rows.append((host, device, max(host, device)))
        parts[backward] = rows
    host = device = longer = 0.0
    for action in pipe.stages[stage]:
        h, d, m = parts[action.kind == BACKWARD][action.chunk]
        host, device, longer = host + h, device + d, longer + m
    factor = max(host, device) / longer if longer > 0 else 1.0
    return factor, [r[2] for r in parts[False]], [r[2] for r in parts[True]]


def _split(cm: CostModel, terms: dict, chunk, layers: int, reruns: tuple[int, int], pipe, first: bool, last: bool,
           backward: bool, total: float, saved: float = 0.0) -> None:
    """Add one action's `total` seconds to the terms (the busiest CP rank's work; `reruns`: the
    layers and the MLP blocks its backward recomputes). Without a profile the analytic curve's
    time is all `layers` (its overheads are per layer)."""
    fit = cm.profile.fit_for(pipe.tp, 1) if cm.profile else None
    if fit is None:
        terms["layers"] += total
        return
    work = max(rank_works(chunk, pipe.cp), key=lambda w: w.tokens)
    work_fit, floor = (fit.bwd, fit.bwd_floor) if backward else (fit.fwd, fit.fwd_floor)
    body = layers * layer_seconds(work_fit, floor, work.keys, work.tokens, work.segments,
                                  fit.bwd_segment_tokens if backward else 0.0)
    recompute, mlp = reruns  # the profile's rerun seconds, as the backward's total has them
    body += cm.recompute_time(work, layers=recompute, tp=pipe.tp) + cm.mlp_recompute_time(work, layers=mlp, tp=pipe.tp)
    body -= saved
    hb, hc = fit.head_bwd if backward else fit.head_fwd
    head = (hb * work.tokens + hc) if last else 0.0
    step = cm.profile.step
    host = step.chunk_overhead_s if step else 0.0
    embed = 0.0
    if step and first:
        eb, ec = step.embed_bwd if backward else step.embed_fwd
        embed = eb * work.tokens + ec
    for name, value in (("layers", body), ("head", head), ("embed", embed), ("host", host)):
        terms[name] += value
    terms["comm"] += max(total - body - head - embed - host, 0.0)


def _step_end(cm: CostModel, terms: dict, layers: int, tp: int, dp: int, zero: int, first: bool, last: bool) -> None:
    step = cm.profile.step if cm.profile else None
    if step is None:
        return
    share = mem.stage_params(cm.model, layers=layers, tp=tp, first=first, last=last) / cm.model.num_params
    terms["grad_norm"] += share * step.grad_norm_s
    terms["optimizer"] += share * step.optimizer_s / (dp if zero >= 1 else 1)
