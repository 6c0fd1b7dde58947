"""How adjacent pipeline stages exchange activations and their gradients.

A stage runner (`runtime/stage.py`) calls three things. `send(message, tensor)` hands over the
output of an action; `post(sends, recvs, ...)` puts on the wire, as one batch, the sends and
receives that `plan.messages.stage_exchanges` schedules before the runner's next action; and
`recv(message, shape=..., dtype=..., device=...)` returns the tensor of a posted receive once it
has arrived. `Message` (from `plan/messages.py`, where the plan says which action sends and
receives what) names one transfer: pipeline, source stage, destination stage, the action kind
it serves (F or N carry the activation forward, B carries its gradient back) and the chunk
index; a sender and its receiver build equal messages independently.

`InProcessTransport` keeps tensors in FIFO queues, for the single-process driver, which asks
`ready(message)` before running an action that receives; it has nothing to post. The
torch.distributed transport (`distributed/p2p.py`) posts each exchange with one
`batch_isend_irecv`; the receiver knows the shape (the chunk's tokens x hidden, or the backward
unit's for B) and dtype, so nothing else needs to travel.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Protocol

import torch

from lengthwise.plan.messages import Message

__all__ = ["InProcessTransport", "Message", "Transport"]


class Transport(Protocol):
    """What a stage runner needs from the wire."""

    def send(self, message: Message, tensor: torch.Tensor) -> None: ...

    def post(self, sends: Sequence[Message], recvs: Sequence[tuple[Message, tuple[int, ...]]], *,
             dtype: torch.dtype, device: torch.device) -> None: ...

    def recv(self, message: Message, *, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor: ...


class InProcessTransport:
    """Queues in memory: stages of one process hand tensors to each other."""

    def __init__(self):
        self._queues: dict[Message, deque[torch.Tensor]] = defaultdict(deque)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        self._queues[message].append(tensor.detach())

    def post(self, sends, recvs, *, dtype, device) -> None:
        """Nothing to do: a queue holds a sent tensor until its receiver takes it."""

    def ready(self, message: Message) -> bool:
        return bool(self._queues.get(message))

    def recv(self, message: Message, *, shape, dtype, device) -> torch.Tensor:
        tensor = self._queues[message].popleft()
        assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, (message, tensor.shape)
        return tensor

    @property
    def in_flight(self) -> int:
        """Tensors sent and not yet received."""
        return sum(len(q) for q in self._queues.values())
