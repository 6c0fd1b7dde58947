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

The layout (`hetero_layout.ExchangeLayout`, computed from every rank's holdings alone) puts
column j of a segment held by the ranks H at owner H[j mod h]: each rank owns about 1/h of
what it holds, ZeRO-1 over the d holders (12 bytes per owned element, held / d of them).

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
import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from lengthwise.runtime.parallel.hetero_layout import Block, ExchangeLayout, Holdings

log = logging.getLogger(__name__)


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
