"""What splitting costs: one sequence cut into n slices, all kept (K = n), against unsplit.

    python benchmarks/bench_split_overhead.py                  # L = 512 ... 4096; n = 2, 4, 8
    python benchmarks/bench_split_overhead.py --lengths 512 --repeat 3 --out /tmp/split.json
    python benchmarks/bench_split_overhead.py --backend reference --out /tmp/split_reference.json

One stdlib document cut to L tokens (byte tokens, tiny model, float32, CPU, one thread) is
planned by ChunkFlow with chunk_size = L / n and k = n: forwards of the n slices in order,
backwards in reverse, each later slice attending to the K/V of the earlier ones, no re-forward
(chunkflow §4.2 with K = N). n = 1 is the unsplit sequence. Each (L, n) runs the executor's
forward and backward `--repeat` times, the n values taking turns so the machine's load hits
them alike; the median wall and CPU seconds and their ratio to n = 1 are reported, against the
target of at most 1.1x (CPU time is the steadier on a shared machine). The peak bytes saved
for backward (one extra, untimed pass) are the same as unsplit: with K = n every activation
is kept, and the K/V context a slice reads shares storage with what the earlier slice's graph
already saved.

Attention backend: `cpu-flash` by default, what `auto` runs on a CPU. It does about the
attention work causality needs whether the sequence is cut or not (an unsplit sequence is one
causal flash call; a slice with context is one call over its context and one causal call over
its own keys, merged by log-sum-exp).
`--backend reference` scores every query against every key of the row: unsplit that is twice
the needed work, so the cut sequence looks cheaper than it is (ratios under 1 at 2K-4K).

Measured (results/split_overhead.json, cpu-flash, 1 thread, load about 1 on 2 cores), CPU time
split / unsplit for n = 2, 4, 8: L = 4096: 0.97, 0.99, 1.08; 2048: 1.00, 1.19, 1.15; 1024: 1.10,
1.20, 1.44; 512: 0.99, 1.16, 1.70. Within 1.1x from 1K-token slices; below, each slice pays
about 5-7 ms of fixed CPU cost on the tiny model (per-operator overhead over 4 layers forward
and backward; weight-gradient products over few rows, each accumulated into the full
gradient). At hidden 1024 (`--lengths 2048 --hidden 1024 --repeat 3`,
results/split_overhead_h1024.json): 1.04, 1.10, 1.16. With the reference backend
(results/split_overhead_reference.json): 0.55-0.87 from 256-token slices up, because its
unsplit row spends half its attention on masked scores (its unsplit L = 4096 takes 2.5 s of
CPU against cpu-flash's 0.9 s).

`--breakdown` adds, per L, the self CPU time of the operators that differ most between n = 1
and the largest n (one profiled pass each, torch.profiler), which says where the overhead of
short slices goes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from lengthwise.cost import CostModel
from lengthwise.plan.ir import FORWARD_NOGRAD
from lengthwise.files import write_atomic
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.attention import BACKENDS
from lengthwise.runtime.execute import run_step
from lengthwise.runtime.memory import SavedTensorMeter
from lengthwise.runtime.model import build_model
from lengthwise.specs import ModelSpec, ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.corpus import load_corpus


def document(length: int) -> torch.Tensor:
    """The first stdlib document of at least `length` tokens, cut to `length`."""
    corpus = load_corpus("stdlib")
    index = next(i for i, n in enumerate(corpus.lengths) if n >= length)
    return torch.as_tensor(corpus.documents[index][:length], dtype=torch.long)


def bench_model(hidden: int | None) -> ModelSpec:
    """The tiny model, or its 4 layers at another width (head dim 64, 2 query heads per K/V
    head, SwiGLU width 2.6875 x hidden: Llama's proportions)."""
    spec = model_preset("tiny")
    if hidden is None:
        return spec
    return replace(spec, name=f"tiny-h{hidden}", hidden=hidden, num_heads=hidden // 64,
                   num_kv_heads=max(1, hidden // 128), head_dim=64, ffn=int(hidden * 2.6875))


def split_plan(length: int, n: int, spec: ModelSpec | None = None):
    spec, cluster = spec or model_preset("tiny"), cluster_preset("cpu", 1)
    plan = get_planner("chunkflow")(PlanRequest(
        lengths=[length], model=spec, cluster=cluster, scheme=ParallelScheme(),
        cost=CostModel(model=spec, cluster=cluster), context_length=length,
        options={"chunk_size": length // n, "k": n}))
    chunks, actions = plan.pipelines[0].chunks, plan.pipelines[0].stages[0]
    assert len(chunks) == n and not any(a.kind == FORWARD_NOGRAD for a in actions), actions
    return plan


def timed(model, plan, token_ids, backend: str) -> tuple[float, float, float]:
    """(loss, wall s, cpu s) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.process_time()
    loss = run_step(model, plan, token_ids, backend=backend)
    return float(loss), time.perf_counter() - wall, time.process_time() - cpu


def saved_peak(model, plan, token_ids, backend: str) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        run_step(model, plan, token_ids, backend=backend)
    return meter.peak_bytes


def op_times(model, plan, token_ids, backend: str) -> dict[str, float]:
    """Self CPU milliseconds per operator of one profiled forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(model, plan, token_ids, backend=backend)
    return {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}


def breakdown(model, plans: dict, token_ids, backend: str, top: int = 8) -> dict:
    """The operators whose self CPU time differs most between unsplit and the most slices."""
    most = max(plans)
    base, split = (op_times(model, plans[n], token_ids, backend) for n in (1, most))
    diff = {op: split.get(op, 0.0) - base.get(op, 0.0) for op in set(base) | set(split)}
    ops = sorted(diff, key=lambda op: -abs(diff[op]))[:top]
    return {"slices": most, "total_ms": {"1": sum(base.values()), str(most): sum(split.values())},
            "ops_ms": {op: {"1": round(base.get(op, 0.0), 2), str(most): round(split.get(op, 0.0), 2),
                            "difference": round(diff[op], 2)} for op in ops}}


def measure_length(length: int, splits: list[int], args) -> dict:
    spec = bench_model(args.hidden)
    model = build_model(spec, seed=args.seed)
    token_ids = [document(length)]
    plans = {n: split_plan(length, n, spec) for n in [1, *splits]}
    runs = {n: [] for n in plans}
    for repeat in range(args.warmup + args.repeat):
        for n, plan in plans.items():
            loss, wall, cpu = timed(model, plan, token_ids, args.backend)
            if repeat >= args.warmup:
                runs[n].append((loss, wall, cpu))
        print(f"  L={length} repeat {repeat}: " + "  ".join(
            f"n={n} {runs[n][-1][2]:.3f}s" for n in plans if runs[n]), file=sys.stderr)
    peaks = {n: saved_peak(model, p, token_ids, args.backend) for n, p in plans.items()}
    result = summarise(length, runs, peaks)
    if args.breakdown:
        result["breakdown"] = breakdown(model, plans, token_ids, args.backend)
    return result


def summarise(length: int, runs: dict, peaks: dict) -> dict:
    base_wall = statistics.median(r[1] for r in runs[1])
    base_cpu = statistics.median(r[2] for r in runs[1])
    per = {}
    for n, rows in runs.items():
        wall, cpu = statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)
        per[str(n)] = {"slice_tokens": length // n, "median_wall_s": wall, "median_cpu_s": cpu,
                       "ratio_wall": wall / base_wall, "ratio_cpu": cpu / base_cpu,
                       "within_1_1x_cpu": cpu / base_cpu <= 1.1,
                       "saved_for_backward_peak_bytes": peaks[n], "loss": rows[0][0],
                       "loss_rel_diff_vs_unsplit": abs(rows[0][0] - runs[1][0][0]) / runs[1][0][0]}
    return {"length": length, "slices": per}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", choices=[b for b in BACKENDS if b != "varlen"], default="cpu-flash")
    ap.add_argument("--breakdown", action="store_true", help="profile where the overhead goes")
    ap.add_argument("--hidden", type=int, help="widen the tiny model's 4 layers to this hidden size")
    ap.add_argument("--out", default="benchmarks/results/split_overhead.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    splits = [int(n) for n in args.splits.split(",")]
    results = [measure_length(int(length), splits, args) for length in args.lengths.split(",")]
    report = {
        "command": "python benchmarks/bench_split_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "threads": args.threads, "load_average_1min": [load_before, os.getloadavg()[0]],
        "model": asdict(bench_model(args.hidden)), "dtype": "float32", "backend": args.backend, "seed": args.seed,
        "target": "split forward+backward at most 1.1x unsplit", "warmup": args.warmup,
        "repeat": args.repeat, "results": results,
    }
    write_atomic(Path(args.out), json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
