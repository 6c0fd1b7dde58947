"""plan/segment_checks.py's pass over arrays says a plan keeps the segment invariants exactly
when validate.py's walk over every segment finds nothing: valid plans, and valid plans with one
segment, chunk or count broken."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from lengthwise.errors import UserError
from lengthwise.plan import validate
from lengthwise.plan.ir import SHARDED, Action, Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.plan.segment_checks import segments_hold
from lengthwise.specs import MODEL_PRESETS, cluster_preset

CASES = settings(max_examples=120, deadline=None, database=None, derandomize=True)


def walk_passes(plan: StepPlan) -> bool:
    """validate.py's own checks of invariants 2, 3, 4 and 6, segment by segment."""
    try:
        for p, pipe in enumerate(plan.pipelines):
            for name, units in validate._unit_lists(pipe):
                validate._check_segments(plan, p, name, units, pipe.cp)
        validate._check_one_pipeline_per_sequence(plan)
        validate._check_coverage(plan, backward=False)
        if any(pipe.backward_chunks is not None for pipe in plan.pipelines):
            validate._check_coverage(plan, backward=True)
        validate._check_loss_tokens(plan)
    except UserError:
        return False
    return True


@st.composite
def plans(draw) -> StepPlan:
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    num_pipes = draw(st.integers(1, 3))
    pipes = [[[] for _ in range(draw(st.integers(1, 3)))] for _ in range(num_pipes)]
    for q, n in enumerate(lengths):  # each sequence cut into slices over one pipeline's chunks
        cuts = sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2))) - {n})
        p = draw(st.integers(0, num_pipes - 1))
        for a, b in zip([0] + cuts, cuts + [n]):
            chunk = draw(st.integers(0, len(pipes[p]) - 1))
            pipes[p][chunk].append(Segment(q, a, b))
    out = []
    for rows in pipes:
        chunks = [Chunk(tuple(sorted(r, key=lambda s: (s.seq_id, s.start)))) for r in rows if r]
        cp = draw(st.integers(1, 2))
        units = [Chunk(c.segments[::-1]) for c in chunks] if draw(st.booleans()) else None
        stages = [[Action("F", c) for c in range(len(chunks))] + [Action("B", c) for c in range(len(chunks))]]
        out.append(PipelinePlan(chunks=chunks, stages=stages, cp=cp, backward_chunks=units))
    plan = StepPlan(planner="test", model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster_preset("h100", 8),
                    lengths=lengths, pipelines=out)
    return draw(st.one_of(st.just(plan), broken(plan)))


def broken(plan: StepPlan):
    """The plan with one thing changed: a segment's sequence, bounds or CP rank, a segment
    dropped or repeated, an empty or negatively padded chunk, a moved slice, a wrong loss count."""
    @st.composite
    def change(draw) -> StepPlan:
        pipes = [dataclasses.replace(p, chunks=list(p.chunks)) for p in plan.pipelines]
        p = draw(st.integers(0, len(pipes) - 1))
        kind = draw(st.sampled_from(["seq", "start", "stop", "rank", "drop", "repeat", "empty", "pad", "move",
                                     "loss", "lengths", "swap"]))
        if kind == "loss":
            return dataclasses.replace(plan, metrics={"loss_tokens": plan.loss_tokens + draw(st.sampled_from([-1, 1]))})
        if kind == "lengths":
            lengths = list(plan.lengths)
            lengths[draw(st.integers(0, len(lengths) - 1))] += draw(st.sampled_from([-1, 1]))
            return dataclasses.replace(plan, lengths=lengths)
        if not pipes[p].chunks:
            return plan
        c = draw(st.integers(0, len(pipes[p].chunks) - 1))
        segs = list(pipes[p].chunks[c].segments)
        i = draw(st.integers(0, len(segs) - 1))
        s = segs[i]
        if kind == "seq":
            segs[i] = dataclasses.replace(s, seq_id=draw(st.integers(-1, len(plan.lengths))))
        elif kind == "start":
            segs[i] = dataclasses.replace(s, start=s.start + draw(st.sampled_from([-1, 1])))
        elif kind == "stop":
            segs[i] = dataclasses.replace(s, stop=s.stop + draw(st.sampled_from([-1, 1])))
        elif kind == "rank":
            segs[i] = dataclasses.replace(s, cp_rank=draw(st.sampled_from([SHARDED, 0, 1, 2, -2])))
        elif kind == "drop":
            del segs[i]
        elif kind == "repeat":
            segs.append(s)
        elif kind == "swap":
            segs = segs[::-1]
        elif kind == "empty":
            segs = []
        elif kind == "move":
            del segs[i]
            q = draw(st.integers(0, len(pipes) - 1))
            if pipes[q].chunks:
                pipes[q].chunks[0] = Chunk(pipes[q].chunks[0].segments + (s,))
        pad = -1 if kind == "pad" else pipes[p].chunks[c].pad_to
        pipes[p].chunks[c] = Chunk(tuple(segs), pad_to=pad)
        return dataclasses.replace(plan, pipelines=pipes)
    return change()


@CASES
@given(plan=plans())
def test_the_array_pass_agrees_with_the_walk_over_every_segment(plan):
    assert segments_hold(plan) == walk_passes(plan)


def test_a_broken_plan_gets_the_walks_error():
    segs = (Segment(0, 0, 5), Segment(0, 4, 9))  # tokens 4 twice
    pipe = PipelinePlan(chunks=[Chunk(segs)], stages=[[Action("F", 0), Action("B", 0)]])
    plan = StepPlan(planner="test", model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster_preset("h100", 8),
                    lengths=[9], pipelines=[pipe])
    assert not segments_hold(plan)
    try:
        validate.validate_plan(plan)
    except UserError as exc:
        assert "comes after a later slice" in str(exc)
    else:
        raise AssertionError("validate_plan accepted a token planned twice")
