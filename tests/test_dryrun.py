"""`lengthwise dryrun`: the executor's real code for one rank, on fake tensors and the fake
process group, measured beside the simulator. Small fake sizes here; full-size runs are in
benchmarks/bench_dryrun.py."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("torch")

from lengthwise.cli import main
from lengthwise.cost import CostModel
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.specs import ModelSpec, ParallelScheme, cluster_preset

SMALL = ModelSpec(name="small", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, head_dim=32, ffn=512,
                  vocab=1024)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    scheme = ParallelScheme(dp=2, pp=2)
    cluster = cluster_preset("h100", scheme.num_gpus)
    plan = get_planner("chunkflow")(PlanRequest(
        lengths=[900, 300, 700, 400, 280, 520], model=SMALL, cluster=cluster, scheme=scheme,
        cost=CostModel(model=SMALL, cluster=cluster), context_length=1024, seed=0,
        options={"chunk_size": 256, "k": 1}))
    assert any(a.kind == "N" for pipe in plan.pipelines for stage in pipe.stages for a in stage)
    path = tmp_path_factory.mktemp("dryrun") / "plan.json"
    plan.save(path)
    return path


@pytest.fixture(scope="module")
def rows(plan_file):
    """`lengthwise dryrun PLAN --ranks 0,3 --json`, parsed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["dryrun", str(plan_file), "--ranks", "0,3", "--json"]) == 0
    return json.loads(out.getvalue())["ranks"]


def test_dryrun_json_has_measured_and_simulated_side_by_side(rows):
    assert set(rows) == {"0", "3"}
    for row in rows.values():
        for key in ("peak_memory_gib", "flops"):
            assert set(row[key]) == {"measured", "simulated"}
        assert set(row["comm_bytes"]["send"]) == {"measured", "simulated"}


def test_dryrun_flops_match_the_cost_models_count(rows):
    """Linear layers, the LM head and causal attention, forward, re-forward and backward: the
    counter's FLOPs of the executor's operations equal the cost model's formula. (Documents
    under 256 tokens would differ a little: they share one kernel call under a block-diagonal
    bias, which scores the masked pairs too; every document here is longer.) Within a
    millionth: a few hundred FLOPs of the embedding-side stage (1e-8 of its count) come from
    small operations outside the formula."""
    for row in rows.values():
        assert row["flops"]["measured"] == pytest.approx(row["flops"]["simulated"], rel=1e-6)


def test_dryrun_sends_and_gradient_reduction_equal_the_cost_model(rows):
    for rank, row in rows.items():
        comm = row["comm_bytes"]
        assert comm["send"]["measured"] == pytest.approx(comm["send"]["simulated"], rel=1e-12), rank
        assert comm["all_reduce"]["measured"] == pytest.approx(comm["all_reduce"]["simulated"], rel=1e-3), rank


def test_dryrun_reports_peak_memory_by_category(rows):
    for row in rows.values():
        parts = row["memory_gib"]
        assert {"parameters", "gradients", "optimizer", "activations"} <= set(parts)
        assert sum(parts.values()) == pytest.approx(row["peak_memory_gib"]["measured"], rel=1e-9)
        assert parts["activations"] > 0 and row["peak_memory_gib"]["simulated"] > 0


def test_dryrun_rank_outside_the_plan_is_a_one_line_error(plan_file, capsys):
    assert main(["dryrun", str(plan_file), "--ranks", "0,4"]) == 2
    err = capsys.readouterr().err
    assert "rank 4 is outside the plan's 4 ranks (0..3)" in err and "Traceback" not in err
