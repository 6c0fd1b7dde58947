"""Tier 2: executing hand-built StepPlans gives exactly the loss and gradients of Hugging Face
transformers run on each sequence alone (float64, 1e-9 relative), and the executor's memory
behaves as ChunkFlow's K promises.

Plans are written by hand (`hand_plan`): chunks as `seq[start:stop]+...`, one action string
per stage (`N` = forward without grad keeping K/V, ChunkFlow's first pass).
"""

from __future__ import annotations

import pytest
import torch

from lengthwise.errors import UserError
from lengthwise.runtime.execute import run_step, unpacked_plan
from lengthwise.runtime.memory import SavedTensorMeter
from lengthwise.runtime.model import build_model
from lengthwise.runtime.verify import (compare_grads, random_tokens, transformers_loss_and_grads,
                                       unpacked_loss_and_grads)
from lengthwise.specs import ModelSpec
from tolerance import normwise_error, reduction_tolerance

from plan_helpers import hand_plan

LLAMA = ModelSpec(name="llama-gqa", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8,
                  ffn=48, vocab=64)
QWEN = ModelSpec(name="qwen-tied", num_layers=2, hidden=32, num_heads=4, num_kv_heads=1, head_dim=8,
                 ffn=48, vocab=64, qkv_bias=True, tied_embeddings=True, rope_theta=1e6)
QWEN_UNTIED = ModelSpec(name="qwen-untied", num_layers=2, hidden=32, num_heads=2, num_kv_heads=2,
                        head_dim=16, ffn=40, vocab=64, qkv_bias=True)

LENGTHS = [12, 5, 4, 3]
SPLIT = "0[0:4] 0[4:8]+1[0:5] 0[8:12]+2[0:4] 3[0:3]"
"""Sequence 0 cut into 3 slices mid-document; the second and third rows mix a slice with
short documents (hybrid chunks)."""

PLANS = {
    "packed": [("0[0:12] 1[0:5]+2[0:4]+3[0:3]", ["F0 F1 B1 B0"])],
    "split-k-all": [(SPLIT, ["F0 F1 F2 B2 B1 B0 F3 B3"])],
    "split-k1": [(SPLIT, ["N0 N1 F2 B2 F1 B1 F0 B0 F3 B3"])],
    "split-in-row": [("0[0:4]+1[0:5]+0[4:8] 0[8:12]+2[0:4]+3[0:3]", ["N0 F1 B1 F0 B0"])],
    "pp2": [(SPLIT, ["N0 F1 F2 F3 B2 B1 F0 B3 B0", "N0 F1 F2 B2 B1 F3 B3 F0 B0"])],
    "pp2-recompute-head-only-stage": [(SPLIT, ["N0 F1.r2 F2.r1 B2 B1 F0.r1 B0 F3 B3", "N0 F1 F2 B2 B1 F0 B0 F3 B3"])],
    # MLP recomputation: whole + MLP (F1.r1.m1), MLP of both layers, a re-forward recomputing one MLP
    "mlp-recompute": [(SPLIT, ["N0 F1.r1.m1 F2.m2 B2 B1 F0.m1 B0 F3.m2 B3"])],
    "dp2": [("0[0:4] 0[4:12]", ["N0 F1 B1 F0 B0"]), ("1[0:5]+2[0:4]+3[0:3]", ["F0 B0"])],
    "dp2-pp2": [("0[0:4] 0[4:12]", ["F0 F1 B1 B0", "F0 F1 B1 B0"]), ("1[0:5]+2[0:4] 3[0:3]", ["F0 F1 B0 B1", "F0 B0 F1 B1"])],
}


def _run(spec, pipelines, *, seed=0):
    plan = hand_plan(spec, LENGTHS, pipelines)
    if "r2" in str(pipelines):  # all layers on stage 0, the last stage runs only norm, head, loss
        plan.pipelines[0].layers_per_stage = [2, 0]
    model = build_model(spec, dtype=torch.float64, seed=seed)
    ids = random_tokens(LENGTHS, spec.vocab, seed + 1)
    loss = run_step(model, plan, ids)
    return model, ids, float(loss), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("spec", [LLAMA, QWEN, QWEN_UNTIED], ids=lambda s: s.name)
