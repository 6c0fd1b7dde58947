"""`compare`: every planner on the same sampled global batches, model and cluster, simulated.

A fair search: every planner receives the same complete list of feasible (tp, pp, cp) schemes
(model states fit at the setup's ZeRO stage; recomputation is each planner's own choice inside
a scheme). Planners that keep sequences whole refuse the schemes that cannot hold their longest
sequence. Each planner's scheme is the fastest that fits over the selection batches — the first
batch and the batch holding the longest sequence — and is kept for all batches; `scheme` in
the setup fixes one scheme for every planner instead. Hydraulis picks its own heterogeneous
strategy inside the GPUs it is given. ChunkFlow runs its own (ChunkSize, K) grid search (§5).

Speedups are reported against the best fitting baseline and against `megatron`, the baseline
most of the papers measured against (ChunkFlow, InfiniPipe, SlimPack, Hydraulis).

`auto` is computed from the other planners' plans of the same batch: the fastest that fits, so it
is never slower than any planner it ran, by construction. Its planning time is the sum of the
planning, validation and simulation time of everything it ran.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections import Counter
from dataclasses import dataclass, field

from lengthwise.cost import CostModel, Profile
from lengthwise.planners import available_planners
from lengthwise.planners.auto import Candidate, choose_best, max_peak, try_planner
from lengthwise.planners.base import PlanRequest
from lengthwise.specs import ClusterSpec, ModelSpec, ParallelScheme

BASELINES = ("padding", "packing", "sorted", "token-balanced", "megatron", "static-cp")
PAPER_BASELINE = "megatron"
PLANNER_OPTIONS = {"chunkflow": {"chunk_size": "auto"}}
"""Options every compare run passes: ChunkFlow searches its own (ChunkSize, K) (chunkflow.txt §5)."""


@dataclass(kw_only=True)
class CompareSetup:
    model: ModelSpec
    cluster: ClusterSpec
    """With num_gpus set to the GPUs compared on."""
    context_length: int
    batches: list[list[int]]
    """Sequence lengths of each sampled global batch."""
    planners: list[str]
    zero: int = 1
    seed: int = 0
    scheme: ParallelScheme | None = None
    """One fixed scheme for every planner; None searches candidate_schemes."""
    profile: Profile | None = None
    """Measured cost profile (`lengthwise profile`); None uses the analytic cost model."""


@dataclass(kw_only=True)
class PlannerRow:
    planner: str
    scheme: str = ""
    runs: list[Candidate] = field(default_factory=list)
    chosen: Counter = field(default_factory=Counter)
    """For auto: how often each planner was chosen."""

    def ok(self) -> list[Candidate]:
        return [r for r in self.runs if r.result is not None]

    def summary(self, best_baseline_s: float | None, megatron_s: float | None = None) -> dict:
        ok = self.ok()
        if not ok:
            return {"scheme": self.scheme, "error": self.runs[0].error if self.runs else "not run"}
        step = statistics.fmean(r.result.step_time_s for r in ok)
        tokens = sum(r.result.tokens for r in ok)
        imbalance = [r.result.dp_imbalance for r in ok if r.result.dp_imbalance is not None]
        d = {
            "scheme": self.scheme,
            "step_time_s": step,
            "tokens_per_s": tokens / sum(r.result.step_time_s for r in ok),
            "speedup_vs_best_baseline": best_baseline_s / step if best_baseline_s else None,
            "speedup_vs_megatron": megatron_s / step if megatron_s else None,
            "bubble_ratio": statistics.fmean(r.result.bubble_ratio for r in ok),
            "dp_imbalance": statistics.fmean(imbalance) if imbalance else None,
            "dp_spread": statistics.fmean(r.result.dp_imbalance_spread for r in ok),
            "peak_memory_gb": max(max_peak(r.result) for r in ok) / 2**30,
            "fits": all(bool(r.result.fits) for r in ok),
            "mfu": statistics.fmean(r.result.mfu or 0.0 for r in ok),
            "planning_ms_mean": statistics.fmean(r.elapsed_ms for r in self.runs),
            "planning_ms_max": max(r.elapsed_ms for r in self.runs),
            "batches": len(ok),
        }
        if self.chosen:
            d["chosen"] = dict(self.chosen)
        return d


def candidate_schemes(setup: CompareSetup) -> list[ParallelScheme]:
    """Every feasible (tp, pp, cp) whose model states fit, fewest model-parallel GPUs first.
    The same list for every planner: no planner wins because it was shown other schemes."""
    if setup.scheme is not None:
        return [setup.scheme]
    m, c, gpus = setup.model, setup.cluster, setup.cluster.num_gpus
    cost = CostModel(model=m, cluster=c, profile=setup.profile)
    found = []
    for tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
        per_pipe = tp * pp * cp
        if gpus % per_pipe or tp > c.gpus_per_node or m.num_heads % tp or m.num_layers % pp:
            continue
        scheme = ParallelScheme(dp=gpus // per_pipe, tp=tp, pp=pp, cp=cp, zero=setup.zero)
        if _states_fit(cost, scheme):
            found.append(scheme)
    found.sort(key=lambda s: (s.gpus_per_pipeline, s.cp, s.pp, s.tp))
    return found


def _states_fit(cost: CostModel, s: ParallelScheme) -> bool:
    try:
        cost.check_states_fit(tp=s.tp, pp=s.pp, dp=s.dp, zero=s.zero)
    except ValueError:
        return False
    return True


def request_for(setup: CompareSetup, lengths: list[int], scheme: ParallelScheme,
                planner: str = "") -> PlanRequest:
    return PlanRequest(lengths=list(lengths), model=setup.model, cluster=setup.cluster, scheme=scheme,
                       cost=CostModel(model=setup.model, cluster=setup.cluster, profile=setup.profile),
                       context_length=setup.context_length, seed=setup.seed,
                       options=dict(PLANNER_OPTIONS.get(planner, {})))


def selection_batches(batches: list[list[int]]) -> list[int]:
    """Indices of the batches a scheme is chosen on: the first and the one holding the longest
    sequence (a scheme chosen on short batches alone can fail on the long tail)."""
    longest = max(range(len(batches)), key=lambda b: max(batches[b], default=0))
    return sorted({0, longest})


def pick_scheme(setup: CompareSetup, planner: str,
                schemes: list[ParallelScheme]) -> tuple[ParallelScheme | None, list[Candidate]]:
    """The planner's fastest scheme (mean step over the selection batches) among those where
    every selection batch fits, and the attempts made."""
    if setup.scheme is not None:
        return setup.scheme, []
    tries, best, best_time = [], None, float("inf")
    picks = selection_batches(setup.batches)
    for scheme in schemes:
        runs = []
        for b in picks:
            runs.append(try_planner(planner, request_for(setup, setup.batches[b], scheme, planner)))
            if not runs[-1].usable:
                break
        tries.extend(runs)
        if all(r.usable for r in runs):
            mean = statistics.fmean(r.result.step_time_s for r in runs)
            if mean < best_time:
                best, best_time = scheme, mean
    return best, tries


def run_compare(setup: CompareSetup, progress=None) -> dict[str, PlannerRow]:
    rows: dict[str, PlannerRow] = {}
    names = [p for p in setup.planners if p != "auto"]
    schemes = candidate_schemes(setup)
    for name in names:
        scheme, tries = pick_scheme(setup, name, schemes)
        row = rows[name] = PlannerRow(planner=name, scheme=str(scheme) if scheme else "none fits")
        if scheme is None:
            row.runs = tries[:1] or [Candidate(planner=name, error="no feasible parallel scheme")]
            _tick(progress, len(setup.batches))
            continue
        for lengths in setup.batches:
            row.runs.append(try_planner(name, request_for(setup, lengths, scheme, name)))
            _tick(progress, 1)
    if "auto" in setup.planners:
        rows["auto"] = auto_row(rows, len(setup.batches))
    return rows


def auto_row(rows: dict[str, PlannerRow], num_batches: int) -> PlannerRow:
    row = PlannerRow(planner="auto", scheme="per batch")
    for b in range(num_batches):
        tried = [r.runs[b] for r in rows.values() if b < len(r.runs)]
        best = choose_best(tried)
        total_ms = sum(c.elapsed_ms for c in tried)
        if best is None:
            row.runs.append(Candidate(planner="auto", error="no planner fits", elapsed_ms=total_ms))
            continue
        row.runs.append(dataclasses.replace(best, planner="auto", elapsed_ms=total_ms))
        row.chosen[best.planner] += 1
    return row


def summarise(rows: dict[str, PlannerRow]) -> dict:
    """Per planner, speedups over the best fitting baseline and over `megatron` (when it ran and fits)."""
    plain = {b: rows[b].summary(None) for b in BASELINES if b in rows}
    fitting = {b: r["step_time_s"] for b, r in plain.items() if r.get("fits")}
    best = min(fitting.values()) if fitting else None
    megatron = fitting.get(PAPER_BASELINE)
    return {"best_baseline_step_time_s": best, "megatron_step_time_s": megatron,
            "planners": {name: row.summary(best, megatron) for name, row in rows.items()}}


def _tick(progress, n: int) -> None:
    if progress is not None:
        progress.update(n)


def all_planners() -> list[str]:
    return available_planners()
