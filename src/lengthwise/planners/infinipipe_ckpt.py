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

Memory is written as what the simulator replays (sim/memory.py): at the start of every action
of a stage, held bytes = model states + sum over alive chunks of (I[s,k] - F[s,k] * r[s,k])
+ K/V terms of split sequences + the action's own transient; each is linear in the r's
(eq. 19), so each action start gives one linear constraint. `MemoryModel` supplies the numbers.
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

    @property
    def f2b(self) -> list[int]:
        """Backward position of each chunk (eq. 16's f2b)."""
        pos = [0] * len(self.chunks)
        for i, c in enumerate(self.backward_order):
            pos[c] = i
        return pos

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
    return GroupSchedule(chunks=chunks, backward_order=backward, prefill=prefill, stages=stages)


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
class Peak:
    """One linear memory constraint: const - sum(saving * r[stage, chunk]) <= limit (eq. 19)."""

    stage: int
    const: float
    """Bytes held when no layer is recomputed."""
    savings: dict[int, float]
    """chunk -> bytes saved per recomputed layer."""


@dataclass(kw_only=True)
class MemoryModel:
    """Linear memory of one group's stages (what the simulator's replay charges)."""

    peaks: list[Peak]
    """One per action start of every stage (duplicates removed)."""
    limit: list[float]
    """[stage] capacity minus model states, bytes (Algorithm 2 line 1, per stage)."""
    max_layers: list[int]
    """[stage] layers a chunk may recompute there."""
    layer_seconds: list[list[float]]
    """[stage][chunk] forward seconds of one layer (the price of recomputing it, eq. 17)."""


@dataclass(kw_only=True)
class StageShape:
    """What one stage of the pipeline holds: its layers and its share of the work."""

    layers: int
    """Decoder layers on the stage."""
    head: bool
    """Whether the stage runs the LM head (the last stage)."""
    states: float
    """Model-state bytes (weights, gradients, optimizer) held all step."""


def group_memory(group: GroupSchedule, cost, stages: list[StageShape], *, tp: int, cp: int) -> MemoryModel:
    """The linear memory model of a group, charged as the simulator's replay charges it."""
    kw = {"tp": tp, "cp": cp}
    peaks, seconds = [], []
    for s, shape in enumerate(stages):
        act = [cost.activation_bytes(c, layers=shape.layers, head=shape.head, **kw) for c in group.chunks]
        saving = [act[k] - cost.activation_bytes(c, layers=shape.layers, head=shape.head, recompute_layers=1, **kw)
                  if shape.layers else 0.0 for k, c in enumerate(group.chunks)]
        kv = _kv_events(group, cost, shape.layers, kw)
        peaks += _stage_peaks(group.stages[s], s, act, saving, kv)
        seconds.append([cost.forward_time(c, layers=1, **kw) for c in group.chunks])
    return MemoryModel(peaks=_dedupe(peaks), limit=[cost.capacity_bytes - st.states for st in stages],
                       max_layers=[st.layers for st in stages], layer_seconds=seconds)


def _kv_events(group: GroupSchedule, cost, layers: int, kw: dict) -> dict[tuple[str, int], float]:
    """(event, chunk) -> K/V bytes of split sequences, as sim/memory.py allocates them: earlier
    slices' K/V from their forward ("F") to the end of the sequence's last backward ("b"), and
    K/V gradients from the start of its first backward ("B", the last slice) to the same end."""
    slices: dict[int, list[tuple[int, int, int]]] = {}
    for k, c in enumerate(group.chunks):
        for seg in c.segments:
            slices.setdefault(seg.seq_id, []).append((seg.start, seg.num_tokens, k))
    out: dict[tuple[str, int], float] = {}

    def add(key: tuple[str, int], amount: float) -> None:
        out[key] = out.get(key, 0.0) + amount

    for parts in slices.values():
        if len(parts) < 2:
            continue
        parts.sort()
        context = parts[-1][0]
        kv = cost.kv_bytes(context, layers=layers, **kw)
        for _, tokens, k in parts[:-1]:
            add(("F", k), kv * tokens / context)
        add(("B", parts[-1][2]), kv)
        add(("b", parts[0][2]), -2 * kv)
    return out


