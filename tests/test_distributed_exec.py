"""Tier 3: plans run across processes (gloo, CPU, float64) give the loss and every gradient of
the single-process executor, and fail loudly, never hang.

One group of 4 worker processes runs every 4-rank scenario in turn (process start-up dominates
on CPU: about 5 s per process under load), rank 0 compares each with `run_step` on one process.
Scenarios: DP=2 x PP=2 and PP=4 with chunkflow's state-aware 1F1B (K=1, split sequences),
DP=2 x CP=2 with a Skrull plan (sharded and local sequences in one chunk, lengths not divisible
by 2c), DP=2 x CP=2 with chunkflow (split sequences
sharded over CP, K/V state handed across slices), DP=2 x PP=2 with SlimPack's MicroPacks
(asymmetric backward grouping: backward units regroup the forward MicroPacks' tokens), PP=2 x CP=2 (Skrull, and a hand plan whose
CP rank 1 holds no token of some chunks), a desynchronised sampler, and a silent stage.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, SHARDED, Segment, StepPlan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.parallel.dp import check_same_plan, global_grad_norm
from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.distributed.p2p import StepFailed
from lengthwise.runtime.parallel.step import gather_grads, run_rank_step
from lengthwise.runtime.execute import run_step
from lengthwise.runtime.model import build_model
from lengthwise.runtime.verify import compare_grads, random_tokens
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset

from plan_helpers import hand_plan

LENGTHS = [200, 30, 17, 60, 5]
SKRULL_LENGTHS = [150, 40, 17, 60, 5, 90, 33, 12]
SCENARIOS = {
    "dp2-pp2": ("chunkflow", LENGTHS, {"dp": 2, "pp": 2}, {"chunk_size": 32, "k": 1}),
    "pp4": ("chunkflow", LENGTHS, {"pp": 4}, {"chunk_size": 48, "k": 1}),
    "dp2-cp2-skrull": ("skrull", SKRULL_LENGTHS, {"dp": 2, "cp": 2}, {"bucket_size": 100}),
    "dp2-cp2-chunkflow": ("chunkflow", LENGTHS, {"dp": 2, "cp": 2}, {"chunk_size": 48, "k": 1}),
    "dp2-pp2-slimpack": ("slimpack", LENGTHS + [90], {"dp": 2, "pp": 2}, {"asymmetric": True}),
    "pp2-cp2-skrull": ("skrull", SKRULL_LENGTHS, {"pp": 2, "cp": 2}, {"bucket_size": 90}),
    "pp2-cp2-empty-rows": ("hand", [13, 5, 4, 3, 1], {"pp": 2, "cp": 2}, {}),
    **{f"dp2-pp2-{planner}": (planner, LENGTHS + [90, 44], {"dp": 2, "pp": 2}, {})
       for planner in ("padding", "packing", "sorted", "token-balanced", "infinipipe", "hydraulis", "auto")},
}
"""Every planner runs over the transport, whose messages all carry tag 0: a link whose two
ends disagree on message order would swap activations or fail on a size mismatch."""
HAND_PLANS = {"pp2-cp2-empty-rows": [("0[0:13]+1[0:5]@0+2[0:4]@1 3[0:3]@0 4[0:1]", ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"])]}
"""Chunk 1 has no token on CP rank 1; chunk 2 is one sharded token (only rank 0's head piece
is not empty), so rank 1 joins chunk 2's K/V collectives with an empty row."""


def make_plan(name: str, *, lengths=None):
    planner, default_lengths, degrees, options = SCENARIOS[name]
    spec = model_preset("tiny")
    if planner == "hand":
        plan = hand_plan(spec, default_lengths, HAND_PLANS[name])
        plan.pipelines[0].cp = degrees["cp"]
        plan.cluster = cluster_preset("cpu", plan.num_gpus)
        return plan
    scheme = ParallelScheme(**degrees)
    cluster = cluster_preset("cpu", scheme.num_gpus)
    request = PlanRequest(lengths=list(lengths or default_lengths), model=spec, cluster=cluster, scheme=scheme,
                          cost=CostModel(model=spec, cluster=cluster), context_length=256, seed=0, options=options)
    return get_planner(planner)(request)


def _run_scenario(rank: int, mesh: Mesh, name: str) -> dict | None:
    plan = make_plan(name)
    model = build_model(plan.model, dtype=torch.float64, seed=0)
    tokens = random_tokens(plan.lengths, plan.model.vocab, 1)
    step = run_rank_step(model, plan, tokens, mesh=mesh, backend="reference")
    grads = gather_grads(model, step.layout, plan)
    norm = float(global_grad_norm(model, plan, step.layout))
    stats = [None] * mesh.world_size if rank == 0 else None
    torch.distributed.gather_object(step.stats.to_dict(), stats, dst=0)
    if rank != 0:
        return None
    reference = build_model(plan.model, dtype=torch.float64, seed=0)
    ref_loss = run_step(reference, plan, tokens, backend="reference")
    _, rel, worst = compare_grads(grads, {n: p.grad for n, p in reference.named_parameters()})
    ref_norm = float(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm())
    return {"loss": step.loss, "ref_loss": float(ref_loss), "rel": rel, "worst": worst, "stats": stats,
            "plan": plan.to_dict(), "norm": norm, "ref_norm": ref_norm}


def _run_desync(rank: int, mesh: Mesh) -> str:
    """Rank 1's sampler is one batch ahead: it plans other lengths."""
    lengths = LENGTHS if rank != 1 else [201, 30, 17, 60, 5]
    try:
        check_same_plan(make_plan("dp2-pp2", lengths=lengths))
    except UserError as exc:
        return str(exc)
    return "no error"


