"""Simulated comparisons of every planner on the papers' settings; the README's planner table.

    python benchmarks/compare_suite.py                      # all scenarios, writes benchmarks/results/compare_suite.{json,md}
    python benchmarks/compare_suite.py --jobs 2                                # the same, two scenarios at a time
    python benchmarks/compare_suite.py --only skrull --batches 2
    python benchmarks/compare_suite.py --only skrull-lmsys-7b,stdlib-7b-32 --batches 4 --stem compare_suite_reduced

Each scenario samples global batches from a published length profile (or, for stdlib-7b-32, a
real corpus's token counts), plans them with every planner (each at its best scheme from
`lengthwise compare`'s search over the selection set, the same scheme list for all, unless the
scenario fixes the paper's scheme: one scheme holds every planner, hydraulis included), and
simulates the plans with the analytic cost model of the cluster preset, whose efficiency curve
is the built-in one fitted to the H200 profiles (cost/efficiency.py; each result's `time_model`
and the tables' first line say so, with the hardware it was measured on). Each paper's rows run
that paper's baseline as the paper ran it (PAPER_BASELINE_OPTIONS); the -searched rows run the
baselines at their defaults. Each cell is a planner's mean speedup over `megatron` and over the
best baseline, with a 95% interval of the per-batch speedups (t-interval over batches). All
figures are simulated, never measured on GPUs.

The first table also sets each paper's planner's speedup over its paper's baseline beside the
speedup that paper published for its closest setting (paper_figures.py), their ratio, and the
strict verdict (`judge`): a point figure reproduces within ±30%; a range when ours lies in it
widened by 30% at both ends and is a speedup; an "up to" is judged at the best row we run of
that paper (`up_to_best`). A row that does not reproduce gets a one-line reason from the run
(`reason`) beside the modelled effect that explains the gap (EXPLANATIONS).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path

from lengthwise.files import write_atomic
from lengthwise.planners.baselines import PAPER_BASELINES
from lengthwise.report import (BASELINES, SELECTION_SIZE, CompareSetup, all_planners, run_compare, summarise,
                               time_model)
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.source import lengths_file_source, profile_source
from lengthwise.workloads.sampler import GlobalBatchSampler

from paper_figures import (  # benchmarks/, the script's own folder; PaperFigure re-exported for tests
    EXPLANATIONS, FIDELITY_TOLERANCE, PAPER_ESTIMATES, PAPER_FIGURES, SKRULL_DATASET_MEANS, PaperFigure,
)

RESULTS = Path(__file__).parent / "results"

# name, paper, profile (or lengths:FILE), model, cluster, gpus, context, batch (sequences or tokens), fixed
# scheme: one for every planner (hydraulis held to it by its pipelines option), a {planner: scheme} dict
# for those planners only (the paper's baseline at the paper's scheme), or None (all searched)
SCENARIOS = [
    # chunkflow table 3: Megatron-LM's (and ChunkFlow's) <TP, SP, PP> for 7B, 4 + 4 with SP, PP 1 at
    # 32K and PP 4 at 256K; the -searched rows let every planner search the scheme list instead
    ("chunkflow-32k", "chunkflow", "chunkflow-eval", "qwen2.5-7b", "h100", 32, 32768, {"batch_size": 256},
     ParallelScheme(dp=8, tp=4, pp=1)),
    ("chunkflow-256k", "chunkflow", "chunkflow-eval", "qwen2.5-7b", "h100", 32, 262144, {"batch_size": 256},
     ParallelScheme(dp=2, tp=4, pp=4)),
    ("chunkflow-32k-searched", "chunkflow", "chunkflow-eval", "qwen2.5-7b", "h100", 32, 32768,
     {"batch_size": 256}, None),
    ("chunkflow-256k-searched", "chunkflow", "chunkflow-eval", "qwen2.5-7b", "h100", 32, 262144,
     {"batch_size": 256}, None),
    ("skrull-lmsys-0.5b", "skrull", "lmsys-skrull", "qwen2.5-0.5b", "h100", 32, 131072, {"batch_size": 64},
     ParallelScheme(dp=4, cp=8, zero=2)),
    ("skrull-chatqa2-0.5b", "skrull", "chatqa2", "qwen2.5-0.5b", "h100", 32, 131072, {"batch_size": 64},
     ParallelScheme(dp=4, cp=8, zero=2)),
    ("skrull-lmsys-7b", "skrull", "lmsys-skrull", "qwen2.5-7b", "h100", 32, 131072, {"batch_size": 64},
     ParallelScheme(dp=4, cp=8, zero=2)),
    # skrull §6: 7B on ChatQA2 needed <DP=2, CP=16, BatchSize=40> for memory
    ("skrull-chatqa2-7b", "skrull", "chatqa2", "qwen2.5-7b", "h100", 32, 131072, {"batch_size": 40},
     ParallelScheme(dp=2, cp=16, zero=2)),
    # hydraulis Table 3 (lines 598-614): Megatron-LM's scheme at 32K (F2 & F3) for LLaMA 7B on 16
    # A800s and 13B on 32; Hydraulis picks its own strategies
    ("hydraulis-cc-7b-16", "hydraulis", "commoncrawl", "llama2-7b", "a800", 16, 32768, {"token_budget": 200_000},
     {"megatron": ParallelScheme(dp=2, tp=4, pp=2)}),
    ("hydraulis-github-13b-32", "hydraulis", "github", "llama2-13b", "a800", 32, 32768, {"token_budget": 200_000},
     {"megatron": ParallelScheme(dp=4, tp=8)}),
    # Table 3's 32B on 32 GPUs (line 611): Megatron-LM at DP2TP16 for 32K; the 32B preset has the 64
    # heads TP 16 needs (specs.py)
    ("hydraulis-cc-32b-32", "hydraulis", "commoncrawl", "llama-32b", "a800", 32, 32768, {"token_budget": 200_000},
     {"megatron": ParallelScheme(dp=2, tp=16)}),
    ("hydraulis-cc-7b-16-searched", "hydraulis", "commoncrawl", "llama2-7b", "a800", 16, 32768,
     {"token_budget": 200_000}, None),
    ("hydraulis-github-13b-32-searched", "hydraulis", "github", "llama2-13b", "a800", 32, 32768,
     {"token_budget": 200_000}, None),
    # infinipipe §5.1-5.2 (lines 341-356): 32 A800s, batch 512, 48K and 96K contexts; Figure 8's caption
    # fixes Megatron-LM at TP 8 with CP 2 for 7B and CP 4 for the larger models
    ("infinipipe-cc-7b-32", "infinipipe", "commoncrawl", "llama2-7b", "a800", 32, 49152, {"batch_size": 512},
     {"megatron": ParallelScheme(dp=2, tp=8, cp=2)}),
    ("infinipipe-github-13b-32", "infinipipe", "github", "llama2-13b", "a800", 32, 98304, {"batch_size": 512},
     {"megatron": ParallelScheme(dp=1, tp=8, cp=4)}),
    ("infinipipe-cc-7b-32-searched", "infinipipe", "commoncrawl", "llama2-7b", "a800", 32, 49152,
     {"batch_size": 512}, None),
    ("infinipipe-github-13b-32-searched", "infinipipe", "github", "llama2-13b", "a800", 32, 98304,
     {"batch_size": 512}, None),
    # slimpack §6.1 (lines 181-183) does not give Megatron-LM's scheme ("according to model scale"):
    # searched for every planner
    ("slimpack-github-7b-128", "slimpack", "github", "llama2-7b", "h100", 128, 131072, {"batch_size": 512}, None),
    ("slimpack-cc-70b-256", "slimpack", "commoncrawl", "llama-70b", "h100", 256, 65536, {"batch_size": 512}, None),
    # the same at 256K, the longest context of slimpack §6.1, where it says its gains are largest (line 191)
    ("slimpack-cc-70b-256-256k", "slimpack", "commoncrawl", "llama-70b", "h100", 256, 262144, {"batch_size": 512},
     None),
    # no paper's: a real corpus sample, the byte-token counts of the 731 non-empty .py files of Python
    # 3.11's standard library (the default training corpus, `--data stdlib`), frozen in a lengths file
    # so the row does not move with the Python version; every planner searched
    ("stdlib-7b-32", "none", "lengths:" + "benchmarks/data/stdlib_lengths.txt", "llama2-7b", "h100", 32, 32768,
     {"batch_size": 256}, None),
]


PAPER_BASELINE = {paper: planner for paper, (planner, _) in PAPER_BASELINES.items()}
"""What each paper measured against (planners/baselines.py PAPER_BASELINES): `megatron` but for
Skrull, which compared with DeepSpeed (ZeRO-2, static context parallelism over every sequence)."""


PAPER_BASELINE_OPTIONS = {paper: {planner: options} for paper, (planner, options) in PAPER_BASELINES.items()
                          if options}
"""Planner options each paper's rows give that paper's baseline, so it runs as the paper ran it
(`paper_options`). The -searched rows run every baseline at its defaults (megatron packs
context-length micro-batches next-fit, recomputation decided from the context) on its best
scheme: not the papers' own baselines."""


