"""Memory replay: what each stage holds along the simulated timeline (infinipipe.txt §3.1).

Each stage holds its model states for the whole step, plus allocations tied to tasks:

- activations of a chunk, from the start of its F to the end of the last B that consumes it
  (fewer bytes when the F keeps only checkpoints of `recompute_layers` layers; the B then
  re-materialises the difference while it runs: a transient);
- the working set of a no-grad forward (N): one layer's activations while it runs;
- K/V state of a split sequence's earlier slices, from the slice's first forward to the
  sequence's last backward on the stage (later slices attend to it: infinipipe eq. 5);
- K/V gradients of a split sequence, from the start of its last slice's backward to the end of
  its first slice's (earlier slices receive them: infinipipe eq. 9-10).

Tasks on one stage are numbered in schedule order, so "the last backward" is the largest task
id, which needs no timing. Events are `(task, at_end, bytes)`; `replay` sorts all stages'
events at once with numpy (frees before allocations at equal times) and takes running sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import Chunk
from lengthwise.plan.schedules import Dependencies
from lengthwise.sim.dag import PipelineTasks


@dataclass(kw_only=True)
class MemorySizes:
    """Sizes of one pipeline's allocations, per stage (bytes, or any consistent unit)."""

    state: list[float]
    """[stage] model states held all step."""
    activation: list[list[float]]
    """[stage][chunk] activations held from F to B, as the stage's F action keeps them."""
    recompute_extra: list[list[float]]
    """[stage][chunk] bytes re-materialised during the B of a chunk whose F recomputes layers."""
    nograd_transient: list[list[float]]
    """[stage][chunk] working set of the chunk's N while it runs."""
    kv: list[dict[int, float]]
    """[stage] bytes of K/V state per split sequence id, summed over its earlier slices."""
    kv_grad: list[dict[int, float]]
    """[stage] bytes of K/V gradient buffers per split sequence id."""


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


def split_sequences(chunks: list[Chunk], units: list[Chunk]) -> list[SplitSequence]:
    """Sequences cut into more than one slice in a pipeline's forward chunks."""
    slices: dict[int, list[tuple[int, int, int]]] = {}
    for c, ch in enumerate(chunks):
        for seg in ch.segments:
            slices.setdefault(seg.seq_id, []).append((seg.start, seg.stop, c))
    holders: dict[int, set[int]] = {}
    for u, ch in enumerate(units):
        for seg in ch.segments:
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
                  splits: list[SplitSequence]) -> tuple[list[int], list[bool], list[float]]:
    """(task, at_end, delta) allocation events of one pipeline, task ids local to it."""
    task, at_end, delta = [], [], []

    def add(tid: int, end: bool, amount: float) -> None:
        if amount:
            task.append(tid), at_end.append(end), delta.append(amount)

    consumers = _consumers(deps, len(t.fwd_id[0]) if t.fwd_id else 0)
    for s in range(len(t.fwd_id)):
        fwd, bwd, nograd = t.fwd_id[s], t.bwd_id[s], t.nograd_id[s]
        for c, users in enumerate(consumers):
            if not users:  # a chunk no backward unit reads holds nothing past its forward
                continue
            release = max(bwd[u] for u in users)
            add(fwd[c], False, sizes.activation[s][c])
            add(release, True, -sizes.activation[s][c])
            extra = sizes.recompute_extra[s][c]
            for u in users:
                add(bwd[u], False, extra), add(bwd[u], True, -extra)
            if nograd[c] >= 0:
                add(nograd[c], False, sizes.nograd_transient[s][c])
                add(nograd[c], True, -sizes.nograd_transient[s][c])
        for seq in splits:
            b_ids = [bwd[u] for u in seq.units]
            kv, grad = sizes.kv[s].get(seq.seq_id, 0.0), sizes.kv_grad[s].get(seq.seq_id, 0.0)
            total = 0.0
            for c, tokens in seq.first_fwd:
                share = kv * tokens / max(seq.context, 1)
                add(t.first_id[s][c], False, share)
                total += share
            add(max(b_ids), True, -total)
            add(min(b_ids), False, grad), add(max(b_ids), True, -grad)
    return task, at_end, delta


def _consumers(deps: Dependencies, num_chunks: int) -> list[list[int]]:
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


def replay(stage: np.ndarray, time: np.ndarray, delta: np.ndarray, base: np.ndarray) -> MemoryCurves:
    """Running memory per global stage from events (numpy, all stages at once)."""
    order = np.lexsort((delta > 0, time, stage))  # frees first when times tie
    stage, time, delta = stage[order], time[order], delta[order]
    running = np.cumsum(delta)
    starts = np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]]) if len(stage) else np.zeros(0, int)
    before = np.repeat(np.r_[0.0, running][starts], np.diff(np.r_[starts, len(stage)]))
    level = running - before + base[stage]
    peak = base.astype(np.float64).copy()
    if len(stage):
        np.maximum.at(peak, stage, level)
    return MemoryCurves(stage=stage, time=time, level=level, base=base, peak=peak)
