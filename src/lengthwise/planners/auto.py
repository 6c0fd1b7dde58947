"""`auto`: plan the batch with every applicable planner, simulate each plan, keep the fastest that
fits memory (ties broken toward less memory). None of the five papers does this step; each
wins on some workloads and loses on others, and the simulator is cheap enough to ask.

Options: `AutoOptions` in planners/options.py (candidates, schemes, candidate_options).

Planning time is the sum of what it runs (planners, validation and simulation), recorded in
`metrics[PLANNING_MS]`; `metrics["auto"]` holds each candidate's simulated step time or the
reason it was skipped.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from lengthwise.errors import UserError
from lengthwise.metrics import GIB, PEAK_MEMORY_GIB, PLANNING_MS
from lengthwise.plan.ir import StepPlan
from lengthwise.plan.validate import validate_plan
from lengthwise.planners.base import PlanRequest, take_options
from lengthwise.planners.registry import CANDIDATE_PLANNERS
from lengthwise.sim import SimResult, simulate_plan
from lengthwise.specs import ParallelScheme


@dataclass(kw_only=True)
class Candidate:
    """One planner's attempt at the batch."""

    planner: str
    plan: StepPlan | None = None
    result: SimResult | None = None
    error: str | None = None
    elapsed_ms: float = 0.0
    """Planning + validation + simulation time of this attempt."""
    scheme: ParallelScheme | None = None
    """The scheme the attempt planned for."""

    @property
    def usable(self) -> bool:
        return self.result is not None and bool(self.result.fits)

    def summary(self):
        if self.result is None:
            return {"error": self.error}
        return {"step_time_s": self.result.step_time_s, "fits": bool(self.result.fits),
                PEAK_MEMORY_GIB: max_peak(self.result) / GIB}


def max_peak(result: SimResult) -> float:
    return max((p for row in result.peak_memory for p in row), default=0.0)


def try_planner(name: str, request: PlanRequest, *, validate: bool = True) -> Candidate:
    """Plan, validate and simulate with one planner; a UserError becomes a skipped candidate.
    `validate=False` leaves validation to the caller (auto's `choose_valid` validates only the
    plans in the running for its choice)."""
    started = time.perf_counter()
    try:
        plan = candidate_planner(name)(request)
        if validate:
            validate_plan(plan, request.cost)
        result = simulate_plan(plan, request.cost)
        cand = Candidate(planner=name, plan=plan, result=result, scheme=request.scheme)
    except UserError as exc:
        cand = Candidate(planner=name, error=str(exc), scheme=request.scheme)
    cand.elapsed_ms = (time.perf_counter() - started) * 1e3
    return cand


def choose_best(candidates: list[Candidate]) -> Candidate | None:
    """Fastest simulated step among plans that fit; ties toward less peak memory."""
    usable = [c for c in candidates if c.usable]
    if not usable:
        return None
    return min(usable, key=lambda c: (c.result.step_time_s, max_peak(c.result)))


def choose_valid(candidates: list[Candidate], request: PlanRequest) -> Candidate | None:
    """choose_best among the plans that pass validate_plan. Plans are validated best first and
    the first valid one wins, so the choice is the one validating every candidate would make,
    at the cost of one validation when the best plan is valid (the usual case)."""
    while (best := choose_best(candidates)) is not None:
        started = time.perf_counter()
        try:
            validate_plan(best.plan, request.cost)
            return best
        except UserError as exc:
            best.plan, best.result, best.error = None, None, f"invalid plan: {exc}"
        finally:
            best.elapsed_ms += (time.perf_counter() - started) * 1e3
    return None


def candidate_planner(name: str):
    """The planner auto may run under `name` (every planner but auto itself)."""
    if name not in CANDIDATE_PLANNERS:
        raise UserError(f"auto cannot run planner {name!r}: candidates are {', '.join(CANDIDATE_PLANNERS)}")
    return CANDIDATE_PLANNERS[name]


def default_candidates() -> list[str]:
    return list(CANDIDATE_PLANNERS)


def candidate_request(request: PlanRequest, name: str, opts: dict) -> PlanRequest:
    scheme = opts["schemes"].get(name)
    if isinstance(scheme, dict):
        scheme = ParallelScheme.from_dict({"zero": request.scheme.zero, **scheme})
    return dataclasses.replace(request, scheme=scheme or request.scheme,
                               options=dict(opts["candidate_options"].get(name, {})))


def plan_auto(request: PlanRequest) -> StepPlan:
    started = time.perf_counter()
    opts = take_options(request, "auto")
    names = opts["candidates"] or default_candidates()
    if "auto" in names:
        raise UserError("auto cannot be its own candidate: remove 'auto' from candidates")
    tried = [try_planner(n, candidate_request(request, n, opts), validate=False) for n in names]
    best = choose_valid(tried, request)
    if best is None:
        reasons = "; ".join(f"{c.planner}: {c.error or 'does not fit memory'}" for c in tried)
        raise UserError(f"no planner produced a plan that fits: {reasons}")
    plan = best.plan
    plan.metrics = {**plan.metrics, "chosen_planner": best.planner,
                    "auto": {c.planner: c.summary() for c in tried},
                    PLANNING_MS: (time.perf_counter() - started) * 1e3}
    plan.options = {"chosen_planner": best.planner, "candidates": names, **plan.options}
    plan.planner = "auto"
    return plan
