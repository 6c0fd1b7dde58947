"""The task DAG of a training step and its critical-path timing (slimpack.txt §4.3).

A task is one action of one stage of one pipeline. Its predecessors are the previous action of
its stage (schedule edge) and its data dependencies (plan/schedules.action_needs): forward
s-1 -> s, backward s+1 -> s, forward slice i -> i+1, backward slice i+1 -> i. A data edge that
crosses stages carries the sender's point-to-point transfer time.

Timing is two passes. `build_pipeline` walks the schedule once (pure Python, no durations) and
numbers the tasks in a topological order, giving each a *level* one above its deepest
predecessor. `evaluate` then computes finish times level by level with numpy over all pipelines
at once: tasks of one level never depend on each other, so

    finish[t] = max(max_j finish[local[t, j]], finish[cross[t]] + send[cross[t]]) + dur[t]

is one vectorised step per level (about 2 * (chunks + stages) levels for 1F1B), with `local`
the same-stage predecessors (previous action, earlier slices) and `cross` the task on the
neighbouring stage that hands over the activation or its gradient.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD, Action, Chunk
from lengthwise.plan.schedules import Dependencies, ShapeCache, check_schedule, schedule_key

KIND_CODE = {FORWARD: 0, FORWARD_NOGRAD: 1, BACKWARD: 2}
"""Integer code of each action kind in task arrays (F=0, N=1, B=2)."""


@dataclass(kw_only=True)
class PipelineTasks:
    """One pipeline's tasks in topological order, with lookup tables by (stage, chunk)."""

    rows: list[tuple]
    """Per task: (stage, kind code, chunk or unit, recompute layers, is re-forward, cross-stage
    predecessor or -1, same-stage predecessors (schedule edge first), level)."""
    fwd_id: list[list[int]]
    """[stage][chunk] task of the chunk's F (its last forward), -1 when absent."""
    first_id: list[list[int]]
    """[stage][chunk] task of the chunk's first forward (N or F)."""
    nograd_id: list[list[int]]
    """[stage][chunk] task of the chunk's N, -1 when absent."""
    bwd_id: list[list[int]]
    """[stage][unit] task of the unit's B."""
    columns: tuple | None = field(default=None, repr=False, compare=False)
    """`rows` as numpy columns once concatenate has asked (_columns)."""
    id_arrays: tuple | None = field(default=None, repr=False, compare=False)
    """(fwd_id, first_id, nograd_id, bwd_id) as int64 arrays once the memory replay has asked."""


_GRAPHS = ShapeCache()
"""Task graphs by schedule key: they depend on the schedule's shape only, not on token counts."""


def build_pipeline(stages: list[list[Action]], chunks: list[Chunk], backward_chunks: list[Chunk] | None,
                   deps: Dependencies) -> PipelineTasks:
    """Number one pipeline's tasks in a topological order by sweeping its stages.

    Sweeps alternate direction (forwards travel down, backwards up) and advance every stage as
    far as its dependencies allow. A schedule that stops making progress is handed to
    check_schedule, which raises UserError with the step-by-rank grid. The result is shared by
    every pipeline of the same schedule key (`schedule_key`): callers must not modify it."""
    units = len(chunks if backward_chunks is None else backward_chunks)
    key = schedule_key(stages, deps, len(chunks), units)
    cached = _GRAPHS.get(key)
    if cached is None:
        cached = _build_pipeline(stages, chunks, backward_chunks, deps)
        _GRAPHS.put(key, cached)
    return cached


