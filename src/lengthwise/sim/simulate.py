"""Simulate one training step: timeline, bubbles, imbalance, memory (slimpack.txt §4.3).

    from lengthwise.sim import simulate_plan, simulate_times
    result = simulate_plan(plan, CostModel(model=plan.model, cluster=plan.cluster))
    result.step_time_s, result.bubble_ratio, result.peak_memory
    simulate_times([4, 2, 1, 1], stages=4).makespan        # chunkflow figure 2: 56.0

Choices, stated once:

- The bubble ratio is chunkflow eq. 1: idle time over total time, summed over every stage of
  every pipeline, where a stage's total is the step's compute makespan (the last action's end
  over all pipelines; waiting for a slower data-parallel replica counts as idle). Re-forward time
  (the second forward of a chunk that ran N) counts as busy, so `reforward` is reported apart.
- Gradient reduction: stage s of all pipelines reduces its gradients once its last backward has
  finished on every replica; it overlaps the backwards still running on other stages (in 1F1B
  stage 0 finishes last, so mostly stage 0's reduction is exposed). Pipelines with different
  pp are not aligned by stage, so then every reduction starts after the last backward anywhere.
  A heterogeneous plan (pipelines differing in tp, pp or cp) reduces nothing: its stages pay
  the executor's exchange with owners among each element's holders instead (sim/inputs.py,
  `CostModel.exchange_time`), at the same moment. `extra_comm_s` of a pipeline is added after.
- Point-to-point transfers delay the receiver and do not occupy either stage.
- With a profile's step terms (cost/time.py): each action also pays the host's per-chunk
  overhead, the first stage's actions the embedding, and each stage, after its gradient
  reduction, the gradient norm and optimizer step over its parameters (`step_end_s`; the
  step ends when the last stage's optimizer does). The analytic model has none of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.plan.ir import StepPlan
from lengthwise.plan.schedules import dependencies
from lengthwise.sim.dag import TaskArrays, build_pipelines, concatenate, evaluate
from lengthwise.sim.inputs import PipelineInput, SliceStructure, direct_input, plan_inputs
from lengthwise.sim.memory import MemoryCurves, replay, split_sequences
from lengthwise.sim.plan_memory import plan_memory_events


@dataclass(kw_only=True)
class Timeline:
    """Every task's place in time, for pictures and tests (not part of the JSON)."""

    tasks: TaskArrays
    start: np.ndarray
    """float64 [T] start of each task."""
    finish: np.ndarray
    """float64 [T] end of each task."""
    comm: np.ndarray
    """float64 [T] context-parallel communication inside each task (at its end)."""
    send: np.ndarray
    """float64 [T] point-to-point transfer after each task to the neighbouring stage."""
    stage_offsets: list[int]
    """Global stage id of each pipeline's stage 0 (plus the total at the end)."""
    sync_start: np.ndarray
    """float64 [G] start of each global stage's gradient reduction."""
    sync_end: np.ndarray
    """float64 [G] its end."""
    memory: MemoryCurves
    """Memory of every global stage along the timeline."""


@dataclass(kw_only=True)
class SimResult:
    """Metrics of one simulated step. Times in `time_unit`, memory in `memory_unit`."""

    time_unit: str
    """"s" for plans, "units" in the direct mode."""
    memory_unit: str
    """"bytes" for plans, "fwd-time units" in the direct mode."""
    makespan: float
    """End of the last compute action over all pipelines."""
    step_time_s: float
    """Makespan plus exposed gradient reduction, gradient norm and optimizer step (a profile's
    step terms, cost/time.py) and extra pipeline communication."""
    step_end_s: float = 0.0
    """The part of step_time_s that the gradient norm and the optimizer step add at the end
    (0 without a profile's step terms)."""
    bubble_ratio: float
    """chunkflow eq. 1 over all stages: idle / (stages * makespan)."""
    reforward_counted_as_busy: bool = True
    """Re-forward time (ChunkFlow's second forward) is busy time in bubble_ratio."""
    busy: list[list[float]]
    """[pipeline][stage] time running actions."""
    idle: list[list[float]]
    """[pipeline][stage] makespan minus busy."""
    reforward: list[list[float]]
    """[pipeline][stage] time spent in second forwards."""
    grad_sync: list[list[float]]
    """[pipeline][stage] gradient reduction time."""
    pipeline_makespan: list[float]
    """[pipeline] end of its last compute action."""
    pipeline_bubble_ratio: list[float]
    """[pipeline] eq. 1 over its own stages and its own makespan."""
    dp_imbalance: float | None
    """Slowest over fastest pipeline makespan (1.0 is balanced; None when one is empty)."""
    dp_imbalance_spread: float
    """(slowest - fastest) / slowest pipeline makespan (hydraulis §8.4)."""
    peak_memory: list[list[float]]
    """[pipeline][stage] highest memory held, model states included."""
    capacity_bytes: float | None = None
    """Usable memory of one GPU; None in the direct mode."""
    fits: bool | None = None
    """Every stage's peak within capacity_bytes; None in the direct mode."""
    num_gpus: int = 0
    """GPUs of all pipelines."""
    tokens: int = 0
    """Tokens of the global batch."""
    tokens_per_s: float | None = None
    """tokens / step_time_s."""
    model_flops: float = 0.0
    """Forward + backward FLOPs of the batch (no padding, no recomputation)."""
    mfu: float | None = None
    """model_flops / (step_time_s * num_gpus * peak FLOP/s)."""
    time_source: str | None = None
    """Where the chunk times came from (CostModel.time_source: a measured profile or the
    built-in curve, and the hardware it was measured on); None in the direct mode."""
    timeline: Timeline | None = field(default=None, repr=False)
    """Per-task detail (dropped from to_dict)."""

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "timeline"}


