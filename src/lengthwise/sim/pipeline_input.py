"""What the simulator's engine takes of one pipeline (`PipelineInput`): built by sim/inputs.py
from a plan and the cost model (and by sim/cell_inputs.py for many pipelines at once), or from
raw forward times (`direct_input`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lengthwise.plan.ir import Chunk
from lengthwise.plan.schedules import Dependencies
from lengthwise.sim.memory import MemorySizes, SplitArrays, SplitSequence


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
    step_end: list[float] | None = None
    """[stage] gradient norm and optimizer step after the reduction (CostModel.step_end_time;
    None: none, as the analytic model and the direct mode)."""
    extra_comm: float = 0.0
    """Pipeline communication charged after everything else (PipelinePlan.extra_comm_s)."""
    model_flops: float = 0.0
    """Forward + backward FLOPs of the pipeline's tokens, padding and recomputation excluded."""
    num_gpus: int = 1
    """GPUs of the pipeline (tp * cp * pp)."""
    deps: Dependencies | None = None
    """The chunks' slice dependencies when already derived (else the engine derives them)."""
    splits: list[SplitSequence] | SplitArrays | None = None
    """split_sequences of the chunks when already derived (else the engine derives them)."""
