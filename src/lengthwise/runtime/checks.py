"""What the executor needs of a StepPlan before it runs it, checked up front.

These are the plan invariants that would otherwise give silently wrong gradients: every token
forwarded with grad exactly once (and backwarded once, when a pipeline groups its backward
separately: SlimPack §4.1.2, each backward segment inside one forward segment), each stage
running F before B of every chunk (an optional N before the F; with backward units, the F of
every chunk a unit reads before the unit's B), and each split sequence's backwards in reverse
slice order on every stage (an earlier slice's backward must see the dK/dV of all later ones).
Messages name the pipeline, stage and action. The full validator (lengthwise.plan.validate)
checks more (memory, costs).
"""

from __future__ import annotations

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, FORWARD, FORWARD_NOGRAD, Action, Chunk, PipelinePlan, StepPlan
from lengthwise.runtime.cells import cell_map
from lengthwise.specs import ModelSpec


def check_executable(plan: StepPlan, spec: ModelSpec, token_ids: list[torch.Tensor]) -> None:
    """UserError naming the first thing in plan or inputs the executor cannot run exactly."""
    _check_inputs(plan, spec, token_ids)
    _check_token_coverage(plan, [pipe.chunks for pipe in plan.pipelines], "the plan")
    if any(pipe.backward_chunks is not None for pipe in plan.pipelines):
        _check_token_coverage(plan, [pipe.bwd_units for pipe in plan.pipelines], "the backward units")
    for p, pipe in enumerate(plan.pipelines):
        _check_pipeline_shape(p, pipe, spec)
        try:
            cells = cell_map(pipe)
        except UserError as exc:
            raise UserError(f"pipeline {p}: {exc}") from None
        reads = [sorted({cells.chunk_of[i] for i in unit}) for unit in cells.backward]
        layers = pipe.stage_layers(spec.num_layers)
        for s, actions in enumerate(pipe.stages):
            _check_stage_actions(f"pipeline {p} stage {s}", actions, pipe, layers[s], reads)
            _check_reverse_backward(f"pipeline {p} stage {s}", actions, pipe)


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


def _check_token_coverage(plan: StepPlan, chunk_lists: list[list[Chunk]], what: str) -> None:
    """Each token of each sequence in exactly one chunk (or unit) of one pipeline."""
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunks in chunk_lists:
        for chunk in chunks:
            for seg in chunk.segments:
                if not 0 <= seg.seq_id < len(plan.lengths) or not 0 <= seg.start < seg.stop <= plan.lengths[seg.seq_id]:
                    raise UserError(f"segment {seg} lies outside its sequence (lengths has {len(plan.lengths)} "
                                    f"sequences; this one's length is "
                                    f"{plan.lengths[seg.seq_id] if 0 <= seg.seq_id < len(plan.lengths) else '-'})")
                covered.setdefault(seg.seq_id, []).append((seg.start, seg.stop))
    for seq_id, length in enumerate(plan.lengths):
        at = 0
        for start, stop in sorted(covered.get(seq_id, [])):
            if start != at:
                raise UserError(f"sequence {seq_id}: tokens [{min(at, start)}:{max(at, start)}) are "
                                f"{'missing' if start > at else 'planned twice'} in {what}")
            at = stop
        if at != length:
            raise UserError(f"sequence {seq_id}: tokens [{at}:{length}) are missing from {what}")


def _check_pipeline_shape(p: int, pipe: PipelinePlan, spec: ModelSpec) -> None:
    if not pipe.stages:
        raise UserError(f"pipeline {p} has no stages")
    layers = pipe.stage_layers(spec.num_layers)
    if len(layers) != pipe.pp or sum(layers) != spec.num_layers or min(layers) < 0:
        raise UserError(f"pipeline {p}: layers_per_stage {layers} must be {pipe.pp} counts summing to "
                        f"the model's {spec.num_layers} layers")
    for chunk in pipe.chunks:
        last_stop: dict[int, int] = {}
        for seg in chunk.segments:
            if last_stop.get(seg.seq_id, seg.start) != seg.start:
                raise UserError(f"pipeline {p}: chunk {chunk} holds slices of sequence {seg.seq_id} that "
                                "are not adjacent in token order; give a row only consecutive slices")
            last_stop[seg.seq_id] = seg.stop