def test_plan_equals_transformers_unpacked(spec, name):
    pytest.importorskip("transformers")
    model, ids, loss, grads = _run(spec, PLANS[name])
    ref_loss, ref_grads = transformers_loss_and_grads(model, ids)
    _, max_rel, worst = compare_grads(grads, ref_grads)
    assert abs(loss - ref_loss) <= 1e-9 * abs(ref_loss)
    assert max_rel <= 1e-9, worst


@pytest.mark.parametrize("name", list(PLANS))
def test_hand_plans_pass_the_plan_validator(name):
    """The plans above are ones a planner may emit (lengthwise.plan.validate agrees)."""
    from lengthwise.cost import CostModel
    from lengthwise.plan.validate import validate_plan

    plan = hand_plan(LLAMA, LENGTHS, PLANS[name])
    plan.cluster = plan.cluster.with_gpus(plan.num_gpus)
    if "r2" in str(PLANS[name]):
        plan.pipelines[0].layers_per_stage = [2, 0]
    validate_plan(plan, CostModel(model=LLAMA, cluster=plan.cluster))


def test_unpacked_oracle_agrees_with_transformers():
    """The fallback oracle (no transformers) is itself exact."""
    pytest.importorskip("transformers")
    model, ids, _, _ = _run(LLAMA, PLANS["packed"])
    loss, grads = unpacked_loss_and_grads(model, ids, backend="reference")
    ref_loss, ref_grads = transformers_loss_and_grads(model, ids)
    assert abs(loss - ref_loss) <= 1e-12 and compare_grads(grads, ref_grads)[1] <= 1e-9


def test_gradients_accumulate_over_steps():
    model, ids, _, grads = _run(LLAMA, PLANS["split-k1"])
    once = {n: g.clone() for n, g in grads.items()}
    run_step(model, hand_plan(LLAMA, LENGTHS, PLANS["packed"]), ids)
    # each weight gradient sums one term per token; the two plans sum them in different orders
    tolerance = reduction_tolerance(torch.float64, sum(LENGTHS))
    for name, p in model.named_parameters():
        assert normwise_error(p.grad, 2 * once[name]) <= tolerance, name


# memory -------------------------------------------------------------------------------------

CHUNK = 16


def _chunkflow_actions(num_slices: int, k: int) -> str:
    """chunkflow Algorithm 2 for one split sequence: the first n-k slices forward without
    grad, the last k with; backward in reverse, re-forwarding each discarded slice first."""
    fwd = [f"N{i}" for i in range(num_slices - k)] + [f"F{i}" for i in range(num_slices - k, num_slices)]
    bwd = [a for i in reversed(range(num_slices)) for a in ((f"B{i}",) if i >= num_slices - k else (f"F{i}", f"B{i}"))]
    return " ".join(fwd + bwd)


def _peak_saved_bytes(num_slices: int, k: int) -> int:
    length = num_slices * CHUNK
    chunks = " ".join(f"0[{i * CHUNK}:{(i + 1) * CHUNK}]" for i in range(num_slices)) + " 1[0:5]"
    plan = hand_plan(LLAMA, [length, 5], [(chunks, [_chunkflow_actions(num_slices, k) + f" F{num_slices} B{num_slices}"])])
    model = build_model(LLAMA, dtype=torch.float64, seed=0)
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        run_step(model, plan, random_tokens([length, 5], LLAMA.vocab, 1))
    assert meter.current_bytes == 0
    return meter.peak_bytes


def _kv_state_bytes(tokens: int) -> int:
    return tokens * 2 * LLAMA.kv_dim * 8 * LLAMA.num_layers  # k and v, float64, every layer


def test_saved_memory_is_independent_of_sequence_length_apart_from_kv_state():
    """chunkflow §4.2: at fixed ChunkSize and K, activations do not grow with the sequence;
    only the K/V state (context the chunks attend to) does."""
    kv_growth = _kv_state_bytes(8 * CHUNK) - _kv_state_bytes(4 * CHUNK)
    for k in (1, 2):
        assert _peak_saved_bytes(8, k) - _peak_saved_bytes(4, k) <= kv_growth
    naive_growth = _peak_saved_bytes(8, 8) - _peak_saved_bytes(4, 4)  # K = N keeps everything
    assert naive_growth > 4 * kv_growth


def test_saved_memory_grows_with_k():
    peaks = [_peak_saved_bytes(6, k) for k in (1, 2, 3)]
    assert peaks[0] < peaks[1] < peaks[2]


# bad plans -----------------------------------------------------------------------------------

