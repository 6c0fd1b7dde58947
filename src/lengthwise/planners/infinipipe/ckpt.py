"""InfiniPipe's stage-aware chunk-level adaptive checkpointing (infinipipe.txt §3.3.3,
Algorithm 2, eq. 15-20): the MILP that picks how many layers each chunk recomputes on each stage.

    problem = checkpointing_problem(group, memory)      # infinipipe/schedule.py builds both
    ckpt = answer_without_milp(problem, "adaptive") or solve_milp(problem, time_limit_s=1.0)
    ckpt.recompute[s][k]                                # layers stage s recomputes for chunk k

Variables (eq. 15-16): the chunk at backward position k on stage s recomputes C[k + pp - 1 - s]
layers, so the stages running backwards in the same wave share one variable and the bubble one
stage's recomputation propagates is used by all (Fig. 7b): n + pp - 1 integers in
[0, layers per stage]. Objective (eq. 17): the recomputation seconds sum_v w_v C_v. The paper
weights every variable by one layer's forward time F-hat; we take the slowest chunk on each wave,
which is the same when chunks are balanced. Constraints (eq. 20): every backward start of every
stage stays under capacity minus that stage's model states (Algorithm 2 takes the largest model
states for all stages; per stage is exact). Solved by HiGHS (scipy.optimize.milp) to a 1% gap.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from lengthwise.plan.ir import Action
from lengthwise.planners.infinipipe.schedule import GroupSchedule, MemoryModel

MIP_GAP = 1e-2
"""Relative optimality gap HiGHS may stop at: recomputation within 1% of the cheapest (well under
0.1% of a step; closing the last 0.1% can take HiGHS seconds on 60-variable groups)."""


@dataclass(kw_only=True)
class Checkpointing:
    """Solved checkpointing of one group."""

    values: list[int]
    """C of eq. 15, n + pp - 1 integers."""
    recompute: list[list[int]]
    """[stage][chunk] recomputed layers (eq. 16)."""
    seconds: float
    """T_ckpt of eq. 17 with our per-wave weights."""
    status: str
    """"none-needed", "milp", "lp-rounded" (HiGHS timed out), "full" (every layer) or "infeasible"."""


@dataclass(kw_only=True)
class Problem:
    """Eq. 20 for one group."""

    group: GroupSchedule
    memory: MemoryModel
    index: np.ndarray
    """int [stage, chunks] eq. 16's C index of each chunk on each stage."""
    weights: np.ndarray
    """Seconds per recomputed layer of each wave: its slowest chunk's one-layer forward."""
    upper: np.ndarray
    """Layers each wave may recompute: the fewest layers of the stages it covers."""
    relaxed: tuple[np.ndarray | None, float] | None = None
    """The LP relaxation's (C, seconds) once solved."""

    def recompute(self, values) -> np.ndarray:
        """float64 [stage, chunks] layers recomputed by each chunk on each stage (eq. 16)."""
        return np.asarray(values, float)[self.index]

    def fits(self, values) -> bool:
        r, m = self.recompute(values), self.memory
        return all(st.levels(r[s]).max(initial=0.0) <= m.limit[s] + 1e-6 * max(1.0, abs(m.limit[s]))
                   for s, st in enumerate(m.stages))

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Eq. 20 as A C[cols] <= ub: -sum(saving * C[var]) <= limit - held-without-recomputation,
        keeping only the rows that some recomputation can take over the limit (`StageMemory.reach`:
        only a backward's own chunk can add, the rest save, so the others always hold) and the
        waves those rows involve (the rest stay 0)."""
        a, ub = [np.zeros((0, len(self.upper)))], [np.zeros(0)]
        for s, st in enumerate(self.memory.stages):
            over = st.reach() > self.memory.limit[s]
            block = np.zeros((int(over.sum()), len(self.upper)))
            block[:, self.index[s]] = -st.savings()[over]
            a.append(block)
            ub.append((self.memory.limit[s] - st.levels())[over])
        a_all = np.vstack(a)
        cols = np.flatnonzero(np.any(a_all != 0, axis=0))
        return cols, a_all[:, cols], np.concatenate(ub)

    def solve(self, *, integral: bool, time_limit_s: float = 1.0):
        """HiGHS on the reduced eq. 20: (full C or None, objective)."""
        cols, a, ub = self.rows()
        if not len(cols):  # nothing over the limit (C = 0), or rows no recomputation relieves
            return (np.zeros_like(self.upper), 0.0) if np.all(ub >= 0) else (None, np.inf)
        res = milp(self.weights[cols], integrality=np.full(len(cols), 1 if integral else 0),
                   bounds=Bounds(np.zeros(len(cols)), self.upper[cols]), constraints=LinearConstraint(a, -np.inf, ub),
                   options={"time_limit": time_limit_s, "mip_rel_gap": MIP_GAP})
        if res.x is None:
            return None, np.inf
        values = np.zeros_like(self.upper)
        values[cols] = np.round(res.x) if integral else res.x
        return values, float(res.fun)


def checkpointing_problem(group: GroupSchedule, memory: MemoryModel) -> Problem:
    index = group.f2b[None, :] + (group.pp - 1 - np.arange(group.pp))[:, None]
    num_vars = len(group.chunks) + group.pp - 1
    weights = np.zeros(num_vars)
    np.maximum.at(weights, index.ravel(), memory.layer_seconds.ravel())
    upper = np.full(num_vars, float(memory.max_layers.max(initial=0)))
    np.minimum.at(upper, index.ravel(), np.repeat(memory.max_layers.astype(float), index.shape[1]))
    return Problem(group=group, memory=memory, index=index, weights=weights, upper=upper)


def answer_without_milp(problem: Problem, mode: str) -> Checkpointing | None:
    """The exact answer when no MILP is needed: nothing to recompute, nothing that fits, or a
    fixed mode ("none", "full"); None when the MILP must decide."""
    zero = np.zeros_like(problem.upper)
    if mode == "full":   # uniform full checkpointing, the "full ckpt" ablation (§5.5)
        return _result(problem, problem.upper, "full" if problem.fits(problem.upper) else "infeasible")
    if problem.fits(zero):
        return _result(problem, zero, "none-needed")
    if mode == "none" or not problem.fits(problem.upper):
        return _result(problem, zero if mode == "none" else problem.upper, "infeasible")
    return None


def row_bound(problem: Problem) -> float:
    """A lower bound on the recomputation seconds without any solver: each over-limit row alone
    needs its excess saved, at best at its cheapest bytes-per-second wave."""
    cols, a, ub = problem.rows()
    over = ub < 0  # rows that hold without recomputation need nothing saved
    if not over.any():
        return 0.0
    if not len(cols):  # rows over the limit that no wave's recomputation relieves
        return np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        per_second = np.where(a[over] < 0, -a[over] / problem.weights[cols][None, :], 0.0)
        # a row no wave can relieve needs infinite seconds: the group is infeasible
        return float(np.max(-ub[over] / per_second.max(axis=1)))


def relaxation_bound(problem: Problem) -> float:
    """Seconds of the LP relaxation: no integer choice recomputes less (prunes eq. 14's DP)."""
    if problem.relaxed is None:
        problem.relaxed = problem.solve(integral=False)
    return problem.relaxed[1]


def solve_milp(problem: Problem, time_limit_s: float) -> Checkpointing:
    """Algorithm 2 lines 6-12 with HiGHS. The LP optimum rounded up most often fits (recomputing
    more needs more memory only in a backward's own row, by the SwiGLU product its re-materialised
    layer holds; `Problem.fits` checks it): when it is within the MIP gap of the LP bound HiGHS is not called,
    and when HiGHS runs out of time it stands in for a worse or missing incumbent."""
    bound = relaxation_bound(problem)
    rounded = np.ceil(problem.relaxed[0] - 1e-9) if problem.relaxed[0] is not None else problem.upper
    cost = float(np.dot(problem.weights, rounded))
    if cost <= bound * (1 + MIP_GAP) + 1e-12 and problem.fits(rounded):
        return _result(problem, rounded, "milp")
    values, found = problem.solve(integral=True, time_limit_s=time_limit_s)
    if values is not None and found <= cost:
        return _result(problem, values, "milp")
    return _result(problem, rounded, "lp-rounded") if problem.fits(rounded) else _result(problem, problem.upper, "full")


def solve_checkpointing(group: GroupSchedule, memory: MemoryModel, *, mode: str = "adaptive",
                        time_limit_s: float = 1.0) -> Checkpointing:
    """Algorithm 2: the cheapest recomputation that fits (mode adaptive), or none / full."""
    problem = checkpointing_problem(group, memory)
    return answer_without_milp(problem, mode) or solve_milp(problem, time_limit_s)


def _result(problem: Problem, values: np.ndarray, status: str) -> Checkpointing:
    values = [int(v) for v in values]
    return Checkpointing(values=values, recompute=problem.recompute(values).astype(int).tolist(),
                         seconds=float(np.dot(problem.weights, values)), status=status)


def brute_force_checkpointing(group: GroupSchedule, memory: MemoryModel) -> float:
    """Cheapest feasible recomputation seconds by enumerating every C (tests, tiny groups)."""
    problem = checkpointing_problem(group, memory)
    best = np.inf
    for values in itertools.product(*(range(int(h) + 1) for h in problem.upper)):
        if problem.fits(values):
            best = min(best, float(np.dot(problem.weights, values)))
    return best


def with_recompute(group: GroupSchedule, recompute: list[list[int]], offset: int = 0) -> list[list[Action]]:
    """The group's stage actions with each F carrying its recomputed layers (chunk indices
    shifted by `offset`)."""
    return [group.stage_actions(s, recompute[s], offset) for s in range(group.pp)]


@dataclass(kw_only=True)
class GroupPlan:
    """A scheduled, checkpointed group."""

    schedule: GroupSchedule
    ckpt: Checkpointing
    stats: dict = field(default_factory=dict)
