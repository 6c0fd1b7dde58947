"""PackFlow 1F1B (slimpack.txt §4.2): forward MicroPacks and separately grouped backward
MicroPacks on one pipeline.

    stages = packflow_schedule(chunks, units, pp)                # B actions index `units`
    stages = packflow_schedule(chunks, units, pp, lean=True)     # lower memory, more bubbles

Stage s runs pp - s - 1 warm-up forwards, then alternates one backward unit with one forward
(steady state), then drains the remaining backwards (cool-down), as 1F1B does. Forward
MicroPacks go in FIFO order; backward unit i additionally waits until every forward MicroPack
it reads has run on the stage (§4.2: a sample's backward starts only after all its slices'
forwards). When that dependency is not met at its 1F1B slot, the stage runs extra forwards
first: the "injected forward MicroPack" of §4.2 / figure 9, plus its own pp - s - 1 warm-up
forwards again, so the upper stages keep computing while the first backward climbs back to
them. Units are already in FILO order within each sample (slimpack/cuts.py), so the K/V-gradient
edges between them point backwards in the list and never stall a stage.

After the injection, two ways to go on (steady is faster, lean holds less memory; `lengthwise
plan --planner slimpack --schedule steady|lean` prints each one's simulated step and peak):

- steady (default): keep the forwards that were run ahead, so every later backward still has
  one forward to pair with and the pipeline never drains again; the run-ahead stays in memory.
- lean: let the backwards that became ready run back to back until the stage is back to its
  1F1B count of forwards in flight; memory falls back, but each burst leaves the upper stages
  idle for about pp - 1 backwards of the stage below.
"""

from __future__ import annotations

import numpy as np

from lengthwise.plan.ir import BACKWARD, FORWARD, Action, Chunk
from lengthwise.plan.schedules import dependencies


def forwards_needed(chunks: list[Chunk], units: list[Chunk]) -> list[int]:
    """Per backward unit: how many forward MicroPacks (a prefix) must run before it."""
    deps = dependencies(chunks, units)
    ready, out = 0, []
    for needs in deps.bwd_needs:
        ready = max([ready] + [c + 1 for c in needs])
        out.append(ready)
    return out


_ACTIONS: dict[str, list[Action]] = {FORWARD: [], BACKWARD: []}
"""Action(kind, i) for i = 0, 1, ...: frozen, so every schedule shares one instance of each."""


def _actions(kind: str, upto: int) -> list[Action]:
    """_ACTIONS[kind], at least `upto` long (grown by a new list, never in place: a list once
    handed out stays index-true)."""
    made = _ACTIONS[kind]
    if len(made) < upto:
        made = _ACTIONS[kind] = made + [Action(kind, i) for i in range(len(made), upto)]
    return made


def packflow_stage(num_chunks: int, ready: list[int], warmup: int, *, lean: bool = False) -> list[Action]:
    """One stage: warm-up forwards, steady 1F1B (with injected forwards), cool-down backwards."""
    out: list[Action] = []
    issued = 0
    forward, backward = _actions(FORWARD, num_chunks), _actions(BACKWARD, len(ready))
    for i, need_ready in enumerate(ready):
        # 1F1B slot, the unit's own dependency plus this stage's warm-up, and (steady) one more
        # forward than the last backward had
        need = max(warmup + i + 1, need_ready + warmup, 0 if lean else issued + 1)
        need = min(num_chunks, need)
        if need > issued:
            out += forward[issued:need]
        issued = max(issued, need)
        out.append(backward[i])
    assert issued == num_chunks, "every forward MicroPack must be read by some backward unit"
    return out


def packflow_schedule(chunks: list[Chunk], units: list[Chunk], pp: int, *, lean: bool = False,
                      ready: list[int] | None = None) -> list[list[Action]]:
    """Per-stage action lists; forward actions index `chunks`, backward actions index `units`.
    `ready`: forwards_needed(chunks, units) when the caller knows it already (cuts.backward_units_ready)."""
    if ready is None:
        ready = forwards_needed(chunks, units)
    if not ready:  # packflow_stage reports a schedule that runs no backward
        return [packflow_stage(len(chunks), ready, warmup=pp - s - 1, lean=lean) for s in range(pp)]
    return packflow_stages(len(chunks), ready, pp, lean=lean)


