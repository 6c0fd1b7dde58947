"""Memory per GPU: model states, activations, K/V state.

- Model states (hydraulis.txt B.1, ZeRO): bf16 weights (2 bytes/param), bf16 gradients (2) and an
  fp32 master copy plus Adam's two moments (12). ZeRO-1 shards the 12 over the data-parallel
  group, ZeRO-2 also the gradients, ZeRO-3 everything.
- Activations kept for backward, per token per layer, bf16, flash attention (no s^2 scores) and
  sequence parallelism (so everything divides by tp), the tensors each block saves:
  two RMSNorm inputs and outputs (4h), q, k, v after rotary (q + 2kv), the attention output (q),
  SwiGLU gate, up and their product (3 ffn). A layer under full recomputation keeps only its
  input (h) (infinipipe.txt eq. 5 calls the per-token figure M_token).
- LM head on the last stage: fp32 logits kept for the loss's backward (4 * vocab bytes per token,
  as the executor's cross-entropy upcasts them) plus the final hidden state.
- K/V state of a split sequence (infinipipe.txt eq. 9-10): k and v of every context token on
  every layer of the stage, 2 * kv_dim values per token; its gradient buffer has the same size.
  With tp larger than the K/V heads, heads are replicated, so a rank holds at least one head.
"""

from __future__ import annotations

from lengthwise.specs import ModelSpec

BYTES_BF16 = 2
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m and v


def stage_params(model: ModelSpec, *, layers: int, tp: int, first: bool, last: bool) -> float:
    """Parameters one GPU of a stage holds."""
    params = layers * model.params_per_layer
    table = model.vocab * model.hidden
    if first:
        params += table
    if last:
        params += model.hidden + (0 if (first and model.tied_embeddings) else table)
    return params / tp


def state_bytes_per_param(dp: int, zero: int) -> float:
    weights, grads, optim = BYTES_BF16, BYTES_BF16, OPTIMIZER_BYTES_PER_PARAM
    if zero >= 1:
        optim /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return weights + grads + optim


def activation_bytes_per_token_layer(model: ModelSpec, tp: int = 1) -> float:
    values = 4 * model.hidden + 2 * model.q_dim + 2 * model.kv_dim + 3 * model.ffn
    return values * BYTES_BF16 / tp


def checkpoint_bytes_per_token_layer(model: ModelSpec, tp: int = 1) -> float:
    return model.hidden * BYTES_BF16 / tp


def head_bytes_per_token(model: ModelSpec, tp: int = 1) -> float:
    return (4 * model.vocab + BYTES_BF16 * model.hidden) / tp


def kv_bytes_per_token_layer(model: ModelSpec, tp: int = 1) -> float:
    kv_heads_per_rank = max(1.0, model.num_kv_heads / tp)
    return 2 * kv_heads_per_rank * model.head_dim * BYTES_BF16
