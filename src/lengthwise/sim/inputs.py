"""What the simulator needs of each pipeline: its schedule, every action's duration and transfer
time, and its memory sizes — from a StepPlan and the cost model, or from raw forward times.

GPU placement (for choosing intra- or inter-node links): pipelines take GPUs in order; pipeline
p's stage s holds GPUs [offset_p + s*tp*cp, offset_p + (s+1)*tp*cp), node = gpu // gpus_per_node.
Context-parallel K/V exchange of SHARDED segments is paid inside the action (cm.cp_comm_time in
F and N, and once more in B: the executor keeps the gathered K/V from the forward and
reduce-scatters their gradients, the same volume as the all-gather); the point-to-point hand-off between stages is an edge delay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.cost.flops import chunk_work, work_key
from lengthwise.errors import UserError
from lengthwise.plan.ir import FORWARD, FORWARD_NOGRAD, Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.plan.schedules import SCHEDULE_NAMES, Dependencies, dependencies, make_schedule
from lengthwise.sim.memory import MemorySizes, SplitSequence, split_sequences

F, N, B = 0, 1, 2
_VECTORISED = ("forward_time", "backward_time", "activation_bytes")
"""CostModel methods _each evaluates for all chunks at once when cp = 1 (CostModel.works_time)."""


@dataclass(kw_only=True)
class PipelineInput:
    """One pipeline ready to simulate."""

    stages: list
    """Per-stage action lists."""
    chunks: list[Chunk]
    """Forward chunks (F and N index these)."""
    backward_chunks: list[Chunk] | None
    """Backward units when they differ from the chunks (SlimPack §4.1.2)."""
    dur: np.ndarray
    """float64 [stage, kind F/N/B, index] duration of each action, CP communication included."""
    comm: np.ndarray
    """float64 [stage, kind, index] the part of `dur` that is context-parallel communication."""
    send: np.ndarray
    """float64 [stage, kind, index] point-to-point time of the action's output to the next
    stage (F, N) or the previous one (B)."""
    sizes: MemorySizes
    """Memory sizes (bytes, or forward-time units in the direct mode)."""
    grad_sync: list[float]
    """[stage] data-parallel gradient reduction time."""
    extra_comm: float = 0.0
    """Pipeline communication charged after everything else (PipelinePlan.extra_comm_s)."""
    model_flops: float = 0.0
    """Forward + backward FLOPs of the pipeline's tokens, padding and recomputation excluded."""
    num_gpus: int = 1
    """GPUs of the pipeline (tp * cp * pp)."""
    deps: Dependencies | None = None
    """The chunks' slice dependencies when already derived (else the engine derives them)."""
    splits: list[SplitSequence] | None = None
    """split_sequences of the chunks when already derived (else the engine derives them)."""


def plan_inputs(plan: StepPlan, cm: CostModel) -> list[PipelineInput]:
    """PipelineInputs of every pipeline of a plan, GPUs assigned in pipeline order."""
    offsets = np.cumsum([0] + [p.num_gpus for p in plan.pipelines]).tolist()
    if offsets[-1] > plan.cluster.num_gpus:
        raise UserError(f"the plan's pipelines use {offsets[-1]} GPUs but cluster {plan.cluster.name} "
                        f"has {plan.cluster.num_gpus}: use a plan made for this cluster")
    shared: dict = {}  # stage-level costs that pipelines of one scheme share
    return [_PipelineCosts(plan, i, cm, offsets, shared).build() for i in range(len(plan.pipelines))]


