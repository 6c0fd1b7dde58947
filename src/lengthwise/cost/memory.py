"""Memory per GPU: model states, activations, K/V state.

- Model states (hydraulis.txt B.1, ZeRO), as the executor's FSDP2 holds them
  (`runtime/parallel/fsdp.py`, measured by `lengthwise dryrun`): bf16 weights for compute (2
  bytes/param), gradients accumulated over the step's backwards in fp32 (4: FSDP2 upcasts them to
  its fp32 reduce dtype while gradient sync is off, as Megatron accumulates "main grads" in fp32;
  the reduce-scatter sends them in fp32 too) and an fp32 master copy plus Adam's two moments
  (12). ZeRO-1 shards the 12 over the data-parallel group, ZeRO-3 also the bf16 weights (the
  executor reshards them after each forward and backward when every replica runs the same
  actions, `parallel/fsdp.py`; the unit it gathers for the running layer is left out). The
  gradients are not sharded at any stage while the step accumulates them: the executor keeps
  FSDP2's gradient sync off until each stage's last backward
  (`set_requires_gradient_sync(False)`, one reduce-scatter a step instead of one per backward
  unit), so FSDP2 accumulates every unit's gradient unsharded, in fp32, over the step's
  backwards whatever the ZeRO stage, and the reduced shard (4/dp) replaces it only at the last
  backward. A dry run measures the same peak for one plan at ZeRO-1 and ZeRO-2
  (`tests/test_dryrun.py`): ZeRO-2 saves nothing in this executor, and the cost model charges
  the whole 4 at every stage.
- Gradients come into being in a step, not before it: the optimizer frees them at the step's
  end (`zero_grad(set_to_none=True)`) and each FSDP unit's fp32 accumulator is made by its first
  backward of the next step. A stage holds none of them through its warm-up forwards; the
  simulator allocates them at the end of the stage's first backward (`sim/memory.py`), which is
  exact before and after it and an upper bound inside it (the accumulators grow layer by layer
  as the chunk's activations are freed layer by layer, so the level is highest at one end).
- The first stage's embedding gradient is the whole table on every TP rank: DTensor hands the
  vocabulary-parallel embedding's gradient back Replicate, and it is accumulated so until the
  reduction (FSDP2's, or `parallel/dp.match_grad_layouts`) slices the rank's rows
  (`grad_params`: vocab x hidden, not vocab x hidden / tp, measured by `lengthwise dryrun`).
  At the end of each backward on the first stage the embedding's backward makes that gradient
  in bf16 before it is added into the accumulator (FSDP2 adds it into its fp32 one, or makes
  the fp32 one from it in the stage's first backward): vocab x hidden x 2 bytes beside all the
  gradients and the other chunks' activations, once the chunk's own are freed
  (`embedding_backward_bytes`; 1 GiB for Qwen2.5-7B, and the peak of a first stage whose
  chunks are short).
- Activations kept for backward, per token per layer, bf16, flash attention (no s^2 scores), the
  tensors each block saves: two RMSNorm inputs and outputs (4h), q, k, v after rotary
  (q + 2kv), the attention output (q), the SwiGLU's gate and up (2 ffn: the executor's SwiGLU
  and down projection are one node that makes their product again in backward rather than
  keep it, `runtime/layer_ops.SwiGLUDown`); in fp32, flash attention's log-sum-exp (one per
  query head) and each norm's reciprocal RMS (the executor's norm and SwiGLU keep what fused
  kernels keep, `runtime/model.py`). A layer whose tensors are made again in backward (full or
  MLP recomputation) runs the product and the down projection as two nodes, the second keeping
  the product (ffn more), so that the rerun stops before the down projection's GEMM
  (`cost/flops.py`): its backward re-materialises that too (`product_bytes_per_token`,
  `CostModel.recompute_transient_bytes`). Under tensor parallelism
  with sequence parallelism (the executor's default, `runtime/parallel/tensor_parallel.py`)
  everything divides by tp except the two norm outputs: the attention and MLP inputs are
  gathered to the whole sequence and DTensor's column-parallel projections keep that gathered
  input for their weight gradients (Megatron-LM re-gathers it in backward instead; we count
  what our executor keeps: 2h whole, as `lengthwise dryrun` measures). A layer under full
  recomputation keeps only its input (h / tp) (infinipipe.txt eq. 5 calls the per-token figure
  M_token). A layer under MLP recomputation (`F.mN`, `runtime/model.DecoderLayer`: one
  non-reentrant checkpoint over its post-attention norm and MLP) keeps what its attention block
  keeps and, of the MLP block, only the block's input, the residual stream after the
  attention, which is also the norm's input and so was kept anyway: it drops the SwiGLU's
  gate and up (2 ffn / tp), the norm's output as the gate and up projections keep it
  (h, gathered whole) and the norm's reciprocal RMS (one fp32, / tp with sequence parallelism)
  (`mlp_recompute_saved_bytes_per_token_layer`; Qwen2.5-1.5B: 38.9 of 55.4 KB per token and
  layer at tp 1), and re-materialises them with the product in backward
  (`mlp_remat_bytes_per_token_layer`). Checkpointing at the norm's input rather than its output (the MLP alone) drops
  the norm's output too, for a rerun of one norm (and under sequence parallelism one all-gather). A row tp does not divide is padded to the next multiple, and the output projection
  keeps a padded copy of the attention output beside flash attention's unpadded one
  (`CostModel.attention_pad_bytes`, per chunk: not a per-token figure).
  Without sequence parallelism (`CostModel.sequence_parallel` False, `sp=False` here; the
  executor's `--no-sequence-parallel`) the residual stream is whole on every TP rank, and so
  are both norms' inputs and outputs (4h) and reciprocal RMS (2 fp32); q, k, v, the attention
  output, the SwiGLU tensors and the log-sum-exp (one per local query head) divide by tp. A
  recomputed layer keeps its whole input (h), rows are not padded (no padded copy), and the
  stages send whole activations (`CostModel.boundary_bytes`). Qwen2.5-7B at tp 4: 51.7 KB per
  token and layer against 41.0 KB with sequence parallelism.
- LM head on the last stage (`runtime/loss.head_loss_sum`: the head and its loss in one, the
  logits made a block at a time and recomputed in backward, never [tokens, vocab] at once):
  the final norm's input (h, bf16) and reciprocal RMS, this rank's rows under sequence
  parallelism, whole without; the head's input (h, bf16, gathered whole), the label (int64) and
  the row's log-sum-exp (fp32), whole (`head_bytes_per_token`: 6.2 KB a token for Qwen2.5-1.5B
  against 614 KB while the loss kept an fp32 softmax).
- While a chunk's backward runs on the last stage, the loss's backward holds, beside what the
  head keeps, the weight's bf16 gradient (this rank's vocabulary rows, vocab x hidden / tp x 2
  bytes, made whole before the first block), the input gradient's fp32 accumulator (4h a
  token), a few per-row vectors, and one block of columns: every row's recomputed fp32 logits
  beside their bf16 copy or gradient (at most HEAD_BLOCK_BYTES of fp32), or that gradient
  beside its bf16 product with the weight block (`head_backward_bytes`, not linear in the
  tokens: the block is bounded). Then the final norm's backward, beside the weight's gradient
  (the norm and the head are one FSDP unit). Qwen2.5-1.5B at 32K tokens: 1.65 GiB for the
  head in all, measured by `benchmarks/bench_head_memory.py` (28.0 GiB with whole logits).
- While a decoder layer's backward runs, beside the chunk's kept activations: the SwiGLU and
  down projection's backward (`runtime/layer_ops.SwiGLUDown`) reads its output's gradient,
  under sequence parallelism gathered whole (the all-gather that is the backward of its
  reduce-scatter: h a token, every row) and held until the node's backward returns, and
  beside it makes silu(gate) and the product again (two [tokens, ffn / tp] bf16 buffers),
  then the down weight's gradient from the product alone, frees it, makes the product's
  gradient and from it the up projection's gradient (with silu(gate) made once more),
  grad * up (the product's gradient then freed) and the gate's gradient (one silu_backward
  kernel): at most three [tokens, ffn / tp] buffers, 3 * ffn / tp values per token beyond
  the kept activations and the gathered gradient (`swiglu_down_backward_bytes_per_token`),
  the largest working set of a layer's backward (attention's gradients are q + 2kv wide)
  unless a norm's is larger: an RMSNorm's backward (`runtime/model._RMSNorm`) holds the fp32
  copy of its input, the bf16 normalised input and four fp32 [tokens, hidden] gradient buffers
  at once, 22 bytes per hidden value (`norm_backward_bytes_per_token`); the post-attention
  norm's runs once the MLP's backward has freed the 2 * ffn / tp SwiGLU values the layer kept.
  With sequence parallelism the norm's divides by tp and the SwiGLU's outgrows it for every
  preset; without, the norm's runs on whole rows and is the larger once ffn / tp < 2.2 hidden:
  Qwen2.5-7B at tp 4 holds 59.9 KB per token there against the SwiGLU's 28.4 KB
  (`layer_backward_bytes_per_token`; tests/test_dryrun.py measures the moments). A layer
  whose tensors are made again in backward runs the product's own nodes (module docstring):
  the down projection's backward (the gathered gradient beside the product's gradient,
  `down_backward_bytes_per_token`), then, once it has freed the product, the SwiGLU's (the
  product's gradient, silu(gate), the gate's and up's gradients: 3 * ffn / tp beyond what the
  layer re-materialised), then the post-attention norm's (3 * ffn / tp SwiGLU values freed
  before it), and the rerun's end below (`layer_backward_bytes_per_token(rerun=True)`). Beside every
  one the residual stream's gradient at the layer's output (2h, /tp with sequence
  parallelism: received from the next stage, which the executor holds for the whole
  backward, or made by the final norm's backward on the last stage;
  `layers_backward_bytes_per_token`). On the last stage the loss's backward comes first and
  the layers' after the head's kept tensors are freed (`backward_work_bytes`).
- In the stage's last backward, which reduces the gradients, FSDP2's post-backward of each
  unit copies the unit's gradient into a new fp32 reduce-scatter input (the unit's whole
  gradient on this rank), frees the gradient it copied (the bf16 one autograd made, or the
  fp32 accumulator of earlier backwards), keeps the reduced fp32 shard (/ the dp x cp group)
  as the gradient and reshards the unit's bf16 weights; it keeps the input until the next
  unit's post-backward. On the last stage the head's unit (the final norm and the LM head)
  is reduced first, and its input and shard are held through the first decoder layer's
  backward, the moment that meets every activation the chunk keeps but the head's
  (`head_reduce_scatter_bytes`, beyond the model states as they are counted: the weights'
  bf16 copy whole below ZeRO-3, the gradients from the end of the stage's first backward;
  `sim/memory_sizes.head_reduce_scatter_work`). Qwen2.5-7B at tp 2 x dp 4: 1.27 GiB held
  there less the 0.51 GiB bf16 weight, 3.7% of a one-chunk last stage's peak that the
  simulator once left out (`tests/test_dryrun.py` measures the moment). Elsewhere the
  previous unit's input is held beside a layer whose activations the previous one has
  freed, and the planners' budgets, which hold the whole fp32 gradients all step, bound it.
- A layer whose MLP block is made again in backward (full recomputation, or the block's own
  checkpoint) peaks at the rerun's end instead, once the down projection's input is back: the
  layer's whole activations (the re-materialised ones, `CostModel.recompute_transient_bytes`,
  beside those kept) with, still held, silu(gate) (ffn / tp, the product's operand) and,
  under sequence parallelism, the down projection's output gradient, gathered whole before
  the rerun began (h, every row), and the post-attention norm's output on this rank's rows,
  held by the rerun's MLP call while its gathered copy is used (h / tp)
  (`rerun_bytes_per_token`). It meets every other tensor the chunk keeps only when every
  layer of the stage reruns (all recomputed, or every MLP block): otherwise the layers that
  keep their activations run their backward first and free more than the rerun's end adds,
  and the chunk's kept activations, one re-materialised layer and the plain working set
  (which is larger than a re-materialised layer's) bound it. LLaMA-70B at tp 8: 25.0 KB a
  token beyond the layer against the split SwiGLU's 21.0 KB; with the stage's terms below,
  5.6% of a fully recomputed 128K-token rank's peak that the simulator once left out
  (tests/test_dryrun.py measures the moment exactly).
  At tp 1 and without sequence parallelism the gradient is the residual stream's own and the
  norm's output the one the projections keep: silu(gate) alone, below the SwiGLU's.
- Beside its layers' tensors a chunk keeps, from its forward to its backward, its rotary
  tables (cos and sin, head_dim bf16 each, whole rows: every TP rank attends over the whole
  row; `rope_bytes_per_token`) and, on every stage but the last, the stage's output, which the
  executor holds to start the backward from (2h, /tp with sequence parallelism; on the last
  stage it is the final norm's input, counted with the head) (`stage_kept_bytes_per_token`).
  Left out: the first stage's token ids, which the embedding keeps (int64, 8 bytes a token).
- The LM head's forward holds one block of rows' fp32 logits beside their fp32 log-softmax (at
  most HEAD_BLOCK_BYTES each: 432 rows of a 152K vocabulary, `head_block`; before that moment
  the block's bf16 logits beside their fp32 copy, less) and per row the log-sum-exp, label
  logit and label column (`head_forward_bytes`).
- Under context parallelism a layer also keeps, for its backward, the K/V its all-gather
  assembled of the chunk's sharded segments: whole (every CP rank's rows), 2 * kv_dim / tp
  values per sharded token (`CostModel.cp_kv_layer_bytes`; 5.6 GiB of a LLaMA-32B cp2 rank's
  48.7 GiB peak, measured by `lengthwise dryrun`).
- K/V state of a split sequence (infinipipe.txt eq. 9-10): k and v of every context token on
  every layer of the stage, 2 * kv_dim values per token; its gradient buffer has the same size.
  With tp larger than the K/V heads, heads are replicated, so a rank holds at least one head.
- K/V projections replicated over TP (`kv_replicated`: tp > the model's K/V heads, e.g.
  Qwen2.5-1.5B's 2 at tp 4 or LLaMA-70B's 8 at tp 16; tp must also divide the query heads, so
  Qwen2.5-7B's 4 never are at tp <= 8): the executor (`runtime/parallel/tensor_parallel.py`) gives every TP
  rank the whole k_proj and v_proj weights (and biases), so `stage_params` counts them whole on
  each rank, not / tp (`replicated_kv_params`), and with them the bf16 weights, the fp32
  gradients and the dp x cp-sharded fp32 master and Adam states, and FSDP2's all-gather and
  reduce-scatter of them (`sim/rank.py`; measured by `lengthwise dryrun`, tests/test_dryrun.py).
"""

