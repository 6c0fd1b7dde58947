"""CostModel's seconds of chunk actions on one stage: forward, backward and what a backward
reruns under recomputation, from a measured profile where it has the scheme and from the
analytic curve elsewhere, for one chunk (`forward_time`) or many rows at once (`works_time`),
and the step's end (`step_end_time`).

A mixin of `CostModel` (`cost/model.py`), its own module so that the model file stays one
screenful per concern; it reads the model's `model`, `cluster`, `profile`, `throughput` and
ratios, and prices the tensor-parallel collectives through `cost/model_comm.py`.
"""

from __future__ import annotations

import numpy as np

import lengthwise.cost.memory as mem
from lengthwise.cost.flops import (
    HEAD_RECOMPUTE,
    ChunkWork,
    down_proj_flops,
    head_forward_flops,
    layer_forward_flops,
    matmul_params_per_layer,
    mlp_recompute_flops,
    rank_works,
    replicated_kv_flops,
)
from lengthwise.cost.model_comm import SP_MLP_RECOMPUTE_ALL_GATHERS
from lengthwise.cost.time import layer_seconds
from lengthwise.plan.ir import Chunk


class ChunkTimes:
    """Seconds of chunk actions of `CostModel` (mixed into it; not used alone)."""

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
