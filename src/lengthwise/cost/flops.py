"""FLOPs of decoder layers on segments and chunks.

A segment [start, stop) of a sequence runs its own `n = stop - start` tokens through the linear
layers and attends causally to `start` context tokens plus itself:

- linear: 2 FLOPs per multiply-add, so 2 * matmul_params_per_layer * n (skrull.txt A.2; the
  QKV, output and SwiGLU projections).
- attention: query position p (0-based in the sequence) sees p + 1 keys; QK^T and PV each cost
  2 * q_dim FLOPs per (query, key) pair, so 4 * q_dim * keys(start, stop) with
  keys(start, stop) = sum_{p=start}^{stop-1} (p + 1) = (stop(stop+1) - start(start+1)) / 2
  (infinipipe.txt eq. 1: a slice's attention cost is the difference of the triangles).
- LM head (last stage only): 2 * hidden * vocab * n; its backward also recomputes it
  (`HEAD_RECOMPUTE`).

Per TP rank: 1/tp of the linear and attention FLOPs, except that a rank whose tp exceeds the
model's K/V heads computes the K/V projections whole (`cost.memory.kv_replicated`; the
executor replicates them, `runtime/parallel/tensor_parallel.py`): 2 * hidden * 2 * kv_dim * n
forward FLOPs per layer, (1 - 1/tp) of them beyond the 1/tp share (`replicated_kv_flops`),
backward `bwd_linear_ratio` times that. Whole-model FLOPs (`layer_forward_flops`, for balancing
and MFU) count every projection once.

Backward costs `bwd_linear_ratio` (2: two GEMMs per forward GEMM) times the linear part and
`bwd_attn_ratio` (2.5: flash-style attention recomputes the scores, slimpack.txt §2.2.2) times
the attention part.

Recomputation (an `F.rN` action: the first N layers of the stage checkpointed, each with
non-reentrant `torch.utils.checkpoint`, `runtime/model.run_layers`): the backward reruns each
such layer's forward only until every tensor the layer saved is back. PyTorch stops the rerun
(its early stop, on by default) in the autograd hook that saves the last of them, and an
operator saves its inputs before it computes: the down projection's matmul is where it stops,
so the rerun computes the input norm, q, k, v, rotary, attention, o_proj, the residual add,
the post-attention norm, gate, up and their SwiGLU product, but not the down projection's GEMM
(2 * hidden * ffn FLOPs per token, `down_proj_flops`) and nothing after it
(`recompute_forward_flops`; the collectives it skips are in `cost/model_time.py`).

MLP recomputation (an `F.mN` action: N of the stage's layers checkpoint their MLP block, the
post-attention norm through the down projection, `runtime/model.DecoderLayer`): the backward
reruns that block until the down projection's input is back, the same early stop, so the norm
(no GEMM), the gate and up projections (2 * 2 * hidden * ffn FLOPs per token) and their SwiGLU
product (`mlp_recompute_flops`); never the attention.

A padded chunk (padding baseline) holds k segments each padded to pad_to / k tokens: all of its
row costs linear FLOPs and each padded row costs full causal attention over its padded length.

Under context parallelism each CP rank's share of a chunk is `rank_works` (the work the cost
model's time and memory go by, the busiest rank's).
"""

from __future__ import annotations

from dataclasses import dataclass

from lengthwise.cost.memory import kv_replicated
from lengthwise.plan.ir import SHARDED, Chunk
from lengthwise.specs import ModelSpec


def causal_keys(start: int, stop: int) -> int:
    """(query, key) pairs of causal attention for positions [start, stop) with context [0, start)."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


def matmul_params_per_layer(model: ModelSpec) -> int:
    """Weights multiplied per token in one decoder layer (norms and biases excluded)."""
    return model.hidden * (2 * model.q_dim + 2 * model.kv_dim) + 3 * model.hidden * model.ffn


@dataclass(frozen=True)
class ChunkWork:
    """What a chunk (or one GPU's share of it) asks of one decoder layer: row tokens (padding
    included) and attention (query, key) pairs. Fractional for a CP rank's share."""

    tokens: float
    keys: float
    segments: float = 1.0
    """Segments (documents and slices) of the row: a profile's host floor grows with them
    (cost/time.py); FLOPs do not."""


def chunk_work(chunk: Chunk) -> ChunkWork:
    if chunk.pad_to > chunk.num_tokens and chunk.segments:
        padded = chunk.pad_to // len(chunk.segments)
        return ChunkWork(chunk.pad_to, len(chunk.segments) * causal_keys(0, padded), len(chunk.segments))
    return ChunkWork(chunk.num_tokens, chunk.attention_pairs, max(len(chunk.segments), 1))


