"""The rows one CP rank computes of a stage whose pipeline has cp > 1 (skrull §4.1 DACP).

    runner = StageRunner(..., rows=CPRows(pipe, cp_rank=r, cp_group=g, stats=stats, backend=b))

The same action list as the plain `StageRunner`, on this rank's share of each cell (a chunk,
or its part in one backward unit: `runtime/cells.py`; `cp.cp_view`): its head and tail pieces
of the sharded segments and the local segments placed on it. What changes:

- the row, its positions, labels and the activations it sends are the rank's share only (a
  message is the rank's shares of the action's cells, concatenated);
- attention is `cp.ShardedAttention` when the chunk has sharded segments (K/V all-gather in
  forward, reduce-scatter in backward, all over the stage's CP group);
- the state store keeps, for a sharded slice that later slices read, its full gathered K/V (so
  every rank of the group holds it whole), and for a local slice its own K/V, as usual.

A rank with no token of a chunk still runs its actions (on empty tensors; the transport sends
no message for an empty tensor, and its neighbour knows the shape is empty from the plan) and
still joins the chunk's CP collectives, which every rank of the group must call in the same
order. Backward needs nothing new: gradients of the gathered K/V reach their owners through
the all-gather's reduce-scatter, in layer order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from lengthwise.errors import UserError
from lengthwise.plan.ir import SHARDED, Action, Chunk, PipelinePlan, Segment
from lengthwise.runtime.cells import cell_map
from lengthwise.runtime.distributed.cp import CPView, ShardedAttention, cp_view
from lengthwise.runtime.distributed.stats import CommStats
from lengthwise.runtime.stage import Row
from lengthwise.runtime.state import KV


class CPRows:
    """One CP rank's share of every cell of a stage (the `rows` of its `StageRunner`)."""

    def __init__(self, pipe: PipelinePlan, *, cp_rank: int, cp_group, stats: CommStats, backend: str):
        self.cp_group, self.stats, self.backend = cp_group, stats, backend
        self.label = f" on CP rank {cp_rank}"
        cells = cell_map(pipe)
        self.views: list[CPView] = [cp_view(c, cp=pipe.cp, rank=cp_rank) for c in cells.cells]
        for cell, chunk in enumerate(cells.cells):
            _check_row(cells.chunk_of[cell], chunk)

    def share(self, cell: int, chunk: Chunk) -> Chunk:
        return self.views[cell].chunk

    def row(self, cell: int, chunk: Chunk, action: Action, where: str) -> Row:
        view = self.views[cell]
        if action.recompute_layers and view.sharded:
            raise UserError(f"{where}: recomputing layers of a chunk with CP-sharded segments is not "
                            "supported (the K/V all-gather would run again in backward); plan it without .r (an MLP "
                            "block's recomputation, .m, reruns no attention)")
        attention = (ShardedAttention(view=view, group=self.cp_group, stats=self.stats, backend=self.backend)
                     if view.sharded or not view.parts else self.backend)
        return CPRow(chunk=view.chunk, computed=Chunk(view.computed), layout=view.layout(), attention=attention,
                     sharded={s: i for i, s in enumerate(view.sharded)})


@dataclass(kw_only=True)
class CPRow(Row):
    """A rank's row: its local segments as usual; a sharded segment's K/V is the whole gathered
    one, so every rank of the group holds it for the later slices that read it."""

    sharded: dict[Segment, int]
    """Sharded segment -> its index in the attention's gathered K/V."""

    def kv_of(self, segment: Segment, kv: list[KV]) -> list[KV]:
        if segment in self.sharded:
            return [layer_kv[self.sharded[segment]] for layer_kv in self.attention.gathered]
        return super().kv_of(segment, kv)


def _check_row(index: int, chunk: Chunk) -> None:
    """A sharded slice must be the only slice of its sequence in the row (its in-row context
    comes from the gather, not from the row)."""
    seq_ids = [s.seq_id for s in chunk.segments]
    for s in chunk.segments:
        if s.cp_rank == SHARDED and seq_ids.count(s.seq_id) > 1:
            raise UserError(f"chunk {index} ({chunk}) holds slice {s}, CP-sharded, and another slice of "
                            f"sequence {s.seq_id}: merge them into one segment")
