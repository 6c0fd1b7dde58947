"""Cells: how the executor runs a pipeline whose backward is grouped apart from its forward
(SlimPack §4.1.2, `PipelinePlan.backward_chunks`).

A *cell* is the part of one forward chunk that one backward unit holds. Every backward segment
is a whole forward segment or a sub-range of one (`plan.validate.check_backward_units`), so the
segments of backward unit u that lie in forward chunk c, in c's row order, are cell (c, u).
Example, forward chunks `0[0:6]` and `0[6:10]+1[0:4]`, backward units `0[5:6]+0[6:10]` and
`1[0:4]+0[0:5]` (FIFO across samples, FILO within one):

    cell 0 = 0[0:5]    chunk 0, unit 1        F0 runs cells 0, 1   (1 reads 0's K/V as context)
    cell 1 = 0[5:6]    chunk 0, unit 0        F1 runs cells 2, 3
    cell 2 = 0[6:10]   chunk 1, unit 0        B0 runs cells 2, 1   (each hands dK/dV of 0[0:5]
    cell 3 = 1[0:4]    chunk 1, unit 1        B1 runs cells 3, 0    and 0[5:6] back, as ever)

Each cell is its own autograd graph: `F c` runs c's cells one after the other, each a packed row
whose earlier pieces of a sequence (in earlier cells or chunks) are K/V context read from the
state store as detached leaves, exactly as a slice of a split sequence reads the slices before
it (chunkflow §4.2). `B u` backwards u's cells, later chunks first, and hands the dK/dV of the
context leaves to the earlier pieces, whose own backward (in this unit or a later one) adds
them as roots. So a backward unit propagates exactly its own tokens' gradients: the sum over
units is the full gradient, with no graph kept twice and no row backwarded twice. When a plan
has no backward_chunks, cells are its chunks and nothing changes.

Messages: `F c` sends one tensor, its cells' output rows concatenated in the cells' forward
order (a permutation of c's row); `B u` sends one tensor, the input gradients of u's cells in
u's backward order. Both ends know the order from the plan, and the sizes are the plan's:
c's tokens forward, u's tokens backward.

Cost, against running each forward chunk as one graph:
- compute: the same FLOPs. Forward attention of a piece against the K/V of earlier pieces of
  its sequence is the same work as the causal block of the whole row; backward of unit u is
  the backward of u's tokens only (what the simulator charges, `cost.backward_time(u)`). But
  `F c` runs as m_c smaller rows (m_c = backward units touching c): m_c times the kernel
  launches per layer and GEMMs of about T_c / m_c rows, and on a CP-sharded segment cut into
  pieces one K/V all-gather per piece instead of one. The time this costs on a CPU is
  measured by benchmarks/bench_split_overhead.py (benchmarks/results/split_overhead*.json:
  rows cut into 2, 4 and 8 pieces against whole rows). Backwarding whole retained chunk graphs once per touching unit (linear
  superposition, also exact) would instead repeat about m_c times each chunk's backward.
- memory: activations of a cell are freed by its unit's backward, so a chunk's activations go
  in parts, never later than the last unit touching it (the simulator frees them cell by cell
  too, `sim/memory.py`; under CP it keeps a chunk's until its last unit: an upper bound). Extra: the K/V *gradients* of a piece whose sequence a backward
  boundary cuts, from the later piece's backward to its own (2 x tokens x kv-dim per layer,
  infinipipe eq. 10), also for a short sequence that only the backward grouping cuts (the
  simulator counts K/V state and gradients only for sequences the forward chunks split). The
  K/V of earlier pieces kept as context are copied into the store's per-sequence buffers
  (`state.py`), so a cell's graph-attached K/V and the stored copy coexist until its backward.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, Action, Chunk, PipelinePlan, Segment
from lengthwise.runtime.state import SliceKey, last_uses


@dataclass(frozen=True, kw_only=True)
class CellMap:
    """One pipeline's cells and which of them each action runs."""

    cells: tuple[Chunk, ...]
    """Every cell's segments, in forward order (by chunk, then by position in the chunk)."""
    chunk_of: tuple[int, ...]
    """Per cell: its forward chunk."""
    unit_of: tuple[int, ...]
    """Per cell: its backward unit."""
    forward: tuple[tuple[int, ...], ...]
    """Per forward chunk: the cells `F c` / `N c` run, in order."""
    backward: tuple[tuple[int, ...], ...]
    """Per backward unit: the cells `B u` runs, in order (later chunks first)."""

    def cells_of(self, action: Action) -> tuple[int, ...]:
        return self.backward[action.chunk] if action.kind == BACKWARD else self.forward[action.chunk]