def _build_pipeline(stages: list[list[Action]], chunks: list[Chunk], backward_chunks: list[Chunk] | None,
                    deps: Dependencies) -> PipelineTasks:
    pp = len(stages)
    grid = lambda n: [[-1] * n for _ in range(pp)]
    units = len(chunks if backward_chunks is None else backward_chunks)
    t = PipelineTasks(rows=[], fwd_id=grid(len(chunks)), first_id=grid(len(chunks)),
                      nograd_id=grid(len(chunks)), bwd_id=grid(units))
    lowered = [[(KIND_CODE[a.kind], a.chunk, a.recompute_layers) for a in acts] for acts in stages]
    limits = (len(chunks), len(chunks), units)
    if any(not 0 <= c < limits[code] for acts in lowered for code, c, _ in acts):
        check_schedule(stages, chunks, backward_chunks)  # raises, naming the bad index
    ctx = [(lowered[s], t.first_id[s], (t.fwd_id[s], t.nograd_id[s], t.bwd_id[s]),
            (t.fwd_id[s - 1], t.nograd_id[s - 1]) if s > 0 else None, t.bwd_id[s + 1] if s + 1 < pp else None)
           for s in range(pp)]
    pos, last, left, up = [0] * pp, [-1] * pp, sum(map(len, stages)), True
    levels: list[int] = []
    while left:
        moved = 0
        for s in (range(pp) if up else range(pp - 1, -1, -1)):
            if pos[s] < len(lowered[s]):
                moved += _advance(t.rows, levels, ctx[s], s, pos, last, deps)
        if not moved:
            check_schedule(stages, chunks, backward_chunks)
            raise AssertionError("schedule stuck but check_schedule passed")
        left -= moved
        up = not up
    ran_nograd = sum(i >= 0 for row in t.nograd_id for i in row)
    if len(t.rows) != pp * (len(chunks) + units) + ran_nograd or any(-1 in row for row in t.bwd_id):
        check_schedule(stages, chunks, backward_chunks)  # a missing or repeated action: raises
        raise AssertionError("malformed schedule passed check_schedule")
    return t


def _advance(rows: list, levels: list[int], ctx: tuple, s: int, pos: list[int], lasts: list[int],
             deps: Dependencies) -> int:
    """Issue stage s's actions while their dependencies have been issued; return how many.
    `ctx` holds the stage's lowered actions (kind code, chunk, recompute) and its id tables and
    its neighbours'. The hot loop of the simulator, hence the local names."""
    acts, first, mine, above, below = ctx
    p0 = p = pos[s]
    last, n = lasts[s], len(acts)
    needs, after, fwd_after = deps.bwd_needs, deps.bwd_after, deps.fwd_after
    while p < n:
        code, c, recompute = acts[p]
        if code == 2:
            local = [mine[0][f] for f in needs[c]] + [mine[2][v] for v in after[c]] if after[c] else \
                [mine[0][f] for f in needs[c]]
            x = below[c] if below is not None else -2
        else:
            local = [first[q] for q in fwd_after[c]] if fwd_after[c] else []
            x = above[code][c] if above is not None else -2
        if x == -1 or -1 in local:
            break
        if last >= 0:
            local.append(last)
        lv = levels[x] if x >= 0 else -1
        for q in local:
            if levels[q] > lv:
                lv = levels[q]
        lv += 1
        tid = len(levels)
        rows.append((s, code, c, recompute, code == 0 and mine[1][c] >= 0, x if x >= 0 else -1, local, lv))
        levels.append(lv)
        mine[code][c] = tid
        if code != 2 and first[c] < 0:
            first[c] = tid
        last = tid
        p += 1
    pos[s], lasts[s] = p, last
    return p - p0


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
    """Flatten per-pipeline task rows into global arrays with shifted task ids (each distinct
    graph's rows turned into arrays once: pipelines of one schedule key share them)."""
    offsets = np.cumsum([0] + [len(p.rows) for p in pipes]).tolist()
    total = offsets[-1]
    cols = [_columns(p) for p in pipes]
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


def _columns(t: PipelineTasks) -> tuple[np.ndarray, ...]:
    """t.rows as int64 columns (stage, kind, index, re-forward, cross, level, same-stage
    predecessor counts, the predecessors flattened), made once per graph."""
    cols = t.columns
    if cols is None:
        rows, n = t.rows, len(t.rows)
        # one comprehension per column: zip(*rows) with ~1e5 arguments is several times slower
        stage, kind, index, _, refwd, cross, local, level = ([r[i] for r in rows] for i in range(8))
        counts = np.fromiter(map(len, local), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(local), dtype=np.int64, count=int(counts.sum()))
        cols = tuple(np.asarray(x, dtype=np.int64).reshape(-1) for x in (stage, kind, index, refwd, cross, level))
        cols = t.columns = cols + (counts, flat)
    return cols


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
