"""Each action's duration and hand-off time on one pipeline: compute (forward, backward,
recomputation), context-parallel K/V exchange inside the action, and the point-to-point transfer
to the neighbouring stage (an edge delay in the task DAG), by stage placement.

GPU placement (for choosing intra- or inter-node links): pipelines take GPUs in order; pipeline
p's stage s holds GPUs [offset_p + s*tp*cp, offset_p + (s+1)*tp*cp), node = gpu // gpus_per_node.
"""

from __future__ import annotations

import numpy as np

from lengthwise.cost.flops import chunk_work, work_key
from lengthwise.plan.ir import Chunk
from lengthwise.sim.plan_costs import _row_of
from lengthwise.sim.terms import host_overlap

F, N, B = 0, 1, 2
"""Index of each action kind on the `dur`, `comm` and `send` tables' second axis."""
_VECTORISED = ("forward_time", "backward_time", "activation_bytes")
"""CostModel methods _each evaluates for all chunks at once when cp = 1 (CostModel.works_time)."""


class _ActionTimes:
    """The time part of `_PipelineCosts` (sim/inputs.py): placement, per-chunk compute tables by
    stage kind (layers, head, embed), CP exchange times and hand-off times. Reads the pipeline's
    `plan`, `pipe`, `cm`, `kw`, `offset`, `units`, `deps`, `works`, `shared` and `_cache`."""

    def node(self, gpu: int) -> int:
        return gpu // self.plan.cluster.gpus_per_node

    def stage_gpus(self, s: int) -> tuple[int, int]:
        width = self.pipe.tp * self.pipe.cp
        return self.offset + s * width, self.offset + (s + 1) * width - 1

    def link_inter(self, s: int) -> bool:
        """Whether the hand-off between stages s and s+1 crosses nodes."""
        return self.node(self.stage_gpus(s)[0]) != self.node(self.stage_gpus(s + 1)[1])

    def per_chunk(self, layers: int, head: bool, embed: bool = False) -> dict[str, np.ndarray]:
        key = (layers, head, embed)
        if key not in self._cache:
            cm = self.cm
            self._cache[key] = {
                "fwd": self._each(cm.forward_time, self.pipe.chunks, layers=layers, head=head, embed=embed),
                "bwd": self._each(cm.backward_time, self.units, layers=layers, head=head, embed=embed),
                "act": self._each(cm.activation_bytes, self.pipe.chunks, layers=layers, head=head),
            }
        return self._cache[key]

    def _each(self, fn, chunks: list[Chunk], **kw) -> np.ndarray:
        """fn(chunk, **kw, tp, cp) of every chunk. Without CP a chunk's cost depends only on its
        ChunkWork (row tokens, attention pairs), so values are shared by every chunk of equal
        work across the plan's pipelines (padded rows, equal-length sequences)."""
        kw = {**kw, **self.kw}
        if self.pipe.cp > 1:
            return np.array([fn(c, **kw) for c in chunks])
        if getattr(fn, "__self__", None) is self.cm and fn.__name__ in _VECTORISED:
            return self._each_at_once(fn.__name__, chunks, kw)
        memo = self.shared.setdefault((fn.__name__, *sorted(kw.items())), {})
        out = np.empty(len(chunks))
        for i, c in enumerate(chunks):
            key = work_key(c)
            v = memo.get(key)
            if v is None:
                v = memo[key] = fn(c, **kw)
            out[i] = v
        return out

    def _works(self, chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row tokens, attention pairs, segments) of every chunk as float64 arrays (chunk_work's, cp = 1)."""
        key = ("works", id(chunks))
        if key not in self._cache:
            works = [(c.num_tokens, c.attention_pairs, max(len(c.segments), 1)) if c.pad_to <= c.num_tokens
                     or not c.segments else (lambda w: (w.tokens, w.keys, w.segments))(chunk_work(c)) for c in chunks]
            arr = np.array(works, dtype=np.float64).reshape(len(chunks), 3)
            self._cache[key] = (arr[:, 0], arr[:, 1], arr[:, 2], chunks)  # chunks kept: the id stays theirs
        tokens, keys, segments, _ = self._cache[key]
        return tokens, keys, segments

    def _each_at_once(self, name: str, chunks: list[Chunk], kw: dict) -> np.ndarray:
        """_each for cp = 1 by the cost model's elementwise forms (the same floats, in one pass)."""
        tokens, keys, segments = self._works(chunks)
        cm, layers, tp, head = self.cm, kw["layers"], kw["tp"], kw.get("head", False)
        if name == "activation_bytes":
            return cm.activation_bytes_rows(tokens, layers=layers, tp=tp, head=head)
        out = cm.works_time(tokens, keys, layers=layers, tp=tp, head=head, embed=kw.get("embed", False),
                            backward=name == "backward_time", segments=segments)
        return out + 0.0 if name == "backward_time" else out  # backward_time adds its (zero) recompute

    def _p2p(self, inter: bool) -> tuple[list[float], list[float]]:
        """Hand-off times of every chunk and unit over an intra- or inter-node link."""
        if ("p2p", inter) not in self._cache:
            cm, kw = self.cm, self.kw
            if self.works is None or self.pipe.cp > 1:
                self._cache["p2p", inter] = (
                    [cm.p2p_time(cm.boundary_bytes(c, **kw), inter_node=inter) for c in self.pipe.chunks],
                    [cm.p2p_time(cm.boundary_bytes(u, **kw), inter_node=inter) for u in self.units])
            else:  # boundary bytes go by row tokens alone: one call per distinct count
                memo = self.shared.setdefault(("p2p", inter, self.pipe.tp), {})

                def times(rows: np.ndarray) -> list[float]:
                    out = []
                    for r in rows.tolist():
                        v = memo.get(r)
                        if v is None:
                            v = memo[r] = cm.p2p_time(cm.boundary_bytes(_row_of(r), **kw), inter_node=inter)
                        out.append(v)
                    return out

                self._cache["p2p", inter] = (times(self.works[0].row_tokens), times(self.works[1].row_tokens))
        return self._cache["p2p", inter]

    def _stage_times(self, s: int, recompute: list[int], mlp: list[int], dur: np.ndarray, comm: np.ndarray) -> None:
        L, head, C, U = self.layers[s], s == self.pipe.pp - 1, len(self.pipe.chunks), len(self.units)
        base = self.per_chunk(L, head, s == 0)
        factor, fmax, bmax = host_overlap(self.cm, self.pipe, s, L)
        if factor < 1.0:  # the host runs ahead of the device across the stage's actions (sim/terms.py)
            base = {**base, "fwd": base["fwd"] - (1.0 - factor) * np.asarray(fmax),
                    "bwd": base["bwd"] - (1.0 - factor) * np.asarray(bmax)}
        reruns = any(recompute) or any(mlp)
        if self.pipe.cp <= 1 and not reruns:  # no CP exchange (comm stays zero), no recomputation
            dur[F, :C] = dur[N, :C] = base["fwd"]
            dur[B, :U] = base["bwd"]
            return
        bwd = base["bwd"].copy()
        for u in range(U if reruns else 0):
            r = max((recompute[c] for c in self.deps.bwd_needs[u]), default=0)
            m = max((mlp[c] for c in self.deps.bwd_needs[u]), default=0)
            if r or m:  # backward re-runs the forward of r layers (InfiniPipe checkpointing), m MLP blocks
                bwd[u] = self.cm.backward_time(self.units[u], layers=L, head=head, recompute_layers=r,
                                               recompute_mlp=m, embed=s == 0, **self.kw)
        cp_f = self._cp_times(s, L, self.pipe.chunks, self.cm.cp_comm_time)
        cp_b = self._cp_times(s, L, self.units, self.cm.cp_grad_comm_time)  # the K/V gradients' reduce-scatter
        dur[F, :C] = dur[N, :C] = base["fwd"] + cp_f
        dur[B, :U] = bwd + cp_b
        comm[F, :C] = comm[N, :C] = cp_f
        comm[B, :U] = cp_b

    def _cp_times(self, s: int, layers: int, chunks: list[Chunk], term) -> np.ndarray:
        if self.pipe.cp <= 1:
            return np.zeros(len(chunks))
        lo, hi = self.stage_gpus(s)
        inter = self.node(lo) != self.node(hi)
        return np.array([term(c, layers=layers, inter_node=inter, **self.kw) for c in chunks])
