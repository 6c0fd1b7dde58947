"""auto on large batches: every candidate ranked on a proxy of the batch (every k-th sequence by
length on dp/k pipelines), only the best ones planned at full size."""

from __future__ import annotations

import math

import pytest

import lengthwise.planners.auto as auto
from lengthwise.cli import main
from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest
from lengthwise.planners.auto import (choose_best, plan_auto, proxy_factor, proxy_lengths, proxy_request,
                                      try_planner)
from lengthwise.planners.base import take_options
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import profile_source

CANDIDATES = ["padding", "packing", "megatron", "sorted", "token-balanced", "chunkflow"]
PROXY = {"preselect_above": 100, "proxy_factor": 4, "preselect": 1, "preselect_margin": 0.0}


def batch(n: int, seed: int = 0) -> list[int]:
    source = profile_source("chunkflow-eval", context_length=16384, overlong="truncate")
    return list(GlobalBatchSampler(source, seed=seed, batch_size=n).next_batch().lengths)


def make_request(lengths, *, dp=8, pp=2, **options) -> PlanRequest:
    model = MODEL_PRESETS["qwen2.5-0.5b"]
    scheme = ParallelScheme(dp=dp, pp=pp)
    cluster = cluster_preset("h100", scheme.num_gpus)
    return PlanRequest(lengths=list(lengths), model=model, cluster=cluster, scheme=scheme,
                       cost=CostModel(model=model, cluster=cluster), context_length=16384,
                       options={"candidates": CANDIDATES, **options})


def comparable(plan) -> dict:
    """The plan's JSON without its timings."""
    d = plan.to_dict()
    d["metrics"] = {k: v for k, v in d["metrics"].items() if k not in ("planning_ms", "auto")}
    return d


@pytest.fixture(scope="module")
def lengths():
    return batch(200)


def test_proxy_keeps_every_kth_sequence_by_length_the_longest_first_in_batch_order():
    lengths = [5, 90, 7, 300, 12, 40, 300, 1, 66]
    kept = proxy_lengths(lengths, 3)
    assert len(kept) == math.ceil(len(lengths) / 3)
    assert sorted(kept, reverse=True) == sorted(lengths, reverse=True)[::3]
    assert kept == [7, 300, 66]  # ranks 0, 3, 6 by length (the first 300 by index), in batch order
    assert max(proxy_lengths(lengths, 100)) == 300 and len(proxy_lengths(lengths, 100)) == 1


def test_proxy_request_shrinks_dp_and_the_cluster_together(lengths):
    small = proxy_request(make_request(lengths, dp=8, pp=2), 4)
    assert (small.scheme.dp, small.scheme.tp, small.scheme.pp, small.scheme.cp) == (2, 1, 2, 1)
    assert small.cluster.num_gpus == small.scheme.num_gpus == 4
    assert small.cost.cluster == small.cluster and small.cluster.name == "h100"
    assert len(small.lengths) == 50 and max(small.lengths) == max(lengths)


def test_default_factor_is_the_largest_divisor_of_dp_meeting_both_floors():
    def k(n, dp, **options):
        req = make_request([100] * n, dp=dp, **{"preselect_above": 8192, **options})
        return proxy_factor(req, take_options(req, "auto"), CANDIDATES)

    assert k(32768, 256) == 16  # 2048 sequences on 16 pipelines
    assert k(32768, 1024) == 16
    assert k(32768, 16) == 2  # at least 8 pipelines
    assert k(8192, 256) == 1  # not above the threshold: full search
    assert k(9000, 12, min_proxy_pipelines=8) == 1  # no divisor of 12 leaves 8 pipelines
    assert k(32768, 256, proxy_factor=5) == 5  # given: used as is
    # a candidate's own scheme must shrink by the same k: the divisor is common to every dp
    assert k(32768, 256, schemes={"packing": {"dp": 24, "tp": 1, "pp": 2}}) == 8


def test_below_the_threshold_auto_is_the_full_search(lengths):
    req = make_request(lengths)
    plan = plan_auto(req)
    assert "auto_proxy" not in plan.metrics
    tried = [try_planner(n, auto.candidate_request(req, n, take_options(req, "auto"))) for n in CANDIDATES]
    assert plan.metrics["chosen_planner"] == choose_best(tried).planner
    assert set(plan.metrics["auto"]) == set(CANDIDATES)
    forced_full = plan_auto(make_request(lengths, preselect_above=len(lengths)))
    assert comparable(forced_full) == comparable(plan)


