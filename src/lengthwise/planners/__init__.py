"""The planners, by name.

    from lengthwise.planners import PlanRequest, get_planner, PLANNER_NAMES
    plan = get_planner("packing")(PlanRequest(lengths=[...], model=..., cluster=..., scheme=...,
                                              cost=..., context_length=32768))

Floors, each importing only those below it: base.py (PlanRequest, shared steps), options.py
(every planner's options), packing_utils.py <- baselines.py and one folder per paper
(chunkflow/, skrull/, hydraulis/, infinipipe/, slimpack/; each folder's planner.py holds its
`plan_<paper>` and search) <- registry.py (every planner but auto) <- auto.py <- this module.
To add a planner, give it an options class in options.py and a line in registry.py.
"""

from __future__ import annotations

from lengthwise.errors import UserError
from lengthwise.planners.auto import plan_auto
from lengthwise.planners.base import Planner, PlanRequest, collector_paused  # noqa: F401
from lengthwise.planners.registry import CANDIDATE_PLANNERS

PLANNERS: dict[str, Planner] = {**CANDIDATE_PLANNERS, "auto": collector_paused(plan_auto)}
"""Planner name -> planner function."""

PLANNER_NAMES: tuple[str, ...] = tuple(PLANNERS)


def get_planner(name: str) -> Planner:
    """The planner function registered under `name`; an unknown name is a UserError."""
    if name not in PLANNERS:
        raise UserError(f"unknown planner {name!r}: use one of {', '.join(PLANNER_NAMES)}")
    return PLANNERS[name]
