"""Skrull's Distributed-Aware Context Parallelism (skrull.txt §4.1, §4.3.2 Algorithm 1, appendix B
Algorithm 3): which sequences of one micro-batch are sharded over the CP group, and which CP rank
holds each of the others whole.

Notation (skrull Table 2): micro-batch lengths s_1..s_n, CP degree c, BucketSize C (tokens one
CP rank holds for activations), D_i = 1 when sequence i is *distributed* (sharded over all c
ranks, `Segment.cp_rank = SHARDED`), A_ir = 1 when the *local* sequence i lives whole on rank r.
A rank holds ceil(s_i / c) tokens of each distributed sequence (the last shard may be shorter;
we count the larger one so the memory bound is never optimistic).

The DACP problem (skrull eq. 1-7, rebuilt from the prose; the extraction lost the formulas):

    minimise   T = max_r T_r                                                     (1)
    T_r  = max( T_comm(V),  T_comp(F_r^loc) ) + T_comp(F^dist)                   (2)
    F_r^loc = sum_i (1 - D_i) A_ir FLOPs(s_i)            local work of rank r    (3)
    F^dist  = sum_i D_i FLOPs(s_i) / c                   distributed work, each rank (4)
    V       = sum_i D_i Vol(s_i)                         K/V bytes exchanged     (5)
    sum_r A_ir = 1 - D_i,   D_i, A_ir in {0, 1}          every sequence once     (6)
    sum_i D_i ceil(s_i / c) + sum_i (1 - D_i) A_ir s_i <= C   for every r        (7)

The max in (2) is the overlap Skrull gets from running local attention while the distributed
sequences' K/V travel (skrull fig. 2d). FLOPs(s) is skrull eq. 13-14 (linear layers 2 * P_mm * s
plus causal attention 2 * d_q * s (s + 1) per layer, `lengthwise.cost.flops`), Vol(s) is eq. 15
(2 * d_kv * s bf16 values per layer, all-gathered in forward and twice in backward) and T_comm is
eq. 16 (alpha-beta, `CostModel.cp_comm_time`).

The heuristic (Algorithm 1 with Algorithm 3's UpdateLocal / UpdateAll / RollBack) visits the
sequences shortest first and keeps two arrays, RemainBucket (tokens each rank can still take) and
Loads (FLOPs each rank already runs):

1. put the sequence whole on the rank with the least load, if its bucket has room (balance
   compute first, principle ii);
2. else on the rank with the most room, if it fits (avoid sharding, principle i);
3. else shard it over all ranks, each taking ceil(s / c) tokens; when the fullest bucket cannot
   take that, roll back: shard the largest local sequence of the fullest bucket and retry
   (principle iii), until everything fits or the fullest bucket has no local sequence left (then
   DACP fails and GDS uses one more micro-batch).

Not in the paper, on by default (`refine`): Algorithm 1 shards only for memory, so with a large
BucketSize the longest sequence of a micro-batch stays whole on one rank while c - 1 ranks idle
(a 40K-token sequence local on one of 8 H100s takes 8x its sharded time). `refine_by_objective`
evaluates eq. 1-2 with the cost model along a path that shards the slowest rank's largest local
sequence step by step and keeps the best point (`--refine false` plans with the paper's
heuristic alone, for comparison; compare's simulated figures are in
benchmarks/results/compare_suite.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lengthwise.plan.ir import SHARDED, Chunk, Segment

if TYPE_CHECKING:
    from lengthwise.cost import CostModel


def shard_tokens(num_tokens: int, cp: int, kv_ratio: float = 0.0) -> int:
    """Bucket tokens a distributed sequence takes on each CP rank: the larger shard, plus the
    K/V of the whole sequence that every layer keeps after its all-gather (the executor's, for
    the backward), `kv_ratio` bucket tokens per token of the sequence (`kv_bucket_ratio`)."""
    return -(-num_tokens // cp) + (math.ceil(num_tokens * kv_ratio) if kv_ratio else 0)


@dataclass(kw_only=True)
class Buckets:
    """DACP's running state for one micro-batch (skrull Algorithm 1: RemainBucket, Loads)."""

    remain: list[int]
    """Tokens each CP rank can still hold (BucketSize minus what it holds); may dip below 0
    inside a roll-back."""
    loads: list[float]
    """FLOPs each CP rank runs so far (its local sequences plus its share of distributed ones)."""
    local: list[list[int]] = field(default_factory=list)
    """Sequence ids held whole by each CP rank."""
    placement: dict[int, int] = field(default_factory=dict)
    """seq_id -> CP rank holding it whole, or SHARDED."""
    kv_ratio: float = 0.0
    """Bucket tokens per token of a distributed sequence for its gathered K/V (`shard_tokens`)."""

    @classmethod
    def empty(cls, cp: int, bucket_size: int, kv_ratio: float = 0.0) -> Buckets:
        return cls(remain=[bucket_size] * cp, loads=[0.0] * cp, local=[[] for _ in range(cp)], kv_ratio=kv_ratio)


