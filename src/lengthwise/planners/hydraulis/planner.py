"""Hydraulis: dynamic heterogeneous strategies and two-stage sequence assignment (hydraulis.txt
§5-§7, appendices B-E).

    lengthwise plan --planner hydraulis --model llama2-7b --cluster a800 --dp 8 --tp 8 \\
        --profile commoncrawl --overlong drop --batch-size 150 --context-length 32768
    lengthwise plan --planner hydraulis --model llama-32b --cluster a800 --dp 16 --tp 4 \\
        --profile github --overlong drop --batch-size 80 --context-length 32768 --option profile=github

The request's scheme only fixes how many GPUs there are (dp x tp x pp x cp); Hydraulis picks
each pipeline's own degrees.

Per global batch (§4's steps 1-4):
0. the parallel scheme space with MaxLen(P), T(l, P), UtilLen(P) (hydraulis/cost.py, app. B-C);
1. candidate strategies S = sum_k d_k P_k by §7's dynamic programme with continuous relaxation
   (hydraulis/strategy.py), cached per histogram, rounded to whole pipelines;
2. per candidate, dispatch sequences to pipelines by Algorithm 1 (hydraulis/dispatch.py, eq. 2-3);
3. per pipeline, pack micro-batches by eq. 1 over appendix C's V range (hydraulis/packing.py);
4. keep the candidate with the least estimated step time, then re-solve eq. 1 as a MILP for its
   slowest pipelines, slowest first, while MILP solves are left.
Steps 2-3 run twice: the candidates with Algorithm 1's longest-first trial alone (a screen:
the lower half by bound first, then only those whose bound is at most the best estimate so far,
so a candidate that could never win is not dispatched; its screen_s is None), then all T trials
for the candidates whose lower bound (GPU-seconds, or the longest sequence alone, plus exchange)
is below the best screened estimate. Every candidate takes the same random orders (drawn from the
request's seed) and a trial count cut by the work budget split over all feasible candidates, so
a candidate's estimate does not depend on which others pass the screen (with or without the
`previous` option, the previous strategy is estimated alike). Eq. 1 by MILP (HiGHS) is kept for
step 4, the greedy for ranking: solving it for every candidate's every pipeline would cost
seconds per batch (the paper spends about 1 s per batch on it with 10 processes, Table 2).

Pipelines of one plan have different (tp, pp, cp), each running plain 1F1B over its whole-sequence
micro-batches. The plan's ZeRO stage is 1: optimizer states are sharded (§5.2), by the executor
over each element's holders. The simulator charges a homogeneous plan a gradient all-reduce over
its pipelines x cp ranks (inter-node per stage as the plan's GPUs fall), and a heterogeneous plan
the executor's exchange, whose owners are among the holders: one all-to-all push of each stage's
bf16 gradients to the owners and one pull of the bf16 weights back, the volume of a ring
all-reduce among each element's holders (hydraulis/cost.py link_time, CostModel.exchange_time;
§5.2's push, LNK and pull in one move). The estimate charges exactly that (cost.plan_exchange, on
the pipelines in the plan's order): step time estimate = slowest pipeline (eq. 1) + slowest
exchange (+ a strategy switch, below). The exchange is outside the DP's latency, so the DP runs
once per cap on it (schemes whose exchange exceeds the cap left out), and every cap's strategies
are candidates.

A strategy switch between batches moves optimizer state: the owners are among the holders, so
they change with the strategy, and the executor (runtime/parallel/hetero.py) moves the fp32
masters and Adam moments to the new owners in one all-to-all and pulls the new layout's weights
(logged with its measured seconds and bytes). With the `previous` option (the training loop
passes the strategy the last batch ran), a candidate whose pipelines differ from it is charged
that move and pull (cost.switch_time, counting every element as moved, an upper bound, or
none when every GPU holds the same pieces in both) on top of its estimate, so the planner
switches only when the new strategy saves more than the switch costs. The process groups of a
scheme not run before are created once and reused.

Complexity (n sequences, D pipelines of the widest screened candidate, S candidates): the
dispatch is O(n D S) work in one numpy step per distinct length (the longest-first trial) or
per sequence (random trials; Algorithm 1 weighs every pipeline for every sequence, the paper's
algorithm allows no less); the slowest pipeline's packing is found from one vectorised LPT bound
per pipeline (O(n D V) work in at most n numpy steps, V the micro-batch count) and the full
greedy packing, O(n log n) per pipeline (BFD, LPT over at most 16 micro-batch counts,
Karmarkar-Karp), only for the pipelines whose bound exceeds the slowest packed so far, then for
every pipeline of the chosen candidate; the proposal DP per histogram is cached. At 1024 GPUs x
32,768 sequences this is about 0.9 s on one core of our machine (the paper reports 3.9 s at 1024
GPUs with several processes); Karmarkar-Karp on pipelines of a thousand sequences and more
(small clusters) is what is left to cut.

Options: `HydraulisOptions` in planners/options.py (each with its default and meaning).
"""

