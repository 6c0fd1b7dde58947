"""The point-to-point transport frees what it sent once it is delivered, not at the step's end."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import lengthwise.runtime.distributed.p2p as p2p
from lengthwise.runtime.transport import Message


class Work:
    """A c10d work handle whose completion the test decides."""

    def __init__(self):
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        self.done = True
        return True


def test_a_delivered_send_is_dropped_at_the_next_message(monkeypatch):
    """Each send or receive first drops the sends already delivered (their buffers were held to
    `finish()`: a stage's whole step of outgoing activations); an undelivered one stays until
    `finish()` waits for it."""
    works = []

    def isend(tensor, dst):
        works.append(Work())
        return works[-1]

    def irecv(tensor, src):
        return Work()

    monkeypatch.setattr(p2p.dist, "isend", isend)
    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    layout = SimpleNamespace(place=SimpleNamespace(cp_rank=0, tp_rank=0), rank_of=lambda *_: 1)
    transport = p2p.DistributedTransport(layout=layout, timeout_s=5.0)
    send = lambda chunk: transport.send(Message(pipeline=0, src=0, dst=1, kind="F", chunk=chunk), torch.ones(4, 8))
    send(0)
    send(1)
    assert len(transport._sends) == 2  # neither delivered yet
    works[0].done = True
    send(2)
    assert [m.chunk for _, _, m in transport._sends] == [1, 2]
    works[1].done = True
    transport.recv(Message(pipeline=0, src=1, dst=0, kind="B", chunk=0), shape=(4, 8), dtype=torch.float32,
                   device="cpu")
    assert [m.chunk for _, _, m in transport._sends] == [2]
    transport.finish()
    assert transport._sends == [] and works[2].done
