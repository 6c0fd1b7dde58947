"""SlimPack's plan metrics: MicroPack counts, FLOPs budgets, forms (Slim / Mix / Pack) and the
spread of MicroPack seconds and tokens (infinipipe table 2 reports the same spread).

Every number is read off the plan's segments as arrays, all pipelines at once (`_Segments`):
token and attention-pair sums per chunk in exact integers (Chunk.num_tokens and
attention_pairs), one cost-model call per tensor-parallel degree for the seconds (elementwise,
the same floats as one call per chunk), one prefix-cost call for every segment's FLOPs, summed
pipeline by pipeline in segment order as before. Chunks that are padded, or numbers past exact
int64 sums, take the chunk-by-chunk path (`_chunk_seconds`). At 4096 GPUs x 131,072 sequences
this is about 0.05 s of the plan's ~7 (it was ~0.45 chunk by chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lengthwise.cost import CostModel
from lengthwise.cost.flops import chunk_work, work_key
from lengthwise.plan.arrays import causal_pairs, row_sums, segment_fields
from lengthwise.plan.ir import Chunk, PipelinePlan
from lengthwise.planners.base import PlanRequest
from lengthwise.planners.slimpack.cuts import PrefixCost

_TIMES = ("forward_time", "backward_time", "works_time")


def rsd(values) -> float:
    """Relative standard deviation, percent."""
    v = np.asarray(values, dtype=np.float64)
    return float(100.0 * v.std() / v.mean()) if len(v) and v.mean() > 0 else 0.0


def mean_rsd(rows: list[list[float]]) -> float:
    """The mean of every row's rsd, the rows of one length at once (numpy's mean and std of each
    row of a 2-D array along its last axis are those of the row alone, float for float)."""
    if not rows:
        return 0.0
    each = np.zeros(len(rows))
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_length.setdefault(len(row), []).append(i)
    for n, at in by_length.items():
        if n:
            v = np.array([rows[i] for i in at], dtype=np.float64)
            mean, std = v.mean(axis=1), v.std(axis=1)
            each[at] = np.where(mean > 0, 100.0 * std / np.where(mean > 0, mean, 1.0), 0.0)
    return float(np.mean(each))


@dataclass(frozen=True, kw_only=True)
class _Segments:
    """Every segment of some chunk lists (one per pipeline), list by list, chunk by chunk."""

    chunks: list[int]
    """[list + 1] where each list's chunks start."""
    counts: np.ndarray
    """int64 [chunk] its segments."""
    fields: np.ndarray
    """int64 [segment, 3] (sequence, start, stop)."""
    padded: bool
    """Some chunk is padded (pad_to beyond its tokens): chunk_work differs from the sums."""

    @classmethod
    def of(cls, lists: list[list[Chunk]]) -> _Segments:
        chunks = [c for x in lists for c in x]
        counts, fields = segment_fields(chunks)
        return cls(chunks=np.cumsum([0] + [len(x) for x in lists]).tolist(), counts=counts, fields=fields[:, :3],
                   padded=any(c.pad_to for c in chunks))

    @property
    def owner(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.counts)), self.counts)

    def sums(self) -> tuple[np.ndarray, np.ndarray] | None:
        """int64 [chunk] tokens and causal attention pairs (Chunk.num_tokens, attention_pairs),
        exact; None where a sum could leave int64."""
        start, stop = self.fields[:, 1], self.fields[:, 2]
        if len(stop) and (int(stop.max()) >= 2**31 or float(stop.max()) ** 2 * len(stop) >= 2**62):
            return None
        return row_sums(self.counts, stop - start), row_sums(self.counts, causal_pairs(start, stop))


def micropack_metrics(request: PlanRequest, pipes: list[PipelinePlan], models) -> dict:
    """Counts, budgets, forms and the spread of MicroPack seconds (whole model, LM head included)."""
    gf, gb = models
    fwd, bwd = _Segments.of([p.chunks for p in pipes]), _Segments.of([p.bwd_units for p in pipes])
    fwd_sums = fwd.sums()
    fwd_t = _seconds(request, pipes, [p.chunks for p in pipes], fwd, fwd_sums, backward=False)
    bwd_t = _seconds(request, pipes, [p.bwd_units for p in pipes], bwd, bwd.sums(), backward=True)
    if fwd_sums is not None:
        each = fwd_sums[0].tolist()
        tokens = [each[a:b] for a, b in zip(fwd.chunks[:-1], fwd.chunks[1:])]
    else:
        tokens = [[c.num_tokens for c in p.chunks] for p in pipes]
    forms = _forms(fwd, request.lengths)
    return {
        "micropacks": [len(p.chunks) for p in pipes],
        "forward_budget_flops": _budgets(gf, fwd),
        "backward_budget_flops": _budgets(gb, bwd),
        "forms": {f: forms.count(f) for f in ("slim", "mix", "pack")},
        # within each pipeline (budgets differ between pipelines), averaged over pipelines
        "micropack_rsd": {"forward_time_pct": mean_rsd(fwd_t), "backward_time_pct": mean_rsd(bwd_t),
                          "tokens_pct": mean_rsd(tokens)},
    }


