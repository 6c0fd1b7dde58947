"""Simulated comparisons of every planner on the papers' settings; the README's planner table.

    python benchmarks/compare_suite.py                      # all scenarios, writes benchmarks/results/compare_suite.{json,md}
    python benchmarks/compare_suite.py --only skrull --batches 2

Each scenario samples global batches from a published length profile, plans them with every
planner (each at its best scheme from `lengthwise compare`'s search unless the scenario fixes the
paper's scheme), and simulates the plans with the analytic cost model of the cluster preset. All
figures are simulated, never measured on GPUs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from lengthwise.plan.ir import write_atomic
from lengthwise.report import CompareSetup, all_planners, run_compare, summarise
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.source import profile_source
from lengthwise.workloads.sampler import GlobalBatchSampler

RESULTS = Path(__file__).parent / "results"

# name, paper, profile, model, cluster, gpus, context, batch (sequences or tokens), fixed scheme
SCENARIOS = [
    ("chunkflow-32k", "chunkflow", "chunkflow-eval", "qwen2.5-7b", "h100", 32, 32768, {"batch_size": 256}, None),
    ("chunkflow-256k", "chunkflow", "chunkflow-eval", "qwen2.5-7b", "h100", 32, 262144, {"batch_size": 256}, None),
    ("skrull-lmsys-0.5b", "skrull", "lmsys-skrull", "qwen2.5-0.5b", "h100", 32, 131072, {"batch_size": 64},
     ParallelScheme(dp=4, cp=8, zero=2)),
    ("skrull-chatqa2-0.5b", "skrull", "chatqa2", "qwen2.5-0.5b", "h100", 32, 131072, {"batch_size": 64},
     ParallelScheme(dp=4, cp=8, zero=2)),
    ("skrull-chatqa2-7b", "skrull", "chatqa2", "qwen2.5-7b", "h100", 32, 131072, {"batch_size": 64},
     ParallelScheme(dp=4, cp=8, zero=2)),
    ("hydraulis-cc-7b-16", "hydraulis", "commoncrawl", "llama2-7b", "a800", 16, 32768, {"token_budget": 200_000}, None),
    ("hydraulis-github-13b-32", "hydraulis", "github", "llama2-13b", "a800", 32, 32768, {"token_budget": 200_000}, None),
    ("infinipipe-cc-7b-32", "infinipipe", "commoncrawl", "llama2-7b", "h100", 32, 65536, {"batch_size": 512}, None),
    ("infinipipe-github-13b-32", "infinipipe", "github", "llama2-13b", "h100", 32, 131072, {"batch_size": 512}, None),
    ("slimpack-github-7b-128", "slimpack", "github", "llama2-7b", "h100", 128, 131072, {"batch_size": 512}, None),
    ("slimpack-cc-70b-256", "slimpack", "commoncrawl", "llama-70b", "h100", 256, 65536, {"batch_size": 512}, None),
]


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
    summary = summarise(run_compare(setup))
    return {"scenario": name, "paper": paper, "profile": profile, "model": model, "cluster": cluster, "gpus": gpus,
            "context_length": context, "batch": size, "fixed_scheme": str(scheme) if scheme else None,
            "seconds": time.perf_counter() - started, **summary}


def markdown(results: list[dict]) -> str:
    lines = ["| scenario | best baseline (s) | " + " | ".join(all_planners()) + " | auto chose |",
             "|---|---|" + "---|" * len(all_planners()) + "---|"]
    for r in results:
        cells = []
        for p in all_planners():
            row = r["planners"].get(p, {})
            speed = row.get("speedup_vs_best_baseline")
            cells.append("-" if speed is None else f"{speed:.2f}x" + ("" if row.get("fits") else " (OOM)"))
        chosen = r["planners"].get("auto", {}).get("chosen", {})
        base = r["best_baseline_step_time_s"]
        lines.append(f"| {r['scenario']} | {base:.2f} | " if base else f"| {r['scenario']} | - | ")
        lines[-1] += " | ".join(cells) + " | " + ", ".join(f"{k} {v}" for k, v in chosen.items()) + " |"
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3)
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
