"""Pipeline schedules as data: GPipe, 1F1B and ChunkFlow's state-aware 1F1B (chunkflow §4.2-4.3).

    >>> stages = make_schedule("state-aware-1f1b", chunks, pp=4, k=1)
    >>> print(format_schedule(stages))       # one column per stage
    >>> check_schedule(stages, chunks)       # UserError with the step-by-rank grid if it deadlocks

(`check_schedule` and `check_message_order`, the validator's half, are in `schedule_checks.py`.)

A schedule is one list of `Action`s per stage. Chunks of one split sequence form a *group*: a
segment with start > 0 continues the chunk that holds the sequence's previous slice, so slices
run forward in order (the K/V state of earlier slices is their context) and backward in reverse
(the K/V gradients flow back to earlier slices). With ChunkFlow's K, the first N-K chunks of a
group of N are first forwarded without keeping activations (`N`, only the K/V state stays) and
forwarded again (`F`) once a kept activation is freed: slice i re-runs after the backward of
slice i+K (for K = 1, of the next slice), so at most K chunks' activations of one sequence are
held at a time on a stage (chunkflow Algorithm 2).

GPipe runs one list of *forward items* (each chunk's first forward, in the order the chunks are
given), then one list of *backward units* (a group's chunks in reverse, each followed by the
re-forward of the slice K places earlier when that one ran `N`), in the order groups complete.
1F1B replays its first stage to fix both lists (`_first_in_first_out`): backwards first in,
first out among those allowed to run, a re-forward a forward item of its own right after the
backward that frees its memory. Every stage then runs the two lists in order, interleaved by
its own warm-up (`_one_f_one_b`).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD, Action, Chunk

SCHEDULE_NAMES = ("gpipe", "1f1b", "state-aware-1f1b")

FIRST_FORWARD = "1"
"""Dependency kind: a chunk's first forward on a stage, `N` when it has one, else `F`."""


@dataclass(frozen=True, kw_only=True)
class Dependencies:
    """Which chunks wait for which, derived from the segments (chunkflow §4.2)."""

    fwd_after: tuple[tuple[int, ...], ...]
    """Per forward chunk: chunks holding the previous slice of one of its sequences; their first
    forward must come first on the same stage."""
    bwd_after: tuple[tuple[int, ...], ...]
    """Per backward unit: units holding the next slice of one of its sequences; their backward
    must come first on the same stage."""
    bwd_needs: tuple[tuple[int, ...], ...]
    """Per backward unit: forward chunks whose activations it consumes (itself when backward
    units are the forward chunks)."""


def dependencies(chunks: list[Chunk], backward_chunks: list[Chunk] | None = None) -> Dependencies:
    """Slice-to-slice dependencies of one pipeline's chunks (and backward units, SlimPack §4.1.2)."""
    fwd_after = _previous_slices(chunks)
    if backward_chunks is None:
        nexts: list[list[int]] = [[] for _ in chunks]
        for c, preds in enumerate(fwd_after):
            for p in preds:
                nexts[p].append(c)
        return Dependencies(fwd_after=fwd_after, bwd_after=tuple(tuple(n) for n in nexts),
                            bwd_needs=tuple((u,) for u in range(len(chunks))))
    bwd_prev = _previous_slices(backward_chunks)
    nexts = [[] for _ in backward_chunks]
    for u, preds in enumerate(bwd_prev):
        for p in preds:
            nexts[p].append(u)
    return Dependencies(fwd_after=fwd_after, bwd_after=tuple(tuple(n) for n in nexts),
                        bwd_needs=_overlapping(backward_chunks, chunks))


def _previous_slices(chunks: list[Chunk]) -> tuple[tuple[int, ...], ...]:
    if not any(seg.start for ch in chunks for seg in ch.segments):
        return ((),) * len(chunks)  # no slice continues another
    ends = {(seg.seq_id, seg.stop): c for c, ch in enumerate(chunks) for seg in ch.segments}
    out = []
    for c, ch in enumerate(chunks):
        preds = []
        for seg in ch.segments:
            if seg.start == 0:
                continue
            p = ends.get((seg.seq_id, seg.start))
            if p is None:
                raise UserError(f"segment {seg} of chunk {c} continues sequence {seg.seq_id} at token "
                                f"{seg.start}, but no chunk holds a slice ending there")
            if p != c and p not in preds:
                preds.append(p)
        out.append(tuple(preds))
    return tuple(out)


def _overlapping(units: list[Chunk], chunks: list[Chunk]) -> tuple[tuple[int, ...], ...]:
    by_seq: dict[int, list[tuple[int, int, int]]] = {}
    for c, ch in enumerate(chunks):
        for seg in ch.segments:
            by_seq.setdefault(seg.seq_id, []).append((seg.start, seg.stop, c))
    out = []
    for unit in units:
        hits = {c for seg in unit.segments for (a, b, c) in by_seq.get(seg.seq_id, ())
                if a < seg.stop and seg.start < b}
        out.append(tuple(sorted(hits)))
    return tuple(out)