def _seconds(request: PlanRequest, pipes: list[PipelinePlan], lists: list[list[Chunk]], segs: _Segments,
             sums, *, backward: bool) -> list[list[float]]:
    """[pipeline][chunk] forward (or backward) seconds of every chunk of `lists`: without CP one
    works_time call per tp over every such pipeline's chunks (CostModel's own, elementwise: the
    same floats as forward_time / backward_time chunk by chunk), else chunk by chunk."""
    cost, layers = request.cost, request.model.num_layers
    standard = all(getattr(type(cost), name) is getattr(CostModel, name) for name in _TIMES)
    out: list = [None] * len(pipes)
    if standard and sums is not None and not segs.padded:
        tokens, keys = sums
        for tp in sorted({p.tp for p in pipes if p.cp == 1}):
            mine = [i for i, p in enumerate(pipes) if p.cp == 1 and p.tp == tp]
            at = np.concatenate([np.arange(segs.chunks[i], segs.chunks[i + 1]) for i in mine])
            each = (cost.works_time(tokens[at], keys[at], layers=layers, tp=tp, head=True,
                                    backward=backward) + 0.0).tolist()  # backward_time adds its (zero) recompute
            bounds = np.cumsum([0] + [len(lists[i]) for i in mine]).tolist()
            for k, i in enumerate(mine):
                out[i] = each[bounds[k]:bounds[k + 1]]
    fn = cost.backward_time if backward else cost.forward_time
    return [o if o is not None else _chunk_seconds(cost, fn, lists[i], pipes[i].tp, pipes[i].cp, layers, standard)
            for i, o in enumerate(out)]


def _chunk_seconds(cost: CostModel, fn, chunks: list[Chunk], tp: int, cp: int, layers: int,
                   standard: bool) -> list[float]:
    """fn(chunk) of each chunk; without CP a chunk's time depends only on its work (tokens,
    pairs), shared by equal chunks."""
    if cp > 1:
        return [fn(c, layers=layers, tp=tp, cp=cp, head=True) for c in chunks]
    if standard:  # CostModel.works_time: the scalar path's arithmetic elementwise, the same floats
        works = [chunk_work(c) for c in chunks]
        out = cost.works_time([w.tokens for w in works], [w.keys for w in works], layers=layers, tp=tp,
                              head=True, backward=fn.__name__ == "backward_time")
        return (out + 0.0).tolist()  # backward_time adds its (zero) recompute; no-op forward
    memo: dict = {}
    out = []
    for c in chunks:
        key = (fn.__name__, tp, work_key(c))
        v = memo.get(key)
        if v is None:
            v = memo[key] = fn(c, layers=layers, tp=tp, cp=cp, head=True)
        out.append(v)
    return out


def _budgets(g: PrefixCost, segs: _Segments) -> list[float]:
    """Per pipeline, the FLOPs of its segments (one elementwise prefix-cost call for all, the same
    floats) summed in segment order, over its chunks."""
    each = g.slice(segs.fields[:, 1], segs.fields[:, 2]).tolist()
    first = np.r_[0, np.cumsum(segs.counts)][segs.chunks].tolist()
    return [sum(each[first[i]:first[i + 1]]) / (segs.chunks[i + 1] - segs.chunks[i])
            for i in range(len(segs.chunks) - 1)]


def _forms(segs: _Segments, lengths: list[int]) -> list[str]:
    """micropack_form of every chunk: 'pack' when all its segments are whole samples, else 'slim'
    for one segment, 'mix' for more."""
    seq, start, stop = segs.fields[:, 0], segs.fields[:, 1], segs.fields[:, 2]
    whole = (start == 0) & (stop == np.asarray(lengths, dtype=np.int64)[seq])
    parts = np.bincount(segs.owner, weights=~whole, minlength=len(segs.counts))
    return np.where(parts == 0, "pack", np.where(segs.counts == 1, "slim", "mix")).tolist()

