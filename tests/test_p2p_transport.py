"""The point-to-point transport posts each exchange as one batch and frees what it sent once it
is delivered, not at the step's end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lengthwise.runtime.distributed.p2p as p2p
from lengthwise.runtime.transport import Message


class Work:
    """A c10d work handle whose completion the test decides."""

    def __init__(self, fail: bool = False):
        self.done, self.fail = False, fail

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        if self.fail:
            raise RuntimeError("Timed out waiting for recv\nconnection closed")
        self.done = True
        return True


def Op(op, tensor, peer):
    """A P2POp without a process group."""
    return SimpleNamespace(op=op, tensor=tensor, peer=peer)


@pytest.fixture
def wire(monkeypatch):
    """A transport on a fake wire: `batches` holds each batch_isend_irecv call's operations,
    `works` the work handed back per operation (gloo's answer: one per operation)."""
    batches, works = [], []

    def batch_isend_irecv(ops):
        batches.append([(op.op, tuple(op.tensor.shape), op.peer) for op in ops])
        works.extend(Work() for _ in ops)
        return works[-len(ops):]

    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(p2p.dist, "P2POp", Op)
    layout = SimpleNamespace(place=SimpleNamespace(cp_rank=0, tp_rank=0), rank_of=lambda p, stage, *_: 10 + stage)
    return p2p.DistributedTransport(layout=layout, timeout_s=5.0), batches, works


def forward(chunk: int) -> Message:
    return Message(pipeline=0, src=0, dst=1, kind="F", chunk=chunk)


def gradient(chunk: int) -> Message:
    return Message(pipeline=0, src=1, dst=0, kind="B", chunk=chunk)


def post(transport, sends=(), recvs=()):
    transport.post(list(sends), [(m, (4, 8)) for m in recvs], dtype=torch.float32, device="cpu")


def test_an_exchange_is_one_batch_of_its_sends_and_receives(wire):
    """A handed-over send waits for its exchange; the exchange posts it with the receives, in
    one batch_isend_irecv, each to or from the neighbour's rank."""
    transport, batches, _ = wire
    transport.send(forward(3), torch.ones(4, 8))
    assert batches == []  # held until its exchange
    post(transport, sends=[forward(3)], recvs=[gradient(0)])
    assert batches == [[(p2p.dist.isend, (4, 8), 11), (p2p.dist.irecv, (4, 8), 11)]]
    received = transport.recv(gradient(0), shape=(4, 8), dtype=torch.float32, device="cpu")
    assert received.shape == (4, 8)


def test_empty_messages_are_left_out_at_both_ends(wire):
    """A CP rank with no token of a chunk neither sends nor receives it; an exchange of nothing
    else posts nothing."""
    transport, batches, _ = wire
    transport.send(forward(0), torch.ones(0, 8))
    transport.post([forward(0)], [(gradient(1), (0, 8))], dtype=torch.float32, device="cpu")
    assert batches == []
    assert transport.recv(gradient(1), shape=(0, 8), dtype=torch.float32, device="cpu").shape == (0, 8)


def test_a_delivered_send_is_dropped_at_the_next_message(wire):
    """Each post or receive first drops the sends already delivered (their buffers were held to
    `finish()`: a stage's whole step of outgoing activations); an undelivered one stays until
    `finish()` waits for it."""
    transport, _, works = wire
    for chunk in range(2):
        transport.send(forward(chunk), torch.ones(4, 8))
        post(transport, sends=[forward(chunk)])
    assert len(transport._sends) == 2  # neither delivered yet
    works[0].done = True
    transport.send(forward(2), torch.ones(4, 8))
    post(transport, sends=[forward(2)], recvs=[gradient(0)])
    assert [m.chunk for _, _, m in transport._sends] == [1, 2]
    works[1].done = True
    transport.recv(gradient(0), shape=(4, 8), dtype=torch.float32, device="cpu")
    assert [m.chunk for _, _, m in transport._sends] == [2]
    transport.finish()
    assert transport._sends == [] and works[2].done


def test_one_work_for_the_whole_batch_covers_every_operation(monkeypatch):
    """NCCL answers a batch with one work: a send of the batch is delivered when it completed."""
    work = Work()
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", lambda ops: [work])
    monkeypatch.setattr(p2p.dist, "P2POp", Op)
    layout = SimpleNamespace(place=SimpleNamespace(cp_rank=0, tp_rank=0), rank_of=lambda *_: 1)
    transport = p2p.DistributedTransport(layout=layout, timeout_s=5.0)
    transport.send(forward(0), torch.ones(4, 8))
    post(transport, sends=[forward(0)], recvs=[gradient(0)])
    transport.recv(gradient(0), shape=(4, 8), dtype=torch.float32, device="cpu")
    post(transport)
    assert transport._sends == []


def test_a_receive_that_never_comes_names_the_message_and_rank(monkeypatch):
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", lambda ops: [Work(fail=True) for _ in ops])
    monkeypatch.setattr(p2p.dist, "P2POp", Op)
    layout = SimpleNamespace(place=SimpleNamespace(cp_rank=0, tp_rank=0), rank_of=lambda p, stage, *_: 10 + stage)
    transport = p2p.DistributedTransport(layout=layout, timeout_s=5.0)
    post(transport, recvs=[gradient(2)])
    with pytest.raises(p2p.ReceiveTimeout, match=r"stage 0 .* gradient of B2 from stage 1 \(rank 11"):
        transport.recv(gradient(2), shape=(4, 8), dtype=torch.float32, device="cpu")
