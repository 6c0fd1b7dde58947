"""What the simulator needs of each pipeline: its schedule, every action's duration and transfer
time, and its memory sizes — from a StepPlan and the cost model, or from raw forward times.

GPU placement (for choosing intra- or inter-node links): pipelines take GPUs in order; pipeline
p's stage s holds GPUs [offset_p + s*tp*cp, offset_p + (s+1)*tp*cp), node = gpu // gpus_per_node.
Context-parallel K/V exchange of SHARDED segments is paid inside the action: the all-gather
in F and N (cm.cp_comm_time), the reduce-scatter of the K/V gradients in B
(cm.cp_grad_comm_time: the executor keeps the gathered K/V from the forward); the
point-to-point hand-off between stages is an edge delay.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

import numpy as np

import lengthwise.cost.memory as mem
from lengthwise.cost import CostModel
from lengthwise.cost.flops import HEAD_RECOMPUTE, ChunkWork, chunk_work, head_forward_flops, layer_forward_flops, work_key
from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD, Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.plan.schedules import SCHEDULE_NAMES, Dependencies, dependencies, make_schedule
from lengthwise.sim.terms import host_overlap
from lengthwise.sim.memory import MemorySizes, SplitArrays, SplitSequence, split_sequences

F, N, B = 0, 1, 2
_VECTORISED = ("forward_time", "backward_time", "activation_bytes")
"""CostModel methods _each evaluates for all chunks at once when cp = 1 (CostModel.works_time)."""


@dataclass(kw_only=True)
class PipelineInput:
    """One pipeline ready to simulate."""

    stages: list
    """Per-stage action lists."""
    chunks: list[Chunk]
    """Forward chunks (F and N index these)."""
    backward_chunks: list[Chunk] | None
    """Backward units when they differ from the chunks (SlimPack §4.1.2)."""
    dur: np.ndarray
    """float64 [stage, kind F/N/B, index] duration of each action, CP communication included."""
    comm: np.ndarray
    """float64 [stage, kind, index] the part of `dur` that is context-parallel communication."""
    send: np.ndarray
    """float64 [stage, kind, index] point-to-point time of the action's output to the next
    stage (F, N) or the previous one (B)."""
    sizes: MemorySizes
    """Memory sizes (bytes, or forward-time units in the direct mode)."""
    grad_sync: list[float]
    """[stage] data-parallel gradient reduction time."""
    step_end: list[float] | None = None
    """[stage] gradient norm and optimizer step after the reduction (CostModel.step_end_time;
    None: none, as the analytic model and the direct mode)."""
    extra_comm: float = 0.0
    """Pipeline communication charged after everything else (PipelinePlan.extra_comm_s)."""
    model_flops: float = 0.0
    """Forward + backward FLOPs of the pipeline's tokens, padding and recomputation excluded."""
    num_gpus: int = 1
    """GPUs of the pipeline (tp * cp * pp)."""
    deps: Dependencies | None = None
    """The chunks' slice dependencies when already derived (else the engine derives them)."""
    splits: list[SplitSequence] | SplitArrays | None = None
    """split_sequences of the chunks when already derived (else the engine derives them)."""


@dataclass(frozen=True, kw_only=True)
class SliceStructure:
    """What the simulator would otherwise read off one pipeline's segments, handed over by a
    planner that knows it from its own cuts: the slice dependencies, the split sequences and
    every segment's token range. Its chunks must be unpadded (pad_to 0)."""

    deps: Dependencies
    """dependencies(chunks, backward_chunks)."""
    splits: SplitArrays
    """split_sequences(chunks, backward units), as arrays."""
    fwd_counts: np.ndarray
    """int64 [chunk] segments of each forward chunk."""
    fwd_bounds: np.ndarray
    """int64 [segment, 2] (start, stop) of every forward segment, chunk by chunk, in order."""
    bwd_counts: np.ndarray
    """int64 [unit] segments of each backward unit."""
    bwd_bounds: np.ndarray
    """int64 [segment, 2] (start, stop) of every backward segment, unit by unit, in order."""
    cells: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """(chunk, unit, tokens) int64 arrays of every cell, the part of a forward chunk one backward
    unit holds, by chunk then unit (the order of the (chunk, unit) reads), where the backward
    units are not the chunks; None: read off the segments when needed."""


def plan_inputs(plan: StepPlan, cm: CostModel,
                known: list[SliceStructure | None] | None = None) -> list[PipelineInput]:
    """PipelineInputs of every pipeline of a plan, GPUs assigned in pipeline order. `known`: per
    pipeline its SliceStructure where the caller has it (None: derived from the segments)."""
    offsets = np.cumsum([0] + [p.num_gpus for p in plan.pipelines]).tolist()
    if offsets[-1] > plan.cluster.num_gpus:
        raise UserError(f"the plan's pipelines use {offsets[-1]} GPUs but cluster {plan.cluster.name} "
                        f"has {plan.cluster.num_gpus}: use a plan made for this cluster")
    known = known or [None] * len(plan.pipelines)
    if len(known) != len(plan.pipelines):
        raise ValueError(f"known has {len(known)} entries for {len(plan.pipelines)} pipelines")
    shared: dict = {}  # stage-level costs that pipelines of one scheme share
    known = [k if k is not None else d for k, d in zip(known, derived_structures(plan.pipelines, known))]
    works = _plan_works(plan, known)
    tables = _batched_tables(plan, cm, works)
    _batched_row_costs(plan, cm, works, tables)
    flops = _batched_model_flops(cm, works)
    return [_PipelineCosts(plan, i, cm, offsets, shared, works[i], tables[i], known[i], flops[i]).build()
            for i in range(len(plan.pipelines))]


_SEGMENT_FIELDS = operator.attrgetter("seq_id", "start", "stop")


