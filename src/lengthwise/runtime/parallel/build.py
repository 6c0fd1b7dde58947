"""One rank's model for a plan: its stage only, parallelised, then materialised.

    model = build_rank_model(plan, mesh, dtype=torch.float64, seed=0)          # or weights="ckpt/"
    run_rank_step(model, plan, token_ids, mesh=mesh)

Order (torchtitan's): the stage's modules on the meta device (`model.StagePart`), tensor
parallelism over the mesh's tp dimension, FSDP2 over dp x cp, then `to_empty` on the rank's
device and the weights: seeded (the same values whatever the split) or read from a Hugging
Face checkpoint, only the stage's tensors, each rank keeping its own shard. Nothing is
allocated beyond the rank's shard of its stage (plus one whole tensor while loading).

`data_parallel="replicate"` keeps whole parameters on every replica and sums gradients with
`parallel/dp.GradReducer` (also what heterogeneous plans, which have no uniform mesh, get;
when some of their pipelines use tp > 1, each TP group gets its own 1-D mesh and gradients are
summed through `parallel/hetero_reducer.HeteroReducer`, the optimisation-propagation exchange).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.parallel.dp import stage_part
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.model import CausalLM, init_weights, meta_model
from lengthwise.runtime.parallel.device_mesh import plan_device_mesh, shard_mesh
from lengthwise.runtime.parallel.fsdp import apply_fsdp
from lengthwise.runtime.parallel.hetero_reducer import hetero_tp_mesh
from lengthwise.runtime.parallel.tensor_parallel import apply_tp
from lengthwise.runtime.weights import copy_whole, load_weights

DATA_PARALLEL = ("fsdp", "replicate")


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How a rank's model is parallelised beyond what the plan fixes (pp, cp, tp, zero)."""

    data_parallel: str = "fsdp"
    """fsdp (FSDP2 over dp x cp, as the plan's zero says) or replicate (whole copies, one
    all-reduce per step)."""
    param_dtype: torch.dtype | None = None
    """Compute dtype under FSDP2 (bfloat16) while the master weights stay in `dtype`."""
    sequence_parallel: bool = True
    """Under tp > 1, split the residual stream's rows over TP (Megatron's sequence parallelism,
    `parallel/tensor_parallel.py`); False keeps whole activations on every TP rank."""


def build_rank_model(plan: StepPlan, mesh: Mesh, *, dtype: torch.dtype = torch.float32, seed: int | None = None,
                     weights: str | Path | None = None, options: ParallelOptions = ParallelOptions(),
                     fake: bool = False) -> CausalLM:
    """This rank's stage of `plan.model`, parallelised and materialised (collective: creates the
    plan's process groups and DeviceMesh, recorded in `mesh.device_mesh`). Neither seed nor
    weights: uninitialised memory. `fake`: called under FakeTensorMode (a dry run), where
    modules are built directly (storage costs nothing there, and fake parameters cannot be
    swapped by `to_empty`)."""
    if options.data_parallel not in DATA_PARALLEL:
        raise UserError(f"data_parallel={options.data_parallel!r}: use one of {', '.join(DATA_PARALLEL)}")
    layout = mesh.layout(plan)
    part = stage_part(plan, layout.place)
    if fake:
        with torch.device(mesh.device):
            model = CausalLM(plan.model, part, dtype)
    else:
        model = meta_model(plan.model, part=part, dtype=dtype)
    device_mesh = plan_device_mesh(plan, layout, mesh.device.type)
    tp = plan.pipelines[layout.place.pipeline].tp
    tp_mesh = device_mesh["tp"] if device_mesh is not None and tp > 1 else None
    if device_mesh is None and any(p.tp > 1 for p in plan.pipelines):
        # heterogeneous pipelines (Hydraulis): each (pipeline, stage, cp rank) has its own TP group,
        # created by every rank in the same order; gradients go through
        # `hetero_reducer.HeteroReducer`
        check_hetero_vocabulary(plan)
        with unset_fake_temporarily() if fake else contextlib.nullcontext():  # its rank table stays real
            tp_mesh = hetero_tp_mesh(plan, layout, mesh)
    mesh.device_mesh = device_mesh
    mesh.compute_dtype = None
    sharded = device_mesh is not None and options.data_parallel == "fsdp" and plan.zero > 0
    if options.param_dtype is not None and not sharded:
        raise UserError("a compute dtype apart from the master weights' needs FSDP2: plan with zero >= 1 "
                        "and uniform pipelines")
    # DeviceMesh keeps its rank tables as tensors: under a dry run's fake mode they must stay real
    # (fake parameters still dispatch to their own mode)
    with unset_fake_temporarily() if fake else contextlib.nullcontext():
        if tp_mesh is not None:
            apply_tp(model, tp_mesh, sequence_parallel=options.sequence_parallel)
        if sharded:
            apply_fsdp(model, shard_mesh(device_mesh), zero=plan.zero, param_dtype=options.param_dtype)
            mesh.compute_dtype = options.param_dtype
    if not fake:
        model.to_empty(device=mesh.device)
        model.tie()  # `to_empty` gives a plain (non-DTensor) tied head a parameter of its own
    if seed is not None:
        init_weights(model, seed, assign=copy_whole)
    elif weights is not None:
        load_weights(model, weights)
    return model


def check_hetero_vocabulary(plan) -> None:
    """UserError when a tp of a heterogeneous plan (pipelines of different shapes) does not
    divide the vocabulary: the exchange maps one layout onto another, and a padded vocabulary
    has no counterpart. Launchers call it before starting processes."""
    odd = sorted({p.tp for p in plan.pipelines if plan.model.vocab % p.tp})
    if odd:
        raise UserError(f"heterogeneous pipelines need every tp to divide the vocabulary: {plan.model.name} "
                        f"has {plan.model.vocab} tokens, which tp {', '.join(map(str, odd))} does not divide")