@pytest.mark.parametrize("pipelines, message", [
    ([("0[0:12] 1[0:5]+2[0:4]", ["F0 F1 B1 B0"])], r"sequence 3: tokens \[0:3\) are missing"),
    ([("0[0:12] 1[0:5]+2[0:4]+3[0:3] 3[0:3]", ["F0 F1 F2 B2 B1 B0"])], r"tokens \[0:3\) appear twice in forward"),
    ([("0[0:12] 1[0:5]+2[0:4]+3[0:3]", ["F0 B1 F1 B0"])], r"B1 waits for F1 on stage 0, which comes later"),
    ([("0[0:12] 1[0:5]+2[0:4]+3[0:3]", ["F0 F1 B1"])], "stage 0 never runs B0"),
    ([(SPLIT, ["F0 F1 F2 B2 B0 B1 F3 B3"])], r"B0 waits for B1 on stage 0, which comes later"),
    ([(SPLIT, ["F1 F0 F2 B2 B1 B0 F3 B3"])], r"F1 waits for F/N0 on stage 0, which comes later"),
    ([("0[0:4] 1[0:5]+2[0:4]+3[0:3]", ["F0 B0 F1 B1"]), ("0[4:12]", ["F0 B0"])], "all slices of a sequence must run in one pipeline"),
    ([("0[0:12] 1[0:5]+2[0:4]+3[0:3]", ["F0 B0 F1 B1", "F1 B1 F0 B0"])], "B0 waits for B0 on stage 1, which stage 1 has not reached"),
    ([("0[0:12] 1[0:5]+2[0:4]+3[0:3]", ["F0 F7 B0"])], r"action F7: index out of range \(0..1\)"),
])
def test_invalid_plan_is_a_user_error(pipelines, message):
    with pytest.raises(UserError, match=message):
        _run(LLAMA, pipelines)


def test_bad_token_ids_are_a_user_error():
    model = build_model(LLAMA, dtype=torch.float64, seed=0)
    plan = unpacked_plan(LENGTHS, LLAMA)
    with pytest.raises(UserError, match="plan says length 12"):
        run_step(model, plan, random_tokens([11, 5, 4, 3], LLAMA.vocab, 0))
    with pytest.raises(UserError, match=r"vocab\(64\)"):
        run_step(model, plan, [t + 64 for t in random_tokens(LENGTHS, 64, 0)])


def test_varlen_backend_on_cpu_is_a_user_error():
    model = build_model(LLAMA, dtype=torch.float64, seed=0)
    with pytest.raises(UserError, match="varlen is unavailable"):
        run_step(model, unpacked_plan(LENGTHS, LLAMA), random_tokens(LENGTHS, 64, 0), backend="varlen")


def test_kv_state_is_freed_right_after_its_last_use():
    from lengthwise.runtime.state import last_uses

    plan = hand_plan(LLAMA, LENGTHS, PLANS["split-k1"])
    pipe = plan.pipelines[0]
    frees = last_uses(pipe.stages[0], pipe.chunks, LENGTHS)  # N0 N1 F2 B2 F1 B1 F0 B0 F3 B3
    assert frees == {5: [(0, 4, 8)], 7: [(0, 0, 4)]}  # slice [4:8] after B1, slice [0:4] after B0


QWEN_4 = ModelSpec(name="qwen-4-layers", num_layers=4, hidden=32, num_heads=4, num_kv_heads=1, head_dim=8,
                   ffn=48, vocab=64, qkv_bias=True, tied_embeddings=True, rope_theta=1e6)


@pytest.mark.parametrize("spec,name,chain", [(LLAMA, "split-k-all", False), (LLAMA, "mlp-recompute", False),
                                             (QWEN, "split-k1", True), (QWEN_4, "pp2", 1)],
                         ids=["split-k-all", "mlp-recompute", "chained-split-k1", "chained-pp2-regions-of-1"])
