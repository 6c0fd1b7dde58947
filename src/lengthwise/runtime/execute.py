"""Run a whole StepPlan on one process: every pipeline, every stage, exactly.

    loss = run_step(model, plan, token_ids)     # grads accumulate into model's parameters
    loss.item()

One `StageRunner` per (pipeline, stage), all sharing one model (so data-parallel replicas'
gradients simply add up, which is the all-reduce SUM the loss normalisation expects) and one
`InProcessTransport`. The driver sweeps the runners round-robin and runs each one's next
action whose input has arrived, one action per runner per sweep, an interleaving close to the
real pipeline timeline. A sweep in which no runner can move is a deadlocked schedule and is
reported stage by stage.

A distributed driver builds the same runners (one per rank) with a torch.distributed transport
and calls `runner.run_all()`.
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
from lengthwise.specs import CLUSTER_PRESETS


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
    return StepPlan(planner=planner, model=spec, cluster=CLUSTER_PRESETS["cpu"], lengths=list(lengths),
                    pipelines=[PipelinePlan(chunks=chunks, stages=[actions])])


def hand_plan(spec, lengths: list[int], pipelines: list[tuple[str, list[str]]]) -> StepPlan:
    """A StepPlan from strings, one (chunks, stages) pair per pipeline, e.g.
    `("0[0:4] 0[4:8]+1[0:3]", ["F0 F1 B1 B0"])` (chunks space-separated, one action string per
    stage). For tests and experiments; planners build plans from objects."""
    pipes = [PipelinePlan(chunks=[Chunk.parse(c) for c in chunks.split()],
                          stages=[[Action.parse(a) for a in stage.split()] for stage in stages])
             for chunks, stages in pipelines]
    return StepPlan(planner="hand", model=spec, cluster=CLUSTER_PRESETS["cpu"], lengths=list(lengths),
                    pipelines=pipes)


@torch.no_grad()
def chunk_logits(model: CausalLM, chunk: Chunk, token_ids: list[torch.Tensor], *,
                 backend: str = "auto") -> torch.Tensor:
    """Logits [T, V] of one chunk through the whole model, for a chunk whose segments need no
    context from other chunks (whole documents, first slices). For tests and inspection."""
    from lengthwise.runtime.attention import ChunkLayout
    from lengthwise.runtime.loss import chunk_positions, chunk_tokens

    layout = ChunkLayout.from_chunk(chunk)
    assert all(s.start == 0 or layout.row_context[i] for i, s in enumerate(chunk.segments)), chunk
    param = next(model.parameters())
    h_TD = model.embed(chunk_tokens(chunk, token_ids).to(param.device))
    rope = model.rope(chunk_positions(chunk, param.device), param.dtype)
    contexts = [[[] for _ in chunk.segments] for _ in model.model.layers]
    h_TD, _ = model.run_layers(h_TD, layers=range(model.spec.num_layers), rope=rope, layout=layout,
                               contexts=contexts, backend=backend)
    return model.head_logits(h_TD)
