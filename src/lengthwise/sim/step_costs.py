"""What a pipeline's step costs beyond its actions: the data-parallel gradient reduction (or,
for heterogeneous pipelines, the exchange with owners), the gradient norm and optimizer step,
and the model FLOPs its tokens need; with the plan-wide facts these share (replicas, world size,
holders), each computed once per plan in the `shared` dict.
"""

from __future__ import annotations

from lengthwise.cost import CostModel
from lengthwise.cost.flops import HEAD_RECOMPUTE, ChunkWork, head_forward_flops, layer_forward_flops
from lengthwise.plan.ir import Chunk


class _StepCosts:
    """The step-level part of `_PipelineCosts` (sim/inputs.py); uses `node` (sim/action_times.py)."""

    def _holders(self):
        """How many GPUs hold each element of the plan (`CostModel.hetero_holders`), once per plan."""
        if "holders" not in self.shared:
            self.shared["holders"] = self.cm.hetero_holders([(q.tp, q.pp, q.cp) for q in self.plan.pipelines])
        return self.shared["holders"]

    def _heterogeneous(self) -> bool:
        if "heterogeneous" not in self.shared:  # once per plan, not once per pipeline (O(pipelines) each)
            self.shared["heterogeneous"] = heterogeneous(self.plan)
        return self.shared["heterogeneous"]

    def _grad_sync(self) -> list[float]:
        if self._heterogeneous():
            # pipelines with other tp x pp x cp: the executor's exchange with owners among each
            # element's holders (runtime/parallel/hetero.py), no all-reduce
            world = self._world()
            inter = self.node(0) != self.node(world - 1)
            return [self._shared(self.cm.exchange_time, layers=L, tp=self.pipe.tp, holders=self._holders(),
                                 inter_node=inter, first=s == 0, last=s == self.pipe.pp - 1)
                    for s, L in enumerate(self.layers)]
        # every CP rank holds the stage's weights too: gradients reduce over dp x cp
        dp = self._replicas()
        if dp <= 1:
            return [0.0] * self.pipe.pp
        key = ("grad_sync", tuple(self.layers), self.pipe.tp, self.pipe.cp)  # the rest is the plan's
        if key not in self.shared:
            self.shared[key] = [self._shared(self.cm.grad_sync_time, layers=L, tp=self.pipe.tp, dp=dp,
                                             zero=self.plan.zero, inter_node=self.dp_inter(s), first=s == 0,
                                             last=s == self.pipe.pp - 1)
                                for s, L in enumerate(self.layers)]
        return list(self.shared[key])

    def _step_end(self) -> list[float] | None:
        """Per stage, the gradient norm and optimizer step after its reduction (a profile's
        step terms; None without: the analytic model's step ends at the reduction)."""
        if self.cm.profile is None or self.cm.profile.step is None:
            return None
        key = ("step_end", tuple(self.layers), self.pipe.tp)  # the rest is the plan's
        if key not in self.shared:
            dp = self._replicas()
            self.shared[key] = [self._shared(self.cm.step_end_time, layers=L, tp=self.pipe.tp, dp=dp,
                                             zero=self.plan.zero, first=s == 0, last=s == self.pipe.pp - 1)
                                for s, L in enumerate(self.layers)]
        return list(self.shared[key])

    def _replicas(self) -> int:
        """Every pipeline's CP ranks summed (the ranks that hold a stage's weights), once per plan
        (summed per pipeline it made building a plan's inputs quadratic in its pipelines)."""
        if "replicas" not in self.shared:
            self.shared["replicas"] = sum(p.cp for p in self.plan.pipelines)
        return self.shared["replicas"]

    def _world(self) -> int:
        """GPUs of every pipeline, once per plan."""
        if "world" not in self.shared:
            self.shared["world"] = sum(q.num_gpus for q in self.plan.pipelines)
        return self.shared["world"]

    def _shared(self, fn, **kw) -> float:
        key = (fn.__name__, *sorted(kw.items()))
        if key not in self.shared:
            self.shared[key] = fn(**kw)
        return self.shared[key]

    def dp_inter(self, s: int) -> bool:
        """Whether stage s's data-parallel group (stage s of every pipeline) spans nodes."""
        if ("dp_inter", s) not in self.shared:
            firsts = [off + s * q.tp * q.cp for off, q in zip(self.offsets, self.plan.pipelines) if s < q.pp]
            self.shared["dp_inter", s] = len({self.node(g) for g in firsts}) > 1
        return self.shared["dp_inter", s]

    def _model_flops(self) -> float:
        L, cm = self.plan.model.num_layers, self.cm
        if (self.works is not None and type(cm).forward_flops is CostModel.forward_flops
                and type(cm).backward_flops is CostModel.backward_flops):
            # CostModel.forward_flops / backward_flops (whole model, head, padding excluded)
            # elementwise over the chunks: the same operations in the same order, then summed
            # one by one as below
            if self.model_flops is not None:  # computed for every pipeline at once (_batched_model_flops)
                return self.model_flops
            fw, bw = self.works
            lin, attn = layer_forward_flops(cm.model, ChunkWork(fw.bare_tokens, fw.bare_pairs))
            fwd = L * (lin + attn) + head_forward_flops(cm.model, fw.bare_tokens)
            lin, attn = layer_forward_flops(cm.model, ChunkWork(bw.bare_tokens, bw.bare_pairs))
            bwd = (L * (lin * cm.bwd_linear_ratio + attn * cm.bwd_attn_ratio)
                   + head_forward_flops(cm.model, bw.bare_tokens) * (cm.bwd_linear_ratio + HEAD_RECOMPUTE))
            return sum(fwd.tolist()) + sum(bwd.tolist())
        bare = lambda c: Chunk(c.segments) if c.pad_to else c
        memo = self.shared.setdefault("model_flops", {})  # by (tokens, pairs): padding excluded
        sums = []
        for k, (units, fn) in enumerate(((self.pipe.chunks, cm.forward_flops), (self.units, cm.backward_flops))):
            values = []
            works = zip(self.works[k].tokens, self.works[k].pairs) if self.works is not None else \
                ((c.num_tokens, c.attention_pairs) for c in units)
            for c, (tokens, pairs) in zip(units, works):
                key = (fn.__name__, tokens, pairs)
                v = memo.get(key)
                if v is None:
                    v = memo[key] = fn(bare(c), layers=L, head=True)
                values.append(v)
            sums.append(sum(values))
        return sums[0] + sums[1]


def heterogeneous(plan) -> bool:
    """Whether the plan's pipelines differ in tp, pp or cp (Hydraulis): the executor then
    exchanges gradients and weights with owners among each element's holders instead of
    all-reducing."""
    return len({(q.tp, q.pp, q.cp) for q in plan.pipelines}) > 1
