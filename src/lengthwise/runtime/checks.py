"""What the executor checks of its inputs before it runs a plan: the plan itself goes through the
plan validator (lengthwise.plan.validate, the same invariants the planners and the simulator
rely on); here, only that the plan was made for the model being run and that the token ids are
the ones it describes.
"""

from __future__ import annotations

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
from lengthwise.plan.validate import validate_plan
from lengthwise.specs import ModelSpec


def check_executable(plan: StepPlan, spec: ModelSpec, token_ids: list[torch.Tensor]) -> None:
    """UserError naming the first thing in plan or inputs the executor cannot run exactly."""
    _check_model(plan, spec)
    _check_inputs(plan, spec, token_ids)
    validate_plan(plan)


def _check_model(plan: StepPlan, spec: ModelSpec) -> None:
    """The plan's stage layers and head split are the model's (validate_plan checks them against
    plan.model)."""
    if (plan.model.num_layers, plan.model.num_heads) != (spec.num_layers, spec.num_heads):
        raise UserError(f"the plan was made for {plan.model.name} ({plan.model.num_layers} layers, "
                        f"{plan.model.num_heads} heads), not {spec.name} ({spec.num_layers} layers, "
                        f"{spec.num_heads} heads): plan again for this model")


def _check_inputs(plan: StepPlan, spec: ModelSpec, token_ids: list[torch.Tensor]) -> None:
    if len(token_ids) != len(plan.lengths):
        raise UserError(f"got token ids for {len(token_ids)} sequences, the plan has {len(plan.lengths)}")
    for i, (ids, n) in enumerate(zip(token_ids, plan.lengths)):
        if ids.dim() != 1 or ids.numel() != n:
            raise UserError(f"sequence {i}: token ids of shape {tuple(ids.shape)}, the plan says length {n}")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= spec.vocab):
            raise UserError(f"sequence {i}: token ids must lie in [0, vocab({spec.vocab}))")
    if not plan.pipelines:
        raise UserError("the plan has no pipelines")
