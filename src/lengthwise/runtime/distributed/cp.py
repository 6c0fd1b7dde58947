"""Context parallelism: one chunk's segments shared by the CP group of a stage.

A segment marked `cp_rank = r` (Skrull's *local* sequences, skrull §4.1) runs whole on CP
rank r. A segment marked SHARDED (Skrull's *distributed* sequences; SlimPack's DP-Merge,
slimpack §4.1.1) is cut into 2c pieces of at most m = ceil(n / 2c) tokens; rank r takes pieces r
and 2c-1-r ("head-tail"): with causal attention piece j costs about j + 1/2 units of key work,
so every rank gets (r + 1/2) + (2c - 1 - r + 1/2) = 2c units. When 2c does not divide n, the
first n mod 2c pieces take one token more. Example, n = 10, c = 2, m = 3:

    pieces   [0:3) [3:6) [6:8) [8:10)
    rank 0:  pieces 0 and 3  -> tokens 0..2 and 8..9    (3 + 2 tokens, padded to 3 + 3 rows)
    rank 1:  pieces 1 and 2  -> tokens 3..7             (3 + 2 tokens, padded to 3 + 3 rows)

Attention: every layer all-gathers the K/V of the sharded pieces over the CP group (each rank
contributes its two pieces, each padded to m rows, so all contributions have one shape), puts
the segment's K/V back in token order (padding rows are never read: masked out, and no token is
dropped), and runs each local piece as a slice whose context is the segment's earlier slices
(from the state store) plus the gathered K/V before the piece: token i of a piece starting at
a attends keys [0, start + a + i], exactly the causal mask of the whole segment. Backward
reduce-scatters the gradient of the gathered K/V, so each rank receives the sum over the group
of dK/dV of its own pieces. The sharded segment's full K/V is what the stage keeps in its state
store when a later slice of the sequence needs it (chunkflow's state hand-over works unchanged).

Trade-off: each rank computes attention for 1/c of the queries but holds the whole segment's K/V
per layer until that layer's backward (an all-gather CP, not a ring): activation memory of the
sharded part is n/c tokens, K/V memory n tokens. Volume per forward: every rank sends its 2m
rows of K and V to c - 1 peers per layer; backward reduce-scatters the same amount.

Tensor legend: T tokens of this rank's row, P padded piece rows of the chunk's sharded segments
on one rank, G K/V heads, E head dim, H query heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lengthwise.errors import UserError
from lengthwise.plan.ir import SHARDED, Chunk, Segment
from lengthwise.runtime.attention import ChunkLayout, attend
from lengthwise.runtime.layout import RowIndex, layout_of
from lengthwise.runtime.distributed.stats import CommStats

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True)
class RowPart:
    """One segment of a CP rank's row."""

    segment: Segment
    """Tokens of the row: a piece [start + a, start + b) of a sharded segment, or a local segment."""
    sharded_index: int | None
    """Index into `CPView.sharded` when a piece of a sharded segment, else None."""
    piece: int | None
    """Which of the 2c pieces (sharded only)."""
    before: int = 0
    """Tokens of its sharded segment before the piece: the gathered prefix it attends to."""


@dataclass(frozen=True, kw_only=True)
class CPView:
    """CP rank `rank`'s share of one chunk."""

    cp: int
    """CP degree of the pipeline."""
    rank: int
    """CP rank."""
    parts: tuple[RowPart, ...]
    """The rank's row, in the chunk's segment order (empty pieces left out)."""
    sharded: tuple[Segment, ...]
    """The chunk's sharded segments, gathered by every rank of the group."""
    computed: tuple[Segment, ...]
    """Whole segments whose K/V this rank holds afterwards: sharded ones and its local ones."""

    @property
    def chunk(self) -> Chunk:
        return Chunk(tuple(p.segment for p in self.parts))

    def layout(self) -> ChunkLayout:
        """Each part is a slice whose context is everything of its sequence before it."""
        parts = self.parts
        in_row = tuple(tuple(j for j in range(i) if _same_local_sequence(parts[j], p)) for i, p in enumerate(parts))
        return ChunkLayout(q_lens=tuple(p.segment.num_tokens for p in parts),
                           ctx_lens=tuple(p.segment.start for p in parts), row_context=in_row)

    def piece_rows(self, index: int) -> int:
        """m: rows of every piece of sharded segment `index` (the last ones padded)."""
        return math.ceil(self.sharded[index].num_tokens / (2 * self.cp))


