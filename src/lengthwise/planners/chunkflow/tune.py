"""ChunkFlow's (ChunkSize, K) tuned once per workload (chunkflow.txt §5: chosen on sample batches,
then fixed for the run), from the grid search each of its plans already ran.

    point = workload_grid_point(plans, requests)    # (chunk_size, k), or None

Each `chunk_size="auto"` plan records its grid in `plan.metrics["grid"]`: every (ChunkSize, K)
it simulated on its own batch, whether it fit and its simulated step time. The workload's point
is the one that fits every batch with the lowest mean step time over them (ties: smaller K, then
smaller ChunkSize), among those ChunkFlow also takes as given options on every batch: its
explicit-option memory check counts full chunks, as many per stage as its schedule for the batch
holds at once, while a grid point was judged by simulating the chunks themselves.
"""

from __future__ import annotations

import statistics

from lengthwise.errors import UserError
from lengthwise.metrics import STEP_TIME_S
from lengthwise.plan.ir import StepPlan
from lengthwise.planners.base import PlanRequest
from lengthwise.planners.chunkflow.build import check_chunk_size_fits


def workload_grid_point(plans: list[StepPlan], requests: list[PlanRequest]) -> tuple[int, int] | None:
    """The (chunk_size, k) for every batch of `requests` (one `auto` plan of each in `plans`),
    or None when no grid point fits them all."""
    times: dict[tuple[int, int], list[float]] = {}
    for plan in plans:
        for row in plan.metrics["grid"]:
            if row["fits"]:
                times.setdefault((row["chunk_size"], row["k"]), []).append(row[STEP_TIME_S])
    common = {point: statistics.fmean(t) for point, t in times.items()
              if len(t) == len(plans) and _accepted(requests, *point)}
    if not common:
        return None
    return min(common, key=lambda p: (common[p], p[1], p[0]))


def _accepted(requests: list[PlanRequest], chunk_size: int, k: int) -> bool:
    """Whether ChunkFlow takes (chunk_size, k) as given options on every request."""
    try:
        for request in requests:
            check_chunk_size_fits(request, chunk_size, k)
    except UserError:
        return False
    return True
