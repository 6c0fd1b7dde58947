"""Planning time per global batch at scale: every planner x {64, 1024, 4096} GPUs x {512, 32768}
sequences, and 4096 GPUs x 131,072 sequences, wall and CPU seconds, written to
benchmarks/results/planning_scale.json.

    python benchmarks/bench_planning_scale.py                                  # the whole table
    python benchmarks/bench_planning_scale.py --planners packing,skrull --gpus 64 --sequences 512   # replaces those rows
    python benchmarks/bench_planning_scale.py --planners slimpack,auto --cases 4096:131072      # named cases only
    nice -n 10 python benchmarks/bench_planning_scale.py --timeout 300
    python benchmarks/bench_planning_scale.py --planners slimpack --cases 1024:32768 --baseline 2270aba --repeat 3

The batch is the first one `lengthwise plan --profile lmsys --model qwen2.5-7b --pp 4
--context-length 8192 --overlong truncate --dp GPUS/4 --batch-size SEQUENCES` plans (issue 16's
setting). Each case runs in its own process (a fresh interpreter, so caches of one case do not
help the next) and is killed after --timeout seconds, recorded as a time-out. The time is the
planner call alone (sampling the batch and building the cost model excluded), once per case,
as wall seconds and as the process's CPU seconds (one thread: on a machine shared with other
jobs the CPU time is the fairer figure; wall time is what a user waits on an idle machine). The JSON records the
machine's CPU count and load average beside the table, and a hash of each plan (planning time
and auto's per-candidate timings left out) so runs before and after an optimisation can be
checked to plan the same. With --baseline SRC every case also runs on another checkout's code,
alternating with this one's, so a speed-up is a ratio of CPU times taken under the same load
(rows then hold `baseline`, `speedup_cpu` and `same_plan`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GPUS = (64, 1024, 4096)
SEQUENCES = (512, 32768)
LARGE = ((4096, 131072),)
"""(GPUs, sequences) cases beyond the grid, run by default too (issue 28: the 10 s standard)."""


def plan_args(planner: str, gpus: int, sequences: int) -> list[str]:
    return ["plan", "--planner", planner, "--profile", "lmsys", "--model", "qwen2.5-7b", "--pp", "4",
            "--dp", str(gpus // 4), "--context-length", "8192", "--overlong", "truncate",
            "--batch-size", str(sequences)]


def plan_hash(plan) -> str:
    """sha256 of the plan's JSON without its timings (which differ run to run)."""
    d = plan.to_dict()
    d["metrics"] = {k: v for k, v in d["metrics"].items() if k not in ("planning_ms", "auto")}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def run_one(planner: str, gpus: int, sequences: int) -> dict:
    """Plan one case in this process; returns its row."""
    from lengthwise.cli import build_parser
    from lengthwise.commands.plan import build_request
    from lengthwise.planners import get_planner

    request = build_request(build_parser("plan").parse_args(plan_args(planner, gpus, sequences)))
    fn = get_planner(planner)
    started, cpu_started = time.perf_counter(), time.process_time()
    plan = fn(request)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "plan_hash": plan_hash(plan),
            "pipelines": len(plan.pipelines), "chunks": sum(len(p.chunks) for p in plan.pipelines)}


