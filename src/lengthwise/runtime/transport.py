"""How adjacent pipeline stages exchange activations and their gradients.

A stage runner (`runtime/stage.py`) only ever calls `send(message, tensor)` and
`recv(message, shape=..., dtype=..., device=...)`. `Message` names one transfer:
pipeline, source stage, destination stage, the action kind it serves (F or N carry the
activation forward, B carries its gradient back) and the chunk index; a sender and its
receiver build equal messages independently, so a point-to-point implementation can match
them by order on each (src, dst) link.

`InProcessTransport` keeps tensors in FIFO queues, for the single-process driver, which asks
`ready(message)` before running an action that receives. A torch.distributed transport
implements the same two calls with blocking send/recv; the receiver knows the shape (the
chunk's tokens x hidden, or the backward unit's for B) and dtype, so nothing else needs to travel.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Protocol

import torch


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
        what = "gradient" if self.kind == "B" else "activation"
        return f"{what} of {self.kind}{self.chunk} from stage {self.src}"


class Transport(Protocol):
    """What a stage runner needs from the wire."""

    def send(self, message: Message, tensor: torch.Tensor) -> None: ...

    def recv(self, message: Message, *, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor: ...


class InProcessTransport:
    """Queues in memory: stages of one process hand tensors to each other."""

    def __init__(self):
        self._queues: dict[Message, deque[torch.Tensor]] = defaultdict(deque)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        self._queues[message].append(tensor.detach())

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