def test_compiled_layers_equal_eager_and_transformers(spec, name, chain, monkeypatch):
    """Each decoder layer under torch.compile (backend aot_eager: it traces and runs the
    captured graphs, forward and backward, without inductor's C++ compile, too slow for 2
    cores) on a plan with a sequence split in three slices and packed rows, and on one whose
    layers recompute their MLP block (its checkpoint around a compiled region of its own); and
    compiled with `chain` (the layers in one compiled region, attention inside,
    `model._run_chain`) on the split plan whose first slices run without gradients before they
    run with them (K = 1; its small rows traced whole, `flash_cpu.dense_row`), and on two
    pipeline stages of two layers each, each layer a region of its own with the attention an
    operator (CHAIN_LAYERS 1, no row dense: two regions a stage, each keeping the row registered
    for its own backward): loss and every gradient equal the eager executor's and transformers'
    within 1e-9; after the step no row is registered for a chained region's backward any more
    (`row_op`)."""
    pytest.importorskip("transformers")
    from lengthwise.runtime import flash_cpu, model as model_module, row_op
    from lengthwise.runtime.compile import compile_layers

    operator = chain is not True and bool(chain)
    if operator:
        monkeypatch.setattr(model_module, "CHAIN_LAYERS", chain)
        monkeypatch.setattr(flash_cpu, "DENSE_ENTRIES", 0)
    registered = []
    register = row_op.register
    monkeypatch.setattr(row_op, "register", lambda *a: registered.append(1) or register(*a))

    _, _, eager_loss, eager_grads = _run(spec, PLANS[name])
    plan = hand_plan(spec, LENGTHS, PLANS[name])
    model = build_model(spec, dtype=torch.float64, seed=0)
    compile_layers(model, backend="aot_eager", chain=bool(chain))
    ids = random_tokens(LENGTHS, spec.vocab, 1)
    loss = float(run_step(model, plan, ids))
    assert not row_op._CALLS and bool(registered) == operator
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_loss, ref_grads = transformers_loss_and_grads(model, ids)
    assert abs(loss - eager_loss) <= 1e-9 * abs(eager_loss) and abs(loss - ref_loss) <= 1e-9 * abs(ref_loss)
    assert compare_grads(grads, eager_grads)[1] <= 1e-9
    assert compare_grads(grads, ref_grads)[1] <= 1e-9


def test_a_chain_runs_only_layers_without_hooks_and_keeps_what_its_layers_keep_apart(monkeypatch):
    """What two compiled layers keep for backward over one chunk (saved-tensor hooks, the
    partitioner of aot_eager_decomp_partition), chained with the attention an operator and
    apart: the same bytes (the same tensors: inductor's partitioner alike, checked by hand). A
    layer with a forward hook of its own (as FSDP2 registers) is called as a module, its hook
    runs, and each layer runs a region of its own: the same bytes again. The row traced whole
    (`flash_cpu.dense_row`, a small row's default on a CPU) keeps its bias besides, once for
    both layers."""
    from lengthwise.plan.ir import Chunk
    from lengthwise.runtime import flash_cpu, model as model_module
    from lengthwise.runtime.compile import compile_layers
    from lengthwise.runtime.layout import ChunkLayout

    chains = []
    run_chain = model_module._run_chain
    monkeypatch.setattr(model_module, "_run_chain", lambda *a: chains.append(len(a[0])) or run_chain(*a))
    tokens, kept = 24, {}
    dense_entries = flash_cpu.DENSE_ENTRIES
    for chain, hooked, dense in ((False, False, False), (True, False, False), (True, True, False),
                                 (True, False, True)):
        monkeypatch.setattr(flash_cpu, "DENSE_ENTRIES", dense_entries if dense else 0)
        model = build_model(LLAMA, dtype=torch.float64, seed=0)
        compile_layers(model, backend="aot_eager_decomp_partition", chain=chain)
        calls = []
        if hooked:
            model.model.layers["0"].register_forward_pre_hook(lambda *a: calls.append(1))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        h = torch.randn(tokens, LLAMA.hidden, dtype=torch.float64, requires_grad=True)
        rope = model.rope(torch.arange(tokens), torch.float64)
        layout = ChunkLayout.from_chunk(Chunk.parse(f"0[0:{tokens}]"))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = model.run_layers(h, layers=range(2), rope=rope, layout=layout, contexts=[[[]], [[]]],
                                      backend="cpu-flash")
        out.sum().backward()
        kept[chain, hooked, dense] = sum(saved.values())
        assert calls == ([1] if hooked else [])
    assert chains == [2, 1, 1, 2]  # both layers in one region; with a hook, a region each
    assert kept[True, False, False] == kept[False, False, False] == kept[True, True, False]
    assert kept[True, False, True] == kept[False, False, False] + tokens * tokens * 8


