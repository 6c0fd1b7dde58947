"""The arrays `sim/dag.py:_build_graphs` works on: every action of every schedule shape being
built, numbered graph by graph and stage by stage (`_flatten`), where each (stage, chunk) and
(stage, unit) action sits (`_id_tables`), each task's predecessor on the neighbouring stage
(`_cross_edges`) and on its own stage (`_local_edges`), and its level (`_levels`). All numpy over
the whole batch; no durations (those come in sim/dag.py:evaluate).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD
from lengthwise.plan.schedule_checks import check_schedule

KIND_CODE = {FORWARD: 0, FORWARD_NOGRAD: 1, BACKWARD: 2}
"""Integer code of each action kind in task arrays (F=0, N=1, B=2)."""



@dataclass(kw_only=True)
class _Batch:
    """Every task of the graphs being built, as flat int64 arrays in numbering order (graph by
    graph, stage by stage, schedule order), with each graph's sizes."""

    num_stages: np.ndarray
    """[graph] stages (pp)."""
    num_chunks: np.ndarray
    """[graph] forward chunks."""
    num_units: np.ndarray
    """[graph] backward units."""
    tasks_per_graph: np.ndarray
    """[graph] tasks."""
    graph_start: np.ndarray
    """[graph] the graph's first task in the batch."""
    lane: np.ndarray
    """[task] its (graph, stage) lane, numbered over the batch."""
    graph: np.ndarray
    """[task] its graph."""
    stage: np.ndarray
    """[task] its stage."""
    code: np.ndarray
    """[task] KIND_CODE of its action."""
    index: np.ndarray
    """[task] its chunk (F, N) or backward unit (B)."""
    is_bwd: np.ndarray
    """bool [task] a backward."""
    task: np.ndarray
    """[task] its id within its graph (numbered stage by stage)."""
    position: np.ndarray
    """[task] its place on its stage (0 for the stage's first action)."""


def _flatten(specs: list[tuple], lowered: list[tuple]) -> _Batch:
    """Number every action of every graph, and say where each one sits."""
    num_stages = np.array([len(st) for st, _, _, _ in specs], dtype=np.int64)
    num_chunks = np.array([len(ch) for _, ch, _, _ in specs], dtype=np.int64)
    num_units = np.array([len(ch if bwd is None else bwd) for _, ch, bwd, _ in specs], dtype=np.int64)
    lane_len = np.array([n for lens, _ in lowered for n in lens], dtype=np.int64)   # actions of each stage
    flat = [a for _, acts in lowered for a in acts]
    code = np.array([KIND_CODE[k] for k, _, _ in flat], dtype=np.int64)
    index = np.array([c for _, c, _ in flat], dtype=np.int64)
    n = len(flat)
    lane = np.repeat(np.arange(len(lane_len)), lane_len)
    lane_graph = np.repeat(np.arange(len(specs)), num_stages)
    lane_stage = np.arange(len(lane_len)) - np.repeat(_starts(num_stages), num_stages)
    graph = lane_graph[lane]
    tasks_per_graph = np.bincount(lane_graph, weights=lane_len, minlength=len(specs)).astype(np.int64)
    graph_start = _starts(tasks_per_graph)
    return _Batch(num_stages=num_stages, num_chunks=num_chunks, num_units=num_units, tasks_per_graph=tasks_per_graph,
                  graph_start=graph_start, lane=lane, graph=graph, stage=lane_stage[lane], code=code, index=index,
                  is_bwd=code == 2, task=np.arange(n) - graph_start[graph],
                  position=np.arange(n) - _starts(lane_len)[lane])


@dataclass(kw_only=True)
class _IdTables:
    """Task ids by [graph, stage, chunk] (F, N, first forward) and [graph, stage, unit] (B),
    flattened over the batch; -1 where the stage has no such action."""

    fwd: np.ndarray
    nograd: np.ndarray
    first: np.ndarray
    """The chunk's N when it runs before its F, else its F."""
    bwd: np.ndarray
    fwd_base: np.ndarray
    """[graph] where the graph's [stage, chunk] block starts."""
    bwd_base: np.ndarray
    """[graph] where the graph's [stage, unit] block starts."""
    fwd_slot: np.ndarray
    """[task] a forward task's cell in the [graph, stage, chunk] tables (0 for a backward)."""
    bwd_slot: np.ndarray
    """[task] a backward task's cell in the [graph, stage, unit] table (0 for a forward)."""


