"""SlimPack's separate backward grouping (PipelinePlan.backward_chunks, slimpack §4.1.2) executes
exactly: loss and every gradient equal Hugging Face transformers run on each sequence alone
(float64, 1e-9 relative), on one process and across two (gloo), and each backward unit
propagates only its own tokens (its messages carry its rows, no more).

The executor runs each forward chunk as *cells*, one per backward unit touching it
(runtime/cells.py). Plans come from the slimpack planner (asymmetric=True, a long sample cut
into several slices plus short ones) or are written by hand for the corner cases: a backward
cut through a sequence the forward kept whole, no-grad forwards and recomputed layers.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, SHARDED, Chunk
from lengthwise.plan.schedules import make_schedule
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.cells import cell_map
from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.parallel.step import gather_grads, run_rank_step
from lengthwise.runtime.execute import run_step
from lengthwise.runtime.model import build_model
from lengthwise.runtime.transport import InProcessTransport
from lengthwise.runtime.verify import compare_grads, random_tokens, verify_plan
from lengthwise.specs import ModelSpec, ParallelScheme, cluster_preset

from plan_helpers import hand_plan

SMALL = ModelSpec(name="small", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8,
                  ffn=48, vocab=64)
LENGTHS = [200, 30, 17, 60, 5]
"""Sequence 0 is cut into three forward MicroPacks and differently into backward ones."""

HAND_LENGTHS = [12, 5, 4, 3]
HAND_CHUNKS = "0[0:6] 0[6:12]+1[0:5] 2[0:4]+3[0:3]"
HAND_UNITS = ["0[9:12]", "0[4:6]+0[6:9]+1[3:5]", "0[0:4]+1[0:3]+2[2:4]", "2[0:2]+3[0:3]"]
"""Backward units that cut sequences 1 and 2, which the forward keeps whole, FILO within each
sequence (the unit holding the later tokens runs backward first)."""
HAND_STAGES = {
    "pp1": ["F0 F1 B0 B1 F2 B2 B3"],
    "pp2": ["F0 F1 F2 B0 B1 B2 B3", "F0 F1 B0 F2 B1 B2 B3"],
    "pp2-nograd-recompute": ["N0 F1.r1 F2 B0 F0 B1 B2 B3", "N0 F1 F2 B0 F0 B1 B2 B3"],
}


def slimpack_plan(lengths=tuple(LENGTHS), *, micropacks=4, spec=SMALL, **degrees):
    scheme = ParallelScheme(**degrees)
    cluster = cluster_preset("cpu", scheme.num_gpus)
    request = PlanRequest(lengths=list(lengths), model=spec, cluster=cluster, scheme=scheme,
                          cost=CostModel(model=spec, cluster=cluster), context_length=512, seed=0,
                          options={"num_micropacks": micropacks, "asymmetric": True})
    plan = get_planner("slimpack")(request)
    validate_plan(plan)
    return plan


def units_plan(stages: list[str], units=HAND_UNITS):
    plan = hand_plan(SMALL, HAND_LENGTHS, [(HAND_CHUNKS, stages)])
    plan.pipelines[0].backward_chunks = [Chunk.parse(u) for u in units]
    return plan


def _regrouped(plan) -> bool:
    """Some backward segment is a strict sub-range of a forward segment."""
    pipe = plan.pipelines[0]
    forward = {(s.seq_id, s.start, s.stop) for c in pipe.chunks for s in c.segments}
    return any((s.seq_id, s.start, s.stop) not in forward for u in pipe.backward_chunks for s in u.segments)


# cells ---------------------------------------------------------------------------------------

def test_cells_tile_every_chunk_and_every_unit():
    plan = slimpack_plan()
    pipe = plan.pipelines[0]
    cells = cell_map(pipe)
    def tokens(*chunks: Chunk) -> list[tuple[int, int]]:
        return sorted((s.seq_id, t) for c in chunks for s in c.segments for t in range(s.start, s.stop))

    for c, chunk in enumerate(pipe.chunks):
        assert tokens(*(cells.cells[i] for i in cells.forward[c])) == tokens(chunk)
    for u, unit in enumerate(pipe.backward_chunks):
        assert tokens(*(cells.cells[i] for i in cells.backward[u])) == tokens(unit)
        assert list(cells.backward[u]) == sorted(cells.backward[u], reverse=True)  # later pieces first


def test_cells_forward_each_sequence_in_token_order():
    cells = cell_map(units_plan(HAND_STAGES["pp1"]).pipelines[0])
    seen: dict[int, int] = {}
    for c in range(len(cells.forward)):
        for i in cells.forward[c]:
            for s in cells.cells[i].segments:
                assert seen.get(s.seq_id, 0) == s.start, (s, seen)
                seen[s.seq_id] = s.stop
    assert [str(cells.cells[i]) for i in cells.forward[1]] == ["1[0:3]", "0[6:9]+1[3:5]", "0[9:12]"]


def test_without_backward_chunks_cells_are_the_chunks():
    pipe = slimpack_plan(micropacks=3).pipelines[0]
    pipe.backward_chunks = None
    cells = cell_map(pipe)
    assert list(cells.cells) == pipe.chunks
    assert cells.forward == cells.backward == tuple((c,) for c in range(len(pipe.chunks)))


# exactness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("pp", [1, 2])
def test_slimpack_asymmetric_plan_equals_transformers_unpacked(pp):
    pytest.importorskip("transformers")
    plan = slimpack_plan(pp=pp)
    assert plan.pipelines[0].backward_chunks is not None and _regrouped(plan)
    assert sum(s.seq_id == 0 for c in plan.pipelines[0].chunks for s in c.segments) >= 3
    result = verify_plan(plan, dtype=torch.float64, seed=0, oracle="transformers")
    assert result.passed, result.to_dict()
    assert result.max_rel_grad_diff < 1e-9 and result.loss_rel_diff < 1e-9


@pytest.mark.parametrize("name", list(HAND_STAGES))
def test_backward_cuts_through_whole_sequences_equal_transformers(name):
    pytest.importorskip("transformers")
    result = verify_plan(units_plan(HAND_STAGES[name]), dtype=torch.float64, seed=1, oracle="transformers")
    assert result.passed, result.to_dict()


def test_backward_units_equal_to_the_chunks_change_nothing_bitwise():
    plain = slimpack_plan(pp=2)
    pipe = plain.pipelines[0]
    pipe.backward_chunks, pipe.stages = None, make_schedule("1f1b", pipe.chunks, 2)
    same = copy.deepcopy(plain)
    same.pipelines[0].backward_chunks = list(pipe.chunks)
    runs = []
    for plan in (plain, same):
        model = build_model(SMALL, dtype=torch.float64, seed=0)
        loss = run_step(model, plan, random_tokens(plan.lengths, SMALL.vocab, 1))
        runs.append((float(loss), [q.grad for q in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_backward_unit_messages_carry_only_the_units_rows(monkeypatch):
    """B u sends u's tokens x hidden (the simulator's boundary bytes of u), F c sends c's."""
    sent = []
    honest = InProcessTransport.send

    def record(self, message, tensor):
        sent.append((message.kind, message.chunk, tuple(tensor.shape)))
        honest(self, message, tensor)

    monkeypatch.setattr(InProcessTransport, "send", record)
    plan = slimpack_plan(pp=2)
    run_step(build_model(SMALL, dtype=torch.float64, seed=0), plan, random_tokens(plan.lengths, SMALL.vocab, 1))
    pipe = plan.pipelines[0]
    for kind, index, shape in sent:
        rows = (pipe.backward_chunks if kind == BACKWARD else pipe.chunks)[index].num_tokens
        assert shape == (rows, SMALL.hidden)
    assert sorted(i for k, i, _ in sent if k == BACKWARD) == list(range(len(pipe.backward_chunks)))