def update_local(b: Buckets, seq: int, rank: int, tokens: int, flops: float) -> None:
    """Algorithm 3 UpdateLocal: rank holds the whole sequence."""
    b.remain[rank] -= tokens
    b.loads[rank] += flops
    b.local[rank].append(seq)
    b.placement[seq] = rank


def update_all(b: Buckets, seq: int, tokens: int, flops: float) -> None:
    """Algorithm 3 UpdateAll: every rank holds one shard and runs 1/c of the work (eq. 4)."""
    cp = len(b.remain)
    share = shard_tokens(tokens, cp, b.kv_ratio)
    for r in range(cp):
        b.remain[r] -= share
        b.loads[r] += flops / cp
    b.placement[seq] = SHARDED


def _undo_local(b: Buckets, seq: int, tokens: int, flops: float) -> None:
    rank = b.placement.pop(seq)
    b.local[rank].remove(seq)
    b.remain[rank] += tokens
    b.loads[rank] -= flops


def roll_back(b: Buckets, need: int, lengths: dict[int, int], flops: dict[int, float]) -> bool:
    """Algorithm 3 RollBack: shard local sequences of the fullest bucket until every bucket has
    `need` tokens free. False when the fullest bucket holds no local sequence to shard."""
    while min(b.remain) < need:
        fullest = min(range(len(b.remain)), key=lambda r: (b.remain[r], r))
        if not b.local[fullest]:
            return False
        # Sharding the largest local sequence frees the most of this bucket.
        victim = max(b.local[fullest], key=lambda i: (lengths[i], i))
        _undo_local(b, victim, lengths[victim], flops[victim])
        update_all(b, victim, lengths[victim], flops[victim])
    return True


def place_sequence(b: Buckets, seq: int, lengths: dict[int, int], flops: dict[int, float]) -> bool:
    """One step of Algorithm 1 for one sequence; False when even roll-back cannot fit it."""
    tokens, work = lengths[seq], flops[seq]
    cp = len(b.remain)
    least_loaded = min(range(cp), key=lambda r: (b.loads[r], r))
    if b.remain[least_loaded] >= tokens:  # Algorithm 1 lines 6-8
        update_local(b, seq, least_loaded, tokens, work)
        return True
    roomiest = max(range(cp), key=lambda r: (b.remain[r], -r))
    if b.remain[roomiest] >= tokens:  # lines 10-12
        update_local(b, seq, roomiest, tokens, work)
        return True
    if not roll_back(b, shard_tokens(tokens, cp, b.kv_ratio), lengths, flops):  # lines 14-18
        return False
    update_all(b, seq, tokens, work)
    return True


