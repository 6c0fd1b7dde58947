"""Can a pipeline's messages stall on NCCL? A replay of the rendezvous rule over the action lists.

    >>> check_rendezvous(pipe.stages, pipeline=0)                  # the executor's posting
    >>> find_stall(pipe.stages, discipline=LONE)                    # the posting before issue 27
    Stall(...)

Gloo buffers a send, so a gloo run never shows what this checks. NCCL does not: a large send
completes only once the peer has posted the matching receive (NVIDIA/nccl issues 479, 783),
matching is by order per ordered pair of ranks, and operations on one communicator run one
after the other on its stream. The model, for one pipeline (one rank per stage: CP and TP
ranks repeat their stage's schedule, and an empty message is skipped at both ends):

- every stage runs a *program*: post a batch of operations, or wait until an operation of an
  earlier batch completed (the compute that follows needs its tensor);
- a posted batch joins the queue of its stream and is in flight once every batch before it on
  that stream completed;
- a send and its receive (the n-th send from a to b and the n-th receive at b from a) complete
  together, once both are in flight; a batch completes when all its operations did.

Disciplines (how a stage turns its action list into a program):

- LONE, the executor before issue 27: before an action `irecv` + wait, after it a lone `isend`.
  Lone operations go to the rank pair's own communicator: one stream per neighbour.
- DEFERRED, a design not taken: each action's send held back and posted in one batch with the
  receive of the stage's next action (one stream per rank). It runs 1F1B, but stalls where a
  stage runs an action between sending F(i) and receiving B(j) while its neighbour runs one
  between sending B(j) and receiving F(i): each batch then holds a send whose receive is in the
  peer's next batch.
- BATCHED, the executor's (`plan/messages.py`): the exchanges of `stage_exchanges`, each one
  `batch_isend_irecv` on the group's communicator (one stream per rank), and before an
  action a wait for the receive it needs.

In steady-state 1F1B, stage s sends F(i) to s + 1 and then needs B(j) back, while s + 1 sends
B(j) and then needs F(i): under LONE both sends sit first on their pair's stream, each waiting
for a receive queued behind the other send, and neither completes. A replay that ends with
stages still waiting is a stall; as pipeline ranks form a path, the stall holds two operations
on one link that wait for each other, and `Stall` names both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lengthwise.errors import UserError
from lengthwise.plan.ir import Action
from lengthwise.plan.messages import Exchange, Message, action_messages, pipeline_messages, schedule_shape

LONE = "lone"
DEFERRED = "deferred"
BATCHED = "batched"
DISCIPLINES = (LONE, DEFERRED, BATCHED)


@dataclass(frozen=True, kw_only=True)
class Operation:
    """One side of one message on one stage."""

    stage: int
    send: bool
    message: Message
    action: int
    """Index of the stage's action it serves: the one whose output it sends, or whose input it
    receives."""

    def describe(self, stages: list[list[Action]]) -> str:
        m, action = self.message, stages[self.stage][self.action]
        if self.send:
            return (f"stage {self.stage}'s send of the {m.what} of {m.kind}{m.chunk} to stage {m.dst} "
                    f"(output of its action {self.action}, {action})")
        return (f"stage {self.stage}'s receive of the {m.what} of {m.kind}{m.chunk} from stage {m.src} "
                f"(input of its action {self.action}, {action})")


@dataclass(frozen=True, kw_only=True)
class Stall:
    """Two operations on one link, each in flight and each waiting for the other side, whose
    matching operation is queued behind (or posted after) the other; `second` is None when the
    first one's counterpart is never posted at all."""

    discipline: str
    first: Operation
    second: Operation | None

    def describe(self, stages: list[list[Action]]) -> str:
        a = self.first.stage
        b = self.first.message.dst if self.first.send else self.first.message.src
        head = (f"pipeline messages stall under NCCL's rule (a send completes only once the peer "
                f"posted the matching receive) with {self.discipline} posting: on the link between "
                f"stages {min(a, b)} and {max(a, b)}, {self.first.describe(stages)} is in flight")
        if self.second is None:
            return f"{head}, but stage {b} never posts the matching operation"
        return (f"{head} while {self.second.describe(stages)} is in flight; each waits for a "
                "matching operation the other stage posts only after its own, so neither completes")


