"""Hydraulis' two-stage assignment of one batch on candidate strategies (hydraulis §6): Algorithm 1's
dispatch (dispatch.py, trials.py) and eq. 1's greedy packing (packing.py) of each candidate's
pipelines, as far as the choice needs them: every candidate's slowest pipeline is found from
one LPT bound per pipeline (all candidates' pipelines in one vectorised pass) and full packings
from the highest bound down; the chosen candidate's other pipelines are packed after (`complete`).
Also the exchange and switch seconds a candidate is charged on top (cost.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lengthwise.planners.base import PlanRequest
from lengthwise.planners.hydraulis.cost import Scheme, parse_pipelines, plan_exchange, switch_time
from lengthwise.planners.hydraulis.arrays import PipelineArrays
from lengthwise.planners.hydraulis.dispatch import Dispatch, dispatch_many
from lengthwise.planners.hydraulis.packing import Packing, PipelineLoad, greedy_pack, lpt_first
from lengthwise.planners.hydraulis.strategy import Strategy
from lengthwise.planners.options import HydraulisOptions


@dataclass(kw_only=True)
class Evaluation:
    """One candidate strategy assessed on one batch (§6: its two-stage assignment)."""

    strategy: Strategy
    pipelines: list[Scheme]
    """Scheme of each pipeline, strategy MaxLen descending."""
    max_lens: list[int]
    """Micro-batch token limit of each pipeline within this strategy."""
    exchange_s: float
    """Slowest pipeline's optimization-propagation exchange, seconds."""
    switch_s: float
    """A strategy switch from the `previous` option's pipelines to these, seconds (0: none)."""
    loads: list[PipelineLoad]
    """Sequences dispatched to each pipeline (Algorithm 1)."""
    packings: list[Packing | None]
    """Micro-batches of each pipeline (eq. 1); None for a pipeline not packed yet (see `full`)."""
    trials: int
    """Dispatch trials run."""
    dispatch: Dispatch | None = None
    """Algorithm 1's result these loads come from (reused by a later pass on the same batch)."""
    full: set[int]
    """Pipelines packed (the others wait for `complete`; their greedy estimate is at most the
    largest of these, so the largest estimate is exact either way)."""
    first_lpt: list[tuple[float, int]]
    """Each pipeline's LPT estimate and micro-batches at greedy_pack's first count (`lpt_first`)."""

    @property
    def estimate_s(self) -> float:
        return float(max(p.estimate_s for p in self.packings if p is not None) + self.exchange_s + self.switch_s)


def exchange(request: PlanRequest, pipes: list[tuple[Scheme, int]], num_gpus: int) -> float:
    """The slowest pipeline's exchange, exactly as the simulator charges the plan `_pipelines`
    makes of these pipelines (same order, so the same GPUs and node spans)."""
    return max(plan_exchange(request.cost, [s for s, _ in pipes], num_gpus=num_gpus))


def switch(request: PlanRequest, previous: str | None, pipes: list[tuple[Scheme, int]],
            num_gpus: int) -> float:
    """The switch from the `previous` option's pipelines to these (cost.switch_time; 0 without
    the option)."""
    if not previous:
        return 0.0
    return switch_time(request.cost, parse_pipelines(previous), [(s.tp, s.pp, s.cp) for s, _ in pipes],
                       num_gpus=num_gpus)


