"""Every GPU measurement the project needs, as one command that fits a short lease on one GPU.

    bash benchmarks/gpu_suite.sh                        # one H100/H200: about 5 minutes, at most 8
    bash benchmarks/gpu_suite.sh --out /tmp/gpu         # the JSON files elsewhere ($OUT when set)
    bash benchmarks/gpu_suite.sh --tiny --out /tmp/t    # the same steps on CPU, tiny models and sizes
    bash benchmarks/gpu_suite.sh --list                 # print the steps and their limits, run nothing
    bash benchmarks/gpu_suite.sh --experiments          # what waits for a GPU beyond the suite, 8 minutes

Each step is one process with its own time limit (killed past it, rc 124), run in order; a
failed step is recorded and the suite goes on, except that a step whose input (a profile) a
failed step should have written is skipped with that reason. Everything lands in one folder:
each step's JSON, its log under logs/, and summary.json (device, torch/CUDA/transformers
versions, commit; per step its command, limit, rc, wall time, output file), rewritten after
every step so a suite cut short still says how far it got. Exit 0 only when every step that
ran succeeded and wrote its file.

The steps' limits add up to at most 480 s (--tiny: 600 s each, only to stop a hang), sized from
the two H200 calls of 2026-11-28 (benchmarks/results/gpu-2026-11-28-nvidia-h200/, layers
compiled): varlen check 20 s; verify 34 s (then, once the LM head compiled too, its JSON written
and the process still exiting at 45 s: inductor's compile workers); host overhead 26 s (before
and after); 0.5B profile 41-46 s at 16K tokens (the 32K chunks now added cost a few seconds:
at 16K and below the compiled layers' times sit on the host floor, so the fit could not see
the device's slope); the 0.5B rows with transformers' packed anchor 66 s; the 1.5B rows 60 s
(seeded weights drawn on threads; before that the step was cut at 80 s); the long rows about
10-14 s a step a system at 128K (run 1 cut them at 70 s with 3 steps each: 1 timed step now);
sim_fidelity 36-45 s. Each process that builds a model of new dimensions pays inductor's
compile once; later processes of the same dimensions read its on-disk caches. Order: the
correctness checks first (verify compiled, and eager if compiled failed: then the rest runs
eager), the host-overhead measurement, the 0.5B profile, the 0.5B rows, the 1.5B rows (planned
with the first H200 run's 1.5B profile, which packing and a fixed ChunkSize need only for
memory), the long rows, sim_fidelity. transformers' padded loop is left to
`bench_gpu_finetune.py` run by hand (10,895 tokens/s on the first run, 6.7x below packing): the
packed anchor is the fair one, and both would not fit the 8 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE_LIMIT_S = 480
"""The suite's promise: all steps' limits together stay under 8 minutes."""
TINY_LIMIT_S = 600


@dataclass(kw_only=True)
class Step:
    """One command of the suite."""

    name: str
    argv: list[str]
    """The command, run from the repository root (python3 ... ; paths relative to the root)."""
    limit_s: int
    """Killed past this many seconds (rc 124)."""
    output: str | None = None
    """The file it writes, relative to the suite's folder (None: its log is its record)."""
    stdout_is_output: bool = False
    """The command prints its JSON on stdout (lengthwise verify --json): saved as `output`."""
    needs: list[str] = field(default_factory=list)
    """Files of earlier steps it reads; missing ones skip it."""
    skip_reason: str | None = None
    """Set when the step cannot run in this mode (the varlen check on CPU)."""
    compiles: bool = False
    """Takes --compile/--no-compile (lengthwise's layers compiled by default on CUDA)."""
    decides_compile: bool = False
    """If it fails compiled and passes with --no-compile, the later steps run with --no-compile
    (a compiler failure on this machine then costs the suite one check, not every measurement)."""


# ---- the steps -----------------------------------------------------------------------------------

PY = "python3"
BENCH = "benchmarks/bench_gpu_finetune.py"


