"""benchmarks/compare_suite.py's first table: each paper's planner beside the paper's own figure.

The script lives in benchmarks/ (not a package): it is loaded from its file. markdown() and
paper_comparison() run on hand-made results, so nothing is simulated here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
PAPERS = ("chunkflow", "skrull", "hydraulis", "infinipipe", "slimpack")


@pytest.fixture
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("compare_suite", BENCH / "compare_suite.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare_suite", module)
    spec.loader.exec_module(module)
    return module


def result(scenario: str, paper: str, mean: float | None) -> dict:
    interval = None if mean is None else {"mean": mean, "low": mean - 0.1, "high": mean + 0.1, "batches": 4}
    row = {"scheme": "dp4-tp1-pp1-cp8", "intervals": {"vs_paper_baseline": interval, "vs_megatron": interval,
                                                       "vs_best_baseline": interval}}
    return {"scenario": scenario, "paper": paper, "fixed_scheme": "dp4-tp1-pp1-cp8",
            "planners": {paper: row, "auto": row}}


def first_table(text: str) -> dict[str, list[str]]:
    """Scenario -> the cells of its row in the markdown's first table."""
    lines = text.split("\n\n")[1].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return header, rows


def test_first_table_sets_each_speedup_beside_the_papers_figure(suite, monkeypatch):
    figure = suite.PaperFigure
    monkeypatch.setattr(suite, "PAPER_FIGURES", {
        "a-value": figure(2.0, "value", "skrull.txt line 1", "same setting"),
        "a-far": figure(4.0, "up to", "chunkflow.txt line 2", "maximum over settings"),
        "a-range": figure((1.5, 2.5), "range", "hydraulis.txt line 3", "spread over settings"),
        "no-figure": figure(None, "none", "", "no matching setting"),
    })
    monkeypatch.setattr(suite, "EXPLANATIONS", {"a-far": "the modelled effect, 2.0x"})
    results = [result("a-value", "skrull", 2.5), result("a-far", "chunkflow", 2.0),
               result("a-range", "hydraulis", 3.0), result("no-figure", "slimpack", 1.2),
               result("a-range-unfit", "hydraulis", None)]
    header, rows = first_table(suite.markdown(results))
    assert header[-4:] == ["paper's figure", "ours / paper", "reproduces", "explanation"]
    # 2.5 / 2.0 = 1.25, inside ±30%; 2.0 / 4.0 = 0.5, outside, with a reason from the run
    assert [rows["a-value"][k] for k in header[-4:]] == ["2.00x", "1.25", "yes", ""]
    assert [rows["a-far"][k] for k in header[-4:-2]] == ["up to 4.00x", "0.50"]
    assert rows["a-far"]["reproduces"].startswith("no: ")
    assert rows["a-far"]["explanation"] == "the modelled effect, 2.0x"
    # a range: the ratio against each end; 3.0 <= 1.3 * 2.5 so it reproduces
    assert [rows["a-range"][k] for k in header[-4:]] == ["1.50-2.50x", "1.20-2.00", "yes", ""]
    assert [rows["no-figure"][k] for k in header[-4:-2]] == ["-", "-"]
    assert rows["no-figure"]["reproduces"] == "n/a"
    assert rows["a-range-unfit"]["reproduces"] == "n/a"
    assert rows["a-range-unfit"]["paper's figure"] == "-"  # not in the patched PAPER_FIGURES


