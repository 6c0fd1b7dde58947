"""Memory per GPU: model states, activations, K/V state.

- Model states (hydraulis.txt B.1, ZeRO), as the executor's FSDP2 holds them
  (`runtime/parallel/fsdp.py`, measured by `lengthwise dryrun`): bf16 weights for compute (2
  bytes/param), gradients accumulated over the step's backwards in fp32 (4: FSDP2 upcasts them to
  its fp32 reduce dtype while gradient sync is off, as Megatron accumulates "main grads" in fp32;
  the reduce-scatter sends them in fp32 too) and an fp32 master copy plus Adam's two moments
  (12). ZeRO-1 shards the 12 over the data-parallel group, ZeRO-2 also the gradients, ZeRO-3
  everything. (Under ZeRO-1 the reduced fp32 gradient shard, 4/dp, replaces each unit's whole
  gradient at the step's last backward, so the whole 4 bounds it.)
- Activations kept for backward, per token per layer, bf16, flash attention (no s^2 scores), the
  tensors each block saves: two RMSNorm inputs and outputs (4h), q, k, v after rotary
  (q + 2kv), the attention output (q), SwiGLU gate, up and their product (3 ffn); in fp32, flash
  attention's log-sum-exp (one per query head) and each norm's reciprocal RMS (the executor's
  norm and SwiGLU keep what fused kernels keep, `runtime/model.py`). Under tensor parallelism
  with sequence parallelism (the executor's default, `runtime/parallel/tensor_parallel.py`)
  everything divides by tp except the two norm outputs: the attention and MLP inputs are
  gathered to the whole sequence and DTensor's column-parallel projections keep that gathered
  input for their weight gradients (Megatron-LM re-gathers it in backward instead; we count
  what our executor keeps: 2h whole, as `lengthwise dryrun` measures). A layer under full
  recomputation keeps only its input (h / tp) (infinipipe.txt eq. 5 calls the per-token figure
  M_token).
- LM head on the last stage: the fp32 softmax kept for the loss's backward (4 * vocab bytes per
  token, as the executor's cross-entropy upcasts the logits), the final norm's input and output
  (2h, bf16; the output, the head's input, gathered whole under sequence parallelism) and
  reciprocal RMS, and the label (int64).
- While a chunk's backward runs on the last stage, the loss's backward turns the kept fp32
  softmax into the logits' gradient in place and hands it on in bf16: 2 * vocab bytes per token
  beside what the head keeps (`runtime/loss.py`; autograd's own cross-entropy worked on two more
  fp32 [tokens, vocab] buffers, 8 * vocab, the largest transient of a step on Qwen2.5-7B's 152K
  vocabulary). Measured by `lengthwise dryrun`.
- K/V state of a split sequence (infinipipe.txt eq. 9-10): k and v of every context token on
  every layer of the stage, 2 * kv_dim values per token; its gradient buffer has the same size.
  With tp larger than the K/V heads, heads are replicated, so a rank holds at least one head.
"""

from __future__ import annotations

from lengthwise.specs import ModelSpec

BYTES_BF16 = 2
BYTES_FP32 = 4
GRAD_BYTES_PER_PARAM = BYTES_FP32
"""Gradients are accumulated over a step's backwards and reduced in fp32."""
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m and v
LABEL_BYTES = 8  # int64 token ids


def stage_params(model: ModelSpec, *, layers: int, tp: int, first: bool, last: bool) -> float:
    """Parameters one GPU of a stage holds: the norms' weights whole on every TP rank (as
    Megatron and the executor's tensor parallelism keep them), the rest split over tp."""
    norms = layers * 2 * model.hidden + (model.hidden if last else 0)
    split = layers * model.params_per_layer - layers * 2 * model.hidden
    table = model.vocab * model.hidden
    if first:
        split += table
    if last:
        split += 0 if (first and model.tied_embeddings) else table
    return split / tp + norms


def state_bytes_per_param(dp: int, zero: int) -> float:
    weights, grads, optim = BYTES_BF16, GRAD_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM
    if zero >= 1:
        optim /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return weights + grads + optim


def activation_bytes_per_token_layer(model: ModelSpec, tp: int = 1) -> float:
    sharded = 2 * model.hidden + 2 * model.q_dim + 2 * model.kv_dim + 3 * model.ffn
    gathered = 2 * model.hidden  # the norm outputs the projections keep whole (module docstring)
    return (sharded * BYTES_BF16 + (model.num_heads + 2) * BYTES_FP32) / tp + gathered * BYTES_BF16


def checkpoint_bytes_per_token_layer(model: ModelSpec, tp: int = 1) -> float:
    return model.hidden * BYTES_BF16 / tp


def head_bytes_per_token(model: ModelSpec, tp: int = 1) -> float:
    # the final norm's input is sharded under sequence parallelism, its output (the head's input) whole
    return (BYTES_FP32 * (model.vocab + 1) + BYTES_BF16 * model.hidden + LABEL_BYTES) / tp + BYTES_BF16 * model.hidden


def head_backward_bytes_per_token(model: ModelSpec, tp: int = 1) -> float:
    """Working set of the loss's backward beyond what the head keeps (module docstring)."""
    return BYTES_BF16 * model.vocab / tp


def kv_bytes_per_token_layer(model: ModelSpec, tp: int = 1) -> float:
    kv_heads_per_rank = max(1.0, model.num_kv_heads / tp)
    return 2 * kv_heads_per_rank * model.head_dim * BYTES_BF16
