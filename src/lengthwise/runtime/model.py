"""A Llama/Qwen2-family decoder in plain PyTorch, cut-able into pipeline stages.

Module and parameter names equal Hugging Face's (`model.embed_tokens.weight`,
`model.layers.3.self_attn.q_proj.weight`, `model.norm.weight`, `lm_head.weight`), so a
`state_dict` moves between this model and `transformers.LlamaForCausalLM` /
`Qwen2ForCausalLM` unchanged (see `runtime/weights.py`).

The model never sees a batch dimension: a *chunk* is one packed row of T tokens, and every
layer takes the row's positions (for the rotary embedding) and its `ChunkLayout` (which tokens
attend to which, `runtime/attention.py`). A layer also takes the K/V *context* of each segment
and returns its own post-rotary K/V, so the state-aware executor (`runtime/stage.py`) can keep
K/V across the slices of a split sequence (chunkflow §4.2).

Stages: `embed` (first stage), `layers[a:b]` (any contiguous range), `head_loss` (last stage:
final norm, LM head and the loss's sum, blocked so the [T, V] logits never exist,
`runtime/loss.head_loss_sum`; `head_logits` makes them, for inspection) are separate calls;
the executor decides which a stage runs. A `StagePart` builds only one stage's modules (its
layers, the embedding on the first stage, norm and head on the last), so a rank holds memory
in proportion to its layers; `layers` is a ModuleDict keyed by the global
layer index, so names stay Hugging Face's whatever the split. The model imports no parallel
code: FSDP2 and tensor parallelism are applied from outside (`runtime/parallel/`).

Numerics follow Hugging Face: RMSNorm and rotary tables are computed in float32 for 16/32-bit
models; in float64 they stay in float64 (Hugging Face would drop to float32 there, see
`runtime/verify.py` for how the oracle is aligned).

Tensor legend: T tokens in the row, D hidden, H query heads, G key/value heads, E head dim,
F SwiGLU width, V vocabulary.
"""

from __future__ import annotations

import functools
import math
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint

from torch.distributed.tensor import DTensor

from lengthwise.runtime import flash_cpu, row_op
from lengthwise.runtime.attention import ChunkLayout, attend, resolve_backend, row_kernels, wants_varlen_index
from lengthwise.runtime.compile import compiled
from lengthwise.runtime.layer_ops import (QKV, GateUp, LinearResidual, OutputNorm, SiluMul, SwiGLUDown, compute_dtype,
                                          heads, rms_norm, rms_norm_backward, rotate)