def simulate_plan(plan: StepPlan, cm: CostModel, known: list[SliceStructure | None] | None = None) -> SimResult:
    """Simulate one step of a plan with the cost model's times, transfers and memory. `known`:
    per pipeline the SliceStructure its planner already holds (None where not; inputs.py)."""
    result = simulate_inputs(plan_inputs(plan, cm, known), time_unit="s", memory_unit="bytes")
    result.capacity_bytes = cm.capacity_bytes
    result.time_source = cm.time_source()["text"]
    result.fits = all(p <= cm.capacity_bytes for row in result.peak_memory for p in row)
    result.tokens = sum(plan.lengths)
    result.tokens_per_s = result.tokens / result.step_time_s if result.step_time_s > 0 else None
    if result.step_time_s > 0:
        result.mfu = result.model_flops / (result.step_time_s * result.num_gpus * plan.cluster.peak_tflops * 1e12)
    return result


def simulate_times(fwd: list[float], stages: int, bwd_ratio: float = 2.0, schedule: str = "1f1b",
                   groups: list[tuple[int, int]] | None = None, k: int | None = None) -> SimResult:
    """Direct mode: one pipeline from per-chunk forward times in any unit (chunkflow §3 style).

    `groups` lists inclusive (first, last) chunk ranges that are slices of one sequence."""
    inp = direct_input(fwd, stages, bwd_ratio=bwd_ratio, schedule=schedule, groups=groups, k=k)
    # raw chunk times carry no token counts: `tokens` stays 0 rather than counting chunks
    return simulate_inputs([inp], time_unit="units", memory_unit="fwd-time units")


def simulate_inputs(inputs: list[PipelineInput], *, time_unit: str, memory_unit: str) -> SimResult:
    """The engine: build the DAG of every pipeline, time it, replay memory, summarise."""
    all_deps = [p.deps or dependencies(p.chunks, p.backward_chunks) for p in inputs]
    pipes = build_pipelines([(p.stages, p.chunks, p.backward_chunks, d) for p, d in zip(inputs, all_deps)])
    tasks = concatenate(pipes)
    dur, comm, send = _task_tables(inputs, tasks)
    start, finish = evaluate(tasks, dur, send)
    stage_offsets = np.cumsum([0] + [len(p.stages) for p in inputs]).tolist()
    gstage = np.asarray(stage_offsets[:-1], dtype=np.int64)[tasks.pipeline] + tasks.stage
    G, P = stage_offsets[-1], len(inputs)
    busy = np.bincount(gstage, weights=dur, minlength=G)
    refwd = np.bincount(gstage, weights=dur * tasks.reforward, minlength=G)
    stage_end = np.zeros(G)
    np.maximum.at(stage_end, gstage, finish)
    pipe_end = np.zeros(P)
    np.maximum.at(pipe_end, tasks.pipeline, finish)
    sync = np.concatenate([np.asarray(p.grad_sync, dtype=np.float64) for p in inputs])
    sync_start = _sync_start(stage_end, [len(p.stages) for p in inputs])
    tail = np.concatenate([np.asarray(p.step_end if p.step_end is not None else [0.0] * len(p.stages),
                                      dtype=np.float64) for p in inputs])
    extra = np.array([p.extra_comm for p in inputs], dtype=np.float64)
    step_end = np.maximum(pipe_end, _pipeline_max(sync_start + sync + tail, stage_offsets)) + extra
    before_tail = np.maximum(pipe_end, _pipeline_max(sync_start + sync, stage_offsets)) + extra
    memory = _replay_memory(inputs, pipes, tasks, start, finish, gstage, G)
    timeline = Timeline(tasks=tasks, start=start, finish=finish, comm=comm, send=send, stage_offsets=stage_offsets,
                        sync_start=sync_start, sync_end=sync_start + sync, memory=memory)
    result = _summarise(inputs, timeline, busy, refwd, sync, pipe_end, float(step_end.max(initial=0.0)),
                        time_unit, memory_unit)
    result.step_end_s = result.step_time_s - float(before_tail.max(initial=0.0))
    return result


