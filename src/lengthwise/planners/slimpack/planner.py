"""SlimPack's choice of MicroPack count, schedule and DP-Merge variant by simulation
(slimpack.txt §5.1, §4.1.2 "each of them is evaluated by a high-fidelity simulator", §4.3).

    groups, pipes, metrics = plan_by_simulation(request, models, opts)

Candidate counts are log-spaced from pp (§5.1: pp, pp*sqrt2, 2pp, ... rounded, duplicates
dropped, up to max_micropacks); each candidate plans every pipeline and simulates the step
(lengthwise.sim). The sweep stops once two fitting candidates in a row are slower than the best
before them (step time against N is U-shaped: bubbles fall as 1/N, per-MicroPack costs grow
with N). Each pipeline keeps the count that finishes it soonest within memory ("each DP replica
may choose a different N"). The lean schedule is swept too when the steady one fits no count;
every Phase-1 variant (with and without compute merges) is swept and the faster step wins; when
none fits, memory outliers are merged over more ranks (the next HOLD share).

Recomputation (option `recompute`; slimpack §6.1 turns recomputation on as memory requires, for
SlimPack and its baseline alike): all slices of a causal sequence are forwarded before its
backward, so the longest sequence's activations are a floor that no MicroPack count lowers.
"auto" plans exactly as without recomputation whenever that fits; only when no count, schedule,
Phase-1 variant or HOLD share fits does it plan again, every forward recomputing r of its
stage's layers for r = 1/4, 1/2, 3/4 and all of them (rounded up): from the fewest that fit
up, the fastest simulated step wins (the fewest that fit often fit only at the largest counts,
where per-MicroPack costs outweigh the re-run forwards; plan.metrics["recompute_levels"]). The
recompute is written into every candidate's forward actions (F3.r5) before the candidate is
simulated, so the sweep sees the smaller activations and the re-run forwards. The level is in
plan.options["recompute"] ("none", "partial" or "full") and plan.metrics["recompute_layers"]
(per stage). With a fixed num_micropacks, "full" recomputes every layer of the pipelines built
(their count still fits each MicroPack alone without recomputation) and "auto" never recomputes.
"mlp" (ours, not the paper's) makes every forward recompute the MLP block of all its stage's
layers (F3.m5: about three quarters of a layer's activations for a sixth more of its forward,
`cost/memory.py`), with no other level tried; "auto" does not try it, as the paper recomputes
whole layers. Its level is plan.metrics["recompute_mlp_layers"] (per stage). The distributed
executor refuses recomputation of whole layers of a MicroPack with CP-sharded segments
(runtime/distributed/cp_stage.py): a plan that recomputes in a DP-Merged pipeline (cp > 1) runs
in the simulator and on the one-process executor (`lengthwise verify` without --nproc), not
across processes; without DP-Merge (every pipeline cp 1) it runs on either.

Cost, in sequences n, pipelines P (DP ranks after DP-Merge), stages pp and candidate counts C
(at most ~2 log2(max_micropacks / pp) + 2 per schedule, Phase-1 variant and HOLD share; the sweep
usually stops after 3-9):

- Phase 1 (dp.py): O(n log n) sorting plus the balancing of packing_utils (Karmarkar-Karp and
  LPT, about O(n log P)); with merged outliers the weighted LPT keeps a heap per merged-group
  size, O(n R log P) for R distinct sizes; a memory outlier left without ranks scans the merged
  groups (O(outliers x groups), only once the ranks run out).
- Per pipeline, once per sweep: its stream (sort, O(S log S) for its S samples) and its
  whole-sample FLOPs prefix sums. Per count, every pipeline at once (build.build_candidates):
  the cuts by numpy over all streams (cuts.streams_cuts; only the search for the sample a
  target lands in runs stream by stream), then MicroPacks and backward units by numpy over the
  streams laid end to end (pieces.streams_pieces: sorting the n + P N sample and cut positions
  into elementary intervals, each one segment, O((n + P N) log(n + P N))), which also yields
  the PackFlow readiness, the slice dependencies and the split sequences the simulator needs
  (a SliceStructure per pipeline); the PackFlow schedule of all stages of a pipeline by numpy,
  O(pp (N + units)). The Segment and Chunk objects of a candidate are made only for the
  pipelines that keep it (LazyChunks): the simulator reads the SliceStructure instead.
- The simulation of every candidate (§4.1.2 "each of them is evaluated by a high-fidelity
  simulator", §5.1): O(n + P N pp) actions and segments per candidate, with the simulator's
  per-action constant (its task graph per distinct pipeline shape, its memory events for all
  pipelines at once). This is what the paper forces: C full-plan simulations, so planning is
  C times linear in the plan's size (n segments, P N MicroPacks), not better. The simulator's
  task graphs (one per distinct schedule and dependency shape, those of a candidate built
  together with numpy), its per-pipeline cost tables and its memory replay (one sort of every
  allocation event) now share most of that time. A plan whose pipelines keep
  different counts is not simulated again: its step time is composed exactly from the
  candidates' per-pipeline results (composed_step_time). A fixed `num_micropacks` skips the
  sweep (one build per pipeline, plus the memory check of fitting_pipeline).

Measured (benchmarks/bench_planning_scale.py, qwen2.5-7b pp 4, 32,768 sequences, CPU seconds,
the least of six runs alternating with the code before, on a shared 2-core machine, the same
plans): 64 GPUs 0.63 s, 1024 GPUs 1.6 s, 4096 GPUs 2.0 s, after the simulator built a
candidate's task graphs together with numpy (0.72, 2.2 and 2.1 s before; 1.82, 4.2-4.4 and
5.0-5.3 s before the pipelines of a count were cut and simulated together). Issue 28 (CPU
seconds, `--baseline` runs alternating with the code before on a machine at load ~10, the same
plans): 1024 GPUs x 32,768 sequences 2.7 s (3.5 s before), 4096 GPUs x 131,072 sequences 10.9 s
(17.6 s before), after the plan-wide sums of the simulator's inputs and its cell frees stopped
being quadratic in pipelines and Karmarkar-Karp took bare items from a sorted list. Then
(`--baseline ca2693a`, load average 9-14 at 1024 GPUs, 4-9 at 4096): 1.18 s (1.61 s before) and
5.06 s (6.64 s before), after the simulator's inputs of every pipeline of a candidate were laid
out together (sim/cell_costs.py, sim/cell_inputs.py), its memory events and task tables lost
their per-pipeline passes, Karmarkar-Karp let a partition take its run of bare items without the
heap, and the MicroPack metrics were read off the segments as arrays (slimpack/metrics.py).
"""

