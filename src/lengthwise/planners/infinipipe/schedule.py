"""One InfiniPipe 1F1B pipeline *group*: its schedule and its memory as a linear function of the
recomputed layers (infinipipe.txt §3.1.3-3.1.4, eq. 5-10, 19).

    group = group_schedule([unit.chunks for unit in units], pp)
    memory = group_memory(group, UnitCosts(cost, stages, tp=8, cp=1))
    memory.stages[s].levels(r)          # bytes held at each backward start of stage s

Schedule (eq. 7): stage s (0-based) keeps a *window* of pp - s - 1 + N_prefill chunks between
their forward and backward, N_prefill being the most chunks one sequence of the group is split
into; chunks go forward in the order given and backward unit by unit, each unit's chunks in
reverse (a split sequence's last slice first, f2b). With N_prefill = 1 this is plain 1F1B.

Memory is charged exactly as the simulator's replay charges it (sim/memory.py, sim/inputs.py):
activations of a chunk from its F to the end of its B, fewer when its F recomputes r layers
(I[k] - F[k] * r, eq. 19), with the difference re-materialised during its B; K/V state of a
split sequence's earlier slices from their forward to the sequence's last backward, and its
K/V gradients from its first backward to the same end (eq. 5, 9), and on the LM head's stage
each forward's head working set while it runs (`cost.head_forward_bytes`). Nothing is freed
between a forward and the next action's start, so every peak lies at some backward's start or,
on the head's stage, some forward's: one linear row per backward (and forward) per stage. Levels for given r come from prefix sums in O(n log n); the dense
rows are only built for the MILP.

The per-chunk bytes and seconds these rows are built from are `unit_costs.UnitCosts`'s, memoised
over the many groups eq. 14's DP builds from the same units.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import BACKWARD, FORWARD, Action, Chunk
from lengthwise.planners.infinipipe.unit_costs import UnitCosts


@dataclass(kw_only=True)
class GroupSchedule:
    """One 1F1B pipeline of whole units (eq. 14's P) before checkpointing."""

    units: list[list[Chunk]]
    """The units, in forward order; their chunks concatenated are `chunks`."""
    chunks: list[Chunk]
    """Forward order."""
    backward_order: np.ndarray
    """int [n] chunk at each backward position."""
    ready: np.ndarray
    """int [n] forwards that must precede each backward (its unit's last chunk included)."""
    prefill: int
    """N_prefill: the most chunks of one sequence in this group."""
    pp: int
    """Stages."""
    f2b: np.ndarray
    """int [n] backward position of each chunk (eq. 16's f2b)."""

    def positions(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """Index of each chunk's F and of its B in the stage's action list: warm-up up to the
        window (eq. 7), then one forward per backward, then cool-down."""
        n = len(self.chunks)
        window = self.pp - stage - 1 + self.prefill
        steps = np.arange(n)
        issued = np.maximum.accumulate(np.minimum(n, np.maximum(window + steps, self.ready)))
        bpos = np.empty(n, dtype=int)
        bpos[self.backward_order] = steps + issued          # the forwards issued so far precede it
        fpos = steps + np.searchsorted(issued, steps, side="right")
        return fpos, bpos

    def stage_actions(self, stage: int, recompute: list[int] | None = None, offset: int = 0) -> list[Action]:
        """The stage's action list, each F carrying its recomputed layers; chunk indices are
        shifted by `offset` (the chunks of earlier groups of the pipeline)."""
        fpos, bpos = self.positions(stage)
        acts: list[Action] = [_action(FORWARD, 0, 0)] * (2 * len(self.chunks))
        layers = [int(r) for r in recompute] if recompute is not None else [0] * len(self.chunks)
        for k, (f, b, r) in enumerate(zip(fpos.tolist(), bpos.tolist(), layers), start=offset):
            acts[f] = _action(FORWARD, k, r)
            acts[b] = _action(BACKWARD, k, 0)
        return acts

    @property
    def stages(self) -> list[list[Action]]:
        """Per stage actions without recomputation."""
        return [self.stage_actions(s) for s in range(self.pp)]


@functools.lru_cache(maxsize=1 << 16)
def _action(kind: str, chunk: int, recompute: int) -> Action:
    """Actions are immutable, so the pipelines of a plan share them (building a frozen
    dataclass costs more than the dictionary lookup)."""
    return Action(kind, chunk, recompute)


def group_schedule(unit_chunks: list[list[Chunk]], pp: int) -> GroupSchedule:
    """Forward in the order given; backward unit by unit, each unit's chunks in reverse."""
    chunks, backward, ready = [], [], []
    for unit in unit_chunks:
        first = len(chunks)
        chunks += unit
        backward += range(len(chunks) - 1, first - 1, -1)
        ready += [len(chunks)] * len(unit)
    order = np.asarray(backward, dtype=int)
    f2b = np.empty(len(chunks), dtype=int)
    f2b[order] = np.arange(len(chunks))
    return GroupSchedule(units=list(unit_chunks), chunks=chunks, backward_order=order, ready=np.asarray(ready, dtype=int),
                         prefill=max((len(u) for u in unit_chunks), default=1), pp=pp, f2b=f2b)


@dataclass(kw_only=True)
class StageMemory:
    """Bytes one stage holds at each of its backward starts and, where its forwards have a
    working set (the LM head's stage), at each forward (model states excluded)."""

    fpos: np.ndarray
    """int [n] action index of each chunk's F."""
    bpos: np.ndarray
    """int [n] action index of each chunk's B."""
    act: np.ndarray
    """float64 [n] activation bytes of each chunk without recomputation."""
    saving: np.ndarray
    """float64 [n] bytes each recomputed layer of a chunk saves."""
    kv: np.ndarray
    """float64 [3, n] K/V bytes allocated at each chunk's F, at its B's start, and (negative,
    freed) at its B's end."""
    work: np.ndarray | None = None
    """float64 [n] bytes each chunk's B works on while it runs (the loss's backward on the LM
    head's stage, one layer's elsewhere: `cost.backward_work_bytes`); None: nothing."""
    forward_work: np.ndarray | None = None
    """float64 [n] bytes each chunk's F works on while it runs beside the activations it keeps
    (the LM head's logits on the head's stage: `cost.head_forward_bytes`); None: nothing, and
    no forward rows (every peak is then at a backward's start)."""
    grads: float = 0.0
    """Gradient bytes (part of the model states the limit leaves out) that the stage's first
    backward makes: not yet held at its start, all held from its end (`StageShape.grads`)."""
    table: float = 0.0
    """The embedding's gradient at each backward's end (first stage, `StageShape.table`):
    then the backward's own chunk is freed and, after the first backward, every gradient made."""
    remat: np.ndarray | None = None
    """float64 [n] bytes each chunk's B holds beyond `work` when its F recomputes layers: its
    working set with the layer it re-materialises (`UnitCosts.recompute_rows`: the layer's
    dropped activations and the SwiGLU's product, which a recomputed layer's nodes keep and the
    others do not, `cost/memory.py`; on the head's stage beside a layer's backward, not on top
    of the loss's); None: nothing."""
    rerun: np.ndarray | None = None
    """float64 [n] bytes each chunk's B holds beyond `work` and `remat` when it recomputes all
    `layers` (`UnitCosts.recompute_rows`: the recomputed layers' own working set, the rerun's
    end among it, in place of the plain layer's; negative where smaller); None: nothing."""
    layers: int = 0
    """The stage's layers."""

    @property
    def rows(self) -> np.ndarray:
        """Chunks in backward order: the chunk whose backward starts each row."""
        return np.argsort(self.bpos)

    def levels(self, recompute: np.ndarray | None = None) -> np.ndarray:
        """float64 [n] bytes held at each backward start, with r[k] layers recomputed, then,
        with `forward_work`, [n] more: the bytes held while each chunk's F runs."""
        rows = self.rows
        kept = self.act - (self.saving * recompute if recompute is not None else 0.0)
        p = self.bpos[rows]
        # alive chunks (and K/V of earlier slices, minus what finished backwards freed) ...
        held = _prefix(self.fpos, kept + self.kv[0])(p) - _prefix(self.bpos, kept - self.kv[2])(p)
        # ... plus what the backward re-materialises of its own F, one recomputed layer at a time
        # (the executor checkpoints per layer: `CostModel.recompute_transient_bytes`), and the K/V
        # gradients, and the backward's working set (the loss's on the head's stage)
        remat = self.remat * np.minimum(recompute, 1.0) if recompute is not None and self.remat is not None else 0.0
        if recompute is not None and self.rerun is not None:  # every layer rerun: its nodes' working set
            remat = remat + np.where(recompute >= self.layers, self.rerun, 0.0)
        own = remat + (self.work if self.work is not None else 0.0) + np.zeros_like(self.act)
        first = rows[:1]
        if self.table:  # the embedding's backward at the end: its own chunk freed, the table made
            end = self.table - kept + np.zeros_like(self.act)
            end[first] += self.grads   # and, in the first backward, every gradient
            own = np.maximum(own, end)
        level = held + own[rows] + _at_or_before(self.bpos, self.kv[1], p)
        level[:1] -= self.grads   # no gradient before the first backward's end
        if self.forward_work is None:
            return level
        return np.concatenate([level, self._forward_levels(kept)])

    def own_costs(self) -> np.ndarray:
        """float64 [n] bytes per recomputed layer that eq. 20's linear row of each chunk's
        backward charges the chunk itself (negative: saves). Its exact level (`levels`) is its
        full activations at r = 0, less `saving` a layer plus `remat` at 0 < r, plus `rerun`
        too at r = `layers`: the steepest line from r = 0 that covers r = 1 and r = `layers`
        bounds them all and is exact at r = 0 and, unless r = `layers` holds more than r = 1,
        at r = 1."""
        remat = self.remat if self.remat is not None else np.zeros_like(self.act)
        rerun = self.rerun if self.rerun is not None else 0.0
        return np.maximum(remat, (remat + rerun) / max(self.layers, 1)) - self.saving

    def _forward_levels(self, kept: np.ndarray) -> np.ndarray:
        """float64 [n] bytes held while each chunk's F runs: the chunks forwarded so far (its own
        kept activations allocated at its start) less those whose backwards ended, the K/V of
        earlier slices and the K/V gradients allocated by then, and its own working set."""
        q = self.fpos
        held = _at_or_before(self.fpos, kept + self.kv[0], q) - _prefix(self.bpos, kept - self.kv[2])(q)
        level = held + _at_or_before(self.bpos, self.kv[1], q) + self.forward_work
        if self.grads:  # forwards before the first backward's end hold no gradient
            level = level - np.where(q < self.bpos.min(initial=0), self.grads, 0.0)
        return level

    def savings(self) -> np.ndarray:
        """float64 [rows of `levels`, n chunks] bytes one recomputed layer of each chunk saves at
        each backward start (eq. 19's F[k] on the chunks alive there; for the backward's own,
        less what re-materialising it holds: -`own_costs`) and, with `forward_work`, while each
        F runs (its own chunk's included). Linear for the MILP, so conservative for the
        backward's own chunk where it recomputes more than one layer (the plan is then checked
        with `levels`)."""
        rows = self.rows
        p = self.bpos[rows][:, None]
        alive = (self.fpos[None, :] < p) & (self.bpos[None, :] > p)
        if self.forward_work is not None:  # each F's rows: its own chunk's kept bytes are exact
            q = self.fpos[:, None]
            alive = np.vstack([alive, (self.fpos[None, :] <= q) & (self.bpos[None, :] > q)])
        out = alive * self.saving[None, :]
        out[np.arange(len(rows)), rows] = -self.own_costs()[rows]
        return out

    def reach(self) -> np.ndarray:
        """float64 [rows of `levels`] the most each row can reach by its own chunk's
        recomputation alone (the others' only save): a row below the limit here always holds."""
        level = self.levels()
        rows = self.rows
        level[:len(rows)] += np.maximum(self.own_costs(), 0.0)[rows] * self.layers
        return level


def _prefix(pos: np.ndarray, values: np.ndarray):
    """p -> sum of the values whose position is before p."""
    order = np.argsort(pos)
    sums = np.concatenate([[0.0], np.cumsum(values[order])])
    return lambda p: sums[np.searchsorted(pos[order], p, side="left")]


def _at_or_before(pos: np.ndarray, values: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Sum of the values whose position is p or before, for each p."""
    order = np.argsort(pos)
    sums = np.concatenate([[0.0], np.cumsum(values[order])])
    return sums[np.searchsorted(pos[order], p, side="right")]


@dataclass(kw_only=True)
class MemoryModel:
    """Linear memory of one group's stages (eq. 19)."""

    stages: list[StageMemory]
    limit: np.ndarray
    """float64 [stage] capacity minus model states (Algorithm 2 line 1, per stage)."""
    max_layers: np.ndarray
    """int [stage] layers a chunk may recompute there."""
    layer_seconds: np.ndarray
    """float64 [stage, chunks] forward seconds of one layer (the price of recomputing it, eq. 17)."""

    def peak(self, stage: int, recompute) -> float:
        """Highest bytes the stage holds (model states excluded) with these recomputed layers."""
        return float(self.stages[stage].levels(np.asarray(recompute, float)).max(initial=0.0))


def group_memory(group: GroupSchedule, costs: UnitCosts, *, first_group: bool = False) -> MemoryModel:
    """The linear memory model of a group on every stage. `first_group`: the group opens its
    pipeline's step, so its first backward on each stage makes the gradients, which no stage
    holds before (`StageShape.grads`); a later group holds them throughout. The planner builds
    groups before it orders them and charges every group as a later one, which bounds the
    first from above."""
    stages, seconds = [], []
    for s in range(group.pp):
        table = costs.columns(s, group.units)
        fpos, bpos = group.positions(s)
        chunks = [c for u in group.units for c in u]
        work = costs.work_row(s, chunks)
        remat, rerun = costs.recompute_rows(s, chunks, work)
        stages.append(StageMemory(fpos=fpos, bpos=bpos, act=table[0], saving=table[1], kv=table[3:], work=work,
                                  forward_work=costs.forward_work_row(s, chunks),
                                  grads=costs.stages[s].grads if first_group else 0.0, table=costs.stages[s].table,
                                  rerun=rerun, layers=costs.stages[s].layers,
                                  remat=remat))
        seconds.append(table[2])
    return MemoryModel(stages=stages, limit=np.array([costs.cost.capacity_bytes - st.states for st in costs.stages]),
                       max_layers=np.array([st.layers for st in costs.stages]),
                       layer_seconds=np.array(seconds).reshape(group.pp, len(group.chunks)))