def searched_row(name: str) -> bool:
    """Rows that search every planner's scheme and run the baselines at their defaults."""
    return name.endswith("-searched")


def paper_options(name: str, paper: str, scheme, planners: list[str]) -> dict[str, dict]:
    """Planner options of one scenario: the paper's baseline as the paper ran it (outside the
    -searched rows), and, where one scheme is fixed for every planner, hydraulis held to it (its
    `pipelines` option: dp identical pipelines of the scheme's tp, pp and cp)."""
    options = {} if searched_row(name) else {p: dict(o) for p, o in PAPER_BASELINE_OPTIONS.get(paper, {}).items()}
    if isinstance(scheme, ParallelScheme) and "hydraulis" in planners:
        one = f"tp{scheme.tp}-pp{scheme.pp}-cp{scheme.cp}"
        options.setdefault("hydraulis", {})["pipelines"] = ",".join([one] * scheme.dp)
    return options


def paper_baseline(paper: str) -> str:
    return PAPER_BASELINE.get(paper, "megatron")


def headline_speedups(results: list[dict]) -> dict[str, str]:
    """Scenario -> its paper's planner's mean speedup over its paper's baseline, as printed."""
    values = {}
    for r in results:
        interval = r["planners"].get(r["paper"], {}).get("intervals", {}).get("vs_paper_baseline")
        if interval:
            values[r["scenario"]] = interval["mean"]
    out = {name: f"{v:.2f}x" for name, v in values.items()}
    for name, members in SKRULL_DATASET_MEANS.items():
        if all(m in values for m in members):
            out["mean:" + name] = f"{statistics.fmean(values[m] for m in members):.2f}x"
    return out