from __future__ import annotations

import math
import time

import numpy as np

from lengthwise.cost.model import split_layers
from lengthwise.errors import UserError
from lengthwise.metrics import GIB, PEAK_MEMORY_GIB, PLANNING_MS, PREDICTED_STEP_TIME_S, STEP_TIME_S
from lengthwise.plan.ir import PipelinePlan, StepPlan
from lengthwise.plan.validate import check_backward_units
from lengthwise.planners.base import PlanRequest, check_lengths, finish_plan, recompute_forwards
from lengthwise.planners.options import options_dict
from lengthwise.planners.slimpack.build import (
    HOLD_SHARES,
    bare_plan,
    build_candidates,
    fitting_pipeline,
    materialize,
    flops_models,
    merge_metrics,
    phase1_variants,
    prepare_stream,
    read_options,
)
from lengthwise.planners.slimpack.metrics import micropack_metrics
from lengthwise.sim import simulate_plan

SWEEP_RATIO = 2 ** 0.5
MAX_SEQUENCES = 1 << 20
"""Most sequences one batch may have: the sweep holds every candidate's segments and simulates
each (measured at 4096 GPUs x 131,072 sequences: 0.87 GB resident, 14 CPU seconds; both grow
about linearly, so 8 times that many needs about 7 GB and minutes). Larger batches are refused
before any work."""
RECOMPUTE_SHARES = (0.25, 0.5, 0.75, 1.0)
"""Shares of each stage's layers "auto" recomputes, in order, when nothing fits without."""


def recompute_levels(request: PlanRequest, choice: str) -> list[list[int]]:
    """Layers each stage's forwards recompute, per level to try in order: [none] for "none" and
    "mlp" (whose MLP blocks are not whole layers), [all] for "full"; "auto": none, then
    RECOMPUTE_SHARES of each stage's layers (rounded up, repeated levels dropped), ending at all
    of them (`choice` checked by `SlimPackOptions`)."""
    layers = split_layers(request.model.num_layers, request.scheme.pp)
    if choice != "auto":
        return [layers if choice == "full" else [0] * len(layers)]
    levels = [[0] * len(layers)]
    for share in RECOMPUTE_SHARES:
        level = [min(n, math.ceil(share * n - 1e-9)) for n in layers]
        if level not in levels:
            levels.append(level)
    return levels


