"""Memory sizes by cell batched over every pipeline of a plan: where a pipeline's backward units
are not its chunks (SlimPack §4.1.2) each cell, the part of a forward chunk one backward unit
holds, is sized apart (`_MemorySizing._cell_sizes`, sim/memory_sizes.py). Those sizes are
elementwise in the cells' tokens, so they are computed here once per stage kind (tp, layers,
head) over the cells of all pipelines together and handed to each pipeline's `_cache`: the
same floats as one call per pipeline (each maximum and each chunk's sum over the same numbers
in the same order), at one numpy pass per kind instead of several per pipeline (SlimPack's
sweep simulates thousands of pipelines per candidate count).

Which pipelines take part: cp 1, backward units of their own, cells handed over in their
SliceStructure that match their slice dependencies' (chunk, unit) reads one for one
(`_MemorySizing._cells` checks the same, pipeline by pipeline, for the others), no forward
that recomputes layers, and the cost model's own byte formulas (a subclass may not be
elementwise).
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

import lengthwise.cost.memory as mem
from lengthwise.cost import CostModel
from lengthwise.plan.ir import StepPlan

_ACTION = operator.attrgetter("kind", "recompute_layers", "recompute_mlp")
CELLS = "checked cells"
"""`_cache` key of a pipeline's cells (chunk, unit, float64 tokens) once checked against its reads."""
ACTIONS = "action kinds"
"""`_cache` key of the set of (kind, recomputed layers, recomputed MLPs) of a celled pipeline's actions."""


def batched_cell_sizes(plan: StepPlan, cm: CostModel, known: list, tables: list[dict]) -> None:
    """Add to `tables[i]` (each pipeline's seed of `_PipelineCosts._cache`) its checked cells and,
    per stage kind (layers, head), ("cells batched", layers, head): (kept [cell], work [unit],
    fwork [chunk] or None off the last stage, kept summed per chunk [chunk])."""
    if (type(cm).activation_bytes_rows is not CostModel.activation_bytes_rows
            or type(cm).backward_work_bytes_rows is not CostModel.backward_work_bytes_rows):
        return
    members = []
    for i, (pipe, k) in enumerate(zip(plan.pipelines, known)):
        if pipe.backward_chunks is not None and pipe.cp <= 1 and k is not None and k.cells is not None:
            actions = tables[i][ACTIONS] = set(map(_ACTION, itertools.chain.from_iterable(pipe.stages)))
            if not any(r or m for _, r, m in actions):  # no forward recomputes layers or an MLP
                members.append(i)
    members = [i for i, ok in zip(members, _reads_match(plan, known, members)) if ok]
    kinds: dict[tuple, list[int]] = {}
    for i in members:
        pipe = plan.pipelines[i]
        c, u, n = known[i].cells
        tables[i][CELLS] = (c, u, n.astype(np.float64))
        layers = pipe.stage_layers(plan.model.num_layers)
        if len(layers) != pipe.pp or any(x < 0 for x in layers):
            continue  # _PipelineCosts reports it
        for key in dict.fromkeys((pipe.tp, x, s == pipe.pp - 1) for s, x in enumerate(layers)):
            kinds.setdefault(key, []).append(i)
    for (tp, layers, head), group in kinds.items():
        _size_kind(plan, cm, tables, group, tp, layers, head)