class _PipelineCosts:
    """Cost tables of one pipeline; per (layers, head) stage kind the per-chunk costs are cached."""

    def __init__(self, plan: StepPlan, index: int, cm: CostModel, offsets: list[int], shared: dict):
        self.plan, self.pipe, self.cm, self.offsets, self.shared = plan, plan.pipelines[index], cm, offsets, shared
        self.offset, pipe = offsets[index], self.pipe
        self.layers = pipe.stage_layers(plan.model.num_layers)
        if len(self.layers) != pipe.pp or any(n < 0 for n in self.layers):
            raise UserError(f"layers_per_stage {self.layers} does not match pp={pipe.pp}")
        self.units = pipe.bwd_units
        self.deps = dependencies(pipe.chunks, pipe.backward_chunks)
        self.kw = {"tp": pipe.tp, "cp": pipe.cp}
        self._cache: dict = {}

    def node(self, gpu: int) -> int:
        return gpu // self.plan.cluster.gpus_per_node

    def stage_gpus(self, s: int) -> tuple[int, int]:
        width = self.pipe.tp * self.pipe.cp
        return self.offset + s * width, self.offset + (s + 1) * width - 1

    def link_inter(self, s: int) -> bool:
        """Whether the hand-off between stages s and s+1 crosses nodes."""
        return self.node(self.stage_gpus(s)[0]) != self.node(self.stage_gpus(s + 1)[1])

    def per_chunk(self, layers: int, head: bool) -> dict[str, np.ndarray]:
        key = (layers, head)
        if key not in self._cache:
            cm = self.cm
            self._cache[key] = {
                "fwd": self._each(cm.forward_time, self.pipe.chunks, layers=layers, head=head),
                "bwd": self._each(cm.backward_time, self.units, layers=layers, head=head),
                "act": self._each(cm.activation_bytes, self.pipe.chunks, layers=layers, head=head),
            }
        return self._cache[key]

    def _each(self, fn, chunks: list[Chunk], **kw) -> np.ndarray:
        """fn(chunk, **kw, tp, cp) of every chunk. Without CP a chunk's cost depends only on its
        ChunkWork (row tokens, attention pairs), so values are shared by every chunk of equal
        work across the plan's pipelines (padded rows, equal-length sequences)."""
        kw = {**kw, **self.kw}
        if self.pipe.cp > 1:
            return np.array([fn(c, **kw) for c in chunks])
        if getattr(fn, "__self__", None) is self.cm and fn.__name__ in _VECTORISED:
            return self._each_at_once(fn.__name__, chunks, kw)
        memo = self.shared.setdefault((fn.__name__, *sorted(kw.items())), {})
        out = np.empty(len(chunks))
        for i, c in enumerate(chunks):
            key = work_key(c)
            v = memo.get(key)
            if v is None:
                v = memo[key] = fn(c, **kw)
            out[i] = v
        return out

    def _works(self, chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray]:
        """(row tokens, attention pairs) of every chunk as float64 arrays (chunk_work's, cp = 1)."""
        key = ("works", id(chunks))
        if key not in self._cache:
            works = [(c.num_tokens, c.attention_pairs) if c.pad_to <= c.num_tokens or not c.segments
                     else (lambda w: (w.tokens, w.keys))(chunk_work(c)) for c in chunks]
            arr = np.array(works, dtype=np.float64).reshape(len(chunks), 2)
            self._cache[key] = (arr[:, 0], arr[:, 1], chunks)  # chunks kept: the id stays theirs
        tokens, keys, _ = self._cache[key]
        return tokens, keys

    def _each_at_once(self, name: str, chunks: list[Chunk], kw: dict) -> np.ndarray:
        """_each for cp = 1 by the cost model's elementwise forms (the same floats, in one pass)."""
        tokens, keys = self._works(chunks)
        cm, layers, tp, head = self.cm, kw["layers"], kw["tp"], kw.get("head", False)
        if name == "activation_bytes":
            return cm.activation_bytes_per_token(layers=layers, tp=tp, head=head) * tokens
        out = cm.works_time(tokens, keys, layers=layers, tp=tp, head=head, backward=name == "backward_time")
        return out + 0.0 if name == "backward_time" else out  # backward_time adds its (zero) recompute

    def build(self) -> PipelineInput:
        pipe = self.pipe
        S, C, U = pipe.pp, len(pipe.chunks), len(self.units)
        shape = (S, 3, max(C, U, 1))
        dur, comm, send = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        recompute = _recompute_table(pipe)
        for s in range(S):
            self._stage_times(s, recompute[s], dur[s], comm[s])
            if s + 1 < S:
                fwd_send, bwd_send = self._p2p(self.link_inter(s))
                send[s, F, :C] = send[s, N, :C] = fwd_send
                send[s + 1, B, :U] = bwd_send
        return PipelineInput(stages=pipe.stages, chunks=pipe.chunks, backward_chunks=pipe.backward_chunks,
                             dur=dur, comm=comm, send=send, sizes=self._sizes(recompute),
                             grad_sync=self._grad_sync(), extra_comm=pipe.extra_comm_s,
                             model_flops=self._model_flops(), num_gpus=pipe.num_gpus, deps=self.deps,
                             splits=self.splits)

    def _p2p(self, inter: bool) -> tuple[list[float], list[float]]:
        """Hand-off times of every chunk and unit over an intra- or inter-node link."""
        if ("p2p", inter) not in self._cache:
            cm, kw = self.cm, self.kw
            self._cache["p2p", inter] = (
                [cm.p2p_time(cm.boundary_bytes(c, **kw), inter_node=inter) for c in self.pipe.chunks],
                [cm.p2p_time(cm.boundary_bytes(u, **kw), inter_node=inter) for u in self.units])
        return self._cache["p2p", inter]

    def _stage_times(self, s: int, recompute: list[int], dur: np.ndarray, comm: np.ndarray) -> None:
        L, head, C, U = self.layers[s], s == self.pipe.pp - 1, len(self.pipe.chunks), len(self.units)
        base = self.per_chunk(L, head)
        bwd = base["bwd"].copy()
        for u in range(U if any(recompute) else 0):
            r = max((recompute[c] for c in self.deps.bwd_needs[u]), default=0)
            if r:  # backward re-runs the forward of r layers (InfiniPipe checkpointing)
                bwd[u] = self.cm.backward_time(self.units[u], layers=L, head=head, recompute_layers=r, **self.kw)
        cp_f = self._cp_times(s, L, self.pipe.chunks)
        cp_b = self._cp_times(s, L, self.units)   # backward reduce-scatters the K/V gradients
        dur[F, :C] = dur[N, :C] = base["fwd"] + cp_f
        dur[B, :U] = bwd + cp_b
        comm[F, :C] = comm[N, :C] = cp_f
        comm[B, :U] = cp_b

    def _cp_times(self, s: int, layers: int, chunks: list[Chunk]) -> np.ndarray:
        if self.pipe.cp <= 1:
            return np.zeros(len(chunks))
        lo, hi = self.stage_gpus(s)
        inter = self.node(lo) != self.node(hi)
        return np.array([self.cm.cp_comm_time(c, layers=layers, inter_node=inter, **self.kw) for c in chunks])

    def _sizes(self, recompute: list[list[int]]) -> MemorySizes:
        pipe, cm, S = self.pipe, self.cm, self.pipe.pp
        dp, zero = len(self.plan.pipelines) * pipe.cp, self.plan.zero  # ZeRO shards over dp x cp
        splits = self.splits = split_sequences(pipe.chunks, self.units)
        act, extra, transient, kv, kv_grad, state, work = [], [], [], [], [], [], []
        for s in range(S):
            L, head = self.layers[s], s == S - 1
            full = self.per_chunk(L, head)["act"]
            kept = [cm.activation_bytes(c, layers=L, head=head, recompute_layers=r, **self.kw) if r else full[i]
                    for i, (c, r) in enumerate(zip(pipe.chunks, recompute[s]))]
            act.append(list(kept))
            extra.append([cm.recompute_transient_bytes(c, recompute_layers=r, **self.kw)
                          for c, r in zip(pipe.chunks, recompute[s])])
            # on the last stage each backward unit's loss backward makes the bf16 logit gradient
            work.append([cm.head_backward_bytes(u, **self.kw) if head else 0.0 for u in self.units])
            nograd = {a.chunk for a in pipe.stages[s] if a.kind == FORWARD_NOGRAD}
            transient.append([cm.activation_bytes(c, layers=min(L, 1), **self.kw) if i in nograd else 0.0
                              for i, c in enumerate(pipe.chunks)])
            sizes = {q.seq_id: cm.kv_bytes(q.context, layers=L, **self.kw) for q in splits}
            kv.append(sizes)
            kv_grad.append(dict(sizes))  # K/V-gradient buffers are the size of the K/V they update
            state.append(self._shared(cm.stage_budget, stage=s, tp=pipe.tp, pp=S, replicas=dp, zero=zero,
                                      layers=L).states)
        return MemorySizes(state=state, activation=act, recompute_extra=extra, nograd_transient=transient,
                           kv=kv, kv_grad=kv_grad, backward_work=work)

    def _grad_sync(self) -> list[float]:
        # every CP rank holds the stage's weights too: gradients reduce over dp x cp
        dp = len(self.plan.pipelines) * self.pipe.cp
        if dp <= 1:
            return [0.0] * self.pipe.pp
        return [self._shared(self.cm.grad_sync_time, layers=L, tp=self.pipe.tp, dp=dp, zero=self.plan.zero,
                             inter_node=self.dp_inter(s), first=s == 0, last=s == self.pipe.pp - 1)
                for s, L in enumerate(self.layers)]

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
        bare = lambda c: Chunk(c.segments) if c.pad_to else c
        memo = self.shared.setdefault("model_flops", {})  # by (tokens, pairs): padding excluded
        sums = []
        for units, fn in ((self.pipe.chunks, cm.forward_flops), (self.units, cm.backward_flops)):
            values = []
            for c in units:
                key = (fn.__name__, c.num_tokens, c.attention_pairs)
                v = memo.get(key)
                if v is None:
                    v = memo[key] = fn(bare(c), layers=L, head=True)
                values.append(v)
            sums.append(sum(values))
        return sums[0] + sums[1]


