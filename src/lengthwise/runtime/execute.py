"""Run a whole StepPlan on one process: every pipeline, every stage, exactly.

    loss = run_step(model, plan, token_ids)     # grads accumulate into model's parameters
    loss.item()

One `StageRunner` per (pipeline, stage), all sharing one model (so data-parallel replicas'
gradients simply add up, which is the all-reduce SUM the loss normalisation expects) and one
`InProcessTransport`. The driver sweeps the runners round-robin and runs each one's next
action whose input has arrived, one action per runner per sweep, an interleaving close to the
real pipeline timeline. A sweep in which no runner can move is a deadlocked schedule and is
reported stage by stage.

A distributed driver (`parallel/step.py`) builds the same runners, one per rank, with a
torch.distributed transport and steps its rank's runner through every action.
"""

from __future__ import annotations

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, Action, Chunk, PipelinePlan, StepPlan
from lengthwise.runtime.attention import resolve_backend
from lengthwise.runtime.checks import check_executable
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.stage import StageRunner
from lengthwise.runtime.transport import InProcessTransport
from lengthwise.specs import cluster_preset


def run_step(model: CausalLM, plan: StepPlan, token_ids: list[torch.Tensor], *,
             backend: str = "auto") -> torch.Tensor:
    """Forward and backward of one global batch as `plan` says; returns the loss (float64
    scalar, sum of token cross-entropies / plan.loss_tokens) with gradients accumulated into
    the model's parameters (.grad, added to what is there)."""
    check_executable(plan, model.spec, token_ids)
    param = next(model.parameters())
    backend = resolve_backend(backend, param.device, param.dtype)
    transport = InProcessTransport()
    runners = [StageRunner(model=model, plan=plan, pipeline=p, stage=s, token_ids=token_ids,
                           transport=transport, backend=backend)
               for p, pipe in enumerate(plan.pipelines) for s in range(pipe.pp)]
    _interleave(runners, transport)
    assert transport.in_flight == 0, "a message was sent and never received"
    return sum(r.loss_sum for r in runners if r.is_last)


def _interleave(runners: list[StageRunner], transport: InProcessTransport) -> None:
    while not all(r.done for r in runners):
        moved = False
        for runner in runners:
            if runner.done:
                continue
            message = runner.needs()
            if message is None or transport.ready(message):
                runner.step()
                moved = True
        if not moved:
            raise UserError(_deadlock_report(runners))


def _deadlock_report(runners: list[StageRunner]) -> str:
    waits = [f"{r.where()} waits for the {r.needs()}" for r in runners if not r.done]
    return "the schedule deadlocks: " + "; ".join(waits)


def unpacked_plan(lengths: list[int], spec, *, planner: str = "unpacked") -> StepPlan:
    """Each sequence alone in its own chunk, forward then backward: plain training."""
    chunks = [Chunk.parse(f"{i}[0:{n}]") for i, n in enumerate(lengths)]
    actions = [Action(kind, i) for i in range(len(lengths)) for kind in (FORWARD, BACKWARD)]
    return StepPlan(planner=planner, model=spec, cluster=cluster_preset("cpu", 1),
                    lengths=list(lengths), pipelines=[PipelinePlan(chunks=chunks, stages=[actions])])