def run_case(planner: str, gpus: int, sequences: int, timeout: float, src: str | None = None) -> dict:
    """One case in a child process importing `src` (default: this checkout's), killed after
    `timeout` seconds."""
    cmd = [sys.executable, __file__, "--one", planner, str(gpus), str(sequences)]
    row = {"planner": planner, "gpus": gpus, "dp": gpus // 4, "sequences": sequences}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(src))
    except subprocess.TimeoutExpired:
        return {**row, "wall_s": None, "error": f"timed out after {timeout:g} s"}
    if done.returncode != 0:
        return {**row, "wall_s": None, "error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1])}


def measure(planner: str, gpus: int, sequences: int, args) -> dict:
    """The case's row: the least CPU time of --repeat runs; with --baseline, each run follows one
    of the baseline checkout on the same case (alternating, so both see the same machine load),
    whose least CPU time and plan hash go in the row's `baseline`."""
    runs, before = [], []
    for _ in range(max(1, args.repeat)):
        if args.baseline:
            before.append(run_case(planner, gpus, sequences, args.timeout, args.baseline))
        runs.append(run_case(planner, gpus, sequences, args.timeout))
    row = least(runs)
    if args.baseline:
        b = least(before)
        row["baseline"] = {k: b.get(k) for k in ("cpu_s", "wall_s", "plan_hash", "error") if k in b}
        if row.get("cpu_s") and b.get("cpu_s"):
            row["speedup_cpu"] = round(b["cpu_s"] / row["cpu_s"], 3)
        row["same_plan"] = row.get("plan_hash") == b.get("plan_hash")
    if len(runs) > 1:
        row["cpu_s_runs"] = [r.get("cpu_s") for r in runs]
    return row


def least(runs: list[dict]) -> dict:
    """The run with the least CPU time (a failed run only when every run failed)."""
    done = [r for r in runs if r.get("cpu_s") is not None]
    return min(done, key=lambda r: r["cpu_s"]) if done else runs[-1]


def child_env(src: str | None = None) -> dict:
    """The children import this checkout's package (or `src`) and use one thread (as the machine allows)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(src).resolve()) if src else str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def machine() -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


PLANNER_ORDER: dict[str, int] = {}
"""Row order of the table: the registry's planner order."""


def write(path: Path, rows: list[dict], settings: dict) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from lengthwise.files import write_atomic

    write_atomic(path, json.dumps({"benchmark": "planning_scale", "setting": settings, "machine": machine(),
                                   "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planners", help="comma-separated (default: every available planner)")
    parser.add_argument("--gpus", default=",".join(map(str, GPUS)), help="comma-separated GPU counts")
    parser.add_argument("--sequences", default=",".join(map(str, SEQUENCES)), help="comma-separated batch sizes")
    parser.add_argument("--cases", help="comma-separated GPUS:SEQUENCES pairs, instead of the grid "
                        "(default: the grid of --gpus x --sequences, plus 4096:131072 when neither is given)")
    parser.add_argument("--baseline", metavar="REV", help="a git revision of this checkout (its src/ is "
                        "extracted to a temporary folder) or a src folder: each case runs with that code too, "
                        "alternating, recorded in the row")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (the least CPU time is kept)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a case is killed")
    parser.add_argument("--out", default=str(RESULTS / "planning_scale.json"))
    parser.add_argument("--one", nargs=3, metavar=("PLANNER", "GPUS", "SEQUENCES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from lengthwise.planners import PLANNER_NAMES

    planners = args.planners.split(",") if args.planners else list(PLANNER_NAMES)
    PLANNER_ORDER.update({name: i for i, name in enumerate(PLANNER_NAMES)})
    settings = {"command": "lengthwise " + " ".join(plan_args("P", 4, 1)).replace("--dp 1", "--dp GPUS/4")
                .replace("--batch-size 1", "--batch-size SEQUENCES"), "timeout_s": args.timeout,
                "repeat": args.repeat, "baseline": args.baseline}
    # A run of some cases replaces those rows of an existing table and keeps the others (each row
    # says when it was measured), so one planner can be re-measured without re-running them all.
    rows = previous_rows(Path(args.out))
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            settings["baseline"] = baseline_label(args.baseline)
            args.baseline = baseline_src(args.baseline, tmp)
        run_cases(args, argv, planners, rows, settings)
    return 0


def run_cases(args, argv, planners: list[str], rows: list[dict], settings: dict) -> None:
    for gpus, sequences in cases(args, argv):
        for planner in planners:
            row = {**measure(planner, gpus, sequences, args),
                   "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            rows = [r for r in rows if case_key(r) != case_key(row)] + [row]
            rows.sort(key=lambda r: (r["sequences"], r["gpus"], PLANNER_ORDER.get(r["planner"], 99)))
            print(json.dumps(row), flush=True)
            write(Path(args.out), rows, settings)


def baseline_src(rev: str, tmp: str) -> str:
    """A src folder holding the baseline's code: `rev` itself when it is a folder, else that git
    revision's src/ extracted under `tmp`."""
    if Path(rev).is_dir():
        return rev
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return str(Path(tmp) / "src")


def baseline_label(rev: str) -> str:
    """The baseline as recorded: its commit when `rev` names one, else the folder given."""
    if Path(rev).is_dir():
        return rev
    root = Path(__file__).resolve().parent.parent
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], capture_output=True, text=True,
                          check=True).stdout.strip()


def cases(args, argv: list[str] | None) -> list[tuple[int, int]]:
    """(GPUs, sequences) to run, in order: --cases, else the grid (and LARGE when the grid is the default)."""
    if args.cases:
        return [tuple(map(int, c.split(":"))) for c in args.cases.split(",")]
    grid = [(g, s) for s in map(int, args.sequences.split(",")) for g in map(int, args.gpus.split(","))]
    given = argv if argv is not None else sys.argv[1:]
    default = not any(a.startswith(("--gpus", "--sequences")) for a in given)
    return grid + (list(LARGE) if default else [])


def case_key(row: dict) -> tuple:
    return row["planner"], row["gpus"], row["sequences"]


def previous_rows(path: Path) -> list[dict]:
    try:
        return list(json.loads(path.read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


if __name__ == "__main__":
    raise SystemExit(main())
