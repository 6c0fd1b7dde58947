"""Memory sizes of one pipeline's actions (sim/memory.py replays them over the timeline): model
states and gradients per stage, each chunk's kept activations (whole, or by cell when the
backward units are not the chunks), re-materialisation and no-grad transients, backward and
head-forward working sets, the embedding backward's peak, and K/V sizes by split sequence.
"""

from __future__ import annotations

import functools
import operator

import numpy as np

import lengthwise.cost.memory as mem
from lengthwise.cost import CostModel
from lengthwise.plan.ir import BACKWARD, FORWARD_NOGRAD, Chunk
from lengthwise.sim.cell_costs import CELLS
from lengthwise.sim.memory import MemorySizes, SplitArrays, split_sequences
from lengthwise.sim.structure import segment_cells

_KIND = operator.attrgetter("kind")


class _MemorySizing:
    """The memory part of `_PipelineCosts` (sim/inputs.py). Besides the pipeline's fields it uses
    `per_chunk` (sim/action_times.py) and the plan-wide answers of sim/step_costs.py
    (`_heterogeneous`, `_holders`, `_replicas`, `_shared`)."""

    def _sizes(self, recompute: list[list[int]], mlp: list[list[int]]) -> MemorySizes:
        """Every stage's memory sizes (MemorySizes), and `self.splits`, the split sequences;
        `recompute` and `mlp`: [stage][chunk] layers each chunk's F recomputes whole and by
        their MLP block alone."""
        pipe, cm, S = self.pipe, self.cm, self.pipe.pp
        splits = self.splits = self.known.splits if self.known is not None else split_sequences(pipe.chunks,
                                                                                                self.units)
        act, extra, transient, kv, kv_grad, work, fwork, cell_act = [], [], [], [], [], [], [], []
        cells = self._cells()
        kv_of: dict[int, dict] = {}  # stages of equal layer counts hold equal K/V
        kv_rows: dict[int, np.ndarray] = {}  # ... and as rows in the order of `splits`, where computed so
        for s in range(S):
            L, head = self.layers[s], s == S - 1
            if cells is not None:  # each cell is its own row: kept, re-materialised and worked on apart
                kept, remat, w, fw = self._cell_sizes(cells, L, head, recompute[s], mlp[s])
                cell_act.append(kept)
                act.append(self._chunk_sums(cells, kept, len(pipe.chunks)))
                if head:
                    w = self._head_reduce_scatter(w, L, remat, recompute[s], mlp[s], cells)
            else:
                kept, remat = self._kept_activations(s, L, head, recompute[s], mlp[s])
                act.append(kept)
                w, fw = self._working_sets(L, head)
                folded, folded_remat = self._with_remat(L, head, w, remat, _reruns(L, recompute[s], mlp[s]))
                if head:  # from the re-materialisation before it is folded into the working sets
                    folded = self._head_reduce_scatter(folded, L, remat, recompute[s], mlp[s], None)
                w, remat = folded, folded_remat
            extra.append(remat)
            work.append(w)
            fwork.append(fw)
            transient.append(self._nograd_transient(s, L, act[-1]))
            kv.append(self._kv_sizes(L, splits, kv_of, kv_rows))
            kv_grad.append(dict(kv[-1]))  # K/V-gradient buffers are the size of the K/V they update
        states, grads = self._states()
        if cm.grads_held_all_step:  # a buffer allocated before the step (`CostModel.grads_held_all_step`)
            grads = [0.0] * S
        if S:
            work[0] = self._embedding_backward(work[0], act[0], extra[0], grads[0], cell_act[0] if cells else None,
                                               cells)
        return MemorySizes(state=[a - g for a, g in zip(states, grads)], grads=grads, activation=act,
                           recompute_extra=extra, nograd_transient=transient, kv=kv, kv_grad=kv_grad,
                           backward_work=work, forward_work=fwork, cell_activation=cell_act,
                           kv_rows=[kv_rows[L] for L in self.layers] if len(kv_rows) == len(kv_of) else None,
                           nograd_held=cm.nograd_keeps_graph)

    def _kept_activations(self, s: int, L: int, head: bool, recompute: list[int], mlp: list[int]):
        """([chunk] activation bytes each chunk's F keeps on stage s, [chunk] the transient bytes
        of re-materialising its recomputed layers (or MLP blocks) in its backward)."""
        pipe, cm = self.pipe, self.cm
        full = self.per_chunk(L, head, s == 0)["act"]
        if not any(recompute) and not any(mlp):  # recompute_transient_bytes is 0 without recomputation
            return full, self._zeros(len(pipe.chunks))
        levels = list(zip(pipe.chunks, recompute, mlp))
        kept = np.array([cm.activation_bytes(c, layers=L, head=head, recompute_layers=r, recompute_mlp=m, **self.kw)
                         if r or m else full[i] for i, (c, r, m) in enumerate(levels)])
        return kept, [cm.recompute_transient_bytes(c, recompute_layers=r, recompute_mlp=m, **self.kw)
                      for c, r, m in levels]

    def _with_remat(self, L: int, head: bool, work, remat, reruns: list[bool]):
        """(work, remat) with each chunk's re-materialisation folded into its backward's working
        set when the units are the chunks (`CostModel.backward_work_bytes`, `remat`, and
        `rerun` where every layer reruns: `reruns`): beside a layer's backward, which on the
        last stage runs after the loss's, not on top of the loss's; as they are otherwise (a
        chunk read by several units re-materialises for each)."""
        pipe, cm = self.pipe, self.cm
        extra = np.asarray(remat, dtype=np.float64)
        if pipe.backward_chunks is not None or not extra.any():
            return work, remat
        work = [cm.backward_work_bytes(c, layers=L, head=head, remat=x, rerun=r, **self.kw) if x else w
                for c, x, r, w in zip(pipe.chunks, extra.tolist(), reruns, np.asarray(work, dtype=np.float64).tolist())]
        return np.array(work), self._zeros(len(pipe.chunks))

    def _working_sets(self, L: int, head: bool):
        """([unit] each backward unit's working set: the loss backward's bf16 logit gradient on
        the last stage, a layer's SwiGLU backward elsewhere; [chunk] the head forward's bf16
        logits on the last stage, zeros elsewhere), when the units are the chunks."""
        pipe, cm = self.pipe, self.cm
        work = self._per_token_row(cm.backward_work_bytes, self.units, 1,
                                   functools.partial(cm.backward_work_bytes_rows, layers=L, tp=pipe.tp, head=head),
                                   layers=L, head=head)
        fwork = self._per_token_row(cm.head_forward_bytes, pipe.chunks, 0,
                                    functools.partial(mem.head_forward_bytes, cm.model, tp=pipe.tp)) \
            if head else self._zeros(len(pipe.chunks))
        return work, fwork

    def _nograd_transient(self, s: int, L: int, act_row):
        """[chunk] what stage s's no-grad forward (N) of each chunk holds while it runs (0 for
        chunks without an N): one layer's activations, or the whole graph an F would keep
        (`CostModel.nograd_keeps_graph`)."""
        pipe, cm, C = self.pipe, self.cm, len(self.pipe.chunks)
        nograd = {a.chunk for a in pipe.stages[s] if a.kind == FORWARD_NOGRAD} \
            if FORWARD_NOGRAD in map(_KIND, pipe.stages[s]) else ()
        if nograd and cm.nograd_keeps_graph:
            return [act_row[i] if i in nograd else 0.0 for i in range(C)]
        return [cm.activation_bytes(c, layers=min(L, 1), **self.kw) if i in nograd else 0.0
                for i, c in enumerate(pipe.chunks)] if nograd else self._zeros(C)

    def _kv_sizes(self, L: int, splits, kv_of: dict[int, dict], kv_rows: dict[int, np.ndarray]) -> dict:
        """{sequence: K/V bytes} of every split sequence on a stage of L layers (kept in `kv_of`
        for the pipeline's other stages of L layers, and in `kv_rows` as a row in the order of
        `splits` where computed that way); kv_bytes by context length, shared by the plan's
        pipelines of one tp, cp."""
        cm = self.cm
        if L not in kv_of:
            if isinstance(splits, SplitArrays) and type(cm).kv_bytes is CostModel.kv_bytes:
                # CostModel.kv_bytes elementwise over the contexts: the same operations, the same floats
                each = kv_rows[L] = np.asarray(cm.kv_bytes(splits.context, layers=L, **self.kw), dtype=np.float64)
                kv_of[L] = dict(zip(splits.seq_id.tolist(), each.tolist()))
            else:
                memo = self.shared.setdefault(("kv", L, self.pipe.tp, self.pipe.cp), {})
                seqs = zip(splits.seq_id.tolist(), splits.context.tolist()) if isinstance(splits, SplitArrays) \
                    else ((q.seq_id, q.context) for q in splits)
                kv_of[L] = {q: memo[n] if n in memo else memo.setdefault(n, cm.kv_bytes(n, layers=L, **self.kw))
                            for q, n in seqs}
        return kv_of[L]

    def _cells(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(chunk, unit, tokens) of every cell, the part of a forward chunk that one backward
        unit holds (`runtime/cells.py`), in the order of the (chunk, unit) reads (by chunk,
        then unit); None when the units are the chunks, or under CP (there chunks are counted
        whole, released at their last reader's end: an upper bound)."""
        pipe = self.pipe
        if pipe.backward_chunks is None or pipe.cp > 1:
            return None
        if CELLS in self._cache:  # checked with every pipeline's (sim/cell_costs.py)
            return self._cache[CELLS]
        if self.known is not None and self.known.cells is not None:
            c, u, n = self.known.cells
            cells = c, u, n.astype(np.float64)
        else:
            cells = segment_cells(pipe.chunks, pipe.backward_chunks)
        # one cell per (chunk, unit) read, in the reads' order (else: chunks released whole)
        reads = [(c, u) for u, needs in enumerate(self.deps.bwd_needs) for c in needs]
        if len(reads) != len(cells[0]) or sorted(reads) != list(zip(cells[0].tolist(), cells[1].tolist())):
            return None
        return cells

    def _chunk_sums(self, cells, kept: np.ndarray, C: int) -> np.ndarray:
        """Each chunk's activations, its cells' summed (shared by stages of equal cell sizes)."""
        key = ("chunk sums", id(kept))
        if key not in self._cache:
            self._cache[key] = (kept, np.bincount(cells[0], weights=kept, minlength=C))
        return self._cache[key][1]

    def _cell_sizes(self, cells, L: int, head: bool, recompute: list[int], mlp: list[int]):
        """A stage's sizes by cell: each cell's kept activations [cell] (its own row: padded
        apart), each chunk's re-materialisation events folded into its units' working sets
        (zeros [chunk]), each unit's working set [unit] (its cells' backwards run one after
        another: the largest cell's loss or layer working set, with its re-materialised layer)
        and each chunk's forward working set [chunk] (its largest cell's LM head logits)."""
        reruns = any(recompute) or any(mlp)
        key = ("cells", L, head, (tuple(recompute), tuple(mlp)) if reruns else None)
        if key in self._cache:  # stages of one shape and recomputation share them
            return self._cache[key]
        batched = self._cache.get(("cells batched", L, head)) if key[3] is None else None
        if batched is not None:  # computed with every pipeline's cells (sim/cell_costs.py)
            kept, work, fwork, sums = batched
            self._cache["chunk sums", id(kept)] = (kept, sums)
            zeros = self._zeros(len(self.pipe.chunks))
            out = self._cache[key] = (kept, zeros, work, zeros if fwork is None else fwork)
            return out
        cm, tp = self.cm, self.pipe.tp
        chunk_of, unit_of, tokens = cells
        remat, rerun = np.zeros(len(tokens)), np.zeros(len(tokens), dtype=bool)
        if not reruns:
            kept = cm.activation_bytes_rows(tokens, layers=L, tp=tp, head=head)
        else:
            levels = np.stack([np.asarray(recompute, dtype=np.int64)[chunk_of],
                               np.asarray(mlp, dtype=np.int64)[chunk_of]])
            kept = np.zeros(len(tokens))
            for k, m in np.unique(levels, axis=1).T.tolist():
                at = (levels[0] == k) & (levels[1] == m)
                rerun[at] = 0 < L <= k + m
                kept[at] = cm.activation_bytes_rows(tokens[at], layers=L, tp=tp, recompute_layers=k,
                                                    recompute_mlp=m, head=head)
                remat[at] = self._cell_remat(tokens[at], k, m)
        work = np.zeros(len(self.units))
        np.maximum.at(work, unit_of, cm.backward_work_bytes_rows(tokens, layers=L, tp=tp, head=head, remat=remat,
                                                                 rerun=rerun))
        fwork = self._zeros(len(self.pipe.chunks))
        if head:
            fwork = np.zeros(len(self.pipe.chunks))
            np.maximum.at(fwork, chunk_of, mem.head_forward_bytes(cm.model, tokens, tp))
        out = self._cache[key] = (kept, self._zeros(len(self.pipe.chunks)), work, fwork)
        return out

    def _cell_remat(self, tokens, k: int, m: int):
        """Bytes cells of `tokens` rows re-materialise at once in their backward when their
        chunk's F recomputes `k` layers whole or `m` MLP blocks (`CostModel.recompute_transient_bytes`:
        the layer's dropped activations and its product, or the MLP block's)."""
        cm, tp = self.cm, self.pipe.tp
        if k:
            return (cm.activation_bytes_rows(tokens, layers=1, tp=tp)
                    - cm.activation_bytes_rows(tokens, layers=1, tp=tp, recompute_layers=1)
                    + mem.product_bytes_per_token(cm.model, tp) * tokens)
        if m:
            return cm.recompute_transient_bytes_per_token(tp=tp, recompute_mlp=m) * tokens
        return np.zeros(np.shape(tokens))

    def _head_reduce_scatter(self, work, L: int, remat, recompute: list[int], mlp: list[int], cells):
        """The last stage's working sets [unit] with the head unit's reduce-scatter in its last B
        (`head_reduce_scatter_work`): the first layer's backward moment of that B's unit, from
        its last cell's rows (the cells' path) or the unit's, beside what it re-materialises
        when that is folded into the unit's working set (the chunks are the units)."""
        cm, pipe, tp = self.cm, self.pipe, self.pipe.tp

        def layer_moment(u: int) -> float:
            if cells is not None:
                i = last_cell(cells, u)
                k, m = recompute[cells[0][i]], mlp[cells[0][i]]
                rows = cells[2][i:i + 1]
                return float(layer_rows_moment(cm, rows, L, tp, remat=self._cell_remat(rows, k, m),
                                               rerun=0 < L <= k + m)[0])
            unit = self.units[u]
            fold = pipe.backward_chunks is None  # else re-materialised by events of their own
            x = float(np.asarray(remat, dtype=np.float64)[u]) if fold else 0.0
            rerun = _reruns(L, recompute, mlp)[u] if fold else False
            return (cm.backward_work_bytes(unit, layers=L, head=False, remat=x, rerun=rerun, **self.kw)
                    - cm.activation_bytes(unit, layers=0, head=True, **self.kw))

        return head_reduce_scatter_work(cm, pipe, work, layers=L, zero=self.plan.zero, shards=self._replicas(),
                                        hetero=self._heterogeneous(), layer_moment=layer_moment)

    def _embedding_backward(self, work, act, extra, grads: float, cell_act=None, cells=None) -> np.ndarray:
        """The first stage's backward working sets (`work`, counted from the level at each B's
        start, beside the layer it re-materialises, `extra`) raised to the moment its
        embedding's backward runs, at the B's end: the whole table's bf16 gradient
        (`mem.embedding_backward_bytes`) beside the other chunks' activations, the B's own and
        its re-materialised layer freed by then (`act`: those whose last reader the B is), and
        beside every gradient in the stage's first B, which makes them (`grads`; a
        heterogeneous plan's autograd keeps that first bf16 table as the gradient itself)."""
        pipe, U = self.pipe, len(self.units)
        first = next((a.chunk for a in pipe.stages[0] if a.kind == BACKWARD), None)
        if first is None:
            return work
        act, extra = np.asarray(act, dtype=np.float64), np.asarray(extra, dtype=np.float64)
        if cells is not None:  # each cell's backward ends in the embedding's: its first cell's
            released = np.full(U, np.inf)       # (the smallest, at most) is all it has freed then
            np.minimum.at(released, cells[1], cell_act)
            released[~np.isfinite(released)] = 0.0
            remat = np.zeros(U)  # folded into `work`, freed with its cell
        elif pipe.backward_chunks is None:  # each unit is its chunk, the only one it reads
            released, remat = act.copy(), extra
        else:
            order = [a.chunk for a in pipe.stages[0] if a.kind == BACKWARD]
            pos = np.zeros(U, dtype=np.int64)
            pos[order] = np.arange(len(order))
            released, remat = np.zeros(U), np.zeros(U)
            readers: dict[int, list[int]] = {}
            for u, needs in enumerate(self.deps.bwd_needs):
                for c in needs:
                    readers.setdefault(c, []).append(u)
                    remat[u] += extra[c]
            for c, us in readers.items():
                released[max(us, key=pos.__getitem__)] += act[c]
        table = mem.embedding_backward_bytes(self.cm.model)
        end = table - released - remat
        end[first] += grads - (table if self._heterogeneous() else 0.0)
        return np.maximum(np.asarray(work, dtype=np.float64), end)

    def _states(self) -> tuple[list[float], list[float]]:
        """[stage] model-state bytes and [stage] their gradients' part, shared by the plan's
        pipelines of one shape."""
        pipe, cm, S = self.pipe, self.cm, self.pipe.pp
        # ZeRO shards over dp x cp: every pipeline's CP ranks (DP-Merged pipelines have more)
        dp, zero = self._replicas(), self.plan.zero
        key = ("states", pipe.tp, pipe.cp, tuple(self.layers))
        if key not in self.shared:
            if self._heterogeneous():  # bf16 stage weights and gradients, the owned masters and moments
                holders = self._holders()
                self.shared[key] = (
                    [self._shared(cm.hetero_state_bytes, layers=L, tp=pipe.tp, first=s == 0, last=s == S - 1,
                                  holders=holders) for s, L in enumerate(self.layers)],
                    [self._shared(cm.hetero_grad_bytes, layers=L, tp=pipe.tp, first=s == 0, last=s == S - 1)
                     for s, L in enumerate(self.layers)])
            else:
                budgets = [self._shared(cm.stage_budget, stage=s, tp=pipe.tp, pp=S, replicas=dp, zero=zero, layers=L)
                           for s, L in enumerate(self.layers)]
                self.shared[key] = ([b.states for b in budgets], [b.grads for b in budgets])
        states, grads = self.shared[key]
        return list(states), list(grads)

    def _zeros(self, n: int) -> np.ndarray:
        """A read-only float64 zero row of n entries, shared by the plan's pipelines."""
        key = ("zeros", n)
        if key not in self.shared:
            row = self.shared[key] = np.zeros(n)
            row.flags.writeable = False
        return self.shared[key]

    def _per_token_row(self, method, chunks: list[Chunk], side: int, per_token, **kwargs):
        """`method(c, **kwargs, tp, cp)` of every chunk of `chunks` (the forward chunks, `side`
        0, or the backward units, 1), a CostModel method that is `per_token` bytes times the
        chunk's tokens on its busiest CP rank (or `per_token(tokens)`, a function of the row
        tokens elementwise): without CP that over the row tokens at once (the same floats),
        unless a subclass redefines the method."""
        cm = self.cm
        if self.works is None or self.pipe.cp > 1 or getattr(type(cm), method.__name__) is not \
                getattr(CostModel, method.__name__):
            return [method(c, **kwargs, **self.kw) for c in chunks]
        if callable(per_token):
            return per_token(self.works[side].row_tokens)
        if not per_token:
            return self._zeros(len(chunks))
        return per_token * self.works[side].row_tokens


def _reruns(layers: int, recompute: list[int], mlp: list[int]) -> list[bool]:
    """[chunk] whether every one of the stage's layers makes its MLP block again in the chunk's
    backward (recomputed whole or by its MLP block): the rerun's end then meets every other
    tensor the chunk keeps (`mem.backward_work_bytes`, `rerun`)."""
    return [0 < layers <= r + m for r, m in zip(recompute, mlp)]


def last_cell(cells, u: int) -> int:
    """Index of unit u's last cell to run backward: its earliest chunk's (`runtime/stage.py`
    runs a unit's cells later chunks first)."""
    chunk_of, unit_of, _ = cells
    i = np.flatnonzero(unit_of == u)
    return int(i[np.argmin(chunk_of[i])])


def layer_rows_moment(cm: CostModel, rows, L: int, tp: int, *, remat=0.0, rerun=False):
    """The last stage's first decoder layer backward moment for rows of `rows` tokens (no CP):
    the layers' working set beside `remat`, less the head's kept tensors, freed by then
    (`mem.backward_work_bytes`)."""
    return (cm.backward_work_bytes_rows(rows, layers=L, tp=tp, head=False, remat=remat, rerun=rerun)
            - cm.activation_bytes_rows(rows, layers=0, tp=tp, head=True))


def head_reduce_scatter_work(cm: CostModel, pipe, work, *, layers: int, zero: int, shards: int, hetero: bool,
                             layer_moment) -> np.ndarray:
    """The last stage's backward working sets (`work`, [unit]) with, in the stage's last B, its
    first decoder layer's backward moment (`layer_moment(u)`, beyond the kept activations)
    raised by what FSDP2 holds there of the head's unit (`mem.head_reduce_scatter_bytes`): in
    that B, which reduces the gradients, the unit's post-backward copies its gradient into a
    new fp32 reduce-scatter input, frees what it copied, keeps the reduced fp32 shard as the
    gradient and reshards its bf16 weights; FSDP2 keeps the input until the next unit's
    post-backward, after the first layer's backward, the moment that meets every activation
    the chunk keeps but the head's. The head's own moments (the loss's and the final norm's
    backward) come before the reduction. Unchanged without FSDP2 (ZeRO 0, a heterogeneous
    plan's replicated stages), without layers, or for a system whose gradients are a buffer
    held all step (`CostModel.grads_held_all_step`)."""
    backwards = [a.chunk for a in pipe.stages[-1] if a.kind == BACKWARD]
    if not backwards or layers <= 0 or zero <= 0 or hetero or cm.grads_held_all_step:
        return work
    u = backwards[-1]
    if not 0 <= u < len(work):
        return work  # a malformed schedule, which the simulator's checks report
    held = mem.head_reduce_scatter_bytes(cm.model, pipe.tp, shards=shards, zero=zero, first=pipe.pp == 1,
                                         grads_made=len(backwards) > 1)
    out = np.array(work, dtype=np.float64)  # a copy: rows may be shared by pipelines
    out[u] = max(out[u], layer_moment(u) + held)
    return out
