"""`auto`: plan the batch with every applicable planner, simulate each plan, keep the fastest that
fits memory (ties broken toward less memory). None of the five papers does this step; each
wins on some workloads and loses on others, and the simulator is cheap enough to ask.

Options: `AutoOptions` in planners/options.py (candidates, schemes, candidate_options, and the
preselection's preselect_above, preselect, preselect_margin, proxy_factor, proxy_sequences,
min_proxy_pipelines).

At scale the full search costs the sum of every candidate's planning and simulation (9.2 CPU
seconds at 1024 GPUs x 32,768 sequences, 11.6 at 4096: benchmarks/results/planning_scale.json),
so a batch of more than `preselect_above` sequences is preselected instead:

1. A proxy of the batch: the sequences sorted by length (longest first, ties by index), every
   k-th of them kept (so the longest one always is, and each length stratum keeps 1/k of its
   sequences), planned on dp/k pipelines of the same tp, pp, cp and ZeRO stage, the cluster and
   cost model resized to match. Each pipeline sees about as many sequences of the same length
   mix as at full size, which is what the planners' choices depend on. (ZeRO shards model
   states over fewer replicas there, so the proxy's memory is slightly tighter, never looser.)
2. Every candidate plans and simulates the proxy; they are ranked fitting plans first by step
   time (then peak memory), then plans that do not fit, then failures.
3. Only the best `preselect` plan the full batch, with any other whose proxy step time is
   within `preselect_margin` of the proxy's best (a close call); while none of them gives a
   valid plan that fits, the next in the proxy's order does, so preselection fails only where
   the full search would. The choice among the full-size plans is the full search's rule.

k defaults to the largest divisor of dp (of every candidate's dp when schemes differ, so each
shrinks exactly) that keeps at least `proxy_sequences` sequences and `min_proxy_pipelines`
pipelines; where none exceeds 1 the full search runs. Every step is deterministic, so every
rank computes the same plan. benchmarks/bench_auto_preselect.py measures the quality this
costs (the full search's pick against the preselected one's simulated step time).

Planning time is the sum of what it runs (planners, validation and simulation), recorded in
`metrics[PLANNING_MS]`; `metrics["auto"]` holds each candidate's simulated step time or the
reason it was skipped; when preselected, each candidate's entry also has `proxy` (its proxy
figures, rank and time) and `full_size` (whether it planned the full batch), and
`metrics["auto_proxy"]` the proxy's k, sequences, scheme and candidate order.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from lengthwise.errors import UserError
from lengthwise.metrics import GIB, PEAK_MEMORY_GIB, PLANNING_MS
from lengthwise.plan.ir import StepPlan
from lengthwise.plan.validate import validate_plan
from lengthwise.planners.base import PlanRequest, take_options
from lengthwise.planners.options import AutoOptions
from lengthwise.planners.registry import CANDIDATE_PLANNERS
from lengthwise.sim import SimResult, simulate_plan
from lengthwise.specs import ParallelScheme


@dataclass(kw_only=True)
class Candidate:
    """One planner's attempt at the batch."""

    planner: str
    plan: StepPlan | None = None
    result: SimResult | None = None
    error: str | None = None
    elapsed_ms: float = 0.0
    """Planning + validation + simulation time of this attempt."""
    scheme: ParallelScheme | None = None
    """The scheme the attempt planned for."""

    @property
    def usable(self) -> bool:
        return self.result is not None and bool(self.result.fits)

    def summary(self):
        if self.result is None:
            return {"error": self.error}
        return {"step_time_s": self.result.step_time_s, "fits": bool(self.result.fits),
                PEAK_MEMORY_GIB: max_peak(self.result) / GIB}


def max_peak(result: SimResult) -> float:
    return max((p for row in result.peak_memory for p in row), default=0.0)


def try_planner(name: str, request: PlanRequest, *, validate: bool = True) -> Candidate:
    """Plan, validate and simulate with one planner; a UserError becomes a skipped candidate.
    `validate=False` leaves validation to the caller (auto's `choose_valid` validates only the
    plans in the running for its choice)."""
    started = time.perf_counter()
    try:
        plan = candidate_planner(name)(request)
        if validate:
            validate_plan(plan, request.cost)
        result = simulate_plan(plan, request.cost)
        cand = Candidate(planner=name, plan=plan, result=result, scheme=request.scheme)
    except UserError as exc:
        cand = Candidate(planner=name, error=str(exc), scheme=request.scheme)
    cand.elapsed_ms = (time.perf_counter() - started) * 1e3
    return cand


