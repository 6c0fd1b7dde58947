"""Tier 2, single-process numerics of the model pieces: masks, labels, weights, configs.

Float64 on CPU; the model is small enough that the whole file runs in seconds.
"""

from __future__ import annotations

import json

import pytest
import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk
from lengthwise.runtime.attention import ChunkLayout, attend, resolve_backend
from lengthwise.runtime.loss import IGNORE, chunk_labels, chunk_positions
from lengthwise.runtime.model import build_model
from lengthwise.runtime.weights import (
    hf_config_dict,
    load_state,
    load_weights,
    save_pretrained,
)
from lengthwise.specs import ModelSpec, model_from_hf_dict

from plan_helpers import chunk_logits

LLAMA = ModelSpec(name="llama-gqa", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8,
                  ffn=48, vocab=64)
QWEN = ModelSpec(name="qwen-tied", num_layers=2, hidden=32, num_heads=4, num_kv_heads=1, head_dim=8,
                 ffn=48, vocab=64, qkv_bias=True, tied_embeddings=True, rope_theta=1e6)


def _ids(lengths, vocab=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def test_mask_is_causal_per_segment_and_aligned_bottom_right():
    layout = ChunkLayout.from_chunk(Chunk.parse("7[4:6]+2[0:3]"))
    expected = torch.zeros(5, 9, dtype=torch.bool)
    expected[0, :5] = True          # query 0 of 7[4:6] sees its 4 context keys and itself
    expected[1, :6] = True
    for q in range(3):              # 2[0:3]: keys 6..8, causal
        expected[2 + q, 6:7 + q] = True
    assert torch.equal(layout.mask("cpu"), expected)


def test_no_cross_document_attention():
    """Perturbing a token of document A changes nothing at document B's positions of the same
    row, and changes A only at and after the perturbed position (one wrong mask bit fails)."""
    model = build_model(LLAMA, dtype=torch.float64, seed=0)
    chunk = Chunk.parse("0[0:7]+1[0:6]+2[0:5]")
    ids = _ids([7, 6, 5])
    base = chunk_logits(model, chunk, ids, backend="reference")
    bumped = [t.clone() for t in ids]
    bumped[1][3] = (bumped[1][3] + 1) % LLAMA.vocab
    moved = (chunk_logits(model, chunk, bumped, backend="reference") - base).abs().amax(-1)
    assert torch.all(moved[:7] == 0) and torch.all(moved[13:] == 0)   # documents 0 and 2
    assert torch.all(moved[7:10] == 0)                                # document 1 before token 3
    assert torch.all(moved[10:13] > 0)                                # token 3 onwards


def test_packed_row_logits_equal_each_document_alone():
    model = build_model(QWEN, dtype=torch.float64, seed=1)
    ids = _ids([5, 9])
    packed = chunk_logits(model, Chunk.parse("1[0:9]+0[0:5]"), ids, backend="reference")
    alone = [chunk_logits(model, Chunk.parse(f"{i}[0:{n}]"), ids, backend="reference") for i, n in enumerate([5, 9])]
    assert torch.allclose(packed, torch.cat([alone[1], alone[0]]), rtol=0, atol=1e-13)


def test_labels_continue_across_a_cut_and_stop_at_each_document_end():
    ids = _ids([8, 3])
    labels = chunk_labels(Chunk.parse("0[0:4]+1[0:3]"), ids)
    assert labels.tolist() == ids[0][1:5].tolist() + ids[1][1:3].tolist() + [IGNORE]
    tail = chunk_labels(Chunk.parse("0[4:8]"), ids)
    assert tail.tolist() == ids[0][5:8].tolist() + [IGNORE]


def test_positions_restart_per_document_and_continue_across_a_cut():
    assert chunk_positions(Chunk.parse("3[4:6]+1[0:2]"), "cpu").tolist() == [4, 5, 0, 1]


def test_context_attention_equals_attention_over_the_uncut_sequence():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    whole = attend(q, k, v, [[]], ChunkLayout.from_chunk(Chunk.parse("0[0:10]")), backend="reference")
    pieces = [[(k[:3], v[:3]), (k[3:6], v[3:6])]]
    tail = attend(q[6:], k[6:], v[6:], pieces, ChunkLayout.from_chunk(Chunk.parse("0[6:10]")), backend="reference")
    assert torch.allclose(tail, whole[6:], rtol=0, atol=1e-14)


@pytest.mark.parametrize("spec", [LLAMA, QWEN], ids=lambda s: s.name)
def test_checkpoint_round_trips_through_transformers(spec, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = build_model(spec, dtype=torch.float64, seed=2)
    save_pretrained(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64)
    ids = _ids([6])
    ours = chunk_logits(model, Chunk.parse("0[0:6]"), ids, backend="reference")
    theirs = hf(input_ids=ids[0][None]).logits[0].detach()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5)  # HF's norms run in float32
    hf.save_pretrained(tmp_path / "theirs")
    back = build_model(spec, dtype=torch.float64)
    load_weights(back, tmp_path / "theirs")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))


