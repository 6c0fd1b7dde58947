"""Heterogeneous pipelines: the optimisation-propagation exchange (hydraulis §5.2).

In a Hydraulis plan each data-parallel pipeline has its own tp x pp x cp, so one parameter can be
held whole by a rank of one pipeline and as tp row or column shards by ranks of another. No
all-reduce over "the ranks holding a parameter" fits: their pieces have different shapes.

Which layout owns the optimizer state, and why. The fp32 master weights and the AdamW moments
live in one fixed layout that does not depend on the plan: every parameter is flattened and its
elements are dealt round-robin over all ranks of the world (element i belongs to rank i mod W).
The layout is the plan's no-one's: a strategy switch (a new set of pipeline schemes) then moves
no optimizer state at all, only changes which slices each rank pulls (Hydraulis makes the same
choice, sharding the master state over all N GPUs independently of the propagation schemes).
Round-robin rather than contiguous ranges: any tp row or column shard whose width is a multiple
of W then holds exactly 1/W of its elements on its own rank, so the exchange volume is exactly
held * (W - 1) / W per rank and direction (`planners/hydraulis/cost.exchange_elements`), not a
function of where a shard happens to fall. Against a ring all-reduce over the d ranks holding an
element (every CP rank and pipeline counts), 2 (d - 1) / d of what each holds, that is
(W - 1) / W * d / (d - 1): 1.97x, 1.48x, 1.31x, 1.23x for d = 2, 3, 4, 5 at W = 64. No
layout that leaves the owner out of the holders does better than d / (d - 1): each holder's
term must leave it on the push and the sum reach it on the pull (d transfers each way, where an
all-reduce among the holders needs d - 1). Owners among the holders would mean owners that
change with the strategy, so a switch would move optimizer state (12 bytes per element).

Each step:
- `pull()`: every owner sends each rank the master elements that rank's propagation shards hold
  (one all_to_all_single over mutually needed slices; no tags), cast to the propagation dtype.
- `push(grads)`: after backward every rank sends its gradient slices back the same way; the owner
  sums what it receives into its shard, rank by rank: the gradient of a single process running the
  whole batch, since each rank's loss is already divided by the global loss-token count.
- `step()`: AdamW on the owner's flat shard (elementwise, so the layout does not change results);
  in training, one torch AdamW over per-parameter views of `master` (`train/dist_hetero.py`),
  after which every rank pulls its next weights.

The master starts from the propagation layout itself (`init_master_from_held`: every element
pushed by its lowest holder only, the others push zeros), and parameters are laid out in the
model's order whatever the strategy, so a switch adopts the master shard as it is.

No index maps. A rank's shard of a parameter is a block of columns of the parameter seen as a
matrix (`piece`), and the elements of it that one owner owns are a strided grid on both sides
(`blocks`): every W-th column of every row, or of every P-th row when W does not divide the row
length. Push and pull copy these grids between the flattened pieces, the all-to-all buffers and
the master shard as strided views, so besides the buffers the exchange keeps only a few Python
tuples per held parameter and owner. The blocks of one plan shape are computed once, from the
holdings alone (every rank derives the same, nothing travels), and cached by
`HeteroExchange.for_shape` while the shape repeats. (Index maps, one int32 or int64 position
per held element and per element owned of what every rank holds, took 39 GiB of an 80 GB GPU
in Hydraulis' own LLaMA-32B setting on 64 GPUs; the blocks give the same sums bit for bit.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import logging
import math
import time

import torch
import torch.distributed as dist

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


def piece(shape: tuple[int, ...], shard: Shard) -> tuple[int, int, int, int]:
    """(rows, length, first, width): the shard's elements are columns first .. first + width - 1
    of the whole parameter seen as a rows x length row-major matrix (rows: the product of the
    dimensions before the split one), in the shard's own row-major order. A whole parameter or
    a split of its first dimension is one contiguous row."""
    numel = int(torch.Size(shape).numel())
    if shard.parts == 1 or numel == 0:
        return 1, numel, 0, numel
    if shape[shard.dim] % shard.parts:
        raise ValueError(f"dimension {shard.dim} of {tuple(shape)} does not split into {shard.parts}")
    rows = int(torch.Size(shape[:shard.dim]).numel())
    length = numel // rows
    width = length // shard.parts
    return rows, length, shard.index * width, width


class Block(NamedTuple):
    """Elements of one held piece that one owner owns, in one row phase: a rows x cols grid,
    at `local_offset` with strides `local_stride` in the holder's flattened pieces and at
    `master_offset` with strides `master_stride` in the owner's master shard."""

    size: tuple[int, int]
    local_offset: int
    local_stride: tuple[int, int]
    master_offset: int
    master_stride: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.size[0] * self.size[1]


