"""InfiniPipe's slice number N, "automatically tuned" (infinipipe.txt §3.2): a search over N.

More slices make chunks shorter (finer 1F1B granularity, fewer bubbles, less memory per chunk,
so less recomputation) but less efficient (small GEMMs, more per-chunk overhead). On the
workloads of §5 the step time falls steeply for the first few N and is flat and noisy around
its minimum, so the search is coarse then fine:

1. Ladder: N = 1, 2, 3, 4, 6, 9, 13, 19, ... (x1.5) until two feasible rungs in a row are no
   better than the best, or N exceeds what the longest sequence can be cut into. Rungs whose
   chunks do not fit memory are skipped (larger N shrinks chunks).
2. Refinement: bisect between the best rung and its neighbours, moving to a better midpoint
   while there is one.

At most `budget` feasible values of N are planned. Each is scored by `score(n)` (planner.py passes
the DP's estimate), which returns a string saying why when N is infeasible.

Cost: each N tried re-chunks the batch and groups every pipeline (planner.py's docstring gives
the orders); the plan objects and the simulation are made only for the few best N afterwards,
so the search itself never simulates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

INFEASIBLE = float("inf")


@dataclass(kw_only=True)
class SliceSearch:
    """Memoised scores of the N tried so far."""

    score: Callable[[int], float | str]
    """N -> step seconds, or a string saying why N has no plan."""
    budget: int
    """Most feasible values of N to plan (infeasible ones are cheap: the ladder skips them)."""
    tried: dict[int, float | str] = field(default_factory=dict)

    def at(self, n: int) -> float:
        if n not in self.tried:
            self.tried[n] = self.score(n)
        value = self.tried[n]
        return value if isinstance(value, float) else INFEASIBLE

    @property
    def spent(self) -> bool:
        return sum(isinstance(v, float) for v in self.tried.values()) >= self.budget

    @property
    def best(self) -> int | None:
        feasible = {n: v for n, v in self.tried.items() if isinstance(v, float)}
        return min(feasible, key=lambda n: (feasible[n], n)) if feasible else None


def ladder(search: SliceSearch, too_many: Callable[[int], bool]) -> list[int]:
    """Step 1: the rungs tried, in order."""
    rungs, n, worse = [], 1, 0
    while not search.spent and not too_many(n):
        before = search.best
        value = search.at(n)
        rungs.append(n)
        if value < INFEASIBLE:
            worse = 0 if before is None or value < search.tried[before] else worse + 1
            if worse >= 2:
                break
        n = max(n + 1, round(n * 1.5))
    return rungs


def refine(search: SliceSearch, rungs: list[int]) -> None:
    """Step 2: bisect around the best N between its neighbouring rungs."""
    best = search.best
    if best is None or best not in rungs:
        return
    i = rungs.index(best)
    lo = rungs[i - 1] if i > 0 else best
    hi = rungs[i + 1] if i + 1 < len(rungs) else best
    while not search.spent:
        left, right = (lo + best) // 2, (best + hi + 1) // 2
        points = [p for p in (left, right) if lo < p < hi and p != best and p not in search.tried]
        if not points:
            return
        for p in points:
            search.at(p)
        new = search.best
        if new != best:
            lo, hi = (lo, best) if new < best else (best, hi)
            best = new
        else:
            lo, hi = max(lo, left), min(hi, right)


def tune(score: Callable[[int], float | str], too_many: Callable[[int], bool], budget: int) -> SliceSearch:
    """Ladder then refinement; the search keeps every score for the plan's metrics."""
    search = SliceSearch(score=score, budget=budget)
    refine(search, ladder(search, too_many))
    return search
