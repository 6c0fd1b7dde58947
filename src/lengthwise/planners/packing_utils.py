"""Bin packing and balancing helpers shared by the planners.

Items are identified by their index into a list of sizes (token counts, FLOPs, seconds ...);
every helper returns lists of those indices, is deterministic (ties broken by index), and never
drops or duplicates an item.

- `best_fit_decreasing`: fill bins of a fixed capacity, largest item first, each into the bin
  it leaves fullest (Krell et al. 2021 packing, the baseline SlimPack §6 compares against).
- `greedy_balance`: k groups, largest item first onto the lightest group (LPT; Graham's 4/3
  bound on the heaviest group).
- `karmarkar_karp`: k groups by largest differencing, optionally with equal item counts
  (verl-style).

Measured on 512-sequence batches, 20 seeds (`get_profile(name).sample(512, default_rng(seed))`,
sequences over the bin dropped): best-fit-decreasing fills 98.6% of each 8K bin on `lmsys`
(worst batch 96.8%) but 90.3% of each 32K bin on `chunkflow-eval`, whose few 10-32K sequences
leave gaps no short one fills. Over 8 groups the heaviest exceeds the ideal sum/8 by 0.001%
with Karmarkar-Karp and 0.03% with LPT on `lmsys`; both by 1.7% on `chunkflow-eval`, where
single sequences outweigh a group's share.
"""

from __future__ import annotations

import bisect
import heapq


def best_fit_decreasing(sizes: list[float], capacity: float) -> list[list[int]]:
    """Pack items into as few bins of `capacity` as best-fit decreasing finds.

    Bins are returned in the order they were opened (so the first bin holds the largest item),
    items inside a bin in the order they were placed. Every size must be <= capacity.
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    # (remaining room, bin index) sorted, so the tightest bin that still fits is one bisect away.
    room: list[tuple[float, int]] = []
    for i in order:
        assert sizes[i] <= capacity, f"item {i} of size {sizes[i]} exceeds capacity {capacity}"
        pos = bisect.bisect_left(room, (sizes[i], -1))
        if pos == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - sizes[i], len(bins) - 1))
            continue
        left, b = room.pop(pos)
        bins[b].append(i)
        bisect.insort(room, (left - sizes[i], b))
    return bins


def greedy_balance(sizes: list[float], k: int) -> list[list[int]]:
    """Split items into k groups, largest first onto the currently lightest group (LPT)."""
    assert k >= 1
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, g) for g in range(k)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + sizes[i], g))
    return groups


def karmarkar_karp(sizes: list[float], k: int, *, equal_count: bool = False) -> list[list[int]]:
    """Split items into k groups of near-equal total size by largest differencing.

    Each item starts as a k-way partial partition (itself in one group, the rest empty); the
    two partial partitions with the largest spread (max - min group sum) are merged by pairing
    the heaviest group of one with the lightest of the other, until one remains. With
    `equal_count`, items are first padded to a multiple of k with zero-size placeholders and
    merged in rounds of k, so every group gets the same number of items (+-1).
    Groups are returned heaviest first.
    """
    assert k >= 1
    if equal_count:
        return _kk_equal_count(sizes, k)
    heap = [_kk_entry([(sizes[i], [i])] + [(0.0, [])] * (k - 1), i) for i in range(len(sizes))]
    heapq.heapify(heap)
    return _kk_merge_all(heap, k)


def _kk_entry(groups: list[tuple[float, list[int]]], tiebreak: int) -> tuple:
    groups = sorted(groups, key=lambda g: (-g[0], g[1][:1]))
    spread = groups[0][0] - groups[-1][0]
    return (-spread, tiebreak, groups)


def _kk_merge_all(heap: list, k: int) -> list[list[int]]:
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, t1, a = heapq.heappop(heap)
        _, t2, b = heapq.heappop(heap)
        # Heaviest of a with lightest of b: the differencing step that cancels the spreads.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        heapq.heappush(heap, _kk_entry(merged, min(t1, t2)))
    return [sorted(g[1]) for g in heap[0][2]]


def _kk_equal_count(sizes: list[float], k: int) -> list[list[int]]:
    """KK over rounds of k items: each round's items go one per group, so counts stay equal."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = []
    for r in range(0, len(order), k):
        ids = order[r:r + k]
        groups = [(sizes[i], [i]) for i in ids] + [(0.0, [])] * (k - len(ids))
        heap.append(_kk_entry(groups, r))
    heapq.heapify(heap)
    return _kk_merge_all(heap, k)


def split_to_multiple(bins: list[list[int]], sizes: list[float], k: int) -> list[list[int]]:
    """Split multi-item bins until the bin count is a multiple of k (or no bin can be split).

    Used to give every data-parallel rank the same number of packs: the fullest splittable bin
    gives up its smallest item to a new bin. Returns new lists; the input is not changed.
    """
    bins = [list(b) for b in bins]
    while len(bins) % k:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda b: (sum(sizes[i] for i in bins[b]), -b))
        smallest = min(bins[b], key=lambda i: (sizes[i], i))
        bins[b].remove(smallest)
        bins.append([smallest])
    return bins
