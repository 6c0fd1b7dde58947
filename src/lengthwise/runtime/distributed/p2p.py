"""A torch.distributed `Transport`: adjacent pipeline stages exchange activations and their
gradients point-to-point (chunkflow §4.3's state-aware 1F1B, infinipipe §4 and slimpack §4.2
all run on plain stage-to-stage send/recv).

Sends are asynchronous (`isend`), so a stage that sends an activation forward and a stage that
sends a gradient back at the same moment cannot block each other. A send's buffer is kept alive
until its work completes: each send and receive first drops the sends already delivered
(`Work.is_completed`, which does not wait), and `finish()` waits for the rest at the end of the
step. Holding every buffer to the end instead would keep all of a step's outgoing activations
and gradients on the GPU (a first stage's whole step of chunk outputs). The fake process group
of `lengthwise dryrun` completes every send at once but never reports it, so a dry run still
holds them to the end: an upper bound. A receive posts `irecv` into a buffer
whose shape the plan gives (the chunk's tokens on this CP rank x hidden, or the backward
unit's for B: every rank holds the plan, so nothing but the tensor travels) and waits at most `Mesh.timeout_s`; a receive that
never comes raises `ReceiveTimeout` naming the stage, the action it serves and the sending rank,
instead of hanging.

An empty tensor (a CP rank holding no token of a chunk) is not sent: sender and receiver
both know from the plan that it is empty.

Order, not tags: NCCL matches point-to-point messages between two ranks by the order they were
posted, so every message here carries tag 0 and each link relies on the plan's invariant that
the sender posts its messages in the order the receiver posts its receives
(`plan.schedules.check_message_order`, part of `validate_plan`).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lengthwise.runtime.distributed.mesh import PlanLayout
from lengthwise.runtime.distributed.stats import CommStats
from lengthwise.runtime.transport import Message

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
        self._sends: list[tuple[object, torch.Tensor, Message]] = []

    def _peer(self, message: Message, stage: int) -> int:
        place = self.layout.place
        return self.layout.rank_of(message.pipeline, stage, place.cp_rank, place.tp_rank)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        payload = tensor.detach().contiguous()
        if payload.numel() == 0:
            return  # a CP rank with no token of the chunk: the receiver knows it from the plan
        self._drop_delivered()
        work = dist.isend(payload, self._peer(message, message.dst))
        self._sends.append((work, payload, message))
        self.stats.p2p_elements += payload.numel()
        self.stats.p2p_messages += 1

    def recv(self, message: Message, *, shape, dtype, device) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self.dtype or dtype, device=device)
        if buffer.numel() == 0:
            return buffer
        self._drop_delivered()
        src = self._peer(message, message.src)
        work = dist.irecv(buffer, src)
        started = time.perf_counter()
        try:
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
        self._sends = [entry for entry in self._sends if not entry[0].is_completed()]

    def finish(self) -> None:
        """Wait until every send of the step has been delivered."""
        started = time.perf_counter()
        for work, _, message in self._sends:
            try:
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