def _id_tables(specs: list[tuple], b: _Batch) -> _IdTables:
    """Where each (stage, chunk)'s F and N and each (stage, unit)'s B is; rejects a graph where
    an F or B is missing or an action is repeated."""
    per_chunk, per_unit = b.num_stages * b.num_chunks, b.num_stages * b.num_units
    fwd_base, bwd_base = _starts(per_chunk), _starts(per_unit)
    g, s = b.graph, b.stage
    fwd_slot = np.where(b.is_bwd, 0, fwd_base[g] + s * b.num_chunks[g] + b.index)
    bwd_slot = np.where(b.is_bwd, bwd_base[g] + s * b.num_units[g] + b.index, 0)
    tables = []
    for kind, slot, size in ((0, fwd_slot, int(per_chunk.sum())), (1, fwd_slot, int(per_chunk.sum())),
                             (2, bwd_slot, int(per_unit.sum()))):
        mine = b.code == kind
        count = np.bincount(slot[mine], minlength=size)
        owner = np.repeat(np.arange(len(specs)), per_unit if kind == 2 else per_chunk)
        _reject(specs, owner[(count > 1) | ((count == 0) & (kind != 1))])   # an action missing or repeated
        table = np.full(size, -1, dtype=np.int64)
        table[slot[mine]] = b.task[mine]
        tables.append(table)
    fwd, nograd, bwd = tables
    first = np.where((nograd >= 0) & (nograd < fwd), nograd, fwd)
    return _IdTables(fwd=fwd, nograd=nograd, first=first, bwd=bwd, fwd_base=fwd_base, bwd_base=bwd_base,
                     fwd_slot=fwd_slot, bwd_slot=bwd_slot)


def _reforward(b: _Batch, ids: _IdTables) -> np.ndarray:
    """bool [task]: an F after its chunk's N on its stage (it runs the forward again)."""
    reforward = np.zeros(len(b.code), dtype=bool)
    f = np.flatnonzero(b.code == 0)
    nograd = ids.nograd[ids.fwd_slot[f]]
    reforward[f] = (nograd >= 0) & (nograd < b.task[f])
    return reforward


def _cross_edges(b: _Batch, ids: _IdTables) -> tuple[np.ndarray, np.ndarray]:
    """(cross, no_sender): [task] the neighbouring stage's task handing over the input (F or N
    of the same chunk on the stage above, B of the same unit on the stage below; -1 for the
    first stage's forwards and the last stage's backwards), and the graphs of tasks whose
    neighbour never runs it."""
    g = b.graph
    from_above = ~b.is_bwd & (b.stage > 0)
    from_below = b.is_bwd & (b.stage + 1 < b.num_stages[g])
    cross = np.full(len(b.code), -1, dtype=np.int64)
    above = ids.fwd_slot[from_above] - b.num_chunks[g[from_above]]
    cross[from_above] = np.where(b.code[from_above] == 0, ids.fwd[above], ids.nograd[above])
    cross[from_below] = ids.bwd[ids.bwd_slot[from_below] + b.num_units[g[from_below]]]
    return cross, g[(from_above | from_below) & (cross < 0)]


