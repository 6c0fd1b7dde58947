"""SlimPack Phase 1 and DP-Merge (slimpack.txt §4.1.1): samples onto data-parallel ranks for
equal forward FLOPs, merging ranks for outliers.

Every DP rank gets the same forward-FLOPs capacity B = total / dp (§4.1.1 Phase 1). A sample
whose FLOPs exceed B cannot be balanced by any placement: it is an *outlier*, and DP-Merge
gives it ceil(F / B) ranks that run as one pipeline with context parallelism of that degree
(§4.1.1 "DP-Merge"), so its per-GPU FLOPs drop to F / m. A sample whose whole activations and
K/V state (held from its first slice's forward to its first slice's backward, §4.2) overflow
one pipeline is a memory outlier and is merged over as many ranks as its memory needs
(§4.1.1: memory and compute outliers need not coincide).

Whether merging a compute outlier pays depends on what its context parallelism costs (every
slice re-gathers its K/V context, cost.cp_comm_time, across nodes when the merged ranks span
them), so the planner builds the memory-only variant as well and lets the simulator choose
(slimpack.py step 5).

Placement. Outliers take their ranks first, largest first, each leaving at least one rank to
every outlier after it. The other samples then go, largest first, onto the rank group with the
lowest load per merged rank after adding them (LPT weighted by group size). Without outliers
every group is one rank and the better of Karmarkar-Karp and LPT is kept (packing_utils).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from lengthwise.errors import UserError
from lengthwise.planners.packing_utils import greedy_balance, karmarkar_karp


@dataclass(kw_only=True)
class RankGroup:
    """Data-parallel ranks that run one pipeline: one rank, or several merged by DP-Merge."""

    ranks: int
    """DP ranks merged into this pipeline (its context-parallel degree multiplies by this)."""
    outliers: list[int] = field(default_factory=list)
    """Sequence ids sharded over the merged ranks (context parallelism)."""
    seq_ids: list[int] = field(default_factory=list)
    """Every sequence this pipeline runs, outliers included."""

    def load(self, flops: np.ndarray) -> float:
        return float(flops[self.seq_ids].sum()) if self.seq_ids else 0.0


def merge_sizes(flops: np.ndarray, mem_want: np.ndarray, mem_floor: np.ndarray, dp: int, *,
                by_flops: bool = True) -> list[tuple[list[int], int]]:
    """(outlier sequence ids, ranks) of every merged group (DP-Merge, §4.1.1).

    `mem_want`: ranks a sample should merge over to leave room beside it for other MicroPacks;
    `mem_floor`: ranks it cannot do without (all of a GPU's free memory for it alone);
    `by_flops`: also merge compute outliers (FLOPs above a rank's share), not only memory ones.

    Samples that cannot fit unmerged go first, largest floor first, so every later one finds a
    group at least its floor. When the ranks run out, a memory outlier joins the least-loaded
    merged group that holds its floor: a pipeline runs its samples one after another (§4.2
    stream order), so two long samples of one group never hold their activations at once. A
    compute outlier left without ranks runs as an ordinary sample. (Giving every outlier its
    own ranks made bimodal batches — ChatQA2's many long samples — refuse schemes where every
    other planner fits.)"""
    by_compute = np.ceil(flops / (flops.sum() / dp) - 1e-9).astype(np.int64) if by_flops else 1
    want = np.maximum(by_compute, mem_want)
    outliers = sorted(np.flatnonzero(want > 1).tolist(), key=lambda i: (-int(mem_floor[i]), -flops[i], i))
    groups: list[tuple[list[int], int]] = []
    loads: list[float] = []
    left = dp
    for i in outliers:
        m = int(min(want[i], left))
        if m >= max(int(mem_floor[i]), 2):
            groups.append(([i], m))
            loads.append(float(flops[i]))
            left -= m
            continue
        if mem_floor[i] <= 1:
            continue  # a compute outlier without ranks left: an ordinary sample
        fit = [g for g, (_, r) in enumerate(groups) if r >= mem_floor[i]]
        if not fit:
            raise UserError(
                f"sequence {i} needs {mem_floor[i]} merged DP ranks to hold its activations and K/V "
                f"state but only {max(left, 0)} of dp={dp} can merge for it: raise --dp, --tp or --pp"
            )
        g = min(fit, key=lambda g: (loads[g] / groups[g][1], g))
        groups[g][0].append(i)
        loads[g] += float(flops[i])
    return groups


def assign_ranks(flops: np.ndarray, mem_want: np.ndarray, mem_floor: np.ndarray, dp: int, *,
                 merge: bool, by_flops: bool = True,
                 merged: list[tuple[list[int], int]] | None = None) -> list[RankGroup]:
    """Phase 1: rank groups with their sequences (outliers merged when `merge`; compute
    outliers too when `by_flops`, see merge_sizes; `merged`: merge_sizes' result when the
    caller has it already)."""
    if not merge and (mem_floor > 1).any():
        i = int(np.argmax(mem_floor))
        raise UserError(f"sequence {i} needs {mem_floor[i]} merged DP ranks to hold its activations and "
                        "K/V state: enable dp_merge or raise --tp/--pp")
    if merged is None:
        merged = merge_sizes(flops, mem_want, mem_floor, dp, by_flops=by_flops) if merge else []
    if not merged:
        return [RankGroup(ranks=1, seq_ids=sorted(g)) for g in _balanced(flops.tolist(), dp)]
    groups = [RankGroup(ranks=m, outliers=list(ids), seq_ids=list(ids)) for ids, m in merged]
    groups += [RankGroup(ranks=1) for _ in range(dp - sum(m for _, m in merged))]
    taken = {i for ids, _ in merged for i in ids}
    rest = sorted((i for i in range(len(flops)) if i not in taken), key=lambda i: (-flops[i], i))
    _weighted_lpt(groups, rest, flops)
    for g in groups:
        g.seq_ids.sort()
    return groups


def _balanced(sizes: list[float], dp: int) -> list[list[int]]:
    """Karmarkar-Karp or LPT, whichever leaves the heaviest rank lighter."""
    if dp == 1:
        return [list(range(len(sizes)))]

    def heaviest(parts: list[list[int]]) -> float:
        return max(sum(sizes[i] for i in p) for p in parts)

    return min(karmarkar_karp(sizes, dp), greedy_balance(sizes, dp), key=heaviest)


def _weighted_lpt(groups: list[RankGroup], seq_ids: list[int], flops: np.ndarray) -> None:
    """Largest first onto the group whose load per merged rank stays lowest (ties: lowest
    index). Groups of one size form one heap by (load, index): (load + f) / ranks never
    decreases with the load, so a heap's best is among its lightest entries (those whose key
    rounds equal to the lightest's are all looked at); O(n R log P) for R distinct sizes
    (a few), not O(n P)."""
    loads = [g.load(flops) for g in groups]
    heaps: dict[int, list[tuple[float, int]]] = {}
    for k, g in enumerate(groups):
        heaps.setdefault(g.ranks, []).append((loads[k], k))
    for h in heaps.values():
        heapq.heapify(h)
    for i in seq_ids:
        f = float(flops[i])
        best, found = None, {}
        for r, h in heaps.items():
            top = (h[0][0] + f) / r
            taken = found[r] = []
            while h and (h[0][0] + f) / r == top:  # every entry of the lightest key
                taken.append(heapq.heappop(h))
            k = min(k for _, k in taken)
            if best is None or (top, k) < best:
                best = (top, k)
        g = best[1]
        groups[g].seq_ids.append(i)
        loads[g] += f
        for r, taken in found.items():
            for load, k in taken:
                heapq.heappush(heaps[r], (loads[k], k) if k == g else (load, k))


def memory_ranks(lengths: np.ndarray, share_per_token: float) -> np.ndarray:
    """Per sequence: merged ranks needed so that its whole activations and K/V state fit, given
    the share of a stage's free memory one token takes on the tightest stage (CP divides it)."""
    return np.maximum(1, np.ceil(lengths * share_per_token - 1e-9)).astype(np.int64)
