"""A torch.distributed `Transport`: adjacent pipeline stages exchange activations and their
gradients point-to-point (chunkflow §4.3's state-aware 1F1B, infinipipe §4 and slimpack §4.2
all run on plain stage-to-stage send/recv).

Batches, not lone sends. On NCCL a large send completes only once the peer has posted the
matching receive, and lone sends and receives to one peer share one stream; in steady-state 1F1B
two neighbouring stages each send first and then wait for the other's send, and neither
completes (`plan/rendezvous.py` replays the rule; it stalls the plans of every planner that
splits sequences). So a send handed over by `send()` is not posted at once: the stage runner
calls `post()` before each action with the exchange that `plan.messages.stage_exchanges`
schedules there, the sends and receives of one round of a lock-step clock that every rank
computes alike from the plan, and `post()` puts them on the wire together with one
`batch_isend_irecv` (one NCCL group on the group's communicator, as torch.distributed.pipelining
and Megatron-LM post theirs). That module's docstring proves that no rank then waits forever:
every round's exchanges are all in flight together once the earlier rounds completed. Gloo has
no groups: it posts the same operations one by one, and buffers. (NCCL wants the group's
communicator to exist before a batch that not all ranks join: `dp.check_same_plan`, a collective
on the default group, runs before every step's actions.)

A receive is posted into a buffer whose shape the plan gives (the chunk's tokens on this CP rank
x hidden, or the backward unit's for B: every rank holds the plan, so nothing but the tensor
travels), possibly some actions before the one that needs it (the tensor waits in its buffer);
`recv()` then waits for it at most `Mesh.timeout_s`, and a receive that never comes raises
`ReceiveTimeout` naming the stage, the action it serves and the sending rank, instead of hanging.

A send's buffer is kept alive until its work completes: each post and receive first drops the
sends already delivered (`Work.is_completed`, which does not wait), and `finish()` waits for the
rest at the end of the step. Holding every buffer to the end instead would keep all of a step's
outgoing activations and gradients on the GPU (a first stage's whole step of chunk outputs).
The fake process group of `lengthwise dryrun` completes every send at once but never reports it,
so a dry run still holds them to the end: an upper bound.

An empty tensor (a CP rank holding no token of a chunk) is neither sent nor received: both ends
know from the plan that it is empty, so both leave it out of their batch.

Order, not tags: NCCL matches point-to-point messages between two ranks by the order they were
posted, so every message here carries tag 0 and each link relies on the plan's invariant that
the sender posts its messages in the order the receiver posts its receives
(`plan.schedule_checks.check_message_order`, part of `validate_plan`), which the exchanges keep: they
post each link's messages in the order of their rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lengthwise.runtime.distributed.mesh import PlanLayout
from lengthwise.runtime.distributed.stats import CommStats
from lengthwise.runtime.transport import Message


class StepFailed(RuntimeError):
    """A rank could not finish its actions (a receive timed out); the message names where."""


class ReceiveTimeout(RuntimeError):
    """A point-to-point receive that did not complete within the time-out."""


class DistributedTransport:
    """Send/recv between this rank and the same CP rank of the neighbouring stages."""

    def __init__(self, *, layout: PlanLayout, timeout_s: float, stats: CommStats | None = None,
                 dtype: torch.dtype | None = None):
        self.layout, self.timeout_s = layout, timeout_s
        self.dtype = dtype
        """Activation dtype when it differs from the one the stage asks for (its parameters'):
        bf16 compute over fp32 master weights."""
        self.stats = stats if stats is not None else CommStats()
        self._outgoing: dict[Message, torch.Tensor] = {}
        """Sends handed over and not yet posted."""
        self._sends: list[tuple[list, torch.Tensor, Message]] = []
        """Posted sends not known to be delivered: (works, payload, message)."""
        self._receives: dict[Message, tuple[list, torch.Tensor]] = {}
        """Posted receives not yet taken by `recv`: (works, buffer)."""

    def _peer(self, message: Message, stage: int) -> int:
        place = self.layout.place
        return self.layout.rank_of(message.pipeline, stage, place.cp_rank, place.tp_rank)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        """Hold `tensor` until the exchange that carries `message` is posted."""
        self._outgoing[message] = tensor.detach()

    def post(self, sends: Sequence[Message], recvs: Sequence[tuple[Message, tuple[int, ...]]], *,
             dtype: torch.dtype, device: torch.device) -> None:
        """Put one exchange on the wire: the held tensors of `sends` and a buffer of the given
        shape for each of `recvs`, as one batch (empty tensors left out)."""
        self._drop_delivered()
        ops, sent, received = [], [], []
        for message in sends:
            payload = self._outgoing.pop(message).contiguous()
            if payload.numel():
                ops.append(dist.P2POp(dist.isend, payload, self._peer(message, message.dst)))
                sent.append((payload, message))
        for message, shape in recvs:
            if math.prod(shape):
                buffer = torch.empty(shape, dtype=self.dtype or dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buffer, self._peer(message, message.src)))
                received.append((buffer, message))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        # NCCL answers one work for the whole group, gloo (no groups) one per operation
        per_op = [[w] for w in works] if len(works) == len(ops) else [list(works)] * len(ops)
        for (payload, message), op_works in zip(sent, per_op):
            self._sends.append((op_works, payload, message))
            self.stats.p2p_elements += payload.numel()
            self.stats.p2p_messages += 1
        for (buffer, message), op_works in zip(received, per_op[len(sent):]):
            self._receives[message] = (op_works, buffer)

    def recv(self, message: Message, *, shape, dtype, device) -> torch.Tensor:
        """The tensor of a posted receive, once it has arrived."""
        if not math.prod(shape):
            return torch.empty(shape, dtype=self.dtype or dtype, device=device)
        self._drop_delivered()
        works, buffer = self._receives.pop(message)
        assert tuple(buffer.shape) == tuple(shape), (message, buffer.shape, shape)
        src = self._peer(message, message.src)
        started = time.perf_counter()
        try:
            for work in works:
                work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            waited = time.perf_counter() - started
            raise ReceiveTimeout(
                f"stage {message.dst} gave up after {waited:.1f} s (time-out {self.timeout_s:g} s) waiting "
                f"for the {message} (rank {src}, {tuple(shape)} {str(dtype).removeprefix('torch.')}): that "
                f"rank failed, is slower than the time-out, or runs a different plan ({_first_line(exc)})"
            ) from None
        self.stats.wait_s += time.perf_counter() - started
        return buffer

    def _drop_delivered(self) -> None:
        """Forget the sends whose work has completed, freeing their buffers."""
        self._sends = [entry for entry in self._sends if not all(w.is_completed() for w in entry[0])]

    def finish(self) -> None:
        """Wait until every send of the step has been delivered."""
        assert not self._outgoing, f"sends never posted: {[str(m) for m in self._outgoing]}"
        started = time.perf_counter()
        for works, _, message in self._sends:
            try:
                for work in works:
                    work.wait(timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise ReceiveTimeout(f"stage {message.src}: the {message} was never received by "
                                     f"stage {message.dst} within {self.timeout_s:g} s "
                                     f"({_first_line(exc)})") from None
        self._sends.clear()
        self.stats.wait_s += time.perf_counter() - started


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
