"""What auto's preselection costs in plan quality and saves in planning time, written to
benchmarks/results/auto_preselect.json.

    python benchmarks/bench_auto_preselect.py                          # every case below
    python benchmarks/bench_auto_preselect.py --workloads lmsys --gpus 1024 --seeds 0
    nice -n 10 python benchmarks/bench_auto_preselect.py --timeout 600

Each case is one global batch of 32,768 sequences (seeds 0-3: `--seed`) planned by auto twice,
each in its own process (a fresh interpreter, as bench_planning_scale.py does): once with the
full search (`preselect_above` above the batch, every candidate at full size) and once with
auto's defaults (above `preselect_above` sequences: every candidate ranked on the proxy, the
best `preselect` of them at full size). Per case it records both ways' chosen planner, simulated
step time (auto's own simulation of the chosen plan) and their ratio (preselected over full, 1.0
when the pick is the same), and the CPU seconds of the planner call (one thread; the batch's
sampling and the cost model are outside). Workloads:

  lmsys       issue 16's setting: `lengthwise plan --planner auto --profile lmsys --model qwen2.5-7b
              --pp 4 --dp GPUS/4 --context-length 8192 --overlong truncate --batch-size 32768`
  long-tail   the same with `--profile chunkflow-eval --context-length 131072` (a few sequences
              of 32K-128K tokens among short ones: the proxy must keep the longest, which only
              the splitting planners can place)
  lmsys-no-hydraulis  lmsys with every candidate but hydraulis: a close call on the proxy
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SEQUENCES = 32768
WORKLOADS = {
    "lmsys": ["--profile", "lmsys", "--context-length", "8192"],
    "long-tail": ["--profile", "chunkflow-eval", "--context-length", "131072"],
    "lmsys-no-hydraulis": ["--profile", "lmsys", "--context-length", "8192"],
}
CANDIDATES = {"lmsys-no-hydraulis": "every planner but hydraulis"}
"""Workloads that restrict auto's candidates (hydraulis wins the others by 10% or more, so
without it the proxy must separate infinipipe and slimpack, within 0.1% of each other)."""
FULL = {"preselect_above": 10**9}
"""auto's options for the full search: no batch is above this."""


