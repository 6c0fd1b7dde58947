"""Memory replay: what each stage holds along the simulated timeline (infinipipe.txt §3.1).

Each stage holds its model states for the whole step, but for their gradients, which come into
being in the stage's first backward (the optimizer frees them at every step's end; each FSDP
unit's fp32 accumulator is made by its first backward): allocated at that backward's end, held to
the step's end. Exact before and after it; inside it the accumulators grow layer by layer while
the chunk's activations are freed layer by layer, both about linearly, so the level there is
highest at one of its ends, which the events below hold. Plus allocations tied to tasks:

- activations of a chunk, from the start of its F to the end of the last B that consumes it
  (fewer bytes when the F keeps only checkpoints of `recompute_layers` layers; the B then
  re-materialises them one layer at a time, as the executor's per-layer checkpoints do: a
  transient of one layer's activations, `CostModel.recompute_transient_bytes`; on the last
  stage the B also works on the loss's fp32 logit gradients, another transient);
- the working set of each B beyond the kept activations (the loss's backward on the last stage,
  one layer's SwiGLU backward elsewhere: `CostModel.backward_work_bytes`), and on the last stage
  that of each F's LM head (its bf16 logits beside their fp32 copy), while the task runs;
- the working set of a no-grad forward (N): one layer's activations while it runs (or, modelling
  ChunkFlow's own system, `CostModel.nograd_keeps_graph`, the activations an F keeps, until the
  stage's next forward ends);
- K/V state of a split sequence's earlier slices, from the slice's first forward to the
  sequence's last backward on the stage (later slices attend to it: infinipipe eq. 5);
- K/V gradients of a split sequence, from the start of its last slice's backward to the end of
  its first slice's (earlier slices receive them: infinipipe eq. 9-10).

With separate backward units (SlimPack §4.1.2) the executor runs each cell, the part of a
forward chunk that one backward unit holds, as a row of its own and frees its activations when
that unit's backward ends (runtime/cells.py): a chunk's activations are allocated at its F as
the sum of its cells' (`MemorySizes.cell_activation`) and freed cell by cell (under CP chunks
are released whole at their last reader's end, an upper bound); K/V gradients of a sequence
that only the backward grouping cuts are not counted (a few tokens' K/V per cut).

Tasks on one stage are numbered in schedule order, so "the last backward" is the largest task
id, which needs no timing. Events are `(task, at_end, bytes)`; `replay` sorts all stages'
events at once with numpy (frees before allocations at equal times) and takes running sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lengthwise.plan.ir import Chunk
from lengthwise.plan.schedules import Dependencies
from lengthwise.sim.dag import PipelineTasks


@dataclass(kw_only=True)
class MemorySizes:
    """Sizes of one pipeline's allocations, per stage (bytes, or any consistent unit). A per-chunk
    or per-unit row may be a list or a float64 array (memory_events reads them as arrays)."""

    state: list[float]
    """[stage] model states held all step."""
    activation: list[list[float]]
    """[stage][chunk] activations held from F to B, as the stage's F action keeps them."""
    recompute_extra: list[list[float]]
    """[stage][chunk] bytes re-materialised at once during the B of a chunk whose F recomputes
    layers (one layer's)."""
    nograd_transient: list[list[float]]
    """[stage][chunk] working set of the chunk's N while it runs (`nograd_held`: until the end
    of the stage's next forward)."""
    kv: list[dict[int, float]]
    """[stage] bytes of K/V state per split sequence id, summed over its earlier slices."""
    kv_grad: list[dict[int, float]]
    """[stage] bytes of K/V gradient buffers per split sequence id."""
    backward_work: list[list[float]] = field(default_factory=list)
    """[stage][backward unit] bytes held only while the unit's B runs (the loss's backward on
    the last stage, a layer's backward elsewhere); empty: none."""
    forward_work: list[list[float]] = field(default_factory=list)
    """[stage][chunk] bytes held only while the chunk's F runs (the LM head's bf16 logits on
    the last stage); empty: none."""
    grads: list[float] = field(default_factory=list)
    """[stage] gradient bytes allocated at the end of the stage's first B and held to the
    step's end (not part of `state`); empty: none."""
    cell_activation: list = field(default_factory=list)
    """[stage][(chunk, unit) read, by chunk then unit] bytes of each cell's activations, freed
    at the end of that unit's B (`activation` is then each chunk's sum of them); empty: each
    chunk's activations are freed whole at the end of the last B reading them."""
    kv_rows: list | None = None
    """[stage] float64 [split sequence] `kv` as rows in the order of the pipeline's SplitArrays
    (whose sequences are distinct), where the sizes were computed from them; `kv_grad` is then
    the same. None: looked up by sequence id."""
    nograd_held: bool = False
    """Each N's bytes are freed at the end of the stage's next forward (F or N), not at its own
    (`CostModel.nograd_keeps_graph`: the graph of a forward whose loss was dropped lives until
    the next forward's loss replaces it)."""


