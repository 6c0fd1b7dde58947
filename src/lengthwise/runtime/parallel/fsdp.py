"""FSDP2 over a stage's data-parallel x CP ranks: parameters, gradients and optimizer states
sharded (ZeRO-3, or ZeRO-1/2-like), gradients reduced once per step.

    apply_fsdp(model, shard_mesh(mesh), zero=3, param_dtype=torch.bfloat16)
    steps = FsdpSteps(model, plan, layout)      # per step, around the action loop
    steps.begin(); ... steps.before_action(i) ...; steps.end()

Wrapping (torchtitan's): `fully_shard` on every decoder layer, then on the stage's root (its
embedding, final norm and head, tied or not, form the root's group). The executor calls the
model's `embed`, `run_layers` and `head_logits`, not `forward`, so those are registered as
FSDP forward methods (`register_fsdp_forward_method`).

Gradient reduction. A plan runs many backwards per step (one per backward unit's cell), and
the loss is already normalised by the global batch's loss tokens (`runtime/loss.py`), so the
gradient of one process is the SUM over replicas: `set_gradient_divide_factor(1.0)` on every
FSDP module, and `set_requires_gradient_sync(False)` until the stage's last backward action,
so FSDP2 accumulates unsharded gradients locally and reduce-scatters once.

Collective order. FSDP2 all-gathers a layer's parameters before each forward and backward it
has resharded, and reduce-scatters in post-backward: every rank of a dp x cp group must make the
same sequence of those calls. CP ranks of a stage run the same actions; data-parallel replicas
run their own pipeline's actions. So:

- ZeRO-3 (`reshard_after_forward=True`, plan `zero` 3) all-gathers per forward and backward
  when the stage's action sequence (kinds and cells per action) is the same on every replica
  of the group (`same_structure`); otherwise that step gathers once at its start and keeps the
  parameters until its end (the ZeRO-1/2-like mode below), which only costs memory;
- ZeRO-1/2-like (`zero` < 3): `unshard()` once at the start of the step, no resharding after
  forward or backward until the last backward, which reshards.

The last backward action must hold the same number of cells on every replica (each cell's
backward reduce-scatters once); `FsdpSteps` checks this and names the stage otherwise.
"""

from __future__ import annotations


import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, StepPlan
from lengthwise.runtime.cells import cell_map
from lengthwise.runtime.distributed.mesh import PlanLayout
from lengthwise.runtime.model import CausalLM

FORWARD_METHODS = ("embed", "run_layers", "head_logits")


def apply_fsdp(model: CausalLM, mesh: DeviceMesh, *, zero: int, param_dtype: torch.dtype | None = None) -> CausalLM:
    """Shard `model` (one stage's, maybe TP-parallelised) over `mesh`, in place.

    `param_dtype`: compute dtype (bf16) while the sharded master copy stays in the model's
    dtype (fp32); gradients are reduced in float32 (`MixedPrecisionPolicy`)."""
    policy = MixedPrecisionPolicy() if param_dtype is None else \
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = zero >= 3
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    if own_embedding_group(model):
        fully_shard(model.model.embed_tokens, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        # A plain SUM (no NCCL PreMulSum, which gloo lacks): the factor is 1 anyway.
        module.set_force_sum_reduction_for_comms(True)
    return model


def own_embedding_group(model: CausalLM) -> bool:
    """Whether the (untied) embedding of a stage that also holds the head gets its own FSDP
    group. The root's group is reduced when the gradient reaches the input of one of its
    methods (`head_logits`, `run_layers`), before the embedding's backward: in the same group,
    the embedding would join that reduce-scatter only on replicas that accumulated its gradient
    in an earlier backward of the step, and replicas with one backward and with several (packing
    dp 2 over 3 sequences) would call reduce-scatters of different sizes. Its own group is
    reduced after its backward, at the end. A tied embedding is the head's weight: it stays."""
    return hasattr(model.model, "embed_tokens") and model.part.last and not model.spec.tied_embeddings


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fsdp(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def stage_structure(plan: StepPlan, pipeline: int, stage: int) -> list[tuple[str, int, int]]:
    """What decides this stage's FSDP collectives: per action, its kind, cells and recomputed
    layers."""
    pipe = plan.pipelines[pipeline]
    cells = cell_map(pipe)
    return [(a.kind, len(cells.cells_of(a)), a.recompute_layers) for a in pipe.stages[stage]]


class FsdpSteps:
    """Switches FSDP2's per-step behaviour around one rank's action loop (module docstring)."""

    def __init__(self, model: CausalLM, plan: StepPlan, layout: PlanLayout, *, zero: int):
        place = layout.place
        self.model, self.modules = model, fsdp_modules(model)
        self.actions = plan.pipelines[place.pipeline].stages[place.stage]
        # every rank holds the plan, so each can tell from it alone what all replicas of its
        # stage (the same stage of every pipeline; CP ranks share their pipeline's) will run
        structure = stage_structure(plan, place.pipeline, place.stage)
        replicas = [stage_structure(plan, p, place.stage) for p in range(len(plan.pipelines))]
        self.per_chunk = zero >= 3 and all(r == structure for r in replicas)
        last_b = max(i for i, a in enumerate(self.actions) if a.kind == BACKWARD)
        if any(_last_backward_cells(r) != structure[last_b][1] for r in replicas):
            raise UserError(f"pipeline {place.pipeline} stage {place.stage}: its last backward unit has "
                            f"{structure[last_b][1]} cells, other data-parallel replicas' differ; FSDP "
                            f"reduces once per cell, so plan with equal last backward units or --zero 0")
        part = model.part
        if model.spec.tied_embeddings and part.first and part.last and \
                len({_backwards(r) > 1 for r in replicas}) > 1:
            raise UserError(f"pipeline {place.pipeline} stage {place.stage}: FSDP2 cannot reduce a tied embedding "
                            "consistently when some data-parallel replicas run one backward unit in the step "
                            "and others several (their reduce-scatters differ in size); use --zero 0, pp > 1, "
                            "or a batch that gives every replica several micro-batches")
        self.last_backward = last_b
        self.cells_of_last = range(structure[last_b][1])

    def begin(self) -> None:
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_forward(self.per_chunk, recurse=False)
            module.set_reshard_after_backward(self.per_chunk, recurse=False)
        if not self.per_chunk:
            for module in self.modules:
                module.unshard()

    def before_action(self, index: int) -> None:
        if index == self.last_backward:
            for module in self.modules:
                module.set_requires_gradient_sync(True, recurse=False)
                module.set_reshard_after_backward(True, recurse=False)

    def end(self) -> None:
        """Parameters resharded after the step, whatever the mode."""
        for module in self.modules:
            module.reshard()

    def reduced_elements(self, group_size: int) -> int:
        """Gradient elements this rank handed to FSDP2's reduce-scatters (its unsharded
        gradients, once per cell of the last backward; the all-gathers of parameters are not
        counted)."""
        cells = len(self.cells_of_last)
        return cells * group_size * sum(p.to_local().numel() for p in self.model.parameters())


def _backwards(structure: list[tuple[str, int, int]]) -> int:
    return sum(kind == BACKWARD for kind, _, _ in structure)


def _last_backward_cells(structure: list[tuple[str, int, int]]) -> int:
    return next(cells for kind, cells, _ in reversed(structure) if kind == BACKWARD)
