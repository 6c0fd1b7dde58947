"""Per-stage bytes and seconds of the chunks of InfiniPipe units (infinipipe.txt eq. 5, 9, 19):
each chunk's activations, the bytes one recomputed layer saves, one layer's forward seconds,
and the K/V state and K/V gradients of the sequences a unit splits, as `schedule.group_memory`
charges them. Its own module because the grouping DP (`grouping.py`) asks it about many
candidate groups of the same units before any group has a schedule: the tables are memoised
per unit and per stage shape, and the capacity bounds (`held_at_most`, `surely_fit`) are
answered from them without building a memory model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.cost.flops import work_key
from lengthwise.plan.ir import Chunk
from lengthwise.planners.infinipipe.segment_arrays import SegmentArrays


@dataclass(kw_only=True)
class StageShape:
    """What one stage of the pipeline holds besides its chunks."""

    layers: int
    """Decoder layers on the stage."""
    head: bool
    """Whether the stage runs the LM head (the last stage)."""
    states: float
    """Model-state bytes (weights, gradients, optimizer) held all step."""
    grads: float = 0.0
    """The gradients' part of `states`, made by the stage's first backward (none before it)."""
    table: float = 0.0
    """The first stage's embedding gradient as its backward makes it at each backward's end
    (`cost.memory.embedding_backward_bytes`); 0 elsewhere."""


class UnitCosts:
    """Per-stage bytes and seconds of each unit's chunks, memoised: eq. 14's DP builds many
    groups from the same units. A split sequence lies wholly in one unit, so its K/V events
    are the unit's own. Stages of one shape (layers, LM head or not) share their tables, and
    without context parallelism chunks of equal work (tokens, attention pairs) share their
    costs (a mesh cuts every long sequence into the same slices)."""

    def __init__(self, cost, stages: list[StageShape], *, tp: int, cp: int):
        self.cost, self.stages, self.kw = cost, stages, {"tp": tp, "cp": cp}
        self._memo: dict[tuple, tuple[list[Chunk], np.ndarray]] = {}
        self._chunks: dict[tuple, tuple[float, float, float]] = {}
        self._prepared: list[list[Chunk]] = []
        self._cols: dict[int, tuple[int, int]] = {}
        self._batch: dict[tuple[int, bool], np.ndarray] = {}
        self._seconds_pending: dict[tuple[int, bool], tuple[list[Chunk], list]] = {}
        self.keys: list = []
        """Per prepared chunk, in order: its work (tokens, attention pairs) without context
        parallelism, where equal keys cost the same; else its id."""
        self._fwd1: dict = {}
        self._last_key: tuple | None = None
        self._last_index = np.zeros(0, dtype=np.int64)

    def table(self, stage: int, unit: list[Chunk]) -> np.ndarray:
        """float64 [6, chunks]: activation bytes, bytes saved per recomputed layer, forward
        seconds of one layer, then the three K/V rows of `kv_events`."""
        shape = self.stages[stage]
        key = (shape.layers, shape.head, id(unit))   # hashing segments is slow; the memo keeps the unit alive
        if key not in self._memo:
            rows = np.array([self._chunk(stage, c) for c in unit], dtype=float).reshape(len(unit), 3).T
            if len(unit) > 1:
                kv = kv_events(split_slices(unit), self, stage, len(unit))
            else:   # one chunk holds each of its sequences whole: no K/V state
                kv = np.zeros((3, 1))
            self._memo[key] = (unit, np.vstack([rows, kv]))
        return self._memo[key][1]

    def prepare(self, units: list[list[Chunk]]) -> None:
        """Tables of many units at once, one array per stage shape, so `columns` gathers a
        group's tables with one index instead of one small array per unit (the same numbers as
        `table`). Without context parallelism the activation rows are the cost model's bytes
        per token times each chunk's tokens (what `activation_bytes` computes), and the
        one-layer forward seconds are looked up only when a group's memory model needs them."""
        self._prepared = units     # keeps the ids below valid
        self._cols, self._last_key = {}, None
        at = 0
        for u in units:
            self._cols[id(u)] = (at, at + len(u))
            at += len(u)
        chunks = [c for u in units for c in u]
        per_token = self.kw["cp"] == 1 and not any(c.pad_to for c in chunks)
        segments = SegmentArrays.of(chunks)
        works = segments.works() if per_token else None
        if works is not None:   # work_key of unpadded chunks, summed over all segments at once
            keys = self.keys = list(zip(*works))
        else:
            keys = self.keys = [work_key(c) for c in chunks] if self.kw["cp"] == 1 else [id(c) for c in chunks]
        tokens = np.array([k[0] for k in keys], dtype=float) if per_token else None
        self._batch, self._seconds_pending = {}, {}
        # per stage shape, the largest working set of one action (backward, or the LM head's
        # forward: `mem.head_forward_bytes`) of the prepared chunks
        if works is not None and chunks and type(self.cost).backward_work_bytes is CostModel.backward_work_bytes \
                and type(self.cost).head_forward_bytes is CostModel.head_forward_bytes:
            # both grow with the chunk's tokens without CP: the most tokens give the most
            most = [chunks[int(np.argmax(tokens))]]
        else:
            most = chunks
        self._most_work = {(sh.layers, sh.head): max(self.work(sh, most), self.forward_work(sh, most)) if most else 0.0
                           for sh in self.stages}
        splits = None
        for stage, shape in enumerate(self.stages):
            if (shape.layers, shape.head) in self._batch:
                continue
            table = np.zeros((6, len(chunks)))
            if per_token:
                table[0] = self.cost.activation_bytes_rows(tokens, layers=shape.layers, tp=self.kw["tp"],
                                                           head=shape.head)
                if shape.layers:
                    table[1] = table[0] - self.cost.activation_bytes_rows(tokens, layers=shape.layers, tp=self.kw["tp"],
                                                                          recompute_layers=1, head=shape.head)
                self._seconds_pending[shape.layers, shape.head] = (chunks, keys)
            else:
                table[:3] = np.array([self._chunk(stage, c) for c in chunks], dtype=float).reshape(len(chunks), 3).T
            if splits is None:   # the same for every stage
                splits = segments.split_parts(np.array([len(u) for u in units], dtype=np.int64))
                contexts, at = np.unique(splits.context, return_inverse=True)
            splits.kv_rows(np.array([self.kv(stage, n) for n in contexts.tolist()], dtype=np.float64)[at], table[3:])
            self._batch[shape.layers, shape.head] = table

    def held_at_most(self, stage: int, units: list[list[Chunk]]) -> float:
        """A bound on every level of `StageMemory.levels` without recomputation for one group of
        these units on the stage. At the k-th backward start the chunks alive (forwarded, not yet
        backwarded, its own included) number issued_k - k <= the window pp - s - 1 + N_prefill:
        `positions` issues max(window + j, ready_j) forwards by backward j <= k, and
        ready_j - k <= ready_j - j <= its unit's chunks <= N_prefill (units go backward one
        after another); a forward's chunks alive are those of the next backward at most. So a
        level is at most the window's largest activations plus every K/V state and K/V gradient
        (frees only lower it) plus the largest working set of one action."""
        table = self._gather(stage, units)
        if table is None:
            table = self.columns(stage, units)
        window = len(self.stages) - stage - 1 + max(len(u) for u in units)
        largest = np.sort(table[0])[::-1][:window]
        shape = self.stages[stage]
        chunks = [c for u in units for c in u]
        work = max(self.work(shape, chunks), shape.table, self.forward_work(shape, chunks))
        return float(largest.sum() + table[3].sum() + table[4].sum() + work)

    def alone_surely_fits(self) -> list[bool]:
        """Per prepared unit, whether all of its chunks' activations and K/V fit every stage at
        once: then it fits alone with no recomputation (its whole unit is within the window, so
        this is `held_at_most` for the unit alone), and with any (recomputing only lowers
        every level)."""
        starts = np.cumsum([0] + [len(u) for u in self._prepared])[:-1]
        ok = np.ones(len(self._prepared), dtype=bool)
        if not len(starts):
            return []
        for shape in self.stages:
            table = self._batch[shape.layers, shape.head]
            # one backward at a time: the largest bounds it (or the embedding's gradient at its end)
            work = max(self._most_work[shape.layers, shape.head], shape.table)
            ok &= np.add.reduceat(table[0] + table[3] + table[4], starts) + work <= self.cost.capacity_bytes - shape.states
        return ok.tolist()

    def surely_fit(self, shares: list[list[int]]) -> list[bool]:
        """For each share (indices into the prepared units, one pipeline's units), whether one
        group of them has `held_at_most` within capacity less model states on every stage: the
        same bound for every pipeline at once, by one sort of all chunks per stage shape."""
        units = self._prepared
        sizes = np.array([len(u) for u in units], dtype=np.int64)
        owner = np.zeros(len(units), dtype=np.int64)
        for p, share in enumerate(shares):
            owner[share] = p
        prefill = np.zeros(len(shares), dtype=np.int64)
        np.maximum.at(prefill, owner, sizes)
        pid = np.repeat(owner, sizes)
        ok = np.array([len(share) > 0 for share in shares])
        for stage, shape in enumerate(self.stages):
            table = self._batch[shape.layers, shape.head]
            order = np.lexsort((-table[0], pid))        # by pipeline, largest activation first
            pids, act = pid[order], table[0][order]
            rank = np.arange(len(pids)) - np.searchsorted(pids, pids, side="left")
            keep = rank < (len(self.stages) - stage - 1 + prefill)[pids]
            held = np.bincount(pids[keep], weights=act[keep], minlength=len(shares))
            held += np.bincount(pid, weights=table[3] + table[4], minlength=len(shares))
            held += max(self._most_work[shape.layers, shape.head], shape.table)
            ok &= held <= self.cost.capacity_bytes - shape.states
        return ok.tolist()

    def columns(self, stage: int, units: list[list[Chunk]]) -> np.ndarray:
        """float64 [6, chunks of all units]: their `table`s side by side."""
        shape = self.stages[stage]
        pending = self._seconds_pending.pop((shape.layers, shape.head), None)
        if pending is not None:   # the one-layer forward seconds, first needed now
            chunks, keys = pending
            memo, kw, row = self._fwd1, self.kw, []
            for c, k in zip(chunks, keys):
                if k not in memo:
                    memo[k] = self.cost.forward_time(c, layers=1, **kw)
                row.append(memo[k])
            self._batch[shape.layers, shape.head][2] = row
        table = self._gather(stage, units)
        return table if table is not None else np.concatenate([self.table(stage, u) for u in units], axis=1)

    def _gather(self, stage: int, units: list[list[Chunk]]) -> np.ndarray | None:
        """The prepared tables of these units side by side; None unless all were prepared."""
        shape = self.stages[stage]
        big = self._batch.get((shape.layers, shape.head))
        if big is None or any(id(u) not in self._cols for u in units):
            return None
        key = tuple(id(u) for u in units)
        if self._last_key != key:
            cols = [self._cols[id(u)] for u in units]
            self._last_key = key
            self._last_index = np.fromiter(itertools.chain.from_iterable(range(a, b) for a, b in cols), dtype=np.int64,
                                           count=sum(b - a for a, b in cols))
        return big[:, self._last_index]

    def _chunk(self, stage: int, chunk: Chunk) -> tuple[float, float, float]:
        shape = self.stages[stage]
        key = (shape.layers, shape.head, work_key(chunk) if self.kw["cp"] == 1 else id(chunk))
        found = self._chunks.get(key)
        if found is None:
            found = self._chunks[key] = self._chunk_costs(shape, chunk)
        return found

    def _chunk_costs(self, shape: StageShape, chunk: Chunk) -> tuple[float, float, float]:
        cost = self.cost
        act = cost.activation_bytes(chunk, layers=shape.layers, head=shape.head, **self.kw)
        less = cost.activation_bytes(chunk, layers=shape.layers, head=shape.head, recompute_layers=1,
                                     **self.kw) if shape.layers else act
        return act, act - less, cost.forward_time(chunk, layers=1, **self.kw)

    def kv(self, stage: int, context: int) -> float:
        return self.cost.kv_bytes(context, layers=self.stages[stage].layers, **self.kw)

    def work(self, shape: StageShape, chunks: list[Chunk]) -> float:
        """The largest working set of one chunk's backward on a stage of this shape beyond its
        kept activations (`cost.backward_work_bytes`: the loss's on the LM-head stage, one
        layer's SwiGLU backward elsewhere); backwards run one at a time, so it bounds them all."""
        return max(self.cost.backward_work_bytes(c, layers=shape.layers, head=shape.head, **self.kw) for c in chunks)

    def forward_work(self, shape: StageShape, chunks: list[Chunk]) -> float:
        """The largest working set of one chunk's forward beyond its kept activations: the LM
        head's block of logits on the head's stage (`cost.head_forward_bytes`), 0 elsewhere."""
        if not shape.head or not chunks:
            return 0.0
        return max(self.cost.head_forward_bytes(c, **self.kw) for c in chunks)

    def forward_work_row(self, stage: int, chunks: list[Chunk]) -> np.ndarray | None:
        """float64 [chunks] each chunk's forward working set on the stage (the LM head's, as the
        simulator charges it: `cost.head_forward_bytes`); None off the head's stage."""
        if not self.stages[stage].head:
            return None
        return np.array([self.cost.head_forward_bytes(c, **self.kw) for c in chunks], dtype=float)

    def work_row(self, stage: int, chunks: list[Chunk]) -> np.ndarray:
        """float64 [chunks] each chunk's backward working set on the stage."""
        shape = self.stages[stage]
        return np.array([self.cost.backward_work_bytes(c, layers=shape.layers, head=shape.head, **self.kw)
                         for c in chunks], dtype=float)

    def recompute_rows(self, stage: int, chunks: list[Chunk],
                       work: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(float64 [chunks] what each chunk's backward holds beyond `work` once its F recomputes
        a layer, float64 [chunks] or None what it holds beyond that when it recomputes all the
        stage's layers), charged as the simulator charges them (`sim/memory_sizes.py`): the
        backward's working set with the layer it re-materialises (`cost.recompute_transient_bytes`,
        its dropped activations and the SwiGLU's product) beside a layer's backward, on the
        head's stage after the loss's rather than on top of it (`cost.backward_work_bytes` with
        `remat`), and, every layer rerun, with the moments of the recomputed layers' own nodes
        (the split SwiGLU and down projection, and the rerun's end: `rerun`) in place of the
        plain layer's, so the second row may be negative; None where the two are equal."""
        shape, cost = self.stages[stage], self.cost
        if not shape.layers:
            return np.zeros(len(chunks)), None
        transient = [cost.recompute_transient_bytes(c, recompute_layers=1, **self.kw) for c in chunks]
        with_layer = np.array([cost.backward_work_bytes(c, layers=shape.layers, head=shape.head, remat=x, **self.kw)
                               for c, x in zip(chunks, transient)], dtype=float)
        if cost.backward_work_bytes_per_token(layers=shape.layers, tp=self.kw["tp"], rerun=True) \
                == cost.backward_work_bytes_per_token(layers=shape.layers, tp=self.kw["tp"]):
            return with_layer - work, None
        full = np.array([cost.backward_work_bytes(c, layers=shape.layers, head=shape.head, remat=x, rerun=True,
                                                  **self.kw) for c, x in zip(chunks, transient)], dtype=float)
        return with_layer - work, full - with_layer


def split_slices(chunks: list[Chunk]) -> list[list[tuple[int, int, int]]]:
    """(start, tokens, chunk) of the slices of each sequence cut into several, in token order."""
    slices: dict[int, list[tuple[int, int, int]]] = {}
    for k, c in enumerate(chunks):
        for seg in c.segments:
            slices.setdefault(seg.seq_id, []).append((seg.start, seg.stop - seg.start, k))
    return [sorted(parts) for parts in slices.values() if len(parts) > 1]


def kv_events(splits: list[list[tuple[int, int, int]]], costs: UnitCosts, stage: int, n: int) -> np.ndarray:
    """float64 [3, n] K/V bytes of split sequences (sim/memory.py): earlier slices' K/V at their
    forward (later slices read it), K/V gradients at the start of the sequence's first backward,
    both freed at the end of its last backward (the first slice's)."""
    out = np.zeros((3, n))
    for parts in splits:
        context = parts[-1][0]
        kv = costs.kv(stage, context)
        for _, tokens, k in parts[:-1]:
            out[0, k] += kv * tokens / context
        out[1, parts[-1][2]] += kv
        out[2, parts[0][2]] -= 2 * kv
    return out