def blocks(shape_piece: tuple[int, int, int, int], world: int, owners, *, local_offset: int,
           master_offsets: list[int]) -> list[tuple[int, Block]]:
    """(owner, block) of a held piece for each owner in `owners`, row phase by row phase.

    Element (i, j) of the piece is element f = i * length + first + j of the whole parameter,
    owned by f mod W at position f // W of the owner's part of that parameter. Along a row the
    owners repeat every W columns; from row to row the pattern shifts by length mod W, so it
    repeats every P = W / gcd(length, W) rows (1 when W divides the row length). Rows
    i0, i0 + P, ... and columns j0, j0 + W, ... of owner o are thus a strided grid on both
    sides: in the piece, strides (P * width, W); in the owner's part, consecutive positions
    along a row and length / gcd(length, W) apart from row to row."""
    rows, length, first, width = shape_piece
    W = world
    g = math.gcd(length, W)
    P = W // g
    out = []
    for i0 in range(min(P, rows)):
        m = (rows - i0 + P - 1) // P
        for o in owners:
            j0 = (o - first - i0 * length) % W
            if j0 >= width:
                continue
            f = i0 * length + first + j0
            out.append((o, Block((m, (width - j0 + W - 1) // W), local_offset + i0 * width + j0, (P * width, W),
                                 master_offsets[o] + f // W, (length // g, 1))))
    return out


Holdings = dict[str, Shard]
"""One rank's propagation layout: parameter name -> the shard it holds (absent: not held)."""


def _strided(flat: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """A strided view into a contiguous 1-D tensor, `offset` elements from its start."""
    return flat.as_strided(size, stride, flat.storage_offset() + offset)


class HeteroExchange:
    """Master shards in the fixed round-robin layout and the pull/push of one plan shape."""

    _cache: dict = {}

    def __init__(self, shapes: dict[str, tuple[int, ...]], holdings: list[Holdings], *,
                 group=None, device=None):
        self.shapes = dict(shapes)
        self.holdings = holdings
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if len(holdings) != self.world:
            raise ValueError(f"{len(holdings)} holdings for {self.world} ranks")
        self.device = device or torch.device("cpu")
        W = self.world
        names = list(self.shapes)
        numel = {n: int(torch.Size(self.shapes[n]).numel()) for n in names}
        # offsets of each parameter's owned elements inside every owner's flat shard
        owned = {n: [(numel[n] - o + W - 1) // W for o in range(W)] for n in names}
        self.shard_offset = {}
        total = [0] * W
        for n in names:
            self.shard_offset[n] = list(total)
            total = [t + c for t, c in zip(total, owned[n])]
        self.shard_size = total[self.rank]
        self.numel = numel

        def rank_blocks(r: int, owners) -> list[tuple[int, Block]]:
            # r's held pieces in parameter order, each row phase by row phase
            out, offset = [], 0
            for n in names:
                shard = holdings[r].get(n)
                if shard is None:
                    continue
                p = piece(self.shapes[n], shard)
                out += blocks(p, W, owners, local_offset=offset, master_offsets=self.shard_offset[n])
                offset += p[0] * p[3]
            return out

        # No index maps: what a rank sends each owner and what an owner sums from each rank are
        # strided grids of the flattened pieces and of the master shard (`blocks`), computed
        # from the holdings alone (every rank derives the same, nothing travels).
        # as holder: the blocks of every owner, in the order both sides use on the wire
        self.held_blocks: list[list[Block]] = [[] for _ in range(W)]
        for o, b in rank_blocks(self.rank, range(W)):
            self.held_blocks[o].append(b)
        self.local_size = sum(math.prod(piece(self.shapes[n], s)[::3]) for n, s in holdings[self.rank].items()
                              if n in self.shapes)
        self.local_counts = [sum(b.numel for b in bs) for bs in self.held_blocks]
        # as owner: for each rank r, the blocks of what r holds and this rank owns, in r's order
        self.owned_blocks: list[list[Block]] = [[b for _, b in rank_blocks(r, (self.rank,))] for r in range(W)]
        self.owner_counts = [sum(b.numel for b in bs) for bs in self.owned_blocks]
        self.master: torch.Tensor | None = None
        self.bytes_sent = 0
        """Bytes this rank sent to other ranks (self-slices excluded), pulls and pushes."""

    @classmethod
    def for_shape(cls, key, shapes, holdings, *, group=None, device=None) -> "HeteroExchange":
        """The exchange of a plan shape `key`, built once and reused while the shape repeats."""
        ex = cls._cache.get(key)
        if ex is None:
            ex = cls._cache[key] = cls(shapes, holdings, group=group, device=device)
        return ex

    def switch(self, key, shapes, holdings) -> "HeteroExchange":
        """A strategy switch: the exchange of the new plan shape, adopting this one's master
        shard as is (the master layout depends only on the parameters and the world, so no
        optimizer state moves; only the pulled slices change). Logs its measured cost: the
        blocks' build (cached shapes cost nothing) and the first pull of the new layout."""
        if list(dict(shapes).items()) != list(self.shapes.items()):  # same names, shapes and order
            raise ValueError("a strategy switch keeps the parameters (and their order)")
        started = time.perf_counter()
        new = type(self).for_shape(key, shapes, holdings, group=self.group, device=self.device)
        new.master = self.master
        built = time.perf_counter() - started
        before = new.bytes_sent
        new.last_pull = new.pull()
        new.switch_cost = {"build_s": built, "pull_s": time.perf_counter() - started - built,
                           "pull_bytes": new.bytes_sent - before, "state_bytes_moved": 0}
        log.info("strategy switch to %s: blocks %.4f s, first pull %.4f s (%d bytes sent), 0 bytes of "
                 "optimizer state moved", key, built, new.switch_cost["pull_s"], new.switch_cost["pull_bytes"])
        return new

    # ---------------------------------------------------------------- master state
    def init_master(self, full: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
        """This rank's master shard from whole parameters (every rank passes the same values)."""
        parts = [full[n].detach().reshape(-1)[self.rank::self.world].to(self.device, dtype)
                 for n in self.shapes]
        self.master = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self.device)
        return self.master

    def first_holder_mask(self) -> torch.Tensor:
        """Boolean mask over this rank's held elements (local flat layout, as `flatten_local`):
        True where no lower rank holds the element. Pushing held values times this mask sums
        exactly one copy of every element (the others add zeros): the master from the
        propagation layout, bit for bit, whatever the layout."""
        mask = []
        for n in self.shapes:
            covered = None
            for r in range(self.world):
                shard = self.holdings[r].get(n)
                if shard is None:
                    continue
                rows, length, first, width = piece(self.shapes[n], shard)
                if covered is None:
                    covered = torch.zeros(rows * length, dtype=torch.bool)
                region = covered.view(rows, length)[:, first:first + width]
                if r == self.rank:
                    mask.append((~region).reshape(-1))
                region.fill_(True)
        return torch.cat(mask).to(self.device) if mask else torch.zeros(0, dtype=torch.bool, device=self.device)

    def init_master_from_held(self, local_values: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """This rank's master shard from the held pieces of every rank (collective; each element
        taken from its lowest holder, so every rank's pieces may come from another layout)."""
        mask = self.first_holder_mask()
        values = torch.where(mask, local_values.reshape(-1).to(dtype), torch.zeros((), dtype=dtype))
        self.master = self.push(values, dtype=dtype)
        return self.master

    def master_view(self, name: str) -> torch.Tensor:
        """This rank's owned elements of one parameter (flat indices rank, rank + W, ...)."""
        start = self.shard_offset[name][self.rank]
        return self.master[start:start + (self.numel[name] - self.rank + self.world - 1) // self.world]

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
        """Elements every rank holds (the exchange's per-rank volume before the 1/W it keeps)."""
        return [sum(self.numel[n] // s.parts for n, s in h.items() if n in self.shapes)
                for h in self.holdings]


# -------------------------------------------------------------------- executor wiring
def hetero_tp_mesh(plan, layout, mesh):
    """This rank's 1-D TP DeviceMesh in a heterogeneous plan, or None at tp 1 (collective: every
    rank creates every TP group of the plan, in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

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


def _holding(param, tp_rank: int, pushes: bool):
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        placement = param.placements[0]
        if placement.is_shard() or param.to_local().shape != param.shape:
            assert placement.is_shard(), (placement, param.shape, param.to_local().shape)
            return (placement.dim % param.ndim, tp_rank, param.device_mesh.size(), True)
    return (0, 0, 1, pushes)


class HeteroReducer:
    """Gradient sum of a heterogeneous plan through the exchange: every rank pushes its gradient
    pieces (whole, or tp row / column shards) to the owners, who sum them, then pulls the summed
    gradient of exactly the pieces it holds. Replicated parameters of a TP group push from TP rank
    0 only (the others computed the same gradient), except replicated K/V weights, whose gradient
    is a partial sum per TP rank. The holdings are all-gathered once per plan shape."""

    def __init__(self, model, plan, layout, *, key):
        from lengthwise.runtime.distributed.dp import held_parameters
        from lengthwise.runtime.model import parameter_names
        from lengthwise.runtime.parallel.tensor_parallel import tp_partial_names

        place = layout.place
        tp = plan.pipelines[place.pipeline].tp
        partial = tp_partial_names(model.spec, tp)
        if model.spec.vocab % max(p.tp for p in plan.pipelines):
            raise ValueError("heterogeneous tp needs a vocabulary every tp divides")
        self.params = held_parameters(model, plan, place)
        mine = {n: _holding(p, place.tp_rank, place.tp_rank == 0 or partial(n)) for n, p in self.params.items()}
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        all_holdings = [None] * dist.get_world_size()
        dist.all_gather_object(all_holdings, (mine, shapes))
        merged = {}
        for _, sh in all_holdings:
            merged.update(sh)
        # the model's own order, so that the master layout is the same under every strategy
        order = [n for n in parameter_names(model.spec) if n in merged]
        self.holdings = [{n: Shard(d, i, k) for n, (d, i, k, _) in h.items()} for h, _ in all_holdings]
        self.pushes = {n: h[3] for n, h in mine.items()}
        self.exchange = HeteroExchange.for_shape(key, {n: merged[n] for n in order}, self.holdings)

    def local_grads(self) -> torch.Tensor:
        """This rank's gradient pieces, flattened in the exchange's order (zeros for the TP
        replicas that do not push); a held parameter without a gradient counts as zeros."""
        from torch.distributed.tensor import DTensor

        from lengthwise.runtime.distributed.dp import local

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
        from lengthwise.runtime.distributed.dp import local

        parts = [local(self.params[n]).detach().reshape(-1) for n in self.exchange.held_names()]
        return torch.cat(parts) if parts else torch.zeros(0)

    def load_values(self, flat: torch.Tensor) -> None:
        """Copy a pulled buffer into the held parameters (each rank's own pieces)."""
        from lengthwise.runtime.distributed.dp import local

        with torch.no_grad():
            for n, value in self.exchange.unflatten_local(flat).items():
                target = local(self.params[n])
                target.copy_(value.view_as(target))

    def reduce(self) -> int:
        """Sum the held gradients in place; returns the elements this rank sent (push + pull)."""
        from lengthwise.runtime.distributed.dp import local

        ex = self.exchange
        flat = self.local_grads()
        before = ex.bytes_sent
        ex.master = ex.push(flat, dtype=flat.dtype)
        summed = ex.unflatten_local(ex.pull())
        for n, g in summed.items():
            local(self.params[n].grad).copy_(g.view_as(local(self.params[n].grad)))
        return (ex.bytes_sent - before) // flat.element_size()