def choose_best(candidates: list[Candidate]) -> Candidate | None:
    """Fastest simulated step among plans that fit; ties toward less peak memory."""
    usable = [c for c in candidates if c.usable]
    if not usable:
        return None
    return min(usable, key=lambda c: (c.result.step_time_s, max_peak(c.result)))


def choose_valid(candidates: list[Candidate], request: PlanRequest) -> Candidate | None:
    """choose_best among the plans that pass validate_plan. Plans are validated best first and
    the first valid one wins, so the choice is the one validating every candidate would make,
    at the cost of one validation when the best plan is valid (the usual case)."""
    while (best := choose_best(candidates)) is not None:
        started = time.perf_counter()
        try:
            validate_plan(best.plan, request.cost)
            return best
        except UserError as exc:
            best.plan, best.result, best.error = None, None, f"invalid plan: {exc}"
        finally:
            best.elapsed_ms += (time.perf_counter() - started) * 1e3
    return None


def candidate_planner(name: str):
    """The planner auto may run under `name` (every planner but auto itself)."""
    if name not in CANDIDATE_PLANNERS:
        raise UserError(f"auto cannot run planner {name!r}: candidates are {', '.join(CANDIDATE_PLANNERS)}")
    return CANDIDATE_PLANNERS[name]


def default_candidates() -> list[str]:
    return list(CANDIDATE_PLANNERS)


def candidate_request(request: PlanRequest, name: str, opts: AutoOptions) -> PlanRequest:
    scheme = opts.schemes.get(name)
    if isinstance(scheme, dict):
        scheme = ParallelScheme.from_dict({"zero": request.scheme.zero, **scheme})
    return dataclasses.replace(request, scheme=scheme or request.scheme,
                               options=dict(opts.candidate_options.get(name, {})))


MAX_SEQUENCES = 1 << 20
"""Most sequences one batch may have (the bound of slimpack and infinipipe, its costliest
candidates; auto also plans the whole batch at full size with its proxy's pick). Larger batches
are refused before any candidate runs."""


def plan_auto(request: PlanRequest) -> StepPlan:
    started = time.perf_counter()
    if len(request.lengths) > MAX_SEQUENCES:
        raise UserError(f"auto plans at most {MAX_SEQUENCES:,} sequences a batch, not {len(request.lengths):,}: "
                        "its candidates plan and simulate the whole batch: lower --batch-size or split the batch")
    opts = take_options(request, "auto")
    names = opts.candidates or default_candidates()
    if "auto" in names:
        raise UserError("auto cannot be its own candidate: remove 'auto' from candidates")
    k = proxy_factor(request, opts, names)
    if k > 1:
        best, tried, proxy = preselected_search(request, opts, names, k)
    else:
        tried = [try_planner(n, candidate_request(request, n, opts), validate=False) for n in names]
        best, proxy = choose_valid(tried, request), None
    if best is None:
        reasons = "; ".join(f"{c.planner}: {c.error or 'does not fit memory'}" for c in tried)
        raise UserError(f"no planner produced a plan that fits: {reasons}")
    plan = best.plan
    plan.metrics = {**plan.metrics, "chosen_planner": best.planner,
                    "auto": {c.planner: c.summary() for c in tried},
                    PLANNING_MS: (time.perf_counter() - started) * 1e3}
    if proxy is not None:
        ran = {c.planner for c in tried}
        plan.metrics["auto"] = {n: {**plan.metrics["auto"].get(n, {}), "full_size": n in ran,
                                    "proxy": proxy.figures[n]} for n in proxy.order}
        plan.metrics["auto_proxy"] = proxy.describe()
    plan.options = {"chosen_planner": best.planner, "candidates": names, **plan.options}
    plan.planner = "auto"
    return plan


# ---- preselection on a proxy of the batch (large batches) ----