def dacp(seq_ids: list[int], lengths: dict[int, int], flops: dict[int, float], *, cp: int,
         bucket_size: int, kv_ratio: float = 0.0) -> dict[int, int] | None:
    """DACP placement of one micro-batch (seq_id -> CP rank or SHARDED), or None when it fails.

    `lengths` and `flops` map seq_id to tokens and training FLOPs (eq. 13-14)."""
    b = Buckets.empty(cp, bucket_size, kv_ratio)
    for seq in sorted(seq_ids, key=lambda i: (lengths[i], i)):  # ascending (Algorithm 1 line 2)
        if not place_sequence(b, seq, lengths, flops):
            return None
    assert min(b.remain) >= 0
    return b.placement


def dacp_chunk(placement: dict[int, int], lengths: dict[int, int]) -> Chunk:
    """The micro-batch as a chunk: distributed sequences first, then each rank's local ones."""
    order = sorted(placement, key=lambda i: (placement[i], i))
    return Chunk(tuple(Segment(i, 0, lengths[i], placement[i]) for i in order))


def rank_tokens(chunk: Chunk, cp: int, kv_ratio: float = 0.0) -> list[int]:
    """Bucket tokens each CP rank holds for a chunk: left side of constraint (7)."""
    sharded = sum(shard_tokens(s.num_tokens, cp, kv_ratio) for s in chunk.segments if s.cp_rank == SHARDED)
    held = [sharded] * cp
    for s in chunk.segments:
        if s.cp_rank != SHARDED:
            held[s.cp_rank] += s.num_tokens
    return held


def train_time(cost: CostModel, chunk: Chunk, *, layers: int, tp: int, cp: int) -> float:
    """Forward plus backward seconds of a chunk spread evenly over tp x cp GPUs (T_comp)."""
    if not chunk.segments:
        return 0.0
    return (cost.forward_time(chunk, layers=layers, tp=tp, cp=cp, head=True)
            + cost.backward_time(chunk, layers=layers, tp=tp, cp=cp, head=True))


@dataclass(frozen=True, kw_only=True)
class DacpCost:
    """Skrull eq. 1-5 evaluated with the cost model for one CP group."""

    cost: CostModel
    """The cost model (T_comp, T_comm)."""
    layers: int
    """Decoder layers the group runs (all of them with pp = 1)."""
    tp: int
    """Tensor-parallel degree of each CP rank."""
    cp: int
    """CP degree c."""
    inter_node: bool
    """Whether the CP group spans nodes (slower K/V exchange)."""
    kv_ratio: float = 0.0
    """Bucket tokens per token of a distributed sequence for its gathered K/V (`shard_tokens`)."""

    def comp_s(self, segments: list[Segment], *, cp: int) -> float:
        """T_comp of segments spread over cp ranks (cp = 1: one rank's local sequences)."""
        return train_time(self.cost, Chunk(tuple(segments)), layers=self.layers, tp=self.tp, cp=cp)

    def comm_s(self, dist_tokens: int) -> float:
        """T_comm of eq. 5 and 15-16: forward K/V all-gather, backward about twice it. The volume
        depends only on the distributed tokens, so one segment of their total stands for all."""
        if not dist_tokens:
            return 0.0
        probe = Chunk((Segment(0, 0, dist_tokens, SHARDED),))
        return 3 * self.cost.cp_comm_time(probe, layers=self.layers, tp=self.tp, cp=self.cp,
                                          inter_node=self.inter_node)

    def time(self, chunk: Chunk) -> float:
        """Eq. 1-2: the slowest rank, local work overlapping the distributed K/V exchange."""
        rc = rank_costs(chunk, self)
        return max(rc.comm_s, *rc.local_s) + self.comp_s(rc.dist, cp=self.cp)


@dataclass(kw_only=True)
class RankCosts:
    """One micro-batch's eq. 2-5 terms, updated in place as local sequences get sharded."""

    local: list[list[Segment]]
    """Segments each CP rank holds whole."""
    dist: list[Segment]
    """Distributed segments."""
    held: list[int]
    """Tokens each rank holds (left side of eq. 7)."""
    local_s: list[float]
    """T_comp of each rank's local segments, seconds."""
    comm_s: float = 0.0
    """T_comm of the distributed segments' K/V, seconds."""

    @property
    def dist_tokens(self) -> int:
        return sum(s.num_tokens for s in self.dist)


