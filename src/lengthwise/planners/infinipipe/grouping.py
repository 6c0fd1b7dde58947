"""InfiniPipe's sequence grouping (infinipipe.txt §3.3.2, eq. 14): which units share one 1F1B
pipeline group, each group checkpointed by Algorithm 2 (infinipipe/ckpt.py).

    lay = layout(request, dp)
    groups, cost = group_by_classes(units, request, lay, mode="adaptive", time_limit_s=1.0)

Units are classed by how many chunks they have (N_prefill of a group is its largest class).
Consecutive classes form one group, and with dp[0] = 0

    dp[i] = min over k < i of dp[k] + delta + T_ckpt(classes k..i-1)

delta being one more warm-up/cool-down ((pp - 1) mean chunk passes on a stage) and T_ckpt the
group's recomputation seconds. More groups keep short sequences out of the deep windows of long
ones (less recomputation) at the price of more warm-ups (§3.3.2: "sequences of similar lengths
should be grouped together"). The paper solves an MILP per candidate group, n(n+1)/2 of them
(§3.3.4); we solve the LP relaxation of each first and MILPs only in bound order, stopping once
no bound can beat the best found, which gives the same dp[i] (to the MILP gap) with a fraction
of the MILPs. Groups needing no recomputation, or unable to fit, need no solver at all.

Most pipelines never reach the DP: every group costs delta, so when the whole pipeline as one
group needs no recomputation that group is eq. 14's optimum (`group_by_classes`), found with one
group problem, or none when the units' activations and K/V fit on every stage all at once
(`surely_fits`). Otherwise the DP builds a group's problem only once dp[k] + delta could still
beat the best option found (`cheapest`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from lengthwise.cost.memory import embedding_backward_bytes
from lengthwise.planners.base import PlanRequest
from lengthwise.planners.infinipipe.chunking import Unit
from lengthwise.planners.infinipipe.ckpt import (
    Checkpointing,
    GroupPlan,
    Problem,
    answer_without_milp,
    checkpointing_problem,
    relaxation_bound,
    row_bound,
    solve_milp,
)
from lengthwise.planners.infinipipe.schedule import group_memory, group_schedule
from lengthwise.planners.infinipipe.unit_costs import StageShape, UnitCosts

INF = float("inf")


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """How each group's checkpointing is decided."""

    mode: str
    """"adaptive" (Algorithm 2's MILP), "none" (never recompute) or "full" (every layer)."""
    time_limit_s: float
    """HiGHS time limit per MILP, seconds."""


@dataclass(kw_only=True)
class Layout:
    """Per-stage shape of every pipeline and the degrees the cost model needs."""

    stages: list[StageShape]
    tp: int
    cp: int
    dp: int
    """Pipelines (some may stay empty when the batch has fewer units)."""
    costs: UnitCosts
    """Memoised per-stage chunk costs."""


def layout(request: PlanRequest, dp: int) -> Layout:
    s, cost = request.scheme, request.cost
    stages = [StageShape(layers=b.layers, head=b.last, states=b.states, grads=b.grads,
                         table=embedding_backward_bytes(cost.model) if b.first else 0.0)
              for b in cost.stage_budgets(tp=s.tp, pp=s.pp, replicas=dp * s.cp, zero=s.zero)]
    return Layout(stages=stages, tp=s.tp, cp=s.cp, dp=dp, costs=UnitCosts(cost, stages, tp=s.tp, cp=s.cp))


def chunk_stage_seconds(chunk, request: PlanRequest, shape: StageShape) -> float:
    """Forward + backward seconds of a chunk on one stage."""
    kw = {"layers": shape.layers, "tp": request.scheme.tp, "cp": request.scheme.cp, "head": shape.head}
    return request.cost.forward_time(chunk, **kw) + request.cost.backward_time(chunk, **kw)


