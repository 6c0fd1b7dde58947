"""Cost tables batched over every pipeline of a plan: what one decoder layer is asked by each
chunk (`_Works`, exact integer sums over every segment at once), and the per-chunk compute
times, activation bytes, hand-off times and model FLOPs of every pipeline without context
parallelism, one cost-model call per stage kind over all their chunks together (elementwise:
the same floats as one call per pipeline). `_PipelineCosts` (sim/inputs.py) starts from these.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.cost.flops import HEAD_RECOMPUTE, ChunkWork, chunk_work, head_forward_flops, layer_forward_flops
from lengthwise.plan.ir import Chunk, Segment, StepPlan
from lengthwise.sim.structure import SliceStructure


def _batched_row_costs(plan: StepPlan, cm: CostModel, works, tables: list[dict]) -> None:
    """_PipelineCosts._p2p (both links) of every pipeline without CP, added to its `tables`
    entry: without CP it goes by row tokens alone, so the cost model is asked once per distinct
    row-token count of the plan (the same calls as the per-pipeline memo)."""
    by_tp: dict[int, list[int]] = {}
    for i, pipe in enumerate(plan.pipelines):
        if pipe.cp <= 1 and works[i] is not None:
            by_tp.setdefault(pipe.tp, []).append(i)
    for tp, members in by_tp.items():
        rows = [w.row_tokens for i in members for w in works[i]]   # each pipeline's chunks, then its units
        values, at = np.unique(np.concatenate(rows), return_inverse=True)
        chunks = [_row_of(r) for r in values.tolist()]
        each = {("p2p", inter): np.array([cm.p2p_time(cm.boundary_bytes(c, tp=tp, cp=1), inter_node=inter)
                                          for c in chunks], dtype=np.float64)[at] for inter in (False, True)}
        bounds = np.cumsum([0] + [len(r) for r in rows]).tolist()
        for k, i in enumerate(members):
            a, b, c = bounds[2 * k], bounds[2 * k + 1], bounds[2 * k + 2]
            for name, v in each.items():
                tables[i][name] = (v[a:b], v[b:c])


def _batched_model_flops(cm: CostModel, works) -> list[float | None]:
    """_PipelineCosts._model_flops of every pipeline with works, elementwise over all of their
    chunks at once (the same operations on the same numbers), each pipeline's then summed one by
    one in its order; None where the pipeline has no works or the cost model is not CostModel's."""
    if (type(cm).forward_flops is not CostModel.forward_flops or type(cm).backward_flops is not CostModel.backward_flops
            or all(w is None for w in works)):
        return [None] * len(works)
    L, have = cm.model.num_layers, [i for i, w in enumerate(works) if w is not None]
    fw = ChunkWork(np.concatenate([works[i][0].bare_tokens for i in have]),
                   np.concatenate([works[i][0].bare_pairs for i in have]))
    bw = ChunkWork(np.concatenate([works[i][1].bare_tokens for i in have]),
                   np.concatenate([works[i][1].bare_pairs for i in have]))
    lin, attn = layer_forward_flops(cm.model, fw)
    fwd = (L * (lin + attn) + head_forward_flops(cm.model, fw.tokens)).tolist()
    lin, attn = layer_forward_flops(cm.model, bw)
    bwd = (L * (lin * cm.bwd_linear_ratio + attn * cm.bwd_attn_ratio)
           + head_forward_flops(cm.model, bw.tokens) * (cm.bwd_linear_ratio + HEAD_RECOMPUTE)).tolist()
    fb = np.cumsum([0] + [len(works[i][0].bare_tokens) for i in have]).tolist()
    bb = np.cumsum([0] + [len(works[i][1].bare_tokens) for i in have]).tolist()
    out: list[float | None] = [None] * len(works)
    for k, i in enumerate(have):
        out[i] = sum(fwd[fb[k]:fb[k + 1]]) + sum(bwd[bb[k]:bb[k + 1]])
    return out


@dataclass(kw_only=True)
class _Works:
    """What one decoder layer is asked by each chunk of a list (chunk_work's numbers, cp = 1)."""

    tokens: list[int]
    """Tokens of each chunk, padding excluded (Chunk.num_tokens)."""
    pairs: list[int]
    """Causal attention pairs of each chunk, padding excluded (Chunk.attention_pairs)."""
    row_tokens: np.ndarray
    """float64: row tokens, padding included (chunk_work(chunk).tokens)."""
    row_keys: np.ndarray
    """float64: attention pairs, padding included (chunk_work(chunk).keys)."""
    bare_tokens: np.ndarray
    """float64: `tokens`."""
    bare_pairs: np.ndarray
    """float64: `pairs`."""
    segments: np.ndarray | None = None
    """float64: segments of each row (a profile's host floor, cost/time.py)."""