# bad plans -----------------------------------------------------------------------------------

@pytest.mark.parametrize("units, stages, message", [
    (["0[4:12]", "0[0:4]+1[0:5]", "2[0:4]+3[0:3]"], "F0 F1 B0 B1 F2 B2",
     r"segment 0\[4:12\] is not inside one forward segment"),
    (["0[0:2]+0[4:6]", "0[2:4]", "0[6:12]+1[0:5]", "2[0:4]+3[0:3]"], "F0 F1 B2 B1 B0 F2 B3",
     r"B1 waits for B0 on stage 0, which comes later"),
    (HAND_UNITS, "F0 B0 F1 B1 F2 B2 B3", r"B0 waits for F1 on stage 0, which comes later"),
    (HAND_UNITS, "F0 F1 F2 B0 B2 B1 B3", r"B2 waits for B1 on stage 0, which comes later"),
    (HAND_UNITS[:3] + ["2[0:2]"], "F0 F1 F2 B0 B1 B2 B3", r"tokens \[0:3\) are missing from backward"),
    (HAND_UNITS, "F0 F1 F2 B0 B1 B2", "stage 0 never runs B3"),
])
def test_invalid_backward_grouping_is_a_user_error(units, stages, message):
    plan = units_plan([stages], units)
    model = build_model(SMALL, dtype=torch.float64, seed=0)
    with pytest.raises(UserError, match=message):
        run_step(model, plan, random_tokens(HAND_LENGTHS, SMALL.vocab, 0))