from __future__ import annotations

import numpy as np

from lengthwise.specs import ModelSpec

BYTES_BF16 = 2
BYTES_FP32 = 4
GRAD_BYTES_PER_PARAM = BYTES_FP32
"""Gradients are accumulated over a step's backwards and reduced in fp32."""
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m and v
LABEL_BYTES = 8  # int64 token ids
HEAD_BLOCK_BYTES = 256 * 2**20
"""The LM head's loss holds its logits one block at a time, each block's wide (float32) logits
at most this many bytes (`runtime/loss.head_loss_sum`): rows of the vocabulary in forward,
columns of every token in backward."""
HEAD_BLOCK_ALIGN = ((1024, 128), (16, 16))
"""A head block's rows or columns are rounded down to a multiple of 128 from 1,024 on, of 16
from 16 on (`head_block`): a block of columns is the leading dimension of backward's logits and
their gradient, and a width that is no multiple of 8 sends cuBLAS to its unaligned kernels. On
an H200 the 2,814-column blocks of a 23,845-token Qwen2.5-0.5B step ran the head's three
backward matmuls on sm80 `align2` kernels at about 250 TFLOP/s, 27% of the step
(benchmarks/results/gpu-2026-11-28-nvidia-h200/breakdown/)."""


def kv_replicated(model: ModelSpec, tp: int) -> bool:
    """Whether tensor parallelism over `tp` ranks replicates the model's K/V projections: tp
    larger than its K/V heads, each rank then computing all of them and keeping the one its
    query heads read (the executor's rule, `runtime/parallel/tensor_parallel.kv_replicated`;
    this one keeps the planning core free of torch)."""
    return tp > model.num_kv_heads