def explanation(result: dict, others: dict[str, str] | None = None) -> str:
    """EXPLANATIONS' sentence for one scenario, its numbers taken from `result`."""
    text = EXPLANATIONS.get(result["scenario"], "")
    if not text:
        return ""
    planners = result["planners"]
    base, mine = planners.get(paper_baseline(result["paper"]), {}), planners.get(result["paper"], {})
    fields = {"baseline_scheme": base.get("scheme", "-"), "baseline_s": base.get("step_time_s") or math.nan,
              "paper_scheme": mine.get("scheme", "-"), "paper_s": mine.get("step_time_s") or math.nan,
              "baseline_compute_s": base.get("compute_time_s") or math.nan,
              "paper_compute_s": mine.get("compute_time_s") or math.nan,
              "baseline_micro_batches": base.get("micro_batches") or math.nan,
              "baseline_bubble": base.get("bubble_ratio", math.nan), "paper_bubble": mine.get("bubble_ratio", math.nan),
              "paper": result["paper"]}
    interval = mine.get("intervals", {}).get("vs_paper_baseline")
    fields["speedup"] = interval["mean"] if interval else math.nan
    fields["over_estimate"] = fields["speedup"] / PAPER_ESTIMATES.get(result["scenario"], math.nan)
    fields["compute_ratio"] = fields["baseline_compute_s"] / fields["paper_compute_s"]
    fields["baseline_sync_s"] = fields["baseline_s"] - fields["baseline_compute_s"]
    fields["paper_sync_s"] = fields["paper_s"] - fields["paper_compute_s"]
    names = [spec[0] for spec in SCENARIOS] + ["mean:" + name for name in SKRULL_DATASET_MEANS]
    for name in names:
        text = text.replace("{" + name + "}", (others or {}).get(name, "n/a"))
    return text.format(**fields)