# two processes -------------------------------------------------------------------------------

SCENARIOS = {
    "pp2": functools.partial(slimpack_plan, pp=2),
    "dp-merge-cp2": functools.partial(slimpack_plan, (300, 20, 12, 9), micropacks=3, dp=2),
}
"""Two ranks each: PP=2 with asymmetric MicroPacks, and DP-Merge folding both DP ranks into one
CP=2 pipeline whose outlier is sharded and whose backward units are sub-ranges of its slices."""


def _two_rank_worker(rank: int) -> dict | None:
    mesh = Mesh.from_default_group(timeout_s=60)
    out = {}
    for name, make in SCENARIOS.items():
        plan = make()
        model = build_model(plan.model, dtype=torch.float64, seed=0)
        tokens = random_tokens(plan.lengths, plan.model.vocab, 1)
        step = run_rank_step(model, plan, tokens, mesh=mesh, backend="reference")
        grads = gather_grads(model, step.layout, plan)
        stats = [None] * mesh.world_size if rank == 0 else None
        torch.distributed.gather_object(step.stats.to_dict(), stats, dst=0)
        if rank == 0:
            reference = build_model(plan.model, dtype=torch.float64, seed=0)
            ref_loss = run_step(reference, plan, tokens, backend="reference")
            _, rel, worst = compare_grads(grads, {n: p.grad for n, p in reference.named_parameters()})
            out[name] = {"loss": step.loss, "ref_loss": float(ref_loss), "rel": rel, "worst": worst,
                         "stats": stats, "plan": plan}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return spawn(_two_rank_worker, 2, timeout_s=120)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_distributed_backward_units_equal_single_process(two_ranks, name):
    run = two_ranks[name]
    pipe = run["plan"].pipelines[0]
    assert pipe.backward_chunks is not None and _regrouped(run["plan"])
    assert run["loss"] == pytest.approx(run["ref_loss"], rel=1e-12, abs=0)
    assert run["rel"] < 1e-11, run["worst"]


def test_distributed_pipeline_sends_each_unit_once_with_its_rows(two_ranks):
    run = two_ranks["pp2"]
    pipe, hidden = run["plan"].pipelines[0], SMALL.hidden
    tokens = sum(c.num_tokens for c in pipe.chunks)
    for stats in run["stats"]:  # stage 0 sends every F, stage 1 every B: each all tokens once
        assert stats["p2p_elements"] == tokens * hidden
    assert run["stats"][1]["p2p_messages"] == len(pipe.backward_chunks)


def test_dp_merge_scenario_shards_sub_ranges_of_the_outlier(two_ranks):
    pipe = two_ranks["dp-merge-cp2"]["plan"].pipelines[0]
    assert pipe.cp == 2
    sharded = [s for u in pipe.backward_chunks for s in u.segments if s.cp_rank == SHARDED]
    assert len(sharded) > len([s for c in pipe.chunks for s in c.segments if s.cp_rank == SHARDED])
    assert two_ranks["dp-merge-cp2"]["stats"][0]["cp_scatter_elements"] > 0