from __future__ import annotations

import time

import numpy as np

from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk, PipelinePlan, StepPlan
from lengthwise.plan.schedules import make_schedule
from lengthwise.planners.base import PlanRequest, finish_plan, take_options, whole
from lengthwise.planners.options import HydraulisOptions, options_dict
from lengthwise.planners.hydraulis.cost import (
    Scheme,
    link_time,
    make_scheme,
    parse_pipelines,
    scheme_holders,
    scheme_space,
    sync_time,
)
from lengthwise.planners.hydraulis.dispatch import lower_bound, trials_for
from lengthwise.planners.hydraulis.evaluate import Evaluation, complete, evaluate_all, exchange, switch
from lengthwise.planners.hydraulis.packing import milp_pack
from lengthwise.planners.hydraulis.strategy import (
    Histogram,
    Strategy,
    homogeneous,
    length_edges,
    propose,
    round_proposal,
)
from lengthwise.workloads import get_profile

CAP_RATIO = 1.25
"""Exchange times closer than this factor share one proposal run (see _caps)."""
MAX_LEN_TAIL = 0.01
"""Profile mode proposes for every L above the length that a batch's longest sequence stays
under with this probability."""
PROFILE_SAMPLE = 65536
"""Sequences drawn (seed 0) to stand for a dataset profile in the proposal."""


def plan_hydraulis(request: PlanRequest) -> StepPlan:
    """Plan one global batch with Hydraulis (see the module docstring)."""
    started = time.perf_counter()
    opts = take_options(request, "hydraulis")
    num_gpus = request.cluster.num_gpus
    space = _space(request, opts, num_gpus)
    _check_lengths(request, space, num_gpus, opts)
    fallback = None
    if opts.pipelines is not None:
        candidates = [_fixed_strategy(request, opts, num_gpus)]
    else:
        candidates, fallback = _candidates(request, opts, space, num_gpus)
    best, table = _choose(request, opts, candidates, num_gpus)
    complete(best)
    milp_count = _refine(best, opts)
    pipelines = _pipelines(request, best, num_gpus)
    plan = finish_plan(request, pipelines, planner="hydraulis", started=started,
                       options=options_dict(opts))
    plan.zero = 1
    plan.metrics.update(_metrics(best, table, milp_count))
    plan.metrics["fallback"] = fallback
    return plan


def _fixed_strategy(request: PlanRequest, opts: HydraulisOptions, num_gpus: int) -> Strategy:
    """The strategy the `pipelines` option names (tp2-pp1,tp1-pp2: one scheme per pipeline)."""
    degrees = parse_pipelines(opts.pipelines)
    total = sum(tp * pp * cp for tp, pp, cp in degrees)
    if total != num_gpus:
        raise UserError(f"pipelines {opts.pipelines} use {total} GPUs, the cluster has {num_gpus}")
    counts: dict[Scheme, int] = {}
    for tp, pp, cp in degrees:
        scheme = make_scheme(request.cost, tp=tp, pp=pp, cp=cp, num_gpus=num_gpus,
                             threshold=opts.util_threshold)
        if scheme is None:
            raise UserError(f"pipeline scheme tp{tp}-pp{pp}-cp{cp}: the model states alone overflow a GPU")
        counts[scheme] = counts.get(scheme, 0) + 1
    return Strategy.of(counts)


def _space(request: PlanRequest, opts: HydraulisOptions, num_gpus: int) -> list[Scheme]:
    max_tp = opts.max_tp or request.cluster.gpus_per_node
    space = scheme_space(request.cost, num_gpus=num_gpus, context_length=request.context_length, max_tp=max_tp,
                         max_pp=opts.max_pp, max_cp=opts.max_cp, threshold=opts.util_threshold)
    if not space:
        raise UserError(f"{request.model.name}'s model states fit no scheme with tp <= {max_tp}, pp <= "
                        f"{opts.max_pp} on {num_gpus} GPUs: add GPUs or raise max_tp/max_pp")
    return space