def test_a_chain_without_a_flash_backend_runs_its_layers_as_before(monkeypatch):
    """Chained layers under the reference backend (no flash kernels to hold as an operator):
    no row is registered, each layer runs its own compiled regions around the eager attention,
    and the output and input gradient equal the eager layers'."""
    from lengthwise.plan.ir import Chunk
    from lengthwise.runtime import row_op
    from lengthwise.runtime.compile import compile_layers
    from lengthwise.runtime.layout import ChunkLayout

    registered = []
    register = row_op.register
    monkeypatch.setattr(row_op, "register", lambda *a: registered.append(1) or register(*a))
    tokens, results = 12, []
    for chain in (False, True):
        model = build_model(LLAMA, dtype=torch.float64, seed=0)
        if chain:
            compile_layers(model, backend="aot_eager", chain=True)
        h = torch.randn(tokens, LLAMA.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        out, _ = model.run_layers(h, layers=range(2), rope=model.rope(torch.arange(tokens), torch.float64),
                                  layout=ChunkLayout.from_chunk(Chunk.parse(f"0[0:{tokens}]")), contexts=[[[]], [[]]],
                                  backend="reference")
        out.sum().backward()
        results.append((out.detach(), h.grad))
    assert registered == []
    for eager, chained in zip(*results):
        assert (eager - chained).abs().max() <= 1e-12 * eager.abs().max()


@pytest.mark.parametrize("chain", [False, True], ids=["apart", "chained"])
def test_compiled_layers_compile_once_whatever_the_chunk_lengths(chain):
    """A first chunk exactly as long as the head dimension, then other lengths (a row of two
    documents, one of a single document): each of a layer's two compiled regions compiles one
    graph for every length, shared by both layers, and so does the head's (the loss blocks'
    softmax gradient); chained, the layers' one region (attention inside, a new row handle each
    chunk) replaces the two. With duck sizing
    on, the first length made a layer graph specialised to it and a second compile followed
    (`compile.py`)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lengthwise.runtime.compile import compile_layers

    torch._dynamo.reset()
    counters.clear()
    model = build_model(LLAMA, dtype=torch.float64, seed=0)
    compile_layers(model, backend="aot_eager", chain=chain)
    for lengths, chunks in (([LLAMA.head_dim], "0[0:8]"), ([5, 4], "0[0:5]+1[0:4]"), ([LLAMA.hidden + 3], "0[0:35]")):
        plan = hand_plan(LLAMA, lengths, [(chunks, ["F0 B0"])])
        run_step(model, plan, random_tokens(lengths, LLAMA.vocab, 1))
    assert counters["stats"]["unique_graphs"] == (1 if chain else 2) + 1
    assert torch._dynamo.config.recompile_limit >= 64  # a region's several graphs never fall back to eager


def test_a_compiled_layer_keeps_gate_and_up_not_their_product():
    """What one decoder layer keeps for backward, counted by saved-tensor hooks: eager, the
    autograd Functions' choice (`layer_ops`: gate and up, not the SwiGLU's product); compiled,
    AOTAutograd's partitioner's (the min-cut partitioner without inductor's code generation),
    which kept the product too until `compile_layers` let it recompute values backward
    writes out (`compile.py`). Two ffn-wide tensors either way; compiled, no more bytes than
    eager."""
    from lengthwise.plan.ir import Chunk
    from lengthwise.runtime.compile import compile_layers
    from lengthwise.runtime.layout import ChunkLayout

    tokens, backend = 24, "aot_eager_decomp_partition"
    kept = {}
    for compile_backend in (None, backend):
        model = build_model(LLAMA, dtype=torch.float64, seed=0)
        if compile_backend:
            compile_layers(model, backend=compile_backend)
        layer = next(iter(model.model.layers.values()))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.shape[-1])
            return t

        h = torch.randn(tokens, LLAMA.hidden, dtype=torch.float64, requires_grad=True)
        rope = model.rope(torch.arange(tokens), torch.float64)
        layout = ChunkLayout.from_chunk(Chunk.parse(f"0[0:{tokens}]"))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(h, rope, layout, [[]], "cpu-flash")[0]
        out.sum().backward()
        kept[compile_backend] = saved
    eager, compiled = kept[None], kept[backend]
    for saved in (eager, compiled):
        assert [size for size, width in saved.values() if width == LLAMA.ffn] == [tokens * LLAMA.ffn * 8] * 2
    assert sum(size for size, _ in compiled.values()) <= sum(size for size, _ in eager.values())
