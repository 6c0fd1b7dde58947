"""Float64 exactness of every planner, compiled, with the LM head in blocks: one table.

    python benchmarks/verify_matrix.py                           # every planner x tp1, tp2, pp2, cp2
    python benchmarks/verify_matrix.py --planners chunkflow,skrull --schemes pp2,cp2
    python benchmarks/verify_matrix.py --compile-backend inductor --out /tmp/m.json
    python benchmarks/verify_matrix.py --chain        # compiled with one region between attentions

What `lengthwise verify --compile` does (tp1: one process, `runtime/verify.verify_plan`; tp2,
pp2 and cp2: two gloo processes, `runtime/parallel/verify_dist.verify_worker`, the entry of
`verify --nproc 2`), for each planner of `lengthwise.planners.PLANNER_NAMES` on each scheme:
the tiny Llama preset in float64, seeded weights and tokens, a batch of 8 sequences (one of 200
tokens, so chunkflow and skrull split it), every decoder layer under torch.compile
(`runtime/compile.py`; backend aot_eager by default: it traces and runs the captured forward and
backward graphs, as inductor does, without inductor's C++ compile, which 2 shared CPU cores
cannot afford for 48 cells), and the LM head's loss in blocks of 64 rows of the 260-token
vocabulary (`--head-block-bytes`; the default block holds a tiny model's whole head), so the
blocked loss runs several blocks forward and backward, as a 152K vocabulary does.

Each cell: the loss and every gradient against Hugging Face transformers run on each sequence
alone; the largest relative gradient and loss differences, whether both are within float64's
1e-9 (`runtime/verify.TOLERANCE`), the plan's pipelines as executed (a planner may choose
another layout than the scheme asked for: auto, and slimpack at cp2, run this batch as two tp1
pipelines), and the graphs torch.compile built on each rank (TorchDynamo's count after a reset
before the cell: zero would mean the layers ran eager). All cells go to
benchmarks/results/verify_matrix.json; exit status 1 when a cell fails.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PLANNER_NAMES, PlanRequest, get_planner
from lengthwise.runtime.attention import resolve_backend
from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.parallel.verify_dist import VerifyJob, verify_worker
from lengthwise.runtime.verify import verify_plan
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import RESULTS, write_results  # noqa: E402

MODEL = "tiny"
LENGTHS = [200, 30, 17, 60, 5, 90, 33, 12]
SCHEMES = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}
OPTIONS = {"chunkflow": {"chunk_size": 64, "k": 1}, "skrull cp2": {"bucket_size": 128},
           "hydraulis tp2": {"pipelines": "tp2-pp1"}, "hydraulis pp2": {"pipelines": "tp1-pp2"},
           "hydraulis cp2": {"pipelines": "tp1-pp1-cp2"}}
"""Planner options sized to the tiny batch, by planner or by "planner scheme" (the rest keep
their defaults): chunkflow splits the 200-token sequence into slices of 64; skrull under cp2
shards it over the 2 CP ranks (a bucket of 128 per rank holds the rest whole; without cp a
bucket of 128 cannot hold it, so the other schemes keep skrull's default); hydraulis is held to
the scheme's one pipeline (left to choose, it runs this batch on two tp1 pipelines whatever the
scheme, as auto and slimpack at cp2 do: their cells say so under "pipelines")."""
HEAD_BLOCK_BYTES = 64 * 260 * 8
"""64 rows of the tiny vocabulary's float64 logits per forward block."""
SEED = 0
TIMEOUT_S = 600.0
"""A stage may wait for its neighbour's first compile."""


def make_plan(planner: str, scheme: str):
    spec = model_preset(MODEL)
    parallel = ParallelScheme(**SCHEMES[scheme])
    cluster = cluster_preset("cpu", parallel.num_gpus)
    cost = CostModel(model=spec, cluster=cluster)
    request = PlanRequest(lengths=list(LENGTHS), model=spec, cluster=cluster, scheme=parallel, cost=cost,
                          context_length=256, seed=SEED, options=planner_options(planner, scheme))
    plan = get_planner(planner)(request)
    validate_plan(plan, cost)
    return plan


def planner_options(planner: str, scheme: str) -> dict:
    return OPTIONS.get(f"{planner} {scheme}", OPTIONS.get(planner, {}))


def compiled_graphs() -> int:
    """Graphs TorchDynamo captured since its last reset."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def reset_compiler() -> None:
    """Forget every compiled graph (each cell compiles its own, and no cell runs eager because
    earlier cells used up the recompile limit)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()


def layout(plan) -> str:
    return " ".join(f"tp{p.tp}-pp{p.pp}-cp{p.cp}" for p in plan.pipelines)


def cell(planner: str, scheme: str, plan, result: dict, graphs: list[int], seconds: float) -> dict:
    loss_rel = abs(result["loss"] - result["reference_loss"]) / abs(result["reference_loss"])
    exact = result["max_rel_grad_diff"] <= 1e-9 and loss_rel <= 1e-9 and result["oracle"] == "transformers"
    return {"planner": planner, "scheme": scheme, "options": planner_options(planner, scheme), "pipelines": layout(plan),
            "chunks": sum(len(p.chunks) for p in plan.pipelines), "max_rel_grad_diff": result["max_rel_grad_diff"],
            "loss_rel_diff": loss_rel, "worst_param": result["worst_param"], "oracle": result["oracle"],
            "compiled_graphs_per_rank": graphs, "passed": bool(exact and all(graphs)), "seconds": round(seconds, 1)}


