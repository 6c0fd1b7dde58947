"""ChunkFlow's grid search over ChunkSize and K (chunkflow.txt §5), scored by the simulator.

§5: a large ChunkSize under-fills a pipeline (few chunks, more bubbles), a small one under-uses
the GPU; K trades memory for fewer re-run forwards. The paper grid-searches both per training
configuration (its table 4 lists the winners, e.g. (8K, 16) for the 7B model at 256K context).
Here every candidate is planned for the actual batch, simulated, and the fastest whose simulated
peak memory fits every GPU wins; ties go to the smaller K, then the smaller ChunkSize.

Candidates: ChunkSize in 2K, 4K, ..., 64K up to the context length rounded up to a power of two;
K in 1, 2, 4, ... up to the largest group (pieces of the batch's longest sequence) plus that
largest group itself (K = N never re-runs a forward); only K = 1 when nothing is split.
"""

from __future__ import annotations

import time

from lengthwise.errors import UserError
from lengthwise.metrics import GIB, PEAK_MEMORY_GIB, PLANNING_MS, STEP_TIME_S
from lengthwise.plan.ir import StepPlan
from lengthwise.planners.base import PlanRequest, check_lengths, take_options
from lengthwise.planners.chunkflow.build import (
    build_pipelines,
    build_plan,
    check_chunk_size_fits,
    default_chunk_size,
    pipelines_inflight,
)
from lengthwise.sim import simulate_plan

GRID_CHUNK_SIZES = tuple(2**p for p in range(11, 17))
"""2K .. 64K tokens, the range chunkflow §6.3 explores."""


def chunk_size_candidates(context_length: int) -> list[int]:
    """Grid sizes up to the context length's power of two (a larger chunk splits nothing more)."""
    cap = 1 << max(context_length - 1, 1).bit_length()
    return [c for c in GRID_CHUNK_SIZES if c <= cap] or [GRID_CHUNK_SIZES[0]]


def k_candidates(longest: int, chunk_size: int) -> list[int]:
    """Powers of two below the largest group's chunk count, and that count."""
    largest_group = -(-longest // chunk_size) if longest > chunk_size else 1
    ks = [1 << p for p in range(largest_group.bit_length()) if 1 << p < largest_group]
    return ks + [largest_group]


def score(plan: StepPlan, cost) -> dict:
    """The simulated step time and peak memory of one candidate plan."""
    result = simulate_plan(plan, cost)
    return {"step_time_s": result.step_time_s, "fits": bool(result.fits),
            PEAK_MEMORY_GIB: max(max(row) for row in result.peak_memory) / GIB}


def grid_search(request: PlanRequest, k: int | None, started: float) -> StepPlan:
    """Plan and simulate every (ChunkSize, K); return the fastest plan that fits memory."""
    longest = max(request.lengths)
    grid, best, best_key = [], None, None
    for chunk_size in chunk_size_candidates(request.context_length):
        for cand_k in [k] if k is not None else k_candidates(longest, chunk_size):
            plan = build_plan(request, chunk_size, cand_k, time.perf_counter())
            row = {"chunk_size": chunk_size, "k": cand_k, **score(plan, request.cost)}
            grid.append(row)
            key = (row[STEP_TIME_S], cand_k, chunk_size)
            if row["fits"] and (best_key is None or key < best_key):
                best, best_key = plan, key
    if best is None:
        raise UserError(
            f"chunkflow chunk_size=auto: no (ChunkSize, K) of {len(grid)} candidates fits memory in "
            f"simulation (smallest peak {min(r['peak_memory_gib'] for r in grid):.1f} GiB > "
            f"{request.cost.capacity_bytes / GIB:.1f} GiB): raise --tp/--pp or the ZeRO stage"
        )
    best.options = {"chunk_size": "auto", "k": "auto" if k is None else k,
                    "chosen_chunk_size": best.metrics["chunk_size"], "chosen_k": best.metrics["k"]}
    best.metrics["grid"] = grid
    best.metrics[PLANNING_MS] = (time.perf_counter() - started) * 1e3
    return best


def plan_chunkflow(request: PlanRequest) -> StepPlan:
    """ChunkFlow for one global batch (chunkflow §4-§5); options: `ChunkFlowOptions` (planners/options.py)."""
    started = time.perf_counter()
    opts = take_options(request, "chunkflow")
    chunk_size, k = opts.chunk_size, opts.k
    check_lengths(request)
    if chunk_size == "auto":
        return grid_search(request, k, started)
    k = k or 1
    chunk_size = chunk_size or default_chunk_size(request, k)
    built = build_pipelines(request, chunk_size, k)  # built once: checked, then planned
    check_chunk_size_fits(request, chunk_size, k, pipelines_inflight(built[1], request.scheme.pp))
    return build_plan(request, chunk_size, k, started, built)