def _local_edges(b: _Batch, ids: _IdTables, needs, after, fwd_after) -> tuple[np.ndarray, np.ndarray]:
    """(count [task], flattened ids): each task's same-stage predecessors in CSR form: a B's
    chunks it reads (`needs`), its units holding later slices (`after`), an F or N's earlier
    slices (`fwd_after`, their first forwards), then the schedule edge (the stage's previous
    action). `needs`, `after`, `fwd_after`: _csr of the Dependencies fields over all graphs."""
    g, is_bwd, n = b.graph, b.is_bwd, len(b.code)
    unit = np.where(is_bwd, _starts(b.num_units)[g] + b.index, 0)      # numbered over all graphs
    chunk = np.where(is_bwd, 0, _starts(b.num_chunks)[g] + b.index)
    pick = lambda row_len, at, mask: np.where(mask, np.append(row_len, 0)[np.where(mask, at, len(row_len))], 0)
    n_need, n_after, n_fa = pick(needs[0], unit, is_bwd), pick(after[0], unit, is_bwd), pick(fwd_after[0], chunk, ~is_bwd)
    has_prev = b.position > 0
    counts = n_need + n_after + n_fa + has_prev
    start = _starts(counts)
    local = np.full(int(counts.sum()), -1, dtype=np.int64)
    for lens, (row_len, values), ids_of, table, base, width, skip in (
            (n_need, needs, unit, ids.fwd, ids.fwd_base, b.num_chunks, 0 * n_need),
            (n_after, after, unit, ids.bwd, ids.bwd_base, b.num_units, n_need),
            (n_fa, fwd_after, chunk, ids.first, ids.fwd_base, b.num_chunks, 0 * n_fa)):
        t = np.repeat(np.arange(n), lens)
        k = np.arange(len(t)) - np.repeat(_starts(lens), lens)
        ref = values[_starts(row_len)[ids_of[t]] + k]          # the chunk or unit depended on
        local[start[t] + skip[t] + k] = table[base[g[t]] + b.stage[t] * width[g[t]] + ref]
    t = np.flatnonzero(has_prev)
    local[start[t] + counts[t] - 1] = b.task[t] - 1
    return counts, local


def _levels(b: _Batch, cross: np.ndarray) -> np.ndarray:
    """[task] one above its deepest predecessor. Along a stage levels rise by at least one per
    task, so the same-stage predecessors never decide it, and for the i-th task of a stage

        level[i] = max(level[i - 1], level[cross[i]]) + 1 = i + max_{j <= i} (level[cross[j]] + 1 - j):

    a running maximum per stage given the cross levels. Starting from no cross edges and
    repeating this (each time over every task of every graph) raises the levels to the longest
    paths, in as many rounds as the deepest path changes stages plus one (under ten on
    SlimPack's and InfiniPipe's schedules). Around a cycle levels rise every round, past the
    graph's task count, where the loop stops."""
    most = int(b.tasks_per_graph.max())
    shift = b.lane * (4 * (most + 2))                   # keeps each stage's running maximum its own
    sender = np.where(cross >= 0, cross + b.graph_start[b.graph], len(cross))
    pos = b.position
    level = pos.copy()
    for _ in range(most + 2):
        new = np.maximum.accumulate(np.append(level, -1)[sender] + 1 - pos + shift) - shift + pos
        if np.array_equal(new, level):
            break
        level = new
    return level


def _reads(b: _Batch, needs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk, unit, graph) of every (forward chunk, backward unit) read, by graph, chunk, unit."""
    unit = np.repeat(np.arange(len(needs[0])), needs[0])
    graph = np.repeat(np.arange(len(b.num_units)), b.num_units)[unit]
    order = np.lexsort((unit, needs[1], graph))
    return needs[1][order], (unit - _starts(b.num_units)[graph])[order], graph[order]


def _reject(specs: list[tuple], bad: np.ndarray) -> None:
    """Hand the first graph named in `bad` (its schedule cannot run) to check_schedule, which
    raises UserError naming the action."""
    if len(bad):
        stages, chunks, backward_chunks, _ = specs[int(bad.min())]
        check_schedule(stages, chunks, backward_chunks)
        raise AssertionError("schedule cannot run but check_schedule passed")


def _starts(sizes: np.ndarray) -> np.ndarray:
    """Exclusive running sum: where each block of `sizes` starts."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else np.zeros(0, np.int64)


def _csr(rows_of_graphs: list[tuple[tuple[int, ...], ...]]) -> tuple[np.ndarray, np.ndarray]:
    """(length of each row, the rows' values flattened) over the rows of every graph in turn."""
    rows = [r for rows in rows_of_graphs for r in rows]
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    return lens, np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lens.sum()))
