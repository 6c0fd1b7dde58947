"""Full-size dry runs: ranks of real plans at the size they are planned for, executed on this
CPU under fake tensors and the fake process group, measured beside the simulator.

    python benchmarks/bench_dryrun.py                           # every scenario below
    python benchmarks/bench_dryrun.py --scenarios qwen7b-32-chunkflow,qwen7b-32-chunkflow-tp4-nosp

Each scenario plans one global batch sampled from the paper's length profile with
`lengthwise plan`'s own code, then runs `lengthwise dryrun`'s measurement for the first and
last stage of the pipeline holding the batch's longest sequence (TP rank 0, CP rank 0) and
writes every row, with the plan's shape and the command that ran it, into
benchmarks/results/dryrun.json, beside the rows of scenarios not run this time. The targets
(issue "Executor III"): simulated peak memory within 10% of measured on every rank, FLOPs
within 2%, communication bytes within 1%, and one rank in under 5 minutes here.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lengthwise.commands.dryrun import dryrun_rows
from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
from lengthwise.files import write_atomic
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.sim.rank import rank_places
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import profile_source

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    model: str
    cluster: str
    profile: str
    planner: str
    context_length: int
    batch_size: int
    scheme: dict
    options: dict = field(default_factory=dict)
    sequence_parallel: bool = True
    """Tensor parallelism with sequence parallelism (the executor's default); False runs and
    simulates it without (`lengthwise dryrun --no-sequence-parallel`, `CostModel.sequence_parallel`)."""


SCENARIOS = {
    # ChunkFlow's setting: Qwen2.5-7B on 32 GPUs at 32K context
    "qwen7b-32-chunkflow": Scenario(model="qwen2.5-7b", cluster="h100", profile="chunkflow-eval", planner="chunkflow",
                                    context_length=32768, batch_size=256, scheme={"dp": 4, "tp": 2, "pp": 4},
                                    options={"chunk_size": 8192, "k": 2}),
    # the same at tp 4 without sequence parallelism: whole activations on every TP rank
    "qwen7b-32-chunkflow-tp4-nosp": Scenario(model="qwen2.5-7b", cluster="h100", profile="chunkflow-eval",
                                             planner="chunkflow", context_length=32768, batch_size=256,
                                             scheme={"dp": 2, "tp": 4, "pp": 4}, options={"chunk_size": 8192, "k": 2},
                                             sequence_parallel=False),
    "qwen7b-32-packing": Scenario(model="qwen2.5-7b", cluster="h100", profile="chunkflow-eval", planner="packing",
                                  context_length=32768, batch_size=256, scheme={"dp": 4, "tp": 2, "pp": 4}),
    "qwen7b-32-infinipipe": Scenario(model="qwen2.5-7b", cluster="h100", profile="chunkflow-eval",
                                     planner="infinipipe", context_length=32768, batch_size=256,
                                     scheme={"dp": 4, "tp": 2, "pp": 4}),
    # SlimPack's and Hydraulis' large setting: LLaMA-2-70B on 256 GPUs at 128K context
    "llama70b-256-slimpack": Scenario(model="llama-70b", cluster="h100", profile="commoncrawl", planner="slimpack",
                                      context_length=131072, batch_size=512, scheme={"dp": 8, "tp": 8, "pp": 4}),
    "llama70b-256-hydraulis": Scenario(model="llama-70b", cluster="h100", profile="commoncrawl",
                                       planner="hydraulis", context_length=131072, batch_size=512,
                                       scheme={"dp": 8, "tp": 8, "pp": 4}),
    # Megatron-LM with full recomputation on the same setting: a 128K micro-batch per pipeline
    # (F0.r20 B0 on every stage), as a Megatron-LM user would run a context that does not fit
    # 1F1B without it; and at 32K context, recomputation forced, three micro-batches' checkpoints
    # in flight on the first stage (F0.r20 F1.r20 F2.r20 B0 B1 B2)
    "llama70b-megatron-fullrecompute": Scenario(model="llama-70b", cluster="h100", profile="commoncrawl",
                                                planner="megatron", context_length=131072, batch_size=512,
                                                scheme={"dp": 8, "tp": 8, "pp": 4}, options={"recompute": "full"}),
    "llama70b-megatron-fullrecompute-32k": Scenario(model="llama-70b", cluster="h100", profile="commoncrawl",
                                                    planner="megatron", context_length=32768, batch_size=512,
                                                    scheme={"dp": 8, "tp": 8, "pp": 4},
                                                    options={"recompute": "full"}),
    # InfiniPipe's adaptive checkpointing on the same setting: selective recomputation, F.rN with
    # N from 1 to 4 of a stage's 20 layers on the measured ranks
    "llama70b-256-infinipipe": Scenario(model="llama-70b", cluster="h100", profile="commoncrawl",
                                        planner="infinipipe", context_length=131072, batch_size=512,
                                        scheme={"dp": 8, "tp": 8, "pp": 4}),
    # Hydraulis' own setting: LLaMA-32B on 64 A800s at 32K context, a batch of ~200K tokens
    # (144 sequences: 196,113 tokens at seed 0); the scheme only sizes the cluster
    "llama32b-64-hydraulis": Scenario(model="llama-32b", cluster="a800", profile="commoncrawl", planner="hydraulis",
                                      context_length=32768, batch_size=144, scheme={"dp": 4, "tp": 8, "pp": 2}),
    # the first GPU run's setting (an H200 there, an 80 GB H100 here): Qwen2.5-1.5B packed into 32K rows on one
    # GPU, 64 sequences a step: the LM head's loss blocked (issue 26: peak <= 40 GiB, head <= 2 GiB)
    "qwen1.5b-32k-packing-1gpu": Scenario(model="qwen2.5-1.5b", cluster="h100", profile="chunkflow-eval",
                                          planner="packing", context_length=32768, batch_size=64,
                                          scheme={"dp": 1}),
    # the same batch and row with every layer's MLP block recomputed (`--recompute mlp`: F0.m28), the
    # SwiGLU's tensors dropped for a rerun of gate and up in backward (issue 26: peak <= 40 GiB)
    "qwen1.5b-32k-packing-mlprecompute": Scenario(model="qwen2.5-1.5b", cluster="h100", profile="chunkflow-eval",
                                                  planner="packing", context_length=32768, batch_size=64,
                                                  scheme={"dp": 1}, options={"recompute": "mlp"}),
}


def make_plan(s: Scenario, seed: int) -> StepPlan:
    spec = model_preset(s.model)
    scheme = ParallelScheme(**s.scheme)
    cluster = cluster_preset(s.cluster, scheme.num_gpus)
    source = profile_source(s.profile, s.context_length, "drop")
    lengths = GlobalBatchSampler(source, batch_size=s.batch_size, seed=seed).next_batch().lengths
    return get_planner(s.planner)(PlanRequest(lengths=list(lengths), model=spec, cluster=cluster, scheme=scheme,
                                              cost=CostModel(model=spec, cluster=cluster,
                                                             sequence_parallel=s.sequence_parallel),
                                              context_length=s.context_length, seed=seed, options=dict(s.options)))


def default_ranks(plan: StepPlan) -> list[int]:
    """First and last stage (CP rank 0, TP rank 0) of the pipeline holding the longest sequence."""
    longest = max(range(len(plan.lengths)), key=plan.lengths.__getitem__)
    holder = next(p for p, pipe in enumerate(plan.pipelines)
                  if any(s.seq_id == longest for c in pipe.chunks for s in c.segments))
    places = rank_places(plan)
    mine = [r for r, place in enumerate(places) if place.pipeline == holder]
    return sorted({mine[0], mine[-1]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "dryrun.json"))
    args = parser.parse_args()
    rows = {}
    for name in args.scenarios.split(","):
        scenario = SCENARIOS[name]
        started = time.perf_counter()
        plan = make_plan(scenario, args.seed)
        planned_s = time.perf_counter() - started
        ranks = default_ranks(plan)
        try:
            result = dryrun_rows(plan, ranks, sequence_parallel=scenario.sequence_parallel)
        except UserError as exc:  # e.g. a plan the executor cannot run yet: recorded, not hidden
            rows[name] = {"scenario": vars(scenario), "num_gpus": plan.num_gpus, "error": str(exc)}
            print(f"{name:24s} not run: {exc}", flush=True)
            continue
        rows[name] = {"scenario": vars(scenario), "num_gpus": plan.num_gpus, "max_length": max(plan.lengths),
                      "tokens": sum(plan.lengths), "planning_s": planned_s, "ranks": result}
        for rank, row in result.items():
            mem = row["peak_memory_gib"]
            print(f"{name:24s} rank {rank:>4s}: peak {mem['measured']:7.2f} GiB measured, {mem['simulated']:7.2f} "
                  f"simulated; FLOPs x{row['flops']['measured'] / max(row['flops']['simulated'], 1):.4f}; "
                  f"{row['dryrun_s']:.0f} s", flush=True)
    command = "python " + " ".join(sys.argv)
    for row in rows.values():
        row["command"] = command
    out = Path(args.out)
    kept = json.loads(out.read_text()) if out.exists() else {}
    merged = {**kept.get("results", {}), **rows}  # the other scenarios' rows stay as they were measured
    write_atomic(out, json.dumps({"command": kept.get("command", command), "torch": torch.__version__,
                                  "machine": platform.processor() or platform.machine(), "results": merged},
                                 indent=1))


if __name__ == "__main__":
    main()
