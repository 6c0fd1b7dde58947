"""CostModel's communication: the tensor-parallel collectives of a layer and of the model's
ends, the bytes a stage hands to the next, data-parallel gradient reduction, a heterogeneous
plan's exchange, and context parallelism's K/V all-gather and gradient reduce-scatter.

A mixin of `CostModel` (`cost/model.py`), its own module so that the model file stays one
screenful per concern; it reads the model's `model`, `comm`, `sequence_parallel` and calls its
memory sizes (`kv_bytes`, `hetero_owned`). The collective counts per layer are here too, since
the simulator (`sim/rank.py`) counts the executor's collectives from them.
"""

from __future__ import annotations

import lengthwise.cost.memory as mem
from lengthwise.cost.flops import rank_works
from lengthwise.cost.model_memory import ExchangeHolders
from lengthwise.plan.ir import SHARDED, Chunk

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


class CommCosts:
    """Communication seconds and bytes of `CostModel` (mixed into it; not used alone)."""

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
        return self._cp_kv_collectives("all_gather", chunk, layers=layers, tp=tp, cp=cp, inter_node=inter_node)

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
        return self._cp_kv_collectives("reduce_scatter", chunk, layers=layers, tp=tp, cp=cp, inter_node=inter_node)

    def _cp_kv_collectives(self, kind: str, chunk: Chunk, *, layers: int, tp: int, cp: int,
                           inter_node: bool) -> float:
        """`layers` collectives of `kind` over the CP group on `cp_kv_layer_bytes`; 0 without CP
        or sharded segments."""
        if cp <= 1:
            return 0.0
        nbytes = self.cp_kv_layer_bytes(chunk, tp=tp)
        if nbytes == 0:
            return 0.0
        return layers * self.collective_time(kind, nbytes, ranks=cp, inter_node=inter_node)
