"""Where one training step's time goes on the device: kernels by kind, the device's idle time, the
host's dispatch count, for lengthwise's systems on one GPU (or, with --tiny, on CPU).

    python benchmarks/gpu_step_breakdown.py --out /tmp/b/breakdown.json     # the default cases, GPU
    python benchmarks/gpu_step_breakdown.py --cases qwen2.5-1.5b:chunkflow@8192 --steps 3
    python benchmarks/gpu_step_breakdown.py --tiny --out /tmp/breakdown.json      # CPU, seconds

A case is MODEL:SYSTEM[@CHUNKSIZE][:eager|:chain] (bench_gpu_finetune's systems `packing`,
`chunkflow`; `@N` a fixed ChunkSize, `:eager` without torch.compile, `:chain` compiled with up to
four layers in one region, attention included, `runtime/compile.py`). Per case, on the same chunkflow-eval
batches as bench_gpu_finetune (`--batch-size` sequences, `--context`): a fresh model and fused
AdamW, then **every batch run once untimed** (so each chunk length the timed steps meet has been
compiled: a step that compiles is a one-time cost, not the step time), then `--steps` timed steps
over the same batches (tokens/s, MFU, peak memory), then one more step under torch.profiler.
From the profiled step:

- `wall_us`: the step's time under the profiler (its own overhead included);
- `device_busy_us`: the union of the device's kernel, copy and set intervals, and `device_idle_share`
  = 1 - busy / wall: the time the device waited for the host (launch-bound where it is large);
- `kernels_by_kind`: microseconds and counts per kind (gemm, attention, triton, elementwise,
  reduction, optimizer, copy, collective, other), from the kernel names;
- `top_kernels`: the 25 kernels that took the most time;
- `host`: ATen operator calls (nested included) and kernel launches the step made, and the
  CUDA runtime's synchronising calls (`syncs`: stream, device and event synchronisations; the
  timing's own two and the loss read at the step's end among them).

Then, on a GPU, one more step under PyTorch's sync debug mode (`sync_sites`): every operation
that made the host wait for the device (a blocking copy, a value read), counted by the line of
lengthwise's or the benchmark's code that called it.

What it is for: the H200 runs measured 26% MFU on Qwen2.5-0.5B and 42% on 1.5B; this says whether
the gap is the device waiting on the host, the matmuls' own efficiency, or the work between them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch
from bench_common import Device, empty_cache, random_token_ids, sample_batches, timed
from bench_gpu_finetune import Runner, Settings, compiled_graphs

from lengthwise.cost.flops import sequence_model_flops
from lengthwise.files import write_atomic
from lengthwise.runtime.train.step import PeakMemory
from lengthwise.specs import model_preset

DEFAULT_CASES = "qwen2.5-0.5b:packing,qwen2.5-1.5b:packing,qwen2.5-1.5b:chunkflow@8192"
TINY_CASES = "tiny-qwen:packing,tiny-qwen:chunkflow@64"

KINDS = (  # (kind, substrings of a lower-cased kernel name), first match wins
    ("collective", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "sm90_", "sm100_")),
    ("triton", ("triton",)),
    ("copy", ("memcpy", "memset", "copy", "cat_", "catarray")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


def parse_case(text: str) -> tuple[str, str, int | None, str]:
    """(model, system, chunk size or None, variant: "", ":eager" or ":chain") of
    MODEL:SYSTEM[@N][:eager|:chain]."""
    model, _, rest = text.partition(":")
    variant = next((v for v in (":eager", ":chain") if rest.endswith(v)), "")
    rest = rest.removesuffix(variant)
    system, _, size = rest.partition("@")
    if not model or system not in ("packing", "chunkflow") or (size and not size.isdigit()):
        raise SystemExit(f"case {text!r}: use MODEL:packing or MODEL:chunkflow[@CHUNKSIZE], optionally :eager or :chain")
    return model, system, int(size) if size else None, variant


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def profiled(step) -> dict:
    """One call of `step` under torch.profiler: the breakdown described in the module docstring."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        wall_s, _ = step()
    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    by_kind: dict[str, dict] = {}
    by_name: dict[str, list] = {}
    for e in device:
        span = e.time_range.end - e.time_range.start
        row = by_kind.setdefault(kind_of(e.name), {"us": 0.0, "count": 0})
        row["us"] += span
        row["count"] += 1
        agg = by_name.setdefault(e.name, [0.0, 0])
        agg[0] += span
        agg[1] += 1
    busy = union_us([(e.time_range.start, e.time_range.end) for e in device])
    wall_us = wall_s * 1e6
    names = [e.name for e in events if e.device_type == DeviceType.CPU]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"wall_us": wall_us, "device_busy_us": busy,
            "device_idle_share": (1 - busy / wall_us) if device and wall_us > 0 else None,
            "kernels_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["us"])),
            "top_kernels": [{"name": n[:160], "us": us, "count": c, "kind": kind_of(n)} for n, (us, c) in top],
            "host": {"aten_ops": sum(n.startswith("aten::") for n in names),
                     "kernel_launches": sum(n in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                  "cuLaunchKernelEx") for n in names),
                     "compiled_graph_calls": sum(n.startswith("## Call CompiledFxGraph") for n in names),
                     "syncs": sum(n in SYNC_CALLS for n in names)}}


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _short(path: str) -> str:
    """A source path from the package or the benchmarks folder on: "lengthwise/runtime/x.py"."""
    for marker in ("/src/", "/benchmarks/"):
        if marker in path:
            return ("benchmarks/" if marker == "/benchmarks/" else "") + path.rsplit(marker, 1)[-1]
    return path