def _check_stage_actions(where: str, actions: list[Action], pipe: PipelinePlan, layers: int,
                         reads: list[list[int]]) -> None:
    """Per chunk, the stage runs [N] F once, in that order; per backward unit one B, after the F
    of every chunk it reads (`reads`; without backward_chunks: each chunk [N] F B)."""
    sizes = {FORWARD: len(pipe.chunks), FORWARD_NOGRAD: len(pipe.chunks), BACKWARD: len(pipe.bwd_units)}
    seen: dict[int, str] = {}
    backwarded: set[int] = set()
    for index, action in enumerate(actions):
        here = f"{where} action {index} ({action})"
        if not 0 <= action.chunk < sizes[action.kind]:
            what = "backward units" if action.kind == BACKWARD and pipe.backward_chunks is not None else "chunks"
            raise UserError(f"{here}: the pipeline has {sizes[action.kind]} {what}")
        if not 0 <= action.recompute_layers <= layers:
            raise UserError(f"{here}: recompute_layers must lie in [0, {layers}], the stage's layers")
        if action.kind == BACKWARD:
            _check_backward_after_forwards(here, action.chunk, reads, seen, backwarded)
            backwarded.add(action.chunk)
            continue
        before = seen.get(action.chunk, "")
        if before not in {FORWARD_NOGRAD: ("",), FORWARD: ("", "N")}[action.kind]:
            raise UserError(f"{here} follows {before} for chunk {action.chunk}; each chunk runs [N] F B "
                            "once, in that order")
        seen[action.chunk] = before + action.kind
    no_f = [c for c in range(len(pipe.chunks)) if not seen.get(c, "").endswith("F")]
    no_b = [u for u in range(len(pipe.bwd_units)) if u not in backwarded]
    if pipe.backward_chunks is None and (no_f or no_b):
        raise UserError(f"{where}: chunks {sorted(set(no_f + no_b))} lack an F followed by a B")
    if no_f or no_b:
        raise UserError(f"{where}: chunks {no_f} lack an F, backward units {no_b} a B")


def _check_backward_after_forwards(here: str, unit: int, reads: list[list[int]], seen: dict[int, str],
                                   done: set[int]) -> None:
    if unit in done:
        raise UserError(f"{here} runs B{unit} twice; each chunk runs [N] F B once, in that order")
    lacking = [c for c in reads[unit] if not seen.get(c, "").endswith("F")]
    if lacking:
        raise UserError(f"{here} follows {seen.get(lacking[0], '') or 'nothing'} for chunk {lacking[0]}; "
                        "each chunk runs [N] F B once, in that order (B after the F of every chunk it reads)")


def _check_reverse_backward(where: str, actions: list[Action], pipe: PipelinePlan) -> None:
    """Slices of one sequence: backward from the last slice to the first (chunkflow §4.2)."""
    last_start: dict[int, int] = {}
    for index, action in enumerate(actions):
        if action.kind != BACKWARD:
            continue
        firsts: dict[int, int] = {}  # a row's slices of one sequence run backward together
        for seg in pipe.bwd_units[action.chunk].segments:
            later = last_start.get(seg.seq_id)
            if later is not None and seg.start > later:
                raise UserError(f"{where} action {index} ({action}): slice {seg} runs backward after an "
                                "earlier slice of its sequence; backwards must go from the last slice to the first")
            firsts[seg.seq_id] = min(firsts.get(seg.seq_id, seg.start), seg.start)
        last_start.update(firsts)