def chunk_groups(chunks: list[Chunk]) -> list[list[int]]:
    """Chunks linked by split sequences (connected components), each sorted, by first chunk."""
    parent = list(range(len(chunks)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for c, preds in enumerate(_previous_slices(chunks)):
        for p in preds:
            parent[root(c)] = root(p)
    groups: dict[int, list[int]] = {}
    for c in range(len(chunks)):
        groups.setdefault(root(c), []).append(c)
    return sorted(groups.values())


def make_schedule(name: str, chunks: list[Chunk], pp: int, k: int | None = None) -> list[list[Action]]:
    """Per-stage action lists for `pp` stages running `chunks` in the order given.

    `k`: ChunkFlow's K, activations kept per group (None keeps all; `state-aware-1f1b` defaults
    to 1 as the paper does). `1f1b` is state-aware 1F1B with K unbounded unless `k` is given."""
    if name not in SCHEDULE_NAMES:
        raise UserError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULE_NAMES)}")
    if pp < 1:
        raise UserError(f"pp must be at least 1, got {pp}")
    if k is not None and k < 1:
        raise UserError(f"k must be at least 1 (activations kept per split sequence), got {k}")
    if name == "state-aware-1f1b" and k is None:
        k = 1
    # The schedule depends on the chunks only through their count and slice links: pipelines of
    # one plan share a few shapes, so each shape is scheduled once (copies handed out).
    key = (name, pp, k, len(chunks), _previous_slices(chunks))
    cached = _SCHEDULES.get(key)
    if cached is None:
        forwards, units, ready = _items(chunks, k)
        if name == "gpipe":
            cached = [forwards + [a for unit in units for a in unit] for _ in range(pp)]
        else:
            # every stage runs the one forward list and the one backward list in order, so each
            # pipeline link carries its messages in one order (`check_message_order`)
            forwards, units, ready, after = _first_in_first_out(forwards, units, chunks, warmup=pp - 1)
            cached = [_one_f_one_b(forwards, units, ready, after, warmup=pp - s - 1) for s in range(pp)]
        _SCHEDULES.put(key, cached)
    return [list(stage) for stage in cached]


def _items(chunks: list[Chunk], k: int | None):
    """Forward items, backward units, and per unit how many forward items must precede it."""
    groups = chunk_groups(chunks)
    for c, preds in enumerate(_previous_slices(chunks)):
        if any(p > c for p in preds):
            raise UserError(f"chunk {c} continues a slice held by later chunk {max(preds)}: "
                            "order chunks so that each sequence's slices come in order")
    nograd = set()
    for group in groups:
        if k is not None and len(group) > k:
            nograd.update(group[: len(group) - k])   # chunkflow Algorithm 2: first N-K re-run
    forwards = [Action(FORWARD_NOGRAD if c in nograd else FORWARD, c) for c in range(len(chunks))]
    last_of = {group[-1]: group for group in groups}
    units, ready = [], []
    for c in range(len(chunks)):
        group = last_of.get(c, [])
        for j in range(len(group) - 1, -1, -1):
            # A slice's re-forward follows the backward that frees the K-th kept activation
            # after it (for K = 1: right before its own backward); 1F1B makes it a forward item
            # of its own there (`_first_in_first_out`).
            refwd = [Action(FORWARD, group[j - k])] if k is not None and j >= k and group[j - k] in nograd else []
            units.append([Action(BACKWARD, group[j])] + refwd)
            ready.append(c + 1)
    return forwards, units, ready


def _first_in_first_out(forwards: list[Action], units: list[list[Action]], chunks: list[Chunk], *,
                        warmup: int) -> tuple[list[Action], list[list[Action]], list[int], list[int]]:
    """Forward items and backward units in the order the first stage's 1F1B runs them, a
    re-forward becoming a forward item of its own (chunkflow §4.3: Algorithm 2's order under 1F1B).

    Replays the first stage: `warmup` + 1 kept forwards ahead (an `N` on top, `_one_f_one_b`),
    then one backward per kept forward. Each
    backward is of the chunk whose kept activations have waited longest among those allowed to
    run (its sequence's later slices backed off), first in, first out as 1F1B backs off
    micro-batches. A re-forward (chunkflow Algorithm 2: slice j again once slice j + K's
    backward frees its memory) is the next forward item after that backward, and its own
    backward waits its turn behind the chunks forwarded before it. So on figure 6(a)'s chunks,
    in Algorithm 1's order (the split sequence first), the re-forward's trip up the pipeline
    overlaps the packed chunks' backwards: makespan 50 units, the split sequence's own chain of
    dependencies, against 58 when the slice's backward followed its re-forward at once (the
    first stage idled while it climbed). Without re-forwards the order is `_items`'.

    Returns (forward items, backward units, per unit the forward items that must precede it,
    per forward item the unit it must follow: -1, or for a re-forward the backward freeing its
    memory)."""
    bwd_after = dependencies(chunks).bwd_after
    waits = [len(later) for later in bwd_after]
    unblocks: list[list[int]] = [[] for _ in chunks]
    for c, later in enumerate(bwd_after):
        for n in later:
            unblocks[n].append(c)
    reforward = {unit[0].chunk: unit[1:] for unit in units}
    pending, issued, ran, heap = deque((a, -1) for a in forwards), [], {}, []
    order: list[list[Action]] = []
    ready: list[int] = []

    def issue() -> None:
        action, _ = item = pending.popleft()
        issued.append(item)
        if action.kind == FORWARD:
            ran[action.chunk] = len(issued)
            if waits[action.chunk] == 0:
                heapq.heappush(heap, (ran[action.chunk], action.chunk))

    for i in range(len(units)):
        while pending and (len(ran) < warmup + i + 1 or not heap):
            issue()
        *_, c = heapq.heappop(heap)
        order.append([Action(BACKWARD, c)])
        ready.append(ran[c])
        for p in unblocks[c]:
            waits[p] -= 1
            if waits[p] == 0 and p in ran:
                heapq.heappush(heap, (ran[p], p))
        pending.extendleft((a, i) for a in reversed(reforward[c]))
    items = issued + list(pending)
    return [a for a, _ in items], order, ready, [t for _, t in items]