def _check_lengths(request: PlanRequest, space: list[Scheme], num_gpus: int, opts: HydraulisOptions) -> None:
    """Every sequence non-empty, within the context, and held by some scheme (MaxLen, B.1)."""
    if not request.lengths:
        raise UserError("the global batch is empty: give at least one sequence")
    widest = max(space, key=lambda s: s.max_len)
    for seq_id, n in enumerate(request.lengths):
        if n < 1:
            raise UserError(f"sequence {seq_id} has length {n}: lengths must be at least 1 token")
        if n > request.context_length:
            raise UserError(f"sequence {seq_id} has {n} tokens > context length {request.context_length}: "
                            f"raise --context-length or use --overlong truncate|drop")
        if n > widest.max_len:
            raise UserError(
                f"sequence {seq_id} has {n} tokens > {widest.max_len}, the MaxLen of the widest scheme "
                f"{widest} on {num_gpus} GPUs (schemes searched up to tp {max(s.tp for s in space)}, pp "
                f"{max(s.pp for s in space)}, cp {max(s.cp for s in space)}; option max_cp {opts.max_cp}, "
                f"max_pp {opts.max_pp}): raise max_cp or max_pp, add GPUs, or use a splitting planner")


def _histogram(request: PlanRequest, opts: HydraulisOptions,
               space: list[Scheme]) -> tuple[Histogram, tuple[int, ...], float]:
    """What to propose for: the dataset profile (all L up to the context) or this batch."""
    tokens = float(sum(request.lengths))
    if opts.profile is None:
        return Histogram.of(request.lengths), (max(request.lengths),), tokens
    sample = get_profile(opts.profile).sample(PROFILE_SAMPLE, np.random.default_rng(0),
                                                 below=request.context_length + 1)
    hist = Histogram.of(sample)
    tokens = float(f"{tokens:.2g}")  # batches of about this size share one cached proposal
    # L ranges over the longest lengths a batch reaches with probability >= 1%: P(max < L) =
    # F(L)^B for B sequences per batch.
    per_batch = max(1.0, tokens / float(np.mean(sample)))
    shortest = float(np.quantile(sample, MAX_LEN_TAIL ** (1 / per_batch)))
    edges = length_edges(max(hist.lengths), opts.length_step, [s.max_len for s in space])
    return hist, tuple(int(e) for e in edges[1:] if e >= shortest) or (int(edges[-1]),), tokens


