"""PipelineInputs of many pipelines built together: SlimPack's sweep simulates every pipeline
of every candidate count, and `_PipelineCosts.build` (sim/inputs.py) spent some 130 us of
Python per pipeline putting its per-stage rows together. Here the rows of all such pipelines
are laid out at once with numpy (durations, hand-off times, memory sizes), each pipeline
getting views of the plan-wide arrays: the same numbers in the same places as `build` writes
them, from the same batched tables (sim/plan_costs.py, sim/cell_costs.py).

Which pipelines: cp 1, split sequences known as arrays, every stage's tables batched, no
forward that recomputes and no no-grad forward, and no host floor in the cost model's profile
(its overlap factor rescales a stage's times); either CELLED (backward units of their own,
sized by `batched_cell_sizes`) or PLAIN (the chunks are the units, the cost model's own byte
formulas). Every other pipeline is built by `build` as before.

K/V sizes per split sequence are handed over as rows (`MemorySizes.kv_rows`, the engine's
read) and as `SplitKV` mappings, which make their {sequence: bytes} dict only if asked.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping

import numpy as np

import lengthwise.cost.memory as mem
from lengthwise.cost import CostModel
from lengthwise.plan.ir import BACKWARD, FORWARD, StepPlan
from lengthwise.sim.action_times import B, F, N
from lengthwise.sim.cell_costs import ACTIONS, CELLS
from lengthwise.sim.memory import MemorySizes, SplitArrays
from lengthwise.sim.memory_sizes import head_reduce_scatter_work, last_cell, layer_rows_moment
from lengthwise.sim.pipeline_input import PipelineInput
from lengthwise.sim.step_costs import heterogeneous

_ACTION = operator.attrgetter("kind", "recompute_layers", "recompute_mlp")
_ACTIONS = {(FORWARD, 0, 0), (BACKWARD, 0, 0)}
"""The actions this module builds for: forwards and backwards recomputing nothing."""


class SplitKV(Mapping):
    """{split sequence id: bytes} of one stage, as `_MemorySizing._kv_sizes` gives it, kept as
    the pipeline's sequence ids and their row; the dict is made on first use."""

    def __init__(self, seq_id: np.ndarray, row: np.ndarray):
        self._seq_id, self._row, self._dict = seq_id, row, None

    def _table(self) -> dict:
        if self._dict is None:
            self._dict = dict(zip(self._seq_id.tolist(), self._row.tolist()))
        return self._dict

    def __getitem__(self, key):
        return self._table()[key]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._seq_id)


def celled_inputs(plan: StepPlan, cm: CostModel, offsets: list[int], known: list, works: list, tables: list[dict],
                  flops: list, stage_costs) -> dict:
    """{pipeline: PipelineInput} for the pipelines this module builds (see its docstring);
    `stage_costs(i)`: a `_PipelineCosts` of pipeline i, asked for the per-shape step terms
    (states, gradient reduction, optimizer step), which every pipeline of a shape shares."""
    if type(cm).kv_bytes is not CostModel.kv_bytes:
        return {}
    modes = [_mode(plan, cm, i, known[i], tables[i]) if flops[i] is not None else None
             for i in range(len(plan.pipelines))]
    todo = [i for i, mode in enumerate(modes) if mode is not None]
    if not todo:
        return {}
    pipes = [plan.pipelines[i] for i in todo]
    S = np.array([p.pp for p in pipes], dtype=np.int64)
    C = np.array([len(p.chunks) for p in pipes], dtype=np.int64)
    U = np.array([len(p.bwd_units) for p in pipes], dtype=np.int64)
    W = np.maximum(np.maximum(C, U), 1)
    layers = [p.stage_layers(plan.model.num_layers) for p in pipes]
    _plain_rows(cm, [(i, p, n) for i, p, n in zip(todo, pipes, layers) if modes[i] == PLAIN], works, tables)
    rows = [_stage_rows(tables[i], modes[i], p, n) for i, p, n in zip(todo, pipes, layers)]
    dur, send = _action_tables(plan, offsets, todo, pipes, layers, tables, S, C, U, W)
    comm = np.zeros(len(dur))
    steps = _step_terms(todo, pipes, layers, stage_costs)
    work0 = _embedding_work(cm, todo, pipes, layers, tables, rows, steps, heterogeneous(plan))
    kv = _kv_rows(cm, todo, pipes, layers, known)
    bounds = np.r_[0, np.cumsum(S * 3 * W)].tolist()
    out = {}
    for k, (i, pipe) in enumerate(zip(todo, pipes)):
        shape = (int(S[k]), 3, int(W[k]))
        state, grads, sync, end = steps[pipe.tp, tuple(layers[k])]
        sizes = _sizes(cm, pipe, layers[k], rows[k], known[i].splits, kv[k], state, grads, work0[k])
        sizes.backward_work[-1] = _head_reduce_scatter(plan, cm, pipe, layers[k][-1], sizes.backward_work[-1],
                                                       tables[i].get(CELLS) if modes[i] == CELLED else None,
                                                       works[i][1].row_tokens if modes[i] == PLAIN else None)
        out[i] = PipelineInput(stages=pipe.stages, chunks=pipe.chunks, backward_chunks=pipe.backward_chunks,
                               dur=dur[bounds[k]:bounds[k + 1]].reshape(shape),
                               comm=comm[bounds[k]:bounds[k + 1]].reshape(shape),
                               send=send[bounds[k]:bounds[k + 1]].reshape(shape), sizes=sizes,
                               grad_sync=list(sync), step_end=None if end is None else list(end),
                               extra_comm=pipe.extra_comm_s, model_flops=flops[i], num_gpus=pipe.num_gpus,
                               deps=known[i].deps, splits=known[i].splits)
    return out