def _same_local_sequence(a: RowPart, b: RowPart) -> bool:
    """Two local slices of one sequence in the row: the later reads the earlier from the row
    (pieces of a sharded segment read each other from the gather instead)."""
    return a.sharded_index is None and b.sharded_index is None and a.segment.seq_id == b.segment.seq_id


def piece_bounds(num_tokens: int, cp: int, piece: int) -> tuple[int, int]:
    """Token range [a, b) of piece `piece` of 2 cp within a segment: the first n mod 2c pieces
    hold one token more than the others, so pieces differ by one token at most (and a rank's
    head and tail pieces together by one at most from any other rank's)."""
    size, extra = divmod(num_tokens, 2 * cp)
    start = piece * size + min(piece, extra)
    return start, start + size + (1 if piece < extra else 0)


def rank_pieces(cp: int, rank: int) -> tuple[int, int]:
    """Head-tail balance: rank r holds pieces r and 2c-1-r of 2c."""
    return rank, 2 * cp - 1 - rank


def piece_owner(cp: int, piece: int) -> tuple[int, int]:
    """(rank, 0 for its head piece or 1 for its tail piece) holding piece `piece`."""
    return (piece, 0) if piece < cp else (2 * cp - 1 - piece, 1)


def cp_view(chunk: Chunk, *, cp: int, rank: int) -> CPView:
    parts, sharded, computed = [], [], []
    for segment in chunk.segments:
        if segment.cp_rank == SHARDED:
            for piece in rank_pieces(cp, rank):
                a, b = piece_bounds(segment.num_tokens, cp, piece)
                if b > a:
                    part = Segment(segment.seq_id, segment.start + a, segment.start + b, SHARDED)
                    parts.append(RowPart(segment=part, sharded_index=len(sharded), piece=piece, before=a))
            sharded.append(segment)
            computed.append(segment)
        elif not 0 <= segment.cp_rank < cp:
            raise UserError(f"segment {segment} is placed on CP rank {segment.cp_rank}, but the pipeline "
                            f"has cp={cp}: use a rank in [0, {cp}) or SHARDED")
        elif segment.cp_rank == rank:
            parts.append(RowPart(segment=segment, sharded_index=None, piece=None))
            computed.append(segment)
    return CPView(cp=cp, rank=rank, parts=tuple(parts), sharded=tuple(sharded), computed=tuple(computed))


