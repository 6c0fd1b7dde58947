"""The step simulator: task DAG timing, memory replay, metrics and pictures (no PyTorch)."""

from lengthwise.sim.simulate import SimResult, Timeline, simulate_inputs, simulate_plan, simulate_times  # noqa: F401
