"""Heterogeneous pipelines: the optimisation-propagation exchange (hydraulis §5.2).

In a Hydraulis plan each data-parallel pipeline has its own tp x pp x cp, so one parameter can be
held whole by a rank of one pipeline and as tp row or column shards by ranks of another. No
all-reduce over "the ranks holding a parameter" fits: their pieces have different shapes.

Which ranks own the optimizer state. Every element's owner is one of its holders. The holders
of an element are the ranks whose propagation pieces contain it: one rank per (pipeline, CP
rank) for a tp-split parameter (d of them, the same d for every layer, since every pipeline
holds every layer once per CP rank), every TP rank of a pipeline for a TP-replicated one (the
norms; K/V projections replicated over TP), both the first and the last stage of a pipeline
for a tied embedding. The owner holds the fp32 master element and AdamW's two moments.

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

Volume. Each step is a reduce-scatter and an all-gather among the holders of each element, as
one all-to-all each way over the world (most splits empty):
- `push(grads)`: every holder sends its gradient of the elements others own to their owners;
  the owner sums what it receives (its own slice included) from zero, rank by rank: the
  gradient of a single process running the whole batch, since each rank's loss is already
  divided by the global loss-token count, and the same sums on every device.
- `step()`: AdamW on the owner's flat shard (elementwise, so the layout does not change
  results); in training, one torch AdamW over per-parameter views of `master`
  (`train/dist_hetero.py`), after which every rank pulls its next weights.
- `pull()`: every owner sends its updated elements to their other holders, cast to the
  propagation dtype.
Per element and direction h - 1 transfers, exactly the 2 (h - 1) / h of a ring all-reduce
among the h holders over both directions: per rank, held - owned each way
(`planners/hydraulis/cost.exchange_elements`). (The previous layout dealt elements round-robin
over all W ranks, owner outside the holders: (W - 1) / W * h / (h - 1) of that, 1.97x at h = 2.)

Strategy switches. The owners depend on the strategy, so a switch moves the master and both
moments from the old owners to the new ones: one all-to-all (`HeteroExchange.switch`), 12 bytes
per element whose owner changes (every element whose owner stays is a local copy). The blocks
of a move are again strided grids on both sides: an old owner's columns (every h-th of an old
segment) meet a new owner's (every h'-th of a new segment) at every lcm(h, h')-th column of
their overlap. Both layouts must see each parameter at the same TP dimension (the executor
passes it from the model: `tensor_parallel.tp_shard_dim`).

The master starts from the propagation layout itself (`init_master_from_held`: every element
pushed by its lowest holder only, the others push zeros), and parameters are laid out in the
model's order whatever the strategy.

No index maps. Push, pull and the switch's move copy strided grids between the flattened
pieces, the all-to-all buffers and the master shard as views; the exchange keeps only a few
Python tuples per held parameter, segment and owner. The blocks of one plan shape are computed
once and cached by `HeteroExchange.for_shape` while the shape repeats (the few most recent
shapes, `CACHED_SHAPES`). (Index maps, one int32 or int64 position per held element and per
element owned of what every rank holds, took 39 GiB of an 80 GB GPU in Hydraulis' own
LLaMA-32B setting on 64 GPUs.)

Tied embeddings (Qwen2's layout). The head is the embedding: one parameter,
`model.embed_tokens.weight`, held by the first and the last stage of every pipeline (whole, or
as the tp ranks' vocabulary rows); both stages push their gradient of it (each use's part) and
pull the same updated rows, so the two copies stay equal and the sum is that of one process.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lengthwise.runtime.parallel.dp import held_parameters, local, stage_holds
from lengthwise.runtime.model import StagePart, meta_model
from lengthwise.runtime.parallel.tensor_parallel import tp_partial_names, tp_shard_dim

log = logging.getLogger(__name__)


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


def _strided(flat: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """A strided view into a contiguous 1-D tensor, `offset` elements from its start."""
    return flat.as_strided(size, stride, flat.storage_offset() + offset)


class HeteroExchange:
    """This rank's master shard in the owned-by-holders layout (module docstring) and the
    push and pull of one plan shape."""

    CACHED_SHAPES = 4
    """Plan shapes whose exchanges `for_shape` keeps (least recently used dropped first): the
    current strategy, the one a switch leaves, and a few a planner alternates between."""
    _cache: OrderedDict = OrderedDict()

    def __init__(self, shapes: dict[str, tuple[int, ...]], holdings: list[Holdings], *,
                 dims: dict[str, int | None] | None = None, group=None, device=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if len(holdings) != self.world:
            raise ValueError(f"{len(holdings)} holdings for {self.world} ranks")
        self.layout = layout = ExchangeLayout(shapes, holdings, dims=dims)
        self.shapes, self.holdings, self.numel = layout.shapes, holdings, layout.numel
        self.device = device or torch.device("cpu")
        self.shard_offset = layout.shard_offset
        self.shard_size = layout.shard_size[self.rank]
        # as holder: the blocks of every owner, in the order both sides use on the wire
        self.held_blocks = layout.held_blocks(self.rank)
        self.local_size = layout.local_size[self.rank]
        self.local_counts = [sum(b.numel for b in bs) for bs in self.held_blocks]
        # as owner: for each rank r, the blocks of what r holds and this rank owns, in r's order
        self.owned_blocks = layout.owned_blocks(self.rank)
        self.owner_counts = [sum(b.numel for b in bs) for bs in self.owned_blocks]
        self.master: torch.Tensor | None = None
        self.bytes_sent = 0
        """Bytes this rank sent to other ranks (self-slices excluded): pulls, pushes and moves."""

    @classmethod
    def for_shape(cls, key, shapes, holdings, *, dims=None, group=None, device=None) -> "HeteroExchange":
        """The exchange of a plan shape `key`, built once and reused while the shape repeats
        (the same object: callers compare exchanges by identity). At most `CACHED_SHAPES` kept
        per process, so that a run visiting many strategies keeps neither their blocks nor
        their master shards."""
        ex = cls._cache.get(key)
        if ex is None:
            ex = cls._cache[key] = cls(shapes, holdings, dims=dims, group=group, device=device)
            while len(cls._cache) > cls.CACHED_SHAPES:
                cls._cache.popitem(last=False)
        else:
            cls._cache.move_to_end(key)
        return ex

    def switch(self, key, shapes, holdings, *, dims=None, state: tuple[torch.Tensor, ...] = ()) -> "HeteroExchange":
        """A strategy switch (collective): the exchange of the new plan shape, with this one's
        master shard and the tensors `state` laid out like it (AdamW's moments) moved to the new
        owners in one all-to-all (`moved`: the moved `state`), then the new layout's first pull
        (`last_pull`). Logs and keeps (`switch_cost`) its measured cost: the blocks' build
        (cached shapes cost nothing), the move (seconds, bytes this rank sent), the pull."""
        started = time.perf_counter()
        new = type(self).for_shape(key, shapes, holdings, dims=dims, group=self.group, device=self.device)
        send, recv = self.layout.moves(new.layout, self.rank)
        built = time.perf_counter() - started
        tensors = (self.master, *state)
        before = new.bytes_sent
        moved = new.move(tensors, send, recv)
        new.master, new.moved = moved[0], tuple(moved[1:])
        if new is not self:
            self.master = None  # moved: the cache keeps no stale master shard
        move_s = time.perf_counter() - started - built
        state_bytes = new.bytes_sent - before
        new.last_pull = new.pull()
        new.switch_cost = {"build_s": built, "move_s": move_s, "state_bytes_moved": state_bytes,
                           "pull_s": time.perf_counter() - started - built - move_s,
                           "pull_bytes": new.bytes_sent - before - state_bytes}
        log.info("strategy switch to %s: blocks %.4f s, %d bytes of optimizer state moved in %.4f s, first pull "
                 "%.4f s (%d bytes sent)", key, built, state_bytes, move_s, new.switch_cost["pull_s"],
                 new.switch_cost["pull_bytes"])
        return new

    def move(self, tensors, send: list[list[Block]], recv: list[list[Block]]) -> list[torch.Tensor]:
        """`tensors` (laid out like the old master shard, one dtype) in this layout, moved by the
        blocks of `ExchangeLayout.moves`: one all-to-all for all of them."""
        dtype = tensors[0].dtype
        k = len(tensors)
        send_counts = [k * sum(b.numel for b in bs) for bs in send]
        recv_counts = [k * sum(b.numel for b in bs) for bs in recv]
        buffer = torch.empty(sum(send_counts), dtype=dtype, device=self.device)
        at = 0
        for bs in send:
            for t in tensors:
                flat = t.contiguous()
                for b in bs:
                    buffer[at:at + b.numel].view(b.size).copy_(_strided(flat, b.size, b.local_stride, b.local_offset))
                    at += b.numel
        got = self._all_to_all(buffer, send_counts, recv_counts)
        del buffer
        out = [torch.zeros(self.shard_size, dtype=dtype, device=self.device) for _ in tensors]
        at = 0
        for bs in recv:
            for t in out:
                for b in bs:
                    _strided(t, b.size, b.master_stride, b.master_offset).copy_(got[at:at + b.numel].view(b.size))
                    at += b.numel
        return out

    # ---------------------------------------------------------------- master state
    def init_master(self, full: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
        """This rank's master shard from whole parameters (every rank passes the same values)."""
        parts = [full[n].detach().reshape(-1)[self.owned_indices(n)].to(self.device, dtype) for n in self.shapes]
        self.master = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self.device)
        return self.master

    def owned_indices(self, name: str, rank: int | None = None) -> torch.Tensor:
        """Flat indices into the whole parameter of a rank's owned elements (this rank's by
        default), in master order (for tests and for gathering whole weights)."""
        return self.layout.owned_indices(name, self.rank if rank is None else rank)

    def first_holder_mask(self) -> torch.Tensor:
        """Boolean mask over this rank's held elements (local flat layout, as `flatten_local`):
        True where no lower rank holds the element. Pushing held values times this mask sums
        exactly one copy of every element (the others add zeros): the master from the
        propagation layout, bit for bit, whatever the layout."""
        mask = []
        for n in self.shapes:
            pieces = self.layout.pieces[n]
            if self.rank not in pieces:
                continue
            rows, length = self.layout.params[n].rows, self.layout.params[n].length
            covered = torch.zeros(rows, length, dtype=torch.bool)
            for r in range(self.rank):
                if r in pieces:
                    _, _, first, width = pieces[r]
                    covered[:, first:first + width] = True
            _, _, first, width = pieces[self.rank]
            mask.append((~covered[:, first:first + width]).reshape(-1))
        return torch.cat(mask).to(self.device) if mask else torch.zeros(0, dtype=torch.bool, device=self.device)

    def init_master_from_held(self, local_values: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """This rank's master shard from the held pieces of every rank (collective; each element
        taken from its lowest holder, so every rank's pieces may come from another layout)."""
        mask = self.first_holder_mask()
        values = torch.where(mask, local_values.reshape(-1).to(dtype), torch.zeros((), dtype=dtype))
        self.master = self.push(values, dtype=dtype)
        return self.master

    def master_view(self, name: str, flat: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's owned elements of one parameter in `flat` (the master by default), in
        master order (`owned_indices`)."""
        flat = self.master if flat is None else flat
        start = self.shard_offset[name][self.rank]
        return flat[start:start + self.layout.owned_count[name][self.rank]]

    # ---------------------------------------------------------------- exchange
    def _all_to_all(self, send: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=self.group)
        self.bytes_sent += (send.numel() - send_counts[self.rank]) * send.element_size()
        return recv

    def pull(self, dtype=None) -> torch.Tensor:
        """This rank's held elements (all held parameters' shards, flattened, in parameter
        order) from the owners' master shards."""
        dtype = dtype or self.master.dtype
        master = self.master.contiguous()
        send = torch.empty(sum(self.owner_counts), dtype=dtype, device=self.device)
        at = 0
        for b in (b for bs in self.owned_blocks for b in bs):
            send[at:at + b.numel].view(b.size).copy_(_strided(master, b.size, b.master_stride, b.master_offset))
            at += b.numel
        recv = self._all_to_all(send, self.owner_counts, self.local_counts)
        del send
        out = torch.empty(self.local_size, dtype=dtype, device=self.device)
        at = 0
        for b in (b for bs in self.held_blocks for b in bs):
            _strided(out, b.size, b.local_stride, b.local_offset).copy_(recv[at:at + b.numel].view(b.size))
            at += b.numel
        return out

    def push(self, local_grads: torch.Tensor, dtype=None) -> torch.Tensor:
        """Sum every rank's gradient slices into the owners' shards; returns this rank's
        summed gradient shard (laid out like `master`), summed in `dtype`. The slices travel in
        their own dtype when `dtype` holds every value of it exactly (bf16 gradients summed in
        fp32: half the bytes of upcasting before the send, the same sums bit for bit). Each
        element is summed from zero over its holders in rank order, on every device."""
        dtype = dtype or (self.master.dtype if self.master is not None else local_grads.dtype)
        flat = local_grads.reshape(-1).contiguous()
        wire = flat.dtype if torch.promote_types(flat.dtype, dtype) == dtype else dtype
        send = torch.empty(sum(self.local_counts), dtype=wire, device=flat.device)
        at = 0
        for b in (b for bs in self.held_blocks for b in bs):
            send[at:at + b.numel].view(b.size).copy_(_strided(flat, b.size, b.local_stride, b.local_offset))
            at += b.numel
        recv = self._all_to_all(send, self.local_counts, self.owner_counts)
        del send
        grad = torch.zeros(self.shard_size, dtype=dtype, device=self.device)
        at = 0
        for b in (b for bs in self.owned_blocks for b in bs):  # rank by rank
            _strided(grad, b.size, b.master_stride, b.master_offset).add_(recv[at:at + b.numel].view(b.size))
            at += b.numel
        return grad

    # ---------------------------------------------------------------- local tensors
    def held_names(self) -> list[str]:
        mine = self.holdings[self.rank]
        return [n for n in self.shapes if n in mine]

    def flatten_local(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate this rank's held shards (local row-major) in parameter order."""
        parts = [tensors[n].reshape(-1) for n in self.held_names()]
        return torch.cat(parts) if parts else torch.zeros(0)

    def unflatten_local(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a pulled buffer into this rank's held shards (shaped as held)."""
        out, off = {}, 0
        for n in self.held_names():
            shape = list(self.shapes[n])
            shard = self.holdings[self.rank][n]
            shape[shard.dim] //= shard.parts
            k = int(torch.Size(shape).numel())
            out[n] = flat[off:off + k].view(shape)
            off += k
        return out

    def held_elements(self) -> list[int]:
        """Elements every rank holds."""
        return self.layout.held_elements()

    def owned_elements(self) -> list[int]:
        """Elements every rank owns (the size of its master shard)."""
        return list(self.layout.shard_size)


# -------------------------------------------------------------------- holdings of a strategy
def strategy_holdings(spec, pipelines, names) -> tuple[list[Holdings], dict[str, int | None]]:
    """Every rank's holdings under a strategy, from the model and the strategy alone (ranks
    laid out as `distributed/mesh.plan_places`: pipeline, stage, CP rank, TP rank innermost),
    and the dimension each parameter is seen at (its TP split, `tensor_parallel.tp_shard_dim`,
    whatever the strategy). `pipelines`: (tp, pp, cp, layers per stage) of each pipeline;
    `names`: the parameters, in the model's order."""
    dims = {n: tp_shard_dim(spec, n, None) for n in names}
    out: list[Holdings] = []
    for tp, pp, cp, stage_layers in pipelines:
        start = 0
        for s, count in enumerate(stage_layers):
            layers = range(start, start + count)
            start += count
            held = [n for n in names if stage_holds(n, layers=layers, first=s == 0, last=s == pp - 1,
                                                     tied=spec.tied_embeddings)]
            split = {n: tp_shard_dim(spec, n, tp) for n in held}
            for _ in range(cp):
                for t in range(tp):
                    out.append({n: WHOLE if split[n] is None else Shard(split[n], t, tp) for n in held})
    return out, dims


def whole_shapes(spec) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model and its shape, in the model's order."""
    return {n: tuple(p.shape) for n, p in meta_model(spec, part=StagePart.whole(spec)).named_parameters()}


def plan_pipelines(plan) -> tuple[tuple[int, int, int, tuple[int, ...]], ...]:
    """(tp, pp, cp, layers per stage) of each pipeline of `plan`: what fixes every rank's holdings."""
    return tuple((p.tp, p.pp, p.cp, tuple(p.stage_layers(plan.model.num_layers))) for p in plan.pipelines)


# -------------------------------------------------------------------- executor wiring
def hetero_tp_mesh(plan, layout, mesh):
    """This rank's 1-D TP DeviceMesh in a heterogeneous plan, or None at tp 1 (collective: every
    rank creates every TP group of the plan, in the same order)."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for r, p in enumerate(layout.places):
        if plan.pipelines[p.pipeline].tp > 1:
            groups.setdefault((p.pipeline, p.stage, p.cp_rank), []).append((p.tp_rank, r))
    rank_sets = [tuple(r for _, r in sorted(v)) for v in groups.values()]
    mesh.ensure_groups(rank_sets)
    place = layout.place
    if plan.pipelines[place.pipeline].tp == 1:
        return None
    mine = next(s for s in rank_sets if layout.rank in s)
    return DeviceMesh.from_group(mesh.group(mine), mesh.device.type, mesh_dim_names=("tp",))


def _holding(param, tp_rank: int) -> Shard:
    if isinstance(param, DTensor):
        placement = param.placements[0]
        if placement.is_shard() or param.to_local().shape != param.shape:
            assert placement.is_shard(), (placement, param.shape, param.to_local().shape)
            return Shard(placement.dim % param.ndim, tp_rank, param.device_mesh.size())
    return WHOLE


class HeteroReducer:
    """Gradient sum of a heterogeneous plan through the exchange: every rank pushes its gradient
    pieces (whole, or tp row / column shards) to the owners, who sum them, then pulls the summed
    gradient of exactly the pieces it holds. Replicated parameters of a TP group push from TP rank
    0 only (the others computed the same gradient), except replicated K/V weights, whose gradient
    is a partial sum per TP rank. Every rank's holdings follow from the plan alone
    (`strategy_holdings`); this rank's are checked against its parameters' TP placements."""

    def __init__(self, model, plan, layout, *, key):
        place = layout.place
        tp = plan.pipelines[place.pipeline].tp
        partial = tp_partial_names(model.spec, tp)
        if model.spec.vocab % max(p.tp for p in plan.pipelines):
            raise ValueError("heterogeneous tp needs a vocabulary every tp divides")
        self.params = held_parameters(model, plan, place)
        shapes = whole_shapes(model.spec)
        self.holdings, dims = strategy_holdings(model.spec, plan_pipelines(plan), list(shapes))
        mine = {n: _holding(p, place.tp_rank) for n, p in self.params.items()}
        if mine != self.holdings[layout.rank]:
            raise RuntimeError(f"rank {layout.rank}: its parameters' TP layout {mine} is not the strategy's "
                               f"{self.holdings[layout.rank]}")
        self.pushes = {n: place.tp_rank == 0 or partial(n) or s.parts > 1 for n, s in mine.items()}
        self.exchange = HeteroExchange.for_shape(key, shapes, self.holdings, dims=dims,
                                                 device=next(iter(self.params.values())).device)

    def local_grads(self) -> torch.Tensor:
        """This rank's gradient pieces, flattened in the exchange's order (zeros for the TP
        replicas that do not push); a held parameter without a gradient counts as zeros."""
        ex = self.exchange
        parts = []
        for n in ex.held_names():
            p = self.params[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # e.g. the embedding's gradient comes back Replicate: take this rank's rows
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            g = local(p.grad).reshape(-1)
            parts.append(g if self.pushes[n] else torch.zeros_like(g))
        flat = torch.cat(parts) if parts else torch.zeros(0)
        if flat.numel() != ex.local_size:
            raise RuntimeError(f"rank {ex.rank}: {flat.numel()} gradient elements for {ex.local_size} held")
        return flat

    def local_values(self) -> torch.Tensor:
        """This rank's held parameter pieces, flattened in the exchange's order."""
        parts = [local(self.params[n]).detach().reshape(-1) for n in self.exchange.held_names()]
        return torch.cat(parts) if parts else torch.zeros(0)

    def load_values(self, flat: torch.Tensor) -> None:
        """Copy a pulled buffer into the held parameters (each rank's own pieces)."""
        with torch.no_grad():
            for n, value in self.exchange.unflatten_local(flat).items():
                target = local(self.params[n])
                target.copy_(value.view_as(target))

    def reduce(self) -> int:
        """Sum the held gradients in place; returns the elements this rank sent (push + pull)."""
        ex = self.exchange
        flat = self.local_grads()
        before = ex.bytes_sent
        ex.master = ex.push(flat, dtype=flat.dtype)
        summed = ex.unflatten_local(ex.pull())
        for n, g in summed.items():
            local(self.params[n].grad).copy_(g.view_as(local(self.params[n].grad)))
        return (ex.bytes_sent - before) // flat.element_size()
