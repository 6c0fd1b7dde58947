"""`compare`: every planner on the same sampled global batches, model and cluster, simulated.

For each planner, a search picks its parallel scheme from one list shared by every planner
(`candidate_schemes`): each scheme is planned and simulated on the selection set (the first
SELECTION_SIZE batches and the one holding the longest sequence, `selection_batches`) and the
one with the lowest mean step over all of them that fits memory on every one is kept for all
batches (stated per planner in the report, with the selection set's size). ChunkFlow also tunes its (ChunkSize, K) there, by
its own grid search (`tune`), unless the user fixed the chunk size. Hydraulis picks its own
heterogeneous strategy inside the GPUs it is given.

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
from lengthwise.metrics import BUBBLE_RATIO, DP_IMBALANCE, GIB, MFU, PEAK_MEMORY_GIB, STEP_TIME_S, TOKENS_PER_S
from lengthwise.planners import PLANNER_NAMES
from lengthwise.planners.auto import Candidate, choose_best, max_peak, try_planner
from lengthwise.plan.ir import Chunk, Segment
from lengthwise.planners.base import PlanRequest
from lengthwise.planners.chunkflow.tune import workload_grid_point
from lengthwise.specs import ClusterSpec, ModelSpec, ParallelScheme

BASELINES = ("padding", "packing", "megatron", "static-cp", "sorted", "token-balanced")
PAPERS_BASELINE = "megatron"
"""What ChunkFlow, InfiniPipe, SlimPack and Hydraulis measured against (`speedup_vs_megatron`)."""
MAX_SCHEMES = 8
"""Schemes every planner tries, the best by `scheme_estimate`."""


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
    """One scheme fixed for every planner (`--scheme`); None searches `candidate_schemes`."""
    schemes: dict[str, ParallelScheme] = field(default_factory=dict)
    """Fixed schemes per planner (a paper's own setting); others are searched."""
    profile: Profile | None = None
    """Measured cost profile (`lengthwise profile`); None uses the analytic cost model."""
    options: dict[str, dict] = field(default_factory=dict)
    """Planner options per planner (the command line's, each planner given those it takes)."""


@dataclass(kw_only=True)
class PlannerRow:
    planner: str
    scheme: str = ""
    runs: list[Candidate] = field(default_factory=list)
    chosen: Counter = field(default_factory=Counter)
    """For auto: how often each planner was chosen."""
    tuned: dict = field(default_factory=dict)
    """Options compare tuned for the planner on its scheme (Setting.tuned)."""
    selection: int = 0
    """Batches its scheme was chosen on (the selection set's size; 0: scheme fixed, not searched)."""

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
            STEP_TIME_S: step,
            "compute_time_s": statistics.fmean(r.result.makespan for r in ok),
            TOKENS_PER_S: tokens / sum(r.result.step_time_s for r in ok),
            "speedup_vs_best_baseline": best_baseline_s / step if best_baseline_s else None,
            "speedup_vs_megatron": megatron_s / step if megatron_s else None,
            BUBBLE_RATIO: statistics.fmean(r.result.bubble_ratio for r in ok),
            DP_IMBALANCE: statistics.fmean(imbalance) if imbalance else None,
            "dp_spread": statistics.fmean(r.result.dp_imbalance_spread for r in ok),
            PEAK_MEMORY_GIB: max(max_peak(r.result) for r in ok) / GIB,
            "fits": all(bool(r.result.fits) for r in ok),
            MFU: statistics.fmean(r.result.mfu or 0.0 for r in ok),
            "planning_ms_mean": statistics.fmean(r.elapsed_ms for r in self.runs),
            "planning_ms_max": max(r.elapsed_ms for r in self.runs),
            "batches": len(ok),
        }
        # micro-batches per pipeline, mean over pipelines and batches
        chunks = [statistics.fmean(len(p.chunks) for p in r.plan.pipelines) for r in ok
                  if r.plan is not None and r.plan.pipelines]
        if chunks:
            d["micro_batches"] = statistics.fmean(chunks)
        if self.chosen:
            d["chosen"] = dict(self.chosen)
        if self.tuned:
            d["tuned"] = dict(self.tuned)
        d["selection_batches"] = self.selection
        return d


