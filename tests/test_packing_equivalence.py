"""The fast forms of the packing steps give exactly what the textbook forms give: Karmarkar-Karp
(re-sorting every merged partition), InfiniPipe's bucket packing and Hydraulis' LPT (scanning
every bucket per sequence), and splitting bins to a multiple of k (scanning every bin per split).
The textbook forms are written out here as the reference."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from lengthwise.plan.ir import Segment
from lengthwise.planners.hydraulis.packing import _lpt
from lengthwise.planners.infinipipe.chunking import Bucket, Mesh, SliceCost, pack_buckets
from lengthwise.planners.packing_utils import karmarkar_karp, split_to_multiple

CASES = settings(max_examples=80, deadline=None, database=None, derandomize=True)


def textbook_kk(sizes, k, equal_count=False):
    def entry(groups, tiebreak):
        groups = sorted(groups, key=lambda g: (-g[0], g[1][:1]))
        return (-(groups[0][0] - groups[-1][0]), tiebreak, groups)

    if equal_count:
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        heap = [entry([(sizes[i], [i]) for i in order[r:r + k]] + [(0.0, [])] * (k - len(order[r:r + k])), r)
                for r in range(0, len(order), k)]
    else:
        heap = [entry([(sizes[i], [i])] + [(0.0, [])] * (k - 1), i) for i in range(len(sizes))]
    heapq.heapify(heap)
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, t1, a = heapq.heappop(heap)
        _, t2, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        heapq.heappush(heap, entry(merged, min(t1, t2)))
    return [sorted(g[1]) for g in heap[0][2]]


sizes_lists = st.one_of(st.lists(st.integers(1, 5000), max_size=60), st.lists(st.integers(0, 3), max_size=60),
                        st.lists(st.floats(0, 10, allow_nan=False), max_size=40))


@CASES
@given(sizes=sizes_lists, k=st.integers(1, 9), equal_count=st.booleans())
def test_karmarkar_karp_matches_the_textbook_merge(sizes, k, equal_count):
    assert karmarkar_karp(sizes, k, equal_count=equal_count) == textbook_kk(sizes, k, equal_count)


def textbook_split(bins, sizes, k):
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


@CASES
@given(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=40), data=st.data(), k=st.integers(1, 12))
def test_split_to_multiple_matches_the_scan_of_every_bin(sizes, data, k):
    cut = sorted(data.draw(st.sets(st.integers(1, len(sizes)), max_size=len(sizes))) | {len(sizes)})
    bins = [list(range(a, b)) for a, b in zip([0] + cut[:-1], cut) if b > a]
    assert split_to_multiple(bins, sizes, k) == textbook_split(bins, sizes, k)


def textbook_buckets(tails, short, lengths, mesh, fit):
    buckets = [Bucket(segments=[t], time=fit.work(t.start, t.stop) + fit.c, tokens=t.num_tokens, order=i)
               for i, t in enumerate(tails)]
    threshold = mesh.time_threshold
    for seq_id in sorted(short, key=lambda i: (-lengths[i], i)):
        seg = Segment(seq_id, 0, lengths[seq_id])
        seconds = fit.work(0, seg.stop)
        fits_tokens = [b for b in buckets if b.tokens + seg.num_tokens <= mesh.token_threshold]
        if not fits_tokens:
            buckets.append(Bucket(segments=[seg], time=seconds + fit.c, tokens=seg.num_tokens, order=len(buckets)))
            continue
        fits_both = [b for b in fits_tokens if b.time + seconds <= threshold]
        if not fits_both:
            threshold = min(b.time for b in fits_tokens) + seconds
            fits_both = [b for b in fits_tokens if b.time + seconds <= threshold]
        min(fits_both, key=lambda b: (b.time / b.tokens, b.order)).add(seg, seconds)
    return [(b.segments, b.time, b.tokens) for b in buckets], threshold


@CASES
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=60), tails=st.lists(
    st.tuples(st.integers(1, 4000), st.integers(1, 3000)), max_size=6), token_threshold=st.integers(1, 4000),
    time_scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_bucket_packing_matches_the_scan_of_every_bucket(lengths, tails, token_threshold, time_scale):
    fit = SliceCost(a=1e-9, b=1e-6, c=1e-4)
    seeds = [Segment(len(lengths) + i, start, start + size) for i, (start, size) in enumerate(tails)]
    short = [i for i, n in enumerate(lengths) if n <= token_threshold]
    mesh = Mesh(bounds=(0, token_threshold, token_threshold + 1), token_threshold=token_threshold,
                time_threshold=time_scale * (fit.work(0, token_threshold) + fit.c))
    buckets, threshold = pack_buckets(seeds, short, lengths, mesh, fit)
    assert ([(b.segments, b.time, b.tokens) for b in buckets], threshold) == \
        textbook_buckets(seeds, short, lengths, mesh, fit)


def textbook_lpt(order, work, lengths, v, cap):
    bins, busy, room = [[] for _ in range(v)], [0.0] * v, [cap] * v
    for i in order:
        fits = [j for j in range(v) if room[j] >= lengths[i]]
        if not fits:
            return None
        j = min(fits, key=lambda j: (busy[j], j))
        bins[j].append(i)
        busy[j] += work[i]
        room[j] -= lengths[i]
    return [b for b in bins if b]


@CASES
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=50), v=st.integers(1, 8),
       cap=st.integers(200, 1500), shuffle=st.randoms(use_true_random=False))
def test_hydraulis_lpt_matches_the_scan_of_every_bin(lengths, v, cap, shuffle):
    work = [n * 1e-3 + (n * n) * 1e-7 for n in lengths]
    order = sorted(range(len(work)), key=lambda i: (-work[i], -lengths[i], i))
    shuffled = list(order)
    shuffle.shuffle(shuffled)   # any order, not only the planner's decreasing one
    for o in (order, shuffled):
        assert _lpt(o, work, lengths, v, cap) == textbook_lpt(o, work, lengths, v, cap)


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(sizes=st.one_of(st.lists(st.integers(1, 5000), min_size=1, max_size=80),
                       st.lists(st.integers(1, 3), min_size=1, max_size=80),
                       st.lists(st.floats(1e-6, 10, allow_nan=False), min_size=1, max_size=60)))
def test_two_way_karmarkar_karp_matches_the_textbook_merge(sizes):
    """Two groups of positive sizes (Hydraulis' two micro-batches) take karmarkar_karp's own path."""
    assert karmarkar_karp(sizes, 2) == textbook_kk(sizes, 2)