def _stage_peaks(actions: list[Action], s: int, act: list[float], saving: list[float],
                 kv: dict[tuple[str, int], float]) -> list[Peak]:
    """Held bytes right after each action's start allocations, as linear forms in r."""
    const, coef, peaks = 0.0, {}, []
    for a in actions:
        k = a.chunk
        if a.kind == FORWARD:   # activations (fewer when recomputing) and K/V of an earlier slice
            const += act[k] + kv.get(("F", k), 0.0)
            coef[k] = coef.get(k, 0.0) + saving[k]
            peaks.append(Peak(stage=s, const=const, savings=dict(coef)))
        else:                   # the B re-materialises what its F dropped, and K/V gradients
            const += kv.get(("B", k), 0.0)
            coef[k] = coef.get(k, 0.0) - saving[k]
            peaks.append(Peak(stage=s, const=const, savings={c: v for c, v in coef.items() if v}))
            const += kv.get(("b", k), 0.0) - act[k]
            coef.pop(k, None)
    return peaks


def _dedupe(peaks: list[Peak]) -> list[Peak]:
    seen, out = set(), []
    for p in peaks:
        key = (p.stage, round(p.const), tuple(sorted((c, round(v)) for c, v in p.savings.items())))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


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


def wave_weights(group: GroupSchedule, memory: MemoryModel) -> np.ndarray:
    """Seconds one recomputed layer of wave v costs: the slowest chunk of that wave."""
    w = np.zeros(group.num_vars)
    for s in range(group.pp):
        for k in range(len(group.chunks)):
            v = group.var(s, k)
            w[v] = max(w[v], memory.layer_seconds[s][k])
    return w


def wave_bounds(group: GroupSchedule, memory: MemoryModel) -> np.ndarray:
    """Upper bound of each wave variable: the fewest layers among the stages it covers."""
    hi = np.full(group.num_vars, max(memory.max_layers, default=0), dtype=float)
    for s in range(group.pp):
        for k in range(len(group.chunks)):
            v = group.var(s, k)
            hi[v] = min(hi[v], memory.max_layers[s])
    return hi


def constraint_matrix(group: GroupSchedule, memory: MemoryModel) -> tuple[np.ndarray, np.ndarray]:
    """Rows -sum(saving * C[var]) <= limit - const of eq. 20."""
    a = np.zeros((len(memory.peaks), group.num_vars))
    ub = np.zeros(len(memory.peaks))
    for row, peak in enumerate(memory.peaks):
        for k, saving in peak.savings.items():
            a[row, group.var(peak.stage, k)] -= saving
        ub[row] = memory.limit[peak.stage] - peak.const
    return a, ub


def fits(group: GroupSchedule, memory: MemoryModel, values) -> bool:
    """Whether every peak stays under its stage's limit with wave values C."""
    a, ub = constraint_matrix(group, memory)
    return bool(np.all(a @ np.asarray(values, float) <= ub + 1e-6 * np.maximum(1.0, np.abs(ub))))


def solve_checkpointing(group: GroupSchedule, memory: MemoryModel, *, mode: str = "adaptive",
                        time_limit_s: float = 1.0) -> Checkpointing:
    """Algorithm 2: the cheapest recomputation that fits (mode adaptive), or none / full."""
    w, hi = wave_weights(group, memory), wave_bounds(group, memory)
    zero = np.zeros(group.num_vars)
    if mode == "none" or (mode == "adaptive" and fits(group, memory, zero)):
        return _result(group, zero, w, "none-needed" if fits(group, memory, zero) else "infeasible")
    if not fits(group, memory, hi):
        return _result(group, hi, w, "infeasible")
    if mode == "full":
        return _result(group, hi, w, "full")
    a, ub = constraint_matrix(group, memory)
    res = milp(w, integrality=np.ones_like(w), bounds=Bounds(zero, hi),
               constraints=LinearConstraint(a, -np.inf, ub), options={"time_limit": time_limit_s})
    if res.x is None:   # time limit without an incumbent: full recomputation is feasible
        return _result(group, hi, w, "full")
    return _result(group, np.round(res.x), w, "milp")


def _result(group: GroupSchedule, values: np.ndarray, w: np.ndarray, status: str) -> Checkpointing:
    values = [int(v) for v in values]
    recompute = [[values[group.var(s, k)] for k in range(len(group.chunks))] for s in range(group.pp)]
    return Checkpointing(values=values, recompute=recompute, seconds=float(np.dot(w, values)), status=status)


def brute_force_checkpointing(group: GroupSchedule, memory: MemoryModel) -> float:
    """Cheapest feasible recomputation seconds by enumerating every C (tests, tiny groups)."""
    w, hi = wave_weights(group, memory), wave_bounds(group, memory)
    best = np.inf
    for values in itertools.product(*(range(int(h) + 1) for h in hi)):
        if fits(group, memory, values):
            best = min(best, float(np.dot(w, values)))
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
