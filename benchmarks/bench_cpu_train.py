"""Training throughput on CPU of padding, packing and ChunkFlow plans of the same global batches.

    python benchmarks/bench_cpu_train.py                                  # tiny model, stdlib, 512 truncate + 2048 drop
    python benchmarks/bench_cpu_train.py --settings 512:truncate --steps 3 --out /tmp/cpu_train.json

For each setting (context length : overlong policy) the stdlib corpus (byte tokens) is cut into
`--warmup` + `--steps` global batches of `--batch-size` documents, the same batches for every
planner. Each planner trains its own tiny model and AdamW from the same seed, exactly as
`lengthwise train` does (runtime/train/step.forward_backward, clipping, AdamW), and the planners
take turns batch by batch, so a change in the machine's load hits them alike. Planning time is
recorded but not in the step time (training plans a step ahead in a worker thread).

Padding plans compute their pads (runtime/train/step.py: each sequence of a padded micro-batch
is one row of pad_to / k tokens), so padding costs what the removed fraction predicts:
`expected_speedup_over_padding` = padding's row tokens / the planner's row tokens over the
measured steps, `measured_speedup_over_padding` = the planner's tokens/s / padding's. tokens/s
counts real tokens only; both wall-clock and CPU-time rates are reported, CPU time being the
steadier on a shared machine. Torch runs `--threads` threads (default 1: an oversubscribed
2-core machine runs 2 threads several times slower than 1).

512:truncate is `lengthwise train`'s default data (most stdlib files are longer than 512 bytes,
so nearly every row is full and padding removes little); 2048:drop keeps only the files of at
most 2048 tokens, a long-tail set where padding to the batch's longest wastes about half.

Measured (results/cpu_train.json, cpu-flash attention, 1 thread, 4 steps of 16 documents after
1 warm-up, load about 2 on 2 cores), CPU-time tokens/s and speedup over padding (expected from
the padding removed / measured): 512:truncate, padding fraction 3.3%: padding 7,644, packing
8,236 (1.03 / 1.08), chunkflow 7,947 (1.03 / 1.04); 2048:drop, padding fraction 50.8%: padding
3,703, packing 8,841 (2.03 / 2.39), chunkflow 8,396 (2.03 / 2.27). The packed plans gain more
than the padding removed because a pad also costs attention: a padded row's causal attention
grows with the square of its width. `--backend reference` (every query of a row scored against
every key; results/cpu_train_reference.json) is the slower yardstick: see the README.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from lengthwise.cost import CostModel
from lengthwise.files import write_atomic
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.model import build_model
from lengthwise.runtime.train.loop import make_optimizer
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.step import forward_backward
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import corpus_source


def batches(context: int, overlong: str, batch_size: int, count: int, seed: int):
    """(lengths, token ids) of `count` global batches of the stdlib corpus."""
    source = corpus_source("stdlib", None, context, overlong)
    sampler = GlobalBatchSampler(source, seed=seed, batch_size=batch_size)
    out = []
    for _ in range(count):
        batch = sampler.next_batch()
        ids = [torch.as_tensor(source.tokens(i), dtype=torch.long) for i in batch.seq_ids]
        out.append((list(batch.lengths), ids))
    return out


def plan(planner: str, lengths: list[int], context: int, seed: int):
    spec, cluster = model_preset("tiny"), cluster_preset("cpu", 1)
    cost = CostModel(model=spec, cluster=cluster)
    started = time.perf_counter()
    result = get_planner(planner)(PlanRequest(lengths=lengths, model=spec, cluster=cluster,
                                              scheme=ParallelScheme(), cost=cost,
                                              context_length=context, seed=seed))
    validate_plan(result, cost)
    return result, (time.perf_counter() - started) * 1e3


def timed_step(model, optimizer, step_plan, token_ids, backend: str) -> tuple[float, float, float]:
    """(loss, wall s, cpu s) of one training step."""
    wall, cpu = time.perf_counter(), time.process_time()
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, step_plan, token_ids, backend=backend)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss), time.perf_counter() - wall, time.process_time() - cpu


def run_setting(planners: list[str], context: int, overlong: str, args) -> dict:
    data = batches(context, overlong, args.batch_size, args.warmup + args.steps, args.seed)
    config = TrainConfig()
    models = {p: build_model(model_preset("tiny"), seed=args.seed) for p in planners}
    optimizers = {p: make_optimizer(models[p], config) for p in planners}
    rows = {p: [] for p in planners}
    for index, (lengths, token_ids) in enumerate(data):
        for p in planners:
            step_plan, planning_ms = plan(p, lengths, context, args.seed + index)
            loss, wall, cpu = timed_step(models[p], optimizers[p], step_plan, token_ids, args.backend)
            if index >= args.warmup:
                rows[p].append({"loss": loss, "wall_s": wall, "cpu_s": cpu, "planning_ms": planning_ms,
                                "tokens": sum(lengths),
                                "row_tokens": sum(c.row_tokens for q in step_plan.pipelines for c in q.chunks),
                                "chunks": sum(len(q.chunks) for q in step_plan.pipelines)})
            print(f"  {context}:{overlong} batch {index} {p:>9}: loss {loss:.4f}  {wall:6.2f} s wall "
                  f"{cpu:6.2f} s cpu", file=sys.stderr)
    return summarise(rows, context, overlong, data, args)


def summarise(rows: dict, context: int, overlong: str, data, args) -> dict:
    per = {}
    for p, steps in rows.items():
        tokens = sum(r["tokens"] for r in steps)
        row = sum(r["row_tokens"] for r in steps)
        per[p] = {"tokens_per_s_wall": tokens / sum(r["wall_s"] for r in steps),
                  "tokens_per_s_cpu": tokens / sum(r["cpu_s"] for r in steps),
                  "median_step_wall_s": statistics.median(r["wall_s"] for r in steps),
                  "padding_fraction": (row - tokens) / row, "row_tokens": row, "tokens": tokens,
                  "chunks_per_step": statistics.mean(r["chunks"] for r in steps),
                  "planning_ms_median": statistics.median(r["planning_ms"] for r in steps),
                  "losses": [r["loss"] for r in steps]}
    if "padding" in per:
        base = per["padding"]
        for p, m in per.items():
            m["expected_speedup_over_padding"] = base["row_tokens"] / m["row_tokens"]
            m["measured_speedup_over_padding_cpu"] = m["tokens_per_s_cpu"] / base["tokens_per_s_cpu"]
            m["measured_speedup_over_padding_wall"] = m["tokens_per_s_wall"] / base["tokens_per_s_wall"]
    lengths = [n for lengths, _ in data[args.warmup:] for n in lengths]
    return {"context_length": context, "overlong": overlong, "batch_size": args.batch_size,
            "mean_length": statistics.mean(lengths), "longest": max(lengths), "planners": per}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--planners", default="padding,packing,chunkflow")
    ap.add_argument("--settings", default="512:truncate,2048:drop", help="CONTEXT:OVERLONG, comma-separated")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", choices=("cpu-flash", "reference"), default="cpu-flash",
                    help="attention backend (default cpu-flash, what auto runs on a CPU)")
    ap.add_argument("--out", default="benchmarks/results/cpu_train.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    planners = args.planners.split(",")
    load_before = os.getloadavg()[0]
    settings = [run_setting(planners, int(c), o, args)
                for c, o in (s.split(":") for s in args.settings.split(","))]
    report = {
        "command": "python benchmarks/bench_cpu_train.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "threads": args.threads, "load_average_1min": [load_before, os.getloadavg()[0]],
        "model": "tiny", "data": "stdlib", "dtype": "float32", "backend": args.backend, "seed": args.seed,
        "warmup_steps": args.warmup, "measured_steps": args.steps, "settings": settings,
    }
    write_atomic(Path(args.out), json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
