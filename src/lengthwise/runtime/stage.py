"""One pipeline stage running its action list with state-aware execution (chunkflow §4.2-4.3).

A `StageRunner` owns: the contiguous layer range of its stage (plus the embedding on the first
stage and norm + LM head + loss on the last), the stage's `KVStore`, and the autograd graphs of
the cells forwarded with grad and not yet backwarded. A *cell* is the part of a forward chunk
that one backward unit holds (`cells.py`); without separate backward units (SlimPack §4.1.2)
a cell is a chunk. It talks to its neighbours only through a `Transport`. Actions:

- `F c`: forward chunk c keeping activations, one cell after the other. Each segment with
  context reads the K/V of its sequence's earlier slices (in earlier chunks or cells) from the
  store: per layer one view of the sequence's K/V buffer, `buffer[:start]`, *detached* and a
  leaf with requires_grad, so the graph of a cell ends at it. The cell's slices that later
  slices read are copied into their rows of the buffer.
- `N c`: forward without grad (chunkflow's first pass when more than K slices are in flight):
  only the K/V of segments that later slices need is kept; a later `F c` re-forwards to
  rebuild the activations.
- `B u`: backward of unit u (chunk u without backward_chunks), cell by cell, later chunks
  first. A cell's roots are its stage output (the loss part on the last stage, else the
  activation with the gradient received from the next stage) and the K/V of its slices that
  later slices attended to, with the dK/dV those later slices' backwards accumulated:
  `torch.autograd.backward([out, k, v, ...], [g_out, dk, dv, ...])` (dk, dv: views of the
  slice's rows of the store's gradient accumulators). Afterwards the context leaves' .grad are
  added into the accumulators' rows [:start] for the earlier slices, and the input's gradient
  goes to the previous stage.

One message per action: `F c` sends its cells' rows concatenated, `B u` the input gradients of
its cells (`cells.py` gives the order); which message an action receives and sends is
`plan.messages.action_messages`. Before each action (and after the last) the runner posts the
exchanges `plan.messages.stage_exchanges` schedules there: the sends of earlier actions and the
receives of this or later ones, batched so that no stage waits on NCCL for a send whose
receive its peer has queued behind a send of its own (`plan/rendezvous.py`). Under sequence
parallelism (`model.sequence_shards` > 1, `parallel/tensor_parallel.py`) a TP rank's rows of a
cell are its share of the cell padded to a multiple of the shards, and it exchanges those with
the same TP rank of the neighbour stage; the head's padding rows get the label IGNORE. State is
freed right after the last action of the stage that needs it (`state.last_uses`).

What this process computes of a cell is a `Row`, given by the runner's `rows` strategy:
`WholeRows` (the default) computes every cell whole; context parallelism computes one CP
rank's share with a collective attention (`runtime/distributed/cp_stage.py`, `CPRows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, Action, Chunk, Segment, StepPlan
from lengthwise.plan.messages import Exchange, pipeline_messages
from lengthwise.runtime.attention import ChunkLayout, wants_varlen_index
from lengthwise.runtime.layout import RowIndex
from lengthwise.runtime.cells import CellMap, cell_last_uses, cell_map
from lengthwise.runtime.loss import IGNORE, chunk_labels, chunk_positions, chunk_tokens, to_device
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.state import KV, KVStore, SliceKey, slice_key, stored_prefix, stored_segments
from lengthwise.runtime.transport import Message, Transport


@dataclass(kw_only=True)
class _Pending:
    """What a chunk forwarded with grad keeps until its backward."""

    input_leaf: torch.Tensor | None
    """The received activation (a leaf), None on the first stage."""
    output: torch.Tensor | None
    """The loss part (last stage) or the activation sent on; None on a last stage with no head work."""
    own_kv: dict[SliceKey, list[KV]]
    """Graph-attached k, v per layer of the chunk's slices that later slices read."""
    context_leaves: dict[int, tuple[int, list[KV]]]
    """seq_id -> (c, per layer the detached k, v leaves of its context [0, c) that this
    chunk attended to: views of the store's buffers)."""