def _one_f_one_b(forwards, units, ready, after, *, warmup: int) -> list[Action]:
    """1F1B on one stage: warm-up forwards, then one forward per backward unit, then cool-down.

    Backward unit i comes after the (warmup + i + 1)-th forward that keeps its activations, and
    after forward item ready[i] (a group's last slice must have run forward before the group's
    backwards start). An `N` keeps none, so it runs on top of the count: 1F1B's bound is on
    chunks held (pp - stage), and counting an `N` against it would leave a late stage one
    chunk short of work while a re-forward climbs the pipeline (chunkflow figure 6(a)).
    Forward item p never runs before backward unit after[p] (a re-forward waits for the
    backward that frees its memory)."""
    kept_at = [p + 1 for p, a in enumerate(forwards) if a.kind == FORWARD]
    out: list[Action] = []
    issued = 0
    for i, unit in enumerate(units):
        # warm-up (i == 0: `warmup` forwards, then the first steady forward), steady 1F1B
        j = warmup + i
        need = max(kept_at[j] if j < len(kept_at) else len(forwards), ready[i])
        while issued < need and after[issued] < i:
            out.append(forwards[issued])
            issued += 1
        out += unit
    out += forwards[issued:]  # cool-down has no forwards left; kept for an empty unit list
    return out


def held_chunks(stage: list[Action]) -> int:
    """The most chunks whose activations one stage's action list holds at once: a chunk's from
    its `F` to its `B` (an `N` keeps only K/V state). What a memory model must multiply a
    chunk's activations by: 1F1B's warm-up bounds it by pp - stage for independent chunks, but
    state-aware 1F1B can hold more where a group's later slices must all run forward before its
    first backward (K above pp - stage)."""
    held = most = 0
    for a in stage:
        if a.kind == FORWARD:
            held += 1
            most = max(most, held)
        elif a.kind == BACKWARD:
            held -= 1
    return most


def format_schedule(stages: list[list[Action]]) -> str:
    """Position-by-stage table of a schedule, one column per stage."""
    rows = max((len(s) for s in stages), default=0)
    head = "pos  " + "".join(f"stage{s:<4d}" for s in range(len(stages)))
    lines = [head]
    for i in range(rows):
        cells = "".join(f"{str(st[i]) if i < len(st) else '':<9s}" for st in stages)
        lines.append(f"{i:3d}  {cells}".rstrip())
    return "\n".join(lines)


def action_needs(action: Action, stage: int, deps: Dependencies, pp: int) -> list[tuple[int, str, int]]:
    """Tasks `(stage, kind, index)` that must finish before `action` may start on `stage`.

    Kind FIRST_FORWARD names a chunk's first forward (N or F). Forward-type actions follow the
    same kind on the stage before; backwards follow the stage after (pipeline data edges)."""
    c = action.chunk
    if action.kind == BACKWARD:
        needs = [(stage, FORWARD, f) for f in deps.bwd_needs[c]]
        needs += [(stage, BACKWARD, later) for later in deps.bwd_after[c]]  # K/V grads flow back
        if stage + 1 < pp:
            needs.append((stage + 1, BACKWARD, c))
        return needs
    needs = [(stage, FIRST_FORWARD, p) for p in deps.fwd_after[c]]  # K/V state of earlier slices
    if stage > 0:
        needs.append((stage - 1, action.kind, c))
    return needs


class ShapeCache(dict):
    """A dict that forgets everything when it reaches `limit` entries (bounded memory; the
    shapes of one plan or one search are what repeat)."""

    def __init__(self, limit: int = 2048):
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value


_SCHEDULES = ShapeCache()
"""make_schedule's results by (name, pp, k, chunk count, slice links)."""
