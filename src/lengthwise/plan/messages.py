"""Pipeline messages as data: what each action receives and sends, and when a stage posts them.

    >>> received, sent = action_messages(Action("F", 3), pipeline=0, stage=1, num_stages=4)
    >>> exchanges = stage_exchanges(pipe.stages)[1]     # what stage 1 posts, batch by batch

Every action moves at most one tensor in and one out (`runtime/stage.py` runs exactly this):

    F c / N c on stage s   receives c's activation from s - 1 (s > 0), sends its own to s + 1
    B u on stage s         receives u's gradient from s + 1 (s < pp - 1), sends its own to s - 1

so the plan fixes every message of a step; the executor (`StageRunner`) and the rendezvous
check (`plan/rendezvous.py`) both read them from here, so the two cannot drift apart. (The
same-order check, `schedule_checks.check_message_order`, compares the F/N and B orders these imply.)

When a stage posts them (the executor's discipline). NCCL pairs a send with the peer's receive
posted in the same order on the same communicator, and a large send does not complete before
that receive is posted (NVIDIA/nccl issues 479, 783). Each stage therefore posts its messages in
*exchanges*, one `batch_isend_irecv` each, derived from one global clock that every rank
computes alike from the plan:

1. Replay the pipeline in lock-step rounds: in round r each stage runs its next action if the
   message that action receives was sent in a round before r. The round of a message is the
   round of the action that sends it.
2. A stage posts the messages of round r, sends and receives alike, as one exchange at its
   point P(r) = the number of its own actions of rounds <= r: the sender right after the action
   that produced the message, the receiver after its own actions of rounds <= r, which is
   before the action that consumes it (that one runs in a later round). Exchanges of several
   rounds at one point are posted one after the other, in round order.

Why no rank can wait forever (rounds as a clock): assume every exchange of rounds < r
completed. Then every action of a round <= r can run (its input is from an earlier round), so
every rank reaches P(r) and posts its exchange of round r; all earlier exchanges on its stream
are complete, so the exchanges of round r of all ranks are in flight together and each of
their operations finds its counterpart, which has the same round. So round r completes, and by
induction every round does. The same holds with a CP or TP group's collectives inside an
action: the ranks of one stage run one schedule, in the same rounds, so each reaches the action
under the same assumption. (Collectives between pipelines, FSDP's, are outside this argument.)
The price is synchronisation and memory, not a stall: a stage's exchanges complete in round
order, so it may wait for a neighbour's exchange of round r before one of a later round that it
needs sooner, and a receive posted rounds before its action holds its buffer that long.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, Action


@dataclass(frozen=True, kw_only=True)
class Message:
    """One tensor moving between adjacent stages of one pipeline."""

    pipeline: int
    """Index into StepPlan.pipelines."""
    src: int
    """Sending stage."""
    dst: int
    """Receiving stage (src + 1 for F/N, src - 1 for B)."""
    kind: str
    """Action kind it serves: F or N (activation [T, D]) or B (its gradient [T, D]); T is the
    chunk's tokens, or for B the backward unit's (runtime/cells.py gives the row order)."""
    chunk: int
    """Chunk index within the pipeline (for B: the backward unit's index)."""

    def __str__(self) -> str:
        return f"{self.what} of {self.kind}{self.chunk} from stage {self.src}"

    @property
    def what(self) -> str:
        return "gradient" if self.kind == BACKWARD else "activation"


def action_messages(action: Action, *, pipeline: int, stage: int,
                    num_stages: int) -> tuple[Message | None, Message | None]:
    """(the message `action` receives before it runs, the message it sends after), None where
    the stage is the end of the pipeline the message would cross."""
    backward = action.kind == BACKWARD
    upstream = stage + 1 if backward else stage - 1      # where its input comes from
    downstream = stage - 1 if backward else stage + 1    # where its output goes
    inside = range(num_stages)

    def message(src: int, dst: int) -> Message:
        return Message(pipeline=pipeline, src=src, dst=dst, kind=action.kind, chunk=action.chunk)

    received = message(upstream, stage) if upstream in inside else None
    sent = message(stage, downstream) if downstream in inside else None
    return received, sent


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """Sends and receives one stage posts together (one `batch_isend_irecv`)."""

    round: int
    """The lock-step round all of its messages were sent in."""
    before: int
    """Index of the stage's action it is posted before (the length of the list: after the last)."""
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True, kw_only=True)
class PipelineMessages:
    """Every message of one pipeline's schedule, and when each stage posts it."""

    io: tuple[tuple[tuple[Message | None, Message | None], ...], ...]
    """Per stage, per action: `action_messages`."""
    rounds: tuple[tuple[int, ...], ...]
    """Per stage, per action: its lock-step round."""
    exchanges: tuple[tuple[Exchange, ...], ...]
    """Per stage: its exchanges in posting order (by point, then round)."""


