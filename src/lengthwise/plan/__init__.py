"""The StepPlan and its schedules, as data."""

from lengthwise.plan.ir import (  # noqa: F401
    BACKWARD, FORWARD, FORWARD_NOGRAD, SHARDED, Action, Chunk, PipelinePlan, Segment, StepPlan,
)