def _run_silent_downstream(rank: int, folder: Path) -> str | None:
    """dp2 x pp2; rank 1 (pipeline 0, stage 1) never answers, rank 0 sends F0 and waits for the
    gradient of B0 (1 s time-out); ranks 2 and 3 stop after the plan check. Rank 1 stays alive
    until rank 0 has given up (a file rank 0 writes then). Last scenario: the timed-out link
    stays broken."""
    mesh = Mesh.from_default_group(timeout_s=1)
    spec = model_preset("tiny")
    plan = hand_plan(spec, [12, 5], [("0[0:12]", ["F0 B0", "F0 B0"]), ("1[0:5]", ["F0 B0", "F0 B0"])])
    gave_up = folder / "rank-0-gave-up"
    if rank != 0:
        check_same_plan(plan)
        mesh.layout(plan)
        deadline = time.monotonic() + 120
        while rank == 1 and not gave_up.exists() and time.monotonic() < deadline:  # alive, but silent
            time.sleep(0.01)
        return None
    model = build_model(spec, dtype=torch.float64, seed=0)
    try:
        run_rank_step(model, plan, random_tokens(plan.lengths, spec.vocab, 1), mesh=mesh, backend="reference")
    except StepFailed as exc:
        return str(exc)
    finally:
        gave_up.touch()
    return "no error"


def four_rank_worker(rank: int, folder: str) -> dict | None:
    mesh = Mesh.from_default_group(timeout_s=60)
    out = {name: _run_scenario(rank, mesh, name) for name in SCENARIOS}
    out["desync"] = _run_desync(rank, mesh)
    out["silent-downstream"] = _run_silent_downstream(rank, Path(folder))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    return spawn(four_rank_worker, 4, str(tmp_path_factory.mktemp("silent")), timeout_s=120)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_distributed_step_equals_single_process(four_ranks, name):
    run = four_ranks[name]
    assert run["loss"] == pytest.approx(run["ref_loss"], rel=1e-12, abs=0)
    assert run["rel"] < 1e-11, run["worst"]
    assert run["norm"] == pytest.approx(run["ref_norm"], rel=1e-12)  # for clipping: each parameter once


def test_skrull_scenario_mixes_sharded_and_local_sequences(four_ranks):
    chunks = [c for p in four_ranks["dp2-cp2-skrull"]["plan"]["pipelines"] for c in p["chunks"]]
    segments = [Segment.parse(text) for c in chunks for text in c.split("+")]
    assert {s.cp_rank for s in segments} == {SHARDED, 0, 1}  # sharded and local on both ranks
    sharded = [s.num_tokens for s in segments if s.cp_rank == SHARDED]
    assert any(n % 4 for n in sharded)  # not a multiple of 2c = 4: padded


@pytest.mark.parametrize("name", ["dp2-cp2-skrull", "dp2-cp2-chunkflow"])
def test_cp_kv_volume_is_padded_pieces_to_each_peer(four_ranks, name):
    """Every layer of every forward (F or N) all-gathers K and V of 2 pieces of m = ceil(n / 2c)
    rows per sharded segment to the c - 1 peers; every backward reduce-scatters as much."""
    run = four_ranks[name]
    plan = StepPlan.from_dict(run["plan"])
    spec, c = plan.model, 2
    per_row = 2 * spec.num_kv_heads * spec.head_dim * spec.num_layers * (c - 1)  # k and v, all layers
    for p, pipe in enumerate(plan.pipelines):
        rows = [sum(2 * math.ceil(s.num_tokens / (2 * c)) for s in chunk.segments if s.cp_rank == SHARDED)
                for chunk in pipe.chunks]
        gathered = sum(rows[a.chunk] for a in pipe.stages[0] if a.kind != BACKWARD) * per_row
        scattered = sum(rows[a.chunk] for a in pipe.stages[0] if a.kind == BACKWARD) * per_row
        for stats in run["stats"][2 * p:2 * p + 2]:
            assert (stats["cp_gather_elements"], stats["cp_scatter_elements"]) == (gathered, scattered)
            assert stats["p2p_elements"] == 0  # pp = 1


def test_pipeline_sends_exactly_the_planned_activations(four_ranks):
    """Elements sent per rank = sum over its sending actions of the chunk's tokens x hidden
    (the cost model's boundary_bytes in bf16 is twice that)."""
    run = four_ranks["pp4"]
    plan = StepPlan.from_dict(run["plan"])
    pipe, hidden = plan.pipelines[0], plan.model.hidden
    for stage, actions in enumerate(pipe.stages):
        sends = [a for a in actions if (a.kind == BACKWARD and stage > 0) or (a.kind != BACKWARD and stage < pipe.pp - 1)]
        expected = sum(pipe.chunks[a.chunk].num_tokens for a in sends) * hidden
        assert run["stats"][stage]["p2p_elements"] == expected
        assert run["stats"][stage]["p2p_messages"] == len(sends)


def test_desynchronised_sampler_is_caught_by_plan_hash(four_ranks):
    message = four_ranks["desync"]
    assert "ranks [0, 2, 3]" in message and "ranks [1]" in message


def test_receive_that_never_comes_names_stage_and_action(four_ranks):
    message = four_ranks["silent-downstream"]
    assert message.startswith("pipeline 0 stage 0 action 1 (B0): ")
    assert "(time-out 1 s) waiting for the gradient of B0 from stage 1 (rank 1" in message