def work_key(chunk: Chunk) -> tuple:
    """A hashable stand-in for chunk_work(chunk) that is cheap to build (plain ints, no
    ChunkWork): chunks with equal keys cost the same FLOPs, seconds and activation bytes
    (without CP, where placement on ranks does not matter)."""
    if chunk.pad_to > chunk.num_tokens and chunk.segments:
        return ("padded", chunk.pad_to, len(chunk.segments))
    return (chunk.num_tokens, chunk.attention_pairs)


def layer_forward_flops(model: ModelSpec, work: ChunkWork) -> tuple[float, float]:
    """(linear, attention) forward FLOPs of one decoder layer."""
    return 2.0 * matmul_params_per_layer(model) * work.tokens, 4.0 * model.q_dim * work.keys


def down_proj_flops(model: ModelSpec, tokens):
    """Forward FLOPs of one decoder layer's down projection on `tokens` rows (number or array)."""
    return 2.0 * model.hidden * model.ffn * tokens


def recompute_forward_flops(model: ModelSpec, work: ChunkWork) -> tuple[float, float]:
    """(linear, attention) FLOPs a backward reruns for one checkpointed decoder layer: its
    forward but the down projection, where non-reentrant checkpoint's early stop ends the rerun
    (module docstring). Whole-model FLOPs, as `layer_forward_flops`."""
    lin, attn = layer_forward_flops(model, work)
    return lin - down_proj_flops(model, work.tokens), attn


def mlp_recompute_flops(model: ModelSpec, tokens):
    """FLOPs a backward reruns for one decoder layer whose MLP block is checkpointed, on `tokens`
    rows (a number or an array): its gate and up projections, the down projection being where
    the rerun stops (module docstring). Whole-model FLOPs, as `layer_forward_flops`."""
    return 2.0 * 2 * model.hidden * model.ffn * tokens


def replicated_kv_flops(model: ModelSpec, tokens, tp: int):
    """Forward FLOPs of one decoder layer one TP rank computes beyond 1/tp of its linear FLOPs
    on `tokens` rows (a number or an array): the (1 - 1/tp) of the K/V projections,
    2 * hidden * 2 * kv_dim * tokens, that the other ranks would have computed were they split
    (module docstring); 0.0 when tp does not exceed the K/V heads."""
    if not kv_replicated(model, tp):
        return 0.0
    return 2.0 * model.hidden * 2 * model.kv_dim * tokens * (1 - 1 / tp)


HEAD_RECOMPUTE = 1.0
"""The LM head's backward recomputes its logits (`runtime/loss.head_loss_sum` keeps none from
forward): one more forward's FLOPs beside the bwd_linear_ratio of its two gradient GEMMs."""


def head_forward_flops(model: ModelSpec, tokens: int) -> float:
    return 2.0 * model.hidden * model.vocab * tokens


def sequence_model_flops(model: ModelSpec, length: int, bwd_linear_ratio=2.0, bwd_attn_ratio=2.5) -> float:
    """Forward plus backward FLOPs of training one whole sequence (for MFU and balancing)."""
    lin, attn = layer_forward_flops(model, ChunkWork(length, causal_keys(0, length)))
    head = head_forward_flops(model, length)
    per_layer = lin * (1 + bwd_linear_ratio) + attn * (1 + bwd_attn_ratio)
    return model.num_layers * per_layer + head * (1 + bwd_linear_ratio + HEAD_RECOMPUTE)


def rank_works(chunk: Chunk, cp: int) -> list[ChunkWork]:
    """Each CP rank's share of a chunk: 1/cp of its SHARDED segments (head-tail balanced, so
    attention pairs split evenly too) plus the segments placed whole on that rank (Skrull's
    local sequences). Time and memory go by the busiest rank."""
    if cp <= 1:
        return [chunk_work(chunk)]
    if chunk.pad_to > chunk.num_tokens or all(s.cp_rank == SHARDED for s in chunk.segments):
        w = chunk_work(chunk)
        return [ChunkWork(w.tokens / cp, w.keys / cp, w.segments)]
    sharded = tuple(s for s in chunk.segments if s.cp_rank == SHARDED)
    shared = chunk_work(Chunk(sharded))
    works = []
    for r in range(cp):
        mine = tuple(s for s in chunk.segments if s.cp_rank == r)
        local = chunk_work(Chunk(mine))
        works.append(ChunkWork(local.tokens + shared.tokens / cp, local.keys + shared.keys / cp,
                               max(len(mine) + len(sharded), 1)))
    return works
