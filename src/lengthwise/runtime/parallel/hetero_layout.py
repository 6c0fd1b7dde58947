"""Who holds and who owns every element of a heterogeneous plan's parameters: the layout of
the optimisation-propagation exchange (`hetero.py`), as plain data. Its own module because it
is arithmetic on shapes and column ranges with no process group: tests build it for any world
size without launching ranks (the cost model's element counts are checked against it), and
`HeteroExchange` only moves tensors along the blocks it computes.

The layout (`ExchangeLayout`, computed from every rank's holdings alone: every rank derives
the same, nothing travels). A parameter is seen as a rows x length row-major matrix split at
its TP dimension (rows: the product of the dimensions before it; a parameter nobody splits, or
one split along its first dimension, is one row), so that every rank's piece is a band of
columns, all rows. The column boundaries of every holder's band cut the columns into segments
of one holder set H (ranks ascending, h of them); column j of a segment is owned by H[j mod h].
An owner's elements of a segment are thus every h-th column of it, all rows: a strided grid in
the holder's flattened piece (strides width, h) and a contiguous block in the owner's master
shard (parameter by parameter in the model's order, segment by segment). Each rank owns about
1/h of what it holds, and ZeRO-1 over the d holders is what it stores: 12 bytes per owned
element, held / d of them (not 1/W of the whole model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Shard:
    """The piece of a parameter a rank holds: `parts` even chunks along `dim`, chunk `index`
    (parts 1: the whole parameter)."""

    dim: int = 0
    index: int = 0
    parts: int = 1


WHOLE = Shard()


def shard_indices(shape: tuple[int, ...], shard: Shard) -> torch.Tensor:
    """Flat indices into the whole parameter of the shard's elements, in the shard's own
    row-major order (a reference for tests; the exchange describes shards by `piece`)."""
    full = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64).view(shape)
    if shard.parts == 1:
        return full.reshape(-1)
    if shape[shard.dim] % shard.parts:
        raise ValueError(f"dimension {shard.dim} of {tuple(shape)} does not split into {shard.parts}")
    return full.chunk(shard.parts, dim=shard.dim)[shard.index].reshape(-1)


def piece(shape: tuple[int, ...], shard: Shard, dim: int | None = None) -> tuple[int, int, int, int]:
    """(rows, length, first, width): the shard's elements are columns first .. first + width - 1
    of the whole parameter seen as a rows x length row-major matrix (rows: the product of the
    dimensions before `dim`, the shard's own split dimension by default), in the shard's own
    row-major order. A whole parameter is every column (one row when `dim` is None)."""
    numel = int(torch.Size(shape).numel())
    dim = shard.dim if dim is None and shard.parts > 1 else dim
    if numel == 0 or dim is None:
        return 1, numel, 0, numel
    rows = int(torch.Size(shape[:dim]).numel())
    length = numel // rows
    if shard.parts == 1:
        return rows, length, 0, length
    if shard.dim != dim:
        raise ValueError(f"a shard of dimension {shard.dim} of {tuple(shape)} seen at dimension {dim}")
    if shape[dim] % shard.parts:
        raise ValueError(f"dimension {dim} of {tuple(shape)} does not split into {shard.parts}")
    width = length // shard.parts
    return rows, length, shard.index * width, width


class Block(NamedTuple):
    """Elements of one held piece that one owner owns (or, in a switch, that one old owner
    hands one new owner): a rows x cols grid at `local_offset` with strides `local_stride` on
    the sending or holding side and at `master_offset` with strides `master_stride` in the
    owner's master shard."""

    size: tuple[int, int]
    local_offset: int
    local_stride: tuple[int, int]
    master_offset: int
    master_stride: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.size[0] * self.size[1]


Holdings = dict[str, Shard]
"""One rank's propagation layout: parameter name -> the shard it holds (absent: not held)."""


class Segment(NamedTuple):
    """Columns start .. stop - 1 of a parameter's matrix view, held by the ranks `holders`
    (ascending); column j is owned by holders[j mod len(holders)]."""

    start: int
    stop: int
    holders: tuple[int, ...]

    def owned(self, k: int) -> tuple[int, int]:
        """(first column, count) of the columns the k-th holder owns (every h-th)."""
        h = len(self.holders)
        j0 = self.start + (k - self.start) % h
        return j0, max(0, (self.stop - j0 + h - 1) // h)


class ParamLayout(NamedTuple):
    rows: int
    length: int
    dim: int | None
    """The dimension the matrix view splits at (None: one row, nobody splits it)."""
    segments: tuple[Segment, ...]


class ExchangeLayout:
    """Who holds and who owns every element of every parameter, for `holdings[r]` of each rank r
    (module docstring); `dims`: the dimension each parameter is seen at (its TP split, so that
    two strategies see it alike); by default the holdings' split dimension, else one row."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], holdings: list[Holdings], *,
                 dims: dict[str, int | None] | None = None):
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.holdings = holdings
        self.world = W = len(holdings)
        self.numel = {n: int(torch.Size(s).numel()) for n, s in self.shapes.items()}
        self.params: dict[str, ParamLayout] = {}
        self.pieces: dict[str, dict[int, tuple[int, int, int, int]]] = {}
        for n, shape in self.shapes.items():
            split = {h[n].dim for h in holdings if n in h and h[n].parts > 1}
            dim = dims[n] if dims is not None and n in dims else (min(split) if split else None)
            if split - {dim}:
                raise ValueError(f"{n} is split along dimensions {sorted(split)}, seen at {dim}")
            pieces = {r: piece(shape, h[n], dim) for r, h in enumerate(holdings) if n in h}
            rows, length = piece(shape, WHOLE, dim)[:2]
            cuts = sorted({0, length} | {c for _, _, f, w in pieces.values() for c in (f, f + w)})
            segments = []
            for a, b in zip(cuts, cuts[1:]):
                held_by = tuple(r for r, (_, _, f, w) in pieces.items() if f <= a and b <= f + w)
                if not held_by:
                    raise ValueError(f"columns {a} .. {b - 1} of {n} {shape} are held by no rank")
                segments.append(Segment(a, b, held_by))
            self.params[n] = ParamLayout(rows, length, dim, tuple(segments))
            self.pieces[n] = pieces
        # each owner's master shard: parameter by parameter, segment by segment, a rows x count
        # block of the columns it owns
        self.base: dict[tuple[str, int], int] = {}  # (name, segment) -> block start in its owner's part
        self.owned_count = {n: [0] * W for n in self.shapes}
        for n, p in self.params.items():
            for s, seg in enumerate(p.segments):
                for k, o in enumerate(seg.holders):
                    count = seg.owned(k)[1]
                    if count:
                        self.base[n, s, o] = self.owned_count[n][o]
                        self.owned_count[n][o] += p.rows * count
        self.shard_offset: dict[str, list[int]] = {}
        total = [0] * W
        for n in self.shapes:
            self.shard_offset[n] = list(total)
            total = [t + c for t, c in zip(total, self.owned_count[n])]
        self.shard_size = total
        # each rank's held pieces, flattened in parameter order
        self.local_offset: list[dict[str, int]] = []
        self.local_size: list[int] = []
        for r, h in enumerate(holdings):
            offsets, at = {}, 0
            for n in self.shapes:
                if n in h:
                    offsets[n] = at
                    rows, _, _, width = self.pieces[n][r]
                    at += rows * width
            self.local_offset.append(offsets)
            self.local_size.append(at)

    def _block(self, n: str, s: int, k: int, holder: int) -> Block | None:
        p = self.params[n]
        seg = p.segments[s]
        j0, count = seg.owned(k)
        if not count:
            return None
        rows, _, first, width = self.pieces[n][holder]
        owner = seg.holders[k]
        return Block((p.rows, count), self.local_offset[holder][n] + j0 - first, (width, len(seg.holders)),
                     self.shard_offset[n][owner] + self.base[n, s, owner], (count, 1))

    def held_blocks(self, rank: int) -> list[list[Block]]:
        """For each owner, the blocks of `rank`'s pieces it owns, in parameter then segment order."""
        out: list[list[Block]] = [[] for _ in range(self.world)]
        for n, p in self.params.items():
            for s, seg in enumerate(p.segments):
                if rank in seg.holders:
                    for k, o in enumerate(seg.holders):
                        b = self._block(n, s, k, rank)
                        if b is not None:
                            out[o].append(b)
        return out

    def owned_blocks(self, rank: int) -> list[list[Block]]:
        """For each holder, the blocks of its pieces `rank` owns, in the holder's order."""
        out: list[list[Block]] = [[] for _ in range(self.world)]
        for n, p in self.params.items():
            for s, seg in enumerate(p.segments):
                if rank in seg.holders:
                    k = seg.holders.index(rank)
                    for r in seg.holders:
                        b = self._block(n, s, k, r)
                        if b is not None:
                            out[r].append(b)
        return out

    def owned_indices(self, name: str, rank: int) -> torch.Tensor:
        """Flat indices into the whole parameter of `rank`'s owned elements, in its master order."""
        p = self.params[name]
        parts = []
        for s, seg in enumerate(p.segments):
            if rank in seg.holders:
                j0, count = seg.owned(seg.holders.index(rank))
                if count:
                    cols = j0 + len(seg.holders) * torch.arange(count, dtype=torch.int64)
                    parts.append((torch.arange(p.rows, dtype=torch.int64)[:, None] * p.length + cols).reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def held_elements(self) -> list[int]:
        """Elements every rank holds."""
        return list(self.local_size)

    def moves(self, new: "ExchangeLayout", rank: int) -> tuple[list[list[Block]], list[list[Block]]]:
        """A switch from this layout to `new`: (what `rank` sends each new owner, as old owner;
        what it receives from each old owner, as new owner), as blocks whose `local` side is the
        old master shard and `master` side the new one, in one order on both sides."""
        if list(self.shapes.items()) != list(new.shapes.items()):
            raise ValueError("a strategy switch keeps the parameters (and their order)")
        send: list[list[Block]] = [[] for _ in range(self.world)]
        recv: list[list[Block]] = [[] for _ in range(self.world)]
        for n, p in self.params.items():
            q = new.params[n]
            if (p.rows, p.length) != (q.rows, q.length):
                raise ValueError(f"{n} is seen at dimension {p.dim} by one strategy and {q.dim} by the other")
            for s, a in enumerate(p.segments):
                for t, b in enumerate(q.segments):
                    lo, hi = max(a.start, b.start), min(a.stop, b.stop)
                    if lo >= hi:
                        continue
                    ha, hb = len(a.holders), len(b.holders)
                    step = ha * hb // math.gcd(ha, hb)
                    for x in range(lo, min(hi, lo + step)):
                        old, now = a.holders[x % ha], b.holders[x % hb]
                        if rank not in (old, now):
                            continue
                        j0a, ja = a.owned(x % ha)[0], b.owned(x % hb)[0]
                        count = (hi - x + step - 1) // step
                        block = Block((p.rows, count),
                                      self.shard_offset[n][old] + self.base[n, s, old] + (x - j0a) // ha,
                                      (a.owned(x % ha)[1], step // ha),
                                      new.shard_offset[n][now] + new.base[n, t, now] + (x - ja) // hb,
                                      (b.owned(x % hb)[1], step // hb))
                        if old == rank:
                            send[now].append(block)
                        if now == rank:
                            recv[old].append(block)
        return send, recv
