"""Memory events of every pipeline of a plan at once: `memory.memory_events`' events, the same
values in the same per-pipeline order, built part by part over all pipelines with numpy instead
of pipeline by pipeline (the simulator's path; `memory_events` is the one-pipeline reference).

Its own module because the flattened [pipeline, stage, chunk or unit] index arithmetic it needs
is long and shares nothing with the one-pipeline code but the sizes it reads and the no-grad
release rule (`memory.nograd_ends`).
"""

from __future__ import annotations

import numpy as np

from lengthwise.sim.dag import PipelineTasks
from lengthwise.sim.memory import MemorySizes, nograd_ends, split_arrays


def plan_memory_events(pipes: list[PipelineTasks], all_sizes: list[MemorySizes], all_splits: list, offsets: list[int]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """memory_events of every pipeline at once, task ids shifted by `offsets` (each pipeline's
    first task): the same events with the same values, each pipeline's in the same relative
    order (replay's stable sort then sums them in the same order), built part by part over all
    pipelines with numpy instead of pipeline by pipeline."""
    P = len(pipes)
    if P == 0:
        return np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0)
    ids = [_id_arrays(t) for t in pipes]
    S = np.array([f.shape[0] for f, _, _, _ in ids], dtype=np.int64)
    C = np.array([f.shape[1] for f, _, _, _ in ids], dtype=np.int64)
    U = np.array([b.shape[1] for _, _, _, b in ids], dtype=np.int64)
    off = np.asarray(offsets[:P], dtype=np.int64)
    fsize, bsize = S * C, S * U
    fbase, bbase = _starts(fsize), _starts(bsize)
    # [pipeline, stage, chunk] and [pipeline, stage, unit] tables, flattened, global task ids
    fwd = np.concatenate([f.ravel() for f, _, _, _ in ids]) + np.repeat(off, fsize)
    first = np.concatenate([f.ravel() for _, f, _, _ in ids]) + np.repeat(off, fsize)
    nograd_local = np.concatenate([n.ravel() for _, _, n, _ in ids])
    nograd = nograd_local + np.repeat(off, fsize)
    bwd = np.concatenate([b.ravel() for _, _, _, b in ids]) + np.repeat(off, bsize)
    act = _rows([sz.activation for sz in all_sizes], fsize)
    extra = _rows([sz.recompute_extra for sz in all_sizes], fsize)
    transient = _rows([sz.nograd_transient for sz in all_sizes], fsize)
    work = _rows([sz.backward_work if len(sz.backward_work) else None for sz in all_sizes], bsize)
    fwork = _rows([sz.forward_work if len(sz.forward_work) else None for sz in all_sizes], fsize)
    # (chunk, unit) reads (deps_users, by chunk then unit: each graph's `reads`), stage by stage
    # within each pipeline
    pc = np.concatenate([t.reads[0] for t in pipes])
    pu = np.concatenate([t.reads[1] for t in pipes])
    n = np.array([len(t.reads[0]) for t in pipes], dtype=np.int64)
    pipe, s, k = _by_stage(S, n)
    k += np.repeat(_starts(n), S * n)
    cidx = fbase[pipe] + s * C[pipe] + pc[k]
    uidx = bbase[pipe] + s * U[pipe] + pu[k]
    release = np.full(len(fwd), -1, dtype=np.int64)
    np.maximum.at(release, cidx, bwd[uidx])  # last backward reading the chunk
    read = release >= 0
    ran = nograd_local >= 0
    if any(len(sz.cell_activation) for sz in all_sizes):  # cells freed one by one (memory_events)
        freed = _cell_releases(pipe, s, k - _starts(n)[pipe], n, cidx, uidx, act, bwd, release, all_sizes)
    else:
        freed = (release[read], True, -act[read])
    parts = [(fwd[read], False, act[read]), freed,
             (bwd[uidx], False, extra[cidx]), (bwd[uidx], True, -extra[cidx]),
             (nograd[ran], False, transient[ran]), (_nograd_released(fwd, nograd, ran, all_sizes, fsize), True,
                                                      -transient[ran]),
             (bwd, False, work), (bwd, True, -work), (fwd, False, fwork), (fwd, True, -fwork),
             _first_backward_grads(S, U, bbase, bwd, all_sizes)]
    parts.append(_plan_split_events(S, C, U, fbase, bbase, first, bwd, all_sizes, all_splits))
    task = np.concatenate([p[0] for p in parts])
    at_end = np.concatenate([p[1] if isinstance(p[1], np.ndarray) else np.full(len(p[0]), p[1]) for p in parts])
    delta = np.concatenate([np.asarray(p[2], dtype=np.float64) for p in parts])
    keep = delta != 0
    return task[keep], at_end[keep], delta[keep]