def test_above_the_threshold_the_proxy_ranks_and_only_the_best_plan_at_full_size(lengths):
    req = make_request(lengths, **{**PROXY, "preselect": 2})
    plan = plan_auto(req)
    validate_plan(plan, req.cost)
    proxy = plan.metrics["auto_proxy"]
    assert proxy["k"] == 4 and proxy["sequences"] == 50 and proxy["scheme"] == "dp2-tp1-pp2-cp1"
    assert sorted(proxy["order"]) == sorted(CANDIDATES)
    figures = plan.metrics["auto"]
    assert [figures[n]["proxy"]["rank"] for n in proxy["order"]] == list(range(len(CANDIDATES)))
    fitting = [n for n in proxy["order"] if figures[n]["proxy"].get("fits")]
    times = [figures[n]["proxy"]["step_time_s"] for n in fitting]
    assert fitting == proxy["order"][:len(fitting)] and times == sorted(times)
    full = [n for n in proxy["order"] if figures[n]["full_size"]]
    assert full == proxy["order"][:2]  # both fit at full size here: no fallback needed
    assert all("step_time_s" not in figures[n] for n in proxy["order"][2:])
    assert plan.metrics["chosen_planner"] == min(full, key=lambda n: figures[n]["step_time_s"])
    assert plan.options["chosen_planner"] == plan.metrics["chosen_planner"] and plan.planner == "auto"


def test_the_preselected_plan_is_deterministic(lengths):
    first = plan_auto(make_request(lengths, **PROXY))
    again = plan_auto(make_request(lengths, **PROXY))
    assert comparable(first) == comparable(again)
    assert first.metrics["auto_proxy"] == again.metrics["auto_proxy"]


def test_a_failing_preselected_candidate_falls_back_to_the_next_in_proxy_order(lengths, monkeypatch):
    honest = plan_auto(make_request(lengths, **PROXY))
    order = honest.metrics["auto_proxy"]["order"]
    real = auto.candidate_planner

    def failing_at_full_size(name):
        fn = real(name)

        def run(request):
            if name == order[0] and len(request.lengths) == len(lengths):
                raise UserError("planted failure")
            return fn(request)
        return run

    monkeypatch.setattr(auto, "candidate_planner", failing_at_full_size)
    plan = plan_auto(make_request(lengths, **PROXY))
    figures = plan.metrics["auto"]
    assert plan.metrics["auto_proxy"]["order"] == order  # the proxy itself was not affected
    assert figures[order[0]]["error"] == "planted failure" and figures[order[0]]["full_size"]
    assert plan.metrics["chosen_planner"] == order[1] and figures[order[1]]["full_size"]
    assert not any(figures[n]["full_size"] for n in order[2:])
    validate_plan(plan, make_request(lengths).cost)


def test_an_invalid_preselected_plan_falls_back_too(lengths, monkeypatch):
    honest = plan_auto(make_request(lengths, **PROXY))
    order = honest.metrics["auto_proxy"]["order"]
    real = auto.validate_plan

    def picky(plan, cost=None):
        if plan.planner == order[0]:
            raise UserError("planted defect")
        real(plan, cost)

    monkeypatch.setattr(auto, "validate_plan", picky)
    plan = plan_auto(make_request(lengths, **PROXY))
    assert plan.metrics["chosen_planner"] == order[1]
    assert "planted defect" in plan.metrics["auto"][order[0]]["error"]


def test_a_close_call_on_the_proxy_is_settled_at_full_size(lengths):
    plan = plan_auto(make_request(lengths, **{**PROXY, "preselect_margin": 10.0}))
    figures, order = plan.metrics["auto"], plan.metrics["auto_proxy"]["order"]
    fitting = [n for n in order if figures[n]["proxy"].get("fits")]
    assert len(fitting) >= 2
    # every fitting candidate is within 1000% of the fastest here, so all plan the full batch
    assert [n for n in order if figures[n]["full_size"]] == fitting
    times = {n: figures[n]["step_time_s"] for n in fitting if figures[n].get("fits")}
    assert plan.metrics["chosen_planner"] == min(times, key=times.get)


@pytest.mark.parametrize("name,value,message", [
    ("preselect", 0, "must be a positive integer"), ("proxy_factor", -2, "must be a positive integer"),
    ("preselect_above", "x", "must be a positive integer"), ("min_proxy_pipelines", 0, "must be a positive integer"),
    ("preselect_margin", -0.1, "must be a fraction >= 0")])
def test_bad_preselection_options_are_one_line_errors(lengths, name, value, message):
    with pytest.raises(UserError, match=f"option {name} {message}") as exc:
        plan_auto(make_request(lengths, **{name: value}))
    assert "\n" not in str(exc.value)


def test_cli_flags_reach_auto(tmp_path, capsys):
    import json

    code = main(["plan", "--planner", "auto", "--profile", "tiny", "--batch-size", "64", "--model", "tiny",
                 "--cluster", "cpu", "--context-length", "512", "--dp", "4", "--json",
                 "--preselect-above", "16", "--proxy-factor", "2", "--preselect", "1"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["metrics"]["auto_proxy"]["k"] == 2 and plan["metrics"]["auto_proxy"]["sequences"] == 32
    assert sum(v["full_size"] for v in plan["metrics"]["auto"].values()) >= 1
