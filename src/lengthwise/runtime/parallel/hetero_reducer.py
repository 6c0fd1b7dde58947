"""A plan and a model wired to the heterogeneous exchange (`hetero.py`): every rank's holdings
under a strategy (from the model and the plan alone, so every rank derives the same), this
rank's TP mesh in a heterogeneous plan, and `HeteroReducer`, the gradient sum a rank's step
runs. Its own module because it is the one part of the exchange that knows the model
(parameter names, TP placements, stages); `hetero_layout.py` and `hetero.py` see only shapes
and shards.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lengthwise.runtime.parallel.dp import held_parameters, local, stage_holds
from lengthwise.runtime.model import StagePart, meta_model
from lengthwise.runtime.parallel.hetero import HeteroExchange
from lengthwise.runtime.parallel.hetero_layout import WHOLE, Holdings, Shard
from lengthwise.runtime.parallel.tensor_parallel import tp_partial_names, tp_shard_dim


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
