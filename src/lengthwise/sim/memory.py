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
  one layer's SwiGLU backward elsewhere: `CostModel.backward_work_bytes`; in the last stage's
  last B its first layer's beside the head unit's fp32 reduce-scatter input and shard,
  `sim/memory_sizes.head_reduce_scatter_work`), and on the last stage
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
The simulator builds every pipeline's events at once (`sim/plan_memory.py`), the same events as
`memory_events` gives pipeline by pipeline.
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
        ends = nograd_ends(fwd, nograd[ran_nograd]) if sizes.nograd_held else nograd[ran_nograd]
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


def nograd_ends(fwd: np.ndarray, nograd: np.ndarray) -> np.ndarray:
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