@dataclass(kw_only=True)
class SplitSequence:
    """Where one split sequence's slices sit in a pipeline."""

    seq_id: int
    first_fwd: list[tuple[int, int]]
    """(chunk, tokens) of each slice but the last, whose K/V later slices read."""
    context: int
    """Tokens before the last slice: the size of the K/V-gradient buffer."""
    units: list[int]
    """Backward units holding any of its slices."""


@dataclass(frozen=True, kw_only=True)
class SplitArrays:
    """A pipeline's split sequences (SplitSequence each) as flat int64 arrays."""

    seq_id: np.ndarray
    """[sequence] its id."""
    context: np.ndarray
    """[sequence] SplitSequence.context."""
    slices: np.ndarray
    """[sequence] how many earlier slices (len(first_fwd))."""
    slice_chunk: np.ndarray
    """[slice] chunk of each earlier slice, sequence by sequence."""
    slice_tokens: np.ndarray
    """[slice] its tokens."""
    holders: np.ndarray
    """[sequence] how many backward units hold a slice of it (len(units))."""
    holder_unit: np.ndarray
    """[holder] those units, sequence by sequence, ascending."""

    def __len__(self) -> int:
        return len(self.seq_id)

    @classmethod
    def of(cls, splits: list[SplitSequence]) -> SplitArrays:
        arr = lambda xs: np.array(xs, dtype=np.int64)
        return cls(seq_id=arr([q.seq_id for q in splits]), context=arr([q.context for q in splits]),
                   slices=arr([len(q.first_fwd) for q in splits]),
                   slice_chunk=arr([c for q in splits for c, _ in q.first_fwd]),
                   slice_tokens=arr([n for q in splits for _, n in q.first_fwd]),
                   holders=arr([len(q.units) for q in splits]), holder_unit=arr([u for q in splits for u in q.units]))

    def sequences(self) -> list[SplitSequence]:
        sb = np.concatenate([[0], np.cumsum(self.slices)]).tolist()
        hb = np.concatenate([[0], np.cumsum(self.holders)]).tolist()
        c, n, u = self.slice_chunk.tolist(), self.slice_tokens.tolist(), self.holder_unit.tolist()
        return [SplitSequence(seq_id=q, first_fwd=list(zip(c[sb[i]:sb[i + 1]], n[sb[i]:sb[i + 1]])), context=ctx,
                              units=u[hb[i]:hb[i + 1]])
                for i, (q, ctx) in enumerate(zip(self.seq_id.tolist(), self.context.tolist()))]


def split_arrays(splits) -> SplitArrays:
    """`splits` (a SplitSequence list or SplitArrays) as SplitArrays."""
    return splits if isinstance(splits, SplitArrays) else SplitArrays.of(splits)


def split_sequences(chunks: list[Chunk], units: list[Chunk]) -> list[SplitSequence]:
    """Sequences cut into more than one slice in a pipeline's forward chunks."""
    cut = {seg.seq_id for ch in chunks for seg in ch.segments if seg.start}  # every cut has a later slice
    if not cut:
        return []
    slices: dict[int, list[tuple[int, int, int]]] = {}
    for c, ch in enumerate(chunks):
        for seg in ch.segments:
            if seg.seq_id in cut:
                slices.setdefault(seg.seq_id, []).append((seg.start, seg.stop, c))
    holders: dict[int, set[int]] = {}
    for u, ch in enumerate(units):
        for seg in ch.segments:
            if seg.seq_id in cut:
                holders.setdefault(seg.seq_id, set()).add(u)
    out = []
    for q, parts in slices.items():
        if len(parts) < 2:
            continue
        parts.sort()
        out.append(SplitSequence(seq_id=q, first_fwd=[(c, b - a) for a, b, c in parts[:-1]],
                                 context=parts[-1][0], units=sorted(holders[q])))
    return out


