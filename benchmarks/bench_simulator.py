"""Speed of the step simulator on a large synthetic step.

    python benchmarks/bench_simulator.py                       # 128 pipelines x 8 stages x 32 chunks
    python benchmarks/bench_simulator.py --pipelines 16 --repeat 3

Builds one StepPlan (qwen2.5-7b on an H100 cluster, state-aware 1F1B with K=2, random packed
chunks plus one sequence split into 4 slices per pipeline), simulates it `--repeat` times and
writes best and median wall and CPU seconds of each phase to
benchmarks/results/simulator_speed.json: the whole `simulate_plan`, the cost tables alone
(cost-model calls), and the simulator alone (DAG, timing, memory replay, metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from lengthwise.cost import CostModel
from lengthwise.plan.ir import Chunk, PipelinePlan, Segment, StepPlan
from lengthwise.files import write_atomic
from lengthwise.plan.schedules import make_schedule
from lengthwise.sim import simulate_inputs, simulate_plan
from lengthwise.sim.inputs import plan_inputs
from lengthwise.specs import MODEL_PRESETS, cluster_preset


def synthetic_plan(pipelines: int, stages: int, chunks: int, seed: int = 0) -> StepPlan:
    """Packed chunks of random short sequences, plus one sequence split over 4 chunks per pipeline."""
    rng = random.Random(seed)
    lengths, pipes = [], []
    for _ in range(pipelines):
        rows = []
        long_id, long_len = len(lengths), 4 * 4096
        lengths.append(long_len)
        rows += [Chunk((Segment(long_id, i * 4096, (i + 1) * 4096),)) for i in range(4)]
        for _ in range(chunks - 4):
            segs = []
            for _ in range(rng.randint(1, 6)):
                n = rng.randint(64, 1400)
                segs.append(Segment(len(lengths), 0, n))
                lengths.append(n)
            rows.append(Chunk(tuple(segs)))
        rng.shuffle(rows)
        rows.sort(key=lambda c: c.segments[0].seq_id == long_id and c.segments[0].start)  # slices in order
        pipes.append(PipelinePlan(chunks=rows, stages=make_schedule("state-aware-1f1b", rows, stages, k=2),
                                  schedule="state-aware-1f1b"))
    model = MODEL_PRESETS["qwen2.5-7b"]
    cluster = cluster_preset("h100", pipelines * stages)
    return StepPlan(planner="synthetic", model=model, cluster=cluster, lengths=lengths, pipelines=pipes)


def timed(fn, repeat: int) -> tuple[dict, object]:
    """Best and median wall and CPU seconds of `repeat` calls (CPU time is steadier when other
    processes share the cores)."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"wall_best": min(walls), "wall_median": statistics.median(walls),
            "cpu_best": min(cpus), "cpu_median": statistics.median(cpus)}, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", type=int, default=128)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/simulator_speed.json")
    args = ap.parse_args()
    plan = synthetic_plan(args.pipelines, args.stages, args.chunks)
    cm = CostModel(model=plan.model, cluster=plan.cluster)
    cost_s, inputs = timed(lambda: plan_inputs(plan, cm), args.repeat)
    engine_s, _ = timed(lambda: simulate_inputs(inputs, time_unit="s", memory_unit="bytes"), args.repeat)
    total_s, result = timed(lambda: simulate_plan(plan, cm), args.repeat)
    report = {
        "command": f"python benchmarks/bench_simulator.py --pipelines {args.pipelines} --stages {args.stages} "
                   f"--chunks {args.chunks} --repeat {args.repeat}",
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "pipelines": args.pipelines, "stages": args.stages, "chunks_per_pipeline": args.chunks,
        "tasks": len(result.timeline.start),
        "load_average_1min": os.getloadavg()[0], "cpu_count": os.cpu_count(),
        "simulate_plan_s": total_s,
        "cost_tables_s": cost_s,
        "dag_timing_and_memory_s": engine_s,
        "step_time_s": result.step_time_s, "bubble_ratio": result.bubble_ratio,
    }
    write_atomic(Path(args.out), json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