def segment_cells(chunks: list[Chunk], units: list[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk, unit, tokens) of every cell of these forward chunks and backward units, by chunk
    then unit: every backward segment lies in one forward segment of its sequence
    (`plan.validate.check_backward_units`), found by (sequence, start) order."""
    def table(xs):
        counts = np.fromiter((len(x.segments) for x in xs), dtype=np.int64, count=len(xs))
        flat = np.fromiter(itertools.chain.from_iterable(map(_SEGMENT_FIELDS, (s for x in xs for s in x.segments))),
                           dtype=np.int64, count=3 * int(counts.sum())).reshape(-1, 3)
        return np.repeat(np.arange(len(xs)), counts), flat
    owner_f, fwd = table(chunks)
    owner_b, bwd = table(units)
    order = np.lexsort((fwd[:, 1], fwd[:, 0]))
    keys = fwd[order, 0] * 2**32 + fwd[order, 1]
    holder = order[np.searchsorted(keys, bwd[:, 0] * 2**32 + bwd[:, 1], side="right") - 1]
    cell = owner_f[holder] * max(len(units), 1) + owner_b
    uniq, at = np.unique(cell, return_inverse=True)
    tokens = np.bincount(at, weights=(bwd[:, 2] - bwd[:, 1]).astype(np.float64), minlength=len(uniq))
    return uniq // max(len(units), 1), uniq % max(len(units), 1), tokens


def derived_structures(pipes: list[PipelinePlan], known: list[SliceStructure | None]) -> list[SliceStructure | None]:
    """The SliceStructure of every pipeline without one in `known` whose backward units are its
    chunks and whose chunks are unpadded, read off all of their segments at once: the same
    Dependencies as plan.schedules.dependencies and the same split sequences as
    sim.memory.split_sequences (as arrays). None elsewhere, and for a pipeline whose segments
    dependencies rejects (a slice continuing no other), which is left to it."""
    todo = [i for i, (p, k) in enumerate(zip(pipes, known))
            if k is None and p.backward_chunks is None and not any(c.pad_to for c in p.chunks)]
    out: list[SliceStructure | None] = [None] * len(pipes)
    if not todo:
        return out
    chunks = [c for i in todo for c in pipes[i].chunks]
    nc = np.array([len(pipes[i].chunks) for i in todo], dtype=np.int64)
    counts = np.fromiter(map(len, map(_SEGMENTS, chunks)), dtype=np.int64, count=len(chunks))
    segs = list(itertools.chain.from_iterable(map(_SEGMENTS, chunks)))
    flat = np.fromiter(itertools.chain.from_iterable(map(_SEGMENT_FIELDS, segs)), dtype=np.int64,
                       count=3 * len(segs)).reshape(len(segs), 3)
    seq, start, stop = flat[:, 0], flat[:, 1], flat[:, 2]
    chunk_pipe = np.repeat(np.arange(len(todo)), nc)
    gchunk = np.repeat(np.arange(len(chunks)), counts)           # each segment's chunk over all pipelines
    pipe = chunk_pipe[gchunk]
    chunk = gchunk - _first(nc)[pipe]                             # ... and within its pipeline
    seqs, ends = int(seq.max(initial=0)) + 1, int(stop.max(initial=0)) + 1
    if len(segs) and (int(seq.min()) < 0 or len(todo) * seqs * ends >= 2**62):
        return out
    seq_key = pipe * seqs + seq                                   # (pipeline, sequence)
    # each continuing slice's previous one: the chunk holding the segment of its sequence that ends
    # where it starts (the last such chunk, as dependencies' dictionary keeps it)
    end_key = seq_key * ends + stop
    order = np.argsort(end_key, kind="stable")
    cont = np.flatnonzero(start > 0)
    want = seq_key[cont] * ends + start[cont]
    at = np.searchsorted(end_key[order], want, side="right") - 1
    found = (at >= 0) & (end_key[order][np.maximum(at, 0)] == want)
    broken = set(pipe[cont[~found]].tolist())
    fwd_after: dict[int, list[int]] = {}                          # global chunk -> previous-slice chunks
    for g, c, p in zip(gchunk[cont[found]].tolist(), chunk[cont[found]].tolist(),
                       chunk[order[at[found]]].tolist()):
        if p != c:
            preds = fwd_after.setdefault(g, [])
            if p not in preds:
                preds.append(p)
    # split sequences: those with a slice starting after token 0 in the pipeline, with two or more
    # slices there, in order of first appearance; each one's slices by (start, stop, chunk)
    cut = np.flatnonzero(np.isin(seq_key, seq_key[cont]))
    cut = cut[np.lexsort((cut, seq_key[cut]))]                    # by sequence, then first appearance
    heads = np.flatnonzero(_changed(seq_key[cut]))
    parts = np.diff(np.r_[heads, len(cut)])
    seen = np.repeat(cut[heads], parts)                           # each slice's sequence's first segment
    many = np.repeat(parts >= 2, parts)
    cut, seen = cut[many], seen[many]
    cut = cut[np.lexsort((chunk[cut], stop[cut], start[cut], seen))]
    seen = np.sort(seen, kind="stable")
    heads = np.flatnonzero(_changed(seen))
    lasts = np.r_[heads[1:], len(cut)][:len(heads)] - 1
    earlier = np.ones(len(cut), dtype=bool)
    earlier[lasts] = False
    group = np.cumsum(_changed(seen)) - 1
    held = np.unique(group * (int(nc.max(initial=0)) + 1) + chunk[cut])   # distinct (sequence, chunk)
    held_q, held_c = np.divmod(held, int(nc.max(initial=0)) + 1)
    q_pipe = pipe[cut[heads]]
    qb = np.searchsorted(q_pipe, np.arange(len(todo) + 1)).tolist()
    sb = np.searchsorted(pipe[cut[earlier]], np.arange(len(todo) + 1)).tolist()
    hb = np.searchsorted(q_pipe[held_q], np.arange(len(todo) + 1)).tolist()
    seq_id, context = seq[cut[heads]], start[cut[lasts]]
    slices = np.diff(np.r_[heads, len(cut)]) - 1
    holders = np.bincount(held_q, minlength=len(heads))
    slice_chunk, slice_tokens = chunk[cut[earlier]], (stop - start)[cut[earlier]]
    cb = np.r_[_first(nc), len(chunks)].tolist()
    segb = np.r_[0, np.cumsum(counts)][cb].tolist()
    by_pipe: dict[int, list[int]] = {}
    for g in fwd_after:                                           # ascending chunks, pipeline by pipeline
        by_pipe.setdefault(int(chunk_pipe[g]), []).append(g)
    for k, i in enumerate(todo):
        if k in broken:
            continue
        C, base = int(nc[k]), cb[k]
        after = [()] * C
        nexts: list[list[int]] = [[] for _ in range(C)]
        for g in by_pipe.get(k, ()):
            after[g - base] = tuple(fwd_after[g])
            for p in fwd_after[g]:
                nexts[p].append(g - base)
        deps = Dependencies(fwd_after=tuple(after), bwd_after=tuple(tuple(n) for n in nexts),
                            bwd_needs=_self_needs(C))
        splits = SplitArrays(seq_id=seq_id[qb[k]:qb[k + 1]], context=context[qb[k]:qb[k + 1]],
                             slices=slices[qb[k]:qb[k + 1]], slice_chunk=slice_chunk[sb[k]:sb[k + 1]],
                             slice_tokens=slice_tokens[sb[k]:sb[k + 1]], holders=holders[qb[k]:qb[k + 1]],
                             holder_unit=held_c[hb[k]:hb[k + 1]])
        bounds = flat[segb[k]:segb[k + 1], 1:]
        own = counts[cb[k]:cb[k + 1]]
        out[i] = SliceStructure(deps=deps, splits=splits, fwd_counts=own, fwd_bounds=bounds, bwd_counts=own,
                                bwd_bounds=bounds)
    return out


_SEGMENTS = operator.attrgetter("segments")


def _changed(x: np.ndarray) -> np.ndarray:
    """bool [n]: where x differs from the element before (True at 0)."""
    out = np.ones(len(x), dtype=bool)
    out[1:] = x[1:] != x[:-1]
    return out


def _self_needs(n: int) -> tuple[tuple[int, ...], ...]:
    """bwd_needs when the backward units are the chunks: each reads its own."""
    return tuple((u,) for u in range(n))


def _first(sizes: np.ndarray) -> np.ndarray:
    """Where each block of `sizes` starts."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


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


class _PipelineCosts:
    """Cost tables of one pipeline; per (layers, head, embed) stage kind the per-chunk costs are
    cached (head: the last stage's LM head, embed: the first stage's embedding)."""

    def __init__(self, plan: StepPlan, index: int, cm: CostModel, offsets: list[int], shared: dict,
                 works: tuple[_Works, _Works] | None = None, tables: dict | None = None,
                 known: SliceStructure | None = None, flops: float | None = None):
        self.plan, self.pipe, self.cm, self.offsets, self.shared = plan, plan.pipelines[index], cm, offsets, shared
        self.works = works  # (forward chunks, backward units), _plan_works
        self.offset, pipe = offsets[index], self.pipe
        self.layers = pipe.stage_layers(plan.model.num_layers)
        if len(self.layers) != pipe.pp or any(n < 0 for n in self.layers):
            raise UserError(f"layers_per_stage {self.layers} does not match pp={pipe.pp}")
        self.units = pipe.bwd_units
        self.known = known
        self.model_flops = flops
        self.deps = known.deps if known is not None else dependencies(pipe.chunks, pipe.backward_chunks)
        self.kw = {"tp": pipe.tp, "cp": pipe.cp}
        self._cache: dict = dict(tables or {})  # per_chunk tables batched over the plan (_batched_tables)

    def node(self, gpu: int) -> int:
        return gpu // self.plan.cluster.gpus_per_node

    def stage_gpus(self, s: int) -> tuple[int, int]:
        width = self.pipe.tp * self.pipe.cp
        return self.offset + s * width, self.offset + (s + 1) * width - 1

    def link_inter(self, s: int) -> bool:
        """Whether the hand-off between stages s and s+1 crosses nodes."""
        return self.node(self.stage_gpus(s)[0]) != self.node(self.stage_gpus(s + 1)[1])

    def per_chunk(self, layers: int, head: bool, embed: bool = False) -> dict[str, np.ndarray]:
        key = (layers, head, embed)
        if key not in self._cache:
            cm = self.cm
            self._cache[key] = {
                "fwd": self._each(cm.forward_time, self.pipe.chunks, layers=layers, head=head, embed=embed),
                "bwd": self._each(cm.backward_time, self.units, layers=layers, head=head, embed=embed),
                "act": self._each(cm.activation_bytes, self.pipe.chunks, layers=layers, head=head),
            }
        return self._cache[key]

    def _each(self, fn, chunks: list[Chunk], **kw) -> np.ndarray:
        """fn(chunk, **kw, tp, cp) of every chunk. Without CP a chunk's cost depends only on its
        ChunkWork (row tokens, attention pairs), so values are shared by every chunk of equal
        work across the plan's pipelines (padded rows, equal-length sequences)."""
        kw = {**kw, **self.kw}
        if self.pipe.cp > 1:
            return np.array([fn(c, **kw) for c in chunks])
        if getattr(fn, "__self__", None) is self.cm and fn.__name__ in _VECTORISED:
            return self._each_at_once(fn.__name__, chunks, kw)
        memo = self.shared.setdefault((fn.__name__, *sorted(kw.items())), {})
        out = np.empty(len(chunks))
        for i, c in enumerate(chunks):
            key = work_key(c)
            v = memo.get(key)
            if v is None:
                v = memo[key] = fn(c, **kw)
            out[i] = v
        return out

    def _works(self, chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row tokens, attention pairs, segments) of every chunk as float64 arrays (chunk_work's, cp = 1)."""
        key = ("works", id(chunks))
        if key not in self._cache:
            works = [(c.num_tokens, c.attention_pairs, max(len(c.segments), 1)) if c.pad_to <= c.num_tokens
                     or not c.segments else (lambda w: (w.tokens, w.keys, w.segments))(chunk_work(c)) for c in chunks]
            arr = np.array(works, dtype=np.float64).reshape(len(chunks), 3)
            self._cache[key] = (arr[:, 0], arr[:, 1], arr[:, 2], chunks)  # chunks kept: the id stays theirs
        tokens, keys, segments, _ = self._cache[key]
        return tokens, keys, segments

    def _each_at_once(self, name: str, chunks: list[Chunk], kw: dict) -> np.ndarray:
        """_each for cp = 1 by the cost model's elementwise forms (the same floats, in one pass)."""
        tokens, keys, segments = self._works(chunks)
        cm, layers, tp, head = self.cm, kw["layers"], kw["tp"], kw.get("head", False)
        if name == "activation_bytes":
            return cm.activation_bytes_rows(tokens, layers=layers, tp=tp, head=head)
        out = cm.works_time(tokens, keys, layers=layers, tp=tp, head=head, embed=kw.get("embed", False),
                            backward=name == "backward_time", segments=segments)
        return out + 0.0 if name == "backward_time" else out  # backward_time adds its (zero) recompute

    def build(self) -> PipelineInput:
        pipe = self.pipe
        S, C, U = pipe.pp, len(pipe.chunks), len(self.units)
        shape = (S, 3, max(C, U, 1))
        dur, comm, send = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        recompute = _recompute_table(pipe)
        for s in range(S):
            self._stage_times(s, recompute[s], dur[s], comm[s])
            if s + 1 < S:
                fwd_send, bwd_send = self._p2p(self.link_inter(s))
                send[s, F, :C] = send[s, N, :C] = fwd_send
                send[s + 1, B, :U] = bwd_send
        return PipelineInput(stages=pipe.stages, chunks=pipe.chunks, backward_chunks=pipe.backward_chunks,
                             dur=dur, comm=comm, send=send, sizes=self._sizes(recompute),
                             grad_sync=self._grad_sync(), step_end=self._step_end(), extra_comm=pipe.extra_comm_s,
                             model_flops=self._model_flops(), num_gpus=pipe.num_gpus, deps=self.deps,
                             splits=self.splits)

    def _p2p(self, inter: bool) -> tuple[list[float], list[float]]:
        """Hand-off times of every chunk and unit over an intra- or inter-node link."""
        if ("p2p", inter) not in self._cache:
            cm, kw = self.cm, self.kw
            if self.works is None or self.pipe.cp > 1:
                self._cache["p2p", inter] = (
                    [cm.p2p_time(cm.boundary_bytes(c, **kw), inter_node=inter) for c in self.pipe.chunks],
                    [cm.p2p_time(cm.boundary_bytes(u, **kw), inter_node=inter) for u in self.units])
            else:  # boundary bytes go by row tokens alone: one call per distinct count
                memo = self.shared.setdefault(("p2p", inter, self.pipe.tp), {})

                def times(rows: np.ndarray) -> list[float]:
                    out = []
                    for r in rows.tolist():
                        v = memo.get(r)
                        if v is None:
                            v = memo[r] = cm.p2p_time(cm.boundary_bytes(_row_of(r), **kw), inter_node=inter)
                        out.append(v)
                    return out

                self._cache["p2p", inter] = (times(self.works[0].row_tokens), times(self.works[1].row_tokens))
        return self._cache["p2p", inter]

    def _stage_times(self, s: int, recompute: list[int], dur: np.ndarray, comm: np.ndarray) -> None:
        L, head, C, U = self.layers[s], s == self.pipe.pp - 1, len(self.pipe.chunks), len(self.units)
        base = self.per_chunk(L, head, s == 0)
        factor, fmax, bmax = host_overlap(self.cm, self.pipe, s, L)
        if factor < 1.0:  # the host runs ahead of the device across the stage's actions (sim/terms.py)
            base = {**base, "fwd": base["fwd"] - (1.0 - factor) * np.asarray(fmax),
                    "bwd": base["bwd"] - (1.0 - factor) * np.asarray(bmax)}
        if self.pipe.cp <= 1 and not any(recompute):  # no CP exchange (comm stays zero), no recomputation
            dur[F, :C] = dur[N, :C] = base["fwd"]
            dur[B, :U] = base["bwd"]
            return
        bwd = base["bwd"].copy()
        for u in range(U if any(recompute) else 0):
            r = max((recompute[c] for c in self.deps.bwd_needs[u]), default=0)
            if r:  # backward re-runs the forward of r layers (InfiniPipe checkpointing)
                bwd[u] = self.cm.backward_time(self.units[u], layers=L, head=head, recompute_layers=r, embed=s == 0,
                                               **self.kw)
        cp_f = self._cp_times(s, L, self.pipe.chunks, self.cm.cp_comm_time)
        cp_b = self._cp_times(s, L, self.units, self.cm.cp_grad_comm_time)  # the K/V gradients' reduce-scatter
        dur[F, :C] = dur[N, :C] = base["fwd"] + cp_f
        dur[B, :U] = bwd + cp_b
        comm[F, :C] = comm[N, :C] = cp_f
        comm[B, :U] = cp_b

    def _cp_times(self, s: int, layers: int, chunks: list[Chunk], term) -> np.ndarray:
        if self.pipe.cp <= 1:
            return np.zeros(len(chunks))
        lo, hi = self.stage_gpus(s)
        inter = self.node(lo) != self.node(hi)
        return np.array([term(c, layers=layers, inter_node=inter, **self.kw) for c in chunks])

    def _sizes(self, recompute: list[list[int]]) -> MemorySizes:
        pipe, cm, S = self.pipe, self.cm, self.pipe.pp
        splits = self.splits = self.known.splits if self.known is not None else split_sequences(pipe.chunks,
                                                                                                self.units)
        act, extra, transient, kv, kv_grad, work, fwork, cell_act = [], [], [], [], [], [], [], []
        cells = self._cells()
        kv_of: dict[int, dict] = {}  # stages of equal layer counts hold equal K/V
        C = len(pipe.chunks)
        zeros = self._zeros
        for s in range(S):
            L, head = self.layers[s], s == S - 1
            full = self.per_chunk(L, head, s == 0)["act"]
            if any(recompute[s]):
                kept = np.array([cm.activation_bytes(c, layers=L, head=head, recompute_layers=r, **self.kw) if r
                                 else full[i] for i, (c, r) in enumerate(zip(pipe.chunks, recompute[s]))])
                extra.append([cm.recompute_transient_bytes(c, recompute_layers=r, **self.kw)
                              for c, r in zip(pipe.chunks, recompute[s])])
            else:  # recompute_transient_bytes is 0 without recomputation
                kept = full
                extra.append(zeros(C))
            if cells is not None:  # each cell is its own row: kept, re-materialised and worked on apart
                kept, extra[-1], w, fw = self._cell_sizes(cells, L, head, recompute[s])
                cell_act.append(kept)
                act.append(self._chunk_sums(cells, kept, C))
                work.append(w)
                fwork.append(fw)
                self._stage_rest(s, L, splits, kv_of, kv, kv_grad, transient, zeros, C, act)
                continue
            act.append(kept)
            # each backward unit's working set (the loss backward's bf16 logit gradient on the
            # last stage, a layer's SwiGLU backward elsewhere), and the head forward's bf16 logits
            work.append(self._per_token_row(cm.backward_work_bytes, self.units, 1,
                                            functools.partial(cm.backward_work_bytes_rows, layers=L, tp=pipe.tp,
                                                              head=head),
                                            layers=L, head=head))
            fwork.append(self._per_token_row(cm.head_forward_bytes, pipe.chunks, 0,
                                             functools.partial(mem.head_forward_bytes, cm.model, tp=pipe.tp))
                         if head else zeros(C))
            self._stage_rest(s, L, splits, kv_of, kv, kv_grad, transient, zeros, C, act)
        states, grads = self._states()
        if cm.grads_held_all_step:  # a buffer allocated before the step (`CostModel.grads_held_all_step`)
            grads = [0.0] * S
        if S:
            work[0] = self._embedding_backward(work[0], act[0], extra[0], grads[0], cell_act[0] if cells else None,
                                               cells)
        return MemorySizes(state=[a - g for a, g in zip(states, grads)], grads=grads, activation=act,
                           recompute_extra=extra, nograd_transient=transient, kv=kv, kv_grad=kv_grad,
                           backward_work=work, forward_work=fwork, cell_activation=cell_act,
                           nograd_held=cm.nograd_keeps_graph)

    def _stage_rest(self, s, L, splits, kv_of, kv, kv_grad, transient, zeros, C, act) -> None:
        """Stage s's no-grad forward transients and K/V sizes (appended to the lists)."""
        pipe, cm = self.pipe, self.cm
        nograd = {a.chunk for a in pipe.stages[s] if a.kind == FORWARD_NOGRAD} \
            if FORWARD_NOGRAD in map(_KIND, pipe.stages[s]) else ()
        if nograd and cm.nograd_keeps_graph:  # the whole graph an F would keep (`CostModel.nograd_keeps_graph`)
            transient.append([act[-1][i] if i in nograd else 0.0 for i in range(C)])
        else:
            transient.append([cm.activation_bytes(c, layers=min(L, 1), **self.kw) if i in nograd else 0.0
                              for i, c in enumerate(pipe.chunks)] if nograd else zeros(C))
        if L not in kv_of:  # kv_bytes by context length, shared by the plan's pipelines of one tp, cp
            if isinstance(splits, SplitArrays) and type(cm).kv_bytes is CostModel.kv_bytes:
                # CostModel.kv_bytes elementwise over the contexts: the same operations, the same floats
                each = cm.kv_bytes(splits.context, layers=L, **self.kw)
                kv_of[L] = dict(zip(splits.seq_id.tolist(), np.asarray(each, dtype=np.float64).tolist()))
            else:
                memo = self.shared.setdefault(("kv", L, self.pipe.tp, self.pipe.cp), {})
                seqs = zip(splits.seq_id.tolist(), splits.context.tolist()) if isinstance(splits, SplitArrays) \
                    else ((q.seq_id, q.context) for q in splits)
                kv_of[L] = {q: memo[n] if n in memo else memo.setdefault(n, cm.kv_bytes(n, layers=L, **self.kw))
                            for q, n in seqs}
        kv.append(kv_of[L])
        kv_grad.append(dict(kv_of[L]))  # K/V-gradient buffers are the size of the K/V they update

    def _cells(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(chunk, unit, tokens) of every cell, the part of a forward chunk that one backward
        unit holds (`runtime/cells.py`), in the order of the (chunk, unit) reads (by chunk,
        then unit); None when the units are the chunks, or under CP (there chunks are counted
        whole, released at their last reader's end: an upper bound)."""
        pipe = self.pipe
        if pipe.backward_chunks is None or pipe.cp > 1:
            return None
        if self.known is not None and self.known.cells is not None:
            c, u, n = self.known.cells
            cells = c, u, n.astype(np.float64)
        else:
            cells = segment_cells(pipe.chunks, pipe.backward_chunks)
        # one cell per (chunk, unit) read, in the reads' order (else: chunks released whole)
        reads = [(c, u) for u, needs in enumerate(self.deps.bwd_needs) for c in needs]
        if len(reads) != len(cells[0]) or sorted(reads) != list(zip(cells[0].tolist(), cells[1].tolist())):
            return None
        return cells

    def _chunk_sums(self, cells, kept: np.ndarray, C: int) -> np.ndarray:
        """Each chunk's activations, its cells' summed (shared by stages of equal cell sizes)."""
        key = ("chunk sums", id(kept))
        if key not in self._cache:
            self._cache[key] = (kept, np.bincount(cells[0], weights=kept, minlength=C))
        return self._cache[key][1]

    def _cell_sizes(self, cells, L: int, head: bool, recompute: list[int]):
        """A stage's sizes by cell: each cell's kept activations [cell] (its own row: padded
        apart), each chunk's re-materialisation events folded into its units' working sets
        (zeros [chunk]), each unit's working set [unit] (its cells' backwards run one after
        another: the largest cell's loss or layer working set, with its re-materialised layer)
        and each chunk's forward working set [chunk] (its largest cell's LM head logits)."""
        key = ("cells", L, head, tuple(recompute) if any(recompute) else None)
        if key in self._cache:  # stages of one shape and recomputation share them
            return self._cache[key]
        cm, tp = self.cm, self.pipe.tp
        chunk_of, unit_of, tokens = cells
        remat = np.zeros(len(tokens))
        if not any(recompute):
            kept = cm.activation_bytes_rows(tokens, layers=L, tp=tp, head=head)
        else:
            r = np.asarray(recompute, dtype=np.int64)[chunk_of]
            kept = np.zeros(len(tokens))
            for k in np.unique(r).tolist():
                at = r == k
                kept[at] = cm.activation_bytes_rows(tokens[at], layers=L, tp=tp, recompute_layers=k, head=head)
                if k:
                    remat[at] = (cm.activation_bytes_rows(tokens[at], layers=1, tp=tp)
                                 - cm.activation_bytes_rows(tokens[at], layers=1, tp=tp, recompute_layers=1))
        work = np.zeros(len(self.units))
        np.maximum.at(work, unit_of, remat + cm.backward_work_bytes_rows(tokens, layers=L, tp=tp, head=head))
        fwork = self._zeros(len(self.pipe.chunks))
        if head:
            fwork = np.zeros(len(self.pipe.chunks))
            np.maximum.at(fwork, chunk_of, mem.head_forward_bytes(cm.model, tokens, tp))
        out = self._cache[key] = (kept, self._zeros(len(self.pipe.chunks)), work, fwork)
        return out

    def _embedding_backward(self, work, act, extra, grads: float, cell_act=None, cells=None) -> np.ndarray:
        """The first stage's backward working sets (`work`, counted from the level at each B's
        start, beside the layer it re-materialises, `extra`) raised to the moment its
        embedding's backward runs, at the B's end: the whole table's bf16 gradient
        (`mem.embedding_backward_bytes`) beside the other chunks' activations, the B's own and
        its re-materialised layer freed by then (`act`: those whose last reader the B is), and
        beside every gradient in the stage's first B, which makes them (`grads`; a
        heterogeneous plan's autograd keeps that first bf16 table as the gradient itself)."""
        pipe, U = self.pipe, len(self.units)
        order = [a.chunk for a in pipe.stages[0] if a.kind == BACKWARD]
        if not order:
            return work
        act, extra = np.asarray(act, dtype=np.float64), np.asarray(extra, dtype=np.float64)
        if cells is not None:  # each cell's backward ends in the embedding's: its first cell's
            released = np.full(U, np.inf)       # (the smallest, at most) is all it has freed then
            np.minimum.at(released, cells[1], cell_act)
            released[~np.isfinite(released)] = 0.0
            remat = np.zeros(U)  # folded into `work`, freed with its cell
        elif pipe.backward_chunks is None:  # each unit is its chunk, the only one it reads
            released, remat = act.copy(), extra
        else:
            pos = np.zeros(U, dtype=np.int64)
            pos[order] = np.arange(len(order))
            released, remat = np.zeros(U), np.zeros(U)
            readers: dict[int, list[int]] = {}
            for u, needs in enumerate(self.deps.bwd_needs):
                for c in needs:
                    readers.setdefault(c, []).append(u)
                    remat[u] += extra[c]
            for c, us in readers.items():
                released[max(us, key=pos.__getitem__)] += act[c]
        table = mem.embedding_backward_bytes(self.cm.model)
        end = table - released - remat
        end[order[0]] += grads - (table if self._heterogeneous() else 0.0)
        return np.maximum(np.asarray(work, dtype=np.float64), end)

    def _states(self) -> tuple[list[float], list[float]]:
        """[stage] model-state bytes and [stage] their gradients' part, shared by the plan's
        pipelines of one shape."""
        pipe, cm, S = self.pipe, self.cm, self.pipe.pp
        # ZeRO shards over dp x cp: every pipeline's CP ranks (DP-Merged pipelines have more)
        dp, zero = self._replicas(), self.plan.zero
        key = ("states", pipe.tp, pipe.cp, tuple(self.layers))
        if key not in self.shared:
            if self._heterogeneous():  # bf16 stage weights and gradients, the owned masters and moments
                holders = self._holders()
                self.shared[key] = (
                    [self._shared(cm.hetero_state_bytes, layers=L, tp=pipe.tp, first=s == 0, last=s == S - 1,
                                  holders=holders) for s, L in enumerate(self.layers)],
                    [self._shared(cm.hetero_grad_bytes, layers=L, tp=pipe.tp, first=s == 0, last=s == S - 1)
                     for s, L in enumerate(self.layers)])
            else:
                budgets = [self._shared(cm.stage_budget, stage=s, tp=pipe.tp, pp=S, replicas=dp, zero=zero, layers=L)
                           for s, L in enumerate(self.layers)]
                self.shared[key] = ([b.states for b in budgets], [b.grads for b in budgets])
        states, grads = self.shared[key]
        return list(states), list(grads)

    def _zeros(self, n: int) -> np.ndarray:
        """A read-only float64 zero row of n entries, shared by the plan's pipelines."""
        key = ("zeros", n)
        if key not in self.shared:
            row = self.shared[key] = np.zeros(n)
            row.flags.writeable = False
        return self.shared[key]

    def _per_token_row(self, method, chunks: list[Chunk], side: int, per_token, **kwargs):
        """`method(c, **kwargs, tp, cp)` of every chunk of `chunks` (the forward chunks, `side`
        0, or the backward units, 1), a CostModel method that is `per_token` bytes times the
        chunk's tokens on its busiest CP rank (or `per_token(tokens)`, a function of the row
        tokens elementwise): without CP that over the row tokens at once (the same floats),
        unless a subclass redefines the method."""
        cm = self.cm
        if self.works is None or self.pipe.cp > 1 or getattr(type(cm), method.__name__) is not \
                getattr(CostModel, method.__name__):
            return [method(c, **kwargs, **self.kw) for c in chunks]
        if callable(per_token):
            return per_token(self.works[side].row_tokens)
        if not per_token:
            return self._zeros(len(chunks))
        return per_token * self.works[side].row_tokens

    def _holders(self):
        """How many GPUs hold each element of the plan (`CostModel.hetero_holders`), once per plan."""
        if "holders" not in self.shared:
            self.shared["holders"] = self.cm.hetero_holders([(q.tp, q.pp, q.cp) for q in self.plan.pipelines])
        return self.shared["holders"]

    def _heterogeneous(self) -> bool:
        if "heterogeneous" not in self.shared:  # once per plan, not once per pipeline (O(pipelines) each)
            self.shared["heterogeneous"] = heterogeneous(self.plan)
        return self.shared["heterogeneous"]

    def _grad_sync(self) -> list[float]:
        if self._heterogeneous():
            # pipelines with other tp x pp x cp: the executor's exchange with owners among each
            # element's holders (runtime/parallel/hetero.py), no all-reduce
            world = self._world()
            inter = self.node(0) != self.node(world - 1)
            return [self._shared(self.cm.exchange_time, layers=L, tp=self.pipe.tp, holders=self._holders(),
                                 inter_node=inter, first=s == 0, last=s == self.pipe.pp - 1)
                    for s, L in enumerate(self.layers)]
        # every CP rank holds the stage's weights too: gradients reduce over dp x cp
        dp = self._replicas()
        if dp <= 1:
            return [0.0] * self.pipe.pp
        key = ("grad_sync", tuple(self.layers), self.pipe.tp, self.pipe.cp)  # the rest is the plan's
        if key not in self.shared:
            self.shared[key] = [self._shared(self.cm.grad_sync_time, layers=L, tp=self.pipe.tp, dp=dp,
                                             zero=self.plan.zero, inter_node=self.dp_inter(s), first=s == 0,
                                             last=s == self.pipe.pp - 1)
                                for s, L in enumerate(self.layers)]
        return list(self.shared[key])

    def _step_end(self) -> list[float] | None:
        """Per stage, the gradient norm and optimizer step after its reduction (a profile's
        step terms; None without: the analytic model's step ends at the reduction)."""
        if self.cm.profile is None or self.cm.profile.step is None:
            return None
        dp = self._replicas()
        return [self._shared(self.cm.step_end_time, layers=L, tp=self.pipe.tp, dp=dp, zero=self.plan.zero,
                             first=s == 0, last=s == self.pipe.pp - 1) for s, L in enumerate(self.layers)]

    def _replicas(self) -> int:
        """Every pipeline's CP ranks summed (the ranks that hold a stage's weights), once per plan
        (summed per pipeline it made building a plan's inputs quadratic in its pipelines)."""
        if "replicas" not in self.shared:
            self.shared["replicas"] = sum(p.cp for p in self.plan.pipelines)
        return self.shared["replicas"]

    def _world(self) -> int:
        """GPUs of every pipeline, once per plan."""
        if "world" not in self.shared:
            self.shared["world"] = sum(q.num_gpus for q in self.plan.pipelines)
        return self.shared["world"]

    def _shared(self, fn, **kw) -> float:
        key = (fn.__name__, *sorted(kw.items()))
        if key not in self.shared:
            self.shared[key] = fn(**kw)
        return self.shared[key]

    def dp_inter(self, s: int) -> bool:
        """Whether stage s's data-parallel group (stage s of every pipeline) spans nodes."""
        if ("dp_inter", s) not in self.shared:
            firsts = [off + s * q.tp * q.cp for off, q in zip(self.offsets, self.plan.pipelines) if s < q.pp]
            self.shared["dp_inter", s] = len({self.node(g) for g in firsts}) > 1
        return self.shared["dp_inter", s]

    def _model_flops(self) -> float:
        L, cm = self.plan.model.num_layers, self.cm
        if (self.works is not None and type(cm).forward_flops is CostModel.forward_flops
                and type(cm).backward_flops is CostModel.backward_flops):
            # CostModel.forward_flops / backward_flops (whole model, head, padding excluded)
            # elementwise over the chunks: the same operations in the same order, then summed
            # one by one as below
            if self.model_flops is not None:  # computed for every pipeline at once (_batched_model_flops)
                return self.model_flops
            fw, bw = self.works
            lin, attn = layer_forward_flops(cm.model, ChunkWork(fw.bare_tokens, fw.bare_pairs))
            fwd = L * (lin + attn) + head_forward_flops(cm.model, fw.bare_tokens)
            lin, attn = layer_forward_flops(cm.model, ChunkWork(bw.bare_tokens, bw.bare_pairs))
            bwd = (L * (lin * cm.bwd_linear_ratio + attn * cm.bwd_attn_ratio)
                   + head_forward_flops(cm.model, bw.bare_tokens) * (cm.bwd_linear_ratio + HEAD_RECOMPUTE))
            return sum(fwd.tolist()) + sum(bwd.tolist())
        bare = lambda c: Chunk(c.segments) if c.pad_to else c
        memo = self.shared.setdefault("model_flops", {})  # by (tokens, pairs): padding excluded
        sums = []
        for k, (units, fn) in enumerate(((self.pipe.chunks, cm.forward_flops), (self.units, cm.backward_flops))):
            values = []
            works = zip(self.works[k].tokens, self.works[k].pairs) if self.works is not None else \
                ((c.num_tokens, c.attention_pairs) for c in units)
            for c, (tokens, pairs) in zip(units, works):
                key = (fn.__name__, tokens, pairs)
                v = memo.get(key)
                if v is None:
                    v = memo[key] = fn(bare(c), layers=L, head=True)
                values.append(v)
            sums.append(sum(values))
        return sums[0] + sums[1]


def _row_of(tokens: float) -> Chunk:
    """A one-segment chunk of `tokens` row tokens: what a memo keyed by row tokens asks the
    cost model on a miss (boundary and loss-backward bytes go by row tokens alone without CP),
    so the pipeline's own chunks need not be looked at."""
    return Chunk((Segment(0, 0, int(tokens)),))


_RECOMPUTE = operator.attrgetter("recompute_layers")
_KIND = operator.attrgetter("kind")


def _recompute_table(pipe: PipelinePlan) -> list[list[int]]:
    """[stage][chunk] layers the chunk's F recomputes on that stage."""
    table = [[0] * len(pipe.chunks) for _ in range(pipe.pp)]
    for s, acts in enumerate(pipe.stages):
        if not any(map(_RECOMPUTE, acts)):  # (a scan at C speed) no action recomputes: zeros
            continue
        for a in acts:
            if a.kind == FORWARD and 0 <= a.chunk < len(pipe.chunks):
                table[s][a.chunk] = a.recompute_layers
    return table


def direct_input(fwd: list[float], stages: int, *, bwd_ratio: float = 2.0, schedule: str = "1f1b",
                 groups: list[tuple[int, int]] | None = None, k: int | None = None) -> PipelineInput:
    """A pipeline from raw per-chunk forward times (any unit), the same on every stage.

    `groups`: inclusive index ranges (first, last) of chunks that are consecutive slices of one
    sequence. Backward takes `bwd_ratio` times the forward; activations are counted in forward-
    time units (time proportional to tokens, as chunkflow §3 assumes); no communication."""
    if schedule not in SCHEDULE_NAMES:
        raise UserError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULE_NAMES)}")
    if stages < 1 or not fwd or min(fwd) < 0:
        raise UserError(f"need stages >= 1 and non-negative forward times, got stages={stages}, fwd={fwd}")
    chunks = _direct_chunks(len(fwd), groups or [])
    plan_stages = make_schedule(schedule, chunks, stages, k)
    times = np.asarray(fwd, dtype=np.float64)
    shape = (stages, 3, len(fwd))
    dur = np.zeros(shape)
    dur[:, F, :] = dur[:, N, :] = times
    dur[:, B, :] = bwd_ratio * times
    zeros = [[0.0] * len(fwd) for _ in range(stages)]
    sizes = MemorySizes(state=[0.0] * stages, activation=[list(fwd) for _ in range(stages)],
                        recompute_extra=zeros, nograd_transient=zeros,
                        kv=[{} for _ in range(stages)], kv_grad=[{} for _ in range(stages)])
    return PipelineInput(stages=plan_stages, chunks=chunks, backward_chunks=None, dur=dur,
                         comm=np.zeros(shape), send=np.zeros(shape), sizes=sizes, grad_sync=[0.0] * stages,
                         num_gpus=stages)


def _direct_chunks(n: int, groups: list[tuple[int, int]]) -> list[Chunk]:
    """One one-token segment per chunk; a group's chunks are slices of the group's first chunk."""
    seq_of = list(range(n))
    for first, last in groups:
        if not 0 <= first < last < n:
            raise UserError(f"group {first}-{last} must satisfy 0 <= first < last < {n} (chunks given)")
        if any(seq_of[i] != i for i in range(first, last + 1)):
            raise UserError(f"group {first}-{last} overlaps another group")
        for i in range(first, last + 1):
            seq_of[i] = first
    return [Chunk((Segment(seq_of[i], i - seq_of[i], i - seq_of[i] + 1),)) for i in range(n)]


def heterogeneous(plan) -> bool:
    """Whether the plan's pipelines differ in tp, pp or cp (Hydraulis): the executor then
    exchanges gradients and weights with owners among each element's holders instead of
    all-reducing."""
    return len({(q.tp, q.pp, q.cp) for q in plan.pipelines}) > 1