def _pipeline_max(values: np.ndarray, stage_offsets: list[int]) -> np.ndarray:
    """[pipeline] the largest of its stages' `values`, and 0.0 (what `max(initial=0.0)` over each
    pipeline's slice gives, for all pipelines at once)."""
    offs = np.asarray(stage_offsets, dtype=np.int64)
    out = np.zeros(len(offs) - 1)
    some = np.flatnonzero(offs[1:] > offs[:-1])
    if len(some):
        out[some] = np.maximum(np.maximum.reduceat(values, offs[some]), 0.0)
    return out


def _task_tables(inputs: list[PipelineInput], tasks: TaskArrays):
    """Duration, CP communication and send time of every task: entry (stage, kind, index) of its
    pipeline's tables, every pipeline's flattened end to end and gathered at once."""
    if not inputs:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    shapes = np.array([inp.dur.shape for inp in inputs], dtype=np.int64).reshape(len(inputs), 3)
    base = np.r_[0, np.cumsum(shapes.prod(axis=1))[:-1]]
    p = tasks.pipeline
    at = base[p] + (tasks.stage * shapes[p, 1] + tasks.kind) * shapes[p, 2] + tasks.index
    return tuple(np.concatenate([getattr(inp, name).ravel() for inp in inputs])[at] for name in ("dur", "comm", "send"))


def _sync_start(stage_end: np.ndarray, pps: list[int]) -> np.ndarray:
    """When each global stage's gradient reduction may start (see the module docstring)."""
    if len(set(pps)) == 1 and pps:
        aligned = stage_end.reshape(len(pps), pps[0]).max(axis=0)  # the DP group waits for its slowest replica
        return np.tile(aligned, len(pps))
    return np.full_like(stage_end, stage_end.max(initial=0.0))


def _replay_memory(inputs, pipes, tasks, start, finish, gstage, G) -> MemoryCurves:
    splits = [inp.splits if inp.splits is not None else split_sequences(inp.chunks, inp.backward_chunks or inp.chunks)
              for inp in inputs]
    tid, at_end, delta = plan_memory_events(pipes, [inp.sizes for inp in inputs], splits, tasks.offsets)
    time = np.where(at_end, finish[tid], start[tid])
    base = np.concatenate([np.asarray(p.sizes.state, dtype=np.float64) for p in inputs])
    return replay(gstage[tid], time, delta, base)


def _summarise(inputs, timeline: Timeline, busy, refwd, sync, pipe_end, step_time, time_unit, memory_unit):
    offs = timeline.stage_offsets
    rows = lambda arr: [arr[a:b].tolist() for a, b in zip(offs[:-1], offs[1:])]
    makespan = float(pipe_end.max(initial=0.0))
    total = makespan * offs[-1]
    own_bubble = [1.0 - busy[a:b].sum() / (pipe_end[i] * (b - a)) if pipe_end[i] > 0 else 0.0
                  for i, (a, b) in enumerate(zip(offs[:-1], offs[1:]))]
    fastest, slowest = (float(pipe_end.min()) if len(pipe_end) else 0.0), makespan
    return SimResult(
        time_unit=time_unit, memory_unit=memory_unit, makespan=makespan, step_time_s=step_time,
        bubble_ratio=float(1.0 - busy.sum() / total) if total > 0 else 0.0,
        busy=rows(busy), idle=rows(makespan - busy), reforward=rows(refwd), grad_sync=rows(sync),
        pipeline_makespan=pipe_end.tolist(), pipeline_bubble_ratio=own_bubble,
        dp_imbalance=slowest / fastest if fastest > 0 else None,
        dp_imbalance_spread=(slowest - fastest) / slowest if slowest > 0 else 0.0,
        peak_memory=rows(timeline.memory.peak), num_gpus=sum(p.num_gpus for p in inputs),
        model_flops=float(sum(p.model_flops for p in inputs)), timeline=timeline,
    )
