"""Pipeline schedules as data: GPipe, 1F1B and ChunkFlow's state-aware 1F1B (chunkflow §4.2-4.3).

    >>> stages = make_schedule("state-aware-1f1b", chunks, pp=4, k=1)
    >>> print(format_schedule(stages))       # one column per stage
    >>> check_schedule(stages, chunks)       # UserError with the step-by-rank grid if it deadlocks

A schedule is one list of `Action`s per stage. Chunks of one split sequence form a *group*: a
segment with start > 0 continues the chunk that holds the sequence's previous slice, so slices
run forward in order (the K/V state of earlier slices is their context) and backward in reverse
(the K/V gradients flow back to earlier slices). With ChunkFlow's K, the first N-K chunks of a
group of N are first forwarded without keeping activations (`N`, only the K/V state stays) and
forwarded again (`F`) once a kept activation is freed: slice i re-runs right after the
backward of slice i+K (for K = 1, right before its own backward), so at most K chunks'
activations of one sequence are held at a time (chunkflow Algorithm 2) while the re-forward's
trip down the pipeline overlaps the K-1 backwards in between.

Every generator here interleaves one list of *forward items* (each chunk's first forward, in the
order the chunks are given) with one list of *backward units* (a group's chunks in reverse, each
followed by the re-forward of the slice K places earlier when that one ran `N`), in the order
groups complete.
"""

from __future__ import annotations

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
            cached = align_forward_order([_one_f_one_b(forwards, units, ready, warmup=pp - s - 1)
                                          for s in range(pp)])
        _SCHEDULES.put(key, cached)
    return [list(stage) for stage in cached]


def align_forward_order(stages: list[list[Action]]) -> list[list[Action]]:
    """Give every stage the first stage's forward order, keeping each stage's interleaving.

    1F1B stages differ in warm-up, so a re-forward (ChunkFlow's `F` after `N`) lands after more
    first forwards on early stages than on late ones; the link between them would then carry
    messages in two orders (see `check_message_order`). Each stage keeps its own pattern of
    forward and backward slots and fills its forward slots with the first stage's forwards in
    order, with two rules: a backward whose forward has not run yet pulls the next forwards in
    first (later forward slots then stay empty until the debt is paid), and a re-forward waits
    for the backward it follows on the first stage (the one that frees its memory, chunkflow
    Algorithm 2), so no stage re-forwards a slice before the stage after it could."""
    forwards = [a for a in stages[0] if a.kind != BACKWARD]
    triggers = _reforward_triggers(stages[0])
    return [_refill(stage, forwards, triggers) for stage in stages]


def _reforward_triggers(stage: list[Action]) -> dict[int, int]:
    """Re-forwarded chunk -> the backward unit it follows on this stage."""
    triggers, nograd, last_backward = {}, set(), None
    for a in stage:
        if a.kind == FORWARD_NOGRAD:
            nograd.add(a.chunk)
        elif a.kind == BACKWARD:
            last_backward = a.chunk
        elif a.chunk in nograd and last_backward is not None:
            triggers[a.chunk] = last_backward
    return triggers


def _refill(stage: list[Action], forwards: list[Action], triggers: dict[int, int]) -> list[Action]:
    out: list[Action] = []
    issued, slots, kept, backwards = 0, 0, set(), set()

    def issue() -> None:
        nonlocal issued, slots
        action = forwards[issued]
        out.append(action)
        if action.kind == FORWARD:
            kept.add(action.chunk)
        issued, slots = issued + 1, slots - 1

    def ready() -> bool:
        action = forwards[issued]
        return action.kind != FORWARD or triggers.get(action.chunk, -1) in backwards | {-1}

    for action in stage:
        if action.kind != BACKWARD:
            slots += 1
        else:
            while action.chunk not in kept and issued < len(forwards):
                issue()
            out.append(action)
            backwards.add(action.chunk)
        while slots > 0 and issued < len(forwards) and ready():
            issue()
    while issued < len(forwards):
        issue()
    return out


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
            # after it (for K = 1: right before its own backward), so its trip down the
            # pipeline overlaps the backwards in between.
            refwd = [Action(FORWARD, group[j - k])] if k is not None and j >= k and group[j - k] in nograd else []
            units.append([Action(BACKWARD, group[j])] + refwd)
            ready.append(c + 1)
    return forwards, units, ready