from lengthwise.runtime.layout import LayerContext, RowIndex, context_pieces
from lengthwise.runtime.loss import VocabShard, head_loss_sum
from lengthwise.specs import ModelSpec


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, reduced in at least float32."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype))
        self.eps = eps

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x_TD, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm keeping only its input and the per-token reciprocal RMS for backward (what a
    fused norm kernel keeps), not autograd's widened copy of the input (4 bytes per value in
    bf16 runs) and its normalised output: the cost model's "norm input" (`cost/memory.py`).
    Forward and backward are the same operations, in the same dtypes, that autograd would run
    on the plain expression."""

    @staticmethod
    def forward(ctx, x_TD, weight_D, eps: float):
        y_TD, rstd_T1 = rms_norm(x_TD, weight_D, eps)
        ctx.save_for_backward(x_TD, weight_D, rstd_T1)
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        return *rms_norm_backward(grad_TD, *ctx.saved_tensors), None


def inverse_frequencies(*, head_dim: int, theta: float, scaling, dtype: torch.dtype, device) -> torch.Tensor:
    """theta^(-2i/E), with Llama-3's scaling when given: wavelengths beyond the original
    context / low_freq_factor are stretched by `factor`, those below context / high_freq_factor
    kept, and the band between interpolated linearly in context / wavelength."""
    exponents = torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor, low, high, context = scaling
    wavelen = 2 * math.pi / inv_freq
    smooth = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rotary_tables(positions_T: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype,
                  scaling=None):
    """cos and signed sin tables [T, 1, E] at explicit positions (a slice starting at 4096
    rotates from 4096, not 0): Hugging Face's half-split cos and sin, computed as it does, the
    sin with its first half negated (`layer_ops.rotate`), shaped to broadcast over heads."""
    wide = compute_dtype(dtype)
    inv_freq = inverse_frequencies(head_dim=head_dim, theta=theta, scaling=scaling, dtype=wide,
                                   device=positions_T.device)
    freqs_TE = positions_T.to(wide)[:, None] * inv_freq[None, :]
    angles_TE = torch.cat((freqs_TE, freqs_TE), dim=-1)
    sin_TE = angles_TE.sin()
    half = sin_TE.shape[-1] // 2
    signed_sin_TE = torch.cat((-sin_TE[:, :half], sin_TE[:, half:]), dim=-1)
    return angles_TE.cos().to(dtype)[:, None, :], signed_sin_TE.to(dtype)[:, None, :]


class SelfAttention(nn.Module):
    """GQA attention; optional bias on q, k and v (Qwen2), none on the output projection."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype | None = None):
        super().__init__()
        self.spec = spec
        self.q_proj = nn.Linear(spec.hidden, spec.q_dim, bias=spec.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(spec.q_dim, spec.hidden, bias=False, dtype=dtype)

    def forward(self, x_TD, rope, layout: ChunkLayout, context, backend: str):
        """Returns the output [T, D] and this row's post-rotary k, v [T, G, E]."""
        # Heads counted from the projections' outputs: under tensor parallelism (applied from
        # outside) a rank's projections produce its share of the heads.
        q_THE, k_TGE, v_TGE = self.inputs(x_TD, rope)
        out_THE = attend(q_THE, k_TGE, v_TGE, context, layout, backend=backend)
        return self.o_proj(out_THE.flatten(1)), k_TGE, v_TGE

    def inputs(self, x_TD, rope):
        """Post-rotary q [T, H, E], k and v [T, G, E]."""
        q_THE, k_TGE, v_TGE = (heads(proj(x_TD), self.spec.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return rotate(q_THE, *rope), rotate(k_TGE, *rope), v_TGE


class SwiGLU(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden, spec.ffn, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn, bias=False, dtype=dtype)
        self.down_proj = DownProjection(spec.ffn, spec.hidden, bias=False, dtype=dtype)

    def forward(self, x_TD: torch.Tensor, recomputed: bool = False) -> torch.Tensor:
        """down_proj(silu(gate) * up); `recomputed`: the block's tensors are made again in
        backward (under a checkpoint), so the product is a node of its own that the down
        projection keeps (`layer_ops` module docstring)."""
        gate_TF, up_TF = self.gate_proj(x_TD), self.up_proj(x_TD)
        if recomputed:
            return self.down_proj(SiluMul.apply(gate_TF, up_TF))
        return self.down_proj(gate_TF, up_TF)


class DownProjection(nn.Linear):
    """The SwiGLU's down projection: of the product (`forward(product)`), or of gate and up,
    making the product itself (`layer_ops.SwiGLUDown`, which keeps gate and up but not the
    product). Under tensor parallelism (applied from outside) the weight is a DTensor of this
    rank's input columns: the projection runs on its local shard with this rank's columns of
    gate and up (or the product), plain tensors, and its output, this rank's partial sum, is
    reduced by the parallel style's output hook (`parallel/tensor_parallel.SwiGLUDownParallel`)."""

    def forward(self, x_TF: torch.Tensor, up_TF: torch.Tensor | None = None) -> torch.Tensor:
        weight_DF = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if up_TF is None:
            return F.linear(x_TF, weight_DF)
        return SwiGLUDown.apply(None, x_TF, up_TF, weight_DF)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype | None = None):
        super().__init__()
        self.self_attn = SelfAttention(spec, dtype)
        self.mlp = SwiGLU(spec, dtype)
        self.input_layernorm = RMSNorm(spec.hidden, spec.rms_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.rms_eps, dtype)

    compile_backend: str | None = None
    """The torch.compile backend this layer's forward runs under (`runtime/compile.py`); None:
    eager. A plain attribute, so a deep copy of the model is compiled alike."""
    compile_chain: bool = False
    """Compiled with `chain`: `run_layers` runs this layer with its neighbours in one compiled
    region, attention included (`_run_chain`)."""

    def forward(self, h_TD, rope, layout: ChunkLayout, context, backend: str, recompute_mlp: bool = False,
                recomputed: bool = False):
        """One pre-norm block; returns (h [T, D], k [T, G, E], v [T, G, E]).

        `context[i]` lists the (k, v) pieces of segment i's earlier slices, oldest first. With
        `recompute_mlp` (and grad enabled) the MLP block keeps only its input and runs again in
        backward (`mlp_block`). `recomputed`: the caller checkpoints the whole layer, so its
        MLP ends in the nodes whose rerun stops before the down projection's GEMM
        (`layer_ops` module docstring)."""
        if recompute_mlp and torch.is_grad_enabled():
            return self._with_mlp_checkpoint(h_TD, rope, layout, context, backend)
        if not _plain(self):  # tensor parallelism's hooks and DTensor weights: the module calls
            if self.compile_backend is None:
                return self.block(h_TD, rope, layout, context, backend, recomputed)
            return compiled(DecoderLayer.block, self.compile_backend)(self, h_TD, rope, layout, context, backend,
                                                                       recomputed)
        if self.compile_backend is None:
            return self.fused(h_TD, rope, layout, context, backend, recomputed)
        if self.compile_chain and not recomputed:
            # a layer alone (FSDP2's hooks on it, a stage of one layer): one region, attention inside
            chained = _run_chain([self], h_TD, rope, layout, [context], backend)
            if chained:
                h_TD, ((k_TGE, v_TGE),) = chained
                return h_TD, k_TGE, v_TGE
        # Two compiled regions around the attention, which stays eager (`compile.py`).
        q_THE, k_TGE, v_TGE = compiled(DecoderLayer.attention_input, self.compile_backend)(self, h_TD, rope)
        out_THE = attend(q_THE, k_TGE, v_TGE, context, layout, backend=backend)
        h_TD = compiled(DecoderLayer.attention_output, self.compile_backend)(self, h_TD, out_THE, recomputed)
        return h_TD, k_TGE, v_TGE

    def fused(self, h_TD, rope, layout: ChunkLayout, context, backend: str, recomputed: bool = False):
        """`block`'s arithmetic in six autograd nodes (seven when `recomputed`, `layer_ops.py`):
        the same saved tensors (but the SwiGLU's product, made again in backward), a fraction of
        its host time."""
        q_THE, k_TGE, v_TGE = self.attention_input(h_TD, rope)
        out_THE = attend(q_THE, k_TGE, v_TGE, context, layout, backend=backend)
        return self.attention_output(h_TD, out_THE, recomputed), k_TGE, v_TGE

    def attention_input(self, h_TD, rope):
        """Post-rotary q [T, H, E], k and v [T, G, E] of the normed input, in two nodes."""
        attn, norm = self.self_attn, self.input_layernorm
        return QKV.apply(_RMSNorm.apply(h_TD, norm.weight, norm.eps), *rope, attn.spec.head_dim, attn.q_proj.weight,
                         attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias)

    def attention_output(self, h_TD, out_THE, recomputed: bool = False):
        """The output projection, the residuals and the MLP, in three nodes (four when
        `recomputed`: the SwiGLU's product a node of its own, kept by the down projection)."""
        mlp, norm = self.mlp, self.post_attention_layernorm
        h_TD, x_TD = OutputNorm.apply(h_TD, out_THE, self.self_attn.o_proj.weight, norm.weight, norm.eps)
        gate_TF, up_TF = GateUp.apply(x_TD, mlp.gate_proj.weight, mlp.up_proj.weight)
        if recomputed:
            return LinearResidual.apply(h_TD, SiluMul.apply(gate_TF, up_TF), mlp.down_proj.weight)
        return SwiGLUDown.apply(h_TD, gate_TF, up_TF, mlp.down_proj.weight)

    def _with_mlp_checkpoint(self, h_TD, rope, layout: ChunkLayout, context, backend: str):
        """The layer with its MLP block under non-reentrant `torch.utils.checkpoint` (selective
        recomputation, `F.mN`). The checkpoint's input is the post-attention norm's input, the
        residual stream, which the layer keeps anyway; what the norm and the MLP save (the
        norm's reciprocal RMS and output, gate, up, their product: `SwiGLU`'s recomputed
        nodes) is made again in backward, the rerun stopping once the down projection's input
        is back (`cost/flops.py`). Compiled
        layers compile the attention part and the MLP block apart, the checkpoint outside them
        (as `run_layers` checkpoints a compiled layer whole)."""
        cb = self.compile_backend
        if cb is None:
            h_TD, k_TGE, v_TGE = self.attention_block(h_TD, rope, layout, context, backend)
        elif _hooked(self.self_attn):
            h_TD, k_TGE, v_TGE = compiled(DecoderLayer.attention_block, cb)(self, h_TD, rope, layout, context, backend)
        else:  # the attention outside the compiled regions, as `forward`'s
            q_THE, k_TGE, v_TGE = compiled(DecoderLayer.before_attention, cb)(self, h_TD, rope)
            out_THE = attend(q_THE, k_TGE, v_TGE, context, layout, backend=backend)
            h_TD = compiled(DecoderLayer.attention_residual, cb)(self, h_TD, out_THE)
        mlp = self.mlp_block if cb is None else functools.partial(compiled(DecoderLayer.mlp_block, cb), self)
        return h_TD + checkpoint(mlp, h_TD, True, use_reentrant=False), k_TGE, v_TGE

    def attention_block(self, h_TD, rope, layout: ChunkLayout, context, backend: str):
        """The residual stream after the attention block, and the row's k, v."""
        attn_TD, k_TGE, v_TGE = self.self_attn(self.input_layernorm(h_TD), rope, layout, context, backend)
        return h_TD + attn_TD, k_TGE, v_TGE

    def attention_residual(self, h_TD, out_THE):
        return h_TD + self.self_attn.o_proj(out_THE.flatten(1))

    def mlp_block(self, h_TD, recomputed: bool = False):
        """The MLP block's output (before its residual add) from the residual stream
        (`recomputed`: `SwiGLU.forward`'s, a keyword: tensor parallelism's input hook on the
        MLP takes one input)."""
        return self.mlp(self.post_attention_layernorm(h_TD), recomputed=recomputed)

    def before_attention(self, h_TD, rope):
        return self.self_attn.inputs(self.input_layernorm(h_TD), rope)

    def block(self, h_TD, rope, layout: ChunkLayout, context, backend: str, recomputed: bool = False):
        """The layer's computation as module calls, where tensor parallelism's hooks act."""
        h_TD, k_TGE, v_TGE = self.attention_block(h_TD, rope, layout, context, backend)
        return h_TD + self.mlp_block(h_TD, recomputed), k_TGE, v_TGE


CHAIN_LAYERS = 4
"""Layers one chained region holds at most (`_run_chain`): a stage of L layers calls
ceil(L / 4) regions per chunk, forward and backward. Larger regions call less often but compile
longer (the graph unrolls its layers) and, with a stage's layer count no multiple of it, compile
one more graph for the rest. Measured on a CPU (inductor; `bench_host_overhead.py` host time a
layer and chunk against the layers compiled apart in the same run, and the compile-bound
`lengthwise verify --model-config tiny-qwen --k 1`), the attention an operator: 2 layers 0.79 of
the host time, verify 29 s; 4 layers 0.68, 48 s; apart 17 s. Four, for the host time a ChunkFlow
step waits on; the compilation is paid once a run."""


def _chainable(layers: list[DecoderLayer]) -> bool:
    """Whether `_run_chain` may run these layers together: compiled with `chain`
    (`compile.compile_layers`), all under one backend, plain (`_plain`) and without hooks of
    their own (FSDP2 unshards a layer's weights in its forward's hooks, which a region of
    several layers would not call: such a layer runs a region of its own inside its forward)."""
    return (len(layers) > 1 and all(layer.compile_chain for layer in layers)
            and len({layer.compile_backend for layer in layers}) == 1
            and all(_plain(layer) and not _hooked(layer) for layer in layers))


def _chain_region(layers: list[DecoderLayer], h_TD, rope, flats, handle: int | None, bias_TK):
    """Layers over one chunk with the attention inside: the region `_run_chain` compiles.
    `bias_TK` None: the attention is an operator (`row_op.flash_row`) that finds its row by
    `handle`; else a small row on a CPU, traced (`flash_cpu.dense_row` under that bias, the
    handle unused). Returns h and the (k, v) per layer."""
    kv_per_layer = []
    for layer, flat in zip(layers, flats):
        q_THE, k_TGE, v_TGE = layer.attention_input(h_TD, rope)
        if bias_TK is None:
            out_THE, _ = row_op.flash_row(q_THE, k_TGE, v_TGE, flat, handle)
        else:
            out_THE = flash_cpu.dense_row(q_THE, k_TGE, v_TGE, flat, bias_TK)
        h_TD = layer.attention_output(h_TD, out_THE)
        kv_per_layer.append((k_TGE, v_TGE))
    return h_TD, kv_per_layer


def _run_chain(layers: list[DecoderLayer], h_TD, rope, index, contexts, backend):
    """`run_layers` over compiled layers, up to CHAIN_LAYERS of them in one compiled region,
    attention included (`row_op`): per chunk one compiled call forward and one backward for
    every CHAIN_LAYERS layers, instead of two each per layer (`attention_input`,
    `attention_output` around an eager attention). The arithmetic is the layers'; what the
    region keeps for backward is AOTAutograd's partitioner's choice over the larger graph.
    A small row on a CPU is traced whole instead of held as an operator (`flash_cpu.dense_row`,
    under a bias built once per chunk): the region then calls nothing opaque, and no Python of
    the row's runs inside it.
    Returns h and the (k, v) per layer; None where it cannot run, and the caller runs the layers
    as before: no flash backend (the reference one, a distributed attention), no RowIndex, or
    layers whose contexts differ in shape (not from the stage: it hands every layer the same
    pieces)."""
    kernels = row_kernels(backend, h_TD.device, h_TD.dtype)
    contexts = [context_pieces(context) for context in contexts]
    pieces = {tuple(len(p) for p in context) for context in contexts}
    if kernels is None or not isinstance(index, RowIndex) or len(pieces) != 1:
        return None
    bias_TK = flash_cpu.dense_bias(kernels, index.layout, contexts[0], h_TD.device, h_TD.dtype)
    call = None if bias_TK is not None else row_op.register(kernels, index, pieces.pop())
    region = compiled(_chain_region, layers[0].compile_backend)
    kv_per_layer = []
    for at in range(0, len(layers), CHAIN_LAYERS):
        group = layers[at:at + CHAIN_LAYERS]
        flats = [[t for piece in context for kv in piece for t in kv] for context in contexts[at:at + len(group)]]
        h_TD, kv = region(group, h_TD, rope, flats, call and call.handle, bias_TK)
        if call is not None and h_TD.grad_fn is not None:  # registered until the region's backward has run
            h_TD.grad_fn.metadata["row_call"] = call
        kv_per_layer += kv
    return h_TD, kv_per_layer


def _plain(layer: DecoderLayer) -> bool:
    """No hooks on the layer's parts and plain-tensor weights (no tensor parallelism): the layer
    may run as `fused`, without its modules' calls. FSDP2's hooks sit on the layer itself and
    hand it plain unsharded weights."""
    parts = (layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
    return not any(_hooked(part) for part in parts) and not isinstance(layer.self_attn.q_proj.weight, DTensor)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


@dataclass(frozen=True, kw_only=True)
class StagePart:
    """Which modules one pipeline stage holds."""

    layers: range
    """Global indices of its decoder layers (contiguous)."""
    first: bool
    """Holds the embedding."""
    last: bool
    """Holds the final norm and the LM head (and the embedding too when tied)."""

    @classmethod
    def whole(cls, spec: ModelSpec) -> StagePart:
        return cls(layers=range(spec.num_layers), first=True, last=True)


class DecoderStack(nn.Module):
    """Hugging Face's `model.` prefix: embedding, layers, final norm (those of `part`)."""

    def __init__(self, spec: ModelSpec, part: StagePart, dtype: torch.dtype | None = None):
        super().__init__()
        if part.first or (part.last and spec.tied_embeddings):
            self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden, dtype=dtype)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec, dtype) for i in part.layers})
        if part.last:
            self.norm = RMSNorm(spec.hidden, spec.rms_eps, dtype)