def test_ranges_are_judged_strictly(suite, monkeypatch):
    """Inside [0.7 x low, 1.3 x high] and, the paper's range being all speedups, a speedup:
    0.93x sits above 0.7 x 1.32 but is a slowdown, so it does not reproduce 1.32-2.66x."""
    monkeypatch.setattr(suite, "PAPER_FIGURES", {
        "r": suite.PaperFigure((1.32, 2.66), "range", "hydraulis.txt line 287", "note")})
    row = suite.paper_comparison(result("r", "hydraulis", 1.0))
    assert row["paper_figure"] == [1.32, 2.66] and row["paper_source"] == "hydraulis.txt line 287"
    assert row["ours_over_paper"] == pytest.approx([1.0 / 2.66, 1.0 / 1.32])
    assert row["within_tolerance"] is False  # 1.0 is no speedup
    assert suite.paper_comparison(result("r", "hydraulis", 0.95))["within_tolerance"] is False
    assert suite.paper_comparison(result("r", "hydraulis", 1.05))["within_tolerance"] is True
    assert suite.paper_comparison(result("r", "hydraulis", 3.4))["within_tolerance"] is True  # <= 1.3 x 2.66
    assert suite.paper_comparison(result("r", "hydraulis", 3.5))["within_tolerance"] is False
    # a point figure: within ±30% of it, both sides
    assert suite.judge(1.29, 1.0)[1] and suite.judge(0.71, 1.0)[1]
    assert not suite.judge(1.31, 1.0)[1] and not suite.judge(0.69, 1.0)[1]
    missing = suite.paper_comparison(result("other", "hydraulis", 1.0))
    assert missing["paper_figure"] is None and missing["ours_over_paper"] is None
    assert missing["within_tolerance"] is None and missing["reason"] == ""


def test_up_to_figures_are_judged_at_the_best_setting_run(suite, monkeypatch):
    """An "up to" is the paper's best setting: only our best row of that paper carries the
    verdict; its other rows point to it; -searched rows are judged among themselves."""
    up_to = suite.PaperFigure(2.6, "up to", "infinipipe.txt line 356", "max")
    monkeypatch.setattr(suite, "PAPER_FIGURES", {n: up_to for n in ("p-a", "p-b", "p-a-searched")})
    results = [result("p-a", "infinipipe", 1.2), result("p-b", "infinipipe", 2.2),
               result("p-a-searched", "infinipipe", 1.0)]
    judged = {r["scenario"]: r for r in suite.comparisons(results)}
    assert judged["p-b"]["within_tolerance"] is True and judged["p-b"]["judged_at"] == "p-b"
    assert judged["p-a"]["within_tolerance"] is None and judged["p-a"]["judged_at"] == "p-b"
    assert judged["p-a-searched"]["within_tolerance"] is False  # 1.0 / 2.6, its own group
    assert judged["p-a-searched"]["reason"]
    _, rows = first_table(suite.markdown(results))
    assert rows["p-a"]["reproduces"] == "judged at p-b"


def test_hydraulis_is_held_to_the_papers_fixed_scheme(suite):
    """In a row whose scheme holds every planner, hydraulis gets it too, as dp identical
    pipelines; it searches only where everyone does or where only the baseline is fixed."""
    from lengthwise.specs import ParallelScheme

    planners = ["megatron", "static-cp", "skrull", "hydraulis"]
    scheme = ParallelScheme(dp=4, cp=8, zero=2)
    assert suite.fixed_schemes(scheme, planners) == {p: scheme for p in planners}
    options = suite.paper_options("skrull-lmsys-7b", "skrull", scheme, planners)
    assert options["hydraulis"] == {"pipelines": ",".join(["tp1-pp1-cp8"] * 4)}
    assert options["static-cp"] == {"grad_reduce": "micro-batch"}
    only_baseline = {"megatron": ParallelScheme(dp=2, tp=4, pp=2)}
    assert suite.fixed_schemes(only_baseline, planners) == only_baseline
    assert "hydraulis" not in suite.paper_options("hydraulis-cc-7b-16", "hydraulis", only_baseline, planners)
    assert suite.fixed_schemes(None, planners) == {}


def test_each_papers_rows_run_its_own_baseline_and_searched_rows_the_defaults(suite):
    planners = ["megatron", "static-cp"]
    assert suite.paper_options("slimpack-cc-70b-256", "slimpack", None, planners) == {
        "megatron": {"packing": "best-fit", "recompute_per_batch": True}}
    assert suite.paper_options("chunkflow-32k", "chunkflow", None, planners) == {
        "megatron": {"micro_batch_size": 1}}
    assert suite.paper_options("chunkflow-32k-searched", "chunkflow", None, planners) == {}
    for paper, per_planner in suite.PAPER_BASELINE_OPTIONS.items():
        assert set(per_planner) == {suite.paper_baseline(paper)}


