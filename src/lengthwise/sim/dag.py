"""The task DAG of a training step and its critical-path timing (slimpack.txt §4.3).

A task is one action of one stage of one pipeline. Its predecessors are the previous action of
its stage (schedule edge) and its data dependencies (plan/schedules.action_needs): forward
s-1 -> s, backward s+1 -> s, forward slice i -> i+1, backward slice i+1 -> i. A data edge that
crosses stages carries the sender's point-to-point transfer time.

One chunk through it: 1F1B on two stages, chunk 3 the second slice of a sequence whose first
slice is chunk 2.
- Stage 1's F3 waits for stage 0's F3 (data edge across stages: `cross`, plus F3's send time),
  for stage 1's F2 (the earlier slice, whose K/V it attends to: a same-stage data edge, from
  Dependencies.fwd_after) and for stage 1's previous action (schedule edge). Both same-stage
  edges land in `local`.
- Stage 1's B3 (the last stage has no cross edge for a backward) waits for the F3 it reads
  (Dependencies.bwd_needs) and the previous action; stage 1's B2 waits for B3 too (the later
  slice's gradient flows into the earlier one: Dependencies.bwd_after).
- Stage 0's B3 waits for stage 1's B3 (`cross`, plus B3's send time), its own F3 and its
  previous action.
If the schedule lists an action before one it waits for on the same stage, or never lists it,
the schedule cannot run and check_schedule raises with the step-by-rank grid.

Timing is two passes. `build_pipelines` numbers the tasks stage by stage and gives each a
*level* one above its deepest predecessor (no durations; numpy over every new schedule shape at
once, `_build_graphs`: `_flatten` numbers the actions, `_id_tables` finds each (stage, chunk)'s
task, `_cross_edges` and `_local_edges` the predecessors, `_levels` the levels). `evaluate` then
computes finish times level by level with numpy over all pipelines at once: tasks of one level
never depend on each other, so

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

from lengthwise.plan.ir import Action, Chunk
from lengthwise.plan.schedules import Dependencies, ShapeCache
from lengthwise.sim.task_graph import (KIND_CODE, _Batch, _cross_edges, _csr, _flatten, _id_tables, _IdTables,
                                      _levels, _local_edges, _reads, _reforward, _reject, _starts)

__all__ = ["KIND_CODE", "PipelineTasks", "TaskArrays", "build_pipeline", "build_pipelines", "concatenate", "evaluate"]


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
    graphs: list[PipelineTasks | None] = []
    todo: dict[_GraphKey, list[int]] = {}  # keys not cached: the specs of each
    for i, (stages, chunks, bwd, deps) in enumerate(specs):
        key = _GraphKey(_graph_key(stages, deps, len(chunks), len(chunks if bwd is None else bwd)))
        graphs.append(_GRAPHS.get(key))
        if graphs[-1] is None:
            todo.setdefault(key, []).append(i)
    built = _build_graphs([specs[at[0]] for at in todo.values()], [k.key[:2] for k in todo])
    for (key, at), graph in zip(todo.items(), built):
        _GRAPHS.put(key, graph)
        for i in at:
            graphs[i] = graph
    return graphs


class _GraphKey:
    """A `_graph_key` with its hash computed once: the key holds every action of the schedule,
    and hashing it again at each of a pipeline's cache lookups was a good part of building a
    plan's graphs."""

    __slots__ = ("key", "hash")

    def __init__(self, key: tuple):
        self.key, self.hash = key, hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _GraphKey) and self.hash == other.hash and self.key == other.key


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
    its deepest predecessor (`_levels`). A schedule runs to the end exactly when every
    predecessor exists, the same-stage ones come earlier on their stage, and the graph has no
    cycle (levels would grow past the task count); else check_schedule raises."""
    if not specs:
        return []
    batch = _flatten(specs, lowered)
    _reject(specs, batch.graph[(batch.index < 0) | (batch.index >= np.where(batch.is_bwd, batch.num_units[batch.graph],
                                                                          batch.num_chunks[batch.graph]))])
    ids = _id_tables(specs, batch)
    reforward = _reforward(batch, ids)
    cross, no_sender = _cross_edges(batch, ids)
    deps = [d for _, _, _, d in specs]
    if any((len(d.bwd_needs), len(d.bwd_after), len(d.fwd_after)) != (u, u, c)
           for d, u, c in zip(deps, batch.num_units.tolist(), batch.num_chunks.tolist())):
        raise ValueError("dependencies do not match the pipeline's chunks and backward units")
    needs = _csr([d.bwd_needs for d in deps])
    num_local, local = _local_edges(batch, ids, needs, _csr([d.bwd_after for d in deps]),
                                    _csr([d.fwd_after for d in deps]))
    owner = np.repeat(np.arange(len(batch.code)), num_local)
    late = (local < 0) | (local >= batch.task[owner])   # absent, or later on the stage: never issued
    _reject(specs, np.r_[no_sender, batch.graph[owner[late]]])
    level = _levels(batch, cross)
    _reject(specs, batch.graph[level >= batch.tasks_per_graph[batch.graph]])   # a path longer than the graph: a cycle
    columns = (batch.stage, batch.code, batch.index, reforward.astype(np.int64), cross, level)
    return _split_graphs(batch, ids, columns, num_local, local, _reads(batch, needs))


def _split_graphs(b: _Batch, ids: _IdTables, columns: tuple, num_local: np.ndarray, local: np.ndarray,
                  reads: tuple) -> list[PipelineTasks]:
    """Cut the batch's arrays into one PipelineTasks per graph (copies: a graph is cached alone)."""
    read_c, read_u, read_g = reads
    num_graphs, n = len(b.num_stages), len(b.code)
    rb = np.searchsorted(read_g, np.arange(num_graphs + 1)).tolist()
    tb = np.r_[b.graph_start, n].tolist()
    lb = np.r_[np.append(_starts(num_local), len(local))[b.graph_start], len(local)].tolist()
    fb, bb = np.r_[ids.fwd_base, len(ids.fwd)].tolist(), np.r_[ids.bwd_base, len(ids.bwd)].tolist()
    out = []
    for i in range(num_graphs):
        lo, hi = tb[i], tb[i + 1]
        stages, chunks, units = int(b.num_stages[i]), int(b.num_chunks[i]), int(b.num_units[i])
        out.append(PipelineTasks(
            columns=tuple(c[lo:hi].copy() for c in columns) + (num_local[lo:hi].copy(), local[lb[i]:lb[i + 1]].copy()),
            fwd_id=ids.fwd[fb[i]:fb[i + 1]].reshape(stages, chunks).copy(),
            first_id=ids.first[fb[i]:fb[i + 1]].reshape(stages, chunks).copy(),
            nograd_id=ids.nograd[fb[i]:fb[i + 1]].reshape(stages, chunks).copy(),
            bwd_id=ids.bwd[bb[i]:bb[i + 1]].reshape(stages, units).copy(),
            reads=(read_c[rb[i]:rb[i + 1]], read_u[rb[i]:rb[i + 1]])))
    return out


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
