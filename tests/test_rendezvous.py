"""Pipeline messages cannot stall on NCCL: the lone isend/irecv posting the executor had stalls
the plans of every planner that splits sequences, the batched exchanges stall none, and a stall
is named by its link and both waiting operations."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, Action
from lengthwise.plan.messages import action_messages, lockstep_rounds, stage_exchanges
from lengthwise.plan.rendezvous import BATCHED, DEFERRED, LONE, check_rendezvous, find_stall
from lengthwise.plan.schedule_checks import check_message_order
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest
from lengthwise.planners.registry import CANDIDATE_PLANNERS
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.profiles import get_profile

OPTIONS = {"chunkflow": {"chunk_size": 2048, "k": 1}, "infinipipe": {"num_slices": 3, "score": "estimate"},
           "slimpack": {"asymmetric": True}}
"""Options that make each planner split sequences, re-forward (N) and regroup backward units."""


def plan_for(planner: str, *, pp: int, seed: int, dp: int = 2, num_sequences: int = 24):
    """A plan of `planner` for a long-tailed batch on dp x pp H100s (a model of 3 * pp layers)."""
    model = dataclasses.replace(model_preset("qwen2.5-0.5b"), num_layers=3 * pp)
    scheme = ParallelScheme(dp=dp, pp=pp)
    cluster = cluster_preset("h100", scheme.num_gpus)
    lengths = [int(n) for n in get_profile("chunkflow-eval").sample(num_sequences, np.random.default_rng(seed),
                                                                    below=16384)]
    request = PlanRequest(lengths=lengths, model=model, cluster=cluster, scheme=scheme,
                          cost=CostModel(model=model, cluster=cluster), context_length=16384, seed=seed,
                          options=OPTIONS.get(planner, {}))
    return CANDIDATE_PLANNERS[planner](request)


def actions(*stages: str) -> list[list[Action]]:
    return [[Action.parse(a) for a in stage.split()] for stage in stages]


# the old posting stalls, the new one does not -------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lone_posting_stalls_every_chunkflow_pp4_pipeline(seed):
    """Issue 27: today's ChunkFlow plans at dp2 x pp4 stall under lone isend/irecv, on every
    pipeline, and run under the batched exchanges."""
    plan = plan_for("chunkflow", pp=4, seed=seed, num_sequences=64)
    for p, pipe in enumerate(plan.pipelines):
        with pytest.raises(UserError, match=rf"pipeline {p}: .* lone posting: on the link between stages"):
            check_rendezvous(pipe.stages, discipline=LONE, pipeline=p)
        assert find_stall(pipe.stages, discipline=BATCHED, pipeline=p) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner=st.sampled_from(sorted(CANDIDATE_PLANNERS)), pp=st.integers(2, 8), seed=st.integers(0, 10_000))
def test_every_planners_plans_cannot_stall_when_batched(planner, pp, seed):
    plan = plan_for(planner, pp=pp, seed=seed)
    validate_plan(plan)  # runs the batched rendezvous check on every pipeline
    for p, pipe in enumerate(plan.pipelines):
        assert find_stall(pipe.stages, discipline=BATCHED, pipeline=p) is None


def test_the_planners_cover_reforwards_backward_units_and_stalls():
    """What the property test draws from holds N actions, SlimPack backward units, and plans
    that stall under lone posting (so it is a test of the batching, not of easy schedules)."""
    chunkflow, slimpack = plan_for("chunkflow", pp=5, seed=5), plan_for("slimpack", pp=4, seed=1)
    assert any(a.kind == "N" for pipe in chunkflow.pipelines for acts in pipe.stages for a in acts)
    assert all(pipe.backward_chunks is not None for pipe in slimpack.pipelines)
    for plan in (chunkflow, slimpack):
        assert any(find_stall(pipe.stages, discipline=LONE) for pipe in plan.pipelines)


def random_schedule(rng: random.Random, pp: int, num_chunks: int, reforward: bool) -> list[list[Action]]:
    """The per-stage action lists of one random run of a pipeline with unlimited buffers: each
    move runs, on a random stage, its next forward (its input there) or its next backward (its
    gradient there and the chunk forwarded with grad on the stage). Every stage runs one forward
    order and one backward order, as the plan's message order requires. With `reforward`, every
    chunk first runs N (ChunkFlow's forward without grad) and later F again."""
    forwards = [(kind, c) for kind in (("N", "F") if reforward else ("F",)) for c in range(num_chunks)]
    orders = (forwards, [(BACKWARD, c) for c in range(num_chunks)])
    done, stages, pos = set(), [[] for _ in range(pp)], [[0, 0] for _ in range(pp)]

    def ready(s: int, which: int) -> bool:
        if pos[s][which] == len(orders[which]):
            return False
        kind, c = orders[which][pos[s][which]]
        if which == 0:
            return s == 0 or (s - 1, kind, c) in done
        return (s, "F", c) in done and (s == pp - 1 or (s + 1, kind, c) in done)

    while any(pos[s][1] < num_chunks for s in range(pp)):
        s, which = rng.choice([(s, w) for s in range(pp) for w in (0, 1) if ready(s, w)])
        kind, c = orders[which][pos[s][which]]
        pos[s][which] += 1
        done.add((s, kind, c))
        stages[s].append(Action(kind, c))
    return stages


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), pp=st.integers(2, 6), num_chunks=st.integers(1, 7), reforward=st.booleans())
def test_any_schedule_that_runs_with_buffers_runs_batched(seed, pp, num_chunks, reforward):
    """The docstring's claim beyond the planners: every schedule that runs with unlimited
    buffers (random interleavings, not only 1F1B) runs under the batched exchanges."""
    stages = random_schedule(random.Random(seed), pp, num_chunks, reforward)
    check_message_order(stages)
    assert find_stall(stages, discipline=BATCHED) is None


