"""One InfiniPipe 1F1B pipeline *group*: its schedule and its memory as a linear function of the
recomputed layers (infinipipe.txt §3.1.3-3.1.4, eq. 5-10, 19).

    group = group_schedule([unit.chunks for unit in units], pp)
    memory = group_memory(group, UnitCosts(cost, stages, tp=8, cp=1))
    memory.stages[s].levels(r)          # bytes held at each backward start of stage s

Schedule (eq. 7): stage s (0-based) keeps a *window* of pp - s - 1 + N_prefill chunks between
their forward and backward, N_prefill being the most chunks one sequence of the group is split
into; chunks go forward in the order given and backward unit by unit, each unit's chunks in
reverse (a split sequence's last slice first, f2b). With N_prefill = 1 this is plain 1F1B.

Memory is charged exactly as the simulator's replay charges it (sim/memory.py, sim/inputs.py):
activations of a chunk from its F to the end of its B, fewer when its F recomputes r layers
(I[k] - F[k] * r, eq. 19), with the difference re-materialised during its B; K/V state of a
split sequence's earlier slices from their forward to the sequence's last backward, and its
K/V gradients from its first backward to the same end (eq. 5, 9), and on the LM head's stage
each forward's head working set while it runs (`cost.head_forward_bytes`). Nothing is freed
between a forward and the next action's start, so every peak lies at some backward's start or,
on the head's stage, some forward's: one linear row per backward (and forward) per stage. Levels for given r come from prefix sums in O(n log n); the dense
rows are only built for the MILP.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.cost.flops import work_key
from lengthwise.plan.ir import BACKWARD, FORWARD, Action, Chunk


@dataclass(kw_only=True)
class GroupSchedule:
    """One 1F1B pipeline of whole units (eq. 14's P) before checkpointing."""

    units: list[list[Chunk]]
    """The units, in forward order; their chunks concatenated are `chunks`."""
    chunks: list[Chunk]
    """Forward order."""
    backward_order: np.ndarray
    """int [n] chunk at each backward position."""
    ready: np.ndarray
    """int [n] forwards that must precede each backward (its unit's last chunk included)."""
    prefill: int
    """N_prefill: the most chunks of one sequence in this group."""
    pp: int
    """Stages."""
    f2b: np.ndarray
    """int [n] backward position of each chunk (eq. 16's f2b)."""

    def positions(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """Index of each chunk's F and of its B in the stage's action list: warm-up up to the
        window (eq. 7), then one forward per backward, then cool-down."""
        n = len(self.chunks)
        window = self.pp - stage - 1 + self.prefill
        steps = np.arange(n)
        issued = np.maximum.accumulate(np.minimum(n, np.maximum(window + steps, self.ready)))
        bpos = np.empty(n, dtype=int)
        bpos[self.backward_order] = steps + issued          # the forwards issued so far precede it
        fpos = steps + np.searchsorted(issued, steps, side="right")
        return fpos, bpos

    def stage_actions(self, stage: int, recompute: list[int] | None = None, offset: int = 0) -> list[Action]:
        """The stage's action list, each F carrying its recomputed layers; chunk indices are
        shifted by `offset` (the chunks of earlier groups of the pipeline)."""
        fpos, bpos = self.positions(stage)
        acts: list[Action] = [_action(FORWARD, 0, 0)] * (2 * len(self.chunks))
        layers = [int(r) for r in recompute] if recompute is not None else [0] * len(self.chunks)
        for k, (f, b, r) in enumerate(zip(fpos.tolist(), bpos.tolist(), layers), start=offset):
            acts[f] = _action(FORWARD, k, r)
            acts[b] = _action(BACKWARD, k, 0)
        return acts

    @property
    def stages(self) -> list[list[Action]]:
        """Per stage actions without recomputation."""
        return [self.stage_actions(s) for s in range(self.pp)]


@functools.lru_cache(maxsize=1 << 16)
def _action(kind: str, chunk: int, recompute: int) -> Action:
    """Actions are immutable, so the pipelines of a plan share them (building a frozen
    dataclass costs more than the dictionary lookup)."""
    return Action(kind, chunk, recompute)


def group_schedule(unit_chunks: list[list[Chunk]], pp: int) -> GroupSchedule:
    """Forward in the order given; backward unit by unit, each unit's chunks in reverse."""
    chunks, backward, ready = [], [], []
    for unit in unit_chunks:
        first = len(chunks)
        chunks += unit
        backward += range(len(chunks) - 1, first - 1, -1)
        ready += [len(chunks)] * len(unit)
    order = np.asarray(backward, dtype=int)
    f2b = np.empty(len(chunks), dtype=int)
    f2b[order] = np.arange(len(chunks))
    return GroupSchedule(units=list(unit_chunks), chunks=chunks, backward_order=order, ready=np.asarray(ready, dtype=int),
                         prefill=max((len(u) for u in unit_chunks), default=1), pp=pp, f2b=f2b)


_SEGMENTS, _FIELDS = operator.attrgetter("segments"), operator.attrgetter("seq_id", "start", "stop")


@dataclass(frozen=True, kw_only=True)
class SegmentArrays:
    """Every segment of a list of chunks, chunk by chunk, as int64 arrays."""

    counts: np.ndarray
    """[chunk] its segments."""
    seq_id: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    @classmethod
    def of(cls, chunks: list[Chunk]) -> SegmentArrays:
        segments = list(itertools.chain.from_iterable(map(_SEGMENTS, chunks)))
        flat = np.fromiter(itertools.chain.from_iterable(map(_FIELDS, segments)), dtype=np.int64,
                           count=3 * len(segments)).reshape(len(segments), 3)
        return cls(counts=np.fromiter(map(len, map(_SEGMENTS, chunks)), dtype=np.int64, count=len(chunks)),
                   seq_id=flat[:, 0], start=flat[:, 1], stop=flat[:, 2])

    def works(self) -> tuple[list[int], list[int]] | None:
        """(Chunk.num_tokens, Chunk.attention_pairs) of every chunk, as int64 sums (exact: the
        same integers); None where a sum could leave int64."""
        start, stop = self.start, self.stop
        if len(stop) and int(stop.max()) ** 2 * len(stop) >= 2**62:
            return None
        ends = np.concatenate([[0], np.cumsum(self.counts)])
        per_chunk = lambda x: np.diff(np.concatenate([[0], np.cumsum(x)])[ends])
        return per_chunk(stop - start).tolist(), per_chunk((stop * (stop + 1) - start * (start + 1)) // 2).tolist()

    def split_parts(self, sizes: np.ndarray) -> SplitParts:
        """`split_slices` of every unit of more than one chunk (`sizes`: chunks per unit, the
        chunks being the units' in order), flat: sequences by unit, then by first appearance
        in it, each one's slices by (start, tokens, chunk), as `kv_events` walks them."""
        col = np.repeat(np.arange(len(self.counts)), self.counts)
        unit = np.repeat(np.arange(len(sizes)), sizes)[col]
        idx = np.flatnonzero(sizes[unit] > 1)
        by_seq = idx[np.lexsort((idx, self.seq_id[idx], unit[idx]))]
        heads = np.flatnonzero(_changes(unit[by_seq]) | _changes(self.seq_id[by_seq]))
        parts = np.diff(np.r_[heads, len(by_seq)])
        first_seen = np.repeat(by_seq[heads], parts)       # each segment's sequence's first segment in its unit
        keep = np.repeat(parts > 1, parts)
        sel, rank = by_seq[keep], first_seen[keep]
        tokens = self.stop[sel] - self.start[sel]
        order = np.lexsort((col[sel], tokens, self.start[sel], rank))
        sel, rank, tokens = sel[order], rank[order], tokens[order]
        starts = _changes(rank)
        heads = np.flatnonzero(starts)
        lasts = np.r_[heads[1:], len(sel)][:len(heads)] - 1
        earlier = np.ones(len(sel), dtype=bool)
        earlier[lasts] = False
        group = np.cumsum(starts) - 1
        return SplitParts(col=col[sel][earlier], tokens=tokens[earlier], group=group[earlier],
                          context=self.start[sel][lasts], last=col[sel][lasts], first=col[sel][heads])


def _changes(x: np.ndarray) -> np.ndarray:
    """bool [n]: where x differs from the element before (True at 0)."""
    out = np.ones(len(x), dtype=bool)
    out[1:] = x[1:] != x[:-1]
    return out


@dataclass(frozen=True, kw_only=True)
class SplitParts:
    """The slices of the split sequences of many units (SegmentArrays.split_parts)."""

    col: np.ndarray
    """[slice] chunk (column) of each slice but its sequence's last."""
    tokens: np.ndarray
    """[slice] its tokens."""
    group: np.ndarray
    """[slice] its sequence (0, 1, ... in order)."""
    context: np.ndarray
    """[sequence] start of its last slice."""
    last: np.ndarray
    """[sequence] chunk of its last slice."""
    first: np.ndarray
    """[sequence] chunk of its first slice."""

    def kv_rows(self, kv: np.ndarray, out: np.ndarray) -> None:
        """Add `kv_events` of every sequence (`kv`: float64 [sequence] K/V bytes of its context)
        into out[3, chunks], in kv_events' order (the same sums)."""
        g = self.group
        np.add.at(out[0], self.col, kv[g] * self.tokens / self.context[g])
        np.add.at(out[1], self.last, kv)
        np.add.at(out[2], self.first, -(2 * kv))


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

    def rerun_row(self, stage: int, chunks: list[Chunk], saving: np.ndarray, work: np.ndarray) -> np.ndarray | None:
        """float64 [chunks] what each chunk's backward holds beyond `work` and one re-materialised
        layer (`saving`) when every layer of the stage is recomputed (`cost.backward_work_bytes`
        with `rerun`: the rerun's end under sequence parallelism); None where it never adds."""
        shape, cost = self.stages[stage], self.cost
        if not shape.layers or cost.backward_work_bytes_per_token(layers=shape.layers, tp=self.kw["tp"], rerun=True) \
                == cost.backward_work_bytes_per_token(layers=shape.layers, tp=self.kw["tp"]):
            return None
        full = np.array([cost.backward_work_bytes(c, layers=shape.layers, head=shape.head, remat=x, rerun=True,
                                                  **self.kw) for c, x in zip(chunks, saving.tolist())], dtype=float)
        return np.maximum(full - saving - work, 0.0)


@dataclass(kw_only=True)
class StageMemory:
    """Bytes one stage holds at each of its backward starts and, where its forwards have a
    working set (the LM head's stage), at each forward (model states excluded)."""

    fpos: np.ndarray
    """int [n] action index of each chunk's F."""
    bpos: np.ndarray
    """int [n] action index of each chunk's B."""
    act: np.ndarray
    """float64 [n] activation bytes of each chunk without recomputation."""
    saving: np.ndarray
    """float64 [n] bytes each recomputed layer of a chunk saves."""
    kv: np.ndarray
    """float64 [3, n] K/V bytes allocated at each chunk's F, at its B's start, and (negative,
    freed) at its B's end."""
    work: np.ndarray | None = None
    """float64 [n] bytes each chunk's B works on while it runs (the loss's backward on the LM
    head's stage, one layer's elsewhere: `cost.backward_work_bytes`); None: nothing."""
    forward_work: np.ndarray | None = None
    """float64 [n] bytes each chunk's F works on while it runs beside the activations it keeps
    (the LM head's logits on the head's stage: `cost.head_forward_bytes`); None: nothing, and
    no forward rows (every peak is then at a backward's start)."""
    grads: float = 0.0
    """Gradient bytes (part of the model states the limit leaves out) that the stage's first
    backward makes: not yet held at its start, all held from its end (`StageShape.grads`)."""
    table: float = 0.0
    """The embedding's gradient at each backward's end (first stage, `StageShape.table`):
    then the backward's own chunk is freed and, after the first backward, every gradient made."""
    rerun: np.ndarray | None = None
    """float64 [n] bytes each chunk's B holds beyond `work` and its re-materialised layer when
    it recomputes all `layers` (`UnitCosts.rerun_row`); None: nothing."""
    layers: int = 0
    """The stage's layers."""

    @property
    def rows(self) -> np.ndarray:
        """Chunks in backward order: the chunk whose backward starts each row."""
        return np.argsort(self.bpos)

    def levels(self, recompute: np.ndarray | None = None) -> np.ndarray:
        """float64 [n] bytes held at each backward start, with r[k] layers recomputed, then,
        with `forward_work`, [n] more: the bytes held while each chunk's F runs."""
        rows = self.rows
        kept = self.act - (self.saving * recompute if recompute is not None else 0.0)
        p = self.bpos[rows]
        # alive chunks (and K/V of earlier slices, minus what finished backwards freed) ...
        held = _prefix(self.fpos, kept + self.kv[0])(p) - _prefix(self.bpos, kept - self.kv[2])(p)
        # ... plus what the backward re-materialises of its own F, one recomputed layer at a time
        # (the executor checkpoints per layer: `CostModel.recompute_transient_bytes`), and the K/V
        # gradients, and the backward's working set (the loss's on the head's stage)
        remat = self.saving * np.minimum(recompute, 1.0) if recompute is not None else 0.0
        if recompute is not None and self.rerun is not None:  # every layer rerun: its end
            remat = remat + np.where(recompute >= self.layers, self.rerun, 0.0)
        own = remat + (self.work if self.work is not None else 0.0) + np.zeros_like(self.act)
        first = rows[:1]
        if self.table:  # the embedding's backward at the end: its own chunk freed, the table made
            end = self.table - kept + np.zeros_like(self.act)
            end[first] += self.grads   # and, in the first backward, every gradient
            own = np.maximum(own, end)
        level = held + own[rows] + _at_or_before(self.bpos, self.kv[1], p)
        level[:1] -= self.grads   # no gradient before the first backward's end
        if self.forward_work is None:
            return level
        return np.concatenate([level, self._forward_levels(kept)])

    def row_levels(self) -> np.ndarray:
        """`levels()` with each backward's own chunk charged what its rerun adds beyond the
        layers that recomputing them all frees (`rerun`): the start of eq. 20's linear rows,
        which charge that chunk its full activations whatever it recomputes (`savings`)."""
        level = self.levels()
        if self.rerun is not None:
            rows = self.rows
            level[:len(rows)] += np.maximum(self.rerun - (self.layers - 1) * self.saving, 0.0)[rows]
        return level

    def _forward_levels(self, kept: np.ndarray) -> np.ndarray:
        """float64 [n] bytes held while each chunk's F runs: the chunks forwarded so far (its own
        kept activations allocated at its start) less those whose backwards ended, the K/V of
        earlier slices and the K/V gradients allocated by then, and its own working set."""
        q = self.fpos
        held = _at_or_before(self.fpos, kept + self.kv[0], q) - _prefix(self.bpos, kept - self.kv[2])(q)
        level = held + _at_or_before(self.bpos, self.kv[1], q) + self.forward_work
        if self.grads:  # forwards before the first backward's end hold no gradient
            level = level - np.where(q < self.bpos.min(initial=0), self.grads, 0.0)
        return level

    def savings(self) -> np.ndarray:
        """float64 [rows of `levels`, n chunks] bytes one recomputed layer of each chunk saves at
        each backward start (eq. 19's F[k] on the chunks alive there, 0 for the backward's own)
        and, with `forward_work`, while each F runs (its own chunk's included: exact there).

        Linear for the MILP, so conservative for the backward's own chunk: `levels` charges it
        its kept bytes plus one re-materialised layer, at most its full activations, which is
        what this row assumes it holds (the plan is then checked with `levels`)."""
        rows = self.rows
        p = self.bpos[rows][:, None]
        alive = (self.fpos[None, :] < p) & (self.bpos[None, :] > p)
        if self.forward_work is not None:  # each F's rows: its own chunk's kept bytes are exact
            q = self.fpos[:, None]
            alive = np.vstack([alive, (self.fpos[None, :] <= q) & (self.bpos[None, :] > q)])
        return alive * self.saving[None, :]


def _prefix(pos: np.ndarray, values: np.ndarray):
    """p -> sum of the values whose position is before p."""
    order = np.argsort(pos)
    sums = np.concatenate([[0.0], np.cumsum(values[order])])
    return lambda p: sums[np.searchsorted(pos[order], p, side="left")]


def _at_or_before(pos: np.ndarray, values: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Sum of the values whose position is p or before, for each p."""
    order = np.argsort(pos)
    sums = np.concatenate([[0.0], np.cumsum(values[order])])
    return sums[np.searchsorted(pos[order], p, side="right")]


@dataclass(kw_only=True)
class MemoryModel:
    """Linear memory of one group's stages (eq. 19)."""

    stages: list[StageMemory]
    limit: np.ndarray
    """float64 [stage] capacity minus model states (Algorithm 2 line 1, per stage)."""
    max_layers: np.ndarray
    """int [stage] layers a chunk may recompute there."""
    layer_seconds: np.ndarray
    """float64 [stage, chunks] forward seconds of one layer (the price of recomputing it, eq. 17)."""

    def peak(self, stage: int, recompute) -> float:
        """Highest bytes the stage holds (model states excluded) with these recomputed layers."""
        return float(self.stages[stage].levels(np.asarray(recompute, float)).max(initial=0.0))


def group_memory(group: GroupSchedule, costs: UnitCosts, *, first_group: bool = False) -> MemoryModel:
    """The linear memory model of a group on every stage. `first_group`: the group opens its
    pipeline's step, so its first backward on each stage makes the gradients, which no stage
    holds before (`StageShape.grads`); a later group holds them throughout. The planner builds
    groups before it orders them and charges every group as a later one, which bounds the
    first from above."""
    stages, seconds = [], []
    for s in range(group.pp):
        table = costs.columns(s, group.units)
        fpos, bpos = group.positions(s)
        chunks = [c for u in group.units for c in u]
        work = costs.work_row(s, chunks)
        stages.append(StageMemory(fpos=fpos, bpos=bpos, act=table[0], saving=table[1], kv=table[3:], work=work,
                                  forward_work=costs.forward_work_row(s, chunks),
                                  grads=costs.stages[s].grads if first_group else 0.0, table=costs.stages[s].table,
                                  rerun=costs.rerun_row(s, chunks, table[1], work), layers=costs.stages[s].layers))
        seconds.append(table[2])
    return MemoryModel(stages=stages, limit=np.array([costs.cost.capacity_bytes - st.states for st in costs.stages]),
                       max_layers=np.array([st.layers for st in costs.stages]),
                       layer_seconds=np.array(seconds).reshape(group.pp, len(group.chunks)))


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
