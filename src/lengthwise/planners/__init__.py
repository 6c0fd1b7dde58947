"""The planners, by name. Each lives in its own module, imported only when asked for.

    from lengthwise.planners import PlanRequest, get_planner, PLANNER_NAMES
    plan = get_planner("packing")(PlanRequest(lengths=[...], model=..., cluster=..., scheme=...,
                                              cost=..., context_length=32768))

To add a planner, add one line to `_REGISTRY`: name -> "module:function" under
lengthwise.planners. A name whose module does not exist yet is listed but reported as not
available (`planner_available`), so tests iterating over PLANNER_NAMES can skip it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator, Mapping

from lengthwise.errors import UserError
from lengthwise.planners.base import Planner, PlanRequest  # noqa: F401

_REGISTRY = {
    "padding": "baselines:plan_padding",
    "packing": "baselines:plan_packing",
    "sorted": "baselines:plan_sorted",
    "token-balanced": "baselines:plan_token_balanced",
    "megatron": "megatron:plan_megatron",
    "static-cp": "megatron:plan_static_cp",
    "chunkflow": "chunkflow:plan_chunkflow",
    "skrull": "skrull:plan_skrull",
    "hydraulis": "hydraulis:plan_hydraulis",
    "infinipipe": "infinipipe:plan_infinipipe",
    "slimpack": "slimpack:plan_slimpack",
    "auto": "auto:plan_auto",
}

PLANNER_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def _module_name(name: str) -> str:
    return f"lengthwise.planners.{_REGISTRY[name].partition(':')[0]}"


def planner_available(name: str) -> bool:
    """Whether the planner's module exists in this build (later planners land one by one)."""
    return name in _REGISTRY and importlib.util.find_spec(_module_name(name)) is not None


def available_planners() -> list[str]:
    return [n for n in PLANNER_NAMES if planner_available(n)]


def get_planner(name: str) -> Planner:
    """The planner function registered under `name`; an unknown name is a UserError."""
    if name not in _REGISTRY:
        raise UserError(f"unknown planner {name!r}: use one of {', '.join(available_planners())}")
    if not planner_available(name):
        raise UserError(
            f"planner {name!r} is not implemented yet: use one of {', '.join(available_planners())}"
        )
    module = importlib.import_module(_module_name(name))
    return getattr(module, _REGISTRY[name].partition(":")[2])


class _LazyPlanners(Mapping):
    """name -> planner function, importing each planner's module on first access."""

    def __getitem__(self, name: str) -> Planner:
        if name not in _REGISTRY:
            raise KeyError(name)
        return get_planner(name)

    def __iter__(self) -> Iterator[str]:
        return iter(PLANNER_NAMES)

    def __len__(self) -> int:
        return len(PLANNER_NAMES)


PLANNERS: Mapping[str, Planner] = _LazyPlanners()
