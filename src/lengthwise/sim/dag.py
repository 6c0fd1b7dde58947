"""The task DAG of a training step and its critical-path timing (slimpack.txt §4.3).

A task is one action of one stage of one pipeline. Its predecessors are the previous action of
its stage (schedule edge) and its data dependencies (plan/schedules.action_needs): forward
s-1 -> s, backward s+1 -> s, forward slice i -> i+1, backward slice i+1 -> i. A data edge that
crosses stages carries the sender's point-to-point transfer time.

Timing is two passes. `build_pipelines` numbers the tasks stage by stage and gives each a
*level* one above its deepest predecessor (no durations; numpy over every new schedule shape at
once, `_build_graphs`). `evaluate` then computes finish times level by level with numpy over all
pipelines at once: tasks of one level never depend on each other, so

    finish[t] = max(max_j finish[local[t, j]], finish[cross[t]] + send[cross[t]]) + dur[t]

is one vectorised step per level (about 2 * (chunks + stages) levels for 1F1B), with `local`
the same-stage predecessors (previous action, earlier slices) and `cross` the task on the
neighbouring stage that hands over the activation or its gradient.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD, Action, Chunk
from lengthwise.plan.schedules import Dependencies, ShapeCache, check_schedule

KIND_CODE = {FORWARD: 0, FORWARD_NOGRAD: 1, BACKWARD: 2}
"""Integer code of each action kind in task arrays (F=0, N=1, B=2)."""


@dataclass(kw_only=True)
class PipelineTasks:
    """One pipeline's tasks, numbered stage by stage in schedule order, with their levels and
    lookup tables by (stage, chunk)."""

    columns: tuple[np.ndarray, ...]
    """int64 columns, one entry per task: stage, kind code, chunk or unit, is re-forward,
    cross-stage predecessor (-1 for none), level; then each task's count of same-stage
    predecessors (slice edges, then the schedule edge) and those predecessors flattened."""
    fwd_id: np.ndarray
    """int64 [stage, chunk] task of the chunk's F (its last forward)."""
    first_id: np.ndarray
    """int64 [stage, chunk] task of the chunk's first forward (N or F)."""
    nograd_id: np.ndarray
    """int64 [stage, chunk] task of the chunk's N, -1 when absent."""
    bwd_id: np.ndarray
    """int64 [stage, unit] task of the unit's B."""
    reads: tuple[np.ndarray, np.ndarray]
    """(chunk, unit) int64 pairs: each backward unit reading each forward chunk's activations
    (Dependencies.bwd_needs), by chunk, then unit."""

    @property
    def num_tasks(self) -> int:
        return len(self.columns[0])

    @property
    def id_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.fwd_id, self.first_id, self.nograd_id, self.bwd_id


_GRAPHS = ShapeCache()
"""Task graphs by `_graph_key`: they depend on the schedule's shape only, not on token counts."""


def build_pipeline(stages: list[list[Action]], chunks: list[Chunk], backward_chunks: list[Chunk] | None,
                   deps: Dependencies) -> PipelineTasks:
    """One pipeline's task graph (`build_pipelines`)."""
    return build_pipelines([(stages, chunks, backward_chunks, deps)])[0]


def build_pipelines(specs: list[tuple]) -> list[PipelineTasks]:
    """The task graph of each (stages, chunks, backward_chunks, deps). A graph is shared by every
    pipeline of the same schedule shape (`_graph_key`): callers must not modify it. The graphs
    of keys not seen before are built together (`_build_graphs`). A schedule that cannot run to
    the end is handed to check_schedule, which raises UserError with the step-by-rank grid."""
    keys = [_graph_key(stages, deps, len(chunks), len(chunks if bwd is None else bwd))
            for stages, chunks, bwd, deps in specs]
    found: dict = {}
    todo: dict = {}
    for key, spec in zip(keys, specs):
        if key not in found and key not in todo:
            cached = _GRAPHS.get(key)
            if cached is None:
                todo[key] = spec
            else:
                found[key] = cached
    for key, graph in zip(todo, _build_graphs(list(todo.values()), [k[:2] for k in todo])):
        _GRAPHS.put(key, graph)
        found[key] = graph
    return [found[key] for key in keys]


_FIELDS = operator.attrgetter("kind", "chunk", "recompute_layers")