def _one_f_one_b(forwards, units, ready, *, warmup: int) -> list[Action]:
    """1F1B on one stage: warm-up forwards, then one forward per backward unit, then cool-down.

    Backward unit i comes after forward item max(warmup + i + 1, ready[i]): a group's last slice
    must have run forward before the group's backwards start."""
    out: list[Action] = []
    issued = 0
    for i, unit in enumerate(units):
        # warm-up (i == 0: `warmup` forwards, then the first steady forward), steady 1F1B
        need = min(len(forwards), max(warmup + i + 1, ready[i]))
        out += forwards[issued:need]
        issued = need
        out += unit
    out += forwards[issued:]  # cool-down has no forwards left; kept for an empty unit list
    return out


def held_chunks(stage: list[Action]) -> int:
    """The most chunks whose activations one stage's action list holds at once: a chunk's from
    its `F` to its `B` (an `N` keeps only K/V state). What a memory model must multiply a
    chunk's activations by: 1F1B's warm-up bounds it by pp - stage for independent chunks, but
    state-aware 1F1B can hold more on late stages (forwards that fill the first stage's warm-up
    come in its order, ahead of a group's re-forwards: `align_forward_order`)."""
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


def schedule_key(stages: list[list[Action]], deps: Dependencies, num_chunks: int, num_units: int) -> tuple:
    """Everything a schedule's feasibility and task graph depend on, as one hashable value: the
    actions (kind, chunk, recomputed layers) of every stage, the slice dependencies and the
    chunk and unit counts — not the chunks' token counts. Pipelines of one plan (and plans of one
    planner's search) repeat a few shapes, so proofs and task graphs are kept per key."""
    return (tuple(tuple((a.kind, a.chunk, a.recompute_layers) for a in acts) for acts in stages),
            deps, num_chunks, num_units)


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


_PROVEN = ShapeCache()
_SCHEDULES = ShapeCache()
"""make_schedule's results by (name, pp, k, chunk count, slice links)."""
"""Schedule keys already proven to run to the end."""


def check_schedule(stages: list[list[Action]], chunks: list[Chunk],
                   backward_chunks: list[Chunk] | None = None) -> None:
    """Prove a schedule runs to the end: replay it in lock-step (each stage issues its next action
    once the action's dependencies finished in an earlier step). On failure raise UserError with
    the step-by-rank grid, the failing actions marked `<-- ERROR HERE`. A schedule whose key
    (`schedule_key`) was proven before is not replayed again."""
    deps = dependencies(chunks, backward_chunks)
    units = len(chunks if backward_chunks is None else backward_chunks)
    key = schedule_key(stages, deps, len(chunks), units)
    if key in _PROVEN:
        return
    _replay_schedule(stages, chunks, backward_chunks, deps)
    _PROVEN.put(key, True)


def _replay_schedule(stages: list[list[Action]], chunks: list[Chunk], backward_chunks: list[Chunk] | None,
                     deps: Dependencies) -> None:
    sizes = {FORWARD: len(chunks), FORWARD_NOGRAD: len(chunks),
             BACKWARD: len(chunks if backward_chunks is None else backward_chunks)}
    pp, done, pos, grid = len(stages), set(), [0] * len(stages), []
    while any(pos[s] < len(stages[s]) for s in range(pp)):
        row = [""] * pp
        for s in range(pp):
            if pos[s] == len(stages[s]):
                continue
            action = stages[s][pos[s]]
            problem = _static_problem(action, s, done, sizes)
            if problem:
                _fail(grid, {s: action}, f"stage {s} {action}: {problem}")
            if all(n in done for n in action_needs(action, s, deps, pp)):
                row[s] = str(action)
        if not any(row):
            _fail(grid, {s: stages[s][pos[s]] for s in range(pp) if pos[s] < len(stages[s])},
                  "deadlock: " + "; ".join(_waits(stages, pos, done, deps)))
        for s in range(pp):
            if row[s]:
                a = stages[s][pos[s]]
                done.update({(s, a.kind, a.chunk), (s, FIRST_FORWARD, a.chunk)} if a.kind != BACKWARD
                            else {(s, a.kind, a.chunk)})
                pos[s] += 1
        grid.append(row)
    _check_complete(grid, done, pp, sizes)