def find_stall(stages: list[list[Action]], *, discipline: str = BATCHED, pipeline: int = 0) -> Stall | None:
    """Replay the stages' programs under the rule of the module docstring; the stall, or None
    when every operation completes."""
    shape = (discipline, schedule_shape(stages))
    if shape in _STALL_FREE:
        return None
    key = (discipline, pipeline, shape[1])
    if key not in _REPLAYED:
        programs, build = _programs(stages, discipline, pipeline)
        pending = _replay(programs, build)
        if not pending:  # the pipeline index only labels the messages: every pipeline of this shape is free
            if len(_STALL_FREE) >= 1024:
                _STALL_FREE.clear()
            _STALL_FREE.add(shape)
            return None
        if len(_REPLAYED) >= 256:
            _REPLAYED.clear()
        _REPLAYED[key] = _stall(pending, build, discipline)
    return _REPLAYED[key]


_STALL_FREE: set[tuple] = set()
"""(discipline, schedule) pairs whose replay completed: the messages' pipeline index names them
but takes no part in matching them (links are keyed by stages and order), so one replay answers
for every pipeline of that schedule (hydraulis' 512 pipelines at 1024 GPUs have a few dozen)."""
_REPLAYED: dict[tuple, Stall | None] = {}
"""find_stall's stalls by (discipline, pipeline, schedule), whose description names the
pipeline: the validator meets one plan's schedules again in the executor's checks."""


def check_rendezvous(stages: list[list[Action]], *, discipline: str = BATCHED, pipeline: int = 0) -> None:
    """UserError naming the pipeline, the link and both waiting operations if the pipeline's
    messages would stall on NCCL (`find_stall`)."""
    try:
        stall = find_stall(stages, discipline=discipline, pipeline=pipeline)
    except UserError as exc:
        raise UserError(f"pipeline {pipeline}: {exc}") from None
    if stall is not None:
        raise UserError(f"pipeline {pipeline}: {stall.describe(stages)}")


# the programs ------------------------------------------------------------------------------

POST, WAIT = "post", "wait"


@dataclass(kw_only=True)
class _Batch:
    stream: tuple[int, ...]
    ops: list[int]


class _Builder:
    """Collects operations and batches; numbers each operation on its ordered link (NCCL's
    matching key) in posting order."""

    def __init__(self):
        self.ops: list[Operation] = []
        self.keys: list[tuple[int, int, int, bool]] = []
        self.batches: list[_Batch] = []
        self._count: dict[tuple[int, int, bool], int] = {}

    def op(self, stage: int, send: bool, message: Message, action: int) -> int:
        link = (message.src, message.dst, send)
        n = self._count.get(link, 0)
        self._count[link] = n + 1
        self.ops.append(Operation(stage=stage, send=send, message=message, action=action))
        self.keys.append((message.src, message.dst, n, send))
        return len(self.ops) - 1

    def batch(self, stream: tuple[int, ...], ops: list[int]) -> tuple[str, int]:
        self.batches.append(_Batch(stream=stream, ops=ops))
        return POST, len(self.batches) - 1


def _programs(stages: list[list[Action]], discipline: str, pipeline: int):
    if discipline not in DISCIPLINES:
        raise UserError(f"unknown posting discipline {discipline!r}: choose one of {', '.join(DISCIPLINES)}")
    build = _Builder()
    if discipline != BATCHED:  # needs no rounds: replays schedules the batching refuses too
        pp, make = len(stages), _lone_program if discipline == LONE else _deferred_program
        return [make(build, s, [action_messages(a, pipeline=pipeline, stage=s, num_stages=pp) for a in acts])
                for s, acts in enumerate(stages)], build
    messages = pipeline_messages(stages, pipeline)
    return [_batched_program(build, s, io, exchanges)
            for s, (io, exchanges) in enumerate(zip(messages.io, messages.exchanges))], build

def _lone_program(build: _Builder, s: int, io) -> list[tuple[str, int]]:
    program, sends = [], []
    for i, (received, sent) in enumerate(io):
        if received is not None:
            op = build.op(s, False, received, i)
            program += [build.batch((s, received.src), [op]), (WAIT, op)]
        if sent is not None:
            sends.append(build.op(s, True, sent, i))
            program.append(build.batch((s, sent.dst), [sends[-1]]))
    return program + [(WAIT, op) for op in sends]


