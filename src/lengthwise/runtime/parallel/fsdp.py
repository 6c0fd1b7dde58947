"""FSDP2 over a stage's data-parallel x CP ranks: parameters, gradients and optimizer states
sharded (ZeRO-3, or ZeRO-1/2-like), gradients reduced once per step.

    apply_fsdp(model, shard_mesh(mesh), zero=3, param_dtype=torch.bfloat16)
    steps = FsdpSteps(model, plan, layout)      # per step, around the action loop
    steps.begin(); ... steps.before_action(i) ...; steps.end()

Wrapping (torchtitan's): `fully_shard` on the embedding, on every decoder layer, on the final
norm with the LM head, then on the stage's root (`shard_groups`). The executor calls the
model's `embed`, `run_layers` and `head_loss` (or `head_logits`), not `forward`, so those are registered as
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

Gradients are reduce-scattered once a step, in the backward of the stage's last cell (a
backward action of several cells, SlimPack's backward units, turns reduction on only before
its last cell), so replicas may hold any number of cells in their last backward.
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

FORWARD_METHODS = ("embed", "run_layers", "head_logits", "head_loss")


def apply_fsdp(model: CausalLM, mesh: DeviceMesh, *, zero: int, param_dtype: torch.dtype | None = None) -> CausalLM:
    """Shard `model` (one stage's, maybe TP-parallelised) over `mesh`, in place.

    `param_dtype`: compute dtype (bf16) while the sharded master copy stays in the model's
    dtype (fp32); gradients are reduced in float32 (`MixedPrecisionPolicy`)."""
    policy = MixedPrecisionPolicy() if param_dtype is None else \
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = zero >= 3
    for group in shard_groups(model):
        fully_shard(group, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        # A plain SUM (no NCCL PreMulSum, which gloo lacks): the factor is 1 anyway.
        module.set_force_sum_reduction_for_comms(True)
    return model


def shard_groups(model: CausalLM) -> list:
    """The FSDP units below the root, in forward order: the embedding, each decoder layer,
    the final norm with the LM head.

    The embedding and the head are units of their own rather than the root's parameters
    because the root's hooks wrap every root forward method: its post-backward (reduce-scatter
    and reshard) fires where gradients leave `run_layers`, which on the first stage is before
    the embedding's backward, so the embedding was all-gathered again and reduce-scattered a
    second time in the last backward (one more vocabulary table per step); on the last stage
    the head was all-gathered again after its reduce-scatter. As units of their own, each is
    gathered and reduced once, around its own modules' forward and backward. A tied table
    held by one stage for both ends stays in the root (one parameter cannot be in two units)."""
    part, stack = model.part, model.model
    tied_here = model.spec.tied_embeddings and part.last
    groups: list = []
    if part.first and not tied_here:
        groups.append(stack.embed_tokens)
    groups += list(stack.layers.values())
    if part.last and not tied_here:
        groups.append([stack.norm, model.lm_head])
    return groups


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """One module per FSDP unit (a unit of several modules, the norm with the head, once)."""
    units, seen = [], set()
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module._get_fsdp_state()) not in seen:
            seen.add(id(module._get_fsdp_state()))
            units.append(module)
    return units


def is_fsdp(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def stage_structure(plan: StepPlan, pipeline: int, stage: int) -> list[tuple[str, int, int, int]]:
    """What decides this stage's FSDP collectives: per action, its kind, cells and recomputed
    layers and MLP blocks."""
    pipe = plan.pipelines[pipeline]
    cells = cell_map(pipe)
    return [(a.kind, len(cells.cells_of(a)), a.recompute_layers, a.recompute_mlp) for a in pipe.stages[stage]]


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
        self.last_backward = max(i for i, a in enumerate(self.actions) if a.kind == BACKWARD)
        part = model.part
        if model.spec.tied_embeddings and part.first and part.last and \
                len({_backwards(r) > 1 for r in replicas}) > 1:
            raise UserError(f"pipeline {place.pipeline} stage {place.stage}: FSDP2 cannot reduce a tied embedding "
                            "consistently when some data-parallel replicas run one backward unit in the step "
                            "and others several (their reduce-scatters differ in size); use --zero 0, pp > 1, "
                            "or a batch that gives every replica several micro-batches")

    def begin(self) -> None:
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_forward(self.per_chunk, recurse=False)
            module.set_reshard_after_backward(self.per_chunk, recurse=False)
        if not self.per_chunk:
            for module in self.modules:
                module.unshard()

    def before_backward_cell(self, index: int, position: int, cells: int) -> None:
        """Before each cell's backward (`StageRunner.before_backward_cell`): the step's last
        cell reduce-scatters every unit's accumulated gradient, once, and reshards."""
        if index == self.last_backward and position == cells - 1:
            for module in self.modules:
                module.set_requires_gradient_sync(True, recurse=False)
                module.set_reshard_after_backward(True, recurse=False)

    def end(self) -> None:
        """Parameters resharded after the step, whatever the mode."""
        for module in self.modules:
            module.reshard()

    def reduced_elements(self, group_size: int) -> int:
        """Gradient elements this rank handed to FSDP2's reduce-scatters (its unsharded
        gradients, once a step; the all-gathers of parameters are not counted)."""
        return group_size * sum(p.to_local().numel() for p in self.model.parameters())


def _backwards(structure: list[tuple[str, int, int, int]]) -> int:
    return sum(kind == BACKWARD for kind, *_ in structure)