def cell_map(pipe: PipelinePlan) -> CellMap:
    """The cells of a pipeline (its chunks when it has no backward_chunks)."""
    if pipe.backward_chunks is None:
        ids = tuple(range(len(pipe.chunks)))
        return CellMap(cells=tuple(pipe.chunks), chunk_of=ids, unit_of=ids,
                       forward=tuple((c,) for c in ids), backward=tuple((c,) for c in ids))
    per_chunk = _group_by_chunk(pipe.chunks, pipe.backward_chunks)
    cells, chunk_of, unit_of, forward = [], [], [], []
    for c, groups in enumerate(per_chunk):
        order = _forward_order(c, groups)
        forward.append(tuple(range(len(cells), len(cells) + len(order))))
        for u in order:
            cells.append(Chunk(tuple(seg for _, seg in sorted(groups[u]))))
            chunk_of.append(c)
            unit_of.append(u)
    backward = [[] for _ in pipe.backward_chunks]
    for i in range(len(cells) - 1, -1, -1):  # later chunks first: later pieces of a sequence first
        backward[unit_of[i]].append(i)
    return CellMap(cells=tuple(cells), chunk_of=tuple(chunk_of), unit_of=tuple(unit_of),
                   forward=tuple(forward), backward=tuple(tuple(b) for b in backward))


def _group_by_chunk(chunks: list[Chunk], units: list[Chunk]) -> list[dict[int, list]]:
    """Per forward chunk: unit -> [((row position, start), segment)] of its segments there."""
    spans: dict[int, list[tuple[int, int, int, int]]] = {}
    for c, chunk in enumerate(chunks):
        for pos, seg in enumerate(chunk.segments):
            spans.setdefault(seg.seq_id, []).append((seg.start, seg.stop, c, pos))
    out: list[dict[int, list]] = [{} for _ in chunks]
    for u, unit in enumerate(units):
        for seg in unit.segments:
            c, pos = _holder(spans.get(seg.seq_id, []), seg, u)
            out[c].setdefault(u, []).append(((pos, seg.start), seg))
    return out


def _holder(spans: list[tuple[int, int, int, int]], seg: Segment, u: int) -> tuple[int, int]:
    for start, stop, c, pos in spans:
        if start <= seg.start and seg.stop <= stop:
            return c, pos
    raise UserError(f"backward unit {u}: segment {seg} is not inside one forward segment of sequence "
                    f"{seg.seq_id}: a backward unit may only hold whole forward segments or sub-ranges of one")


def _forward_order(c: int, groups: dict[int, list]) -> list[int]:
    """The units of chunk c's cells in an order that forwards every sequence's pieces in token
    order (a piece's context must be in the store before it runs): topological, ties by row."""
    pieces = sorted((seg.seq_id, seg.start, u) for u, segs in groups.items() for _, seg in segs)
    after: dict[int, set[int]] = {u: set() for u in groups}
    waits = dict.fromkeys(groups, 0)
    for (q, _, u), (q2, _, u2) in itertools.pairwise(pieces):
        if q == q2 and u != u2 and u2 not in after[u]:
            after[u].add(u2)
            waits[u2] += 1
    first_row = {u: min(key for key, _ in segs) for u, segs in groups.items()}
    ready = [(first_row[u], u) for u, n in waits.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for v in after[u]:
            waits[v] -= 1
            if waits[v] == 0:
                heapq.heappush(ready, (first_row[v], v))
    if len(order) < len(groups):
        stuck = sorted(set(groups) - set(order))
        raise UserError(f"chunk {c}: backward units {stuck} interleave the pieces of a sequence in it "
                        "(unit A holds an earlier and a later piece, unit B one in between): give each "
                        "backward unit one contiguous range per forward segment")
    return order


def cell_last_uses(actions: list[Action], cmap: CellMap, lengths: list[int]) -> dict[int, list[SliceKey]]:
    """action index -> the pieces whose K/V state nothing after that action needs
    (`state.last_uses` over the cell actions the stage's actions expand to)."""
    index_of, expanded = [], []
    for index, action in enumerate(actions):
        for cell in cmap.cells_of(action):
            index_of.append(index)
            expanded.append(Action(action.kind, cell))
    frees: dict[int, list[SliceKey]] = {}
    for j, keys in last_uses(expanded, list(cmap.cells), lengths).items():
        frees.setdefault(index_of[j], []).extend(keys)
    return frees