@dataclass(kw_only=True)
class Row:
    """What this process computes of one cell in one forward."""

    chunk: Chunk
    """The segments computed here, in row order: their tokens, positions and labels."""
    computed: Chunk
    """Whole segments whose earlier slices' K/V the row reads from the store, and whose own K/V
    this process holds afterwards (the cell itself, unless context parallelism shares it)."""
    layout: ChunkLayout
    attention: Any
    """The attention backend's name, or a callable attention (runtime/model.py)."""

    def kv_of(self, segment: Segment, kv: list[KV]) -> list[KV]:
        """Per layer, the K/V of whole segment `segment` of `computed` after the forward: views
        of its rows of the row's K/V (the store copies them into its buffers)."""
        lo = dict(zip(self.chunk.segments, self.layout.q_offsets))[segment]
        return [(k[lo:lo + segment.num_tokens], v[lo:lo + segment.num_tokens]) for k, v in kv]


class Rows(Protocol):
    """How a stage's cells become the rows this process computes."""

    label: str
    """Added to the runner's `where()` (e.g. the CP rank)."""

    def share(self, cell: int, chunk: Chunk) -> Chunk:
        """The segments of cell `cell` (`chunk`) computed here: `row(...).chunk`."""
        ...

    def row(self, cell: int, chunk: Chunk, action: Action, where: str) -> Row:
        """What `action` computes here of cell `cell`; UserError, prefixed by `where`, if it cannot."""
        ...


class WholeRows:
    """Every cell computed whole, with the named attention backend."""

    label = ""

    def __init__(self, backend: str):
        self.backend = backend

    def share(self, cell: int, chunk: Chunk) -> Chunk:
        return chunk

    def row(self, cell: int, chunk: Chunk, action: Action, where: str) -> Row:
        return Row(chunk=chunk, computed=chunk, layout=ChunkLayout.from_chunk(chunk), attention=self.backend)