def profile_step(model: str, tiny_model: str, out: Path, tiny: bool, limit_s: int) -> Step:
    name = tiny_model if tiny else model
    sizes = (["--device", "cpu", "--layers", "1", "--min-tokens", "16", "--max-tokens", "64", "--max-context",
              "256", "--repeats", "1", "--warmup", "0"] if tiny else ["--max-tokens", "32768", "--repeats", "2"])
    return Step(name=f"profile-{model.removeprefix('qwen2.5-')}", limit_s=limit_s, compiles=True,
                argv=[PY, "-m", "lengthwise", "profile", "--model", name, *sizes, "--out",
                      str(out / f"profile-{name}.json")], output=f"profile-{name}.json")


def finetune_step(name: str, out: Path, tiny: bool, limit_s: int, *, context: int, systems: str,
                  extra: list[str], model: str = "qwen2.5-0.5b", profile: str | None = None, steps: int = 2) -> Step:
    """bench_gpu_finetune.py on `model` (tiny-qwen with --tiny), `steps` batches each run once
    untimed and then timed (`--warm-timed`: no timed step compiles; the 128K row's one timed
    chunkflow step compiled two graphs at 6010257, when warm-up ran another batch), planned with
    the profile an earlier step measured (or the file `profile` names)."""
    model = "tiny-qwen" if tiny else model
    measured = out / f"profile-{model}.json"
    sizes = (["--tiny", "--device", "cpu", "--warm-timed"] if tiny else
             ["--models", model, "--contexts", str(context), "--steps", str(steps), "--warmup", "0", "--warm-timed"])
    return Step(name=name, limit_s=limit_s, output=f"{name}.json", needs=[] if profile else [measured.name],
                compiles=True, argv=[PY, BENCH, *sizes, "--systems", systems, "--no-scan", *extra,
                                     "--profile-file", f"{model}={profile or measured}", "--out", str(out / f"{name}.json")])


H200_PROFILE_15B = "benchmarks/results/h200-2026-11-27/profile-qwen2.5-1.5b.json"
"""The 1.5B profile the first H200 run measured: the 1.5B row plans with it (packing and a fixed
ChunkSize need only its memory terms), which saves the suite a 1.5B profile."""


