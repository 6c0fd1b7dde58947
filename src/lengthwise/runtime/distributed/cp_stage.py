"""A stage runner for one CP rank of a stage whose pipeline has cp > 1 (skrull §4.1 DACP).

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

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import FORWARD, SHARDED, Action, Chunk
from lengthwise.runtime.distributed.cp import CPView, ShardedAttention, cp_view
from lengthwise.runtime.distributed.stats import CommStats
from lengthwise.runtime.loss import chunk_positions
from lengthwise.runtime.stage import StageRunner, _Pending
from lengthwise.runtime.state import slice_key, stored_segments


class CPStageRunner(StageRunner):
    """Runs one CP rank's share of one stage's actions."""

    def __init__(self, *, cp_rank: int, cp_group, stats: CommStats, **kwargs):
        super().__init__(**kwargs)
        cp = self.plan.pipelines[self.pipeline].cp
        self.cp_rank, self.cp_group, self.stats = cp_rank, cp_group, stats
        self.views: list[CPView] = [cp_view(c, cp=cp, rank=cp_rank) for c in self.cells.cells]
        for cell, chunk in enumerate(self.cells.cells):
            _check_row(self.cells.chunk_of[cell], chunk)

    def where(self, index: int | None = None) -> str:
        return f"{super().where(index)} on CP rank {self.cp_rank}"

    def _cell_rows(self, cell: int) -> int:
        return self.views[cell].chunk.num_tokens

    def _forward_cell(self, action: Action, cell: int, received: torch.Tensor | None) -> torch.Tensor:
        view, grad = self.views[cell], action.kind == FORWARD
        if grad and cell in self.pending:
            raise UserError(f"{self.where()}: chunk {action.chunk} is forwarded twice before its backward")
        if action.recompute_layers and view.sharded:
            raise UserError(f"{self.where()}: recomputing layers of a chunk with CP-sharded segments is not "
                            "supported (the K/V all-gather would run again in backward); plan it without .r")
        attention = (ShardedAttention(view=view, group=self.cp_group, stats=self.stats, backend=self.backend)
                     if view.sharded or not view.parts else self.backend)
        with torch.set_grad_enabled(grad):
            h_TD, input_leaf = self._share_input(action, view, received)
            leaves = self._context_leaves(Chunk(view.computed), grad)
            rope = self.model.rope(_positions(view.chunk, h_TD.device), h_TD.dtype)
            h_TD, kv = self.model.run_layers(
                h_TD, layers=self.layers, rope=rope, layout=view.layout(), backend=attention,
                contexts=self._contexts(view.chunk, leaves), recompute_layers=action.recompute_layers)
            own_kv = self._keep_share_kv(view, kv, attention, grad)
            output = self._share_output(action, view, h_TD)
        if grad:
            self.pending[cell] = _Pending(input_leaf=input_leaf, output=output,
                                          own_kv=own_kv, context_leaves=leaves)
        return h_TD

    def _share_input(self, action: Action, view: CPView, received: torch.Tensor | None):
        if self.is_first and not view.parts:
            return self.model.embed(torch.zeros(0, dtype=torch.long, device=self._param.device)), None
        return self._cell_input(action, view.chunk, received)

    def _keep_share_kv(self, view: CPView, kv, attention, grad: bool):
        """Store the K/V later slices read: gathered whole for sharded segments, else the row's."""
        offsets = {p.segment: o for p, o in zip(view.parts, view.layout().q_offsets)}
        sharded_index = {s: i for i, s in enumerate(view.sharded)}
        own = {}
        for segment in stored_segments(Chunk(view.computed), self.plan.lengths):
            if segment in sharded_index:
                i = sharded_index[segment]
                per_layer = [layer_kv[i] for layer_kv in attention.gathered]
            else:
                lo, hi = offsets[segment], offsets[segment] + segment.num_tokens
                per_layer = [(k[lo:hi], v[lo:hi]) for k, v in kv]
                if not grad:
                    per_layer = [(k.clone(), v.clone()) for k, v in per_layer]
            self.store.put(slice_key(segment), per_layer)
            own[slice_key(segment)] = per_layer
        return own

    def _share_output(self, action: Action, view: CPView, h_TD: torch.Tensor):
        if not self.is_last or action.kind != FORWARD or view.parts:
            return self._cell_output(action, view.chunk, h_TD)
        # No token of this chunk here: a zero loss part that still reaches the row's graph,
        # so that backward runs this rank's share of the CP collectives.
        return 0.0 * h_TD.sum()


def _positions(chunk: Chunk, device) -> torch.Tensor:
    if not chunk.segments:
        return torch.zeros(0, dtype=torch.long, device=device)
    return chunk_positions(chunk, device)


def _check_row(index: int, chunk: Chunk) -> None:
    """A sharded slice must be the only slice of its sequence in the row (its in-row context
    comes from the gather, not from the row)."""
    seq_ids = [s.seq_id for s in chunk.segments]
    for s in chunk.segments:
        if s.cp_rank == SHARDED and seq_ids.count(s.seq_id) > 1:
            raise UserError(f"chunk {index} ({chunk}) holds slice {s}, CP-sharded, and another slice of "
                            f"sequence {s.seq_id}: merge them into one segment")

