"""The point-to-point transport posts each exchange as one batch and frees what it sent once it
is delivered, not at the step's end; a stage runner posts the plan's exchanges."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lengthwise.runtime.distributed.p2p as p2p
from lengthwise.plan.messages import stage_exchanges
from lengthwise.runtime.execute import _interleave
from lengthwise.runtime.model import build_model
from lengthwise.runtime.stage import StageRunner
from lengthwise.runtime.transport import InProcessTransport, Message
from lengthwise.runtime.verify import random_tokens
from lengthwise.specs import ModelSpec

from plan_helpers import hand_plan


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


class RecordingTransport(InProcessTransport):
    """The in-process queues, recording what each stage posts and the shapes it receives."""

    def __init__(self):
        super().__init__()
        self.handed, self.posts, self.taken = set(), {}, {}

    def send(self, message, tensor):
        self.handed.add(message)
        super().send(message, tensor)

    def post(self, sends, recvs, *, dtype, device):
        assert set(sends) <= self.handed, "a send posted before its action produced it"
        stage = sends[0].src if sends else recvs[0][0].dst
        self.posts.setdefault(stage, []).append((tuple(sends), tuple(recvs)))

    def recv(self, message, *, shape, dtype, device):
        self.taken[message] = tuple(shape)
        return super().recv(message, shape=shape, dtype=dtype, device=device)


def test_a_stage_posts_the_plans_exchanges_with_the_shapes_it_receives():
    """The runner posts exactly `stage_exchanges` (re-forwards and a recomputing stage included),
    every send after the action that made it, each receive with the shape its action takes."""
    spec = ModelSpec(name="tiny2", num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn=24, vocab=32)
    plan = hand_plan(spec, [12, 5, 4, 3], [("0[0:4] 0[4:8]+1[0:5] 0[8:12]+2[0:4] 3[0:3]",
                                            ["N0 F1.r1 F2 F3 B2 B1 F0 B3 B0", "N0 F1 F2 B2 B1 F3 B3 F0 B0"])])
    model = build_model(spec, dtype=torch.float64, seed=0)
    transport = RecordingTransport()
    runners = [StageRunner(model=model, plan=plan, pipeline=0, stage=s, token_ids=random_tokens(plan.lengths, 32, 1),
                           transport=transport, backend="reference") for s in range(2)]
    _interleave(runners, transport)
    for s, exchanges in enumerate(stage_exchanges(plan.pipelines[0].stages)):
        posted = transport.posts[s]
        assert [sends for sends, _ in posted] == [e.sends for e in exchanges]
        assert [tuple(m for m, _ in recvs) for _, recvs in posted] == [e.recvs for e in exchanges]
        assert all(transport.taken[m] == shape for _, recvs in posted for m, shape in recvs)