def _ours(result: dict) -> float | None:
    interval = result["planners"].get(result["paper"], {}).get("intervals", {}).get("vs_paper_baseline")
    return interval["mean"] if interval else None


def judge(ours: float, value: float | tuple[float, float]) -> tuple[float | list[float], bool]:
    """(ours / paper, whether it reproduces) under the strict rule: a point figure within
    ±FIDELITY_TOLERANCE of ours / paper; a range [low, high] reproduces when ours lies inside
    [low x (1 - tol), high x (1 + tol)] and, where the paper's whole range is a speedup (low > 1),
    ours is a speedup too: a slowdown never reproduces a published speedup."""
    if isinstance(value, tuple):
        low, high = value
        inside = (1 - FIDELITY_TOLERANCE) * low <= ours <= (1 + FIDELITY_TOLERANCE) * high
        return [ours / high, ours / low], inside and (low <= 1 or ours > 1)
    ratio = ours / value
    return ratio, abs(ratio - 1) <= FIDELITY_TOLERANCE


def up_to_best(results: list[dict]) -> dict[str, str]:
    """Scenario -> the scenario an "up to" figure is judged at: the one of the same paper, figure
    and kind of row (-searched or the paper's setting) whose speedup is highest, since an "up to"
    is the paper's best setting and ours is compared at the best setting we run."""
    best: dict[tuple, tuple[float, str]] = {}
    for r in results:
        figure, ours = PAPER_FIGURES.get(r["scenario"]), _ours(r)
        if figure is None or figure.kind != "up to" or ours is None:
            continue
        key = (r["paper"], figure.value, searched_row(r["scenario"]))
        if key not in best or ours > best[key][0]:
            best[key] = (ours, r["scenario"])
    out = {}
    for r in results:
        figure = PAPER_FIGURES.get(r["scenario"])
        if figure is not None and figure.kind == "up to":
            key = (r["paper"], figure.value, searched_row(r["scenario"]))
            if key in best:
                out[r["scenario"]] = best[key][1]
    return out


def reason(result: dict) -> str:
    """One line from the run naming where the step time goes, for a row that does not reproduce."""
    planners = result["planners"]
    base_name = paper_baseline(result["paper"])
    base, mine = planners.get(base_name, {}), planners.get(result["paper"], {})
    if "error" in base or "error" in mine:
        return f"{base_name}: {base.get('error', 'ran')}; {result['paper']}: {mine.get('error', 'ran')}"
    if base.get("step_time_s") is None or mine.get("step_time_s") is None:
        return "the paper's planner or baseline did not run"
    return (f"{base_name} at {base.get('scheme', '-')} {base['step_time_s']:.2f} s a step ({base['compute_time_s']:.2f} s "
            f"compute, idle {base.get('bubble_ratio', math.nan):.0%}), {result['paper']} at {mine.get('scheme', '-')} "
            f"{mine['step_time_s']:.2f} s ({mine['compute_time_s']:.2f} s, idle {mine.get('bubble_ratio', math.nan):.0%})")


def paper_comparison(result: dict, others: dict[str, str] | None = None,
                     best: dict[str, str] | None = None) -> dict:
    """The paper's figure for one scenario's result, the ratio of our mean speedup over the
    paper's baseline to it, and whether it reproduces (`judge`). An "up to" figure is judged
    only at `best`'s scenario for it (the best setting we run of that paper, `up_to_best`); the
    paper's other rows say where it was judged. A row that does not reproduce gets `reason`."""
    figure = PAPER_FIGURES.get(result["scenario"])
    ours = _ours(result)
    value = figure.value if figure else None
    ratio = within = None
    judged_at = (best or {}).get(result["scenario"])
    if value is not None and ours is not None:
        if figure.kind == "up to" and judged_at and judged_at != result["scenario"]:
            ratio = ours / value  # within stays None: the verdict is the best row's
        else:
            ratio, within = judge(ours, value)
    return {"paper_figure": list(value) if isinstance(value, tuple) else value,
            "paper_figure_kind": figure.kind if figure else "none",
            "paper_source": figure.source if figure else None,
            "paper_note": figure.note if figure else "no entry in PAPER_FIGURES",
            "ours_over_paper": ratio, "within_tolerance": within,
            "judged_at": judged_at if figure and figure.kind == "up to" else result["scenario"],
            "reason": reason(result) if within is False else "",
            "explanation": explanation(result, others)}