def check_message_order(stages: list[list[Action]]) -> None:
    """Prove every pipeline link carries its messages in the same order at both ends.

    Point-to-point messages are matched by order, not by tag (NCCL has no tags), so stage s must
    send its forward outputs (F and N) in the order stage s + 1 runs those forwards, and stage
    s + 1 must send its input gradients (B) in the order stage s runs those backwards. Hence
    every stage runs the same forward order and the same backward order; only how the two
    interleave differs from stage to stage. Raise UserError naming the link and the first
    message that differs."""
    for s in range(len(stages) - 1):
        for label, kinds, sender, receiver in (("forward", (FORWARD, FORWARD_NOGRAD), s, s + 1),
                                               ("backward", (BACKWARD,), s + 1, s)):
            sent = _messages(stages[sender], kinds)
            received = _messages(stages[receiver], kinds)
            if sent != received:
                i = next((i for i, (a, b) in enumerate(zip(sent, received)) if a != b),
                         min(len(sent), len(received)))
                raise UserError(
                    f"{label} messages from stage {sender} to stage {receiver} arrive out of order: "
                    f"message {i} is {_name(sent, i)} when sent but {_name(received, i)} when "
                    f"received (sender order {_window(sent, i)}, receiver order "
                    f"{_window(received, i)}); every stage must run its forwards (and its "
                    f"backwards) in one order")


def _messages(actions: list[Action], kinds: tuple[str, ...]) -> list[str]:
    return [f"{a.kind}{a.chunk}" for a in actions if a.kind in kinds]


def _name(messages: list[str], i: int) -> str:
    return messages[i] if i < len(messages) else "nothing"


def _window(messages: list[str], i: int, width: int = 3) -> str:
    lo = max(0, i - width)
    return ("... " if lo else "") + " ".join(messages[lo:i + width]) + (" ..." if i + width < len(messages) else "")


def _static_problem(action: Action, s: int, done: set, sizes: dict[str, int]) -> str | None:
    if not 0 <= action.chunk < sizes[action.kind]:
        return f"index {action.chunk} out of range (0..{sizes[action.kind] - 1})"
    if (s, action.kind, action.chunk) in done:
        return "runs twice on this stage"
    if action.kind == FORWARD_NOGRAD and (s, FORWARD, action.chunk) in done:
        return f"N{action.chunk} after F{action.chunk}: the no-grad forward must come first"
    return None


def _waits(stages, pos, done, deps) -> list[str]:
    pp, out = len(stages), []
    for s in range(pp):
        if pos[s] == len(stages[s]):
            continue
        action = stages[s][pos[s]]
        ns, kind, idx = next(n for n in action_needs(action, s, deps, pp) if n not in done)
        runs = any(a.chunk == idx and (a.kind == kind or (kind == FIRST_FORWARD and a.kind != BACKWARD))
                   for a in stages[ns][pos[ns]:])
        name = f"{'F/N' if kind == FIRST_FORWARD else kind}{idx} on stage {ns}"
        note = ("" if not runs else ", which comes later in its own list" if ns == s
                else f", which stage {ns} has not reached")
        out.append(f"stage {s} {action} waits for {name}"
                   + (note if runs else f", which stage {ns} never runs after this point"))
    return out


def _check_complete(grid, done, pp, sizes) -> None:
    for s in range(pp):
        for kind in (FORWARD, BACKWARD):
            missing = [i for i in range(sizes[kind]) if (s, kind, i) not in done]
            if missing:
                _fail(grid, {}, f"stage {s} never runs {', '.join(f'{kind}{i}' for i in missing[:8])}")


def _fail(grid: list[list[str]], failing: dict[int, Action], reason: str, *, tail: int = 40) -> None:
    pp = len(grid[0]) if grid else max(failing, default=0) + 1
    width = max([9] + [len(c) + 2 for row in grid for c in row])
    lines = [f"schedule cannot run: {reason}",
             "step  " + "".join(f"{'stage' + str(s):<{width}s}" for s in range(pp))]
    if len(grid) > tail:
        lines.append(f" ...  ({len(grid) - tail} earlier steps)")
    for i in range(max(0, len(grid) - tail), len(grid)):
        lines.append(f"{i:4d}  " + "".join(f"{c:<{width}s}" for c in grid[i]).rstrip())
    last = [str(failing[s]) if s in failing else "" for s in range(pp)]
    lines.append(f"{len(grid):4d}  " + "".join(f"{c:<{width}s}" for c in last).rstrip() + "  <-- ERROR HERE")
    raise UserError("\n".join(lines))