CELLED, PLAIN = "celled", "plain"
"""The two kinds of pipeline built here: backward units of their own (memory by cell), or the
chunks as their units (memory by chunk)."""


def _mode(plan: StepPlan, cm: CostModel, i: int, known, table: dict) -> str | None:
    """CELLED, PLAIN, or None for a pipeline `_PipelineCosts.build` makes (module docstring)."""
    pipe = plan.pipelines[i]
    if pipe.cp > 1 or known is None or not isinstance(known.splits, SplitArrays):
        return None
    fit = cm.profile.fit_for(pipe.tp, 1) if cm.profile else None
    if fit is not None and fit.has_floor:
        return None
    layers = pipe.stage_layers(plan.model.num_layers)
    kinds = [(n, s == pipe.pp - 1, s == 0) for s, n in enumerate(layers)]
    if not all(k in table for k in kinds) or not all(("p2p", inter) in table for inter in (False, True)):
        return None
    if CELLS in table:
        ok = all(("cells batched", n, head) in table for n, head, _ in kinds) and table[ACTIONS] <= _ACTIONS
        return CELLED if ok else None
    if pipe.backward_chunks is not None or any(getattr(type(cm), name) is not getattr(CostModel, name)
                                               for name in ("backward_work_bytes", "head_forward_bytes")):
        return None
    return PLAIN if set(map(_ACTION, itertools.chain.from_iterable(pipe.stages))) <= _ACTIONS else None


def _plain_rows(cm: CostModel, members: list, works: list, tables: list[dict]) -> None:
    """Per stage kind (layers, head), the backward working sets [unit] and the head forward's
    [chunk] (last stage) of every PLAIN pipeline, one elementwise call per kind over all of
    their rows (`_MemorySizing._working_sets`), into tables[i]["plain batched", layers, head]."""
    kinds: dict[tuple, list[int]] = {}
    for i, pipe, layers in members:
        for key in dict.fromkeys((pipe.tp, n, s == pipe.pp - 1) for s, n in enumerate(layers)):
            kinds.setdefault(key, []).append(i)
    for (tp, n, head), group in kinds.items():
        units = [works[i][1].row_tokens for i in group]
        work = cm.backward_work_bytes_rows(np.concatenate(units), layers=n, tp=tp, head=head)
        ub = np.r_[0, np.cumsum([len(u) for u in units])].tolist()
        fwork, cb = None, None
        if head:
            rows = [works[i][0].row_tokens for i in group]
            fwork = mem.head_forward_bytes(cm.model, np.concatenate(rows), tp)
            cb = np.r_[0, np.cumsum([len(r) for r in rows])].tolist()
        for k, i in enumerate(group):
            tables[i]["plain batched", n, head] = (work[ub[k]:ub[k + 1]],
                                                   None if fwork is None else fwork[cb[k]:cb[k + 1]])