def test_the_stdlib_row_reads_its_lengths_file(suite):
    spec = next(s for s in suite.SCENARIOS if s[0] == "stdlib-7b-32")
    batches = suite.sample_batches(spec[2], spec[6], 0, 2, spec[7])
    assert len(batches) == 2 and all(len(b) == 256 and max(b) <= spec[6] for b in batches)
    assert suite.PAPER_FIGURES["stdlib-7b-32"].value is None


def test_every_scenario_has_a_cited_figure_from_its_own_paper(suite):
    for name, paper, *_ in suite.SCENARIOS:
        figure = suite.PAPER_FIGURES[name]
        assert (paper == "none") == (figure.value is None)
        assert figure.kind in ("value", "average", "up to", "range", "none")
        assert figure.note
        if figure.value is None:
            assert figure.kind == "none"
            continue
        assert figure.source.startswith(f"{paper}.txt ") and "line" in figure.source
        low, high = figure.value if isinstance(figure.value, tuple) else (figure.value, figure.value)
        assert 1.0 < low <= high and (figure.kind == "range") == isinstance(figure.value, tuple)


def test_explanations_take_their_numbers_from_the_run(suite, monkeypatch):
    """The skrull sentences: compute ratio and what the step adds after the makespan come from
    the planners' means, the three-dataset mean from the scenarios' speedups (LMSys twice, as it
    stands for Wikipedia too)."""
    monkeypatch.setattr(suite, "EXPLANATIONS", {"s": "{compute_ratio:.1f}x; {baseline_sync_s:.2f} s, "
                                                     "{paper_sync_s:.2f} s; {baseline_micro_batches:.0f}; "
                                                     "{mean:skrull-0.5b}"})
    rows = [result(name, "skrull", mean) for name, mean in
            (("skrull-lmsys-0.5b", 3.0), ("skrull-chatqa2-0.5b", 1.5))]
    r = result("s", "skrull", 2.0)
    r["planners"]["static-cp"] = {"step_time_s": 0.5, "compute_time_s": 0.4, "micro_batches": 16.0}
    r["planners"]["skrull"].update({"step_time_s": 0.15, "compute_time_s": 0.1})
    text = suite.explanation(r, suite.headline_speedups(rows))
    assert text == "4.0x; 0.10 s, 0.05 s; 16; 2.50x"


def test_gain_sentences_take_bubbles_and_the_estimate_from_the_run(suite, monkeypatch):
    """The "up to" rows' sentences: each planner's bubble ratio from its summary, and our mean
    speedup over the paper's figure estimated for this setting (PAPER_ESTIMATES)."""
    monkeypatch.setattr(suite, "EXPLANATIONS", {"s": "{paper} {baseline_bubble:.0%} {paper_bubble:.0%}; "
                                                     "{speedup:.2f}x is {over_estimate:.2f}"})
    monkeypatch.setattr(suite, "PAPER_ESTIMATES", {"s": 2.5})
    r = result("s", "infinipipe", 1.5)
    r["planners"]["megatron"] = {"step_time_s": 3.0, "compute_time_s": 2.9, "bubble_ratio": 0.25}
    r["planners"]["infinipipe"].update({"step_time_s": 2.0, "compute_time_s": 1.9, "bubble_ratio": 0.1})
    assert suite.explanation(r) == "infinipipe 25% 10%; 1.50x is 0.60"


def test_every_fixed_scheme_is_accepted_by_its_scenarios_model(suite):
    from lengthwise.specs import model_preset

    for name, paper, profile, model, cluster, gpus, *_, scheme in suite.SCENARIOS:
        fixed = scheme.values() if isinstance(scheme, dict) else [scheme] if scheme else []
        for s in fixed:
            s.validate(model_preset(model), gpus)