def rank_costs(chunk: Chunk, model: DacpCost) -> RankCosts:
    """Eq. 2-5 terms of a placed micro-batch (with cp = 1 everything counts as distributed)."""
    if model.cp == 1:
        chunk = Chunk(tuple(Segment(s.seq_id, s.start, s.stop, SHARDED) for s in chunk.segments))
    local = [[s for s in chunk.segments if s.cp_rank == r] for r in range(model.cp)]
    dist = [s for s in chunk.segments if s.cp_rank == SHARDED]
    rc = RankCosts(local=local, dist=dist, held=rank_tokens(chunk, model.cp, model.kv_ratio),
                   local_s=[model.comp_s(segs, cp=1) for segs in local])
    rc.comm_s = model.comm_s(rc.dist_tokens)
    return rc


def shard_largest_on_slowest(rc: RankCosts, model: DacpCost, bucket_size: int) -> Segment | None:
    """Shard the slowest rank's largest local segment in place and return it; None (and no
    change) when that rank waits on communication or the shards would break eq. 7."""
    slowest = max(range(model.cp), key=lambda r: (rc.local_s[r], -r))
    if rc.local_s[slowest] <= rc.comm_s:
        return None
    victim = max(rc.local[slowest], key=lambda s: (s.num_tokens, s.seq_id))
    share = shard_tokens(victim.num_tokens, model.cp, model.kv_ratio)
    held = [h + share - (victim.num_tokens if r == slowest else 0) for r, h in enumerate(rc.held)]
    if max(held) > bucket_size:
        return None
    rc.held = held
    rc.local[slowest].remove(victim)
    rc.local_s[slowest] = model.comp_s(rc.local[slowest], cp=1)
    rc.dist.append(Segment(victim.seq_id, victim.start, victim.stop, SHARDED))
    rc.comm_s = model.comm_s(rc.dist_tokens)
    return victim


def checkpoints(n: int) -> list[int]:
    """Path lengths at which refine_by_objective evaluates eq. 1: every one up to 8, then about
    25% apart, and the last (each evaluation costs a pass over all distributed segments)."""
    points, k = [], 0
    while k < n:
        points.append(k)
        k = k + 1 if k < 8 else -(-k * 5 // 4)
    return points + [n]


def refine_by_objective(placement: dict[int, int], lengths: dict[int, int], model: DacpCost,
                        bucket_size: int) -> dict[int, int]:
    """Our addition to Algorithm 1, which shards only for memory, so one long local sequence can
    leave c - 1 ranks idle: follow the path that keeps sharding the slowest rank's largest local
    sequence while it stays feasible and local work outweighs communication, and keep the point
    on that path with the lowest eq. 1 (sharding one of two equally long stragglers gains nothing
    until the other is sharded too, so the path does not stop at the first step that does not
    help). Distributed work and communication only grow along the path, so the search ends once
    they alone reach the best time found."""
    if model.cp == 1:
        return placement
    rc = rank_costs(dacp_chunk(placement, lengths), model)
    base = list(rc.dist)
    heads, comms, path = [max(rc.comm_s, *rc.local_s)], [rc.comm_s], []
    while (victim := shard_largest_on_slowest(rc, model, bucket_size)) is not None:
        path.append(victim)
        heads.append(max(rc.comm_s, *rc.local_s))
        comms.append(rc.comm_s)
    best_t, best_k = math.inf, 0
    for k in checkpoints(len(path)):
        dist_s = model.comp_s(base + [Segment(v.seq_id, v.start, v.stop, SHARDED) for v in path[:k]], cp=model.cp)
        if comms[k] + dist_s >= best_t:
            break
        if heads[k] + dist_s < best_t:  # eq. 2
            best_t, best_k = heads[k] + dist_s, k
    return {**placement, **{v.seq_id: SHARDED for v in path[:best_k]}}
