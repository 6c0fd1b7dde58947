"""`lengthwise compare` and `auto`: every planner on the same batches; auto never loses."""

import itertools
import json

import pytest

from lengthwise.cli import main
from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.planners import PLANNER_NAMES, PlanRequest
from lengthwise.planners.auto import plan_auto
from lengthwise.report import CompareSetup, candidate_schemes, run_compare, summarise
from lengthwise.sim import simulate_plan
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset


def small_setup(planners):
    batches = [[3000, 200, 90, 1500, 60, 800, 40, 4000], [100, 2000, 50, 60, 7000, 30]]
    return CompareSetup(model=MODEL_PRESETS["qwen2.5-0.5b"], cluster=cluster_preset("h100", 8),
                        context_length=8192, batches=batches, planners=planners)


def test_auto_is_never_slower_than_any_planner_it_ran():
    rows = run_compare(small_setup(list(PLANNER_NAMES)))
    auto = rows.pop("auto")
    for b, run in enumerate(auto.runs):
        for row in rows.values():
            other = row.runs[b]
            if other.result is not None and other.result.fits:
                assert run.result.step_time_s <= other.result.step_time_s
    assert sum(auto.chosen.values()) == len(auto.runs)


def test_summary_reports_speedup_against_the_best_fitting_baseline():
    summary = summarise(run_compare(small_setup(["padding", "packing", "token-balanced"])))
    rows = summary["planners"]
    best = min(r["step_time_s"] for r in rows.values())
    assert summary["best_baseline_step_time_s"] == pytest.approx(best)
    assert max(r["speedup_vs_best_baseline"] for r in rows.values()) == pytest.approx(1.0)


def test_every_planner_searches_the_same_scheme_list(monkeypatch):
    """Fairness: no planner loses because it was given other schemes. Every planner's search
    tries exactly the list `candidate_schemes` makes once for the setup."""
    import lengthwise.report as report

    setup = small_setup(["packing", "megatron", "chunkflow", "skrull", "infinipipe"])
    tried: dict[str, list[str]] = {}
    original = report.try_planner

    def spy(name, request, **kw):
        tried.setdefault(name, []).append(str(request.scheme))
        return original(name, request, **kw)

    monkeypatch.setattr(report, "try_planner", spy)
    run_compare(setup)
    schemes = [str(s) for s in candidate_schemes(setup)]
    selection = len(report.selection_batches(setup))
    assert len(schemes) > 1
    for name, seen in tried.items():
        # schemes in list order, each on every selection batch (chunkflow twice: its grid search,
        # then the tuned point); the per-batch runs of the chosen scheme follow
        groups = [(s, len(list(g))) for s, g in itertools.groupby(seen)]
        assert [s for s, _ in groups][:len(schemes)] == schemes, name
        assert all(n >= selection for _, n in groups), name


def test_chunkflow_runs_every_batch_with_the_grid_point_it_tuned_on_the_selection_batches():
    setup = small_setup(["chunkflow"])
    rows = run_compare(setup)
    row = rows["chunkflow"]
    assert set(row.tuned) == {"chunk_size", "k"}
    for run in row.runs:
        assert run.plan.metrics["chunk_size"] == row.tuned["chunk_size"]
        assert run.plan.metrics["k"] == row.tuned["k"]
    assert summarise(rows)["planners"]["chunkflow"]["tuned"] == row.tuned


def test_a_scheme_is_chosen_on_the_selection_set_with_the_longest_sequence():
    """The first SELECTION_SIZE batches and the one holding the longest sequence."""
    from lengthwise.report import SELECTION_SIZE, selection_batches

    setup = small_setup(["packing"])
    setup.batches = [[100, 200, 300], [50, 60], [7000, 20]]
    assert selection_batches(setup) == [0, 1, 2]
    setup.batches = [[100]] * (SELECTION_SIZE + 3) + [[7000]] + [[50]]
    assert selection_batches(setup) == list(range(SELECTION_SIZE)) + [SELECTION_SIZE + 3]


def test_a_scheme_is_kept_by_its_mean_over_every_selection_batch(monkeypatch):
    """pick_scheme keeps the scheme with the lowest mean over the whole selection set, not the
    one fastest on the first two batches, and the report says how many batches chose it."""
    import lengthwise.report as report
    from types import SimpleNamespace
    from lengthwise.planners.auto import Candidate
    from lengthwise.specs import ParallelScheme

    setup = small_setup(["packing"])
    setup.batches = [[10], [20], [30], [40], [50]]
    a, b = ParallelScheme(dp=2, tp=1, pp=1), ParallelScheme(dp=1, tp=1, pp=2)
    # scheme a is faster on batches 0 and 1, b on the other three and on the mean
    times = {str(a): [1.0, 1.0, 5.0, 5.0, 5.0], str(b): [2.0, 2.0, 2.0, 2.0, 2.0]}

    def fake(name, request, **kw):
        step = times[str(request.scheme)][[10, 20, 30, 40, 50].index(request.lengths[0])]
        return Candidate(planner=name, result=SimpleNamespace(fits=True, step_time_s=step))

    monkeypatch.setattr(report, "try_planner", fake)
    setting, tries = report.pick_scheme(setup, "packing", [a, b])
    assert setting.scheme == b and len(tries) == 2 * 5