def _candidates(request: PlanRequest, opts: HydraulisOptions, space: list[Scheme],
                num_gpus: int) -> tuple[list[Strategy], str | None]:
    """§7's proposal once per exchange cap, rounded; plus a homogeneous fallback if none holds
    the batch's longest sequence, with a one-line reason (plan.metrics["fallback"])."""
    hist, targets, tokens = _histogram(request, opts, space)
    # Caps only group schemes for the proposal runs (a candidate's estimate charges its exact
    # exchange, `evaluate.exchange`); each scheme's level is its reduction over as many ranks as it
    # would have pipelines, the grouping these caps were tuned with.
    costs = {s: sync_time(request.cost, s, num_pipelines=num_gpus // s.num_gpus, num_gpus=num_gpus,
                          ranks=num_gpus // s.num_gpus)
             + link_time(request.cost, s, num_gpus=num_gpus,
                         holders=scheme_holders(request.cost, [s] * max(1, num_gpus // s.num_gpus)))
             for s in space}
    caps = _caps(sorted(set(costs.values())))
    masks = tuple(tuple(costs[s] <= cap for s in space) for cap in caps)
    out: dict[Strategy, None] = {}
    for prop in propose(tuple(space), hist, num_gpus, targets, tokens, opts.length_step,
                        opts.pipeline_step, masks):
        subset = tuple(s for s in space if costs[s] <= max(costs[p] for p, _ in prop.pipelines))
        out.update(dict.fromkeys(round_proposal(prop, subset, num_gpus)))
    longest = max(request.lengths)
    if any(s.max_len >= longest for c in out for s, _ in c.parts):
        return list(out), None
    scheme = min((s for s in space if s.max_len >= longest), key=lambda s: s.num_gpus)
    out[homogeneous(scheme, num_gpus)] = None
    return list(out), (f"no proposed strategy holds the longest sequence ({longest} tokens; {len(out) - 1} "
                       f"rounded candidates): added {num_gpus // scheme.num_gpus}x{scheme}")


def _caps(levels: list[float]) -> list[float]:
    """Exchange caps: the distinct exchange times, those within CAP_RATIO of a smaller cap
    merged into it (schemes with tp * pp alike differ only by their embedding share)."""
    caps: list[float] = []
    start = 0.0
    for x in levels:
        if caps and x <= start * CAP_RATIO:
            caps[-1] = x
        else:
            caps.append(x)
            start = x
    return caps


def _part_limits(request: PlanRequest, strategy: Strategy) -> list[int]:
    """Micro-batch limit of each part's pipelines: MaxLen with states sharded over all GPUs
    (B.1), capped by the ZeRO-1 view over this strategy's pipelines that validation and
    simulation take."""
    d = strategy.num_pipelines
    return [min(s.max_len, request.cost.max_seq_len(tp=s.tp, pp=s.pp, cp=s.cp, dp=d, zero=1))
            for s, _ in strategy.parts]


def _strategy_pipelines(strategy: Strategy, limits: list[int]) -> list[tuple[Scheme, int]]:
    """(scheme, limit) per pipeline, limit descending (§6.2's P_1 .. P_D)."""
    parts = sorted(zip(strategy.parts, limits), key=lambda x: -x[1])
    return [(s, m) for (s, n), m in parts for _ in range(n)]


def _choose(request: PlanRequest, opts: HydraulisOptions, candidates: list[Strategy], num_gpus: int):
    """Screen every candidate with one longest-first dispatch trial, run all trials on those
    whose lower bound beats the best screened plan, keep the least estimated step time.
    Returns it and one metrics row per candidate (estimate_s None when pruned or infeasible)."""
    lengths = np.asarray(request.lengths, dtype=np.int64)
    prepared = sorted((_prepare(request, c, num_gpus, lengths, opts.previous) for c in candidates), key=lambda p: p[0])
    feasible = [p for p in prepared if p[2] is not None]
    if not feasible:
        raise UserError(_none_holds(request, prepared, fixed=opts.pipelines is not None))
    screened = _screen(request, opts, feasible, lengths, num_gpus)
    cut = min(ev.estimate_s for ev in screened if ev is not None)
    rest = [i for i, p in enumerate(feasible) if p[0] < cut]
    # The budget is split over every feasible candidate, not over those that pass the screen: a
    # candidate's trials, and so its estimate, do not depend on which others are evaluated.
    share = len(feasible)
    if rest and max(trials_for(len(lengths), len(feasible[i][2]), opts.trials, opts.dispatch_work, share)
                    for i in rest) > 1:
        full = evaluate_all(request, opts, [feasible[i] for i in rest], lengths, num_gpus, trials=opts.trials,
                             share=share, screened=[screened[i] for i in rest])
    else:  # one trial is the longest-first order the screen already ran: the same dispatch
        full = [screened[i] for i in rest]
    final = dict(zip(rest, (min(screened[i], ev, key=lambda e: e.estimate_s) for i, ev in zip(rest, full))))
    rows = [_row(b, c, None, None) for b, c, pipes in prepared if pipes is None]
    rows += [_row(p[0], p[1], None if screened[i] is None else screened[i].estimate_s,
                  final[i].estimate_s if i in final else None) for i, p in enumerate(feasible)]
    best = min([*final.values(), *(ev for ev in screened if ev is not None)], key=lambda e: e.estimate_s)
    return best, rows


def _none_holds(request: PlanRequest, prepared: list, *, fixed: bool) -> str:
    """One line: no candidate strategy holds the batch's longest sequence, and what to change."""
    longest = max(request.lengths)
    limits = [max(_part_limits(request, strategy), default=0) for _, strategy, _ in prepared]
    widest = max(range(len(prepared)), key=lambda i: limits[i])
    return (f"sequence {request.lengths.index(longest)} has {longest} tokens > {limits[widest]}, the longest "
            f"micro-batch of any candidate strategy (widest: {prepared[widest][1]}, optimizer states sharded over "
            f"its pipelines): " + ("give pipelines with larger tp, pp or cp" if fixed else
                                   "raise max_cp or max_pp, add GPUs, or use a splitting planner"))


def _screen(request: PlanRequest, opts: HydraulisOptions, feasible: list, lengths: np.ndarray, num_gpus: int) -> list:
    """One longest-first trial for each candidate (bound ascending), in two passes: the lower
    half by bound first, then only those whose bound is at most the best estimate so far. A
    candidate left out (None) has estimate >= bound > that best, so it could never be chosen
    nor pass to the full trials: the choice is the same as screening all, at a fraction of the
    cost when the widest candidates have the weakest bounds."""
    out: list[Evaluation | None] = [None] * len(feasible)
    first = list(range(max(1, (len(feasible) + 1) // 2)))
    for i, ev in zip(first, evaluate_all(request, opts, [feasible[i] for i in first], lengths, num_gpus, trials=1)):
        out[i] = ev
    cut = min(ev.estimate_s for ev in out if ev is not None)
    second = [i for i in range(len(first), len(feasible)) if feasible[i][0] <= cut]
    if second:
        evs = evaluate_all(request, opts, [feasible[i] for i in second], lengths, num_gpus, trials=1)
        for i, ev in zip(second, evs):
            out[i] = ev
    return out


def _row(bound: float, strategy: Strategy, screen: float | None, estimate: float | None) -> dict:
    """One candidate in plan.metrics["candidates"], seconds rounded to microseconds."""
    r = lambda x: None if x is None or not np.isfinite(x) else round(float(x), 6)
    return {"strategy": str(strategy), "gpus": strategy.num_gpus, "lower_bound_s": r(bound),
            "screen_s": r(screen), "estimate_s": r(estimate)}


def _usable(request: PlanRequest, strategy: Strategy) -> tuple[Strategy, list[int]]:
    """The strategy without parts whose model states overflow under its pipeline count (their
    GPUs stay idle; fewer pipelines shard the optimizer less, so check again), and the limits."""
    while True:
        limits = _part_limits(request, strategy)
        if min(limits, default=1) >= 1:
            return strategy, limits
        strategy = Strategy(tuple(p for p, m in zip(strategy.parts, limits) if m >= 1))


def _prepare(request: PlanRequest, strategy: Strategy, num_gpus: int, lengths: np.ndarray,
             previous: str | None):
    """(lower bound, strategy, pipelines with limits or None when it cannot hold the batch)."""
    strategy, limits = _usable(request, strategy)
    if max(limits, default=0) < lengths.max():
        return np.inf, strategy, None
    schemes = [s for s, _ in strategy.parts]
    pipes = _strategy_pipelines(strategy, limits)
    bound = lower_bound(lengths, schemes, [n for _, n in strategy.parts], limits)
    return bound + exchange(request, pipes, num_gpus) + switch(request, previous, pipes, num_gpus), strategy, pipes


def _refine(ev: Evaluation, opts: HydraulisOptions) -> int:
    """Eq. 1 by MILP for the slowest pipeline, then the next slowest, while solves are left;
    stops once the slowest pipeline has had its turn. Returns how many pipelines improved."""
    left, tried, improved = opts.milp_solves, set(), 0
    while left > 0:
        j = max(range(len(ev.packings)), key=lambda j: (ev.packings[j].estimate_s, -j))
        if j in tried:
            break
        tried.add(j)
        new, used = milp_pack(ev.loads[j], ev.packings[j], solves=left, time_limit_s=opts.milp_time_limit_s,
                              node_limit=opts.milp_node_limit)
        left -= used
        improved += new is not ev.packings[j]
        ev.packings[j] = new
    return improved


def _pipelines(request: PlanRequest, ev: Evaluation, num_gpus: int) -> list[PipelinePlan]:
    """One 1F1B PipelinePlan per pipeline of the chosen strategy (the simulator charges the
    exchange from the plan's shape: sim/inputs.py)."""
    out = []
    for scheme, load, packing in zip(ev.pipelines, ev.loads, ev.packings):
        chunks = [Chunk(whole([load.seq_ids[i] for i in b], request.lengths)) for b in packing.bins]
        out.append(PipelinePlan(chunks=chunks, stages=make_schedule("1f1b", chunks, scheme.pp), tp=scheme.tp,
                                cp=scheme.cp, schedule="1f1b"))
    return out


def _metrics(ev: Evaluation, table: list[dict], milp_count: int) -> dict:
    methods = [p.method for p in ev.packings if p.bins]
    return {
        "strategy": str(ev.strategy),
        "candidates": table,
        "pipeline_schemes": [str(s) for s in ev.pipelines],
        "pipeline_max_len": ev.max_lens,
        "estimated_step_s": ev.estimate_s,
        "estimated_pipeline_s": [p.estimate_s for p in ev.packings],
        "exchange_s": ev.exchange_s,
        "switch_s": ev.switch_s,
        "dispatch_trials": ev.trials,
        "packing_methods": {m: methods.count(m) for m in sorted(set(methods))},
        "milp_improved_pipelines": milp_count,
    }