def test_mismatched_weight_is_named():
    model = build_model(LLAMA, dtype=torch.float64, seed=0)
    state = {k: v for k, v in model.state_dict().items()}
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \[3, 3\]"):
        load_state(model, state)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(UserError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.weight"):
        load_state(model, state)
    extra = {**model.state_dict(), "model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}
    with pytest.raises(UserError, match=r"unexpected tensor model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_state(model, extra)


@pytest.mark.parametrize("field, value", [("mlp_bias", True), ("use_sliding_window", True),
                                          ("rope_scaling", {"type": "linear", "factor": 2.0}),
                                          ("hidden_act", "gelu"), ("attention_bias", True)])
def test_unsupported_config_field_is_named(field, value, tmp_path):
    cfg = {**hf_config_dict(LLAMA), field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=field):
        ModelSpec.from_hf_config(path)


def test_hf_config_round_trips_the_spec():
    for spec in (LLAMA, QWEN):
        back = model_from_hf_dict(hf_config_dict(spec), name=spec.name)
        assert back == spec


def test_unavailable_backend_is_a_user_error():
    with pytest.raises(UserError, match="varlen is unavailable: it needs a CUDA device"):
        resolve_backend("varlen", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(UserError, match="unknown attention backend 'flash9'"):
        resolve_backend("flash9", torch.device("cpu"), torch.float64)
    with pytest.raises(UserError, match="cpu-flash is unavailable: it needs a floating-point model"):
        resolve_backend("cpu-flash", torch.device("cpu"), torch.int64)
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "cpu-flash"
    # On a GPU in 32 or 64 bits neither fast kernel runs: auto falls back to the reference.
    assert resolve_backend("auto", torch.device("cuda"), torch.float32) == "reference"
    with pytest.raises(UserError, match="cpu-flash is unavailable: it runs on a CPU, the model is on cuda"):
        resolve_backend("cpu-flash", torch.device("cuda"), torch.float32)


def test_auto_uses_the_reference_where_this_torch_lacks_the_cpu_flash_kernel(monkeypatch):
    from lengthwise.runtime import flash_cpu
    monkeypatch.setattr(flash_cpu, "_kernel_problem", lambda: "this torch has no CPU flash-attention kernel")
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "reference"
    with pytest.raises(UserError, match="cpu-flash is unavailable: this torch has no CPU flash"):
        resolve_backend("cpu-flash", torch.device("cpu"), torch.float32)


def test_backend_choices_of_the_commands_are_the_runtime_ones():
    from lengthwise.commands.common import ATTENTION_BACKENDS
    from lengthwise.runtime.attention import BACKENDS
    assert ATTENTION_BACKENDS == BACKENDS


def _attention_inputs(spec: str, gen, dtype=torch.float64, heads=4, kv_heads=2, dim=8):
    """q, k, v of a row and, per segment, context pieces (two when it can) making up the part
    of its context that is not in the row."""
    layout = ChunkLayout.from_chunk(Chunk.parse(spec))
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    rows = sum(layout.q_lens)
    q, k, v = rand(rows, heads, dim), rand(rows, kv_heads, dim), rand(rows, kv_heads, dim)
    context = []
    for i, start in enumerate(layout.ctx_lens):
        in_store = start - sum(layout.q_lens[j] for j in layout.row_context[i])
        sizes = [n for n in (in_store // 2, in_store - in_store // 2) if n]
        context.append([(rand(n, kv_heads, dim), rand(n, kv_heads, dim)) for n in sizes])
    return layout, q, k, v, context


ROWS = ["0[0:300]",                               # one document: a single causal call
        "0[40:300]",                              # a slice with context from the store
        "3[0:4]+3[4:11]+1[0:3]+2[0:2]+4[5:9]+5[0:12]",   # row context, short documents grouped
        "1[0:3]+2[0:2]+6[0:3]+7[0:1]+8[0:290]+9[0:5]",   # a group, then a document past it
        "6[9:40]+6[40:41]+7[0:1]"]                # one-token segments


@pytest.mark.parametrize("spec", ROWS)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_cpu_flash_equals_the_reference_with_gradients(spec, kv_heads):
    """cpu-flash (CPU flash calls merged by log-sum-exp) gives the reference's output and
    the gradients of q, k, v and every context piece, to float64 rounding."""
    gen = torch.Generator().manual_seed(len(spec) + kv_heads)
    layout, q, k, v, context = _attention_inputs(spec, gen, kv_heads=kv_heads)
    leaves = [q, k, v, *(t for pieces in context for kv in pieces for t in kv)]
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    results = {}
    for backend in ("reference", "cpu-flash"):
        out = attend(q, k, v, context, layout, backend=backend)
        results[backend] = [out, *torch.autograd.grad(out, leaves, grad_out)]
    for ref, ours in zip(results["reference"], results["cpu-flash"]):
        assert torch.allclose(ours, ref, rtol=0, atol=1e-13)


def test_cpu_flash_saves_no_scores():
    """What cpu-flash keeps for backward grows with the row, not with row x keys."""
    from lengthwise.runtime.memory import SavedTensorMeter
    gen = torch.Generator().manual_seed(0)
    saved = {}
    for context in (64, 1024):
        layout, q, k, v, pieces = _attention_inputs(f"0[{context}:{context + 64}]", gen)
        with SavedTensorMeter() as meter:
            attend(q, k, v, pieces, layout, backend="cpu-flash").sum().backward()
        saved[context] = meter.peak_bytes
    inputs_growth = 2 * (1024 - 64) * 2 * 8 * 8   # the two context pieces of k and v, float64
    assert saved[1024] - saved[64] == inputs_growth


LLAMA3 = ModelSpec(name="llama3-scaled", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8,
                   ffn=48, vocab=64, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 16))


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    """Positions past the (tiny) original context of 16 exercise all three frequency bands."""
    transformers = pytest.importorskip("transformers")
    model = build_model(LLAMA3, dtype=torch.float32, seed=3)
    save_pretrained(model, tmp_path)
    assert model_from_hf_dict(json.loads((tmp_path / "config.json").read_text()), name=LLAMA3.name) == LLAMA3
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = _ids([40])
    ours = chunk_logits(model, Chunk.parse("0[0:40]"), ids, backend="reference")
    theirs = hf(input_ids=ids[0][None]).logits[0].detach()
    plain = chunk_logits(build_model(LLAMA3.__class__(**{**LLAMA3.to_dict(), "rope_scaling": None}),
                                     dtype=torch.float32, seed=3), Chunk.parse("0[0:40]"), ids, backend="reference")
    assert torch.allclose(ours, theirs, rtol=0, atol=2e-5)       # float32 round-off of 2 layers
    assert not torch.allclose(plain, theirs, rtol=0, atol=1e-3)  # the scaling matters here


def test_stage_parts_hold_only_their_modules_with_the_whole_models_values():
    from lengthwise.runtime.model import StagePart

    whole = build_model(QWEN, dtype=torch.float64, seed=5).state_dict()
    first = build_model(QWEN, dtype=torch.float64, seed=5, part=StagePart(layers=range(0, 1), first=True, last=False))
    last = build_model(QWEN, dtype=torch.float64, seed=5, part=StagePart(layers=range(1, 2), first=False, last=True))
    assert set(first.state_dict()) == {"model.embed_tokens.weight"} | {k for k in whole if k.startswith("model.layers.0.")}
    assert set(last.state_dict()) == (set(whole) - set(first.state_dict())) | {"model.embed_tokens.weight"}
    assert last.lm_head.weight is last.model.embed_tokens.weight  # tied on the last stage
    for part in (first, last):
        assert all(torch.equal(t, whole[k]) for k, t in part.state_dict().items())


def test_stage_loads_only_its_tensors_from_a_sharded_checkpoint(tmp_path):
    from safetensors.torch import save_file

    from lengthwise.runtime.model import StagePart

    whole = build_model(LLAMA, dtype=torch.float64, seed=7).state_dict()
    names = sorted(whole)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: whole[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    stage = build_model(LLAMA, dtype=torch.float64, part=StagePart(layers=range(1, 2), first=False, last=True))
    load_weights(stage, tmp_path)
    assert all(torch.equal(t, whole[k]) for k, t in stage.state_dict().items())
    assert not any(k.startswith("model.layers.0.") or k == "model.embed_tokens.weight" for k in stage.state_dict())
    bad = {**whole, "model.norm.weight": torch.zeros(31, dtype=torch.float64)}
    save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "one.safetensors"))
    with pytest.raises(UserError, match=r"model\.norm\.weight has shape \[31\], the model config needs \[32\]"):
        load_weights(stage, tmp_path / "one.safetensors")


def test_parameter_names_from_the_spec_are_the_models():
    from lengthwise.runtime.model import parameter_names

    for spec in (LLAMA, QWEN):
        assert parameter_names(spec) == [n for n, _ in build_model(spec, seed=0).named_parameters()]


def test_seeded_weights_drawn_on_threads_equal_those_drawn_one_after_another(monkeypatch):
    """init_weights draws each parameter's noise on a few threads ahead of the copy; each
    parameter has its own generator, so the values are bit for bit the sequential draw's."""
    import lengthwise.runtime.model as model_module

    spec = ModelSpec(name="t", num_layers=3, hidden=16, num_heads=4, num_kv_heads=2, head_dim=4, ffn=24, vocab=40)
    threaded = build_model(spec, dtype=torch.float64, seed=11)
    calls = []
    monkeypatch.setattr(model_module, "_ordered_window",
                        lambda fn, items, workers: calls.append(workers) or map(fn, items))
    sequential = build_model(spec, dtype=torch.float64, seed=11)
    assert calls  # the threaded path was the one replaced
    for (name, a), (_, b) in zip(threaded.named_parameters(), sequential.named_parameters()):
        assert torch.equal(a, b), name