def suite_steps(out: Path, *, tiny: bool, cuda: bool, old_src: str | None = None) -> list[Step]:
    """The suite, in running order: the correctness checks and the host-overhead measurement
    first, then the measurements the later ones plan with. --tiny keeps every step and its JSON,
    at CPU sizes: tiny models, a 256-token context, ChunkSize 64/128 standing for auto/8192,
    sequences of 160-256 tokens standing for the 64K-128K long ones (still several chunks each).
    `old_src`: an older revision's src/ folder, timed beside this one by the host-overhead step."""
    device = ["--device", "cpu", "--lengths", "60,20,9", "--chunk-size", "16"] if tiny else \
             ["--device", "cuda", "--dtype", "bfloat16", "--backend", "varlen", "--lengths", "200,30,17,60,5",
              "--chunk-size", "64"]
    chunk_8k = "128" if tiny else "8192"
    long_range = "160-256" if tiny else "65536-131072"
    p05 = f"profile-{'tiny-qwen' if tiny else 'qwen2.5-0.5b'}.json"
    host_variants = ["--variants", "before,after", "--old-src", old_src] if old_src else ["--variants", "after"]
    return [
        # the varlen kernels against float64, and an eager step making no host sync (the compiled
        # step's syncs: gpu_step_breakdown's sync_sites; its compilation would not fit here)
        Step(name="varlen-check", limit_s=30,
             argv=[PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_bench_cpu.py", "-k",
                   "varlen and not compiled and not chained"],
             skip_reason=None if cuda and not tiny else "needs CUDA (torch.nn.attention.varlen): not run with --tiny"),
        Step(name="verify", limit_s=50, output="verify.json", stdout_is_output=True, compiles=True, decides_compile=True,
             argv=[PY, "-m", "lengthwise", "verify", "--model-config", "tiny-qwen", *device, "--k", "1", "--json"]),
        Step(name="host-overhead", limit_s=35, output="host-overhead.json",
             argv=[PY, "benchmarks/bench_host_overhead.py", "--device", "cpu" if tiny else "cuda", *host_variants,
                   "--rounds", "1" if tiny else "3", "--steps", "1" if tiny else "5",
                   "--out", str(out / "host-overhead.json")]),
        profile_step("qwen2.5-0.5b", "tiny-qwen", out, tiny, 55),
        # the transformers row runs in the same process as lengthwise's (ratios within one run)
        finetune_step("finetune-0.5b-32k", out, tiny, 85, context=32768, systems="packing,chunkflow,hf-packed",
                      extra=[]),
        # the 1.5B rows: packing's MFU and peak, chunkflow at ChunkSize 8192 against it
        finetune_step("finetune-1.5b-32k", out, tiny, 85, context=32768, systems="packing,chunkflow",
                      extra=["--chunk-size", chunk_8k], model="qwen2.5-1.5b",
                      profile=None if tiny else H200_PROFILE_15B),
        finetune_step("finetune-0.5b-128k-long", out, tiny, 80, context=131072, systems="packing,chunkflow",
                      extra=["--chunk-size", chunk_8k, "--long-sequence", long_range], steps=1),
        Step(name="sim-fidelity-0.5b-32k", limit_s=55, output="sim-fidelity-0.5b-32k.json", needs=[p05],
             argv=[PY, "benchmarks/sim_fidelity.py", *(["--tiny", "--device", "cpu"] if tiny else
                   ["--model", "qwen2.5-0.5b", "--context", "32768", "--batches", "2", "--repeats", "2"]),
                   "--profile-file", str(out / p05), "--out", str(out / "sim-fidelity-0.5b-32k.json")]),
    ]


def experiment_steps(out: Path, *, tiny: bool, cuda: bool) -> list[Step]:
    """`--experiments`: what waits for a GPU beyond the suite (benchmarks/GPU_RUNS.md), for a
    lease the suite has already had, within the same 8 minutes: a step of every kind checked for
    synchronising calls (eager, compiled, chained), `verify` of the chained compilation (bf16,
    varlen, a split sequence: the attention operator inside the region against transformers),
    the chained compilation against the default on the step ChunkFlow waits on the host for
    (gpu_step_breakdown.py), the LM head's softmax gradient in its variants
    (bench_softmax_grad.py)."""
    cases = ("tiny-qwen:chunkflow@64:chain" if tiny else
             "qwen2.5-1.5b:chunkflow@8192,qwen2.5-1.5b:chunkflow@8192:chain,qwen2.5-1.5b:packing:chain")
    return [
        Step(name="sync-check", limit_s=75,
             argv=[PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_bench_cpu.py", "-k",
                   "never_makes_the_host_wait"],
             skip_reason=None if cuda and not tiny else "needs CUDA (sync debug mode): not run with --tiny"),
        Step(name="verify-chain", limit_s=90, output="verify-chain.json", stdout_is_output=True,
             argv=[PY, "-m", "lengthwise", "verify", "--model-config", "tiny-qwen",
                   *(["--device", "cpu", "--lengths", "60,20,9", "--chunk-size", "16"] if tiny else
                     ["--device", "cuda", "--dtype", "bfloat16", "--backend", "varlen", "--lengths", "200,30,17,60,5",
                      "--chunk-size", "64"]), "--k", "1", "--compile-chain", "--json"]),
        Step(name="chain-breakdown", limit_s=265, output="chain-breakdown.json",
             argv=[PY, "benchmarks/gpu_step_breakdown.py", *(["--tiny", "--steps", "1"] if tiny else
                   ["--profile-file", f"qwen2.5-1.5b={H200_PROFILE_15B}"]), "--cases", cases,
                   "--out", str(out / "chain-breakdown.json")]),
        Step(name="softmax-grad", limit_s=50, output="softmax-grad.json",
             argv=[PY, "benchmarks/bench_softmax_grad.py", *(["--tiny"] if tiny else []),
                   "--out", str(out / "softmax-grad.json")]),
    ]


