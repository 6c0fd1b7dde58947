"""How many pipelines of every planner's plans stall under NCCL's rendezvous rule, per posting
discipline (plan/rendezvous.py): lone isend/irecv (the executor before issue 27), sends deferred
to the next receive (a design not taken) and the lock-step exchanges the executor posts.
A replay of the rule over the plans' action lists (simulated, no GPU), written to
benchmarks/results/rendezvous_survey.json.

    python benchmarks/rendezvous_survey.py                   # about a minute on one CPU
    python benchmarks/rendezvous_survey.py --seeds 1 --sequences 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

from lengthwise.cost import CostModel  # noqa: E402
from lengthwise.errors import UserError  # noqa: E402
from lengthwise.files import write_atomic  # noqa: E402
from lengthwise.plan.rendezvous import DISCIPLINES, find_stall  # noqa: E402
from lengthwise.planners import PlanRequest  # noqa: E402
from lengthwise.planners.registry import CANDIDATE_PLANNERS  # noqa: E402
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset  # noqa: E402
from lengthwise.workloads.profiles import get_profile  # noqa: E402

SETTINGS = [("qwen2.5-7b", 1, 2), ("qwen2.5-7b", 1, 4), ("llama-70b", 8, 4), ("llama-70b", 8, 8)]
"""(model, tp, pp), each at dp 2 on H100s."""


def survey(model_name: str, tp: int, pp: int, seed: int, sequences: int) -> list[dict]:
    model = model_preset(model_name)
    scheme = ParallelScheme(dp=2, tp=tp, pp=pp)
    cluster = cluster_preset("h100", scheme.num_gpus)
    lengths = [int(n) for n in get_profile("chunkflow-eval").sample(sequences, np.random.default_rng(seed),
                                                                    below=32768)]
    rows = []
    for name, planner in CANDIDATE_PLANNERS.items():
        request = PlanRequest(lengths=lengths, model=model, cluster=cluster, scheme=scheme,
                              cost=CostModel(model=model, cluster=cluster), context_length=32768, seed=seed)
        try:
            plan = planner(request)
        except UserError as exc:
            rows.append({"planner": name, "model": model_name, "tp": tp, "pp": pp, "seed": seed, "error": str(exc)})
            continue
        pipes = [pipe for pipe in plan.pipelines if pipe.pp > 1]
        stalls = {d: sum(find_stall(pipe.stages, discipline=d, pipeline=p) is not None
                         for p, pipe in enumerate(plan.pipelines) if pipe.pp > 1) for d in DISCIPLINES}
        rows.append({"planner": name, "model": model_name, "tp": tp, "pp": pp, "seed": seed, "pipelines": len(pipes),
                     "stalled": stalls})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=128, help="sequences per global batch")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/rendezvous_survey.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [row for model, tp, pp in SETTINGS for seed in range(args.seeds)
            for row in survey(model, tp, pp, seed, args.sequences)]
    totals = {d: sum(r.get("stalled", {}).get(d, 0) for r in rows) for d in DISCIPLINES}
    by_planner = {}
    for r in rows:
        if "stalled" in r:
            t = by_planner.setdefault(r["planner"], {"pipelines": 0, **{d: 0 for d in DISCIPLINES}})
            t["pipelines"] += r["pipelines"]
            for d in DISCIPLINES:
                t[d] += r["stalled"][d]
    result = {"benchmark": "rendezvous_survey", "simulated": True,
              "command": "python benchmarks/rendezvous_survey.py " + " ".join(sys.argv[1:]),
              "settings": {"model_tp_pp": SETTINGS, "dp": 2, "profile": "chunkflow-eval", "below": 32768,
                           "sequences": args.sequences, "seeds": list(range(args.seeds))},
              "pipelines": sum(r.get("pipelines", 0) for r in rows), "stalled": totals,
              "by_planner": by_planner, "rows": rows, "seconds": round(time.perf_counter() - started, 1)}
    write_atomic(Path(args.out), json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("pipelines", "stalled", "by_planner")}, indent=1))


if __name__ == "__main__":
    main()
