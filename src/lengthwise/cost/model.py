"""CostModel: FLOPs, seconds and bytes of chunks on stages, for one model on one cluster.

Everything a planner or the simulator asks about cost goes through this one object, so an
analytic model and a measured profile are interchangeable.

This module holds the object, its FLOPs and its limits (`stage_budget`, `max_seq_len`); its
seconds, communication and bytes are mixins in `model_time.py`, `model_comm.py` and
`model_memory.py`, so that each concern reads on its own.

    cm = CostModel(MODEL_PRESETS["qwen2.5-7b"], cluster_preset("h100", 32))
    cm.forward_time(chunk, layers=7, tp=1)          # seconds on one stage of 7 layers
    cm.max_seq_len(tp=1, pp=4)                       # longest sequence a pipeline holds
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import lengthwise.cost.memory as mem
from lengthwise.cost.comm import CommModel
from lengthwise.cost.flops import HEAD_RECOMPUTE, chunk_work, head_forward_flops, layer_forward_flops
from lengthwise.cost.model_comm import CommCosts
from lengthwise.cost.model_memory import MemoryCosts
from lengthwise.cost.model_time import ChunkTimes
from lengthwise.cost.time import Profile, Throughput
from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk
from lengthwise.specs import ClusterSpec, ModelSpec

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


@dataclass(kw_only=True)
class CostModel(ChunkTimes, CommCosts, MemoryCosts):
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
    swiglu_keeps_product: bool = False
    """What a layer's MLP keeps for backward. False, the executor: the SwiGLU's gate and up, its
    product made again in backward (`runtime/layer_ops.SwiGLUDown`). True, Megatron-LM's (the
    papers' systems): the product too, one more [tokens, ffn / tp] bf16 tensor a layer (its
    down projection saves its input). Like the two settings above, for describing another
    system's kept activations in the simulator (`benchmarks/chunkflow_table5.py`)."""
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


def split_layers(num_layers: int, pp: int) -> list[int]:
    """Even split of layers over pp stages, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]