# ---- running them --------------------------------------------------------------------------------

def run_step(step: Step, out: Path, env: dict) -> dict:
    """Run one step under its limit; its record for the summary."""
    record = {"name": step.name, "command": " ".join(step.argv), "limit_s": step.limit_s, "output": step.output}
    missing = [n for n in step.needs if not (out / n).is_file()]
    if step.skip_reason or missing:
        reason = step.skip_reason or f"needs {', '.join(missing)}, which an earlier step did not write"
        return {**record, "status": "skipped", "reason": reason, "rc": None, "wall_s": 0.0}
    log = out / "logs" / f"{step.name}.log"
    start, cpu_before = time.perf_counter(), _children_cpu_s()
    with open(log, "w") as err:
        if step.stdout_is_output:  # kept only when the command succeeds: no half-written JSON
            partial = out / f"{step.output}.partial"
            with open(partial, "w") as std:
                rc = _launch(step, env, std, err)
            if rc == 0:
                partial.replace(out / step.output)
        else:
            rc = _launch(step, env, err, err)
    record.update(rc=rc, wall_s=round(time.perf_counter() - start, 2),
                  cpu_s=round(_children_cpu_s() - cpu_before, 2), log=str(log.relative_to(out)))
    written = step.output is None or _nonempty(out / step.output)
    record["status"] = "ok" if rc == 0 and written else ("timeout" if rc == 124 else "failed")
    if rc == 0 and not written:
        record["reason"] = f"exited 0 without writing {step.output}"
    return record


def _launch(step: Step, env: dict, stdout, stderr) -> int:
    """The step's exit code, or 124 after killing its whole process group at the limit."""
    proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        return proc.wait(timeout=step.limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return 124


def _children_cpu_s() -> float:
    """User + system CPU seconds of finished child processes (a step's cost on a shared
    machine, where wall time says more about the neighbours)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def step_env(tiny: bool) -> dict:
    """The steps' environment: src and benchmarks importable; one CPU thread for --tiny (the
    tiny sizes gain nothing from threads, and a shared machine loses much to them)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", "benchmarks",
                                                                     os.environ.get("PYTHONPATH")]))}
    if tiny:
        env["OMP_NUM_THREADS"] = "1"
    return env


_DESCRIBE = """
import json, platform, sys, torch, transformers
cuda = torch.cuda.is_available() and sys.argv[1] == "gpu"
print(json.dumps({"device": torch.cuda.get_device_name(0) if cuda else "cpu (" + platform.machine() + ")",
                  "device_type": "cuda" if cuda else "cpu", "torch": torch.__version__,
                  "cuda": torch.version.cuda if cuda else None, "transformers": transformers.__version__,
                  "python": platform.python_version()}))
"""


