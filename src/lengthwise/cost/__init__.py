"""The cost model: FLOPs, time, memory and communication of chunks on stages."""

from lengthwise.cost.model import CostModel, split_layers  # noqa: F401
from lengthwise.cost.time import Profile, SchemeFit, Throughput  # noqa: F401
