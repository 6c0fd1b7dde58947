"""Proofs that a pipeline schedule (`schedules.py`) runs: `check_schedule` replays it in
lock-step and, when it cannot run, raises UserError with the step-by-rank grid, the failing
actions marked `<-- ERROR HERE`; `check_message_order` proves every pipeline link carries its
messages in one order at both ends. Its own module because it is the validator's half of
schedules as data: the generators in `schedules.py` never call it (`validate.py` and the
simulator's task graph do), and most of its code is the error report (the grid, the waits named).
"""

from __future__ import annotations

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD, Action, Chunk
from lengthwise.plan.schedules import FIRST_FORWARD, Dependencies, ShapeCache, action_needs, dependencies


def schedule_key(stages: list[list[Action]], deps: Dependencies, num_chunks: int, num_units: int) -> tuple:
    """Everything a schedule's feasibility and task graph depend on, as one hashable value: the
    actions (kind, chunk, recomputed layers) of every stage, the slice dependencies and the
    chunk and unit counts — not the chunks' token counts. Pipelines of one plan (and plans of one
    planner's search) repeat a few shapes, so proofs and task graphs are kept per key."""
    return (tuple(tuple((a.kind, a.chunk, a.recompute_layers) for a in acts) for acts in stages),
            deps, num_chunks, num_units)


_PROVEN = ShapeCache()
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
