"""Tier 1 for the distributed executor: rank layout, CP pieces and plan fingerprints, no
processes started."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lengthwise.cli import main
from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk
from lengthwise.runtime.distributed.cp import (
    cp_view,
    piece_bounds,
    piece_owner,
    rank_pieces,
)
from lengthwise.runtime.parallel.dp import holder_sets, plan_fingerprint
from lengthwise.runtime.distributed.mesh import (
    PlanLayout,
    check_world_size,
    plan_places,
)
from lengthwise.runtime.model import build_model
from lengthwise.specs import model_preset

from plan_helpers import hand_plan

SPEC = model_preset("tiny")


def _plan():
    plan = hand_plan(SPEC, [12, 5, 4], [("0[0:12]", ["F0 B0", "F0 B0"]), ("1[0:5]+2[0:4]@1", ["F0 B0", "F0 B0"])])
    plan.pipelines[1].cp = 2
    return plan


def test_ranks_are_laid_out_pipeline_stage_cp_rank():
    places = [(p.pipeline, p.stage, p.cp_rank) for p in plan_places(_plan())]
    assert places == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_wrong_process_count_shows_the_arithmetic():
    with pytest.raises(UserError, match=r"pp\(2\) \* cp\(1\) \+ pp\(2\) \* cp\(2\) = 6 processes, got 4"):
        check_world_size(_plan(), 4)


def test_verify_nproc_mismatch_is_a_usage_error(capsys):
    assert main(["verify", "--nproc", "3", "--dp", "2", "--pp", "2", "--lengths", "40,30"]) == 2
    assert "= 4 processes, got 3" in capsys.readouterr().err


def test_gradients_are_summed_over_exactly_the_ranks_holding_a_parameter():
    plan = _plan()
    sets = holder_sets(build_model(SPEC, seed=0), plan, PlanLayout(places=plan_places(plan), rank=0))
    assert sets["model.embed_tokens.weight"] == (0, 2, 3)  # first stages, both CP ranks of pipeline 1
    assert sets["lm_head.weight"] == (1, 4, 5)
    assert sets["model.layers.0.mlp.up_proj.weight"] == (0, 2, 3)
    assert sets["model.layers.3.mlp.up_proj.weight"] == (1, 4, 5)


@given(num_tokens=st.integers(1, 200), cp=st.integers(1, 4))
def test_cp_pieces_cover_every_token_once_head_tail_balanced(num_tokens, cp):
    chunk = Chunk.parse(f"0[7:{7 + num_tokens}]")
    covered = []
    for rank in range(cp):
        view = cp_view(chunk, cp=cp, rank=rank)
        assert {p.piece for p in view.parts} <= set(rank_pieces(cp, rank))
        covered += [t for p in view.parts for t in range(p.segment.start, p.segment.stop)]
        assert all(p.before == p.segment.start - 7 for p in view.parts)
    assert sorted(covered) == list(range(7, 7 + num_tokens))
    shares = [sum(p.segment.num_tokens for p in cp_view(chunk, cp=cp, rank=r).parts) for r in range(cp)]
    assert max(shares) - min(shares) <= 1


def test_head_tail_balances_causal_work():
    """Rank r's pieces r and 2c-1-r: key work (sum of positions + 1) equal up to one piece row."""
    n, cp = 4096, 4
    work = []
    for rank in range(cp):
        spans = [piece_bounds(n, cp, piece) for piece in rank_pieces(cp, rank)]
        work.append(sum(t + 1 for a, b in spans for t in range(a, b)))
    assert max(work) / min(work) < 1.001
    assert [piece_owner(cp, j) for j in range(2 * cp)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]


def test_local_segments_stay_on_their_rank_and_bad_ranks_are_named():
    chunk = Chunk.parse("0[0:10]@1+1[0:6]")  # 6 tokens in 4 pieces: 2, 2, 1, 1
    assert [str(p.segment) for p in cp_view(chunk, cp=2, rank=1).parts] == ["0[0:10]@1", "1[2:4]", "1[4:5]"]
    assert [str(p.segment) for p in cp_view(chunk, cp=2, rank=0).parts] == ["1[0:2]", "1[5:6]"]
    with pytest.raises(UserError, match="CP rank 3, but the pipeline has cp=2"):
        cp_view(Chunk.parse("0[0:10]@3"), cp=2, rank=0)


def test_plan_fingerprint_ignores_metrics_but_not_chunks():
    plan = _plan()
    before = plan_fingerprint(plan)
    plan.metrics["planning_s"] = 0.123
    assert plan_fingerprint(plan) == before
    plan.pipelines[0].stages[0].reverse()
    assert plan_fingerprint(plan) != before