def sync_sites(step) -> dict[str, int] | None:
    """Where one call of `step` made the host wait for the device: PyTorch's sync debug mode
    warns at each synchronising operation; each warning is counted by the innermost frame of
    lengthwise's or this folder's code on the stack ("path:line"). None off CUDA."""
    if not torch.cuda.is_available():
        return None
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()[:-1]
        below = stack[max(i for i, f in enumerate(stack) if f.name == "sync_sites") + 1:]  # the step's frames
        ours = [f for f in below if "/lengthwise/" in f.filename or "/benchmarks/" in f.filename]
        where = f"{_short(ours[-1].filename)}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}"
        sites[where] = sites.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def run_case(case: str, dev: Device, args, profiles: dict) -> dict:
    model_name, system, chunk, variant = parse_case(case)
    spec = model_preset(model_name)
    tiny = args.tiny
    s = Settings(models=[model_name], contexts=[args.context], systems=[system], batch_size=args.batch_size,
                 warmup=0, steps=args.steps, chunk_size=str(chunk) if chunk else "auto", scan_contexts=[],
                 workload="tiny" if tiny else "chunkflow-eval", compile=False if variant == ":eager" else args.compile,
                 tiny=tiny)
    profile = profiles.get(model_name)
    batches = sample_batches(s.workload, args.context, args.batch_size, args.steps, args.seed)
    row: dict = {"case": case, "model": model_name, "system": system, "chunk_size": chunk, "context": args.context}
    runner = Runner(system + variant, spec, dev, s, profile, args.context)
    try:
        plans = [runner.prepare(lengths) for lengths in batches]
        tokens = [random_token_ids(lengths, spec.vocab, args.seed + i) for i, lengths in enumerate(batches)]

        def step(i):
            return timed(lambda: runner.step(batches[i], plans[i], tokens[i]), dev)

        graphs = compiled_graphs()
        warm = [step(i)[0] for i in range(len(batches))]  # every chunk length compiled once
        row["warmup_s"] = warm
        row["graphs_compiled_in_warmup"] = compiled_graphs() - graphs
        graphs = compiled_graphs()
        with PeakMemory(runner.model) as peak:
            times = [step(i)[0] for i in range(len(batches))]
        total_tokens = sum(sum(b) for b in batches)
        flops = sum(sequence_model_flops(spec, n) for b in batches for n in b)
        row.update(step_times_s=times, graphs_compiled_while_timed=compiled_graphs() - graphs,
                   tokens_per_s=total_tokens / sum(times),
                   mfu=flops / (sum(times) * dev.peak_tflops(None) * 1e12),
                   peak_memory_bytes=peak.bytes, memory_kind=peak.kind, compiled=runner.compiled,
                   plan=runner.plan_info, chunks_per_step=[sum(len(p.chunks) for p in plan.pipelines) for plan in plans])
        row["profiled_step"] = {"batch": 0, "tokens": sum(batches[0]), "unprofiled_s": times[0], **profiled(lambda: step(0))}
        row["sync_sites"] = sync_sites(lambda: runner.step(batches[0], plans[0], tokens[0]))
    finally:
        del runner
        gc.collect()
        empty_cache(dev)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", help=f"comma-separated MODEL:SYSTEM[@N][:eager|:chain] (default {DEFAULT_CASES})")
    ap.add_argument("--context", type=int, help="context length, tokens (default 32768; --tiny 256)")
    ap.add_argument("--batch-size", type=int, help="sequences a batch (default 64; --tiny 8)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (batches), each run once untimed first")
    ap.add_argument("--profile-file", action="append", default=[], metavar="MODEL=FILE",
                    help="a measured profile for the planners (ChunkSize auto); default: the analytic model")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the layers (default: on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU")
    ap.add_argument("--out", required=True, help="results JSON")
    args = ap.parse_args(argv)
    args.context = args.context or (256 if args.tiny else 32768)
    args.batch_size = args.batch_size or (8 if args.tiny else 64)
    dev = Device.pick("cpu" if args.tiny else "auto", "auto")
    from lengthwise.cost import Profile

    profiles = {}
    for item in args.profile_file:
        name, _, path = item.partition("=")
        profiles[name] = Profile.load(path)
    cases = (args.cases or (TINY_CASES if args.tiny else DEFAULT_CASES)).split(",")
    out = {"what": "one training step's device time by kernel kind, device idle share, host dispatch counts",
           "command": "python benchmarks/gpu_step_breakdown.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": dev.name, "torch": torch.__version__, "cases": []}
    for case in cases:
        try:
            out["cases"].append(run_case(case, dev, args, profiles))
        except RuntimeError as exc:  # out of memory and the like: recorded, the next case runs
            out["cases"].append({"case": case, "error": str(exc).splitlines()[0][:300]})
        c = out["cases"][-1]
        p = c.get("profiled_step", {})
        print(f"{case}: {c.get('tokens_per_s', 0):,.0f} tok/s, MFU {c.get('mfu', 0):.1%}, "
              f"idle {p.get('device_idle_share') or 0:.1%}, {c.get('error', '')}", file=sys.stderr, flush=True)
        write_atomic(Path(args.out), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