class StageRunner:
    """Runs the actions of one stage of one pipeline of a StepPlan, in order."""

    def __init__(self, *, model: CausalLM, plan: StepPlan, pipeline: int, stage: int,
                 token_ids: list[torch.Tensor], transport: Transport, backend: str = "auto",
                 rows: Rows | None = None):
        pipe = plan.pipelines[pipeline]
        layer_counts = pipe.stage_layers(model.spec.num_layers)
        first_layer = sum(layer_counts[:stage])
        self.model, self.plan, self.transport, self.backend = model, plan, transport, backend
        self.rows: Rows = rows or WholeRows(backend)
        self.pipeline, self.stage, self.num_stages = pipeline, stage, pipe.pp
        self.layers = range(first_layer, first_layer + layer_counts[stage])
        self.chunks: list[Chunk] = pipe.chunks
        self.cells: CellMap = cell_map(pipe)
        self.actions: list[Action] = pipe.stages[stage]
        messages = pipeline_messages(pipe.stages, pipeline)
        self.io = messages.io[stage]
        """Per action: (the message it receives, the message it sends), None at a pipeline end."""
        self.exchanges: dict[int, list[Exchange]] = {}
        """Action index -> the exchanges posted before it (len(actions): after the last)."""
        for exchange in messages.exchanges[stage]:
            self.exchanges.setdefault(exchange.before, []).append(exchange)
        self.token_ids = token_ids
        self.store = KVStore(stored_prefix(list(self.cells.cells), plan.lengths))
        self.pending: dict[int, _Pending] = {}
        """Per cell forwarded with grad and not yet backwarded: what its backward needs."""
        self.frees = cell_last_uses(self.actions, self.cells, plan.lengths)
        self.next_index = 0
        self.before_backward_cell: Callable[[int, int, int], None] | None = None
        """Called with (action index, cell position, cells of the action) before each cell's
        backward (FSDP2 turns gradient reduction on for the step's last one)."""
        self._param = next(model.parameters())
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self._param.device)
        """Detached sum of this stage's loss parts (last stage only); stays on the device so
        that no chunk waits for a host copy."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def done(self) -> bool:
        return self.next_index == len(self.actions)

    def where(self, index: int | None = None) -> str:
        index = self.next_index if index is None else index
        return f"pipeline {self.pipeline} stage {self.stage} action {index} ({self.actions[index]}){self.rows.label}"

    def needs(self) -> Message | None:
        """The message the next action must receive before it can run, if any."""
        return self.io[self.next_index][0]

    def step(self) -> None:
        """Post what is due, run the next action, then free the state nothing later needs (and
        after the last action post the last sends)."""
        self._post(self.next_index)
        action = self.actions[self.next_index]
        if action.kind == BACKWARD:
            self._backward(action)
        else:
            self._forward(action)
        for key in self.frees.get(self.next_index, []):
            self.store.free(key)
        self.next_index += 1
        if self.done:
            self._post(self.next_index)

    # forward ----------------------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        """`F c` / `N c`: c's cells in order (one cell, c itself, without backward_chunks)."""
        cells = self.cells.forward[action.chunk]
        received, sent = self.io[self.next_index]
        inputs = [None] * len(cells) if received is None else self._receive(received, cells)
        outputs = [self._forward_cell(action, cell, x) for cell, x in zip(cells, inputs)]
        if sent is not None:
            self.transport.send(sent, _joined(outputs))

    def _forward_cell(self, action: Action, cell: int, received: torch.Tensor | None) -> torch.Tensor:
        grad = action.kind == FORWARD
        if grad and cell in self.pending:
            raise UserError(f"{self.where()}: chunk {action.chunk} is forwarded twice before its backward")
        row = self.rows.row(cell, self.cells.cells[cell], action, self.where())
        with torch.set_grad_enabled(grad):
            h_TD, input_leaf = self._cell_input(action, row.chunk, received)
            leaves = self._context_leaves(row.computed, grad)
            rope = self.model.rope(chunk_positions(row.chunk, h_TD.device), h_TD.dtype)
            # the row's attention index, once for every layer of the stage, forward and backward
            index = RowIndex.build(row.layout, h_TD.device, varlen=wants_varlen_index(row.attention))
            h_TD, kv = self.model.run_layers(
                h_TD, layers=self.layers, rope=rope, layout=index, backend=row.attention,
                contexts=self._contexts(row.chunk, leaves), recompute_layers=action.recompute_layers,
                recompute_mlp=action.recompute_mlp)
            own_kv = self._keep_own_kv(row, kv)
            output = self._cell_output(action, row.chunk, h_TD)
        if grad:
            self.pending[cell] = _Pending(input_leaf=input_leaf, output=output,
                                          own_kv=own_kv, context_leaves=leaves)
        return h_TD

    def _receive(self, message: Message, cells: tuple[int, ...]) -> list[torch.Tensor]:
        """The tensor of `message`, cut into its cells' rows."""
        whole = self.transport.recv(message, shape=self._shape(message), dtype=self._param.dtype,
                                    device=self._param.device)
        return list(torch.split(whole, [self._cell_rows(cell) for cell in cells]))

    def _shape(self, message: Message) -> tuple[int, int]:
        """[rows, hidden] of a message this stage receives: its cells' rows, in order."""
        cells = self.cells.backward[message.chunk] if message.kind == BACKWARD else self.cells.forward[message.chunk]
        return sum(self._cell_rows(cell) for cell in cells), self.model.spec.hidden

    def _post(self, index: int) -> None:
        """The exchanges due before action `index`, each as one batch, in round order."""
        for exchange in self.exchanges.get(index, ()):
            self.transport.post(exchange.sends, [(m, self._shape(m)) for m in exchange.recvs],
                                dtype=self._param.dtype, device=self._param.device)

    def _cell_rows(self, cell: int) -> int:
        """Rows of the cell's part of a message: what this process computes of it (its rows of
        it under sequence parallelism, `model.sequence_shards`)."""
        tokens = self.rows.share(cell, self.cells.cells[cell]).num_tokens
        return -(-tokens // self.model.sequence_shards)

    def _cell_input(self, action: Action, chunk: Chunk, received: torch.Tensor | None):
        if self.is_first:
            tokens = to_device(chunk_tokens(chunk, self.token_ids) if chunk.segments
                               else torch.zeros(0, dtype=torch.long), self._param.device)
            return self.model.embed(tokens), None
        leaf = received.detach().requires_grad_(action.kind == FORWARD)
        return leaf, leaf

    def _context_leaves(self, chunk: Chunk, grad: bool) -> dict[int, tuple[int, list[KV]]]:
        """seq_id -> (c, per layer the (k, v) leaf of its context [0, c) from earlier chunks,
        one view of the store's buffers) for every sequence of the chunk with such a context."""
        return {seq_id: (stop, self.store.context(seq_id, stop, grad=grad, where=self.where()))
                for seq_id, stop in _context_from_store(chunk).items() if stop > 0}

    def _contexts(self, chunk: Chunk, leaves: dict[int, tuple[int, list[KV]]]):
        """Per layer of the stage, per segment: its context pieces from the store, one view
        or none (a later slice of the sequence in the same row adds the row's own K/V)."""
        return [[[leaves[s.seq_id][1][j]] if s.seq_id in leaves else [] for s in chunk.segments]
                for j in range(len(self.layers))]

    def _keep_own_kv(self, row: Row, kv: list[KV]):
        """Store the K/V that later slices will read; return them (graph-attached) for backward."""
        own = {}
        for segment in stored_segments(row.computed, self.plan.lengths):
            per_layer = row.kv_of(segment, kv)
            self.store.put(slice_key(segment), per_layer)
            own[slice_key(segment)] = per_layer
        return own

    def _cell_output(self, action: Action, chunk: Chunk, h_TD: torch.Tensor):
        """What the cell's backward starts from: the activation sent on, or the loss part."""
        if not self.is_last:
            return h_TD
        if action.kind != FORWARD:
            return None  # N only leaves K/V; the loss comes with the later F
        if not chunk.segments:
            # No token of this cell here (a CP rank without a share): a zero loss part that still
            # reaches the row's graph, so that backward runs this rank's part of any collective.
            return 0.0 * h_TD.sum()
        labels = to_device(chunk_labels(chunk, self.token_ids), h_TD.device)
        rows = h_TD.shape[0] * self.model.sequence_shards  # the head gathers the rows of every TP rank
        if rows > labels.shape[0]:  # sequence parallelism's padding rows predict nothing
            labels = torch.cat([labels, labels.new_full((rows - labels.shape[0],), IGNORE)])
        loss_part = self.model.head_loss(h_TD, labels) / self.plan.loss_tokens
        self.loss_sum = self.loss_sum + loss_part.detach().double()
        return loss_part

    # backward ----------------------------------------------------------------------------

    def _backward(self, action: Action) -> None:
        """`B u`: u's cells, later chunks first (one cell, chunk u, without backward_chunks)."""
        cells = self.cells.backward[action.chunk]
        received, sent = self.io[self.next_index]
        grads = [None] * len(cells) if received is None else self._receive(received, cells)
        input_grads = []
        for position, (cell, g) in enumerate(zip(cells, grads)):
            if self.before_backward_cell is not None:
                self.before_backward_cell(self.next_index, position, len(cells))
            input_grads.append(self._backward_cell(action, cell, g))
        if sent is not None:
            self.transport.send(sent, _joined(input_grads))

    def _backward_cell(self, action: Action, cell: int, g_out: torch.Tensor | None) -> torch.Tensor | None:
        pending = self.pending.pop(cell, None)
        if pending is None:
            c = self.cells.chunk_of[cell]
            raise UserError(f"{self.where()}: B{action.chunk} has no F{c} before it on this stage")
        roots = [pending.output]
        grads = [torch.ones_like(pending.output) if g_out is None else g_out]
        for key, kv_per_layer in pending.own_kv.items():
            owed = self.store.pop_grads(key)
            for (k, v), (dk, dv) in zip(kv_per_layer, owed or []):
                roots += [k, v]
                grads += [dk, dv]
        torch.autograd.backward(roots, grads)
        for seq_id, (stop, leaves) in pending.context_leaves.items():
            self.store.add_grads(seq_id, stop, [(_grad_of(k), _grad_of(v)) for k, v in leaves])
        return None if self.is_first else _grad_of(pending.input_leaf)


def _context_from_store(chunk: Chunk) -> dict[int, int]:
    """seq_id -> end of the context that comes from the store: the first start of the
    sequence in this row (any later slice of it in the row reads the row's own K/V)."""
    stops: dict[int, int] = {}
    for s in chunk.segments:
        stops[s.seq_id] = min(stops.get(s.seq_id, s.start), s.start)
    return stops




def _grad_of(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _joined(rows: list[torch.Tensor]) -> torch.Tensor:
    """One message from per-cell rows (no copy for the usual single cell)."""
    return rows[0].detach() if len(rows) == 1 else torch.cat([r.detach() for r in rows])
