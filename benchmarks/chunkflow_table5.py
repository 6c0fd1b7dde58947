"""ChunkFlow's Table 5 against the simulator: peak memory of Qwen2.5-7B at <TP4, SP4, PP1>, K = 1.

    python benchmarks/chunkflow_table5.py        # writes benchmarks/results/chunkflow_table5.json

The paper (chunkflow.txt §6.3.1, lines 261-271) measures the peak memory of ChunkFlow's
training at ChunkSize 2K / 4K / 8K for 32K and 256K contexts. Here each cell is the simulated
peak of the chunkflow planner's plan for a batch holding one context-length sequence beside
short ones, on one tp4 pipeline (dp 1: Megatron-LM's optimizer states unsharded, 18 bytes a
parameter), with the executor's per-tensor activation accounting (sequence parallelism on, as
the paper's SP 4). Two columns:

- `executor`: the memory of our executor running that plan (`CostModel()` as it is).
- `chunkflow_system`: the same accounting with three settings of the system the paper measured,
  each named in `CostModel`: `grads_held_all_step` (Megatron-LM's DistributedDataParallel keeps
  its fp32 main-gradient buffer allocated for the whole run), `nograd_keeps_graph` (Algorithm
  2 runs a re-forwarded chunk's first forward with autograd on and drops its loss, so the graph
  lives until the next forward's loss replaces it: two chunks' activations at the end of each
  forward of a split sequence, where our executor runs that forward under no_grad) and
  `swiglu_keeps_product` (Megatron-LM's down projection keeps the SwiGLU's product, which our
  executor makes again in backward).

All figures are simulated; the paper's are measured on GPUs. The JSON also gives the slope of
each column (bytes per chunk token).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lengthwise.cost import CostModel
from lengthwise.files import write_atomic
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.sim import simulate_plan
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset

K = 1024
GIB = 2**30
PAPER = {(32 * K, 2 * K): 41.6, (32 * K, 4 * K): 47.5, (32 * K, 8 * K): 59.3,
         (256 * K, 2 * K): 45.6, (256 * K, 4 * K): 50.8, (256 * K, 8 * K): 63.8}
"""(context, ChunkSize) -> peak GiB, chunkflow.txt Table 5."""
SHORTS = [700, 300, 1500, 90, 2000] * 20


def simulated_peak(context: int, chunk_size: int, *, chunkflow_system: bool = False) -> float:
    """Peak GiB of the cell; `chunkflow_system`: with the two settings of the paper's system."""
    scheme = ParallelScheme(dp=1, tp=4, pp=1)
    cluster = cluster_preset("h100", scheme.num_gpus)
    cost = CostModel(model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster, grads_held_all_step=chunkflow_system,
                     nograd_keeps_graph=chunkflow_system, swiglu_keeps_product=chunkflow_system)
    request = PlanRequest(lengths=SHORTS + [context], model=cost.model, cluster=cluster, scheme=scheme, cost=cost,
                          context_length=context, options={"chunk_size": chunk_size, "k": 1})
    result = simulate_plan(get_planner("chunkflow")(request), cost)
    return max(max(stages) for stages in result.peak_memory) / GIB


COLUMNS = {"executor": False, "chunkflow_system": True}


def main() -> int:
    cells = []
    for (context, chunk), paper in PAPER.items():
        cell = {"context": context, "chunk_size": chunk, "paper_gib": paper}
        for name, system in COLUMNS.items():
            ours = simulated_peak(context, chunk, chunkflow_system=system)
            cell[f"{name}_gib"], cell[f"{name}_over_paper"] = ours, ours / paper
        cells.append(cell)
    slopes = {}
    for context in (32 * K, 256 * K):
        col = [c for c in cells if c["context"] == context]
        span = (col[-1]["chunk_size"] - col[0]["chunk_size"])
        slopes[str(context)] = {key: (col[-1][key] - col[0][key]) * GIB / span
                                for key in ("paper_gib", *(f"{name}_gib" for name in COLUMNS))}
    out = {"meta": {"command": "python benchmarks/chunkflow_table5.py", "simulated": True,
                    "setting": "qwen2.5-7b, dp1 x tp4 x pp1 (sequence parallel), K=1, h100 memory",
                    "columns": {"executor": "CostModel() as is",
                                "chunkflow_system": "CostModel(grads_held_all_step=True, nograd_keeps_graph=True, "
                                                    "swiglu_keeps_product=True)"}},
           "cells": cells, "bytes_per_chunk_token": slopes}
    path = Path(__file__).parent / "results" / "chunkflow_table5.json"
    write_atomic(path, json.dumps(out, indent=1))
    for c in cells:
        print(f"{c['context'] // K}K context, ChunkSize {c['chunk_size'] // K}K: paper {c['paper_gib']:.1f} GiB, "
              f"executor {c['executor_gib']:.1f} GiB ({c['executor_over_paper']:.3f}), "
              f"ChunkFlow's system {c['chunkflow_system_gib']:.1f} GiB ({c['chunkflow_system_over_paper']:.3f})")
    for context, s in slopes.items():
        print(f"{int(context) // K}K: bytes per chunk token, paper {s['paper_gib'] / 1e6:.2f} MB, "
              f"executor {s['executor_gib'] / 1e6:.2f} MB, ChunkFlow's system {s['chunkflow_system_gib'] / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
