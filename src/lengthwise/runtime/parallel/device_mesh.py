"""The plan's ranks as one `torch.distributed.device_mesh.DeviceMesh` with dimensions
(pp, dp, cp, tp).

The rank order is `distributed/mesh.PlanLayout`'s (pipeline by pipeline, then stage, CP rank,
TP rank innermost); the mesh tensor is that layout read in (stage, pipeline, cp, tp) order, so
`mesh["tp"]` is a stage's TP group, `mesh["dp", "cp"]` (flattened to "dp_cp") the ranks that
hold the same TP shard of a stage's parameters: FSDP2 shards and reduces over it (the gradient
of one process is the sum over data-parallel replicas and CP ranks, `parallel/dp.py`).

Only plans whose pipelines share (pp, cp, tp) and the layer split have such a mesh;
heterogeneous plans (Hydraulis) run replicated (`dp.GradReducer`), or, with tp > 1 in some
pipeline, with one 1-D TP mesh per TP group and the exchange of `parallel/hetero.py`.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.distributed.mesh import PlanLayout

DIMS = ("pp", "dp", "cp", "tp")


def uniform_degrees(plan: StepPlan) -> tuple[int, int, int, int] | None:
    """(pp, dp, cp, tp) when every pipeline has the same degrees and layer split, else None."""
    first = plan.pipelines[0]
    layers = plan.model.num_layers
    for pipe in plan.pipelines[1:]:
        if (pipe.pp, pipe.cp, pipe.tp) != (first.pp, first.cp, first.tp) or \
                pipe.stage_layers(layers) != first.stage_layers(layers):
            return None
    return first.pp, len(plan.pipelines), first.cp, first.tp


def plan_device_mesh(plan: StepPlan, layout: PlanLayout, device_type: str) -> DeviceMesh | None:
    """The (pp, dp, cp, tp) mesh of a uniform plan, with "dp_cp" flattened (collective: every
    rank creates every sub-group); None for heterogeneous plans."""
    degrees = uniform_degrees(plan)
    if degrees is None:
        return None
    pp, dp, cp, tp = degrees
    # The mesh's rank table is real data, also in a dry run under fake tensors.
    with unset_fake_temporarily():
        ranks = torch.tensor([[[[layout.rank_of(d, s, c, t) for t in range(tp)] for c in range(cp)]
                               for d in range(dp)] for s in range(pp)])
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=DIMS)
        mesh["dp", "cp"]._flatten("dp_cp")
        mesh["tp"], mesh["dp_cp"]  # slice once here (DeviceMesh caches them), outside any fake mode
    return mesh


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP2 shards a stage over: dp_cp (with TP-parallel parameters FSDP2 finds the tp
    dimension on the DTensors and shards their local pieces, torchtitan's 2-D layout)."""
    return mesh["dp_cp"]