def _graph_key(stages: list[list[Action]], deps: Dependencies, num_chunks: int, num_units: int) -> tuple:
    """What a schedule's task graph depends on (schedule_key's content, read with one attrgetter
    call per action): the stages' lengths, every action's (kind, chunk, recomputed layers) stage
    after stage, the slice dependencies and the chunk and unit counts."""
    return (tuple(map(len, stages)), tuple(map(_FIELDS, itertools.chain.from_iterable(stages))), deps, num_chunks,
            num_units)


def _build_graphs(specs: list[tuple], lowered: list[tuple]) -> list[PipelineTasks]:
    """Task graphs of many pipelines at once with numpy (`lowered`: per schedule, its stages'
    lengths and its actions' (kind, chunk, recompute) stage after stage, as in `_graph_key`).

    Tasks are numbered stage by stage. A task's predecessors are the stage's previous action
    (schedule edge), its data dependencies on the same stage (plan/schedules.action_needs:
    earlier slices, the chunks a backward unit reads, the units holding later slices) and the
    task on the neighbouring stage that hands over its input (`cross`). Its level is one above
    its deepest predecessor: along a stage levels rise by at least one per task, so the
    same-stage predecessors never decide it, and

        level[i] = max(level[i - 1], level[cross[i]]) + 1 = i + max_{j <= i} (level[cross[j]] + 1 - j)

    for the i-th task of a stage: a running maximum per stage given the cross levels. Starting
    from no cross edges and repeating this (each time over every task of every graph) raises
    the levels to the longest paths, in as many rounds as the deepest path changes stages plus
    one (under ten on SlimPack's and InfiniPipe's schedules). A schedule runs to the end exactly
    when every predecessor exists, the same-stage ones come earlier on their stage, and the
    graph has no cycle (levels would grow past the task count); else check_schedule raises."""
    if not specs:
        return []
    pp = np.array([len(st) for st, _, _, _ in specs], dtype=np.int64)
    C = np.array([len(ch) for _, ch, _, _ in specs], dtype=np.int64)
    U = np.array([len(ch if bwd is None else bwd) for _, ch, bwd, _ in specs], dtype=np.int64)
    lane_len = np.array([n for lens, _ in lowered for n in lens], dtype=np.int64)
    flat = [a for _, acts in lowered for a in acts]
    code = np.array([KIND_CODE[k] for k, _, _ in flat], dtype=np.int64)
    idx = np.array([c for _, c, _ in flat], dtype=np.int64)
    n = len(flat)
    lane = np.repeat(np.arange(len(lane_len)), lane_len)
    lane_graph = np.repeat(np.arange(len(specs)), pp)
    lane_stage = np.arange(len(lane_len)) - np.repeat(_starts(pp), pp)
    g, s = lane_graph[lane], lane_stage[lane]
    tasks = np.bincount(lane_graph, weights=lane_len, minlength=len(specs)).astype(np.int64)
    gbase = _starts(tasks)
    tid = np.arange(n) - gbase[g]                       # numbered stage by stage within the graph
    pos = np.arange(n) - _starts(lane_len)[lane]        # place on its stage
    is_b = code == 2
    _reject(specs, g[(idx < 0) | (idx >= np.where(is_b, U[g], C[g]))])   # an index out of range
    # [graph, stage, chunk] and [graph, stage, unit] tables of task ids, flattened
    fbase, bbase = _starts(pp * C), _starts(pp * U)
    fslot = np.where(is_b, 0, fbase[g] + s * C[g] + idx)
    bslot = np.where(is_b, bbase[g] + s * U[g] + idx, 0)
    tables = []
    for kind, slot, size in ((0, fslot, int((pp * C).sum())), (1, fslot, int((pp * C).sum())),
                             (2, bslot, int((pp * U).sum()))):
        mine = code == kind
        count = np.bincount(slot[mine], minlength=size)
        owner = np.repeat(np.arange(len(specs)), pp * (U if kind == 2 else C))
        _reject(specs, owner[(count > 1) | ((count == 0) & (kind != 1))])   # an action missing or repeated
        table = np.full(size, -1, dtype=np.int64)
        table[slot[mine]] = tid[mine]
        tables.append(table)
    fwd_tab, nograd_tab, bwd_tab = tables
    first_tab = np.where((nograd_tab >= 0) & (nograd_tab < fwd_tab), nograd_tab, fwd_tab)
    refwd = np.zeros(n, dtype=bool)                     # an F after the chunk's N on its stage
    f = np.flatnonzero(code == 0)
    refwd[f] = (nograd_tab[fslot[f]] >= 0) & (nograd_tab[fslot[f]] < tid[f])
    # the neighbouring stage's task handing over the input: F or N from above, B from below
    up = ~is_b & (s > 0)
    down = is_b & (s + 1 < pp[g])
    cross = np.full(n, -1, dtype=np.int64)
    above = fslot[up] - C[g[up]]
    cross[up] = np.where(code[up] == 0, fwd_tab[above], nograd_tab[above])
    cross[down] = bwd_tab[bslot[down] + U[g[down]]]
    bad = g[(up | down) & (cross < 0)]                  # the neighbour never runs it
    # same-stage predecessors: slice edges (data dependencies), then the schedule edge
    deps = [d for _, _, _, d in specs]
    if any((len(d.bwd_needs), len(d.bwd_after), len(d.fwd_after)) != (u, u, c)
           for d, u, c in zip(deps, U.tolist(), C.tolist())):
        raise ValueError("dependencies do not match the pipeline's chunks and backward units")
    need, after, fa = (_csr([getattr(d, name) for d in deps]) for name in ("bwd_needs", "bwd_after", "fwd_after"))
    unit = np.where(is_b, _starts(U)[g] + idx, 0)       # the task's unit or chunk, numbered over all graphs
    chunk = np.where(is_b, 0, _starts(C)[g] + idx)
    pick = lambda row_len, at, mask: np.where(mask, np.append(row_len, 0)[np.where(mask, at, len(row_len))], 0)
    n_need, n_after, n_fa = pick(need[0], unit, is_b), pick(after[0], unit, is_b), pick(fa[0], chunk, ~is_b)
    has_prev = pos > 0
    counts = n_need + n_after + n_fa + has_prev
    start = _starts(counts)
    local = np.full(int(counts.sum()), -1, dtype=np.int64)
    for lens, (row_len, values), ids, table, base, width, skip in (
            (n_need, need, unit, fwd_tab, fbase, C, 0 * n_need), (n_after, after, unit, bwd_tab, bbase, U, n_need),
            (n_fa, fa, chunk, first_tab, fbase, C, 0 * n_fa)):
        t = np.repeat(np.arange(n), lens)
        k = np.arange(len(t)) - np.repeat(_starts(lens), lens)
        ref = values[_starts(row_len)[ids[t]] + k]          # the chunk or unit depended on
        local[start[t] + skip[t] + k] = table[base[g[t]] + s[t] * width[g[t]] + ref]
    t = np.flatnonzero(has_prev)
    local[start[t] + counts[t] - 1] = tid[t] - 1
    owner = np.repeat(np.arange(n), counts)
    late = (local < 0) | (local >= tid[owner])          # absent, or later on the stage: never issued
    _reject(specs, np.r_[bad, g[owner[late]]])
    # levels: running maxima per stage, repeated until no cross edge raises one
    width = 4 * (int(tasks.max()) + 2)
    shift = lane * width                                # keeps each stage's running maximum its own
    glob = np.where(cross >= 0, cross + gbase[g], n)
    level = pos.copy()
    for _ in range(int(tasks.max()) + 2):   # around a cycle levels rise every round, past its graph's tasks
        new = np.maximum.accumulate(np.append(level, -1)[glob] + 1 - pos + shift) - shift + pos
        if np.array_equal(new, level):
            break
        level = new
    _reject(specs, g[level >= tasks[g]])                # a path longer than the graph: a cycle
    cols = (s, code, idx, refwd.astype(np.int64), cross, level)
    # the reads of each graph, by chunk then unit
    read_u = np.repeat(np.arange(len(need[0])), need[0])
    read_g = np.repeat(np.arange(len(specs)), U)[read_u]
    order = np.lexsort((read_u, need[1], read_g))
    read_c, read_u, read_g = need[1][order], (read_u - _starts(U)[read_g])[order], read_g[order]
    rb = np.searchsorted(read_g, np.arange(len(specs) + 1)).tolist()
    out = []
    tb = np.r_[gbase, n].tolist()
    lb = np.r_[np.append(_starts(counts), len(local))[gbase], len(local)].tolist()
    fb, bb = np.r_[fbase, len(fwd_tab)].tolist(), np.r_[bbase, len(bwd_tab)].tolist()
    for i in range(len(specs)):
        a, b = tb[i], tb[i + 1]
        out.append(PipelineTasks(
            columns=tuple(c[a:b].copy() for c in cols) + (counts[a:b].copy(), local[lb[i]:lb[i + 1]].copy()),
            fwd_id=fwd_tab[fb[i]:fb[i + 1]].reshape(int(pp[i]), int(C[i])).copy(),
            first_id=first_tab[fb[i]:fb[i + 1]].reshape(int(pp[i]), int(C[i])).copy(),
            nograd_id=nograd_tab[fb[i]:fb[i + 1]].reshape(int(pp[i]), int(C[i])).copy(),
            bwd_id=bwd_tab[bb[i]:bb[i + 1]].reshape(int(pp[i]), int(U[i])).copy(),
            reads=(read_c[rb[i]:rb[i + 1]], read_u[rb[i]:rb[i + 1]])))
    return out


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