def _size_kind(plan: StepPlan, cm: CostModel, tables: list[dict], group: list[int], tp: int, layers: int,
               head: bool) -> None:
    """One stage kind's cell sizes over the cells of `group`'s pipelines at once (the arithmetic of
    `_MemorySizing._cell_sizes` without recomputation, elementwise)."""
    cells = [tables[i][CELLS] for i in group]
    C = np.array([len(plan.pipelines[i].chunks) for i in group], dtype=np.int64)
    U = np.array([len(plan.pipelines[i].bwd_units) for i in group], dtype=np.int64)
    n = np.array([len(c[0]) for c in cells], dtype=np.int64)
    cbase, ubase, nbase = (np.r_[0, np.cumsum(x)] for x in (C, U, n))
    chunk_of = np.concatenate([c[0] for c in cells]) + np.repeat(cbase[:-1], n)
    unit_of = np.concatenate([c[1] for c in cells]) + np.repeat(ubase[:-1], n)
    tokens = np.concatenate([c[2] for c in cells])
    kept = cm.activation_bytes_rows(tokens, layers=layers, tp=tp, head=head)
    work = np.zeros(int(ubase[-1]))
    np.maximum.at(work, unit_of, np.zeros(len(tokens)) + cm.backward_work_bytes_rows(tokens, layers=layers, tp=tp,
                                                                                      head=head))
    fwork = None
    if head:
        fwork = np.zeros(int(cbase[-1]))
        np.maximum.at(fwork, chunk_of, mem.head_forward_bytes(cm.model, tokens, tp))
    sums = np.bincount(chunk_of, weights=kept, minlength=int(cbase[-1]))
    cb, ub, nb = cbase.tolist(), ubase.tolist(), nbase.tolist()
    for k, i in enumerate(group):
        tables[i]["cells batched", layers, head] = (
            kept[nb[k]:nb[k + 1]], work[ub[k]:ub[k + 1]], None if fwork is None else fwork[cb[k]:cb[k + 1]],
            sums[cb[k]:cb[k + 1]])


def _reads_match(plan: StepPlan, known: list, members: list[int]) -> list[bool]:
    """Per member pipeline: whether its cells are its (chunk, unit) reads (each unit's
    `bwd_needs`), one cell per read, in the reads' sorted order (by chunk, then unit): the test
    of `_MemorySizing._cells`, over all members at once. A pipeline with a read or a cell out of
    its chunk and unit ranges is left out (False: `_cells` then decides it alone)."""
    if not members:
        return []
    needs = [known[i].deps.bwd_needs for i in members]
    C = np.array([len(plan.pipelines[i].chunks) for i in members], dtype=np.int64)
    U = np.array([len(x) for x in needs], dtype=np.int64)
    per_unit = np.fromiter(map(len, itertools.chain.from_iterable(needs)), dtype=np.int64, count=int(U.sum()))
    read_c = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(needs)), dtype=np.int64,
                         count=int(per_unit.sum()))
    read_u = np.repeat(np.arange(len(per_unit)) - np.repeat(np.r_[0, np.cumsum(U)[:-1]], U), per_unit)
    read_p = np.repeat(np.repeat(np.arange(len(members)), U), per_unit)
    cell_c = np.concatenate([known[i].cells[0] for i in members]).astype(np.int64)
    cell_u = np.concatenate([known[i].cells[1] for i in members]).astype(np.int64)
    n_cells = np.array([len(known[i].cells[0]) for i in members], dtype=np.int64)
    cell_p = np.repeat(np.arange(len(members)), n_cells)
    n_reads = np.bincount(read_p, minlength=len(members))
    bad = np.zeros(len(members), dtype=bool)
    for p, c, u in ((read_p, read_c, read_u), (cell_p, cell_c, cell_u)):
        outside = (c < 0) | (c >= C[p]) | (u < 0) | (u >= U[p])
        bad[p[outside]] = True
    width = int(U.max(initial=0)) + 1  # (chunk, unit) as one number, in their order, within a pipeline
    reads = read_c * width + read_u
    reads = reads[np.lexsort((reads, read_p))]                     # sorted within each pipeline
    cells = cell_c * width + cell_u
    same = ~bad & (n_reads == n_cells)
    # compare the pipelines of equal counts element by element (both are laid out pipeline by pipeline)
    mine = same[cell_p]
    differ = np.zeros(len(members), dtype=np.int64)
    np.add.at(differ, cell_p[mine], (reads[np.flatnonzero(np.repeat(same, n_reads))] != cells[mine]).astype(np.int64))
    return (same & (differ == 0)).tolist()