def recompute_name(level: list[int], layers: list[int], mlp: list[int] | None = None) -> str:
    if mlp and any(mlp):
        return "mlp"
    return "none" if not any(level) else "full" if level == layers else "partial"


def plan_by_simulation(request: PlanRequest, models, opts, recompute: list[int] | None = None,
                       mlp: list[int] | None = None):
    """Phase-1 variants swept at the first HOLD share that lets every pipeline fit in simulation
    (`recompute`: layers every forward of stage s recomputes, None for none; `mlp`: layers whose
    MLP block it recomputes besides)."""
    tried, error = set(), None
    for hold in HOLD_SHARES:
        try:
            variants, flops = phase1_variants(request, models, opts.dp_merge, hold)
        except UserError as exc:  # not enough ranks (or memory) to merge more: no smaller share helps
            error = error or exc
            break
        key = str([merge_metrics(v) for v in variants])
        if key in tried:
            continue
        tried.add(key)
        try:
            return best_variant(request, variants, models, flops, opts, recompute, mlp)
        except UserError as exc:
            error = exc
    raise error


def best_variant(request: PlanRequest, variants, models, flops, opts, recompute: list[int] | None = None,
                 mlp: list[int] | None = None):
    """Sweep every Phase-1 variant; keep the one with the shortest simulated step."""
    best, error, tried = None, None, []
    for groups in variants:
        try:
            pipes, extra = sweep(request, groups, models, flops, opts, recompute, mlp)
        except UserError as exc:  # this variant fits no count; another may
            error = exc
            continue
        tried.append({"dp_merge": merge_metrics(groups), STEP_TIME_S: extra[PREDICTED_STEP_TIME_S]})
        if best is None or extra[PREDICTED_STEP_TIME_S] < best[2][PREDICTED_STEP_TIME_S]:
            best = (groups, pipes, extra)
    if best is None:
        raise error
    best[2]["phase1_variants"] = tried
    return best


def sweep(request: PlanRequest, groups, models, flops, opts, recompute: list[int] | None = None,
          mlp: list[int] | None = None) -> tuple[list[PipelinePlan], dict]:
    """Step 5: simulate every candidate count (the lean schedule too where the steady one fits
    no count, or when asked for), keep per pipeline the fastest candidate that fits."""
    counts = sweep_counts(request.scheme.pp, opts.max_micropacks)
    capacity = request.cost.capacity_bytes
    candidates: list[dict] = []
    prepared = [prepare_stream(request, g, flops) for g in groups]  # shared by every count and schedule
    for lean in schedule_variants(opts):
        candidates += simulate_candidates(request, groups, counts, models, flops, opts.asymmetric, lean,
                                          prepared, recompute=recompute, mlp=mlp)
        if all(any(c["peak"][p] <= capacity for c in candidates) for p in range(len(groups))):
            break
    chosen = choose_per_pipeline(candidates, capacity)
    pipes = [materialize(candidates[k]["pipelines"][p]) for p, k in enumerate(chosen)]
    for p, pipe in enumerate(pipes):
        check_backward_units(pipe.chunks, pipe.backward_chunks or pipe.chunks, where=f"pipeline {p}: ")
    if len(set(chosen)) == 1:
        predicted = candidates[chosen[0]][STEP_TIME_S]
    else:  # the mixed plan's step, composed from its pipelines' own simulations (no re-simulation)
        predicted = composed_step_time([candidates[k]["ends"][p] for p, k in enumerate(chosen)],
                                       [candidates[k]["sync"][p] for p, k in enumerate(chosen)],
                                       [pipe.extra_comm_s for pipe in pipes])
    table = [{"micropacks": c["count"], "lean": c["lean"], STEP_TIME_S: c[STEP_TIME_S], "fits": c["fits"],
              PEAK_MEMORY_GIB: max(c["peak"]) / GIB} for c in candidates]
    return pipes, {"sweep": table, PREDICTED_STEP_TIME_S: predicted}


