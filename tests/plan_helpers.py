"""Plans and logits written by hand, for the executor's tests (not part of the package).

    plan = hand_plan(spec, [12, 5], [("0[0:12] 1[0:5]", ["F0 F1 B1 B0"])])
    logits = chunk_logits(model, Chunk.parse("0[0:6]"), token_ids)
"""

from __future__ import annotations

import torch

from lengthwise.plan.ir import Action, Chunk, PipelinePlan, StepPlan
from lengthwise.runtime.attention import ChunkLayout
from lengthwise.runtime.loss import chunk_positions, chunk_tokens
from lengthwise.runtime.model import CausalLM
from lengthwise.specs import cluster_preset


def hand_plan(spec, lengths: list[int], pipelines: list[tuple[str, list[str]]]) -> StepPlan:
    """A StepPlan from strings, one (chunks, stages) pair per pipeline, e.g.
    `("0[0:4] 0[4:8]+1[0:3]", ["F0 F1 B1 B0"])` (chunks space-separated, one action string per
    stage). For tests and experiments; planners build plans from objects."""
    pipes = [PipelinePlan(chunks=[Chunk.parse(c) for c in chunks.split()],
                          stages=[[Action.parse(a) for a in stage.split()] for stage in stages])
             for chunks, stages in pipelines]
    return StepPlan(planner="hand", model=spec, cluster=cluster_preset("cpu", sum(p.num_gpus for p in pipes)),
                    lengths=list(lengths), pipelines=pipes)


@torch.no_grad()
def chunk_logits(model: CausalLM, chunk: Chunk, token_ids: list[torch.Tensor], *,
                 backend: str = "auto") -> torch.Tensor:
    """Logits [T, V] of one chunk through the whole model, for a chunk whose segments need no
    context from other chunks (whole documents, first slices). For tests and inspection."""
    layout = ChunkLayout.from_chunk(chunk)
    assert all(s.start == 0 or layout.row_context[i] for i, s in enumerate(chunk.segments)), chunk
    param = next(model.parameters())
    h_TD = model.embed(chunk_tokens(chunk, token_ids).to(param.device))
    rope = model.rope(chunk_positions(chunk, param.device), param.dtype)
    contexts = [[[] for _ in chunk.segments] for _ in model.model.layers]
    h_TD, _ = model.run_layers(h_TD, layers=range(model.spec.num_layers), rope=rope, layout=layout,
                               contexts=contexts, backend=backend)
    return model.head_logits(h_TD)