def comparisons(results: list[dict]) -> list[dict]:
    """Every result with its paper comparison (`paper_comparison`), judged together."""
    others, best = headline_speedups(results), up_to_best(results)
    return [{**r, **paper_comparison(r, others, best)} for r in results]


def sample_batches(profile: str, context: int, seed: int, count: int, size: dict) -> list[list[int]]:
    """`count` global batches of a published profile, or of a lengths file ("lengths:PATH",
    relative to the repository root), longer sequences than the context dropped."""
    if profile.startswith("lengths:"):
        source = lengths_file_source(str(Path(__file__).parent.parent / profile.split(":", 1)[1]), context, "drop")
    else:
        source = profile_source(profile, context, "drop")
    sampler = GlobalBatchSampler(source, seed=seed, **size)
    return [list(map(int, sampler.next_batch().lengths)) for _ in range(count)]


def fixed_schemes(scheme, planners: list[str]) -> dict[str, ParallelScheme]:
    """A scenario's fixed schemes per planner (see SCENARIOS); the others search. One scheme
    holds every planner, hydraulis included (`paper_options` gives it the scheme's pipelines):
    hydraulis picks its strategy per batch only where it searches."""
    if isinstance(scheme, dict):
        return {p: s for p, s in scheme.items() if p in planners}
    return {p: scheme for p in planners} if scheme else {}


def scheme_text(scheme) -> str | None:
    if isinstance(scheme, dict):
        return "; ".join(f"{p} {s}" for p, s in scheme.items())
    return str(scheme) if scheme else None


def run_scenario(spec, batches: int, seed: int) -> dict:
    name, paper, profile, model, cluster, gpus, context, size, scheme = spec
    planners = all_planners()
    setup = CompareSetup(model=model_preset(model), cluster=cluster_preset(cluster, gpus), context_length=context,
                         batches=sample_batches(profile, context, seed, batches, size), planners=planners,
                         seed=seed, zero=scheme.zero if isinstance(scheme, ParallelScheme) else 1,
                         schemes=fixed_schemes(scheme, planners),
                         options=paper_options(name, paper, scheme, planners))
    started = time.perf_counter()
    rows = run_compare(setup)
    summary = summarise(rows)
    for planner, row in rows.items():
        summary["planners"][planner]["intervals"] = speedup_intervals(rows, row, paper_baseline(paper))
    return {"scenario": name, "paper": paper, "profile": profile, "model": model, "cluster": cluster, "gpus": gpus,
            "context_length": context, "batch": size, "fixed_scheme": scheme_text(scheme),
            "time_model": time_model(setup), "seconds": time.perf_counter() - started, **summary}


def _run_one(job: tuple) -> dict:
    spec, batches, seed = job
    print(f"{spec[0]} ...", file=sys.stderr, flush=True)
    return run_scenario(spec, batches, seed)


def run_scenarios(chosen: list, batches: int, seed: int, jobs: int, saved: Path) -> list[dict]:
    """Every chosen scenario's result, in the order chosen. With jobs > 1 they run in a process
    pool, the slowest of the last saved run first so that no long one starts last."""
    if jobs == 1:
        return [_run_one((spec, batches, seed)) for spec in chosen]
    last = {}
    if saved.is_file():
        last = {r["scenario"]: r.get("seconds", 0.0) for r in json.loads(saved.read_text()).get("results", [])}
    order = sorted(chosen, key=lambda spec: -last.get(spec[0], 0.0))
    with multiprocessing.get_context("spawn").Pool(min(jobs, len(order))) as pool:
        done = {r["scenario"]: r for r in pool.imap_unordered(_run_one, [(s, batches, seed) for s in order])}
    return [done[spec[0]] for spec in chosen]


