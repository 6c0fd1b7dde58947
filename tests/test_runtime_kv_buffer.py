"""The K/V state of a split sequence lives in one preallocated buffer per layer
(`runtime/state.py`): later slices attend to a view of its prefix, not to a concatenation of
per-slice copies, and the gradients stay exact (float64, against the unpacked oracle).
"""

from __future__ import annotations

import pytest
import torch

from lengthwise.runtime.attention import attend
from lengthwise.runtime.model import build_model
from lengthwise.runtime.stage import StageRunner
from lengthwise.runtime.transport import InProcessTransport
from lengthwise.runtime.verify import compare_grads, random_tokens, unpacked_loss_and_grads
from lengthwise.specs import ModelSpec

from plan_helpers import hand_plan

SPEC = ModelSpec(name="llama-gqa", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8,
                 ffn=48, vocab=64)
SLICE = 4
LENGTHS = [4 * SLICE, 3]
CHUNKS = "0[0:4] 0[4:8] 0[8:12] 0[12:16]+1[0:3]"
"""Sequence 0 cut into 4 slices; the last shares its row with a short document."""
SCHEDULES = {
    "k-all": "F0 F1 F2 F3 B3 B2 B1 B0",
    "k1": "N0 N1 N2 F3 B3 F2 B2 F1 B1 F0 B0",  # chunkflow K = 1: re-forward before each backward
}
PREFIX = 3 * SLICE
"""Rows of sequence 0's buffers: the tokens before its last slice."""


class _Recorder:
    """A callable attention backend that records each call's context pieces, then attends."""

    def __init__(self):
        self.contexts: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def __call__(self, q_THE, k_TGE, v_TGE, context, layout):
        self.contexts.append(context)
        return attend(q_THE, k_TGE, v_TGE, context, layout, backend="cpu-flash")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _run(actions: str, check):
    """Run the plan's one stage action by action, calling check(runner, index) after each;
    returns the model (with the step's gradients), the token ids, the recorder and the runner."""
    plan = hand_plan(SPEC, LENGTHS, [(CHUNKS, [actions])])
    model = build_model(SPEC, dtype=torch.float64, seed=0)
    ids = random_tokens(LENGTHS, SPEC.vocab, 1)
    recorder = _Recorder()
    runner = StageRunner(model=model, plan=plan, pipeline=0, stage=0, token_ids=ids,
                         transport=InProcessTransport(), backend=recorder)
    while not runner.done:
        index = runner.next_index
        runner.step()
        check(runner, index)
    return model, ids, recorder, runner


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_later_slices_attend_to_a_view_of_one_buffer_per_layer(name):
    kv_bytes = SPEC.num_layers * 2 * PREFIX * SPEC.kv_dim * 8  # k and v, float64
    seen = {"store_bytes": set()}

    def check(runner, index):
        store = runner.store
        if store.buffers:
            (seq_id, per_layer), = store.buffers.items()
            assert seq_id == 0 and len(per_layer) == SPEC.num_layers
            buffer_storages = {_storage(t) for kv in per_layer for t in kv}
            assert len(buffer_storages) == 2 * SPEC.num_layers
            for k_buf, v_buf in per_layer:
                assert k_buf.shape == v_buf.shape == (PREFIX, SPEC.num_kv_heads, SPEC.head_dim)
            # every stored slice is rows of those buffers, at its offset: no per-slice copies
            row_bytes = SPEC.num_kv_heads * SPEC.head_dim * 8
            for key in store.keys:
                for (k, v), (k_buf, v_buf) in zip(store.kv(key), per_layer):
                    assert k.data_ptr() == k_buf.data_ptr() + key[1] * row_bytes
                    assert v.data_ptr() == v_buf.data_ptr() + key[1] * row_bytes
            # the store holds one buffer per layer for k and v, plus as many gradient
            # accumulators once a backward has handed gradients back
            assert store.nbytes in (kv_bytes, 2 * kv_bytes)
            seen["store_bytes"].add(store.nbytes)
            for cell, pending in runner.pending.items():
                for seq, (stop, leaves) in pending.context_leaves.items():
                    assert seq == 0 and stop == cell * SLICE
                    for (k, v), (k_buf, v_buf) in zip(leaves, per_layer):
                        assert k.is_leaf and k.requires_grad and k.shape[0] == stop
                        assert _storage(k) == _storage(k_buf) and k.data_ptr() == k_buf.data_ptr()
                        assert _storage(v) == _storage(v_buf) and v.data_ptr() == v_buf.data_ptr()
        else:
            assert store.nbytes == 0

    model, ids, recorder, runner = _run(SCHEDULES[name], check)
    assert seen["store_bytes"] == {kv_bytes, 2 * kv_bytes}
    # freed with the sequence's last stored slice: nothing left after the step
    assert runner.store.nbytes == 0 and not runner.store.buffers and not runner.store.keys

    # attention got, for each later slice, exactly one context piece: a view of the buffer
    with_context = [c for c in recorder.contexts if c[0] and c[0][0][0].shape[0] > 0]
    assert with_context, "no slice read a context"
    for context in with_context:
        assert len(context[0]) == 1
        k, v = context[0][0]
        assert k.shape[0] % SLICE == 0 and 0 < k.shape[0] <= PREFIX
        assert k.is_contiguous() and v.is_contiguous()
    stops = sorted({c[0][0][0].shape[0] for c in with_context})
    assert stops == [SLICE, 2 * SLICE, 3 * SLICE]

    # exact: loss and gradients of the unpacked oracle, float64
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_loss, ref_grads = unpacked_loss_and_grads(model, ids, backend="reference")
    _, max_rel, worst = compare_grads(grads, ref_grads)
    assert abs(float(runner.loss_sum) - ref_loss) <= 1e-9 * abs(ref_loss)
    assert max_rel <= 1e-9, worst