def one_group(units: list[Unit], lay: Layout):
    """The 1F1B group of these units, longest units first."""
    ordered = sorted(units, key=lambda u: (-len(u.chunks), -u.chunks[-1].segments[0].stop, u.seq_id))
    return group_schedule([u.chunks for u in ordered], len(lay.stages))


def group_problem(units: list[Unit], request: PlanRequest, lay: Layout) -> Problem:
    """One 1F1B group (longest units first) and its checkpointing problem (Algorithm 2)."""
    group = one_group(units, lay)
    return checkpointing_problem(group, group_memory(group, lay.costs))


def surely_fits(units: list[Unit], lay: Layout) -> bool:
    """Whether one group of these units needs no recomputation by a bound alone
    (`UnitCosts.held_at_most`: its window's largest activations plus all its K/V), so that
    neither the group's memory rows nor its levels are built; False when unsure."""
    limit = lay.costs.cost.capacity_bytes
    chunks = [u.chunks for u in units]
    return all(lay.costs.held_at_most(s, chunks) <= limit - shape.states for s, shape in enumerate(lay.stages))


def without_recompute(units: list[Unit], lay: Layout) -> GroupPlan:
    """The group with no recomputation, as `answer_without_milp` writes it when it fits."""
    group = one_group(units, lay)
    n, pp = len(group.chunks), group.pp
    ckpt = Checkpointing(values=[0] * (n + pp - 1), recompute=[[0] * n for _ in range(pp)], seconds=0.0,
                         status="none-needed")
    return GroupPlan(schedule=group, ckpt=ckpt)


def plan_group(units: list[Unit], request: PlanRequest, lay: Layout, solver: SolverOptions) -> GroupPlan:
    problem = group_problem(units, request, lay)
    ckpt = answer_without_milp(problem, solver.mode) or solve_milp(problem, solver.time_limit_s)
    return GroupPlan(schedule=problem.group, ckpt=ckpt)


@dataclass(kw_only=True)
class Option:
    """One way to end eq. 14's prefix at class i: the group of classes k..i-1 after dp[k]."""

    cost: float
    """dp[k] + delta + T_ckpt when `plan` is known, else a lower bound of it."""
    start: int
    """k."""
    plan: GroupPlan | None = None
    problem: Problem | None = None
    """Set once built, while only a bound is known."""
    bound: str = "exact"
    """How `cost` was found: "unbuilt" (dp[k] + delta, T_ckpt >= 0), "rows" (no solver), "lp"
    (the relaxation) or "exact"."""


def options_for(i: int, best: list[Option], delta: float) -> list[Option]:
    """Every group ending at class i whose prefix is feasible, bounded by dp[k] + delta: its
    problem is built only if the bound can still win (see `tighten`)."""
    return [Option(cost=best[k].cost + delta, start=k, bound="unbuilt") for k in range(i) if best[k].cost < INF]


def tighten(opt: Option, i: int, base: float, build, solver: SolverOptions) -> Option | None:
    """The next bound of an option: unbuilt -> exact when no MILP is needed (None when the group
    cannot fit), else rows -> LP relaxation -> the MILP's exact answer."""
    if opt.bound == "unbuilt":
        problem = build(opt.start, i)
        quick = answer_without_milp(problem, solver.mode)
        if quick is None:
            return Option(cost=base + row_bound(problem), start=opt.start, problem=problem, bound="rows")
        if quick.status == "infeasible":
            return None
        return Option(cost=base + quick.seconds, start=opt.start, plan=GroupPlan(schedule=problem.group, ckpt=quick))
    if opt.bound == "rows":
        return Option(cost=base + relaxation_bound(opt.problem), start=opt.start, problem=opt.problem, bound="lp")
    ckpt = solve_milp(opt.problem, solver.time_limit_s)
    return Option(cost=base + ckpt.seconds, start=opt.start, plan=GroupPlan(schedule=opt.problem.group, ckpt=ckpt))