@dataclass(kw_only=True)
class Proxy:
    """The proxy's ranking of the candidates and what it was planned on."""

    k: int
    sequences: int
    scheme: ParallelScheme
    order: list[str]
    """Every candidate, best first: fitting plans by simulated step time (then peak memory), then
    plans that do not fit, then failures, each group in candidate order where tied."""
    figures: dict[str, dict]
    """Per candidate: its proxy summary (step time, fits, peak) or error, its rank, its time."""

    def close_calls(self, margin: float) -> list[str]:
        """The fitting candidates whose proxy step time is within `margin` of the fastest's."""
        fitting = [n for n in self.order if self.figures[n].get("fits")]
        if not fitting:
            return []
        bound = self.figures[fitting[0]]["step_time_s"] * (1.0 + margin)
        return [n for n in fitting if self.figures[n]["step_time_s"] <= bound]

    def describe(self) -> dict:
        return {"k": self.k, "sequences": self.sequences, "scheme": str(self.scheme), "order": self.order}


def proxy_factor(request: PlanRequest, opts: AutoOptions, names: list[str]) -> int:
    """The proxy's k, 1 when the batch is planned by every candidate at full size: at or below
    `preselect_above` sequences, or when no k > 1 meets the default's floors."""
    if len(request.lengths) <= opts.preselect_above:
        return 1
    if opts.proxy_factor is not None:
        return opts.proxy_factor
    dps = [request.scheme.dp, *(candidate_request(request, n, opts).scheme.dp for n in names)]
    common = math.gcd(*dps)
    fits = [d for d in range(2, common + 1)
            if common % d == 0 and len(request.lengths) // d >= opts.proxy_sequences
            and request.scheme.dp // d >= opts.min_proxy_pipelines]
    return max(fits, default=1)


def proxy_lengths(lengths: list[int], k: int) -> list[int]:
    """Every k-th sequence by length, longest first (so the longest is always in), in batch order:
    a sample of each length stratum, 1/k of the batch."""
    by_length = np.lexsort((np.arange(len(lengths)), -np.asarray(lengths, dtype=np.int64)))
    return [lengths[i] for i in np.sort(by_length[::k]).tolist()]


def shrink(scheme: ParallelScheme, k: int) -> ParallelScheme:
    """The scheme with dp / k pipelines (rounded, at least 1), the same tp, pp, cp and ZeRO."""
    return dataclasses.replace(scheme, dp=max(1, round(scheme.dp / k)))


def proxy_request(request: PlanRequest, k: int) -> PlanRequest:
    """The batch's proxy: every k-th sequence by length on a cluster of dp / k pipelines, the cost
    model the same but for its cluster's GPU count."""
    scheme = shrink(request.scheme, k)
    cluster = request.cluster.with_gpus(scheme.num_gpus)
    return dataclasses.replace(request, lengths=proxy_lengths(request.lengths, k), scheme=scheme,
                               cluster=cluster, cost=dataclasses.replace(request.cost, cluster=cluster))


def rank_on_proxy(request: PlanRequest, opts: AutoOptions, names: list[str], k: int) -> Proxy:
    """Every candidate on the proxy, simulated (not validated: the ranking needs only times)."""
    small = proxy_request(request, k)
    tried = []
    for n in names:
        full = candidate_request(request, n, opts)
        req = dataclasses.replace(full, lengths=small.lengths, cluster=small.cluster, cost=small.cost,
                                  scheme=shrink(full.scheme, k))
        tried.append(try_planner(n, req, validate=False))

    def key(i: int):
        c = tried[i]
        if c.result is None:
            return (2, 0.0, 0.0, i)
        return (0 if c.usable else 1, c.result.step_time_s, max_peak(c.result), i)

    ranked = sorted(range(len(tried)), key=key)
    figures = {tried[i].planner: {**tried[i].summary(), "rank": r, "elapsed_ms": tried[i].elapsed_ms}
               for r, i in enumerate(ranked)}
    return Proxy(k=k, sequences=len(small.lengths), scheme=small.scheme,
                 order=[tried[i].planner for i in ranked], figures=figures)


def preselected_search(request: PlanRequest, opts: AutoOptions, names: list[str], k: int):
    """Rank the candidates on the proxy, plan the full batch with the best `preselect`, then with
    the next ones in the proxy's order, one at a time, while none gives a valid plan that fits.
    Returns (best or None, the full-size candidates, the proxy)."""
    proxy = rank_on_proxy(request, opts, names, k)
    first = max(opts.preselect, len(proxy.close_calls(opts.preselect_margin)))
    tried: list[Candidate] = []
    best = None
    for i, n in enumerate(proxy.order):
        tried.append(try_planner(n, candidate_request(request, n, opts), validate=False))
        if i + 1 >= first and (best := choose_valid(tried, request)) is not None:
            break
    return best, tried, proxy