class CausalLM(nn.Module):
    """The decoder plus its LM head; `lm_head.weight` is the embedding when tied."""

    def __init__(self, spec: ModelSpec, part: StagePart | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        spec.validate()
        self.spec = spec
        self.part = part or StagePart.whole(spec)
        self.model = DecoderStack(spec, self.part, dtype)
        if self.part.last:
            self.lm_head = LMHead(spec.hidden, spec.vocab, bias=False, dtype=dtype)
        self.sequence_shards = 1
        """Ranks the residual stream's rows are split over (sequence parallelism, set by tensor
        parallelism from outside): `embed` and the layers return this rank's rows of the chunk
        padded to a multiple of it, `head_logits` takes them and returns every padded row."""
        self.tie()

    def tie(self) -> None:
        """Make the LM head share the embedding's parameter (again, after `to_empty`)."""
        if self.spec.tied_embeddings and self.part.last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, tokens_T: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens_T)

    def rope(self, positions_T: torch.Tensor, dtype: torch.dtype):
        spec = self.spec
        return rotary_tables(positions_T, head_dim=spec.head_dim, theta=spec.rope_theta, dtype=dtype,
                             scaling=spec.rope_scaling)

    def run_layers(self, h_TD, *, layers: range, rope, layout: ChunkLayout, contexts, backend: str,
                   recompute_layers: int = 0, recompute_mlp: int = 0):
        """Layers `layers` (a contiguous range) over one chunk.

        `contexts[j]` is the per-segment context of layer layers[j]. The first
        `recompute_layers` keep only their input and run again in backward (infinipipe §4's
        chunk-level checkpointing); the next `recompute_mlp` keep all but their MLP block's
        tensors and run that block again (`DecoderLayer.forward`). Returns h and the list of
        (k, v) per layer."""
        if not isinstance(layout, RowIndex):  # built once here for every layer (the stage passes its own)
            resolved = backend if callable(backend) else resolve_backend(backend, h_TD.device, h_TD.dtype)
            layout = RowIndex.build(layout, h_TD.device, varlen=wants_varlen_index(resolved))
        modules = [self.model.layers[str(index)] for index in layers]
        if not (recompute_layers or recompute_mlp) and _chainable(modules):
            chained = _run_chain(modules, h_TD, rope, layout, contexts, backend)
            if chained:
                return chained
        kv_per_layer = []
        for j, layer in enumerate(modules):
            args = (h_TD, rope, layout, LayerContext(contexts[j]), backend)
            if j < recompute_layers and torch.is_grad_enabled():
                h_TD, k_TGE, v_TGE = checkpoint(layer, *args, recomputed=True, use_reentrant=False)
            else:
                h_TD, k_TGE, v_TGE = layer(*args, recompute_mlp=j < recompute_layers + recompute_mlp)
            kv_per_layer.append((k_TGE, v_TGE))
        return h_TD, kv_per_layer

    def head_logits(self, h_TD: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] (this rank's vocabulary columns under tensor parallelism)."""
        return self.lm_head(self.model.norm(h_TD))

    def head_loss(self, h_TD: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
        """Sum of the row's token cross-entropies (`labels_T`: one per row of the head's input,
        padding rows included, IGNORE where nothing is predicted), the logits made and dropped a
        block at a time (`loss.head_loss_sum`); whole on every TP rank."""
        return self.lm_head(self.model.norm(h_TD), labels_T)


class LMHead(nn.Linear):
    """The LM head: the logits, or with labels the loss's sum without the logits
    (`loss.head_loss_sum`). Under tensor parallelism the weight is this rank's vocabulary rows
    (a DTensor) and `vocab_shard` says which; the input arrives whole on every rank
    (`parallel/tensor_parallel.py` gathers it)."""

    vocab_shard: VocabShard | None = None
    block_bytes: int | None = None
    """Bytes of wide logits per block of the loss (`loss.head_loss_sum`); None: the default."""
    compile_backend: str | None = None
    """The loss blocks' elementwise work compiled under this backend (`runtime.compile`)."""

    def forward(self, x_TD: torch.Tensor, labels_T: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if labels_T is not None:
            return head_loss_sum(x_TD, weight, labels_T, self.vocab_shard, block_bytes=self.block_bytes,
                                 compile_backend=self.compile_backend)
        logits = F.linear(x_TD, weight)
        real = None if self.vocab_shard is None else self.vocab_shard.real
        if real is not None and real < logits.shape[-1]:  # padded vocabulary columns
            logits = logits.index_fill(-1, torch.arange(max(real, 0), logits.shape[-1], device=logits.device),
                                       float("-inf"))
        return logits


def build_model(spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device="cpu",
                seed: int | None = None, part: StagePart | None = None) -> CausalLM:
    """The model (or one stage's `part` of it) in `dtype` on `device`.

    Built on the meta device and materialised once, in place, so a stage allocates only its
    own parameters. With a seed, random weights (`init_weights`, the same values whatever the
    split); without, uninitialised memory for `weights.load_weights` to fill."""
    model = meta_model(spec, part=part, dtype=dtype)
    model.to_empty(device=device)
    model.tie()
    if seed is not None:
        init_weights(model, seed)
    return model


def parameter_names(spec: ModelSpec) -> list[str]:
    """Every parameter of the whole model, in `named_parameters` order, from the spec alone
    (no module built: also under fake tensors, and cheap for 80 layers)."""
    attn = [f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in (("weight", "bias") if spec.qkv_bias else ("weight",))]
    layer = [*attn, "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight"]
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{name}" for i in range(spec.num_layers) for name in layer]
    return names + ["model.norm.weight"] + ([] if spec.tied_embeddings else ["lm_head.weight"])


def meta_model(spec: ModelSpec, *, part: StagePart | None = None, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The model's structure without storage (for parallelising before materialising, and for
    fake-tensor dry runs)."""
    with torch.device("meta"):
        model = CausalLM(spec, part, dtype)
    model.tie()
    return model


@torch.no_grad()
def init_weights(model: CausalLM, seed: int, assign=None) -> None:
    """Seeded random weights: matrices N(0, 0.02) like Hugging Face's initialiser; norms
    1 + N(0, 0.1) and biases N(0, 0.02) rather than constants, so that a test comparing
    gradients exercises every parameter's path. Each parameter draws from its own generator,
    seeded by (seed, name), so a stage's weights do not depend on which other stages exist
    (pp = 2 starts from the same model as pp = 1). `assign(param, whole)` stores a whole
    tensor into a parameter (default: copy; a sharded parameter takes its piece).

    The draws (float64 on the host, about 2.4 s per 100M parameters on one core) run on a few
    threads, a bounded window of parameters ahead of the one being stored: each parameter has
    its own generator, so the values are the same as drawn one after another. Under a dispatch
    mode (fake tensors) they stay on this thread, where the mode applies."""
    named = list(model.named_parameters())
    draw = functools.partial(_seeded_noise, seed)
    if _get_current_dispatch_mode() is not None or len(named) < 2:
        noises = map(draw, named)
    else:
        noises = _ordered_window(draw, named, workers=min(8, os.cpu_count() or 1))
    for (name, param), noise in zip(named, noises):
        if assign is None:
            param.copy_(noise)
        else:
            assign(param, noise)


def _seeded_noise(seed: int, named: tuple[str, nn.Parameter]) -> torch.Tensor:
    """One parameter's initial values (float64, host): its own generator, seeded by (seed, name)."""
    name, param = named
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return noise.mul_(0.1).add_(1.0)
    return noise.mul_(0.02)


def _ordered_window(fn, items: list, *, workers: int):
    """fn(item) for each item, in order, computed on `workers` threads at most 2 x workers
    items ahead of the consumer (bounded memory: the results not yet taken)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = deque(pool.submit(fn, item) for item in items[:2 * workers])
        for item in items[2 * workers:]:
            yield pending.popleft().result()
            pending.append(pool.submit(fn, item))
        while pending:
            yield pending.popleft().result()