def schedule_variants(opts: dict) -> list[bool]:
    """`lean` flags to try in order: steady first under "auto" (lean only matters when asymmetric)."""
    if not opts.asymmetric:
        return [False]
    return {"auto": [False, True], "steady": [False], "lean": [True]}[opts.schedule]


def sweep_counts(pp: int, top: int) -> list[int]:
    """§5.1: pp, pp * sqrt2, pp * 2, ... rounded, up to `top` (included), duplicates dropped."""
    counts, k = [], 0
    while True:
        n = round(pp * SWEEP_RATIO**k)
        if n > top:
            break
        if n not in counts:
            counts.append(n)
        k += 1
    return counts + ([top] if top not in counts else [])


def simulate_candidates(request: PlanRequest, groups, counts, models, flops, asymmetric, lean,
                        prepared=None, *, recompute: list[int] | None = None,
                        mlp: list[int] | None = None) -> list[dict]:
    """Every pipeline at every candidate count, simulated: per candidate its pipelines, per-pipeline
    makespan and peak memory, and the whole step (`prepared`: build.prepare_stream per group;
    `recompute`: layers every forward of stage s recomputes, `mlp` layers whose MLP block it
    recomputes besides, written into the actions first)."""
    out: list[dict] = []
    prepared = prepared or [prepare_stream(request, g, flops) for g in groups]
    for n in counts:
        built = build_candidates(request, groups, n, models, flops, asymmetric, lean, check=False, prepared=prepared)
        pipes = recompute_forwards([pipe for pipe, _ in built], recompute, mlp)
        result = simulate_plan(bare_plan(request, pipes), request.cost, known=[known for _, known in built])
        out.append({"count": n, "lean": lean, "pipelines": pipes, "makespan": result.pipeline_makespan,
                    "peak": [max(row) for row in result.peak_memory], STEP_TIME_S: result.step_time_s,
                    "fits": bool(result.fits), "ends": stage_ends(result), "sync": result.grad_sync})
        if past_the_best(out):
            break
    return out


def stage_ends(result) -> list[np.ndarray]:
    """[pipeline] float64 [stage] end of each stage's last action in a simulated step."""
    t, offs = result.timeline, result.timeline.stage_offsets
    gstage = np.asarray(offs[:-1], dtype=np.int64)[t.tasks.pipeline] + t.tasks.stage
    end = np.zeros(offs[-1])
    np.maximum.at(end, gstage, t.finish)
    return [end[a:b] for a, b in zip(offs[:-1], offs[1:])]


def composed_step_time(ends: list[np.ndarray], sync: list[list[float]], extra: list[float]) -> float:
    """The step time simulate_plan gives a plan whose pipelines (all of one pp) were each
    simulated in some other plan of the same pipeline count and GPU layout: pipelines run
    independently, and only the gradient reductions join them (stage s of every pipeline starts
    reducing when the slowest replica's stage s is done; lengthwise.sim.simulate). The same
    maxima and sums of the same numbers, so the same float."""
    aligned = np.max(np.stack(ends), axis=0)
    return float(max((max(float(e.max(initial=0.0)), float((aligned + np.asarray(sy)).max(initial=0.0))) + x
                      for e, sy, x in zip(ends, sync, extra)), default=0.0))


def past_the_best(candidates: list[dict], patience: int = 2) -> bool:
    """Whether the last `patience` candidates all fit and all ran slower than the best fitting
    one before them: more, smaller MicroPacks only add per-MicroPack overheads from there on
    (step time against N is U-shaped: bubbles fall as 1/N, fixed costs grow with N)."""
    fitting = [c[STEP_TIME_S] for c in candidates if c["fits"]]
    tail = candidates[-patience:]
    if len(tail) < patience or not all(c["fits"] for c in tail) or len(fitting) <= patience:
        return False
    best_before = min(fitting[:-patience])
    return all(c[STEP_TIME_S] > best_before for c in tail)