def evaluate_all(request: PlanRequest, opts: HydraulisOptions, prepared: list, lengths: np.ndarray, num_gpus: int,
                  *, trials: int, share: int | None = None,
                  screened: list[Evaluation | None] | None = None) -> list[Evaluation]:
    """Two-stage assignment (§6) of the batch on each strategy: dispatch (all strategies'
    trials together, every one on the same random orders from the request's seed, its trial
    count from `share`: see dispatch.py), then greedy packing per pipeline. `screened[c]`:
    strategy c's longest-first evaluation from the planner's screen, whose dispatch is not run again and
    which is returned as is when the longest-first trial stays the best (the planner's choice keeps the
    screened evaluation on a tie, so the choice is the same)."""
    screened = screened or [None] * len(prepared)
    arrays = [PipelineArrays.of([s for s, _ in pipes], [m for _, m in pipes]) for _, _, pipes in prepared]
    runs = dispatch_many(lengths, arrays, trials=trials, work_budget=opts.dispatch_work,
                         rng=np.random.default_rng(request.seed), share=share,
                         known=[None if ev is None else ev.dispatch for ev in screened])
    todo = [c for c, (disp, old) in enumerate(zip(runs, screened)) if old is None or disp.trial != 0]
    work = {s: s.seq_time(lengths) for c in todo for s, _ in prepared[c][1].parts}  # w(l) of every sequence
    loads = {c: [_load(lengths, work[s], ids, s, m) for ids, (s, m) in
                 zip(_by_owner(runs[c].owner, len(prepared[c][2])), prepared[c][2])] for c in todo}
    estimates, used = lpt_first([x for c in todo for x in loads[c]])
    sizes = [len(loads[c]) for c in todo]
    out = list(screened)
    for c, bound, bins in zip(todo, _split(estimates, sizes), _split(used, sizes)):
        _, strategy, pipes = prepared[c]
        first_lpt = list(zip(bound.tolist(), bins.tolist()))
        packings, full = _slowest_packed(loads[c], first_lpt)
        out[c] = Evaluation(strategy=strategy, pipelines=[s for s, _ in pipes], max_lens=[m for _, m in pipes],
                            exchange_s=exchange(request, pipes, num_gpus),
                            switch_s=switch(request, opts.previous, pipes, num_gpus), loads=loads[c],
                            packings=packings, trials=runs[c].trials, dispatch=runs[c], full=full,
                            first_lpt=first_lpt)
    return out


def _split(values: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(values, np.cumsum(sizes)[:-1]) if sizes else []


def _slowest_packed(loads: list[PipelineLoad], first_lpt: list[tuple[float, int]]) -> tuple[list, set[int]]:
    """The full greedy packing for the pipelines from the highest upper bound down (the bound:
    `lpt_first`'s estimate, LPT at one micro-batch count, every candidate's pipelines in one numpy
    pass) until the next bound is no more than the slowest full packing found: the largest
    estimate is then exactly that of packing every pipeline fully. Returns the packings (None
    where not packed yet) and the pipelines packed."""
    packings: list[Packing | None] = [None] * len(loads)
    full: set[int] = set()
    slowest = -np.inf
    for j in sorted(range(len(loads)), key=lambda j: -first_lpt[j][0]):
        if first_lpt[j][0] <= slowest:
            break
        packings[j] = greedy_pack(loads[j], first_lpt=first_lpt[j])
        full.add(j)
        slowest = max(slowest, packings[j].estimate_s)
    return packings, full


def complete(ev: Evaluation) -> None:
    """The chosen candidate's remaining pipelines packed (as if every one had been)."""
    for j, load in enumerate(ev.loads):
        if j not in ev.full:
            ev.packings[j] = greedy_pack(load, first_lpt=ev.first_lpt[j])
            ev.full.add(j)


def _by_owner(owner: np.ndarray, pipelines: int) -> list[np.ndarray]:
    """The sequence ids of each pipeline, ascending (one stable sort, not a scan per pipeline)."""
    order = np.argsort(owner, kind="stable")
    return np.split(order, np.cumsum(np.bincount(owner, minlength=pipelines))[:-1])


def _load(lengths: np.ndarray, work: np.ndarray, ids: np.ndarray, scheme: Scheme, max_len: int) -> PipelineLoad:
    """Pipeline load of sequences `ids` (`work`: the scheme's w(l) of every sequence)."""
    return PipelineLoad(seq_ids=tuple(ids.tolist()), lengths=lengths[ids], work=work[ids],
                        chunk_s=scheme.chunk_s, depth=scheme.pp, max_len=max_len, util_len=scheme.util_len)