def pipeline_messages(stages: list[list[Action]], pipeline: int = 0) -> PipelineMessages:
    """The messages and exchanges of a schedule: the discipline of this module's docstring.
    UserError if some message can never be sent (a schedule that deadlocks even with unlimited
    buffers; `schedule_checks.check_schedule` names it)."""
    key = (pipeline, schedule_shape(stages))
    cached = _PIPELINES.get(key)
    if cached is None:
        cached = _pipeline_messages(stages, pipeline)
        if len(_PIPELINES) >= 256:
            _PIPELINES.clear()
        _PIPELINES[key] = cached
    return cached


def stage_exchanges(stages: list[list[Action]], pipeline: int = 0) -> tuple[tuple[Exchange, ...], ...]:
    """Per stage, its exchanges in posting order (`pipeline_messages`)."""
    return pipeline_messages(stages, pipeline).exchanges


def lockstep_rounds(stages: list[list[Action]], pipeline: int = 0) -> tuple[tuple[int, ...], ...]:
    """Per stage, the round of each action: in round r a stage runs its next action if the
    message it receives was sent in a round before r (one action per stage per round)."""
    return pipeline_messages(stages, pipeline).rounds


def schedule_shape(stages: list[list[Action]]) -> tuple:
    """What the messages of a schedule depend on, hashable: each stage's (kind, chunk) list."""
    return tuple(tuple((a.kind, a.chunk) for a in acts) for acts in stages)


_PIPELINES: dict[tuple, PipelineMessages] = {}
"""pipeline_messages' results by schedule (the runners of one pipeline, the validator and the
rendezvous check ask for the same ones)."""


def _pipeline_messages(stages: list[list[Action]], pipeline: int) -> PipelineMessages:
    pp = len(stages)
    io = tuple(tuple(action_messages(a, pipeline=pipeline, stage=s, num_stages=pp) for a in acts)
               for s, acts in enumerate(stages))
    rounds = _rounds(stages, io)
    found: list[dict[int, tuple[list[Message], list[Message]]]] = [{} for _ in stages]
    for s in range(pp):
        for (_, sent), r in zip(io[s], rounds[s]):
            if sent is not None:
                found[s].setdefault(r, ([], []))[0].append(sent)
                found[sent.dst].setdefault(r, ([], []))[1].append(sent)
    exchanges = tuple(tuple(Exchange(round=r, before=bisect.bisect_right(rounds[s], r), sends=tuple(sends),
                                     recvs=tuple(recvs)) for r, (sends, recvs) in sorted(found[s].items()))
                      for s in range(pp))
    return PipelineMessages(io=io, rounds=tuple(map(tuple, rounds)), exchanges=exchanges)


def _rounds(stages: list[list[Action]], io) -> list[list[int]]:
    sent_in: dict[Message, int] = {}
    rounds: list[list[int]] = [[] for _ in stages]
    waiting = [s for s in range(len(stages)) if stages[s]]
    r = 0
    while waiting:
        movers = [s for s in waiting if io[s][len(rounds[s])][0] is None or io[s][len(rounds[s])][0] in sent_in]
        if not movers:
            raise UserError("pipeline messages can never all be sent: " + _blocked(stages, rounds, io))
        for s in movers:
            sent = io[s][len(rounds[s])][1]
            if sent is not None:
                sent_in[sent] = r
            rounds[s].append(r)
        waiting = [s for s in waiting if len(rounds[s]) < len(stages[s])]
        r += 1
    return rounds


def _blocked(stages: list[list[Action]], rounds: list[list[int]], io) -> str:
    return "; ".join(f"stage {s} {actions[len(rounds[s])]} waits for the {io[s][len(rounds[s])][0]}"
                     for s, actions in enumerate(stages) if len(rounds[s]) < len(actions))