@dataclass(kw_only=True)
class TaskArrays:
    """All pipelines' tasks as flat numpy arrays (pipelines concatenated, ids shifted)."""

    pipeline: np.ndarray
    """int32 [T] pipeline of each task."""
    stage: np.ndarray
    """int32 [T] stage within its pipeline."""
    kind: np.ndarray
    """int8 [T] KIND_CODE."""
    index: np.ndarray
    """int32 [T] chunk or backward unit."""
    reforward: np.ndarray
    """bool [T] second forward of a chunk that ran N first."""
    cross: np.ndarray
    """int64 [T] predecessor on the neighbouring stage; T (a dummy finishing at 0) for none."""
    local: np.ndarray
    """int64 [T, D] same-stage predecessors (schedule and slice edges), padded with T."""
    level: np.ndarray
    """int64 [T] topological level."""
    offsets: list[int]
    """First task of each pipeline (plus the total at the end)."""


def concatenate(pipes: list[PipelineTasks]) -> TaskArrays:
    """Flatten per-pipeline task columns into global arrays with shifted task ids."""
    offsets = np.cumsum([0] + [p.num_tasks for p in pipes]).tolist()
    total = offsets[-1]
    cols = [p.columns for p in pipes]
    shift = np.repeat(np.asarray(offsets[:-1], dtype=np.int64), np.diff(offsets))
    join = lambda i: np.concatenate([c[i] for c in cols]) if cols else np.zeros(0, np.int64)
    stage, kind, index, refwd, cross, level, counts, flat = (join(i) for i in range(8))
    cross = np.where(cross < 0, total, cross + shift)
    width = int(counts.max(initial=0)) or 1
    row_of = np.repeat(np.arange(total), counts)
    col_of = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
    local_arr = np.full((total, width), total, dtype=np.int64)
    local_arr[row_of, col_of] = flat + shift[row_of]
    return TaskArrays(pipeline=np.repeat(np.arange(len(pipes), dtype=np.int32), np.diff(offsets)),
                      stage=stage.astype(np.int32), kind=kind.astype(np.int8), index=index.astype(np.int32),
                      reforward=refwd.astype(bool), cross=cross, local=local_arr, level=level, offsets=offsets)


def evaluate(tasks: TaskArrays, dur: np.ndarray, send: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and finish of every task, level by level (durations and sends are float64 [T])."""
    total = len(dur)
    finish = np.zeros(total + 1)  # slot `total` is the dummy predecessor
    begin = np.zeros(total)  # kept exactly: finish - dur can round below the previous task's finish
    send_ext = np.append(send, 0.0)
    order = np.argsort(tasks.level, kind="stable")
    bounds = np.searchsorted(tasks.level[order], np.arange(tasks.level.max(initial=-1) + 2))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        idx = order[lo:hi]
        x = tasks.cross[idx]
        start = np.maximum(finish[tasks.local[idx]].max(axis=1), finish[x] + send_ext[x])
        begin[idx] = start
        finish[idx] = start + dur[idx]
    return begin, finish[:total]