def one_process_cells(planners: list[str], compile_backend: str, attention: str, chain: bool = False) -> list[dict]:
    """tp1: `lengthwise verify --compile` on this process."""
    out = []
    for planner in planners:
        reset_compiler()
        start = time.perf_counter()
        plan = make_plan(planner, "tp1")
        result = verify_plan(plan, dtype=torch.float64, backend=attention, seed=SEED, oracle="transformers",
                             compile=True, compile_backend=compile_backend, head_block_bytes=HEAD_BLOCK_BYTES,
                             compile_chain=chain)
        out.append(cell(planner, "tp1", plan, result.to_dict(), [compiled_graphs()], time.perf_counter() - start))
        print(_line(out[-1]), flush=True)
    return out


def two_rank_worker(rank: int, cells: list[tuple[str, str]], compile_backend: str, attention: str,
                    chain: bool = False) -> list[dict] | None:
    """Every (planner, scheme) cell in turn on one group of 2 ranks (`verify --nproc 2 --compile`)."""
    mesh = Mesh.from_default_group(timeout_s=TIMEOUT_S)
    out = []
    for planner, scheme in cells:
        reset_compiler()
        start = time.perf_counter()
        job = VerifyJob(make_plan=functools.partial(make_plan, planner, scheme), dtype=torch.float64,
                        backend=attention, seed=SEED, oracle="transformers", timeout_s=TIMEOUT_S,
                        compile=compile_backend, head_block_bytes=HEAD_BLOCK_BYTES, compile_chain=chain)
        result = verify_worker(rank, job, mesh)
        graphs = [None] * mesh.world_size if rank == 0 else None
        dist.gather_object(compiled_graphs(), graphs, dst=0)
        if rank == 0:
            out.append(cell(planner, scheme, make_plan(planner, scheme), result, graphs, time.perf_counter() - start))
            print(_line(out[-1]), flush=True)
    return out if rank == 0 else None


def _line(c: dict) -> str:
    return (f"{c['planner']:>14} {c['scheme']}: {c['pipelines']:<24} grad {c['max_rel_grad_diff']:.1e} "
            f"loss {c['loss_rel_diff']:.1e} graphs {c['compiled_graphs_per_rank']} {c['seconds']:.0f}s "
            f"{'ok' if c['passed'] else 'FAILED'}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planners", default=",".join(PLANNER_NAMES), help="comma-separated (default all)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated of {', '.join(SCHEMES)}")
    parser.add_argument("--compile-backend", default="aot_eager", choices=("aot_eager", "inductor", "eager"),
                        help="torch.compile backend (default aot_eager)")
    parser.add_argument("--chain", action="store_true",
                        help="compile up to four layers in one region, attention included (runtime/compile.py; plain layers: "
                             "tp1, pp2, cp2; under tp2 the layers run as modules, unchained)")
    parser.add_argument("--out", help="results JSON (default benchmarks/results/verify_matrix.json, "
                                      "verify_matrix_chain.json with --chain)")
    args = parser.parse_args(argv)
    args.planners, args.schemes = args.planners.split(","), args.schemes.split(",")
    args.out = args.out or str(RESULTS / ("verify_matrix_chain.json" if args.chain else "verify_matrix.json"))
    for name, given, known in (("--planners", args.planners, PLANNER_NAMES), ("--schemes", args.schemes, SCHEMES)):
        if unknown := [g for g in given if g not in known]:
            raise UserError(f"{name}: unknown {', '.join(unknown)}; use some of {', '.join(known)}")
    return args


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    attention = resolve_backend("auto", torch.device("cpu"), torch.float64)
    start = time.perf_counter()
    cells = one_process_cells(args.planners, args.compile_backend, attention, args.chain) if "tp1" in args.schemes else []
    pairs = [(p, s) for p in args.planners for s in args.schemes if s != "tp1"]
    if pairs:
        cells += spawn(two_rank_worker, 2, pairs, args.compile_backend, attention, args.chain, timeout_s=TIMEOUT_S)
    order = {s: i for i, s in enumerate(SCHEMES)}
    cells.sort(key=lambda c: (PLANNER_NAMES.index(c["planner"]), order[c["scheme"]]))
    payload = {
        "what": "float64 loss and gradients of each planner's plan, every decoder layer compiled, LM head "
                "loss in blocks, against Hugging Face transformers run on each sequence alone",
        "model": MODEL, "lengths": LENGTHS, "options": OPTIONS, "dtype": "float64", "attention": attention,
        "compile_backend": args.compile_backend, "compile_chain": args.chain, "head_block_bytes": HEAD_BLOCK_BYTES,
        "tolerance": 1e-9,
        "torch": torch.__version__, "cells": cells, "passed": all(c["passed"] for c in cells),
        "max_rel_grad_diff": max(c["max_rel_grad_diff"] for c in cells),
        "max_loss_rel_diff": max(c["loss_rel_diff"] for c in cells),
        "seconds": round(time.perf_counter() - start, 1),
    }
    write_results(args.out, payload, __file__, argv)
    print(f"{sum(c['passed'] for c in cells)}/{len(cells)} cells within 1e-9; largest gradient difference "
          f"{payload['max_rel_grad_diff']:.2e}, loss {payload['max_loss_rel_diff']:.2e}; {args.out}")
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