def _recompute_table(pipe: PipelinePlan) -> list[list[int]]:
    """[stage][chunk] layers the chunk's F recomputes on that stage."""
    table = [[0] * len(pipe.chunks) for _ in range(pipe.pp)]
    for s, acts in enumerate(pipe.stages):
        for a in acts:
            if a.kind == FORWARD and 0 <= a.chunk < len(pipe.chunks):
                table[s][a.chunk] = a.recompute_layers
    return table


def direct_input(fwd: list[float], stages: int, *, bwd_ratio: float = 2.0, schedule: str = "1f1b",
                 groups: list[tuple[int, int]] | None = None, k: int | None = None) -> PipelineInput:
    """A pipeline from raw per-chunk forward times (any unit), the same on every stage.

    `groups`: inclusive index ranges (first, last) of chunks that are consecutive slices of one
    sequence. Backward takes `bwd_ratio` times the forward; activations are counted in forward-
    time units (time proportional to tokens, as chunkflow §3 assumes); no communication."""
    if schedule not in SCHEDULE_NAMES:
        raise UserError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULE_NAMES)}")
    if stages < 1 or not fwd or min(fwd) < 0:
        raise UserError(f"need stages >= 1 and non-negative forward times, got stages={stages}, fwd={fwd}")
    chunks = _direct_chunks(len(fwd), groups or [])
    plan_stages = make_schedule(schedule, chunks, stages, k)
    times = np.asarray(fwd, dtype=np.float64)
    shape = (stages, 3, len(fwd))
    dur = np.zeros(shape)
    dur[:, F, :] = dur[:, N, :] = times
    dur[:, B, :] = bwd_ratio * times
    zeros = [[0.0] * len(fwd) for _ in range(stages)]
    sizes = MemorySizes(state=[0.0] * stages, activation=[list(fwd) for _ in range(stages)],
                        recompute_extra=zeros, nograd_transient=zeros,
                        kv=[{} for _ in range(stages)], kv_grad=[{} for _ in range(stages)])
    return PipelineInput(stages=plan_stages, chunks=chunks, backward_chunks=None, dur=dur,
                         comm=np.zeros(shape), send=np.zeros(shape), sizes=sizes, grad_sync=[0.0] * stages,
                         num_gpus=stages)


def _direct_chunks(n: int, groups: list[tuple[int, int]]) -> list[Chunk]:
    """One one-token segment per chunk; a group's chunks are slices of the group's first chunk."""
    seq_of = list(range(n))
    for first, last in groups:
        if not 0 <= first < last < n:
            raise UserError(f"group {first}-{last} must satisfy 0 <= first < last < {n} (chunks given)")
        if any(seq_of[i] != i for i in range(first, last + 1)):
            raise UserError(f"group {first}-{last} overlaps another group")
        for i in range(first, last + 1):
            seq_of[i] = first
    return [Chunk((Segment(seq_of[i], i - seq_of[i], i - seq_of[i] + 1),)) for i in range(n)]