def plan_args(workload: str, gpus: int, seed: int) -> list[str]:
    return ["plan", "--planner", "auto", *WORKLOADS[workload], "--model", "qwen2.5-7b", "--pp", "4",
            "--dp", str(gpus // 4), "--overlong", "truncate", "--batch-size", str(SEQUENCES),
            "--seed", str(seed)]


def plan_hash(plan) -> str:
    """sha256 of the plan's JSON without its timings and auto's per-candidate figures."""
    d = plan.to_dict()
    d["metrics"] = {k: v for k, v in d["metrics"].items() if k not in ("planning_ms", "auto", "auto_proxy")}
    d["options"] = {k: v for k, v in d["options"].items() if k not in FULL}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def run_one(workload: str, gpus: int, seed: int, mode: str) -> dict:
    """Plan one case in this process, `mode` full or preselect; returns its half-row."""
    from lengthwise.cli import build_parser
    from lengthwise.commands.plan import build_request
    from lengthwise.planners import get_planner

    request = build_request(build_parser("plan").parse_args(plan_args(workload, gpus, seed)))
    if workload in CANDIDATES:
        from lengthwise.planners.auto import default_candidates

        request.options = {**request.options,
                           "candidates": [n for n in default_candidates() if n != "hydraulis"]}
    if mode == "full":
        request.options = {**request.options, **FULL}
    started, cpu_started = time.perf_counter(), time.process_time()
    plan = get_planner("auto")(request)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    chosen = plan.metrics["chosen_planner"]
    figures = plan.metrics["auto"]
    row = {"chosen": chosen, "step_time_s": figures[chosen]["step_time_s"], "cpu_s": round(cpu, 3),
           "wall_s": round(wall, 3), "plan_hash": plan_hash(plan),
           "full_size_step_time_s": {n: v["step_time_s"] for n, v in figures.items() if "step_time_s" in v}}
    if "auto_proxy" in plan.metrics:
        row["proxy"] = {**plan.metrics["auto_proxy"],
                        "full_size": [n for n in plan.metrics["auto_proxy"]["order"] if figures[n]["full_size"]],
                        "cpu_s": round(sum(v["proxy"]["elapsed_ms"] for v in figures.values()) / 1e3, 3),
                        "step_time_s": {n: v["proxy"].get("step_time_s") for n, v in figures.items()}}
    return row


def run_child(workload: str, gpus: int, seed: int, mode: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--one", workload, str(gpus), str(seed), mode]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_env() -> dict:
    """The children import this checkout's package and use one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def case_row(workload: str, gpus: int, seed: int, timeout: float) -> dict:
    full = run_child(workload, gpus, seed, "full", timeout)
    pre = run_child(workload, gpus, seed, "preselect", timeout)
    row = {"workload": workload, "gpus": gpus, "dp": gpus // 4, "sequences": SEQUENCES, "seed": seed,
           "full": full, "preselect": pre}
    if "error" not in full and "error" not in pre:
        ranked = sorted(full["full_size_step_time_s"], key=full["full_size_step_time_s"].get)
        row.update(same_pick=pre["chosen"] == full["chosen"],
                   step_time_ratio=pre["step_time_s"] / full["step_time_s"],
                   pick_rank_in_full_search=ranked.index(pre["chosen"]) if pre["chosen"] in ranked else None,
                   cpu_speedup=full["cpu_s"] / pre["cpu_s"] if pre["cpu_s"] else None)
    return row


def summary(rows: list[dict]) -> dict:
    out = {}
    for workload in sorted({r["workload"] for r in rows}):
        for gpus in sorted({r["gpus"] for r in rows if r["workload"] == workload}):
            done = [r for r in rows if r["workload"] == workload and r["gpus"] == gpus and "step_time_ratio" in r]
            if not done:
                continue
            out[f"{workload} {gpus} GPUs"] = {
                "cases": len(done), "picks_differ": sum(not r["same_pick"] for r in done),
                "worst_step_time_ratio": max(r["step_time_ratio"] for r in done),
                "full_cpu_s_max": max(r["full"]["cpu_s"] for r in done),
                "preselect_cpu_s_max": max(r["preselect"]["cpu_s"] for r in done),
                "full_cpu_s_mean": sum(r["full"]["cpu_s"] for r in done) / len(done),
                "preselect_cpu_s_mean": sum(r["preselect"]["cpu_s"] for r in done) / len(done)}
    return out


def machine() -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--gpus", default="1024,4096", help="comma-separated GPU counts (pp 4, dp GPUS/4)")
    parser.add_argument("--seeds", default="0,1,2,3", help="comma-separated batch seeds")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one planning is killed")
    parser.add_argument("--out", default=str(RESULTS / "auto_preselect.json"))
    parser.add_argument("--one", nargs=4, metavar=("WORKLOAD", "GPUS", "SEED", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), int(args.one[2]), args.one[3])))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from lengthwise.files import write_atomic
    from lengthwise.planners.options import option_defaults

    defaults = {k: v for k, v in option_defaults("auto").items()
                if k in ("preselect_above", "preselect", "preselect_margin", "proxy_factor", "proxy_sequences",
                         "min_proxy_pipelines")}
    settings = {"commands": {w: "lengthwise " + " ".join(plan_args(w, 4, 0)).replace("--dp 1", "--dp GPUS/4")
                             .replace("--seed 0", "--seed SEED") for w in WORKLOADS},
                "candidates": CANDIDATES, "full_search_options": FULL, "preselect_options": defaults, "timeout_s": args.timeout}
    rows: list[dict] = []
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            parser.error(f"unknown workload {workload!r}: use {', '.join(WORKLOADS)}")
        for gpus in map(int, args.gpus.split(",")):
            for seed in map(int, args.seeds.split(",")):
                row = case_row(workload, gpus, seed, args.timeout)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("full", "preselect")}
                                 | {"chosen": (row["full"].get("chosen"), row["preselect"].get("chosen")),
                                    "cpu_s": (row["full"].get("cpu_s"), row["preselect"].get("cpu_s"))}),
                      flush=True)
                write_atomic(Path(args.out), json.dumps({"benchmark": "auto_preselect", "setting": settings,
                                                         "machine": machine(), "summary": summary(rows),
                                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
