"""The input fuzz suite at 1,000 cases per kind (tests/test_fuzz_inputs.py runs 60): mutated plan,
lengths and profile files and training settings (a `--config` file and flags) through the CLI;
counts successes, one-line errors and failures (tracebacks, non-finite output, inconsistent
results) and writes benchmarks/results/fuzz_inputs.json.

    python benchmarks/fuzz_inputs.py                      # 1,000 per kind, a few minutes
    python benchmarks/fuzz_inputs.py --examples 100 --kinds plans

Cases are drawn by hypothesis with a fixed seed (derandomized), so a run is repeatable.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fuzz_cases as fc  # noqa: E402
from lengthwise.files import write_atomic  # noqa: E402

KINDS = ("plans", "lengths", "profiles", "settings")


def run_kind(kind: str, examples: int) -> dict:
    """Run `examples` cases of one kind; returns the outcome counts and the first failures."""
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []

    def record(case) -> None:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                accepted = case(Path(tmp)) is not None
            counts["ok"] += 1
            counts["accepted" if accepted else "one-line error"] += 1
        except AssertionError as exc:
            counts["failed"] += 1
            failures.append(str(exc)[:300])
        except Exception:   # a traceback the CLI let through
            counts["traceback"] += 1
            failures.append(traceback.format_exc(limit=3)[-600:])

    strategies = {
        "plans": given(doc=fc.mutated_plans())(lambda doc: record(lambda tmp: fc.plan_case(doc, tmp))),
        "lengths": given(data=fc.lengths_files(), planner=st.sampled_from(fc.PLANNERS_FOR_LENGTHS))(
            lambda data, planner: record(lambda tmp: fc.lengths_case(data, tmp, planner))),
        "profiles": given(doc=fc.mutated_profiles())(lambda doc: record(lambda tmp: fc.profile_case(doc, tmp))),
        "settings": given(case=fc.training_settings())(
            lambda case: record(lambda tmp: fc.settings_case(*case, tmp))),
    }
    test = settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))(strategies[kind])
    started = time.perf_counter()
    test()
    return {"cases": counts["ok"] + counts["failed"] + counts["traceback"], **{k: counts[k] for k in ("ok", "accepted", "one-line error", "failed", "traceback")},
            "seconds": round(time.perf_counter() - started, 1), "first_failures": failures[:5]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="cases per kind (default 1000)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_inputs.json"))
    args = parser.parse_args(argv)
    results = {}
    for kind in args.kinds.split(","):
        results[kind] = run_kind(kind, args.examples)
        print(kind, json.dumps({k: v for k, v in results[kind].items() if k != "first_failures"}), flush=True)
    write_atomic(args.out, json.dumps({"benchmark": "fuzz_inputs", "examples_per_kind": args.examples,
                                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                       "kinds": results}, indent=1))
    bad = sum(r["failed"] + r["traceback"] for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