def describe_machine(tiny: bool) -> dict:
    """Device (torch.cuda.get_device_name) and versions, read in a child process: a CUDA
    context in this long-lived one would hold GPU memory away from every step."""
    proc = subprocess.run([PY, "-c", _DESCRIBE, "cpu" if tiny else "gpu"], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        machine = {"device": "unknown", "device_type": "unknown", "describe_error": tail[:300]}
    else:
        machine = json.loads(proc.stdout)
    return {**machine, "commit": _commit()}


def _commit() -> str | None:
    """$LENGTHWISE_COMMIT where set (a checkout copied to the GPU machine may carry no, or stale,
    git metadata), else HEAD (with " (modified)" if tracked files differ)."""
    if os.environ.get("LENGTHWISE_COMMIT") or not (ROOT / ".git").exists():
        return os.environ.get("LENGTHWISE_COMMIT")
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def default_out(machine: dict, tiny: bool, experiments: bool = False) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    name = "-".join("".join(c if c.isalnum() else " " for c in machine["device"].lower()).split())
    kind = ("tiny-" if tiny else "") + ("experiments-" if experiments else "")
    return ROOT / "benchmarks" / "results" / f"gpu-{time.strftime('%Y-%m-%d')}-{kind}{name}"


def write_summary(out: Path, summary: dict) -> None:
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for every file (default: $OUT, else benchmarks/results/gpu-DATE-DEVICE)")
    ap.add_argument("--tiny", action="store_true", help="the same steps on CPU at tiny sizes (the test's mode)")
    ap.add_argument("--old-src", help="an older revision's src/ folder: the host-overhead step times it beside this "
                    "one (e.g. `git archive 1b723e1 src | tar -x -C old`, then --old-src old/src)")
    ap.add_argument("--list", action="store_true", help="print the steps and their limits; run nothing")
    ap.add_argument("--experiments", action="store_true",
                    help="the measurements waiting for a GPU beyond the suite (benchmarks/GPU_RUNS.md), not the suite")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    machine = describe_machine(args.tiny)
    out = Path(args.out) if args.out else default_out(machine, args.tiny, args.experiments)
    old_src = str(Path(args.old_src).resolve()) if args.old_src else None
    if old_src and not (Path(old_src) / "lengthwise").is_dir():
        print(f"--old-src {args.old_src}: no lengthwise package there; give the src/ folder of an export",
              file=sys.stderr)
        return 2
    cuda = machine["device_type"] != "cpu"
    steps = (experiment_steps(out.resolve(), tiny=args.tiny, cuda=cuda) if args.experiments else
             suite_steps(out.resolve(), tiny=args.tiny, cuda=cuda, old_src=old_src))
    if args.tiny:  # the limits budget a GPU lease; on a shared CPU they only stop a hang
        steps = [dataclasses.replace(s, limit_s=TINY_LIMIT_S) for s in steps]
    if args.list:
        for s in steps:
            print(f"{s.limit_s:>4} s  {s.name:<28} {' '.join(s.argv)}")
        print(f"{sum(s.limit_s for s in steps):>4} s  in all")
        return 0
    (out / "logs").mkdir(parents=True, exist_ok=True)
    summary = {"format": "lengthwise.gpu_suite/1", "tiny": args.tiny, "experiments": args.experiments, **machine,
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": "bash benchmarks/gpu_suite.sh "
               + " ".join(sys.argv[1:] if argv is None else argv), "limit_total_s": sum(s.limit_s for s in steps),
               "steps": []}
    start, env = time.perf_counter(), step_env(args.tiny)
    no_compile = False

    def run(step: Step) -> dict:
        print(f"[{time.strftime('%H:%M:%S')}] {step.name} (limit {step.limit_s} s)", file=sys.stderr, flush=True)
        summary["steps"].append(run_step(step, out.resolve(), env))
        summary["wall_s"] = round(time.perf_counter() - start, 2)
        write_summary(out, summary)
        r = summary["steps"][-1]
        print(f"    {r['status']} rc={r['rc']} {r['wall_s']} s {r.get('reason', '')}", file=sys.stderr, flush=True)
        return r

    for step in steps:
        if no_compile and step.compiles:
            step = dataclasses.replace(step, argv=[*step.argv, "--no-compile"])
        r = run(step)
        if step.decides_compile and r["status"] not in ("ok", "skipped") and not no_compile:
            eager = run(dataclasses.replace(step, name=f"{step.name}-no-compile", argv=[*step.argv, "--no-compile"],
                                            output=f"{Path(step.output).stem}-no-compile.json"))
            if eager["status"] == "ok":  # the compiler is what failed: measure the rest eager
                no_compile = True
                summary["compile"] = f"off: {step.name} failed compiled and passed with --no-compile"
                write_summary(out, summary)
    failed = [r["name"] for r in summary["steps"] if r["status"] not in ("ok", "skipped")]
    print(f"{len(steps) - len(failed)}/{len(steps)} steps ok or skipped in {summary['wall_s']} s; "
          f"wrote {out / 'summary.json'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