def candidate_schemes(setup: CompareSetup) -> list[ParallelScheme]:
    """The schemes every planner searches: the same list for all (fairness), whatever the planner.

    Every (tp, pp, cp) whose degrees divide the GPUs, heads and layers, with tp inside a node and
    model states fitting (sharded over dp x cp), ranked by a planner-independent estimate of the
    step on the selection batches (`scheme_estimate`); the best `MAX_SCHEMES` are kept. A planner
    that cannot run on a scheme (a baseline whose pipeline cannot hold the longest sequence)
    simply fails there, as it would in a real run."""
    if setup.scheme is not None:
        return [setup.scheme]
    m, c, gpus = setup.model, setup.cluster, setup.cluster.num_gpus
    cost = CostModel(model=m, cluster=c, profile=setup.profile)
    found = []
    for tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8)):
        per_pipe = tp * pp * cp
        if gpus % per_pipe or tp > c.gpus_per_node or m.num_heads % tp or m.num_layers % pp:
            continue
        scheme = ParallelScheme(dp=gpus // per_pipe, tp=tp, pp=pp, cp=cp, zero=setup.zero)
        if _states_fit(cost, scheme):
            found.append(scheme)
    batches = [setup.batches[i] for i in selection_batches(setup)]
    found.sort(key=lambda s: (sum(scheme_estimate(cost, s, b, setup.context_length) for b in batches),
                              s.gpus_per_pipeline, str(s)))
    return found[:MAX_SCHEMES]


SELECTION_SIZE = 4
"""Batches of the selection set beyond the longest one: the first SELECTION_SIZE sampled."""


def selection_batches(setup: CompareSetup) -> list[int]:
    """The selection set a scheme is chosen on: the first SELECTION_SIZE batches and the one
    holding the longest sequence (a scheme that cannot hold it is no scheme to train with), so
    at most SELECTION_SIZE + 1. A scheme is kept by its mean step over all of them: two batches
    (the first and the longest) weigh the longest half, which a long tail meets once in many."""
    longest = max(range(len(setup.batches)), key=lambda i: max(setup.batches[i], default=0))
    return sorted(set(range(min(SELECTION_SIZE, len(setup.batches)))) | {longest})


def scheme_estimate(cost: CostModel, s: ParallelScheme, lengths: list[int], context_length: int) -> float:
    """Seconds a step of `lengths` would take on scheme `s` with its work spread evenly: each
    pipeline's share (longest first, to the least loaded) packed as one chunk through one stage
    (forward, backward, CP K/V exchange, at the scheme's tp and cp), stretched by a 1F1B bubble
    of pp - 1 over m + pp - 1 with m context-length micro-batches, plus the stage's gradient
    reduction over dp x cp. Blind to memory and to how a planner packs and splits: only for
    ranking schemes, and the same for every planner."""
    layers = cost.model.num_layers // s.pp
    shares: list[list[int]] = [[] for _ in range(s.dp)]
    loads = [0] * s.dp
    for n in sorted(lengths, reverse=True):
        i = loads.index(min(loads))
        shares[i].append(n)
        loads[i] += n * n  # attention dominates long ones; short ones spread anyway
    slowest = 0.0
    for share in shares:
        if not share:
            continue
        chunk = Chunk(tuple(Segment(i, 0, n) for i, n in enumerate(share)))
        busy = (cost.forward_time(chunk, layers=layers, tp=s.tp, cp=s.cp)
                + cost.backward_time(chunk, layers=layers, tp=s.tp, cp=s.cp)
                + cost.cp_comm_time(chunk, layers=layers, tp=s.tp, cp=s.cp)
                + cost.cp_grad_comm_time(chunk, layers=layers, tp=s.tp, cp=s.cp))
        micro = max(1, -(-sum(share) // context_length))
        slowest = max(slowest, busy * (micro + s.pp - 1) / micro)
    sync = cost.grad_sync_time(layers=layers, tp=s.tp, dp=s.dp * s.cp, zero=s.zero, first=True,
                               inter_node=s.num_gpus > cost.cluster.gpus_per_node)
    return slowest + sync


def _states_fit(cost: CostModel, s: ParallelScheme) -> bool:
    try:
        cost.check_states_fit(tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, zero=s.zero)
    except ValueError:
        return False
    return True


def request_for(setup: CompareSetup, lengths: list[int], scheme: ParallelScheme, planner: str,
                tuned: dict | None = None) -> PlanRequest:
    return PlanRequest(lengths=list(lengths), model=setup.model, cluster=setup.cluster, scheme=scheme,
                       cost=CostModel(model=setup.model, cluster=setup.cluster, profile=setup.profile),
                       context_length=setup.context_length, seed=setup.seed,
                       options={**setup.options.get(planner, {}), **(tuned or {})})


@dataclass(kw_only=True)
class Setting:
    """What compare runs a planner with on every batch: a scheme and the options it tuned."""

    scheme: ParallelScheme
    tuned: dict = field(default_factory=dict)
    """Options compare chose by the planner's own search (ChunkFlow's ChunkSize and K)."""



def pick_scheme(setup: CompareSetup, planner: str,
                schemes: list[ParallelScheme]) -> tuple[Setting | None, list[Candidate]]:
    """The planner's fastest scheme of `schemes` that fits on every selection batch (mean step
    time over them), with the options tuned on that scheme, and the attempts made."""
    if planner in setup.schemes:
        scheme = setup.schemes[planner]
        return Setting(scheme=scheme, tuned=tune(setup, planner, scheme)[1]), []
    tries, best, best_time = [], None, float("inf")
    for scheme in schemes:
        runs, tuned = tune(setup, planner, scheme)
        tries += runs
        if all(r.result is not None and r.result.fits for r in runs):
            mean = statistics.fmean(r.result.step_time_s for r in runs)
            if mean < best_time:
                best, best_time = Setting(scheme=scheme, tuned=tuned), mean
    return best, tries


def no_scheme_reason(tries: list[Candidate]) -> str:
    """Why a planner has no scheme of the list: the first failed attempt's error, or its peak
    over the memory it had. No attempt's numbers stand for the planner's row: a scheme that fits
    one selection batch and not another is not a scheme it can train with."""
    failed = next((t for t in tries if not t.usable), None)
    if failed is None:
        return "no feasible parallel scheme"
    if failed.result is None:
        why = failed.error
    else:
        cap = failed.result.capacity_bytes or 0.0
        why = f"peak {max_peak(failed.result) / GIB:.1f} GiB over {cap / GIB:.1f} GiB"
    return f"no scheme fits every selection batch (first failure at {failed.scheme}: {why})"


def tune(setup: CompareSetup, planner: str, scheme: ParallelScheme) -> tuple[list[Candidate], dict]:
    """The planner's runs on the selection batches under `scheme`, and the options tuned for it.

    ChunkFlow, unless the user fixed its chunk size, runs its own (ChunkSize, K) grid search on
    the selection batches and is then run on every batch at the workload's point
    (`planners/chunkflow/tune.py`). Other planners search inside each plan."""
    batches = [setup.batches[b] for b in selection_batches(setup)]
    if planner != "chunkflow" or "chunk_size" in setup.options.get(planner, {}):
        return [try_planner(planner, request_for(setup, b, scheme, planner)) for b in batches], {}
    searched = [try_planner(planner, request_for(setup, b, scheme, planner, {"chunk_size": "auto"}))
                for b in batches]
    if any(r.plan is None for r in searched):
        return searched, {}
    point = workload_grid_point([r.plan for r in searched],
                                [request_for(setup, b, scheme, "chunkflow") for b in batches])
    if point is None:
        return searched, {}
    chunk_size, k = point
    tuned = {"chunk_size": chunk_size, "k": k}
    return [try_planner(planner, request_for(setup, b, scheme, planner, tuned)) for b in batches], tuned


def run_compare(setup: CompareSetup, progress=None) -> dict[str, PlannerRow]:
    rows: dict[str, PlannerRow] = {}
    names = [p for p in setup.planners if p != "auto"]
    schemes = candidate_schemes(setup)
    for name in names:
        setting, tries = pick_scheme(setup, name, schemes)
        row = rows[name] = PlannerRow(planner=name, scheme=str(setting.scheme) if setting else "none fits",
                                      tuned=setting.tuned if setting else {},
                                      selection=0 if name in setup.schemes else len(selection_batches(setup)))
        if setting is None:
            row.runs = [Candidate(planner=name, error=no_scheme_reason(tries),
                                  elapsed_ms=max((t.elapsed_ms for t in tries), default=0.0))]
            _tick(progress, len(setup.batches))
            continue
        for lengths in setup.batches:
            row.runs.append(try_planner(name, request_for(setup, lengths, setting.scheme, name, setting.tuned)))
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


def time_model(setup: CompareSetup) -> dict:
    """Where the comparison's chunk times come from (CostModel.time_source), for its report."""
    return CostModel(model=setup.model, cluster=setup.cluster, profile=setup.profile).time_source()


def summarise(rows: dict[str, PlannerRow]) -> dict:
    base_times = [rows[b].summary(None).get(STEP_TIME_S) for b in BASELINES if b in rows]
    fitting = [t for b, t in zip([b for b in BASELINES if b in rows], base_times)
               if t is not None and rows[b].summary(None)["fits"]]
    best = min(fitting) if fitting else None
    papers = rows[PAPERS_BASELINE].summary(None) if PAPERS_BASELINE in rows else {}
    megatron = papers.get(STEP_TIME_S) if papers.get("fits") else None
    return {"best_baseline_step_time_s": best, "megatron_step_time_s": megatron,
            "planners": {name: row.summary(best, megatron) for name, row in rows.items()}}


def _tick(progress, n: int) -> None:
    if progress is not None:
        progress.update(n)


def all_planners() -> list[str]:
    return list(PLANNER_NAMES)
