"""InfiniPipe's chunk scheduler, one 1F1B pipeline: its schedule and its stage-aware chunk-level
adaptive checkpointing (infinipipe.txt §3.3.3, Algorithm 2, eq. 15-20).

    group = group_schedule(units, pp)                  # one 1F1B pipeline over whole units
    ckpt = solve_checkpointing(group, memory)          # MILP over n + pp - 1 integers (HiGHS)
    ckpt.recompute[s][k]                               # layers stage s recomputes for chunk k

The schedule (§3.1.3, eq. 7): stage s (0-based) keeps a *window* of pp - s - 1 + N_prefill
chunks between their forward and backward, N_prefill being the most chunks one sequence of the
pipeline is split into; chunks go forward in the order given and backward sequence by sequence,
each sequence's slices in reverse (f2b below).

Checkpointing (eq. 15-16): the chunk at backward position k on stage s recomputes
C[k + pp - 1 - s] layers, so the stages running backwards in the same wave share one variable
and the bubble one stage's recomputation propagates is used by all (Fig. 7b). The MILP (eq. 20)
minimises the recomputation seconds sum_v w_v C_v subject to every peak of every stage staying
under the GPU's capacity. The paper weights every variable by one layer's forward time F-hat
(eq. 17); we take the slowest chunk on each wave, which is the same when chunks are balanced.

Memory is written as what the simulator replays (sim/memory.py): at the start of every
backward of a stage (where every peak lies), held bytes = model states + sum over alive chunks
of (I[s,k] - F[s,k] * r[s,k]) + K/V state and gradients of split sequences + what the backward
re-materialises; all linear in the r's (eq. 19), so each backward start gives one row of the
MILP. `MemoryModel` holds the numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from lengthwise.plan.ir import BACKWARD, FORWARD, Action, Chunk


@dataclass(kw_only=True)
class GroupSchedule:
    """One 1F1B pipeline of whole units (eq. 14's P) before checkpointing."""

    chunks: list[Chunk]
    """Forward order."""
    backward_order: list[int]
    """Chunk at each backward position."""
    prefill: int
    """N_prefill: the most chunks of one sequence in this pipeline."""
    stages: list[list[Action]]
    """Per stage actions without recomputation."""
    f2b: list[int]
    """Backward position of each chunk (eq. 16's f2b)."""

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def num_vars(self) -> int:
        return len(self.chunks) + self.pp - 1

    def var(self, stage: int, chunk: int) -> int:
        """Eq. 16: the C index of chunk `chunk` on `stage`."""
        return self.f2b[chunk] + self.pp - 1 - stage


def group_schedule(unit_chunks: list[list[Chunk]], pp: int) -> GroupSchedule:
    """Forward in the order given; backward unit by unit, each unit's chunks in reverse."""
    chunks, backward, ready = [], [], []
    for unit in unit_chunks:
        first = len(chunks)
        chunks += unit
        backward += list(range(len(chunks) - 1, first - 1, -1))
        ready += [len(chunks)] * len(unit)
    prefill = max((len(u) for u in unit_chunks), default=1)
    stages = [_stage_actions(len(chunks), backward, ready, window=pp - s - 1 + prefill) for s in range(pp)]
    f2b = [0] * len(chunks)
    for i, c in enumerate(backward):
        f2b[c] = i
    return GroupSchedule(chunks=chunks, backward_order=backward, prefill=prefill, stages=stages, f2b=f2b)


def _stage_actions(n: int, backward: list[int], ready: list[int], *, window: int) -> list[Action]:
    """Warm-up up to the window (eq. 7), then one forward per backward, then cool-down."""
    out, issued = [], 0
    for i, c in enumerate(backward):
        need = min(n, max(window + i, ready[i]))
        out += [Action(FORWARD, f) for f in range(issued, need)]
        issued = max(issued, need)
        out.append(Action(BACKWARD, c))
    return out


@dataclass(kw_only=True)
class MemoryModel:
    """Linear memory of one group's stages, as the simulator's replay charges it (eq. 19):
    at the start of the backward at position i of stage s the stage holds
    states[s] + const[s][i] - sum_k savings[s][i, k] * r[s, k] bytes."""

    const: list[np.ndarray]
    """[stage] float64 [n] bytes held at each backward start without recomputation."""
    savings: list[np.ndarray]
    """[stage] float64 [n, chunks] bytes one recomputed layer of each chunk saves there."""
    limit: np.ndarray
    """float64 [stage] capacity minus model states (Algorithm 2 line 1, per stage)."""
    max_layers: np.ndarray
    """int [stage] layers a chunk may recompute there."""
    layer_seconds: np.ndarray
    """float64 [stage, chunks] forward seconds of one layer (the price of recomputing it, eq. 17)."""

    def peak(self, stage: int, recompute: list[int]) -> float:
        """Highest bytes the stage holds (model states excluded) with these recomputed layers."""
        levels = self.const[stage] - self.savings[stage] @ np.asarray(recompute, float)
        return float(levels.max(initial=0.0))


@dataclass(kw_only=True)
class StageShape:
    """What one stage of the pipeline holds: its layers and its share of the work."""

    layers: int
    """Decoder layers on the stage."""
    head: bool
    """Whether the stage runs the LM head (the last stage)."""
    states: float
    """Model-state bytes (weights, gradients, optimizer) held all step."""


class ChunkCosts:
    """Per-stage bytes and seconds of chunks, memoised: eq. 14's DP builds many groups from the
    same chunks."""

    def __init__(self, cost, stages: list[StageShape], *, tp: int, cp: int):
        self.cost, self.stages, self.kw = cost, stages, {"tp": tp, "cp": cp}
        self._memo: dict[tuple[int, Chunk], tuple[float, float, float]] = {}

    def of(self, stage: int, chunk: Chunk) -> tuple[float, float, float]:
        """(activation bytes, bytes saved per recomputed layer, forward seconds of one layer)."""
        key = (stage, chunk)
        if key not in self._memo:
            shape, cost = self.stages[stage], self.cost
            act = cost.activation_bytes(chunk, layers=shape.layers, head=shape.head, **self.kw)
            less = cost.activation_bytes(chunk, layers=shape.layers, head=shape.head, recompute_layers=1,
                                         **self.kw) if shape.layers else act
            self._memo[key] = (act, act - less, cost.forward_time(chunk, layers=1, **self.kw))
        return self._memo[key]

    def kv(self, stage: int, context: int) -> float:
        return self.cost.kv_bytes(context, layers=self.stages[stage].layers, **self.kw)


def group_memory(group: GroupSchedule, costs: ChunkCosts) -> MemoryModel:
    """The linear memory model of a group on every stage."""
    consts, savings, seconds = [], [], []
    for s in range(len(costs.stages)):
        table = np.array([costs.of(s, c) for c in group.chunks], dtype=float).reshape(-1, 3)
        const, coef = _stage_peaks(group.stages[s], table[:, 0], table[:, 1], _kv_events(group, costs, s))
        consts.append(const)
        savings.append(coef)
        seconds.append(table[:, 2])
    return MemoryModel(const=consts, savings=savings,
                       limit=np.array([costs.cost.capacity_bytes - st.states for st in costs.stages]),
                       max_layers=np.array([st.layers for st in costs.stages]),
                       layer_seconds=np.array(seconds).reshape(len(costs.stages), len(group.chunks)))


def _kv_events(group: GroupSchedule, costs: ChunkCosts, stage: int) -> np.ndarray:
    """float64 [3, chunks] K/V bytes of split sequences as sim/memory.py allocates them: row 0
    at a chunk's forward (its K/V, read by later slices), row 1 at its backward's start (K/V
    gradients, at the sequence's first backward), row 2 at its backward's end (both freed
    after the sequence's last backward)."""
    slices: dict[int, list[tuple[int, int, int]]] = {}
    for k, c in enumerate(group.chunks):
        for seg in c.segments:
            slices.setdefault(seg.seq_id, []).append((seg.start, seg.num_tokens, k))
    out = np.zeros((3, len(group.chunks)))
    for parts in slices.values():
        if len(parts) < 2:
            continue
        parts.sort()
        context = parts[-1][0]
        kv = costs.kv(stage, context)
        for _, tokens, k in parts[:-1]:
            out[0, k] += kv * tokens / context
        out[1, parts[-1][2]] += kv
        out[2, parts[0][2]] -= 2 * kv
    return out


def _stage_peaks(actions: list[Action], act: np.ndarray, saving: np.ndarray,
                 kv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes held right after each backward's start allocations: (const [n], savings [n, n]).

    Only backward starts can be peaks: nothing is freed between a forward and the next
    action's start, which so holds more. At the start of B_c the stage holds every chunk
    forwarded and not yet backwarded, c included, whose B re-materialises what its F dropped
    (so c's own recomputation saves nothing there)."""
    n = len(act)
    fpos, bpos = np.zeros(n, int), np.zeros(n, int)
    for i, a in enumerate(actions):
        (fpos if a.kind == FORWARD else bpos)[a.chunk] = i
    order = np.argsort(bpos)                      # rows: backwards in stage order
    p = bpos[order][:, None]
    alive = (fpos[None, :] < p) & (bpos[None, :] >= p)
    const = alive @ act + (fpos[None, :] < p) @ kv[0] + (bpos[None, :] <= p) @ kv[1] + (bpos[None, :] < p) @ kv[2]
    coef = alive * saving[None, :]
    coef[np.arange(n), order] = 0.0
    return const, coef


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
    """"none-needed", "milp", "full" (every layer), or "infeasible"."""


def wave_index(group: GroupSchedule) -> np.ndarray:
    """int [stage, chunks] eq. 16's C index of each chunk on each stage."""
    f2b = np.asarray(group.f2b, dtype=int)
    return f2b[None, :] + (group.pp - 1 - np.arange(group.pp))[:, None]


def wave_weights(group: GroupSchedule, memory: MemoryModel) -> np.ndarray:
    """Seconds one recomputed layer of wave v costs: the slowest chunk of that wave."""
    w = np.zeros(group.num_vars)
    np.maximum.at(w, wave_index(group).ravel(), memory.layer_seconds.ravel())
    return w


def wave_bounds(group: GroupSchedule, memory: MemoryModel) -> np.ndarray:
    """Upper bound of each wave variable: the fewest layers among the stages it covers."""
    index = wave_index(group)
    hi = np.full(group.num_vars, float(memory.max_layers.max(initial=0)))
    np.minimum.at(hi, index.ravel(), np.repeat(memory.max_layers.astype(float), index.shape[1]))
    return hi


def constraint_matrix(group: GroupSchedule, memory: MemoryModel) -> tuple[np.ndarray, np.ndarray]:
    """Rows -sum(saving * C[var]) <= limit - const of eq. 20, every stage's rows stacked."""
    index, rows, ubs = wave_index(group), [np.zeros((0, group.num_vars))], [np.zeros(0)]
    for s in range(group.pp):
        a = np.zeros((len(memory.const[s]), group.num_vars))
        a[:, index[s]] = -memory.savings[s]       # eq. 16: chunk k of stage s uses C[f2b[k] + pp-1-s]
        rows.append(a)
        ubs.append(memory.limit[s] - memory.const[s])
    return np.vstack(rows), np.concatenate(ubs)


MIP_GAP = 1e-3
"""Relative optimality gap HiGHS may stop at: recomputation within 0.1% of the cheapest."""


@dataclass(kw_only=True)
class Problem:
    """Eq. 20 for one group, in matrix form."""

    group: GroupSchedule
    weights: np.ndarray
    """Seconds per recomputed layer of each wave."""
    upper: np.ndarray
    """Layers each wave may recompute at most."""
    a: np.ndarray
    ub: np.ndarray

    def fits(self, values) -> bool:
        slack = self.ub - self.a @ np.asarray(values, float)
        return bool(np.all(slack >= -1e-6 * np.maximum(1.0, np.abs(self.ub))))


def checkpointing_problem(group: GroupSchedule, memory: MemoryModel) -> Problem:
    a, ub = constraint_matrix(group, memory)
    return Problem(group=group, weights=wave_weights(group, memory), upper=wave_bounds(group, memory), a=a, ub=ub)


def answer_without_milp(problem: Problem, mode: str) -> Checkpointing | None:
    """The exact answer when no MILP is needed: nothing to recompute, nothing that fits, or a
    fixed mode; None when the MILP must decide."""
    zero = np.zeros_like(problem.upper)
    if problem.fits(zero):
        return _result(problem, zero, "none-needed")
    if mode == "none":
        return _result(problem, zero, "infeasible")
    if not problem.fits(problem.upper):
        return _result(problem, problem.upper, "infeasible")
    if mode == "full":
        return _result(problem, problem.upper, "full")
    return None


def relaxation_bound(problem: Problem) -> float:
    """Seconds of the LP relaxation: no integer choice recomputes less (prunes eq. 14's DP)."""
    res = milp(problem.weights, bounds=Bounds(np.zeros_like(problem.upper), problem.upper),
               constraints=LinearConstraint(problem.a, -np.inf, problem.ub))
    return float(res.fun) if res.x is not None else np.inf


def solve_milp(problem: Problem, time_limit_s: float) -> Checkpointing:
    """Algorithm 2 lines 6-12 with HiGHS."""
    res = milp(problem.weights, integrality=np.ones_like(problem.weights),
               bounds=Bounds(np.zeros_like(problem.upper), problem.upper),
               constraints=LinearConstraint(problem.a, -np.inf, problem.ub),
               options={"time_limit": time_limit_s, "mip_rel_gap": MIP_GAP})
    if res.x is None:   # time limit without an incumbent: full recomputation fits
        return _result(problem, problem.upper, "full")
    return _result(problem, np.round(res.x), "milp")


def solve_checkpointing(group: GroupSchedule, memory: MemoryModel, *, mode: str = "adaptive",
                        time_limit_s: float = 1.0) -> Checkpointing:
    """Algorithm 2: the cheapest recomputation that fits (mode adaptive), or none / full.
    Mode full recomputes every layer of a group only when the group needs any recomputation."""
    problem = checkpointing_problem(group, memory)
    return answer_without_milp(problem, mode) or solve_milp(problem, time_limit_s)


def _result(problem: Problem, values: np.ndarray, status: str) -> Checkpointing:
    group, values = problem.group, [int(v) for v in values]
    recompute = [[values[group.var(s, k)] for k in range(len(group.chunks))] for s in range(group.pp)]
    return Checkpointing(values=values, recompute=recompute, seconds=float(np.dot(problem.weights, values)),
                         status=status)


def brute_force_checkpointing(group: GroupSchedule, memory: MemoryModel) -> float:
    """Cheapest feasible recomputation seconds by enumerating every C (tests, tiny groups)."""
    problem = checkpointing_problem(group, memory)
    best = np.inf
    for values in itertools.product(*(range(int(h) + 1) for h in problem.upper)):
        if problem.fits(values):
            best = min(best, float(np.dot(problem.weights, values)))
    return best


def with_recompute(group: GroupSchedule, recompute: list[list[int]]) -> list[list[Action]]:
    """The group's stage actions with each F carrying its recomputed layers."""
    return [[Action(a.kind, a.chunk, recompute[s][a.chunk] if a.kind == FORWARD else 0) for a in acts]
            for s, acts in enumerate(group.stages)]


@dataclass(kw_only=True)
class GroupPlan:
    """A scheduled, checkpointed group."""

    schedule: GroupSchedule
    ckpt: Checkpointing
    stats: dict = field(default_factory=dict)