def speedup_intervals(rows, row, papers_baseline: str = "megatron") -> dict:
    """Mean and 95% interval of the per-batch speedups of `row` over megatron, over the paper's
    own baseline and over the best baseline of each batch (batches where both fit)."""
    out = {}
    for key, bases in (("vs_megatron", ["megatron"]), ("vs_paper_baseline", [papers_baseline]),
                       ("vs_best_baseline", list(BASELINES))):
        ratios = []
        for b, run in enumerate(row.runs):
            base = [rows[n].runs[b] for n in bases if n in rows and b < len(rows[n].runs)]
            base = [r.result.step_time_s for r in base if r.result is not None and r.result.fits]
            if run.result is not None and run.result.fits and base:
                ratios.append(min(base) / run.result.step_time_s)
        out[key] = mean_interval(ratios)
    return out


def mean_interval(values: list[float]) -> dict | None:
    if not values:
        return None
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "low": mean, "high": mean, "batches": 1}
    import scipy.stats  # here, not at the top: slow to import, and only the simulation needs it

    half = scipy.stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "batches": len(values)}


def _cell(interval: dict | None) -> str:
    if interval is None:
        return "-"
    return f"{interval['mean']:.2f}x [{interval['low']:.2f}, {interval['high']:.2f}]"


def _figure_cell(comparison: dict) -> str:
    value, kind = comparison["paper_figure"], comparison["paper_figure_kind"]
    if value is None:
        return "-"
    if kind == "range":
        return f"{value[0]:.2f}-{value[1]:.2f}x"
    return {"up to": f"up to {value:.2f}x", "average": f"{value:.2f}x (average)"}.get(kind, f"{value:.2f}x")


def _ratio_cell(comparison: dict) -> str:
    ratio = comparison["ours_over_paper"]
    if ratio is None:
        return "-"
    return f"{ratio[0]:.2f}-{ratio[1]:.2f}" if isinstance(ratio, list) else f"{ratio:.2f}"


def verdict_cell(comparison: dict, scenario: str) -> str:
    within = comparison["within_tolerance"]
    if within is None and comparison.get("judged_at") not in (None, scenario):
        return f"judged at {comparison['judged_at']}"
    return {True: "yes", False: "no: " + comparison.get("reason", ""), None: "n/a"}[within]