# a stall, named -------------------------------------------------------------------------------

def test_a_two_stage_stall_names_the_link_and_both_sends():
    """1F1B on two stages: stage 0 sends F1 and then needs B0, stage 1 sends B0 and then needs
    F1; lone posting queues each receive behind the stage's own send."""
    stages = actions("F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2")
    with pytest.raises(UserError) as caught:
        check_rendezvous(stages, discipline=LONE, pipeline=3)
    text = str(caught.value)
    assert text.startswith("pipeline 3: ") and "on the link between stages 0 and 1" in text
    assert "stage 0's send of the activation of F1 to stage 1 (output of its action 1, F1)" in text
    assert "stage 1's send of the gradient of B0 to stage 0 (output of its action 1, B0)" in text
    check_rendezvous(stages, discipline=BATCHED, pipeline=3)


def test_sends_deferred_to_the_next_receive_are_not_enough():
    """The design not taken: stage 0 runs F3 between sending F2 and receiving B0, stage 1 runs
    F1 between sending B0 and receiving F2, so each holds a send whose receive is in the other's
    next batch. The lock-step exchanges run it."""
    stages = actions("F0 F1 F2 F3 B0 B1 B2 B3", "F0 B0 F1 F2 F3 B1 B2 B3")
    stall = find_stall(stages, discipline=DEFERRED)
    assert stall is not None and {stall.first.message.chunk, stall.second.message.chunk} == {0, 2}
    assert find_stall(stages, discipline=BATCHED) is None


def test_a_message_never_received_is_named():
    stages = actions("F0 B0", "F0")  # stage 1 never sends B0's gradient back
    stall = find_stall(stages, discipline=LONE)
    assert stall is not None and stall.second is None
    assert "stage 0's receive of the gradient of B0 from stage 1" in stall.describe(stages)


def test_an_unknown_discipline_is_one_line():
    with pytest.raises(UserError, match="unknown posting discipline 'eager'"):
        find_stall(actions("F0 B0"), discipline="eager")


# the exchanges the executor posts ---------------------------------------------------------------

def test_each_message_is_posted_once_at_both_ends_in_its_round():
    """Sender right after the action producing it, receiver before the action consuming it,
    both in the exchange of the round it was sent in; recompute variants move the same tensors."""
    stages = actions("F0 F1 N2 F3.r1 B0 F2 B1 B2 B3", "F0 B0 F1 N2 F3 B1 F2 B2 B3", "F0 B0 F1 N2 F3.r2 B1 F2 B2 B3")
    rounds = lockstep_rounds(stages)
    exchanges = stage_exchanges(stages)
    for s, acts in enumerate(stages):
        for i, action in enumerate(acts):
            received, sent = action_messages(action, pipeline=0, stage=s, num_stages=len(stages))
            if sent is not None:
                [ex] = [e for e in exchanges[s] if sent in e.sends]
                assert (ex.before, ex.round) == (i + 1, rounds[s][i])
                [peer] = [e for e in exchanges[sent.dst] if sent in e.recvs]
                assert peer.round == ex.round
            if received is not None:
                [ex] = [e for e in exchanges[s] if received in e.recvs]
                assert ex.before <= i and ex.round < rounds[s][i]
    assert find_stall(stages, discipline=BATCHED) is None