def _deferred_program(build: _Builder, s: int, io) -> list[tuple[str, int]]:
    program, sends, held = [], [], None
    for i, (received, _) in enumerate([*io, (None, None)]):
        ops = [] if held is None else [build.op(s, True, held, i - 1)]
        sends += ops
        if received is not None:
            ops.append(build.op(s, False, received, i))
        if ops:
            program.append(build.batch((s,), ops))
        if received is not None:
            program.append((WAIT, ops[-1]))
        held = io[i][1] if i < len(io) else None
    return program + [(WAIT, op) for op in sends]


def _batched_program(build: _Builder, s: int, io, exchanges: tuple[Exchange, ...]) -> list[tuple[str, int]]:
    produced = {sent: i for i, (_, sent) in enumerate(io) if sent is not None}
    consumed = {received: i for i, (received, _) in enumerate(io) if received is not None}
    waits: dict[Message, int] = {}
    by_point: dict[int, list] = {}
    sends = []
    for exchange in exchanges:
        ops = [build.op(s, True, m, produced[m]) for m in exchange.sends]
        sends += ops
        for m in exchange.recvs:
            waits[m] = build.op(s, False, m, consumed.get(m, len(io) - 1))
            ops.append(waits[m])
        by_point.setdefault(exchange.before, []).append(build.batch((s,), ops))
    program = []
    for i in range(len(io) + 1):
        program += by_point.get(i, [])
        received = io[i][0] if i < len(io) else None
        if received is not None:
            program.append((WAIT, waits[received]))
    return program + [(WAIT, op) for op in sends]


# the replay --------------------------------------------------------------------------------

def _replay(programs, build: _Builder) -> list[int]:
    """Run every program as far as the rule lets it; the operations still in flight at the end
    (empty when everything completed)."""
    batches = build.batches
    where = {key: i for i, key in enumerate(build.keys)}
    partner = [where.get((src, dst, n, not send)) for src, dst, n, send in build.keys]
    batch_of = [0] * len(build.ops)
    for b, batch in enumerate(batches):
        for op in batch.ops:
            batch_of[op] = b
    done = [False] * len(build.ops)
    left = [len(batch.ops) for batch in batches]
    streams: dict[tuple[int, ...], deque[int]] = {}
    pc = [0] * len(programs)

    def in_flight(op: int) -> bool:
        queue = streams.get(batches[batch_of[op]].stream)
        return bool(queue) and queue[0] == batch_of[op]

    moved = True
    while moved:
        moved = False
        for s, program in enumerate(programs):
            while pc[s] < len(program):
                step, x = program[pc[s]]
                if step == POST:
                    streams.setdefault(batches[x].stream, deque()).append(x)
                elif not done[x]:
                    break
                pc[s] += 1
                moved = True
        for queue in streams.values():
            while queue:
                for op in batches[queue[0]].ops:
                    other = partner[op]
                    if not done[op] and other is not None and in_flight(other):
                        done[op] = done[other] = True
                        left[batch_of[op]] -= 1
                        left[batch_of[other]] -= 1
                        moved = True
                if left[queue[0]]:
                    break
                queue.popleft()
    return [op for queue in streams.values() if queue for op in batches[queue[0]].ops if not done[op]]


def _stall(pending: list[int], build: _Builder, discipline: str) -> Stall:
    """Two pending operations on one link that wait for each other (a cycle of waits among the
    ranks of a path always has one), or the first pending operation alone."""
    ops = build.ops

    def peer(op: Operation) -> int:
        return op.message.dst if op.send else op.message.src

    by_pair = {}
    for op in sorted(pending, key=lambda o: (ops[o].stage, ops[o].action)):
        by_pair.setdefault((ops[op].stage, peer(ops[op])), op)
    for (s, p), op in sorted(by_pair.items()):
        if (p, s) in by_pair:
            return Stall(discipline=discipline, first=ops[op], second=ops[by_pair[p, s]])
    where = {key: i for i, key in enumerate(build.keys)}
    unmatched = [op for op in pending if (*build.keys[op][:3], not build.keys[op][3]) not in where]
    first = min(unmatched or pending, key=lambda o: (ops[o].stage, ops[o].action))
    return Stall(discipline=discipline, first=ops[first], second=None)