def test_scheme_flag_fixes_one_scheme_for_every_planner(tmp_path, capsys):
    code = main(["compare", "--profile", "tiny", "--model", "tiny", "--cluster", "cpu", "--gpus", "2",
                 "--batch-size", "16", "--batches", "1", "--planners", "packing,megatron,chunkflow",
                 "--scheme", "dp1-tp1-pp2-cp1", "--out", str(tmp_path / "r"), "--json", "--no-pictures"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["planners"]
    assert {r["scheme"] for r in rows.values()} == {"dp1-tp1-pp2-cp1"}
    assert rows["megatron"]["speedup_vs_megatron"] == pytest.approx(1.0)


def test_auto_planner_returns_the_fastest_fitting_candidate():
    model, cluster = MODEL_PRESETS["qwen2.5-0.5b"], cluster_preset("h100", 4)
    request = PlanRequest(lengths=[5000, 300, 200, 100, 2500, 60], model=model, cluster=cluster,
                          scheme=ParallelScheme(dp=2, pp=2), cost=CostModel(model=model, cluster=cluster),
                          context_length=8192, options={"candidates": ["padding", "packing", "chunkflow"]})
    plan = plan_auto(request)
    times = {n: v["step_time_s"] for n, v in plan.metrics["auto"].items() if "step_time_s" in v}
    assert plan.metrics["chosen_planner"] == min(times, key=times.get)
    assert simulate_plan(plan, request.cost).step_time_s == pytest.approx(min(times.values()))


def test_auto_rejects_itself_as_a_candidate():
    model, cluster = MODEL_PRESETS["tiny"], cluster_preset("cpu", 1)
    request = PlanRequest(lengths=[10, 20], model=model, cluster=cluster, scheme=ParallelScheme(),
                          cost=CostModel(model=model, cluster=cluster), context_length=64,
                          options={"candidates": ["auto"]})
    with pytest.raises(UserError, match="own candidate"):
        plan_auto(request)


def test_compare_cli_writes_report_and_json(tmp_path, capsys):
    out = tmp_path / "rep"
    code = main(["compare", "--profile", "tiny", "--model", "tiny", "--cluster", "cpu", "--gpus", "1",
                 "--batch-size", "16", "--batches", "1", "--planners", "packing,padding,auto",
                 "--out", str(out), "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_s", "speedup_vs_best_baseline", "bubble_ratio", "dp_imbalance",
                "peak_memory_gib", "fits", "planning_ms_mean", "planning_ms_max", "scheme"):
        assert key in data["planners"]["packing"]
    assert data["setup"]["simulated"] is True
    source = data["setup"]["time_model"]  # issue 29: which efficiency curve, measured on what
    assert source["efficiency"] == "built-in curve" and source["measured_on"] == "NVIDIA H200"
    report = (out / "report.md").read_text()
    assert "| packing |" in report and "simulated" in report
    assert f"Chunk times: {source['text']}" in report
    assert (out / "gantt-packing.png").stat().st_size > 1000 and (out / "speedup.png").exists()


def test_compare_rejects_unknown_planner(capsys):
    assert main(["compare", "--planners", "packing,nosuch", "--profile", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nosuch" in err[0]


def test_confirm_dry_runs_the_winners_fullest_rank(tmp_path, capsys):
    pytest.importorskip("torch")
    code = main(["compare", "--profile", "tiny", "--model", "tiny", "--cluster", "cpu", "--gpus", "2",
                 "--batch-size", "12", "--batches", "2", "--planners", "packing,megatron,chunkflow,auto",
                 "--scheme", "dp1-tp1-pp2-cp1", "--out", str(tmp_path / "r"), "--json", "--no-pictures",
                 "--confirm"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    c = summary["confirm"]
    assert c["planner"] == "auto" and c["chosen_planner"] in ("packing", "megatron", "chunkflow")
    assert c["measured_peak_gib"] > 0 and c["simulated_peak_gib"] > 0
    assert c["fits"] == (c["measured_peak_gib"] <= c["capacity_gib"])
    assert "Confirmed by a dry run" in (tmp_path / "r" / "report.md").read_text()


def test_a_planner_no_scheme_fits_reports_why_and_offers_auto_nothing(monkeypatch):
    """A planner that fits one selection batch and not another on every scheme has no scheme:
    its row carries the reason, no step time drawn from one selection attempt, and auto does not
    choose any of its attempts."""
    import lengthwise.report as report
    from lengthwise.planners.auto import Candidate

    original = report.try_planner

    def fails_on_the_long_batch(name, request, **kw):
        if name == "packing" and 7000 in request.lengths:
            return Candidate(planner=name, error="sequence too long", scheme=request.scheme)
        return original(name, request, **kw)

    monkeypatch.setattr(report, "try_planner", fails_on_the_long_batch)
    rows = run_compare(small_setup(["packing", "token-balanced", "auto"]))
    packing = summarise(rows)["planners"]["packing"]
    assert "step_time_s" not in packing
    assert packing["scheme"] == "none fits"
    assert packing["error"].startswith("no scheme fits every selection batch") and "sequence too long" in packing["error"]
    assert rows["auto"].chosen == {"token-balanced": 2}