class _GatherKV(torch.autograd.Function):
    """All-gather along rows over the CP group; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, local_RGE, group, cp: int, stats: CommStats):
        out = local_RGE.new_empty((cp * local_RGE.shape[0], *local_RGE.shape[1:]))
        _all_gather(out, local_RGE.contiguous(), group=group)
        stats.cp_gather_elements += local_RGE.numel() * (cp - 1)
        stats.cp_calls += 1
        ctx.group, ctx.cp, ctx.stats = group, cp, stats
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_local = grad_out.new_empty((grad_out.shape[0] // ctx.cp, *grad_out.shape[1:]))
        _reduce_scatter(grad_local, grad_out.contiguous(), group=ctx.group)
        ctx.stats.cp_scatter_elements += grad_local.numel() * (ctx.cp - 1)
        ctx.stats.cp_calls += 1
        return grad_local, None, None, None


class ShardedAttention:
    """The attention of one chunk's forward on one CP rank, layer after layer.

    Passed to the model as its attention backend (a callable); `gathered[j]` keeps, for layer j
    of the stage, the full (k, v) of every sharded segment, for the state store."""

    def __init__(self, *, view: CPView, group, stats: CommStats, backend: str):
        self.view, self.group, self.stats, self.backend = view, group, stats, backend
        self.gathered: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __call__(self, q_THE, k_TGE, v_TGE, context, layout: ChunkLayout | RowIndex):
        full = self._gather(k_TGE, v_TGE, layout_of(layout)) if self.view.sharded else []
        self.gathered.append(full)
        context = [self._with_prefix(part, pieces, full) for part, pieces in zip(self.view.parts, context)]
        if self.view.parts:
            out_THE = attend(q_THE, k_TGE, v_TGE, context, layout, backend=self.backend)
        else:
            out_THE = q_THE.new_zeros(q_THE.shape)
        if full and not any(p.before for p in self.view.parts):
            # Nothing here reads the gathered K/V, yet this rank must join its reduce-scatter in
            # backward: a zero-weighted use keeps the gather in the autograd graph.
            out_THE = out_THE + 0.0 * sum(k.sum() + v.sum() for k, v in full)
        return out_THE

    def _gather(self, k_TGE, v_TGE, layout: ChunkLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Full-length (k, v) of each sharded segment, in token order."""
        view = self.view
        local_k = self._local_pieces(k_TGE, layout)
        local_v = self._local_pieces(v_TGE, layout)
        rows = local_k.shape[0]
        gathered_CRGE = _GatherKV.apply(torch.cat([local_k, local_v]), self.group, view.cp,
                                        self.stats).view(view.cp, 2 * rows, *k_TGE.shape[1:])
        full, at = [], 0
        for i, segment in enumerate(view.sharded):
            m = view.piece_rows(i)
            k = _in_token_order(gathered_CRGE[:, at:at + 2 * m], segment.num_tokens, view.cp, m)
            v = _in_token_order(gathered_CRGE[:, rows + at:rows + at + 2 * m], segment.num_tokens, view.cp, m)
            full.append((k, v))
            at += 2 * m
        return full

    def _local_pieces(self, x_TGE: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        """[P, G, E]: per sharded segment, this rank's head and tail piece, each padded to m rows."""
        offsets = layout.q_offsets
        found = {(p.sharded_index, p.piece): offsets[j] for j, p in enumerate(self.view.parts)
                 if p.sharded_index is not None}
        blocks = []
        for i, segment in enumerate(self.view.sharded):
            m = self.view.piece_rows(i)
            for piece in rank_pieces(self.view.cp, self.view.rank):
                a, b = piece_bounds(segment.num_tokens, self.view.cp, piece)
                rows = x_TGE[found[(i, piece)]:found[(i, piece)] + b - a] if b > a else x_TGE[:0]
                blocks.append(torch.cat([rows, rows.new_zeros((m - (b - a), *x_TGE.shape[1:]))]))
        return torch.cat(blocks) if blocks else x_TGE[:0]

    def _with_prefix(self, part: RowPart, pieces: list, full) -> list:
        """A piece's context: the segment's earlier slices, then its own K/V before the piece."""
        if not part.before:
            return pieces
        k, v = full[part.sharded_index]
        return [*pieces, (k[:part.before], v[:part.before])]


def _in_token_order(blocks_C2MGE: torch.Tensor, num_tokens: int, cp: int, m: int) -> torch.Tensor:
    """[n, G, E] from each rank's (head, tail) padded pieces [c, 2m, G, E], dropping the padding."""
    rows = []
    for piece in range(2 * cp):
        a, b = piece_bounds(num_tokens, cp, piece)
        if b > a:
            owner, half = piece_owner(cp, piece)
            rows.append(blocks_C2MGE[owner, half * m:half * m + b - a])
    return torch.cat(rows)