def _nograd_released(fwd, nograd, ran, all_sizes, fsize) -> np.ndarray:
    """The task at whose end each N's bytes are freed (global ids, the Ns that ran, in order):
    its own, or the stage's next forward where the pipeline's sizes say `nograd_held`."""
    held = np.repeat(np.array([sz.nograd_held for sz in all_sizes], dtype=bool), fsize)[ran]
    if not held.any():
        return nograd[ran]
    ends = nograd[ran].copy()
    ends[held] = nograd_ends(fwd, ends[held])
    return ends


def _cell_releases(pipe, s, local, n, cidx, uidx, act, bwd, release, all_sizes):
    """The frees of the reads' activations, read by read (by pipeline, stage, chunk, then unit;
    `local`: each read's index among its pipeline's `n` reads): a cell's bytes at the end of its
    unit's B where the pipeline has cells, else each chunk's whole at its last read's position,
    at the latest of its reads' backwards (memory_events' events, in its order)."""
    celled = np.array([len(sz.cell_activation) > 0 for sz in all_sizes], dtype=bool)[pipe]
    last = np.r_[cidx[1:] != cidx[:-1], True] if len(cidx) else np.zeros(0, dtype=bool)
    keep = celled | last
    values = np.zeros(len(cidx))
    # every pipeline's [stage, read] cell table, flattened end to end: read i of a celled
    # pipeline p is entry (s, local) of p's table
    rows = [np.asarray(row, dtype=np.float64).ravel() for sz in all_sizes for row in sz.cell_activation]
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    per = np.fromiter((len(sz.cell_activation) for sz in all_sizes), dtype=np.int64, count=len(all_sizes))
    sizes = np.bincount(np.repeat(np.arange(len(all_sizes)), per), weights=lengths, minlength=len(all_sizes))
    at = np.flatnonzero(celled)
    values[at] = np.concatenate(rows)[_starts(sizes.astype(np.int64))[pipe[at]] + s[at] * n[pipe[at]] + local[at]]
    amount = np.where(celled, -values, -act[cidx])
    task = np.where(celled, bwd[uidx], release[cidx])
    return task[keep], True, amount[keep]


def _first_backward_grads(S, U, bbase, bwd, all_sizes) -> tuple[np.ndarray, bool, np.ndarray]:
    """The gradients' allocation at the end of each stage's first B, every pipeline's stages
    in order (none where a pipeline has no backward unit or no gradient sizes)."""
    wanted = [p for p, sz in enumerate(all_sizes) if len(sz.grads) and U[p]]
    if not wanted:
        return np.zeros(0, np.int64), True, np.zeros(0)
    # each (pipeline, stage) row of `bwd` is U[p] tasks; the rows of the pipelines with units
    # lie end to end, so one reduceat takes every row's first backward
    some = np.flatnonzero(U > 0)
    pipe, s, _ = _by_stage(S[some], np.ones(len(some), dtype=np.int64))
    firsts = np.minimum.reduceat(bwd, bbase[some][pipe] + s * U[some][pipe]) if len(pipe) else np.zeros(0, np.int64)
    keep = np.isin(some, wanted)[pipe]
    grads = np.concatenate([np.asarray(all_sizes[p].grads, dtype=np.float64) for p in wanted])
    return firsts[keep], True, grads