def memory_events(t: PipelineTasks, deps: Dependencies, sizes: MemorySizes,
                  splits: list[SplitSequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(task, at_end, delta) allocation events of one pipeline, task ids local to it."""
    fwd, bwd, nograd = (np.asarray(x, dtype=np.int64) for x in (t.fwd_id, t.bwd_id, t.nograd_id))
    act = np.asarray(sizes.activation, dtype=np.float64)
    extra = np.asarray(sizes.recompute_extra, dtype=np.float64)
    transient = np.asarray(sizes.nograd_transient, dtype=np.float64)
    users = deps_users(deps, fwd.shape[1])
    pairs_c = np.array([c for c, us in enumerate(users) for _ in us], dtype=np.int64)
    pairs_u = np.array([u for us in users for u in us], dtype=np.int64)
    release = np.full_like(fwd, -1)
    np.maximum.at(release, (slice(None), pairs_c), bwd[:, pairs_u])  # last backward reading the chunk
    read = release >= 0
    ran_nograd = nograd >= 0
    if len(sizes.cell_activation):  # each cell freed at the end of its unit's B
        cells = np.asarray(sizes.cell_activation, dtype=np.float64).reshape(len(fwd), -1)
        parts = [(fwd[read], False, act[read]), (bwd[:, pairs_u].ravel(), True, -cells.ravel())]
    else:
        parts = [(fwd[read], False, act[read]), (release[read], True, -act[read])]
    # parts whose bytes are all zero are left out: the zero events would be dropped below anyway
    if extra.any():
        parts += [(bwd[:, pairs_u].ravel(), False, extra[:, pairs_c].ravel()),
                  (bwd[:, pairs_u].ravel(), True, -extra[:, pairs_c].ravel())]
    if ran_nograd.any():
        ends = _nograd_ends(fwd, nograd[ran_nograd]) if sizes.nograd_held else nograd[ran_nograd]
        parts += [(nograd[ran_nograd], False, transient[ran_nograd]), (ends, True, -transient[ran_nograd])]
    if len(sizes.backward_work):
        work = np.asarray(sizes.backward_work, dtype=np.float64)
        parts += [(bwd, False, work), (bwd, True, -work)]
    if len(sizes.forward_work):
        fwork = np.asarray(sizes.forward_work, dtype=np.float64)
        parts += [(fwd, False, fwork), (fwd, True, -fwork)]
    if len(sizes.grads) and bwd.shape[1]:
        parts.append((bwd.min(axis=1), True, np.asarray(sizes.grads, dtype=np.float64)))
    if splits:
        parts.append(_split_events(t, sizes, splits))
    task = np.concatenate([np.asarray(p[0], dtype=np.int64).ravel() for p in parts])
    at_end = np.concatenate([p[1] if isinstance(p[1], np.ndarray) else np.full(np.size(p[0]), p[1]) for p in parts])
    delta = np.concatenate([np.asarray(p[2], dtype=np.float64).ravel() for p in parts])
    keep = delta != 0
    return task[keep], at_end[keep], delta[keep]


def _nograd_ends(fwd: np.ndarray, nograd: np.ndarray) -> np.ndarray:
    """For each N task, the stage's next forward task (F or N) after it. A stage's tasks are
    numbered consecutively in schedule order, and every N is followed by its chunk's F on the
    same stage, so the next larger forward id is on the N's stage."""
    ids = np.sort(np.concatenate([fwd.ravel(), nograd.ravel()]))
    at = np.searchsorted(ids, nograd, side="right")
    return ids[np.minimum(at, len(ids) - 1)]


def _split_events(t: PipelineTasks, sizes: MemorySizes,
                  splits: list[SplitSequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K/V state from each earlier slice's first forward to the sequence's last backward, and
    K/V gradients from its first backward (the last slice) to its last, on every stage: the
    events (task, at end, bytes) as flat arrays, stage by stage, sequence by sequence, each
    sequence's slices' allocations, then the K/V release, gradient allocation and release."""
    S, Q = len(t.fwd_id), len(splits)
    first = np.asarray(t.first_id, dtype=np.int64).reshape(S, -1)
    bwd = np.asarray(t.bwd_id, dtype=np.int64).reshape(S, -1)
    slices = [len(q.first_fwd) for q in splits]
    holders = [len(q.units) for q in splits]
    slice_q = np.repeat(np.arange(Q), slices)
    slice_c = np.array([c for q in splits for c, _ in q.first_fwd], dtype=np.int64)
    slice_tokens = np.array([n for q in splits for _, n in q.first_fwd], dtype=np.int64)
    context = np.array([max(q.context, 1) for q in splits], dtype=np.int64)
    b = bwd[:, [u for q in splits for u in q.units]]
    at = np.cumsum([0] + holders[:-1])
    last_b, first_b = np.maximum.reduceat(b, at, axis=1), np.minimum.reduceat(b, at, axis=1)
    kv = np.array([[kv_s.get(q.seq_id, 0.0) for q in splits] for kv_s in sizes.kv], dtype=np.float64)
    grad = np.array([[g_s.get(q.seq_id, 0.0) for q in splits] for g_s in sizes.kv_grad], dtype=np.float64)
    shares = kv[:, slice_q] * slice_tokens / context[slice_q]  # [stage, slice]
    bounds = np.cumsum([0] + slices).tolist()
    freed = np.array([[-sum(row[a:b]) for a, b in zip(bounds[:-1], bounds[1:])] for row in shares.tolist()],
                     dtype=np.float64).reshape(S, Q)  # summed one by one, in slice order
    # columns of one stage's events: per sequence its slices, then the three K/V events
    block = np.cumsum([0] + [k + 3 for k in slices])
    width = int(block[-1])
    slice_col = np.repeat(block[:-1], slices) + (np.arange(len(slice_q)) - np.repeat(np.array(bounds[:-1]), slices))
    tail = block[1:] - 3
    task = np.empty((S, width), dtype=np.int64)
    delta = np.empty((S, width), dtype=np.float64)
    at_end = np.zeros(width, dtype=bool)
    task[:, slice_col], delta[:, slice_col] = first[:, slice_c], shares
    task[:, tail], delta[:, tail] = last_b, freed
    task[:, tail + 1], delta[:, tail + 1] = first_b, grad
    task[:, tail + 2], delta[:, tail + 2] = last_b, -grad
    at_end[tail] = at_end[tail + 2] = True
    return task.ravel(), np.tile(at_end, S), delta.ravel()


def deps_users(deps: Dependencies, num_chunks: int) -> list[list[int]]:
    """Per forward chunk, the backward units that read its activations."""
    users: list[list[int]] = [[] for _ in range(num_chunks)]
    for u, needs in enumerate(deps.bwd_needs):
        for c in needs:
            users[c].append(u)
    return users


@dataclass(kw_only=True)
class MemoryCurves:
    """Every stage's memory along the timeline, stages concatenated (global stage ids)."""

    stage: np.ndarray
    """int64 [E] global stage of each point, sorted by stage then time."""
    time: np.ndarray
    """float64 [E] time of each point."""
    level: np.ndarray
    """float64 [E] memory held right after the point (model states included)."""
    base: np.ndarray
    """float64 [G] model states of each global stage."""
    peak: np.ndarray
    """float64 [G] highest level of each global stage."""


def _event_order(stage: np.ndarray, time: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """np.lexsort((delta > 0, time, stage)) by two stable sorts instead of three: a non-negative
    float64's bits order as the float does, so (time, is an allocation) is one uint64 key; then
    the stages, by numpy's counting sort where they fit int16."""
    if not len(time) or time.dtype != np.float64 or not time.min() >= 0:   # (negative or NaN: the plain sort)
        return np.lexsort((delta > 0, time, stage))
    key = ((time + 0.0).view(np.uint64) << np.uint64(1)) | (delta > 0).astype(np.uint64)   # -0.0 as 0.0
    by_time = np.argsort(key, kind="stable")
    small = stage.max() < 2**15 and stage.min() >= 0
    return by_time[np.argsort(stage[by_time].astype(np.int16 if small else np.int64), kind="stable")]


def replay(stage: np.ndarray, time: np.ndarray, delta: np.ndarray, base: np.ndarray) -> MemoryCurves:
    """Running memory per global stage from events (numpy, all stages at once)."""
    order = _event_order(stage, time, delta)  # by stage, then time, frees first when times tie
    stage, time, delta = stage[order], time[order], delta[order]
    running = np.cumsum(delta)
    starts = np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]]) if len(stage) else np.zeros(0, int)
    before = np.repeat(np.r_[0.0, running][starts], np.diff(np.r_[starts, len(stage)]))
    level = running - before + base[stage]
    peak = base.astype(np.float64).copy()
    if len(stage):
        np.maximum.at(peak, stage, level)
    return MemoryCurves(stage=stage, time=time, level=level, base=base, peak=peak)


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
    ends[held] = _nograd_ends(fwd, ends[held])
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
