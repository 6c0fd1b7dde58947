"""The names of the figures planners, the simulator and the report record: one glossary.

Keys of `StepPlan.metrics`, of `compare`'s summary (report.md, --json) and of the simulator's
`SimResult` attributes. The unit is in the name: `_s` seconds, `_ms` milliseconds, `_gib` GiB
(2**30 bytes), `_bytes` bytes; ratios lie in [0, 1].
"""

STEP_TIME_S = "step_time_s"
"""Seconds of one optimizer step, simulated (SimResult) or measured (train)."""
PREDICTED_STEP_TIME_S = "predicted_step_time_s"
"""A planner's own estimate of the step's seconds, from its cost model before simulation."""
PEAK_MEMORY_GIB = "peak_memory_gib"
"""Largest memory any GPU holds during the step, GiB."""
BUBBLE_RATIO = "bubble_ratio"
"""Share of pipeline-stage time spent idle."""
DP_IMBALANCE = "dp_imbalance"
"""Slowest data-parallel pipeline's time over the mean pipeline's, minus 1."""
TOKENS_PER_S = "tokens_per_s"
"""Tokens of the global batch per second of step time."""
MFU = "mfu"
"""Model FLOPs utilisation: useful FLOPs per second over the GPUs' peak."""
PLANNING_MS = "planning_ms"
"""Milliseconds of CPU the planner took for the batch."""

GIB = 2**30
"""Bytes in a GiB."""