def kv_params_per_layer(model: ModelSpec) -> int:
    """Weights (and biases, with `qkv_bias`) of one decoder layer's k_proj and v_proj."""
    return 2 * model.kv_dim * (model.hidden + (1 if model.qkv_bias else 0))


def replicated_kv_params(model: ModelSpec, *, layers: int, tp: int) -> float:
    """Parameters one TP rank holds beyond its 1/tp of the stage's split weights because the K/V
    projections are replicated (`kv_replicated`): the (1 - 1/tp) of them the split would have
    left to the other ranks; 0 when tp does not exceed the K/V heads."""
    if not kv_replicated(model, tp):
        return 0.0
    return layers * kv_params_per_layer(model) * (1 - 1 / tp)


def stage_params(model: ModelSpec, *, layers: int, tp: int, first: bool, last: bool) -> float:
    """Parameters one GPU of a stage holds: the norms' weights whole on every TP rank (as
    Megatron and the executor's tensor parallelism keep them), the K/V projections whole too
    when tp exceeds the K/V heads (`replicated_kv_params`), the rest split over tp."""
    norms = layers * 2 * model.hidden + (model.hidden if last else 0)
    split = layers * model.params_per_layer - layers * 2 * model.hidden
    table = model.vocab * model.hidden
    if first:
        split += table
    if last:
        split += 0 if (first and model.tied_embeddings) else table
    params = split / tp + norms
    if kv_replicated(model, tp):
        params += replicated_kv_params(model, layers=layers, tp=tp)
    return params


