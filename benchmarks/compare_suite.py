"""Simulated comparisons of every planner on the papers' settings; the README's planner table.

    python benchmarks/compare_suite.py                      # all scenarios, writes benchmarks/results/compare_suite.{json,md}
    python benchmarks/compare_suite.py --only skrull --batches 2

Each scenario samples global batches from a published length profile, plans them with every
planner (each at its best scheme from `lengthwise compare`'s search, the same scheme list for
all, unless the scenario fixes the paper's scheme), and simulates the plans with the analytic
cost model of the cluster preset. Each cell is a planner's mean speedup over `megatron` (the
baseline the papers measured against) and over the best baseline, with a 95% interval of the
per-batch speedups (t-interval over batches). All figures are simulated, never measured on GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import scipy.stats

from lengthwise.plan.ir import write_atomic
from lengthwise.report import BASELINES, CompareSetup, all_planners, run_compare, summarise
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.source import profile_source
from lengthwise.workloads.sampler import GlobalBatchSampler

RESULTS = Path(__file__).parent / "results"

# name, paper, profile, model, cluster, gpus, context, batch (sequences or tokens), fixed scheme
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
    # skrull §6: 7B on ChatQA2 needed <DP=2, CP=16, BatchSize=40> for memory
    ("skrull-chatqa2-7b", "skrull", "chatqa2", "qwen2.5-7b", "h100", 32, 131072, {"batch_size": 40},
     ParallelScheme(dp=2, cp=16, zero=2)),
    ("hydraulis-cc-7b-16", "hydraulis", "commoncrawl", "llama2-7b", "a800", 16, 32768, {"token_budget": 200_000}, None),
    ("hydraulis-github-13b-32", "hydraulis", "github", "llama2-13b", "a800", 32, 32768, {"token_budget": 200_000}, None),
    ("infinipipe-cc-7b-32", "infinipipe", "commoncrawl", "llama2-7b", "h100", 32, 65536, {"batch_size": 512}, None),
    ("infinipipe-github-13b-32", "infinipipe", "github", "llama2-13b", "h100", 32, 131072, {"batch_size": 512}, None),
    ("slimpack-github-7b-128", "slimpack", "github", "llama2-7b", "h100", 128, 131072, {"batch_size": 512}, None),
    ("slimpack-cc-70b-256", "slimpack", "commoncrawl", "llama-70b", "h100", 256, 65536, {"batch_size": 512}, None),
]


PAPER_BASELINE = {"skrull": "static-cp"}
"""What each paper measured against, where it is not `megatron`: Skrull compared with DeepSpeed
(ZeRO-2, static context parallelism over every sequence)."""


def paper_baseline(paper: str) -> str:
    return PAPER_BASELINE.get(paper, "megatron")


def sample_batches(profile: str, context: int, seed: int, count: int, size: dict) -> list[list[int]]:
    sampler = GlobalBatchSampler(profile_source(profile, context, "drop"), seed=seed, **size)
    return [list(map(int, sampler.next_batch().lengths)) for _ in range(count)]


def run_scenario(spec, batches: int, seed: int) -> dict:
    name, paper, profile, model, cluster, gpus, context, size, scheme = spec
    planners = all_planners()
    setup = CompareSetup(model=model_preset(model), cluster=cluster_preset(cluster, gpus), context_length=context,
                         batches=sample_batches(profile, context, seed, batches, size), planners=planners,
                         seed=seed, zero=scheme.zero if scheme else 1,
                         schemes={p: scheme for p in planners if p != "hydraulis"} if scheme else {})
    started = time.perf_counter()
    rows = run_compare(setup)
    summary = summarise(rows)
    for planner, row in rows.items():
        summary["planners"][planner]["intervals"] = speedup_intervals(rows, row, paper_baseline(paper))
    return {"scenario": name, "paper": paper, "profile": profile, "model": model, "cluster": cluster, "gpus": gpus,
            "context_length": context, "batch": size, "fixed_scheme": str(scheme) if scheme else None,
            "seconds": time.perf_counter() - started, **summary}


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
    half = scipy.stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "batches": len(values)}


def _cell(interval: dict | None) -> str:
    if interval is None:
        return "-"
    return f"{interval['mean']:.2f}x [{interval['low']:.2f}, {interval['high']:.2f}]"


def markdown(results: list[dict]) -> str:
    """Three tables, each mean [95% interval] over batches: each paper's planner over that
    paper's own baseline; every planner over megatron; every planner over the best baseline."""
    out = ["Each paper's planner over the baseline that paper measured against, in the paper's "
           "setting (simulated):\n",
           "| scenario | scheme | planner | paper's baseline | speedup | auto over the same baseline |",
           "|---|---|---|---|---|---|"]
    for r in results:
        base = paper_baseline(r["paper"])
        mine = r["planners"].get(r["paper"], {})
        auto = r["planners"].get("auto", {})
        scheme = r["fixed_scheme"] or f"searched ({mine.get('scheme', '-')})"
        out.append(f"| {r['scenario']} | {scheme} | {r['paper']} | {base} | "
                   f"{_cell(mine.get('intervals', {}).get('vs_paper_baseline'))} | "
                   f"{_cell(auto.get('intervals', {}).get('vs_paper_baseline'))} |")
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
    parser.add_argument("--only", help="run scenarios whose name contains this text")
    args = parser.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or args.only in s[0]]
    results = []
    for spec in chosen:
        print(f"{spec[0]} ...", file=sys.stderr, flush=True)
        results.append(run_scenario(spec, args.batches, args.seed))
    meta = {"command": "python benchmarks/compare_suite.py " + " ".join(argv or sys.argv[1:]),
            "simulated": True, "python": platform.python_version(), "machine": platform.machine()}
    stem = "compare_suite" if not args.only else f"compare_suite_{args.only}"
    write_atomic(RESULTS / f"{stem}.json", json.dumps({"meta": meta, "results": results}, indent=1))
    write_atomic(RESULTS / f"{stem}.md", markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