def cheapest(i: int, options: list[Option], best: list[Option], delta: float, build,
             solver: SolverOptions) -> Option:
    """The cheapest option, tightening bounds lowest first until no bound can beat the best
    exact cost found (branch and bound over eq. 14's choices): groups are built only while
    their dp[k] + delta can still win, and most built ones never reach HiGHS."""
    found = Option(cost=INF, start=-1)
    heap = [(o.cost, o.start, o.bound, n, o) for n, o in enumerate(options)]
    heapq.heapify(heap)
    count = len(heap)
    while heap and heap[0][0] < found.cost:
        _, _, _, _, opt = heapq.heappop(heap)
        if opt.plan is not None:
            found = min(found, opt, key=lambda o: (o.cost, o.start))
            continue
        opt = tighten(opt, i, best[opt.start].cost + delta, build, solver)
        if opt is not None:
            heapq.heappush(heap, (opt.cost, opt.start, opt.bound, count, opt))
            count += 1
    return found


def group_by_classes(units: list[Unit], request: PlanRequest, lay: Layout, solver: SolverOptions,
                     chunk_seconds: list[float] | None = None,
                     fits: bool | None = None) -> tuple[list[GroupPlan], float] | None:
    """Eq. 14 over the distinct chunk counts; None when no grouping fits memory.
    `chunk_seconds`: forward + backward seconds on stage 0 of every chunk of `units` in order
    (computed when not given); `fits`: `surely_fits(units, lay)` when the caller knows it.

    Every group costs delta > 0 plus its recomputation, so when all units in one group need no
    recomputation that group is the optimum (any other grouping pays at least one delta more)
    and the DP is skipped: one group problem per pipeline instead of C(C+1)/2 (pp = 1, where
    delta = 0, ties go to the single group too)."""
    if not units:    # more pipelines than units: this one stays empty
        return [], 0.0
    if chunk_seconds is None:
        chunk_seconds = [chunk_stage_seconds(c, request, lay.stages[0]) for u in units for c in u.chunks]
    mean = sum(chunk_seconds) / len(chunk_seconds)
    delta = (len(lay.stages) - 1) * mean   # one more warm-up and cool-down
    if solver.mode != "full" and (fits if fits is not None else surely_fits(units, lay)):
        return [without_recompute(units, lay)], 0.0 + delta + 0.0
    whole = group_problem(units, request, lay)
    quick = answer_without_milp(whole, solver.mode)
    if quick is not None and quick.status == "none-needed":
        return [GroupPlan(schedule=whole.group, ckpt=quick)], 0.0 + delta + quick.seconds
    classes = sorted({u.num_chunks for u in units})
    members = {n: [u for u in units if u.num_chunks == n] for n in classes}
    build = lambda k, i: whole if (k, i) == (0, len(classes)) else \
        group_problem([u for n in classes[k:i] for u in members[n]], request, lay)
    best = [Option(cost=0.0, start=-1)]
    for i in range(1, len(classes) + 1):
        best.append(cheapest(i, options_for(i, best, delta), best, delta, build, solver))
    if best[-1].cost == INF:
        return None
    groups, i = [], len(classes)
    while i > 0:
        groups.append(best[i].plan)
        i = best[i].start
    return groups, best[-1].cost    # longest classes first


def unit_need(unit: Unit, request: PlanRequest, lay: Layout, solver: SolverOptions) -> tuple[float, int]:
    """(bytes, stage) the unit alone needs at its peak with the most recomputation the mode
    allows; any group holding it needs at least as much (its chunks stay alive alongside)."""
    problem = group_problem([unit], request, lay)
    r = problem.recompute(problem.upper if solver.mode != "none" else 0 * problem.upper)
    needs = [problem.memory.stages[s].levels(r[s]).max() + lay.stages[s].states for s in range(len(lay.stages))]
    stage = max(range(len(needs)), key=lambda i: needs[i])
    return float(needs[stage]), stage