def grad_params(model: ModelSpec, *, layers: int, tp: int, first: bool, last: bool) -> float:
    """Gradient elements one GPU of a stage accumulates in a step: `stage_params`, except that
    the embedding's gradient is the whole table on every TP rank (module docstring)."""
    params = stage_params(model, layers=layers, tp=tp, first=first, last=last)
    if first and tp > 1:
        params += model.vocab * model.hidden * (1 - 1 / tp)
    return params


def state_bytes_per_param(dp: int, zero: int, *, grads: bool = True) -> float:
    """Bytes per stage parameter of its weights, optimizer states and (`grads`) gradients, as
    the executor holds them while it accumulates the step's gradients (module docstring: the
    gradients whole at every ZeRO stage)."""
    weights, grads, optim = BYTES_BF16, GRAD_BYTES_PER_PARAM if grads else 0.0, OPTIMIZER_BYTES_PER_PARAM
    if zero >= 1:
        optim /= dp
    if zero >= 3:
        weights /= dp
    return weights + grads + optim


def activation_bytes_per_token_layer(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """Bytes one decoder layer keeps per token for its backward (module docstring); `sp`:
    sequence parallelism, without which the norms' inputs, outputs and reciprocal RMS are whole."""
    heads = 2 * model.q_dim + 2 * model.kv_dim + 2 * model.ffn  # q, k, v, attention output, gate and up
    norms = 2 * model.hidden  # the two norms' inputs (their outputs, kept by the projections, whole)
    if sp:
        return ((heads + norms) * BYTES_BF16 + (model.num_heads + 2) * BYTES_FP32) / tp + norms * BYTES_BF16
    return (heads * BYTES_BF16 + model.num_heads * BYTES_FP32) / tp + 2 * norms * BYTES_BF16 + 2 * BYTES_FP32


def residual_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """One residual-stream tensor (bf16): this rank's rows under sequence parallelism."""
    return model.hidden * BYTES_BF16 / (tp if sp else 1)


def checkpoint_bytes_per_token_layer(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """A recomputed layer's input: one residual-stream tensor."""
    return residual_bytes_per_token(model, tp, sp=sp)


def rope_bytes_per_token(model: ModelSpec) -> float:
    """The chunk's rotary tables, cos and sin (bf16), whole rows on every TP rank."""
    return 2 * model.head_dim * BYTES_BF16


def stage_kept_bytes_per_token(model: ModelSpec, tp: int = 1, *, layers: int, head: bool, sp: bool = True) -> float:
    """What a chunk keeps on a stage beside its layers' and the head's tensors (module
    docstring): the rotary tables, and the stage's output but on the last stage."""
    return (rope_bytes_per_token(model) if layers > 0 else 0.0) + (0.0 if head else residual_bytes_per_token(
        model, tp, sp=sp))


def mlp_recompute_saved_bytes_per_token_layer(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """Bytes per token a decoder layer does not keep when its MLP block is recomputed (module
    docstring): the SwiGLU's gate and up (2 ffn / tp bf16 values), the post-attention norm's
    output (h bf16, whole) and its reciprocal RMS (fp32; this rank's rows under sequence
    parallelism)."""
    return 2 * model.ffn * BYTES_BF16 / tp + model.hidden * BYTES_BF16 + BYTES_FP32 / (tp if sp else 1)


def product_bytes_per_token(model: ModelSpec, tp: int = 1) -> float:
    """The SwiGLU's product (ffn / tp bf16), which a layer whose tensors are made again in
    backward keeps among them (its down projection's input) and a layer that keeps its
    activations does not (module docstring)."""
    return model.ffn * BYTES_BF16 / tp


def mlp_remat_bytes_per_token_layer(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """What the backward of a layer whose MLP block is recomputed re-materialises at once: what
    the layer did not keep (`mlp_recompute_saved_bytes_per_token_layer`) and the product, the
    down projection's input, the last of them: the rerun stops once it is back (`cost/flops.py`)."""
    return mlp_recompute_saved_bytes_per_token_layer(model, tp, sp=sp) + product_bytes_per_token(model, tp)


def head_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """What the LM head and its loss keep per token on the last stage (module docstring): the
    final norm's input (bf16) and reciprocal RMS (fp32), this rank's rows under sequence
    parallelism; the head's input, whole (gathered); the label (int64) and the row's
    log-sum-exp (fp32), whole. No logits: the blocked loss recomputes them in backward."""
    whole = BYTES_BF16 * model.hidden + LABEL_BYTES + BYTES_FP32
    norm = BYTES_BF16 * model.hidden + BYTES_FP32
    return norm / (tp if sp else 1) + whole


HEAD_FORWARD_ROW_BYTES = 33
"""Per token of the chunk (whole rows), the blocked loss's forward vectors beside its block: the
rows' log-sum-exps (fp32), exponential sums and label logits (2 fp32), the label's column (int64)
and whether this rank holds it (bool); and, during a block's log-softmax, its rows' column read
(int64) and logit (fp32) (`runtime/loss._row_statistics`), counted for every token: exact when
one block holds the chunk, a few bytes a token on the safe side otherwise."""

HEAD_BACKWARD_ROW_BYTES = 21
"""Per token, the blocked loss's backward vectors: the rows' scale (fp32), row indices and label
columns (2 int64) and whether this rank holds the label (bool)."""


def head_columns(model: ModelSpec, tp: int = 1) -> float:
    """Vocabulary columns one TP rank's head computes."""
    return model.vocab / tp


def head_block(count):
    """The rows (forward) or columns (backward) of a head block that fit its bound, `count`
    (a number or a numpy array), rounded down as HEAD_BLOCK_ALIGN says; never below 1."""
    count = np.maximum(1, np.floor(count))
    out = count
    for least, multiple in reversed(HEAD_BLOCK_ALIGN):
        out = np.where(count >= least, count - count % multiple, out)
    return int(out) if out.ndim == 0 else out


def head_forward_bytes(model: ModelSpec, tokens, tp: int = 1):
    """Working set of the LM head's forward beside its kept tensors, for a chunk of `tokens`
    rows (a number or a numpy array, elementwise): one block of rows' fp32 logits beside their
    fp32 log-softmax (`runtime/loss._row_statistics`: at most HEAD_BLOCK_BYTES of fp32 logits, a
    block of whole rows of this rank's columns; the moment before, bf16 logits beside their fp32
    copy, is smaller) and the per-row vectors."""
    columns = head_columns(model, tp)
    rows = np.minimum(tokens, head_block(HEAD_BLOCK_BYTES // int(BYTES_FP32 * columns)))
    return rows * columns * (BYTES_FP32 + BYTES_FP32) + np.multiply(tokens, HEAD_FORWARD_ROW_BYTES)


def head_backward_bytes(model: ModelSpec, tokens, tp: int = 1):
    """Working set of the loss's backward beside what the head keeps, for a chunk of `tokens`
    rows (a number or an array): the weight's gradient (this rank's vocabulary rows, bf16,
    whole from the first block), the input's gradient accumulated in fp32 ([tokens, hidden]),
    the per-row vectors, and the larger of two moments of a block of columns (every row, at
    most HEAD_BLOCK_BYTES of fp32 logits): its recomputed fp32 logits beside their bf16
    product or bf16 gradient, or that gradient beside its bf16 product with the weight block
    ([tokens, hidden])."""
    columns = head_columns(model, tp)
    tokens = np.asarray(tokens, dtype=np.float64)
    fit = head_block(HEAD_BLOCK_BYTES / (BYTES_FP32 * np.maximum(tokens, 1)))  # columns of every row in a block
    block_columns = np.minimum(columns, fit)
    block = np.maximum(block_columns * (BYTES_FP32 + BYTES_BF16), (block_columns + model.hidden) * BYTES_BF16)
    per_row = BYTES_FP32 * model.hidden + HEAD_BACKWARD_ROW_BYTES + block
    work = columns * model.hidden * BYTES_BF16 + tokens * per_row
    return np.where(tokens > 0, work, 0.0) if work.ndim else (float(work) if tokens > 0 else 0.0)


def embedding_backward_bytes(model: ModelSpec) -> float:
    """The embedding's gradient as its backward makes it, at the end of each backward on the
    first stage: the whole table in bf16 on every TP rank, before it is added into the
    accumulated gradient (module docstring)."""
    return model.vocab * model.hidden * BYTES_BF16


def head_reduce_scatter_bytes(model: ModelSpec, tp: int = 1, *, shards: int, zero: int, first: bool = False,
                              grads_made: bool = True) -> float:
    """What FSDP2 holds of the head's unit (the final norm and the LM head) during the last
    stage's first decoder layer backward in the stage's last backward, which reduces the
    gradients (module docstring), beyond what the model states count: the unit's fp32
    reduce-scatter input (its whole gradient on this rank) and the reduced fp32 shard (/ the
    `shards` ranks of the dp x cp group), less the gradient it copied (the fp32 accumulator
    counted with the gradients, `grads_made`: an earlier backward made it) and the bf16 weights
    it reshards (counted whole below ZeRO-3). `first`: the stage is also the first, whose tied
    LM head weight is the embedding's (the unit then holds the norm alone)."""
    params = model.hidden if (first and model.tied_embeddings) else \
        stage_params(model, layers=0, tp=tp, first=False, last=True)
    held = GRAD_BYTES_PER_PARAM * params * (1 + 1 / shards)
    if grads_made:
        held -= GRAD_BYTES_PER_PARAM * params
    if zero < 3:
        held -= BYTES_BF16 * params
    return held


def norm_backward_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """Working set of an RMSNorm's backward (`runtime/model._RMSNorm`) per token of the chunk:
    the fp32 copy of its input, the bf16 normalised input and four fp32 [tokens, hidden]
    gradient buffers at once (22 bytes per hidden value), and three fp32 values per row; on
    this rank's rows under sequence parallelism, whole without."""
    return (22 * model.hidden + 3 * BYTES_FP32) / (tp if sp else 1)


def gathered_output_grad_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """The down projection's output gradient beyond the residual stream's own: gathered whole
    (every row) under sequence parallelism at tp > 1, the stream's gradient itself otherwise."""
    return model.hidden * BYTES_BF16 if sp and tp > 1 else 0.0


def down_backward_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """The down projection's backward beyond the kept activations (module docstring): its
    gathered output gradient beside the product's gradient it makes (ffn / tp bf16)."""
    return gathered_output_grad_bytes_per_token(model, tp, sp=sp) + model.ffn * BYTES_BF16 / tp


def swiglu_down_backward_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """The SwiGLU and down projection's backward beyond the kept activations
    (`runtime/layer_ops.SwiGLUDown`, module docstring): its gathered output gradient beside at
    most three [tokens, ffn / tp] bf16 buffers."""
    return gathered_output_grad_bytes_per_token(model, tp, sp=sp) + 3 * model.ffn * BYTES_BF16 / tp


def rerun_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True) -> float:
    """Beyond a layer's whole activations, the end of its MLP block's rerun in backward (module
    docstring): silu(gate) (ffn / tp bf16) and, under sequence parallelism, the gathered
    output gradient and the post-attention norm's output rows."""
    gathered = gathered_output_grad_bytes_per_token(model, tp, sp=sp)
    rows = residual_bytes_per_token(model, tp, sp=sp) if gathered else 0.0
    return model.ffn * BYTES_BF16 / tp + gathered + rows


def layer_backward_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True, rerun: bool = False) -> float:
    """Working set of one decoder layer's backward beyond the kept activations (module
    docstring): the SwiGLU and down projection's (`swiglu_down_backward_bytes_per_token`) or
    the post-attention norm's, whose moment comes once the MLP's backward has freed the gate
    and up the layer kept (2 ffn / tp values). With `rerun` (its MLP block made again in
    backward, by the product's own nodes), beside the re-materialised tensors: the SwiGLU
    backward's, the down projection's, the norm's (the SwiGLU's 3 ffn / tp freed before it)
    or the rerun's end (`rerun_bytes_per_token`)."""
    norm = norm_backward_bytes_per_token(model, tp, sp=sp)
    if not rerun:
        return max(swiglu_down_backward_bytes_per_token(model, tp, sp=sp), norm - 2 * model.ffn * BYTES_BF16 / tp)
    swiglu = 3 * model.ffn * BYTES_BF16 / tp
    return max(swiglu, down_backward_bytes_per_token(model, tp, sp=sp), norm - swiglu,
               rerun_bytes_per_token(model, tp, sp=sp))


def layers_backward_bytes_per_token(model: ModelSpec, tp: int = 1, *, sp: bool = True, rerun: bool = False) -> float:
    """`layer_backward_bytes_per_token` beside the residual stream's gradient (module docstring)."""
    return layer_backward_bytes_per_token(model, tp, sp=sp, rerun=rerun) + residual_bytes_per_token(model, tp, sp=sp)


def backward_work_bytes_per_token(model: ModelSpec, tp: int = 1, *, layers: int, head: bool,
                                  sp: bool = True, rerun: bool = False) -> float:
    """Largest working set of a stage's backward beyond its kept activations, per token: one
    layer's beside the residual stream's gradient (`layers_backward_bytes_per_token`, none
    without layers; `rerun`: the layers' MLP blocks are made again in backward), and on the
    last stage the final norm's. The loss's own (`head_backward_bytes`) is not linear in the
    tokens (its blocks are bounded) and is added per chunk (`backward_work_bytes`); per token
    it is its slope at long chunks (one column a block): the input gradient's fp32 accumulator
    beside a block's bf16 product."""
    layer = layers_backward_bytes_per_token(model, tp, sp=sp, rerun=rerun) if layers > 0 else 0.0
    if not head:
        return layer
    loss = (BYTES_FP32 + BYTES_BF16) * model.hidden + HEAD_BACKWARD_ROW_BYTES + BYTES_BF16
    return max(loss, layer - head_bytes_per_token(model, tp, sp=sp), norm_backward_bytes_per_token(model, tp, sp=sp))


def head_backward_fixed_bytes(model: ModelSpec, tp: int = 1) -> float:
    """What the loss's backward holds whatever the tokens, beyond `backward_work_bytes_per_token`
    times them (an upper bound): the weight's bf16 gradient and one block's fp32 logits with
    their bf16 copy (`head_backward_bytes`)."""
    return head_columns(model, tp) * model.hidden * BYTES_BF16 + HEAD_BLOCK_BYTES * (BYTES_FP32 + BYTES_BF16) / BYTES_FP32


def backward_work_bytes(model: ModelSpec, tokens, tp: int = 1, *, layers: int, head: bool, sp: bool = True,
                        remat=0.0, rerun=False):
    """Largest working set of a stage's backward beyond its kept activations for a chunk of
    `tokens` rows (a number or an array): one layer's per token beside the residual stream's
    gradient (`layers_backward_bytes_per_token`), beside `remat` bytes a recomputed layer (or
    MLP block) re-materialises for it (where `rerun`, a bool or bool array: every layer of the
    stage makes its MLP block again, with the rerun's end among the layer's moments; module
    docstring), and on the last stage, where it runs first, the blocked loss's
    (`head_backward_bytes`), then the final norm's beside the head weight's bf16 gradient (the
    norm and the head are one FSDP unit, which takes that gradient into its fp32 accumulator
    after both backwards); the layers' (and their re-materialisation) run once the head's kept
    tensors are freed."""
    layer = _layers_backward_bytes(model, tokens, tp, layers=layers, sp=sp, remat=remat, rerun=rerun)
    if not head:
        return layer
    weight_grad = head_columns(model, tp) * model.hidden * BYTES_BF16
    final_norm = np.multiply(norm_backward_bytes_per_token(model, tp, sp=sp), tokens) + weight_grad
    kept = np.multiply(head_bytes_per_token(model, tp, sp=sp), tokens)
    return np.maximum(np.maximum(head_backward_bytes(model, tokens, tp), final_norm), layer - kept)


def _layers_backward_bytes(model: ModelSpec, tokens, tp: int, *, layers: int, sp: bool, remat, rerun):
    """The layers' part of `backward_work_bytes` (elementwise over `tokens`, `remat`, `rerun`)."""
    if layers <= 0:
        return np.multiply(0.0, tokens) + remat
    plain = layers_backward_bytes_per_token(model, tp, sp=sp)
    rerun_b = layers_backward_bytes_per_token(model, tp, sp=sp, rerun=True)
    if np.ndim(rerun) == 0:
        return np.multiply(rerun_b if rerun else plain, tokens) + remat
    return np.multiply(np.where(np.asarray(rerun, dtype=bool), rerun_b, plain), tokens) + remat


def kv_bytes_per_token_layer(model: ModelSpec, tp: int = 1) -> float:
    kv_heads_per_rank = max(1.0, model.num_kv_heads / tp)
    return 2 * kv_heads_per_rank * model.head_dim * BYTES_BF16