def _starts(sizes: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def _by_stage(S: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For blocks of S[p] x n[p] entries (stage-major): each entry's block, stage, and index
    within the stage (0..n[p]-1)."""
    sizes = S * n
    pipe = np.repeat(np.arange(len(S)), sizes)
    j = np.arange(int(sizes.sum())) - np.repeat(_starts(sizes), sizes)
    width = np.maximum(n[pipe], 1)
    return pipe, j // width, j % width


def _rows(tables: list, sizes: np.ndarray) -> np.ndarray:
    """[pipeline][stage][i] numbers (None: zeros), flattened."""
    out = []
    for rows, size in zip(tables, sizes.tolist()):
        if rows is None:
            out.append(np.zeros(size))
        else:
            out += rows
    return np.concatenate(out, dtype=np.float64) if out else np.zeros(0)


def _id_arrays(t: PipelineTasks) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(fwd_id, first_id, nograd_id, bwd_id), int64 [stage, chunk or unit] each."""
    return t.id_arrays


def _looked_up(tables: list[dict], ids: list[int], like: tuple | None = None) -> list[np.ndarray]:
    """[stage] float64 [split] each table's bytes of each split sequence (0 where absent), one
    pass per distinct table: stages of one layer count share theirs. `like`: (tables, rows)
    already looked up, reused for an equal table (the same numbers)."""
    done: dict[int, np.ndarray] = {}
    out = []
    for s, table in enumerate(tables):
        row = done.get(id(table))
        if row is None:
            if like is not None and table == like[0][s]:
                row = like[1][s]
            else:
                row = np.array([table.get(q, 0.0) for q in ids], dtype=np.float64)
            done[id(table)] = row
        out.append(row)
    return out


def _plan_split_events(S, C, U, fbase, bbase, first, bwd, all_sizes, all_splits):
    """_split_events of every pipeline (global task ids), in the same per-pipeline order."""
    all_splits = [split_arrays(x) for x in all_splits]
    Q = np.array([len(x) for x in all_splits], dtype=np.int64)
    if not Q.any():
        return np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0)
    cat = lambda name: np.concatenate([getattr(x, name) for x in all_splits]).astype(np.int64)
    slices, holders, slice_c, slice_tokens = cat("slices"), cat("holders"), cat("slice_chunk"), cat("slice_tokens")
    holder_u, context = cat("holder_unit"), np.maximum(cat("context"), 1)
    nsplits = len(slices)
    qstart = _starts(Q)
    split_pipe = np.repeat(np.arange(len(Q)), Q)
    # [pipeline, stage, split] K/V and K/V-gradient bytes
    kv, grad = [], []
    for sz, x in zip(all_sizes, all_splits):
        if not len(x):
            continue
        if sz.kv_rows is not None and all(len(row) == len(x) for row in sz.kv_rows):
            kv += sz.kv_rows
            grad += sz.kv_rows
            continue
        rows = _looked_up(sz.kv, x.seq_id.tolist())
        kv += rows
        grad += _looked_up(sz.kv_grad, x.seq_id.tolist(), like=(sz.kv, rows))
    kv, grad = np.concatenate(kv), np.concatenate(grad)
    qsbase = _starts(S * Q)
    # last and first backward of each split sequence, per stage: its holders stage by stage
    H = np.bincount(split_pipe, weights=holders, minlength=len(Q)).astype(np.int64)
    pipe, s, h = _by_stage(S, H)
    h += np.repeat(_starts(H), S * H)
    holder_q = np.repeat(np.arange(nsplits), holders)
    b = bwd[bbase[pipe] + s * U[pipe] + holder_u[h]]
    group = qsbase[pipe] + s * Q[pipe] + (holder_q[h] - qstart[pipe])
    at = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    last_b, first_b = np.maximum.reduceat(b, at), np.minimum.reduceat(b, at)
    # each earlier slice's share of the K/V, per stage
    NS = np.bincount(split_pipe, weights=slices, minlength=len(Q)).astype(np.int64)
    pipe, s, i = _by_stage(S, NS)
    i += np.repeat(_starts(NS), S * NS)
    slice_q = np.repeat(np.arange(nsplits), slices)
    q = slice_q[i]
    kvi = qsbase[pipe] + s * Q[pipe] + (q - qstart[pipe])
    shares = kv[kvi] * slice_tokens[i] / context[q]
    task_slice = first[fbase[pipe] + s * C[pipe] + slice_c[i]]
    # freed K/V: the shares summed one by one in slice order (a sequential running sum per row)
    rank = np.arange(len(i)) - np.repeat(np.flatnonzero(np.r_[True, kvi[1:] != kvi[:-1]]),
                                         np.diff(np.r_[np.flatnonzero(np.r_[True, kvi[1:] != kvi[:-1]]), len(i)]))
    grid = np.zeros((len(kv), int(slices.max(initial=0)) or 1))
    grid[kvi, rank] = shares
    freed = -np.cumsum(grid, axis=1)[:, -1]
    # columns of one stage: per split its slices, then the K/V release, gradient allocation
    # and release; rows stage by stage
    W = Q * 3 + NS
    pipe, s, col = _by_stage(S, W)
    per_q = slices + 3
    col_q = np.repeat(np.arange(nsplits), per_q)
    within = np.arange(int(per_q.sum())) - np.repeat(_starts(per_q), per_q)
    col += np.repeat(_starts(W), S * W)
    cq, cw = col_q[col], within[col]
    kq = qsbase[pipe] + s * Q[pipe] + (cq - qstart[pipe])
    is_slice = cw < slices[cq]
    kind = np.where(is_slice, 0, cw - slices[cq] + 1)  # 0 slice, 1 K/V release, 2 gradient, 3 its release
    # the slice's entry among `shares`: rows of (pipeline, stage), slices of the pipeline in order
    sl = _starts(slices)[cq] + np.minimum(cw, np.maximum(slices[cq] - 1, 0))
    share_row = _starts(S * NS)[pipe] + s * NS[pipe] + (sl - _starts(NS)[pipe])
    share_row = np.where(is_slice, share_row, 0)
    task = np.where(is_slice, task_slice[share_row] if len(task_slice) else 0,
                    np.where(kind == 2, first_b[kq], last_b[kq]))
    delta = np.where(is_slice, shares[share_row] if len(shares) else 0.0,
                     np.where(kind == 1, freed[kq], np.where(kind == 2, grad[kq], -grad[kq])))
    return task.astype(np.int64), (kind == 1) | (kind == 3), delta
