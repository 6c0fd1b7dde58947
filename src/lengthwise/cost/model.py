"""CostModel: FLOPs, seconds and bytes of chunks on stages, for one model on one cluster.

Everything a planner or the simulator asks about cost goes through this one object, so an
analytic model and a measured profile are interchangeable.

    cm = CostModel(MODEL_PRESETS["qwen2.5-7b"], cluster_preset("h100", 32))
    cm.forward_time(chunk, layers=7, tp=1)          # seconds on one stage of 7 layers
    cm.max_seq_len(tp=1, pp=4)                       # longest sequence a pipeline holds
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

import lengthwise.cost.memory as mem
from lengthwise.cost.comm import CommModel
from lengthwise.cost.flops import (
    HEAD_RECOMPUTE,
    ChunkWork,
    chunk_work,
    down_proj_flops,
    head_forward_flops,
    layer_forward_flops,
    matmul_params_per_layer,
    mlp_recompute_flops,
    replicated_kv_flops,
)
from lengthwise.cost.time import Profile, Throughput, layer_seconds
from lengthwise.errors import UserError
from lengthwise.plan.ir import SHARDED, Chunk
from lengthwise.specs import ClusterSpec, ModelSpec

SP_COLLECTIVES_PER_LAYER = 2
"""All-gathers (and as many reduce-scatters) of one decoder layer per direction under sequence
parallelism: one before and one after the attention block, and the same for the MLP."""
NOSP_FORWARD_ALL_REDUCES = 2
"""All-reduces of one decoder layer's forward without sequence parallelism: the row-parallel
outputs of the attention (o_proj) and of the MLP (down_proj)."""
NOSP_BACKWARD_ALL_REDUCES = 2
"""All-reduces of one decoder layer's backward without sequence parallelism: the input gradient
of each block, the sum of its column-parallel projections' partial input gradients (q, k, v;
gate, up), which share one Replicate DTensor input (`parallel/tensor_parallel.LAYER_PLAN`; as
Megatron-LM's "copy to the tensor-parallel region"). Measured by `lengthwise dryrun
--no-sequence-parallel` (`tp_all_reduce`)."""
SP_RECOMPUTE_ALL_GATHERS = 2
"""All-gathers a backward reruns for one checkpointed decoder layer under sequence parallelism:
both blocks' (before the attention and before the MLP). The rerun stops at the down projection
(`cost/flops.py`: non-reentrant checkpoint's early stop), so of the forward's reduce-scatters it
reruns only the attention block's (`SP_RECOMPUTE_REDUCE_SCATTERS`), not the MLP's."""
SP_RECOMPUTE_REDUCE_SCATTERS = 1
"""Reduce-scatters a backward reruns for one checkpointed layer: the attention output's only."""
NOSP_RECOMPUTE_ALL_REDUCES = 1
"""All-reduces a backward reruns for one checkpointed layer without sequence parallelism: the
attention output's (o_proj); the down projection's is never rerun."""
SP_MLP_RECOMPUTE_ALL_GATHERS = 1
"""All-gathers a backward reruns for one layer whose MLP block is checkpointed (`F.mN`), under
sequence parallelism: the MLP's input. Its reduce-scatter comes after the down projection, where
the rerun stops; without sequence parallelism it reruns no collective (its input is whole and
its all-reduce is the down projection's)."""

RECOMPUTE_LEVELS = ("none", "mlp", "full")
"""Recomputation levels a planner chooses between, cheapest first: none, every layer's MLP block
(`F.mN`), every layer whole (`F.rN`)."""


@dataclass(frozen=True)
class StageBudget:
    """What one GPU of a pipeline stage has to hold before any chunk, and the per-token sizes of
    what chunks add: the one answer to "what fits on stage s" that the planners, the validator
    and the simulator all use (`CostModel.stage_budgets`).

    `replicas` GPUs hold a copy of the stage's weights (data-parallel pipelines times CP ranks);
    ZeRO shards model states over them."""

    stage: int
    layers: int
    first: bool
    last: bool
    tp: int
    replicas: int
    zero: int
    states: float
    """Model-state bytes: weights, gradients and optimizer states (`CostModel.model_state_bytes`)."""
    grads: float
    """The gradients' part of `states`, which comes into being in the stage's first backward
    (`CostModel.grad_bytes`; the simulator allocates it there, planners count it all step)."""
    capacity: float
    """Usable bytes of a GPU (`CostModel.capacity_bytes`)."""
    activation_per_token: float
    """Bytes a chunk keeps per row token from its forward to its backward, no recomputation
    (the LM head's too on the last stage)."""
    recomputed_per_token: float
    """The same when the forward recomputes every layer of the stage (keeps their inputs)."""
    remat_per_token: float
    """Bytes per token a backward re-materialises at once under recomputation (one layer)."""
    mlp_recomputed_per_token: float
    """The same as `activation_per_token` when the forward recomputes every layer's MLP block."""
    mlp_remat_per_token: float
    """Bytes per token a backward re-materialises at once under MLP recomputation (one MLP block)."""
    kv_per_token: float
    """K/V bytes per context token over the stage's layers (split sequences keep them)."""
    backward_work_per_token: float
    """The backward's working set per token beyond the kept activations: the loss's on the
    last stage, one decoder layer's elsewhere (`CostModel.backward_work_bytes`)."""
    rerun_work_per_token: float = 0.0
    """The same under recomputation of whole layers or of their MLP blocks, whose rerun ends
    beside the down projection's gathered output gradient (`mem.rerun_bytes_per_token`)."""
    backward_work_fixed: float = 0.0
    """Bytes of that working set that do not grow with the tokens: on the last stage the
    blocked loss's weight gradient and one block of logits (`mem.head_backward_fixed_bytes`)."""

    @property
    def free(self) -> float:
        """Bytes left for activations and K/V once model states are held (negative: even the
        states do not fit)."""
        return self.capacity - self.states


@dataclass(frozen=True)
class ExchangeHolders:
    """How many GPUs of a heterogeneous strategy hold one element (`CostModel.hetero_holders`):
    one per (pipeline, CP rank) for the tp-split weights, every TP rank of those for the norms
    (held whole on each; K/V projections replicated over TP count as split here, though
    `stage_params` counts them whole on each TP rank: a heterogeneous plan with tp above the
    K/V heads is not modelled exactly), and for the embedding table the first and the last stage of each pipeline
    when it is tied."""

    split: int
    replicated: int
    table: int


@dataclass(kw_only=True)
class CostModel:
    model: ModelSpec
    cluster: ClusterSpec
    bwd_linear_ratio: float = 2.0
    """Backward over forward FLOPs of GEMMs (two GEMMs per forward GEMM)."""
    bwd_attn_ratio: float = 2.5
    """Backward over forward FLOPs of flash-style attention (slimpack.txt §2.2.2)."""
    throughput: Throughput = field(default_factory=Throughput)
    profile: Profile | None = None
    """Measured coefficients; schemes it lacks fall back to the analytic curve."""
    memory_reserve_frac: float = 0.08
    """Share of GPU memory kept free for the allocator's fragmentation and workspaces."""
    tp_comm_overlap: float = 0.0
    """Share of the tensor-parallel activation collectives hidden behind GEMMs (0..1). 0 by
    default: Megatron-LM runs them on the compute stream unless `--tp-comm-overlap` is set, and
    the executor's DTensor collectives run between its GEMMs, not under them."""
    grads_held_all_step: bool = False
    """When gradients take their memory. False, the executor: FSDP2's fp32 accumulators are made
    by each stage's first backward and freed by the optimizer at the step's end (`cost/memory.py`).
    True, Megatron-LM (the papers' baseline system, on which ChunkFlow is built): its
    DistributedDataParallel allocates one contiguous fp32 main-gradient buffer when it wraps the
    model and only zeroes it between steps, so the gradients are held from the step's start."""
    nograd_keeps_graph: bool = False
    """How a chunk's first forward of two (an N: a split sequence's slice forwarded for its K/V
    state and forwarded again before its backward) holds memory. False, the executor: it runs
    under `torch.no_grad()`, holding one layer's working set while it runs. True, ChunkFlow's
    own system as its Algorithm 2 writes it (chunkflow.txt lines 13-19): every forward runs
    with autograd on (`Loss = model(Chunk, StateStore)`) and a chunk's activations are
    "discarded" by not keeping the loss, so its whole graph (the activations an F keeps) lives
    until `Loss` is rebound, when the stage's next forward returns (`sim/memory.py`). At K = 1
    that puts two chunks' activations on the GPU at the end of each of a split sequence's
    forwards, which is what ChunkFlow's Table 5 measured (`benchmarks/chunkflow_table5.py`).
    This and `grads_held_all_step` describe another system's memory for the simulator; the
    planners and the validator budget for the executor whatever they say."""
    sequence_parallel: bool = True
    """Whether tensor parallelism splits the residual stream's rows over the TP ranks, as the
    executor's `ParallelOptions.sequence_parallel` (`lengthwise train/verify/dryrun
    --no-sequence-parallel` turns it off; `runtime/parallel/tensor_parallel.py`). True:
    Megatron-LM's sequence parallelism, all-gathers and reduce-scatters around each block,
    the norms on 1/tp of the rows. False: whole activations, norms and stage boundaries on every
    TP rank, the blocks' outputs and the projections' input gradients all-reduced
    (`tp_comm_time`, `cost/memory.py`). No effect at tp 1."""

    def __post_init__(self):
        self.comm = CommModel(self.cluster)

    def time_source(self) -> dict:
        """Where chunk times come from, for reports: `efficiency` "profile" (a measured one,
        for the schemes it holds; other schemes fall back to the curve, `other_schemes`) or
        "built-in curve"; `measured_on`, the hardware; `text`, one line saying both."""
        curve = {"efficiency": "built-in curve", "measured_on": self.throughput.measured_on,
                 "text": self.throughput.describe()}
        if self.profile is None:
            return curve
        schemes = sorted(self.profile.schemes)
        return {"efficiency": "profile", "measured_on": self.profile.device, "profile_model": self.profile.model,
                "schemes": schemes, "other_schemes": curve,
                "text": f"measured profile of {self.profile.model} on {self.profile.device} ({', '.join(schemes)}); "
                        f"other schemes: {curve['text']}"}

    # ---- FLOPs (whole chunk, every projection once: model FLOPs, for balancing and MFU; a
    # rank's share under tp is 1/tp of them plus `flops.replicated_kv_flops`) ----
    def forward_flops(self, chunk: Chunk, *, layers: int, head: bool = False) -> float:
        work = chunk_work(chunk)
        lin, attn = layer_forward_flops(self.model, work)
        return layers * (lin + attn) + (head_forward_flops(self.model, work.tokens) if head else 0.0)

    def backward_flops(self, chunk: Chunk, *, layers: int, head: bool = False) -> float:
        work = chunk_work(chunk)
        lin, attn = layer_forward_flops(self.model, work)
        body = layers * (lin * self.bwd_linear_ratio + attn * self.bwd_attn_ratio)
        return body + (head_forward_flops(self.model, work.tokens) * (self.bwd_linear_ratio + HEAD_RECOMPUTE)
                       if head else 0.0)

    # ---- seconds on one stage ----
    def forward_time(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1, head: bool = False,
                     embed: bool = False) -> float:
        """Forward seconds of a stage of `layers` layers, with the LM head (`head`: the last
        stage) and the embedding (`embed`: the first stage; under tensor parallelism its
        sequence-parallel collective, `sp_edge_comm_time`)."""
        return max(self._gpu_time(w, layers, tp, head, backward=False, embed=embed) for w in rank_works(chunk, cp))

    def backward_time(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1, head: bool = False,
                      recompute_layers: int = 0, recompute_mlp: int = 0, embed: bool = False) -> float:
        """Backward seconds, plus what it reruns of the forward of `recompute_layers` layers
        (`recompute_time`) and of `recompute_mlp` layers' MLP blocks (`mlp_recompute_time`)."""
        return max(self._gpu_time(w, layers, tp, head, backward=True, embed=embed)
                   + self.recompute_time(w, layers=recompute_layers, tp=tp)
                   + self.mlp_recompute_time(w, layers=recompute_mlp, tp=tp)
                   for w in rank_works(chunk, cp))

    def mlp_recompute_time(self, work: ChunkWork, *, layers: int, tp: int = 1) -> float:
        """Seconds one GPU spends rerunning `layers` checkpointed MLP blocks in a backward on
        `work`: their gate and up projections (`cost/flops.mlp_recompute_flops`) and, under
        sequence parallelism, the all-gather of each block's input
        (`SP_MLP_RECOMPUTE_ALL_GATHERS`). A profile measured whole layer forwards: its per-token
        coefficient cut to the gate and up projections' share of the layer's linear FLOPs."""
        if layers <= 0 or work.tokens == 0:
            return 0.0
        fit = self.profile.fit_for(tp, 1) if self.profile else None
        if fit is not None:
            share = 2 * self.model.hidden * self.model.ffn / matmul_params_per_layer(self.model)
            return layers * fit.fwd[1] * share * work.tokens
        peak = self.cluster.peak_tflops * 1e12
        gemm_s = mlp_recompute_flops(self.model, work.tokens) / tp / (
            peak * self.throughput.linear_efficiency(work.tokens, tp))
        gather_s = 0.0
        if tp > 1 and self.sequence_parallel:
            gather_s = SP_MLP_RECOMPUTE_ALL_GATHERS * self.collective_time(
                "all_gather", self.sp_collective_bytes(work.tokens), ranks=tp, inter_node=False)
        return layers * (gemm_s + (1.0 - self.tp_comm_overlap) * gather_s)

    def recompute_time(self, work: ChunkWork, *, layers: int, tp: int = 1) -> float:
        """Seconds one GPU spends rerunning `layers` checkpointed layers' forwards in a backward
        on `work`: each layer's forward less the down projection's GEMM and the collective after
        it (its reduce-scatter, or all-reduce without sequence parallelism), where non-reentrant
        checkpoint stops (`cost/flops.py`). A profile measured whole forwards: its per-token
        coefficient is cut by the down projection's share of the layer's linear FLOPs."""
        if layers <= 0 or work.tokens == 0:
            return 0.0
        fit = self.profile.fit_for(tp, 1) if self.profile else None
        if fit is not None:
            a, b, c = fit.fwd
            kept = 1.0 - self.model.hidden * self.model.ffn / matmul_params_per_layer(self.model)
            return layers * layer_seconds((a, b * kept, c), fit.fwd_floor, work.keys, work.tokens, work.segments)
        peak = self.cluster.peak_tflops * 1e12
        down_s = down_proj_flops(self.model, work.tokens) / tp / (peak * self.throughput.linear_efficiency(work.tokens, tp))
        skipped = down_s + (1.0 - self.tp_comm_overlap) * self._recompute_skipped_comm_time(work.tokens, tp)
        return self._analytic_time(work, layers, tp, False, False) - layers * skipped

    def _recompute_skipped_comm_time(self, tokens: float, tp: int) -> float:
        """Seconds of the one collective per layer a rerun skips: the MLP's reduce-scatter, or
        its all-reduce without sequence parallelism (0 at tp 1)."""
        if tp <= 1 or tokens <= 0:
            return 0.0
        kind = "reduce_scatter" if self.sequence_parallel else "all_reduce"
        return self.collective_time(kind, self.sp_collective_bytes(tokens), ranks=tp, inter_node=False)

    def _gpu_time(self, work: ChunkWork, layers: int, tp: int, head: bool, backward: bool,
                  embed: bool = False) -> float:
        """Seconds for one GPU of a tp group running `work` (its share of the chunk)."""
        if work.tokens == 0 or (layers == 0 and not head and not (embed and tp > 1)):
            return 0.0
        fit = self.profile.fit_for(tp, 1) if self.profile else None
        if fit is not None:
            hb, hc = fit.head_bwd if backward else fit.head_fwd
            layer = layer_seconds(fit.bwd if backward else fit.fwd, fit.bwd_floor if backward else fit.fwd_floor,
                                  work.keys, work.tokens, work.segments, fit.bwd_segment_tokens if backward else 0.0)
            body = layers * layer
            return body + ((hb * work.tokens + hc) if head else 0.0) + self._step_action_time(work.tokens, embed,
                                                                                             backward)
        return self._analytic_time(work, layers, tp, head, backward, embed)

    def _step_action_time(self, tokens, embed: bool, backward: bool):
        """A profile's terms of one chunk action outside the layers and the head: the host's
        per-chunk overhead and (first stage) the embedding (0 without step terms)."""
        step = self.profile.step if self.profile else None
        if step is None:
            return 0.0
        eb, ec = step.embed_bwd if backward else step.embed_fwd
        return step.chunk_overhead_s + ((eb * tokens + ec) if embed else 0.0)

    def step_end_time(self, *, layers: int, tp: int = 1, dp: int = 1, zero: int = 1, first: bool = False,
                      last: bool = False) -> float:
        """Seconds a stage spends after its last backward and gradient reduction: the gradient
        norm and the optimizer step over its share of the parameters (a profile's step terms,
        which are for the whole model on one GPU; ZeRO >= 1 steps 1/dp of the states). 0 without
        a profile's step terms: the analytic model leaves them out."""
        step = self.profile.step if self.profile else None
        if step is None or not (step.optimizer_s or step.grad_norm_s):
            return 0.0
        share = mem.stage_params(self.model, layers=layers, tp=tp, first=first, last=last) / self.model.num_params
        return share * (step.grad_norm_s + step.optimizer_s / (dp if zero >= 1 else 1))

    def _analytic_time(self, work: ChunkWork, layers: int, tp: int, head: bool, backward: bool,
                       embed: bool = False) -> float:
        lin, attn = layer_forward_flops(self.model, work)
        head_flops = head_forward_flops(self.model, work.tokens) if head else 0.0
        if backward:
            lin, attn, head_flops = (lin * self.bwd_linear_ratio, attn * self.bwd_attn_ratio,
                                     head_flops * (self.bwd_linear_ratio + HEAD_RECOMPUTE))
        peak = self.cluster.peak_tflops * 1e12
        lin_eff = self.throughput.linear_efficiency(work.tokens, tp)
        lin_s = (layers * lin + head_flops) / tp / (peak * lin_eff)
        if mem.kv_replicated(self.model, tp):  # K/V projections computed whole on each rank (cost/flops.py)
            kv = replicated_kv_flops(self.model, work.tokens, tp) * (self.bwd_linear_ratio if backward else 1.0)
            lin_s += layers * kv / (peak * lin_eff)
        attn_s = layers * attn / tp / (peak * self.throughput.attention_mfu)
        tp_s = (1.0 - self.tp_comm_overlap) * layers * self.tp_comm_time(work.tokens, tp=tp, backward=backward)
        if tp > 1 and (head or embed):
            tp_s += (1.0 - self.tp_comm_overlap) * self.sp_edge_comm_time(work.tokens, tp=tp, head=head, embed=embed,
                                                                           backward=backward)
        return lin_s + attn_s + tp_s + layers * self.throughput.layer_overhead_s

    def works_time(self, tokens, keys, *, layers: int, tp: int = 1, head: bool = False,
                   backward: bool = False, embed: bool = False, segments=None) -> np.ndarray:
        """_gpu_time of many whole-GPU works at once (cp = 1: forward_time / backward_time of
        chunks with these row tokens and attention pairs): float64 array, element for element
        the same arithmetic in the same order as the scalar path, so the same floats (the
        simulator's per-chunk tables use it; tests/test_cost.py checks the equality).
        `segments`: of each row (a profile's host floor grows with them); None counts one each,
        a lower bound of the floor, which planners that pass no segments use."""
        tokens = np.asarray(tokens, dtype=np.float64)
        keys = np.asarray(keys, dtype=np.float64)
        if layers == 0 and not head and not (embed and tp > 1):
            return np.zeros(len(tokens))
        fit = self.profile.fit_for(tp, 1) if self.profile else None
        if fit is not None:
            segs = np.ones(len(tokens)) if segments is None else np.maximum(np.asarray(segments, dtype=np.float64), 1.0)
            hb, hc = fit.head_bwd if backward else fit.head_fwd
            layer = layer_seconds(fit.bwd if backward else fit.fwd, fit.bwd_floor if backward else fit.fwd_floor,
                                  keys, tokens, segs, fit.bwd_segment_tokens if backward else 0.0)
            out = (layers * layer + ((hb * tokens + hc) if head else 0.0)
                   + self._step_action_time(tokens, embed, backward))
        else:
            m, th = self.model, self.throughput
            lin, attn = 2.0 * matmul_params_per_layer(m) * tokens, 4.0 * m.q_dim * keys
            head_flops = 2.0 * m.hidden * m.vocab * tokens if head else 0.0
            if backward:
                lin, attn, head_flops = (lin * self.bwd_linear_ratio, attn * self.bwd_attn_ratio,
                                         head_flops * (self.bwd_linear_ratio + HEAD_RECOMPUTE))
            peak = self.cluster.peak_tflops * 1e12
            x = np.maximum(tokens, 1.0)
            lin_eff = th.linear_mfu * x / (x + th.half_tokens * tp)
            lin_s = (layers * lin + head_flops) / tp / (peak * lin_eff)
            if mem.kv_replicated(m, tp):  # as _analytic_time
                kv = replicated_kv_flops(m, tokens, tp) * (self.bwd_linear_ratio if backward else 1.0)
                lin_s += layers * kv / (peak * lin_eff)
            attn_s = layers * attn / tp / (peak * th.attention_mfu)
            if tp > 1:
                comm = {t: self.tp_comm_time(t, tp=tp, backward=backward) for t in set(tokens.tolist())}
                tp_s = (1.0 - self.tp_comm_overlap) * layers * np.array([comm[t] for t in tokens.tolist()])
                if head or embed:
                    edge = {t: self.sp_edge_comm_time(t, tp=tp, head=head, embed=embed, backward=backward)
                            for t in comm}
                    tp_s += (1.0 - self.tp_comm_overlap) * np.array([edge[t] for t in tokens.tolist()])
            else:
                tp_s = (1.0 - self.tp_comm_overlap) * layers * 0.0
            out = lin_s + attn_s + tp_s + layers * th.layer_overhead_s
        return np.where(tokens == 0, 0.0, out)

    def tp_comm_time(self, tokens: float, *, tp: int, backward: bool = False) -> float:
        """Seconds of one decoder layer's tensor-parallel activation collectives, forward or
        (`backward`) backward, each of tokens x hidden bf16 values (`sp_collective_bytes`),
        inside one node (tp <= GPUs per node). With sequence parallelism (Megatron-LM's layout,
        which the executor's SequenceParallel / ColwiseParallel / RowwiseParallel plan follows):
        before the attention and the MLP block an all-gather of the sequence-sharded
        activations, after each a reduce-scatter (the gathered size); backward runs the
        transposed collectives, the same volume. Without (`sequence_parallel` False): the
        forward all-reduces the two row-parallel outputs, the backward the two blocks' input
        gradients (`NOSP_BACKWARD_ALL_REDUCES`). The embedding's and the LM
        head's collectives are `sp_edge_comm_time`."""
        if tp <= 1 or tokens <= 0:
            return 0.0
        nbytes = self.sp_collective_bytes(tokens)
        if not self.sequence_parallel:
            count = NOSP_BACKWARD_ALL_REDUCES if backward else NOSP_FORWARD_ALL_REDUCES
            return count * self.collective_time("all_reduce", nbytes, ranks=tp, inter_node=False)
        return SP_COLLECTIVES_PER_LAYER * (self.collective_time("all_gather", nbytes, ranks=tp, inter_node=False)
                                           + self.collective_time("reduce_scatter", nbytes, ranks=tp, inter_node=False))

    def sp_edge_comm_time(self, tokens: float, *, tp: int, head: bool = False, embed: bool = False,
                          backward: bool = False) -> float:
        """Seconds of the sequence-parallel collectives at the ends of the model, once per
        forward or backward of the stage that holds them: the embedding's (first stage) output,
        partial sums of the vocabulary-parallel lookup, reduce-scattered to each rank's rows,
        and the LM head's (last stage) input all-gathered from them; backward runs the
        transposes (the embedding's gradient all-gathered, the head's input gradient
        reduce-scattered). Without sequence parallelism: the embedding's partial lookups
        all-reduced in forward, the head's input gradient in backward (its input and the
        embedding's output gradient are whole already). Each of `sp_collective_bytes(tokens)`,
        inside one node."""
        if tp <= 1 or tokens <= 0 or not (head or embed):
            return 0.0
        nbytes = self.sp_collective_bytes(tokens)
        if not self.sequence_parallel:
            reduced = (head and backward) or (embed and not backward)
            return self.collective_time("all_reduce", nbytes, ranks=tp, inter_node=False) if reduced else 0.0
        gather = self.collective_time("all_gather", nbytes, ranks=tp, inter_node=False)
        scatter = self.collective_time("reduce_scatter", nbytes, ranks=tp, inter_node=False)
        if backward:
            return (scatter if head else 0.0) + (gather if embed else 0.0)
        return (gather if head else 0.0) + (scatter if embed else 0.0)

    def sp_collective_bytes(self, tokens: float) -> float:
        """Gathered size of one sequence-parallel all-gather or reduce-scatter of `tokens` rows,
        or the size of one all-reduce of them without sequence parallelism: tokens x hidden bf16
        values (`sim/rank.py` counts the executor's from it)."""
        return tokens * self.model.hidden * mem.BYTES_BF16

    # ---- bytes per GPU ----
    @property
    def capacity_bytes(self) -> float:
        return self.cluster.gpu_memory_bytes * (1.0 - self.memory_reserve_frac)

    def activation_bytes_per_token(self, *, layers: int, tp: int = 1, recompute_layers: int = 0,
                                   recompute_mlp: int = 0, head: bool = False) -> float:
        """Bytes a chunk keeps per row token on a stage of `layers` layers, `recompute_layers` of
        them recomputed whole (each keeps its input) and `recompute_mlp` more their MLP block
        (each keeps all but `mem.mlp_recompute_saved_bytes_per_token_layer`), with the LM
        head's on the last stage (`head`), and what the stage keeps beside them
        (`mem.stage_kept_bytes_per_token`: the rotary tables, the output of a stage but the
        last)."""
        sp = self.sequence_parallel
        full = mem.activation_bytes_per_token_layer(self.model, tp, sp=sp)
        if self.profile and self.profile.activation_bytes_per_token_layer:
            full = self.profile.activation_bytes_per_token_layer / tp
        kept = recompute_layers * mem.checkpoint_bytes_per_token_layer(self.model, tp, sp=sp)
        if recompute_mlp:
            kept -= recompute_mlp * mem.mlp_recompute_saved_bytes_per_token_layer(self.model, tp, sp=sp)
        head_b = mem.head_bytes_per_token(self.model, tp, sp=sp) if head else 0.0
        stage = mem.stage_kept_bytes_per_token(self.model, tp, layers=layers, head=head, sp=sp)
        return (layers - recompute_layers) * full + kept + head_b + stage

    def activation_bytes(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1,
                         recompute_layers: int = 0, recompute_mlp: int = 0, head: bool = False) -> float:
        """Bytes held from the chunk's forward to its backward on the busiest GPU of the CP
        group: per token, and without CP the attention output's padded copy of each layer that
        keeps its activations (`attention_pad_bytes`); under CP each such layer also keeps the
        K/V its all-gather assembled of the chunk's sharded segments, whole, for its backward
        (`cp_kv_layer_bytes`: the executor gathers nothing again there). A layer that recomputes
        only its MLP block keeps both: its attention is not rerun."""
        if cp <= 1:
            return float(self.activation_bytes_rows(chunk_work(chunk).tokens, layers=layers, tp=tp,
                                                    recompute_layers=recompute_layers, recompute_mlp=recompute_mlp,
                                                    head=head))
        per_token = self.activation_bytes_per_token(layers=layers, tp=tp, recompute_layers=recompute_layers,
                                                    recompute_mlp=recompute_mlp, head=head)
        gathered = (layers - recompute_layers) * self.cp_kv_layer_bytes(chunk, tp=tp)
        return per_token * max(w.tokens for w in rank_works(chunk, cp)) + gathered

    def activation_bytes_rows(self, tokens, *, layers: int, tp: int = 1, recompute_layers: int = 0,
                              recompute_mlp: int = 0, head: bool = False):
        """`activation_bytes` of chunks without CP of these row tokens (a number or a float64
        array, elementwise: the same floats)."""
        per_token = self.activation_bytes_per_token(layers=layers, tp=tp, recompute_layers=recompute_layers,
                                                    recompute_mlp=recompute_mlp, head=head)
        return per_token * tokens + (layers - recompute_layers) * self.attention_pad_bytes(tokens, tp=tp)

    def attention_pad_bytes(self, tokens, *, tp: int = 1):
        """Bytes one layer keeps beyond its per-token figure for a row of `tokens` that tp does
        not divide (a number or an array, elementwise): the row is padded to the next multiple of
        tp (`runtime/parallel/tensor_parallel.py`), and the output projection keeps a padded copy
        of the attention output, whose unpadded original flash attention keeps too: q_dim / tp
        bf16 values per padded row (Qwen2.5-7B at tp 2: 4% of a layer's activations). The other
        tensors gain at most tp - 1 rows, left out. Under CP (rows padded otherwise) none, and
        none without sequence parallelism (rows are not padded)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if tp <= 1 or not self.sequence_parallel:
            return np.zeros_like(tokens)
        padded = np.ceil(tokens / tp) * tp
        return np.where(padded > tokens, padded * (self.model.q_dim * mem.BYTES_BF16 / tp), 0.0)

    def recompute_transient_bytes_per_token(self, *, tp: int = 1, recompute_layers: int = 0,
                                            recompute_mlp: int = 0) -> float:
        """Bytes per token a backward re-materialises at once when its forward recomputed
        `recompute_layers` layers. The executor checkpoints layer by layer
        (`runtime/model.run_layers`, non-reentrant `torch.utils.checkpoint` per layer), so the
        backward reruns one layer's forward, consumes it and frees it before the next: one
        layer's activations less the input it kept, whatever the count (0 with no recomputation).
        The rerun stops once the last tensor the layer saved, the down projection's input, is
        back (`cost/flops.py`), so all of them are held at once: the down projection's output
        and the layer's output are never made again. What the rerun's end holds beside them
        (silu(gate), and under sequence parallelism the gathered output gradient and the norm's
        rows) is the backward's working set (`mem.rerun_bytes_per_token`). With only MLP
        blocks recomputed, one block's (`mem.mlp_recompute_saved_bytes_per_token_layer`); with
        both, a whole layer's, the larger."""
        if recompute_layers <= 0:
            return self._mlp_remat_per_token(tp) if recompute_mlp > 0 else 0.0
        return (self.activation_bytes_per_token(layers=1, tp=tp)
                - self.activation_bytes_per_token(layers=1, tp=tp, recompute_layers=1))

    def _mlp_remat_per_token(self, tp: int) -> float:
        return mem.mlp_recompute_saved_bytes_per_token_layer(self.model, tp, sp=self.sequence_parallel)

    def recompute_transient_bytes(self, chunk: Chunk, *, tp: int = 1, cp: int = 1, recompute_layers: int = 0,
                                  recompute_mlp: int = 0) -> float:
        """`recompute_transient_bytes_per_token` for the chunk's busiest GPU of the CP group."""
        if recompute_layers <= 0:
            if recompute_mlp <= 0:
                return 0.0
            return self._mlp_remat_per_token(tp) * max(w.tokens for w in rank_works(chunk, cp))
        if cp <= 1:  # the re-materialised layer's activations, its padded attention output's copy too
            return float(self.activation_bytes_rows(chunk_work(chunk).tokens, layers=1, tp=tp)
                         - self.activation_bytes_rows(chunk_work(chunk).tokens, layers=1, tp=tp, recompute_layers=1))
        per_token = self.recompute_transient_bytes_per_token(tp=tp, recompute_layers=recompute_layers)
        return per_token * max(w.tokens for w in rank_works(chunk, cp)) + self.cp_kv_layer_bytes(chunk, tp=tp)

    def head_backward_bytes(self, chunk: Chunk, *, tp: int = 1, cp: int = 1) -> float:
        """Bytes the loss's backward works on, on top of the kept activations, while the
        chunk's backward runs on the last stage (busiest GPU of the CP group)."""
        return float(mem.head_backward_bytes(self.model, max(w.tokens for w in rank_works(chunk, cp)), tp))

    def backward_work_bytes(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1, head: bool = False,
                            remat: float = 0.0, rerun: bool = False) -> float:
        """Largest working set of the chunk's backward on a stage of `layers` layers (`head`:
        the last stage), on top of its kept activations (busiest GPU of the CP group): the
        loss's backward on the last stage, one layer's SwiGLU backward elsewhere, beside the
        `remat` bytes (`recompute_transient_bytes`) a recomputed layer re-materialises for it,
        and with `rerun` (every layer of the stage makes its MLP block again) the rerun's end
        (`cost/memory.py`)."""
        return float(self.backward_work_bytes_rows(max(w.tokens for w in rank_works(chunk, cp)), layers=layers,
                                                   tp=tp, head=head, remat=remat, rerun=rerun))

    def backward_work_bytes_rows(self, tokens, *, layers: int, tp: int = 1, head: bool = False, remat=0.0,
                                 rerun=False):
        """`backward_work_bytes` of rows of these tokens (a number or a float64 array,
        elementwise, as `remat` and `rerun`): per token, and on the last stage the blocked
        loss's backward (`mem.backward_work_bytes`)."""
        return mem.backward_work_bytes(self.model, tokens, tp, layers=layers, head=head, sp=self.sequence_parallel,
                                       remat=remat, rerun=rerun)

    def backward_work_bytes_per_token(self, *, layers: int, tp: int = 1, head: bool = False,
                                      rerun: bool = False) -> float:
        """`backward_work_bytes` per token (`mem.backward_work_bytes_per_token` in this model's
        tensor-parallel layout; `rerun`: the layers' MLP blocks are made again in backward)."""
        return mem.backward_work_bytes_per_token(self.model, tp, layers=layers, head=head, sp=self.sequence_parallel,
                                                 rerun=rerun)

    def head_forward_bytes(self, chunk: Chunk, *, tp: int = 1, cp: int = 1) -> float:
        """Bytes beside the kept activations while the chunk's forward runs the LM head: one
        block's bf16 logits and their fp32 copy (`mem.head_forward_bytes`; busiest GPU of the
        CP group)."""
        return float(mem.head_forward_bytes(self.model, max(w.tokens for w in rank_works(chunk, cp)), tp))

    def kv_bytes(self, num_tokens: int, *, layers: int, tp: int = 1, cp: int = 1) -> float:
        per = mem.kv_bytes_per_token_layer(self.model, tp)
        if self.profile and self.profile.kv_bytes_per_token_layer:
            per = self.profile.kv_bytes_per_token_layer
        return per * layers * num_tokens / cp

    def model_state_bytes(self, *, layers: int, tp: int = 1, dp: int = 1, zero: int = 1,
                          first: bool = False, last: bool = False) -> float:
        """Bytes of weights, gradients and optimizer states one GPU of a stage holds; `dp` is the
        number of ranks holding a replica of the stage's weights, over which ZeRO shards: data
        parallel pipelines times CP ranks (each CP rank holds the whole stage)."""
        params = mem.stage_params(self.model, layers=layers, tp=tp, first=first, last=last)
        return params * mem.state_bytes_per_param(dp, zero, grads=False) + self.grad_bytes(
            layers=layers, tp=tp, dp=dp, zero=zero, first=first, last=last)

    def grad_bytes(self, *, layers: int, tp: int = 1, dp: int = 1, zero: int = 1,
                   first: bool = False, last: bool = False) -> float:
        """The gradients' part of `model_state_bytes`: fp32 accumulators of `mem.grad_params`
        elements (the embedding's whole table on the first stage), unsharded at every ZeRO stage
        while the step accumulates them (`cost/memory.py`; `dp` and `zero` change nothing)."""
        return mem.grad_params(self.model, layers=layers, tp=tp, first=first, last=last) * mem.GRAD_BYTES_PER_PARAM

    def hetero_holders(self, pipelines) -> "ExchangeHolders":
        """How many GPUs hold each element of a heterogeneous strategy whose pipelines have the
        (tp, pp, cp) of `pipelines` (`ExchangeHolders`)."""
        pipelines = [tuple(p)[:3] for p in pipelines]
        tied = self.model.tied_embeddings
        return ExchangeHolders(split=sum(cp for _, _, cp in pipelines),
                               replicated=sum(tp * cp for tp, _, cp in pipelines),
                               table=sum(cp * (2 if tied and pp > 1 else 1) for _, pp, cp in pipelines))

    def hetero_owned(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False,
                     holders: "ExchangeHolders") -> float:
        """Parameter elements one GPU of a stage owns in a heterogeneous plan
        (runtime/parallel/hetero.py: every element owned by one of its h holders, each holder
        owning 1/h of what it holds): its tp-split weights over `holders.split`, its whole norms
        over `holders.replicated`, its embedding table (tied: on the first and the last stage)
        over `holders.table`. Exact when h divides every held band's width."""
        m = self.model
        norms = layers * 2 * m.hidden + (m.hidden if last else 0)
        split = (layers * m.params_per_layer - layers * 2 * m.hidden) / tp / holders.split
        table = m.vocab * m.hidden / tp
        if first:
            split += table / holders.table
        if last and not (first and m.tied_embeddings):
            split += table / (holders.table if m.tied_embeddings else holders.split)
        return split + norms / holders.replicated

    def hetero_state_bytes(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False,
                           holders: "ExchangeHolders") -> float:
        """Model-state bytes one GPU of a heterogeneous plan holds, as the executor lays them out
        (`runtime/train/dist_hetero.py`, `runtime/parallel/hetero.py`): its stage's weights in
        the run's dtype (bf16, 2 bytes per held parameter), their gradients in the same dtype
        (`hetero_grad_bytes`: autograd accumulates them in the parameters' bf16 and they stay
        local, unsummed, until the push), and for the elements it owns (`hetero_owned`, about 1/d
        of what it holds, d holders) the fp32 master weights and AdamW's two moments (12). The
        exchange keeps no index maps (it copies strided blocks); its push's and pull's buffers at
        the step's end are `exchange_transient_bytes`."""
        held = mem.stage_params(self.model, layers=layers, tp=tp, first=first, last=last)
        owned = self.hetero_owned(layers=layers, tp=tp, first=first, last=last, holders=holders)
        return (held * mem.BYTES_BF16 + self.hetero_grad_bytes(layers=layers, tp=tp, first=first, last=last)
                + mem.OPTIMIZER_BYTES_PER_PARAM * owned)

    def hetero_grad_bytes(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False) -> float:
        """The gradients' part of `hetero_state_bytes`: bf16, of `mem.grad_params` elements (the
        embedding's whole table on the first stage, until `dp.match_grad_layouts` slices it)."""
        return mem.grad_params(self.model, layers=layers, tp=tp, first=first, last=last) * mem.BYTES_BF16

    @staticmethod
    def exchange_transient_bytes(*, held: float, owned: float) -> float:
        """Largest working set of a heterogeneous plan's step end beyond `hetero_state_bytes`
        (`train/dist_hetero.py`; activations are freed by then): a GPU holding `held` parameter
        elements and owning `owned` of them (its master shard), receiving as owner each owned
        element from each of its holders, itself included: `held` in all (owned_c x h_c = held_c
        for every holder count h_c). The push holds the flattened bf16 gradients (2 bytes per held
        element) and the received bf16 slices (2 per received) throughout, beside first the
        owner-ordered send buffer (2 per held), released after the all-to-all, then the fp32
        summed shard (4 per owned) the received slices are added into in place; the gradient
        norm squares a float64 copy of the shard (4 + 16 per owned); the pull, beside the shard,
        fills a bf16 send buffer from the masters it owns (2 per received) and receives the bf16
        weights (2 per held), then releases the send buffer and reorders the weights into a copy
        (2 per held)."""
        received = held
        push = 2 * held + 2 * received + max(2 * held, 4 * owned)
        norm = 20 * owned
        pull = 4 * owned + max(2 * received + 2 * held, 4 * held)
        return max(push, norm, pull)

    @staticmethod
    def exchange_sent_bytes(*, held: float, owned: float) -> float:
        """Bytes one GPU hands to the exchange's two all-to-alls in a step, less what it sends
        itself, for a GPU holding `held` parameter elements and owning `owned` of them: on the
        push its bf16 gradients of the elements others own (held - owned); on the pull, as owner,
        each owned element's bf16 weight to its h - 1 other holders: sum of owned_c (h_c - 1) =
        held - owned again. Exact when every held band's width is a multiple of its holder count,
        within a column per shard row and segment otherwise. (`exchange_bytes` counts instead what
        passes the GPU's link, sent on the push and received on the pull: the same.)"""
        return 2 * (held - owned) * mem.BYTES_BF16

    def boundary_bytes(self, chunk: Chunk, *, tp: int = 1, cp: int = 1, cp_rank: int | None = None) -> float:
        """Hidden states one rank hands to the next stage, scattered over tp with sequence
        parallelism (whole on every TP rank without). Under CP each rank sends its own rows: 1/cp of the sharded segments plus
        the segments placed whole on it (`rank_works`); `cp_rank` None gives the busiest rank's,
        which is what a stage waits for."""
        if cp <= 1 or chunk.pad_to > chunk.num_tokens or all(s.cp_rank == SHARDED for s in chunk.segments):
            rows = chunk.row_tokens / cp
        else:
            works = rank_works(chunk, cp)
            rows = works[cp_rank].tokens if cp_rank is not None else max(w.tokens for w in works)
        return rows * self.model.hidden * mem.BYTES_BF16 / (tp if self.sequence_parallel else 1)

    # ---- communication seconds ----
    def p2p_time(self, nbytes: float, *, inter_node: bool) -> float:
        return self.comm.p2p_time(nbytes, inter_node=inter_node)

    def collective_time(self, kind: str, nbytes: float, *, ranks: int, inter_node: bool) -> float:
        return self.comm.collective_time(kind, nbytes, ranks=ranks, inter_node=inter_node)

    def grad_sync_time(self, *, layers: int, tp: int = 1, dp: int = 1, zero: int = 1, inter_node: bool = True,
                       first: bool = False, last: bool = False,
                       bytes_per_grad: float = mem.GRAD_BYTES_PER_PARAM) -> float:
        """Data-parallel gradient reduction of one stage's gradients (all-reduce, or
        reduce-scatter under ZeRO-2/3, whose parameter all-gather is charged too), sent as
        `bytes_per_grad` bytes each: fp32 as the step's accumulated gradients are reduced, or
        bf16 where a baseline reduces each micro-batch's gradients as computed."""
        params = mem.stage_params(self.model, layers=layers, tp=tp, first=first, last=last)
        grad_bytes = params * bytes_per_grad
        if zero >= 2:
            t = self.collective_time("reduce_scatter", grad_bytes, ranks=dp, inter_node=inter_node)
            return t + (self.collective_time("all_gather", params * mem.BYTES_BF16, ranks=dp, inter_node=inter_node)
                        if zero == 3 else 0.0)
        return self.collective_time("all_reduce", grad_bytes, ranks=dp, inter_node=inter_node)

    def exchange_bytes(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False,
                       holders: "ExchangeHolders") -> float:
        """Bytes that pass one GPU of a stage's link in a heterogeneous plan's
        optimisation-propagation exchange (runtime/parallel/hetero.py): every element is owned by
        one of its holders, so the GPU pushes its bf16 gradients of the elements it holds but
        does not own and pulls their weights back: twice (held - owned) bf16 values, a
        reduce-scatter and an all-gather among each element's holders (2 (d - 1) / d of the held
        bytes at d holders: a ring all-reduce's volume)."""
        held = mem.stage_params(self.model, layers=layers, tp=tp, first=first, last=last)
        owned = self.hetero_owned(layers=layers, tp=tp, first=first, last=last, holders=holders)
        return 2 * (held - owned) * mem.BYTES_BF16

    def exchange_time(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False,
                      holders: "ExchangeHolders", inter_node: bool = True) -> float:
        """Seconds of `exchange_bytes`: a push and a pull, each one all-to-all in which the GPU
        sends (held - owned) bf16 values, priced as an all-to-all among the d = `holders.split`
        holders of its weights (whose ring share (d - 1) / d of the buffer is what it sends)."""
        d = holders.split
        sent = self.exchange_bytes(layers=layers, tp=tp, first=first, last=last, holders=holders) / 2
        if sent <= 0 or d <= 1:
            return 0.0
        return 2 * self.collective_time("all_to_all", sent * d / (d - 1), ranks=d, inter_node=inter_node)

    def cp_comm_time(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1, inter_node: bool = False) -> float:
        """Forward K/V all-gather of the chunk's sharded segments over the CP group, every layer
        (skrull.txt eq. 15: volume = tokens * 2 * kv_dim) on `cp_kv_layer_bytes`: the chunk's own
        rows only, since the gathered K/V of a split sequence's earlier chunks stays in the
        executor's per-layer state and is not gathered again. The backward's reduce-scatter of
        the K/V gradients is `cp_grad_comm_time`."""
        if cp <= 1:
            return 0.0
        nbytes = self.cp_kv_layer_bytes(chunk, tp=tp)
        if nbytes == 0:
            return 0.0
        return layers * self.collective_time("all_gather", nbytes, ranks=cp, inter_node=inter_node)

    def cp_kv_layer_bytes(self, chunk: Chunk, *, tp: int = 1) -> float:
        """Bytes per layer of the K/V of the chunk's sharded segments, whole (all CP ranks'
        pieces; a segment's context from earlier chunks is not in it): what the executor's
        per-layer all-gather assembles, each CP rank contributing 1/cp, and what its backward
        hands to the reduce-scatter of the K/V gradients (runtime/distributed/cp.py `_GatherKV`,
        which pads a segment to a multiple of 2 cp rows, at most 2 cp - 1 rows more)."""
        sharded = sum(s.num_tokens for s in chunk.segments if s.cp_rank == SHARDED)
        return self.kv_bytes(sharded, layers=1, tp=tp) if sharded else 0.0

    def cp_grad_comm_time(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1,
                          inter_node: bool = False) -> float:
        """Seconds of the backward's reduce-scatter of the K/V gradients of the chunk's sharded
        segments over the CP group, every layer: the transpose of the forward's all-gather, on
        `cp_kv_layer_bytes` (the executor keeps the gathered K/V from the forward, so the
        backward gathers nothing again)."""
        if cp <= 1:
            return 0.0
        nbytes = self.cp_kv_layer_bytes(chunk, tp=tp)
        if nbytes == 0:
            return 0.0
        return layers * self.collective_time("reduce_scatter", nbytes, ranks=cp, inter_node=inter_node)

    # ---- limits ----
    def stage_budget(self, *, stage: int, tp: int = 1, pp: int = 1, replicas: int = 1, zero: int = 1,
                     layers: int | None = None) -> StageBudget:
        """Stage `stage` of a tp x pp pipeline whose weights `replicas` GPUs hold (data-parallel
        pipelines times CP ranks): layers as `split_layers` deals them unless given."""
        n = split_layers(self.model.num_layers, pp)[stage] if layers is None else layers
        first, last = stage == 0, stage == pp - 1
        return StageBudget(
            stage=stage, layers=n, first=first, last=last, tp=tp, replicas=replicas, zero=zero,
            states=self.model_state_bytes(layers=n, tp=tp, dp=replicas, zero=zero, first=first, last=last),
            grads=self.grad_bytes(layers=n, tp=tp, dp=replicas, zero=zero, first=first, last=last),
            capacity=self.capacity_bytes,
            activation_per_token=self.activation_bytes_per_token(layers=n, tp=tp, head=last),
            recomputed_per_token=self.activation_bytes_per_token(layers=n, tp=tp, head=last, recompute_layers=n),
            remat_per_token=self.recompute_transient_bytes_per_token(tp=tp, recompute_layers=n),
            mlp_recomputed_per_token=self.activation_bytes_per_token(layers=n, tp=tp, head=last, recompute_mlp=n),
            mlp_remat_per_token=self.recompute_transient_bytes_per_token(tp=tp, recompute_mlp=n),
            kv_per_token=self.kv_bytes(1, layers=n, tp=tp),  # a measured profile's K/V size too
            backward_work_per_token=self.backward_work_bytes_per_token(layers=n, tp=tp, head=last),
            rerun_work_per_token=self.backward_work_bytes_per_token(layers=n, tp=tp, head=last, rerun=True),
            backward_work_fixed=mem.head_backward_fixed_bytes(self.model, tp) if last else 0.0)

    def stage_budgets(self, *, tp: int = 1, pp: int = 1, replicas: int = 1, zero: int = 1) -> list[StageBudget]:
        """`stage_budget` of every stage of the pipeline."""
        return [self.stage_budget(stage=s, tp=tp, pp=pp, replicas=replicas, zero=zero) for s in range(pp)]

    def max_seq_len(self, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, zero: int = 1,
                    inflight: int | None = None, recompute: str = "none") -> int:
        """Longest sequence one pipeline of the scheme holds when every stage keeps `inflight`
        micro-batches of that length alive (default pp on the first stage, pp - s on stage s:
        hydraulis.txt B.1 MaxLen; skrull.txt A.1 BucketSize with pp = 1), at the recomputation
        level `recompute` (RECOMPUTE_LEVELS): with "full" every layer keeps only its input, with
        "mlp" every layer drops its MLP block's tensors (`mem.mlp_recompute_saved_bytes_per_token_layer`),
        and the backward of one micro-batch re-materialises one layer (or one MLP block) at a
        time, as the executor checkpoints and the simulator charges it
        (`recompute_transient_bytes_per_token`); every stage also holds the backward's working
        set of one micro-batch (`backward_work_bytes`: the loss's on the last stage, one
        layer's elsewhere). Under CP a micro-batch's tokens spread over the cp ranks, but each
        layer that runs its attention in backward without rerunning it (all but "full") keeps
        the K/V of the whole sequence that its all-gather assembled (`activation_bytes`);
        without CP, a micro-batch whose rows tp does not divide keeps a padded copy of each such
        layer's attention output (`attention_pad_bytes`; under full recomputation only the
        re-materialised layer's), counted for every micro-batch since its length is not known
        here."""
        assert recompute in RECOMPUTE_LEVELS, recompute
        full = recompute == "full"
        best = math.inf
        for b in self.stage_budgets(tp=tp, pp=pp, replicas=dp * cp, zero=zero):
            held = inflight if inflight is not None else pp - b.stage
            kept, remat = {"none": (b.activation_per_token, 0.0),
                           "mlp": (b.mlp_recomputed_per_token, b.mlp_remat_per_token),
                           "full": (b.recomputed_per_token, b.remat_per_token)}[recompute]
            # plus one backward's re-materialised layer and its working set (the loss's on the
            # last stage) while one micro-batch's backward runs
            work = b.backward_work_per_token if recompute == "none" else b.rerun_work_per_token
            per_token = (kept * held + remat + work) / cp
            if cp > 1 and not full:  # each layer keeps the K/V its all-gather assembled, whole
                per_token += held * b.kv_per_token
            elif cp <= 1 and tp > 1 and self.sequence_parallel:  # a row tp does not divide: its padded attention copy, in every kept layer
                # (only in the re-materialised one under full recomputation)
                per_token += (1 if full else held * b.layers) * self.model.q_dim * mem.BYTES_BF16 / tp
            free = b.free - b.backward_work_fixed  # the loss's block and weight gradient (last stage)
            best = min(best, free / per_token if free > 0 else 0)
        return int(best)

    def check_states_fit(self, *, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, zero: int = 1) -> None:
        """UserError when model states alone overflow a GPU of some stage (ZeRO shards them over
        the dp x cp ranks that hold a replica of the stage's weights)."""
        for b in self.stage_budgets(tp=tp, pp=pp, replicas=dp * cp, zero=zero):
            if b.free < 0:
                raise UserError(
                    f"{self.model.name} does not fit: stage {b.stage} needs {b.states / 2**30:.1f} GiB of model states per GPU"
                    f" (tp={tp}, pp={pp}, dp={dp}, cp={cp}, zero={zero}) but a GPU has {self.capacity_bytes / 2**30:.1f} GiB"
                    " usable; raise --tp/--pp or the ZeRO stage"
                )


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


def split_layers(num_layers: int, pp: int) -> list[int]:
    """Even split of layers over pp stages, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]
