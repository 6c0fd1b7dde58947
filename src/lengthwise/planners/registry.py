"""Every planner but `auto`, by name: the planners `auto` chooses among.

The planners package (`lengthwise.planners`) adds `auto` on top of these.
"""

from __future__ import annotations

from lengthwise.planners.base import Planner, collector_paused
from lengthwise.planners.baselines import (plan_megatron, plan_packing, plan_padding, plan_sorted,
                                           plan_static_cp, plan_token_balanced)
from lengthwise.planners.chunkflow.planner import plan_chunkflow
from lengthwise.planners.hydraulis.planner import plan_hydraulis
from lengthwise.planners.infinipipe.planner import plan_infinipipe
from lengthwise.planners.skrull.planner import plan_skrull
from lengthwise.planners.slimpack.planner import plan_slimpack

_PLANNERS: dict[str, Planner] = {
    "padding": plan_padding,
    "packing": plan_packing,
    "megatron": plan_megatron,
    "static-cp": plan_static_cp,
    "sorted": plan_sorted,
    "token-balanced": plan_token_balanced,
    "chunkflow": plan_chunkflow,
    "skrull": plan_skrull,
    "hydraulis": plan_hydraulis,
    "infinipipe": plan_infinipipe,
    "slimpack": plan_slimpack,
}

CANDIDATE_PLANNERS: dict[str, Planner] = {name: collector_paused(fn) for name, fn in _PLANNERS.items()}
