"""What a distributed checkpoint save holds on one rank at full size: LLaMA-70B on 256 ranks
(dp 8 x pp 4 x tp 8, FSDP2 over dp with fp32 master weights), on fake tensors and the fake
process group, measured by the save's own code (`runtime/parallel/checkpoint_scale.py`).

    python benchmarks/bench_checkpoint_save.py              # ranks 0 and 255 -> results/checkpoint_save.json

Per rank: the bytes of its own parameter shards and AdamW states, the bytes its save writes
(pieces of those same tensors, no copies), the largest piece (the most one host copy holds when
a piece is written from a GPU), the collectives the save issued, and, for comparison, what the
earlier save gathered to rank 0: every parameter of the model whole (fp32).
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_common import RESULTS, write_results

from lengthwise.cost import CostModel
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.parallel.checkpoint_scale import save_footprint
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="0,255")
    args = parser.parse_args(argv)
    spec, scheme = model_preset("llama-70b"), ParallelScheme(dp=8, pp=4, tp=8)
    cluster = cluster_preset("h100", scheme.num_gpus)
    plan = get_planner("chunkflow")(PlanRequest(
        lengths=[4096] * 8, model=spec, cluster=cluster, scheme=scheme, cost=CostModel(model=spec, cluster=cluster),
        context_length=4096, seed=0, options={"chunk_size": 4096, "k": 1}))
    rows = []
    for rank in (int(r) for r in args.ranks.split(",")):
        started = time.perf_counter()
        found = save_footprint(plan, rank)
        rows.append({"rank": rank, "own_bytes": found.own_bytes, "written_bytes": found.written_bytes,
                     "largest_piece_bytes": found.largest_piece_bytes, "pieces_not_own": found.pieces_not_own,
                     "collectives": found.collectives, "seconds": round(time.perf_counter() - started, 2)})
        print(rows[-1])
    payload = {"model": spec.name, "world_size": 256, "scheme": "dp8 x pp4 x tp8, FSDP2 over dp, fp32 masters",
               "measured_on": "fake tensors + fake process group (no data, no devices)", "ranks": rows,
               "earlier_save_gathered_to_rank0_bytes_fp32_weights": 4 * spec.num_params}
    write_results(RESULTS / "checkpoint_save.json", payload, __file__, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
