"""lengthwise: length-aware planning, simulation and exact execution of LLM training.

Planning and simulation (specs, workloads, cost, plan, sim, planners) import no PyTorch;
only `lengthwise.runtime` does.
"""

__version__ = "0.1.0"