def choose_per_pipeline(candidates: list[dict], capacity: float) -> list[int]:
    """Per pipeline, the candidate index that finishes it soonest within memory."""
    chosen = []
    for p in range(len(candidates[0]["pipelines"])):
        fitting = [k for k, c in enumerate(candidates) if c["peak"][p] <= capacity]
        if not fitting:
            best = min(candidates, key=lambda c: c["peak"][p])
            raise UserError(
                f"slimpack: pipeline {p} fits no MicroPack count of {sorted({c['count'] for c in candidates})}: its "
                f"smallest simulated peak is {best['peak'][p] / GIB:.1f} GiB at {best['count']} MicroPacks > "
                f"{capacity / GIB:.1f} GiB capacity: raise max_micropacks, --tp or --pp"
            )
        chosen.append(min(fitting, key=lambda k: (candidates[k]["makespan"][p], k)))
    return chosen


def plan_recomputing(request: PlanRequest, models, opts, levels: list[list[int]], mlp: list[int] | None = None):
    """plan_by_simulation at each recompute level (recompute_levels) in turn: (groups, pipelines,
    metrics, level). Without recomputation when that fits (the plan is then exactly the one of
    "none"); else, from the fewest recomputed layers that fit up to all of them, the level whose
    plan the simulator finds fastest (ties: fewer layers). The fewest that fit often leave only
    the largest MicroPack counts or the lean schedule within memory; more recomputation then
    buys back more than its re-run forwards cost. Fitting nowhere raises the last level's error.
    `mlp`: layers whose MLP block every forward of stage s recomputes at every level."""
    best, error, tried = None, None, []
    for level in levels:
        try:
            groups, pipes, extra = plan_by_simulation(request, models, opts, level if any(level) else None, mlp)
        except UserError as exc:
            error = exc
            tried.append({"recompute_layers": level, "fits": False})
            continue
        tried.append({"recompute_layers": level, "fits": True, STEP_TIME_S: extra[PREDICTED_STEP_TIME_S]})
        if best is None or extra[PREDICTED_STEP_TIME_S] < best[2][PREDICTED_STEP_TIME_S]:
            best = (groups, pipes, extra, level)
        if not any(level):
            break
    if best is None:
        if len(levels) > 1:
            raise UserError(f"{error} (also recomputing every layer)") from None
        raise error
    if len(tried) > 1:
        best[2]["recompute_levels"] = tried
    return best


def check_batch_bound(sequences: int) -> None:
    """Refuse a batch too large to plan (MAX_SEQUENCES), as one line, before any work."""
    if sequences > MAX_SEQUENCES:
        raise UserError(f"slimpack plans at most {MAX_SEQUENCES:,} sequences a batch, not {sequences:,}: its "
                        "simulated sweep holds every candidate's segments (about 7 KB a sequence): lower "
                        "--batch-size or split the batch")


def plan_slimpack(request: PlanRequest) -> StepPlan:
    """SlimPack for one global batch (slimpack §4-§5); options: `SlimPackOptions` (planners/options.py)."""
    started = time.perf_counter()
    check_batch_bound(len(request.lengths))
    opts = read_options(request)
    check_lengths(request)
    s = request.scheme
    request.cost.check_states_fit(tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, zero=s.zero)
    models = flops_models(request)
    levels = recompute_levels(request, opts.recompute)
    layers = split_layers(request.model.num_layers, s.pp)
    mlp = layers if opts.recompute == "mlp" else None
    extra: dict = {}
    if opts.num_micropacks is not None:
        variants, flops = phase1_variants(request, models, opts.dp_merge)
        groups, lean = variants[0], opts.schedule == "lean"
        level = levels[0] if opts.recompute == "auto" else levels[-1]
        pipes = recompute_forwards([fitting_pipeline(request, p, g, opts.num_micropacks, models, flops,
                                                 opts.asymmetric, lean, pipelines=len(groups))
                                for p, g in enumerate(groups)], level, mlp)
    else:
        groups, pipes, extra, level = plan_recomputing(request, models, opts, levels, mlp)
    plan = finish_plan(request, pipes, planner="slimpack", started=started,
                       options={**options_dict(opts), "recompute": recompute_name(level, layers, mlp)})
    plan.metrics.update(micropack_metrics(request, pipes, models))
    plan.metrics["dp_merge"] = merge_metrics(groups)
    plan.metrics.update(extra)
    plan.metrics["recompute_layers"] = list(level)
    plan.metrics["recompute_mlp_layers"] = list(mlp or [0] * len(layers))
    plan.metrics[PLANNING_MS] = (time.perf_counter() - started) * 1e3
    return plan