def _plan_works(plan: StepPlan, known: list[SliceStructure | None]) -> list[tuple[_Works, _Works] | None]:
    """Per pipeline, the works of its forward chunks and of its backward units, from every
    segment of the plan in one pass (numpy sums of integers, exact: the same numbers as
    Chunk.num_tokens and chunk_work, without asking each chunk; segment bounds from `known`
    where given). None for every pipeline where a sum could leave float64's exact integers
    (sequences of tens of millions of tokens)."""
    lists = [x for p in plan.pipelines for x in (p.chunks, p.bwd_units)]
    count_parts, bound_parts = [], []
    if all(k is None for k in known):  # one pass over every segment of the plan
        chunks = [c for x in lists for c in x]
        counts = np.fromiter((len(c.segments) for c in chunks), dtype=np.int64, count=len(chunks))
        count_parts.append(counts)
        bound_parts.append(np.fromiter(itertools.chain.from_iterable((s.start, s.stop) for c in chunks
                                                                     for s in c.segments),
                                       dtype=np.int64, count=2 * int(counts.sum())))
        known = []
    for pipe, k in zip(plan.pipelines, known):
        if k is not None:
            count_parts += [k.fwd_counts, k.bwd_counts]
            bound_parts += [k.fwd_bounds.ravel(), k.bwd_bounds.ravel()]
            continue
        for x in (pipe.chunks, pipe.bwd_units):
            n = np.fromiter((len(c.segments) for c in x), dtype=np.int64, count=len(x))
            count_parts.append(n)
            bound_parts.append(np.fromiter(itertools.chain.from_iterable((s.start, s.stop) for c in x
                                                                         for s in c.segments),
                                           dtype=np.int64, count=2 * int(n.sum())))
    counts = np.concatenate(count_parts).astype(np.int64) if count_parts else np.zeros(0, np.int64)
    flat = np.concatenate(bound_parts).astype(np.int64) if bound_parts else np.zeros(0, np.int64)
    start, stop = flat[0::2], flat[1::2]
    if len(stop) and (int(stop.max()) >= 2**26 or int(stop.max()) ** 2 * len(stop) >= 2**53):
        return [None] * len(plan.pipelines)
    n = len(counts)
    owner = np.repeat(np.arange(n), counts)
    tokens = np.bincount(owner, weights=stop - start, minlength=n)
    pairs = np.bincount(owner, weights=(stop * (stop + 1) - start * (start + 1)) // 2, minlength=n)
    row_tokens, row_keys = tokens.copy(), pairs.copy()
    if not known or any(k is None for k in known):  # a SliceStructure's chunks are unpadded
        chunks = [c for x in lists for c in x]
        pads = np.fromiter((c.pad_to for c in chunks), dtype=np.int64, count=n)
        for i in np.flatnonzero((pads > tokens) & (counts > 0)).tolist():  # padded rows (chunk_work)
            w = chunk_work(chunks[i])
            row_tokens[i], row_keys[i] = w.tokens, w.keys
    tokens_int, pairs_int = tokens.astype(np.int64).tolist(), pairs.astype(np.int64).tolist()
    bounds = np.cumsum([0] + [len(x) for x in lists]).tolist()
    segs = np.maximum(counts, 1).astype(np.float64)
    works = [_Works(tokens=tokens_int[a:b], pairs=pairs_int[a:b], row_tokens=row_tokens[a:b], row_keys=row_keys[a:b],
                    bare_tokens=tokens[a:b], bare_pairs=pairs[a:b], segments=segs[a:b])
             for a, b in zip(bounds[:-1], bounds[1:])]
    return [(works[2 * i], works[2 * i + 1]) for i in range(len(plan.pipelines))]


def _batched_tables(plan: StepPlan, cm: CostModel, works) -> list[dict]:
    """_PipelineCosts.per_chunk of every pipeline without CP, for all pipelines of one tp and
    stage kind (layers, head, embed) in one works_time call each (elementwise: the same floats as
    one call per pipeline). Per pipeline: {(layers, head, embed): {"fwd", "bwd", "act"}}."""
    kinds: dict[tuple, list[int]] = {}
    for i, pipe in enumerate(plan.pipelines):
        if pipe.cp > 1 or works[i] is None:
            continue
        layers = pipe.stage_layers(plan.model.num_layers)
        if len(layers) != pipe.pp or any(n < 0 for n in layers):
            continue  # _PipelineCosts reports it
        for s, n in enumerate(layers):
            members = kinds.setdefault((pipe.tp, n, s == pipe.pp - 1, s == 0), [])
            if not members or members[-1] != i:
                members.append(i)
    out: list[dict] = [{} for _ in plan.pipelines]
    for (tp, layers, head, embed), members in kinds.items():
        fw = [works[i][0] for i in members]
        bw = [works[i][1] for i in members]
        ct, ck = np.concatenate([w.row_tokens for w in fw]), np.concatenate([w.row_keys for w in fw])
        ut, uk = np.concatenate([w.row_tokens for w in bw]), np.concatenate([w.row_keys for w in bw])
        cs, us = np.concatenate([w.segments for w in fw]), np.concatenate([w.segments for w in bw])
        fwd = cm.works_time(ct, ck, layers=layers, tp=tp, head=head, embed=embed, backward=False, segments=cs)
        bwd = cm.works_time(ut, uk, layers=layers, tp=tp, head=head, embed=embed,
                            backward=True, segments=us) + 0.0  # (zero) recompute
        act = cm.activation_bytes_rows(ct, layers=layers, tp=tp, head=head)
        cb = np.cumsum([0] + [len(w.row_tokens) for w in fw]).tolist()
        ub = np.cumsum([0] + [len(w.row_tokens) for w in bw]).tolist()
        for k, i in enumerate(members):
            out[i][layers, head, embed] = {"fwd": fwd[cb[k]:cb[k + 1]], "bwd": bwd[ub[k]:ub[k + 1]],
                                    "act": act[cb[k]:cb[k + 1]]}
    return out


def _row_of(tokens: float) -> Chunk:
    """A one-segment chunk of `tokens` row tokens: what a memo keyed by row tokens asks the
    cost model on a miss (boundary and loss-backward bytes go by row tokens alone without CP),
    so the pipeline's own chunks need not be looked at."""
    return Chunk((Segment(0, 0, int(tokens)),))