def markdown(results: list[dict]) -> str:
    """Three tables, each mean [95% interval] over batches: each paper's planner over that
    paper's own baseline, beside the paper's own figure and the strict verdict (`judge`); every
    planner over megatron; every planner over the best baseline. `results` carry their
    comparisons (`comparisons`)."""
    out = ["Each paper's planner over the baseline that paper measured against, run as the paper ran it "
           "(PAPER_BASELINE_OPTIONS), in the paper's setting (simulated), beside the speedup the paper "
           "published for its closest setting (\"up to\": the paper's maximum over its settings, judged at "
           "the best setting run here; a range: the spread over them; sources in PAPER_FIGURES). "
           "Reproduces: ours / paper within ±30% of a point figure, or inside the range widened by 30% at "
           "both ends and a speedup where the paper's is:\n",
           "| scenario | scheme | planner | paper's baseline | speedup | auto over the same baseline | "
           "paper's figure | ours / paper | reproduces | explanation |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    results = comparisons(results)
    for r in results:
        if r["paper"] not in r["planners"]:
            continue  # a scenario no paper ran (a corpus sample): in the tables below only
        base = paper_baseline(r["paper"])
        mine = r["planners"].get(r["paper"], {})
        auto = r["planners"].get("auto", {})
        scheme = r["fixed_scheme"] or f"searched ({mine.get('scheme', '-')})"
        if r["fixed_scheme"] and f"{r['paper']} " not in r["fixed_scheme"] and r["fixed_scheme"].startswith(base):
            scheme += f"; {r['paper']} searched ({mine.get('scheme', '-')})"
        out.append(f"| {r['scenario']} | {scheme} | {r['paper']} | {base} | "
                   f"{_cell(mine.get('intervals', {}).get('vs_paper_baseline'))} | "
                   f"{_cell(auto.get('intervals', {}).get('vs_paper_baseline'))} | "
                   f"{_figure_cell(r)} | {_ratio_cell(r)} | {verdict_cell(r, r['scenario'])} | "
                   f"{r['explanation']} |")
    sizes = sorted({p.get("selection_batches", 0) for r in results for p in r["planners"].values()} - {0})
    if sizes:
        out.append(f"\nA searched scheme is kept by its mean simulated step over the selection set: "
                   f"{' or '.join(map(str, sizes))} batches (the first {SELECTION_SIZE} or fewer and the one holding the longest "
                   "sequence); a fixed scheme is the paper's.")
    out.append("")
    for key, title in (("vs_megatron", "over megatron (Megatron-LM as ChunkFlow, InfiniPipe, SlimPack and "
                                       "Hydraulis ran it)"),
                       ("vs_best_baseline", "over the best baseline")):
        out.append(f"Speedup {title}, mean [95% interval] over batches (simulated):\n")
        out.append("| scenario | " + " | ".join(all_planners()) + " |")
        out.append("|---|" + "---|" * len(all_planners()))
        for r in results:
            cells = [_cell(r["planners"].get(p, {}).get("intervals", {}).get(key)) for p in all_planners()]
            out.append(f"| {r['scenario']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="run scenarios whose name contains this text, or exactly those of a "
                        "comma-separated list of names")
    parser.add_argument("--render", action="store_true",
                        help="rewrite the tables from the saved results (new figures or explanations), simulating nothing")
    parser.add_argument("--jobs", type=int, default=1,
                        help="run this many scenarios at once, one process each (every scenario is planned and "
                        "simulated alone, so the results do not depend on it); longest first by the last saved run")
    parser.add_argument("--stem", help="name the result files benchmarks/results/STEM.{json,md} (default: "
                        "compare_suite, or compare_suite_ONLY with --only), e.g. to keep a reduced run apart")
    args = parser.parse_args(argv)
    stem = args.stem or ("compare_suite" if not args.only else f"compare_suite_{args.only}")
    if args.render:  # the saved run's numbers, this file's figures and explanations
        saved = json.loads((RESULTS / f"{stem}.json").read_text())
        results = comparisons(saved["results"])
        write_atomic(RESULTS / f"{stem}.json", json.dumps({**saved, "results": results}, indent=1))
        write_atomic(RESULTS / f"{stem}.md", run_label(saved["meta"], results) + time_line(results) + markdown(results))
        print(markdown(results))
        return 0
    chosen = [s for s in SCENARIOS if not args.only or (s[0] in args.only.split(",") if "," in args.only
                                                        else args.only in s[0])]
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, not {args.jobs}")
    results = comparisons(run_scenarios(chosen, args.batches, args.seed, args.jobs, RESULTS / f"{stem}.json"))
    meta = {"command": "python benchmarks/compare_suite.py " + " ".join(argv or sys.argv[1:]),
            "simulated": True, "batches": args.batches, "python": platform.python_version(), "machine": platform.machine()}
    write_atomic(RESULTS / f"{stem}.json", json.dumps({"meta": meta, "results": results}, indent=1))
    write_atomic(RESULTS / f"{stem}.md", run_label(meta, results) + time_line(results) + markdown(results))
    print(time_line(results) + markdown(results))
    return 0


def time_line(results: list[dict]) -> str:
    """Where the scenarios' chunk times came from (each scenario's `time_model`), and on which
    hardware it was measured; empty for results saved before they said."""
    texts = sorted({r["time_model"]["text"] for r in results if "time_model" in r})
    return "".join(f"Chunk times: {t}.\n\n" for t in texts)


def run_label(meta: dict, results: list[dict]) -> str:
    """A line naming a reduced run (fewer scenarios or batches than the full suite's), so its
    verdicts are not read as the suite's."""
    command = meta.get("command", "")
    batches = meta.get("batches") or (int(command.split("--batches ")[1].split()[0]) if "--batches " in command else 32)
    if len(results) == len(SCENARIOS) and batches >= 32:
        return ""
    return (f"REDUCED RUN (`{command}`): {len(results)} of {len(SCENARIOS)} scenarios, {batches} batches each, "
            "simulated; not the full suite's verdicts.\n\n")


if __name__ == "__main__":
    raise SystemExit(main())
