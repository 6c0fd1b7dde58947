"""FSDP2 and tensor parallelism against the replicated executor, same batch, same world size.

    python benchmarks/bench_parallel.py                  # 4 gloo processes on this machine
    python benchmarks/bench_parallel.py --steps 5

On 4 local processes (gloo, CPU, float32, a 4-layer model of width 256), one global batch is
planned with chunkflow at dp 4, and also at dp 2 x tp 2, and run as:

- dp4-replicated: whole parameters on every rank, one bucketed all-reduce per step
  (`parallel/dp.GradReducer`), the executor before FSDP2;
- dp4-fsdp-zero1: FSDP2, parameters gathered once per step, gradients reduce-scattered;
- dp4-fsdp-zero3: FSDP2 resharding after every forward and backward of every chunk (when
  the replicas' action sequences match; else gathered once per step, reported per rank);
- dp2-tp2-fsdp: tensor parallelism over 2 ranks inside FSDP2 over 2.

Each runs `--steps` steps after one warm-up step (timed from a barrier to the slowest rank's
end); the median step time and its ratio to dp4-replicated go to
benchmarks/results/parallel_overhead.json. Timings on a shared CPU are noisy: one run, as
measured, no claim beyond it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lengthwise.cost import CostModel
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.parallel.step import run_rank_step
from lengthwise.runtime.parallel.build import ParallelOptions, build_rank_model
from lengthwise.runtime.verify import random_tokens
from lengthwise.specs import ModelSpec, ParallelScheme, cluster_preset

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import write_results  # noqa: E402

SPEC = ModelSpec(name="bench-256", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, head_dim=32,
                 ffn=688, vocab=1024)
LENGTHS = [512, 300, 260, 200, 180, 150, 120, 100, 90, 64, 40, 24]
RUNS = {
    "dp4-replicated": ({"dp": 4, "zero": 0}, "replicate"),
    "dp4-fsdp-zero1": ({"dp": 4, "zero": 1}, "fsdp"),
    "dp4-fsdp-zero3": ({"dp": 4, "zero": 3}, "fsdp"),
    "dp2-tp2-fsdp": ({"dp": 2, "tp": 2, "zero": 1}, "fsdp"),
}


def make_plan(degrees: dict):
    scheme = ParallelScheme(**degrees)
    cluster = cluster_preset("cpu", scheme.num_gpus)
    request = PlanRequest(lengths=LENGTHS, model=SPEC, cluster=cluster, scheme=scheme,
                          cost=CostModel(model=SPEC, cluster=cluster), context_length=1024, seed=0,
                          options={"chunk_size": 256, "k": 1})
    return get_planner("chunkflow")(request)


def worker(rank: int, steps: int) -> dict | None:
    out = {}
    for name, (degrees, data_parallel) in RUNS.items():
        mesh = Mesh.from_default_group(timeout_s=600)
        plan = make_plan(degrees)
        model = build_rank_model(plan, mesh, dtype=torch.float32, seed=0,
                                 options=ParallelOptions(data_parallel=data_parallel))
        tokens = random_tokens(plan.lengths, SPEC.vocab, 1)
        times, sharding = [], None
        for step in range(steps + 1):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            started = time.perf_counter()
            result = run_rank_step(model, plan, tokens, mesh=mesh, backend="reference")
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            sharding = result.sharding
            if step:
                times.append(float(elapsed))
        out[name] = {"median_step_s": statistics.median(times), "steps_s": times, "sharding_rank0": sharding,
                     "loss": result.loss}
    if rank != 0:
        return None
    base = out["dp4-replicated"]["median_step_s"]
    for entry in out.values():
        entry["ratio_to_replicated"] = entry["median_step_s"] / base
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "parallel_overhead.json"))
    args = parser.parse_args(argv)
    runs = spawn(worker, 4, args.steps, timeout_s=1200)
    payload = {"model": SPEC.to_dict(), "lengths": LENGTHS, "nproc": 4, "backend": "gloo", "dtype": "float32",
               "runs": runs}
    write_results(args.out, payload, "bench_parallel.py", sys.argv[1:] if argv is None else argv)
    for name, entry in runs.items():
        print(f"{name:16s} {entry['median_step_s']:.3f} s/step  x{entry['ratio_to_replicated']:.2f}  "
              f"({entry['sharding_rank0']})")


if __name__ == "__main__":
    main()
