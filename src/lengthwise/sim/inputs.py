"""What the simulator needs of each pipeline: its schedule, every action's duration and transfer
time, and its memory sizes — from a StepPlan and the cost model, or from raw forward times.

Which module holds what:
    sim/pipeline_input.py  PipelineInput, what the engine takes of one pipeline
    sim/structure.py     slice dependencies, split sequences and cells read off the segments
    sim/plan_costs.py    per-chunk cost tables batched over every pipeline of the plan
    sim/cell_costs.py    memory sizes by cell batched over every pipeline of the plan
    sim/cell_inputs.py   the PipelineInputs of many pipelines built together
    sim/action_times.py  each action's duration, CP communication and hand-off time
    sim/memory_sizes.py  memory sizes (states, activations, working sets, K/V)
    sim/step_costs.py    gradient reduction, optimizer step, model FLOPs
`_PipelineCosts` below combines the last three for one pipeline.

Context-parallel K/V exchange of SHARDED segments is paid inside the action: the all-gather
in F and N (cm.cp_comm_time), the reduce-scatter of the K/V gradients in B
(cm.cp_grad_comm_time: the executor keeps the gathered K/V from the forward); the
point-to-point hand-off between stages is an edge delay.
"""

from __future__ import annotations

import operator

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import FORWARD, Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.plan.schedules import SCHEDULE_NAMES, dependencies, make_schedule
from lengthwise.sim.action_times import B, F, N, _ActionTimes
from lengthwise.sim.cell_costs import batched_cell_sizes
from lengthwise.sim.cell_inputs import celled_inputs
from lengthwise.sim.memory import MemorySizes
from lengthwise.sim.memory_sizes import _MemorySizing
from lengthwise.sim.pipeline_input import PipelineInput
from lengthwise.sim.plan_costs import (_batched_model_flops, _batched_row_costs, _batched_tables, _plan_works,
                                       _Works)
from lengthwise.sim.step_costs import _StepCosts, heterogeneous
from lengthwise.sim.structure import SliceStructure, derived_structures, segment_cells

__all__ = ["PipelineInput", "SliceStructure", "plan_inputs", "direct_input", "derived_structures", "segment_cells",
           "heterogeneous"]


def plan_inputs(plan: StepPlan, cm: CostModel,
                known: list[SliceStructure | None] | None = None) -> list[PipelineInput]:
    """PipelineInputs of every pipeline of a plan, GPUs assigned in pipeline order. `known`: per
    pipeline its SliceStructure where the caller has it (None: derived from the segments)."""
    offsets = np.cumsum([0] + [p.num_gpus for p in plan.pipelines]).tolist()
    if offsets[-1] > plan.cluster.num_gpus:
        raise UserError(f"the plan's pipelines use {offsets[-1]} GPUs but cluster {plan.cluster.name} "
                        f"has {plan.cluster.num_gpus}: use a plan made for this cluster")
    known = known or [None] * len(plan.pipelines)
    if len(known) != len(plan.pipelines):
        raise ValueError(f"known has {len(known)} entries for {len(plan.pipelines)} pipelines")
    shared: dict = {}  # stage-level costs that pipelines of one scheme share
    known = [k if k is not None else d for k, d in zip(known, derived_structures(plan.pipelines, known))]
    works = _plan_works(plan, known)
    tables = _batched_tables(plan, cm, works)
    _batched_row_costs(plan, cm, works, tables)
    flops = _batched_model_flops(cm, works)
    batched_cell_sizes(plan, cm, known, tables)
    costs = lambda i: _PipelineCosts(plan, i, cm, offsets, shared, works[i], tables[i], known[i], flops[i])
    together = celled_inputs(plan, cm, offsets, known, works, tables, flops, costs)
    return [together[i] if i in together else costs(i).build() for i in range(len(plan.pipelines))]


class _PipelineCosts(_ActionTimes, _MemorySizing, _StepCosts):
    """Cost tables of one pipeline; per (layers, head, embed) stage kind the per-chunk costs are
    cached (head: the last stage's LM head, embed: the first stage's embedding). Its parts live
    by concern in sim/action_times.py, sim/memory_sizes.py and sim/step_costs.py."""

    def __init__(self, plan: StepPlan, index: int, cm: CostModel, offsets: list[int], shared: dict,
                 works: tuple[_Works, _Works] | None = None, tables: dict | None = None,
                 known: SliceStructure | None = None, flops: float | None = None):
        self.plan, self.pipe, self.cm, self.offsets, self.shared = plan, plan.pipelines[index], cm, offsets, shared
        self.works = works  # (forward chunks, backward units), _plan_works
        self.offset, pipe = offsets[index], self.pipe
        self.layers = pipe.stage_layers(plan.model.num_layers)
        if len(self.layers) != pipe.pp or any(n < 0 for n in self.layers):
            raise UserError(f"layers_per_stage {self.layers} does not match pp={pipe.pp}")
        self.units = pipe.bwd_units
        self.known = known
        self.model_flops = flops
        self.deps = known.deps if known is not None else dependencies(pipe.chunks, pipe.backward_chunks)
        self.kw = {"tp": pipe.tp, "cp": pipe.cp}
        self._cache: dict = dict(tables or {})  # per_chunk tables batched over the plan (_batched_tables)

    def build(self) -> PipelineInput:
        pipe = self.pipe
        S, C, U = pipe.pp, len(pipe.chunks), len(self.units)
        shape = (S, 3, max(C, U, 1))
        dur, comm, send = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        recompute, mlp = _recompute_table(pipe)
        for s in range(S):
            self._stage_times(s, recompute[s], mlp[s], dur[s], comm[s])
            if s + 1 < S:
                fwd_send, bwd_send = self._p2p(self.link_inter(s))
                send[s, F, :C] = send[s, N, :C] = fwd_send
                send[s + 1, B, :U] = bwd_send
        return PipelineInput(stages=pipe.stages, chunks=pipe.chunks, backward_chunks=pipe.backward_chunks,
                             dur=dur, comm=comm, send=send, sizes=self._sizes(recompute, mlp),
                             grad_sync=self._grad_sync(), step_end=self._step_end(), extra_comm=pipe.extra_comm_s,
                             model_flops=self._model_flops(), num_gpus=pipe.num_gpus, deps=self.deps,
                             splits=self.splits)


_RECOMPUTE = operator.attrgetter("recompute_layers")
_RECOMPUTE_MLP = operator.attrgetter("recompute_mlp")
_KIND = operator.attrgetter("kind")


def _recompute_table(pipe: PipelinePlan) -> tuple[list[list[int]], list[list[int]]]:
    """([stage][chunk] layers the chunk's F recomputes whole on that stage, [stage][chunk] layers
    whose MLP block it recomputes)."""
    table = [[0] * len(pipe.chunks) for _ in range(pipe.pp)]
    mlp = [[0] * len(pipe.chunks) for _ in range(pipe.pp)]
    for s, acts in enumerate(pipe.stages):
        if not any(map(_RECOMPUTE, acts)) and not any(map(_RECOMPUTE_MLP, acts)):  # (scans at C speed) zeros
            continue
        for a in acts:
            if a.kind == FORWARD and 0 <= a.chunk < len(pipe.chunks):
                table[s][a.chunk] = a.recompute_layers
                mlp[s][a.chunk] = a.recompute_mlp
    return table, mlp


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