def packflow_stages(num_chunks: int, ready: list[int], pp: int, *, lean: bool = False) -> list[list[Action]]:
    """packflow_stage of every stage at once with numpy. Forwards issued by unit i on a stage
    with `w` warm-up forwards, a_i = max(w + i + 1, ready_i + w) capped at the chunk count C:
    steady issues max(a_i, issued_{i-1} + 1), so issued_i = min(C, i + max_{j<=i} (a_j - j));
    lean issues a_i, so issued_i = max_{j<=i} min(C, a_j). Unit i's backward follows them, at
    position issued_i + i of the stage."""
    C, U = num_chunks, len(ready)
    i = np.arange(U)
    w = (pp - 1 - np.arange(pp))[:, None]
    a = np.maximum(w + i + 1, np.asarray(ready, dtype=np.int64) + w)
    if lean:
        issued = np.maximum.accumulate(np.minimum(a, C), axis=1)
    else:
        issued = np.minimum(C, i + np.maximum.accumulate(a - i, axis=1))
    assert (issued[:, -1] == C).all(), "every forward MicroPack must be read by some backward unit"
    is_b = np.zeros((pp, C + U), dtype=bool)
    is_b[np.arange(pp)[:, None], issued + i] = True
    index = np.where(is_b, C + np.cumsum(is_b, axis=1) - 1, np.cumsum(~is_b, axis=1) - 1)
    actions = np.empty(C + U, dtype=object)
    actions[:C], actions[C:] = _actions(FORWARD, C)[:C], _actions(BACKWARD, U)[:U]
    return actions[index].tolist()


def packflow_stages_many(num_chunks: list[int], ready: list[list[int]], pp: int, *,
                         lean: bool = False) -> list[list[list[Action]]]:
    """packflow_stages of many pipelines (each with at least one backward unit) at once: the
    same arithmetic over every pipeline's units laid end to end, the running maxima restarted at
    each pipeline (each one's values lifted above all before it), so the same action lists."""
    P = len(num_chunks)
    C = np.asarray(num_chunks, dtype=np.int64)
    U = np.array([len(r) for r in ready], dtype=np.int64)
    ustart = np.concatenate([[0], np.cumsum(U)[:-1]]).astype(np.int64)
    pipe = np.repeat(np.arange(P), U)                            # each unit's pipeline
    i = np.arange(int(U.sum())) - ustart[pipe]                   # and its index there
    r = np.fromiter((x for row in ready for x in row), dtype=np.int64, count=int(U.sum()))
    w = (pp - 1 - np.arange(pp))[:, None]
    a = np.maximum(w + i + 1, r + w)
    lift = pipe * (2 * (int(C.max(initial=0)) + int(U.max(initial=0)) + pp + 2))   # every value below is >= 0
    if lean:
        issued = np.maximum.accumulate(np.minimum(a, C[pipe]) + lift, axis=1) - lift
    else:
        issued = np.minimum(C[pipe], i + np.maximum.accumulate(a - i + lift, axis=1) - lift)
    assert (issued[:, ustart + U - 1] == C).all(), "every forward MicroPack must be read by some backward unit"
    # per pipeline a [stage, C + U] block: which places hold a backward, then which action each is
    width = C + U
    base = np.concatenate([[0], np.cumsum(pp * width)[:-1]]).astype(np.int64)
    row = base[pipe] + np.arange(pp)[:, None] * width[pipe]      # each (stage, unit)'s row start
    is_b = np.zeros(int((pp * width).sum()), dtype=bool)
    is_b[row + issued + i] = True
    rows = np.repeat(np.arange(P * pp), np.repeat(width, pp))    # row of each place
    starts = np.concatenate([[0], np.cumsum(np.repeat(width, pp))[:-1]])
    nb = np.cumsum(is_b) - np.concatenate([[0], np.cumsum(is_b)])[starts][rows]   # backwards up to here
    at = np.arange(len(is_b)) - starts[rows]                     # place within the row
    fwd = np.asarray(_actions(FORWARD, int(C.max(initial=0))) + [None], dtype=object)
    bwd = np.asarray(_actions(BACKWARD, int(U.max(initial=0))) + [None], dtype=object)
    acts = np.where(is_b, bwd[np.where(is_b, nb - 1, -1)], fwd[np.where(is_b, -1, at - nb)]).tolist()
    bounds = np.concatenate([[0], np.cumsum(np.repeat(width, pp))]).tolist()
    return [[acts[bounds[p * pp + s]:bounds[p * pp + s + 1]] for s in range(pp)] for p in range(P)]