def _stage_rows(table: dict, mode: str, pipe, layers: list[int]) -> list[tuple]:
    """Per stage (kept activations [chunk], backward working sets [unit], head forward's
    [chunk] or None, cells' activations [cell] or None)."""
    out = []
    for s, n in enumerate(layers):
        head = s == pipe.pp - 1
        if mode == CELLED:
            kept, work, fwork, sums = table["cells batched", n, head]
            out.append((sums, work, fwork, kept))
        else:
            work, fwork = table["plain batched", n, head]
            out.append((table[n, head, s == 0]["act"], work, fwork, None))
    return out


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices start, start + 1, ..., start + length - 1 of every span, end to end."""
    within = np.arange(int(lengths.sum())) - np.repeat(np.r_[0, np.cumsum(lengths)[:-1]], lengths)
    return np.repeat(starts, lengths) + within


def _action_tables(plan, offsets, todo, pipes, layers, tables, S, C, U, W) -> tuple[np.ndarray, np.ndarray]:
    """Every pipeline's `dur` and `send` [stage, kind, index], flattened end to end: forward and
    no-grad rows the stage's forward times, backward rows its backward times; sends the hand-off
    over the link to the next stage (forward rows) and from it (the next stage's backward rows)."""
    base = np.r_[0, np.cumsum(S * 3 * W)[:-1]]
    pipe_of = np.repeat(np.arange(len(pipes)), S)
    stage = np.arange(int(S.sum())) - np.repeat(np.r_[0, np.cumsum(S)[:-1]], S)
    row = base[pipe_of] + stage * 3 * W[pipe_of]          # each (pipeline, stage)'s block
    c, u = C[pipe_of], U[pipe_of]
    fwd, bwd, fsend, bsend = [], [], [], []
    per_node = plan.cluster.gpus_per_node
    for k, (i, pipe) in enumerate(zip(todo, pipes)):
        n, width = layers[k], pipe.tp * pipe.cp
        for s in range(pipe.pp):
            t = tables[i][n[s], s == pipe.pp - 1, s == 0]
            fwd.append(t["fwd"])
            bwd.append(t["bwd"])
            if s + 1 < pipe.pp:  # _ActionTimes.link_inter: stage s's first GPU and s + 1's last
                lo, hi = offsets[i] + s * width, offsets[i] + (s + 2) * width - 1
                f, b = tables[i]["p2p", lo // per_node != hi // per_node]
                fsend.append(f)
                bsend.append(b)
    total = int(base[-1] + S[-1] * 3 * W[-1])
    dur, send = np.zeros(total), np.zeros(total)
    fwd, bwd = np.concatenate(fwd), np.concatenate(bwd)
    dur[_spans(row + F * W[pipe_of], c)] = fwd
    dur[_spans(row + N * W[pipe_of], c)] = fwd
    dur[_spans(row + B * W[pipe_of], u)] = bwd
    inner = stage < S[pipe_of] - 1                      # stages with a next one
    if inner.any():
        fsend, bsend = np.concatenate(fsend), np.concatenate(bsend)
        send[_spans(row[inner] + F * W[pipe_of][inner], c[inner])] = fsend
        send[_spans(row[inner] + N * W[pipe_of][inner], c[inner])] = fsend
        nxt = row[inner] + 3 * W[pipe_of][inner]          # the next stage's block
        send[_spans(nxt + B * W[pipe_of][inner], u[inner])] = bsend
    return dur, send


def _step_terms(todo, pipes, layers, stage_costs) -> dict:
    """{(tp, stage layers): (states less gradients, gradients, gradient reduction, optimizer
    step)} from one pipeline of each shape (`_MemorySizing._sizes`' and `build`'s own calls)."""
    out = {}
    for k, (i, pipe) in enumerate(zip(todo, pipes)):
        key = (pipe.tp, tuple(layers[k]))
        if key not in out:
            costs = stage_costs(i)
            states, grads = costs._states()
            if costs.cm.grads_held_all_step:
                grads = [0.0] * pipe.pp
            out[key] = ([a - g for a, g in zip(states, grads)], grads, costs._grad_sync(), costs._step_end())
    return out


def _embedding_work(cm: CostModel, todo, pipes, layers, tables, rows, steps, hetero: bool) -> list:
    """Per pipeline, the first stage's backward working sets with the embedding's backward
    (`_MemorySizing._embedding_backward`), all pipelines at once: the table's bf16 gradient
    beside everything each unit has not freed by then (all but its smallest cell's activations,
    or its chunk's), and the stage's gradients at its first backward. A pipeline whose first
    stage runs no backward keeps its working sets."""
    table = mem.embedding_backward_bytes(cm.model)
    firsts, works, released, extra = [], [], [], []
    celled = [k for k, r in enumerate(rows) if r[0][3] is not None]
    freed = dict(zip(celled, _smallest_cells([tables[todo[k]][CELLS][1] for k in celled],
                                            [rows[k][0][3] for k in celled], [len(rows[k][0][1]) for k in celled])))
    for k, pipe in enumerate(pipes):
        firsts.append(next((a.chunk for a in pipe.stages[0] if a.kind == BACKWARD), None))
        act, work, _, _ = rows[k][0]
        works.append(work)
        released.append(freed[k] if k in freed else act)
        extra.append(steps[pipe.tp, tuple(layers[k])][1][0] - (table if hetero else 0.0))
    lengths = np.array([len(w) for w in works], dtype=np.int64)
    base = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
    rel = np.concatenate(released)
    end = table - rel - np.zeros(len(rel))
    ran = [k for k, f in enumerate(firsts) if f is not None]
    end[base[ran] + np.array([firsts[k] for k in ran], dtype=np.int64)] += np.array([extra[k] for k in ran],
                                                                                     dtype=np.float64)
    out = np.maximum(np.concatenate(works), end)
    return [out[b:b + n] if f is not None else w
            for b, n, f, w in zip(base.tolist(), lengths.tolist(), firsts, works)]


def _smallest_cells(units: list, kept: list, sizes: list[int]) -> list:
    """Per pipeline [unit] its smallest cell's activations (0 for a unit without cells), by one
    minimum over every pipeline's cells."""
    if not units:
        return []
    base = np.r_[0, np.cumsum(sizes)].astype(np.int64)
    low = np.full(int(base[-1]), np.inf)
    np.minimum.at(low, np.concatenate(units) + np.repeat(base[:-1], [len(u) for u in units]), np.concatenate(kept))
    low[~np.isfinite(low)] = 0.0
    return [low[a:b] for a, b in zip(base[:-1].tolist(), base[1:].tolist())]


def _kv_rows(cm: CostModel, todo, pipes, layers, known) -> list[dict]:
    """Per pipeline {stage layers: K/V bytes of each split sequence}, kv_bytes elementwise over
    every pipeline's contexts at once (one call per layer count and tp)."""
    out = [dict() for _ in todo]
    groups: dict[tuple, list[int]] = {}
    for k, pipe in enumerate(pipes):
        for n in dict.fromkeys(layers[k]):
            groups.setdefault((n, pipe.tp, pipe.cp), []).append(k)
    for (n, tp, cp), members in groups.items():
        contexts = [known[todo[k]].splits.context for k in members]
        each = np.asarray(cm.kv_bytes(np.concatenate(contexts), layers=n, tp=tp, cp=cp), dtype=np.float64)
        bounds = np.r_[0, np.cumsum([len(x) for x in contexts])].tolist()
        for j, k in enumerate(members):
            out[k][n] = each[bounds[j]:bounds[j + 1]]
    return out


def _head_reduce_scatter(plan: StepPlan, cm: CostModel, pipe, L: int, work, cells, unit_tokens):
    """The last stage's working sets [unit] with the head unit's reduce-scatter in its last B
    (`memory_sizes.head_reduce_scatter_work`), from its last cell's rows (CELLED) or the unit's
    (PLAIN); nothing here recomputes."""
    def layer_moment(u: int) -> float:
        rows = cells[2][last_cell(cells, u):][:1] if cells is not None else np.asarray(unit_tokens)[u:u + 1]
        return float(layer_rows_moment(cm, np.asarray(rows, dtype=np.float64), L, pipe.tp)[0])

    if not len(work):
        return work
    return head_reduce_scatter_work(cm, pipe, work, layers=L, zero=plan.zero, shards=sum(p.cp for p in plan.pipelines),
                                    hetero=heterogeneous(plan), layer_moment=layer_moment)


def _sizes(cm: CostModel, pipe, layers: list[int], rows: list[tuple], splits: SplitArrays, kv: dict, state, grads,
           work0) -> MemorySizes:
    """The pipeline's MemorySizes as `_MemorySizing._sizes` makes them (by cell, or by chunk)."""
    S, C = pipe.pp, len(pipe.chunks)
    zeros = np.zeros(C)
    zeros.flags.writeable = False
    work = [r[1] for r in rows]
    if S:
        work[0] = work0
    return MemorySizes(state=list(state), grads=list(grads), activation=[r[0] for r in rows],
                       recompute_extra=[zeros] * S, nograd_transient=[zeros] * S,
                       kv=[SplitKV(splits.seq_id, kv[n]) for n in layers],
                       kv_grad=[SplitKV(splits.seq_id, kv[n]) for n in layers], backward_work=work,
                       forward_work=[zeros if r[2] is None else r[2] for r in rows],
                       cell_activation=[r[3] for r in rows] if rows and rows[0][3] is not None else [],
                       kv_rows=[kv[n] for n in layers], nograd_held=cm.nograd_keeps_graph)
