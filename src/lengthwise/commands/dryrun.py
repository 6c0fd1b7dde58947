"""Run ranks of a plan at full size on this CPU (fake tensors, fake process group) and set what
they allocate, compute and send beside what the simulator predicts.

    lengthwise plan --planner chunkflow --profile chunkflow-eval --model qwen2.5-7b --dp 8 --pp 4 \\
        --context-length 32768 --overlong drop --batch-size 256 --out plan.json
    lengthwise dryrun plan.json --ranks 0,5,31
    lengthwise dryrun plan.json --json

Measured: peak memory by category (parameters, gradients, optimizer, activations,
temporaries), FLOPs, and bytes handed to sends and collectives by kind, from the executor's
real code for each named rank (`lengthwise.runtime.dryrun`). Simulated: the same quantities
from the cost model and the simulator (`lengthwise.sim.rank`). No GPU and no real memory are
used; a 7B rank takes seconds to a few minutes. `--json` prints
{"ranks": {"R": {"peak_memory_gib": {"measured", "simulated"}, "flops": {...},
"comm_bytes": {...}, "memory_gib": {...}}}}.
"""

from __future__ import annotations

import argparse

from lengthwise.errors import UserError
from lengthwise.limits import DRYRUN_RANKS, check_size

GIB = 2**30


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", help="a StepPlan written by `lengthwise plan`")
    parser.add_argument("--ranks", metavar="R,R,...", default="0",
                        help="ranks to run, comma-separated, or 'all' (default 0)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="parameter and activation dtype of the run (default bfloat16)")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="run tensor parallelism without sequence parallelism (whole activations on every "
                             "TP rank); the simulator models the same layout (CostModel.sequence_parallel)")
    parser.add_argument("--attention", choices=("cpu-flash", "varlen"),
                        help="attention path to run: varlen (the CUDA operators' shapes, under fake tensors) or "
                             "cpu-flash (default: what the plan's cluster would run, varlen on GPUs)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def run(args: argparse.Namespace) -> int:
    from lengthwise.files import json_text
    from lengthwise.plan.validate import load_plan
    from lengthwise.sim.rank import rank_places

    plan = load_plan(args.plan)
    ranks = parse_ranks(args.ranks, len(rank_places(plan)))
    rows = dryrun_rows(plan, ranks, dtype=args.dtype, sequence_parallel=args.sequence_parallel,
                       attention=args.attention)
    if args.json:
        print(json_text({"ranks": rows}))
    else:
        print(format_rows(rows))
    return 0


def dryrun_rows(plan, ranks: list[int], *, dtype: str = "bfloat16",
                sequence_parallel: bool = True, attention: str | None = None) -> dict[str, dict]:
    """Rank -> measured and simulated values side by side (`side_by_side`)."""
    from lengthwise.cost import CostModel
    from lengthwise.sim.rank import rank_prediction
    from lengthwise.sim.simulate import simulate_plan

    import torch

    from lengthwise.runtime.dryrun import dryrun_rank
    cost = CostModel(model=plan.model, cluster=plan.cluster, sequence_parallel=sequence_parallel)
    peaks = simulate_plan(plan, cost).peak_memory
    return {str(rank): side_by_side(dryrun_rank(plan, rank, dtype=getattr(torch, dtype), backend=attention,
                                                sequence_parallel=sequence_parallel),
                                    rank_prediction(plan, cost, rank=rank, peak_memory=peaks))
            for rank in ranks}


def parse_ranks(text: str, world_size: int) -> list[int]:
    """'0,5,31' or 'all' -> ranks, each checked against the plan's world size."""
    if text == "all":
        check_size(f"--ranks all ({world_size} ranks):", world_size, DRYRUN_RANKS)
        return list(range(world_size))
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--ranks {text!r}: give comma-separated integers, e.g. 0,5,31, or all") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise UserError(f"--ranks: rank {bad[0]} is outside the plan's {world_size} ranks (0..{world_size - 1})")
    check_size("--ranks count", len(ranks), DRYRUN_RANKS)
    return ranks


def side_by_side(measured, predicted) -> dict:
    """One rank's JSON row: measured and simulated values of each quantity."""
    kinds = sorted(set(measured.comm_bytes) | {k for k, v in predicted.comm_bytes.items() if v})
    return {
        "place": f"pipeline {predicted.place.pipeline} stage {predicted.place.stage} cp rank {predicted.place.cp_rank}",
        "peak_memory_gib": {"measured": measured.peak_memory_bytes / GIB, "simulated": predicted.peak_memory_bytes / GIB},
        "memory_gib": {k: v / GIB for k, v in measured.memory_bytes.items()},
        "flops": {"measured": measured.flops, "simulated": predicted.flops},
        "comm_bytes": {k: {"measured": measured.comm_bytes.get(k, 0), "simulated": predicted.comm_bytes.get(k, 0.0)}
                       for k in kinds},
        "dryrun_s": measured.seconds,
    }


def format_rows(rows: dict) -> str:
    lines = []
    for rank, row in rows.items():
        mem, flops = row["peak_memory_gib"], row["flops"]
        lines.append(f"rank {rank} ({row['place']}), dry run {row['dryrun_s']:.1f} s")
        lines.append(f"  peak memory  measured {mem['measured']:8.2f} GiB   simulated {mem['simulated']:8.2f} GiB"
                     f"   {_ratio(mem['measured'], mem['simulated'])}")
        lines.append("    at the peak: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in row["memory_gib"].items() if v))
        lines.append(f"  FLOPs        measured {flops['measured'] / 1e12:8.2f} T     simulated "
                     f"{flops['simulated'] / 1e12:8.2f} T     {_ratio(flops['measured'], flops['simulated'])}")
        for kind, pair in row["comm_bytes"].items():
            lines.append(f"  {kind:<12s} measured {pair['measured'] / GIB:8.3f} GiB   simulated "
                         f"{pair['simulated'] / GIB:8.3f} GiB   {_ratio(pair['measured'], pair['simulated'])}")
    return "\n".join(lines)


def _ratio(measured: float, simulated: float) -> str:
    if simulated == 0:
        return "(measured only)" if measured else ""
    return f"measured/simulated {measured / simulated:.3f}"
