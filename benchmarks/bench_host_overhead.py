"""Host time per layer and chunk: the executor's Python and dispatch cost, on tiny shapes where the
arithmetic is nothing, before and after the hot-path work (issue 26).

    python benchmarks/bench_host_overhead.py                 # writes benchmarks/results/host_overhead.json
    python benchmarks/bench_host_overhead.py --rounds 3 --steps 5 --no-inductor   # quick look
    python benchmarks/bench_host_overhead.py --device cuda --variants after       # on a GPU (gpu_suite)

What is timed: one training step (forward and backward, `run_step`) of a plan with a split
sequence and packed rows — sequence 0 cut into three slices, two of them sharing a row with a
short document — on a tiny model (hidden 32, 4 query heads, 2 K/V heads), float32, one thread.
The same step with 8 and with 4 decoder layers (`FEW`, `MANY`): the difference over (4 layers x 3
chunks) is the time one layer costs one chunk, forward and backward, without the embedding, head
and loss. Four layers apart, because the chained variant runs up to four layers in one compiled
region (`model.CHAIN_LAYERS`): 8 layers make one region more than 4, so the difference holds a
region's call as a deep stage pays it, a quarter of it per layer (with 2 and 4 layers both would
be one region, and the difference would leave the call out).

Variants, each in its own process, all timed in turns in one run (the machine's load is shared
alike):
- `before`: the package as of `--old-rev` (default: the commit this work started from),
  exported from git into a temporary folder;
- `after`: this checkout, eager;
- `after+compile`: this checkout with each decoder layer compiled (`--compile-backend`,
  default inductor; `--no-inductor` uses aot_eager, which traces but does not fuse);
- `after+compile+chain`: the same, compiled with `chain` (up to four layers in one compiled
  region, attention included, `runtime/compile.py`): on a CPU this plan's rows are small, so
  each row's attention is traced whole into the region (`flash_cpu.dense_row`, one masked
  kernel call);
- `after+compile+chain+operator`: chained with the attention held as an operator
  (`row_op.flash_row`, `flash_cpu.DENSE_ENTRIES` 0), the path a GPU's regions take and a CPU's
  larger rows: what the chain costs where the row's Python still runs inside it.
Reported: the median over rounds of each variant's per-layer-chunk time, and before / after;
for the eager variants also the time of the ATen calls alone (`replay`: every operator call the
step dispatched below autograd, recorded once and made again in a loop, no autograd, none of
the executor's Python): what is left when all the code around the calls costs nothing, so
`replayed_share_of_step` near 1 says the step's host time is its operator calls, and a lower
per-layer time needs fewer calls;
and, apart, the varlen (CUDA) path's index and key-packing host work per layer and chunk
(`varlen_index_work`), which the CPU step above does not run.

Three more variants measure PyTorch's own floor, with nothing of lengthwise in it (`floor_worker`):
the same layer shapes written as the plain expressions a model file has (RMSNorm, q/k/v with
biases, rotary embedding, one causal `scaled_dot_product_attention` call over the chunk's own
tokens, no earlier K/V, output projection, SwiGLU), each chunk through the layers forward and
back (`.sum().backward()`), the same chunk lengths (8, 16, 16 tokens), the same 8-minus-4-layer
difference: `floor` eager, `floor+compile` with every layer compiled whole (one graph forward,
one backward; the compile backend as above), `floor+compile+chain` with four layers in one
compiled function as the chained executor runs them. What `floor` and `floor+compile` cost is
what any executor that calls PyTorch once per layer and chunk pays on this host, however little
else it does; `floor+compile+chain` is the floor of calling it once per four layers (its
attention still sees no earlier K/V, so its row is simpler than the executor's).
Times are the CPU time of the process's main thread (`time.thread_time`, torch on one thread),
not wall time: on a shared machine a process also waits for a core, which is not the host
cost of the code. With `--device cuda` (bfloat16, the varlen backend: the GPU path) they are
wall times of the step with the device synchronised at its end: on these shapes the device
waits for the host, so the wall time is the host's, synchronising copies included, which the
CPU step cannot show. `before` needs the old revision's source: git here, or `--old-src` (a
`src/` folder exported beforehand, e.g. `git archive 1b723e1 src | tar -x -C /tmp/old`, where
the machine has no git history); `--variants` picks which variants run. Beside them, exact counts per layer and chunk that no machine's load moves:
ATen operator calls, autograd nodes run in backward, calls into compiled graphs
(`dispatch_counts`); and each variant's warm-up wall time (`warmup_s`: three steps of each model,
compilation included for the compiled variants).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OLD_REV = "1b723e1"
"""The commit before the hot-path work (branch `hotpath`'s start)."""
LENGTHS = [24, 8, 8]
CHUNKS = "0[0:8] 0[8:16]+1[0:8] 0[16:24]+2[0:8]"
ACTIONS = "F0 F1 F2 B2 B1 B0"
NUM_CHUNKS = 3
FEW, MANY = 4, 8
"""The two depths whose steps are timed (module docstring)."""
SAMPLES = (MANY - FEW) * NUM_CHUNKS
"""Layer-chunks the deeper step runs more."""
VARIANTS = ("before", "after", "after+compile", "after+compile+chain", "after+compile+chain+operator", "floor",
            "floor+compile", "floor+compile+chain")
COUNTS = ("aten_ops", "dispatched_ops", "autograd_nodes", "compiled_graph_calls")
"""Per layer and chunk, counted once per variant (`dispatch_counts`)."""


def worker(compile_backend: str | None, steps: int, device: str = "cpu", chain: bool = False,
           operator: bool = False) -> None:
    """Build the two models, warm up, then time `steps` steps of each whenever a line arrives."""
    import torch

    if operator:
        from lengthwise.runtime import flash_cpu

        flash_cpu.DENSE_ENTRIES = 0

    from lengthwise.plan.ir import Action, Chunk, PipelinePlan, StepPlan
    from lengthwise.runtime.execute import run_step
    from lengthwise.runtime.model import build_model
    from lengthwise.specs import ModelSpec, cluster_preset

    torch.set_num_threads(1)
    cuda = device == "cuda"
    dtype, backend = (torch.bfloat16, "varlen") if cuda else (torch.float32, "cpu-flash")

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    models, plans = {}, {}
    for layers in (FEW, MANY):
        spec = ModelSpec(name=f"tiny-{layers}", num_layers=layers, hidden=32, num_heads=4, num_kv_heads=2,
                         head_dim=8, ffn=48, vocab=64)
        models[layers] = build_model(spec, dtype=dtype, device=device, seed=0)
        if compile_backend:
            from lengthwise.runtime.compile import compile_layers

            compile_layers(models[layers], backend=compile_backend, chain=chain)
        plans[layers] = StepPlan(planner="hand", model=spec, cluster=cluster_preset("cpu", 1), lengths=LENGTHS,
                                 pipelines=[PipelinePlan(chunks=[Chunk.parse(c) for c in CHUNKS.split()],
                                                         stages=[[Action.parse(a) for a in ACTIONS.split()]])])
    tokens = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(LENGTHS)]

    def step(layers: int) -> float:
        model = models[layers]
        model.zero_grad(set_to_none=True)
        started = clock()
        loss = run_step(model, plans[layers], tokens, backend=backend)
        float(loss)
        return clock() - started

    warm = time.perf_counter()
    for _ in range(3):  # warm-up (and compilation)
        step(FEW), step(MANY)
    warm = time.perf_counter() - warm
    counts = {layers: dispatch_counts(lambda: step(layers)) for layers in (FEW, MANY)}
    per_layer_counts = {kind: (counts[MANY][kind] - counts[FEW][kind]) / SAMPLES for kind in counts[FEW]}
    # eager only: a compiled graph's own kernels are no ATen calls, and a dispatch mode around
    # a compiled region changes what it runs
    calls = None if compile_backend else {layers: recorded_calls(lambda: step(layers)) for layers in (FEW, MANY)}
    per_layer_counts["dispatched_ops"] = calls and (len(calls[MANY]) - len(calls[FEW])) / SAMPLES
    varlen_index = varlen_index_work()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print("ready " + json.dumps({"device": name, "torch": torch.__version__, "warmup_s": warm}), flush=True)
    for _ in sys.stdin:
        times = {layers: [] for layers in (FEW, MANY)}
        for _ in range(steps):
            for layers in (FEW, MANY):
                times[layers].append(step(layers))
        few, many = statistics.median(times[FEW]), statistics.median(times[MANY])
        replays = calls and {layers: statistics.median(replay(calls[layers], clock) for _ in range(steps))
                             for layers in (FEW, MANY)}
        print(json.dumps({f"step_{FEW}_layers_s": few, f"step_{MANY}_layers_s": many,
                          "per_layer_chunk_s": (many - few) / SAMPLES,
                          "replay_per_layer_chunk_s": replays and (replays[MANY] - replays[FEW]) / SAMPLES,
                          "varlen_index_per_layer_chunk_s": varlen_index(), **per_layer_counts}), flush=True)


FLOOR_CHUNK_TOKENS = (8, 16, 16)
"""Tokens of the plan's three chunks (`CHUNKS`), for `floor_worker`."""


def floor_worker(compile_backend: str | None, steps: int, chain: bool = False) -> None:
    """`worker`'s protocol for PyTorch's floor (module docstring): plain-expression layers of the
    same shapes, each chunk forward and backward through 2 and through 4 of them."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    hidden, heads, kv_heads, head_dim, ffn = 32, 4, 2, 8, 48

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    class PlainLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.Parameter(torch.ones(hidden)), nn.Parameter(torch.ones(hidden))
            self.q = nn.Linear(hidden, heads * head_dim)
            self.k = nn.Linear(hidden, kv_heads * head_dim)
            self.v = nn.Linear(hidden, kv_heads * head_dim)
            self.o = nn.Linear(heads * head_dim, hidden, bias=False)
            self.gate = nn.Linear(hidden, ffn, bias=False)
            self.up = nn.Linear(hidden, ffn, bias=False)
            self.down = nn.Linear(ffn, hidden, bias=False)

        def forward(self, h, cos, sin):
            tokens = h.shape[0]
            x = norm(h, self.norm1)
            q = rotate(self.q(x).view(tokens, heads, head_dim), cos, sin).transpose(0, 1)
            k = rotate(self.k(x).view(tokens, kv_heads, head_dim), cos, sin).transpose(0, 1)
            v = self.v(x).view(tokens, kv_heads, head_dim).transpose(0, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + self.o(out.transpose(0, 1).reshape(tokens, heads * head_dim))
            x = norm(h, self.norm2)
            return h + self.down(F.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    stacks = {layers: [PlainLayer() for _ in range(layers)] for layers in (FEW, MANY)}
    if compile_backend and not chain:
        for stack in stacks.values():
            for layer in stack:
                layer.compile(backend=compile_backend, dynamic=True)

    def run(layers, h, cos, sin):
        for layer in layers:
            h = layer(h, cos, sin)
        return h

    region = torch.compile(run, backend=compile_backend, dynamic=True) if chain else run
    group = 4 if chain else 1
    chunks = []
    for tokens in FLOOR_CHUNK_TOKENS:
        angles = torch.arange(tokens, dtype=torch.float32)[:, None, None] * torch.ones(head_dim)
        chunks.append((torch.randn(tokens, hidden, requires_grad=True), angles.cos(), angles.sin()))

    def step(layers: int) -> float:
        started = time.thread_time()
        for h, cos, sin in chunks:
            for at in range(0, layers, group):
                h = region(stacks[layers][at:at + group], h, cos, sin)
            h.sum().backward()
        return time.thread_time() - started

    for _ in range(3):  # warm-up (and compilation)
        step(FEW), step(MANY)
    print("ready " + json.dumps({"device": "cpu", "torch": torch.__version__}), flush=True)
    for _ in sys.stdin:
        times = {layers: [step(layers) for _ in range(steps)] for layers in (FEW, MANY)}
        few, many = statistics.median(times[FEW]), statistics.median(times[MANY])
        print(json.dumps({f"step_{FEW}_layers_s": few, f"step_{MANY}_layers_s": many,
                          "per_layer_chunk_s": (many - few) / SAMPLES}), flush=True)


def dispatch_counts(run) -> dict[str, int]:
    """What one call of `run` dispatches, counted by the profiler (exact, unlike times on a
    shared machine): ATen operator calls (nested ones included), autograd nodes run in
    backward (parameters' gradient accumulation included), and calls into compiled graphs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    names = [event.name for event in prof.events()]
    return {"aten_ops": sum(name.startswith("aten::") for name in names),
            "autograd_nodes": sum(name.startswith("autograd::engine::evaluate_function") for name in names),
            "compiled_graph_calls": sum(name.startswith("## Call CompiledFxGraph") for name in names)}


def recorded_calls(run) -> list:
    """Every ATen operator call one call of `run` dispatches below autograd (forward, backward
    and the optimizer-free step's glue), with its arguments, for `replay`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        run()
    return recorder.calls


def replay(calls, clock=time.thread_time) -> float:
    """CPU seconds to make the recorded operator calls again, one after the other, without
    autograd or any of the executor's Python: the floor that what the step dispatches sets,
    whatever the code around it (the calls write into tensors of the recorded run, no grad)."""
    import torch

    with torch.no_grad():
        started = clock()
        for func, args, kwargs in calls:
            func(*args, **kwargs)
        return clock() - started


VARLEN_LAYERS = 28
"""Layers the varlen index is shared by in `varlen_index_work` (Qwen2.5-1.5B's 28)."""


def varlen_index_work():
    """A timer of the varlen path's index and key-packing work for one layer of a chunk holding
    a slice with a 16-token context and a short document, on CPU tensors. Before: per layer,
    cu_seqlens from Python lists and the context concatenated to the row's keys and values
    (`ChunkLayout.cu_seqlens`, `pack_keys`). After: the chunk's RowIndex, built once and
    shared by its layers (its cost / VARLEN_LAYERS); nothing per layer. On a GPU the
    per-layer host-to-device copies of the old path also wait for the device: not counted."""
    import torch

    from lengthwise.plan.ir import Chunk
    from lengthwise.runtime import layout as layout_module

    layout = layout_module.ChunkLayout.from_chunk(Chunk.parse("0[16:24]+2[0:8]"))
    k, v = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    context = [[torch.randn(16, 2, 8)], []]
    if hasattr(layout_module.ChunkLayout, "cu_seqlens"):
        def one():
            layout.cu_seqlens("cpu")
            layout_module.pack_keys(k, context, layout)
            layout_module.pack_keys(v, context, layout)
        per = 1
    else:
        def one():
            layout_module.RowIndex.build(layout, "cpu", varlen=True)
        per = VARLEN_LAYERS

    def timer(repeats: int = 2000) -> float:
        started = time.thread_time()
        for _ in range(repeats):
            one()
        return (time.thread_time() - started) / repeats / per
    return timer


def old_source(rev: str, into: Path) -> Path:
    """`src/` of the package at `rev`, exported from git."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def start(src: Path, compile_backend: str | None, steps: int, device: str,
          floor: bool = False, chain: bool = False, operator: bool = False) -> tuple[subprocess.Popen, dict]:
    """A worker process on `src`'s package (or PyTorch's floor), ready, and what it runs on."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    args = [sys.executable, __file__, "--floor-worker" if floor else "--worker", "--steps", str(steps),
            "--device", device]
    if compile_backend:
        args += ["--compile-backend", compile_backend]
    if chain:
        args += ["--chain"]
    if operator:
        args += ["--operator"]
    proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        raise SystemExit(f"worker for {src} ({compile_backend or 'eager'}) failed to start: {line!r}")
    return proc, json.loads(line.removeprefix("ready "))


def ask(proc: subprocess.Popen) -> dict:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--floor-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-backend", help=argparse.SUPPRESS)
    ap.add_argument("--chain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--operator", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--old-rev", default=OLD_REV, help=f"git revision of `before` (default {OLD_REV})")
    ap.add_argument("--rounds", type=int, default=7, help="turns of every variant (default 7)")
    ap.add_argument("--steps", type=int, default=10, help="steps per turn, median kept (default 10)")
    ap.add_argument("--no-inductor", action="store_true", help="compile with aot_eager instead of inductor")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated of {', '.join(VARIANTS)} (default all; the floors on CPU only)")
    ap.add_argument("--old-src", help="the old revision's src/ folder for `before` (default: exported from git)")
    ap.add_argument("--out", default=str(RESULTS / "host_overhead.json"))
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.compile_backend, args.steps, args.device, args.chain, args.operator)
        return 0
    if args.floor_worker:
        floor_worker(args.compile_backend, args.steps, args.chain)
        return 0
    compile_backend = "aot_eager" if args.no_inductor else "inductor"
    wanted = args.variants.split(",")
    if not set(wanted) <= set(VARIANTS):
        raise SystemExit(f"--variants {args.variants!r}: use {', '.join(VARIANTS)}")
    if args.device == "cuda":
        wanted = [name for name in wanted if not name.startswith("floor")]  # CPU time only
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"before": lambda: (Path(args.old_src) if args.old_src else old_source(args.old_rev, Path(tmp)), None),
                   "after": lambda: (ROOT / "src", None),
                   "after+compile": lambda: (ROOT / "src", compile_backend),
                   "after+compile+chain": lambda: (ROOT / "src", compile_backend),
                   "after+compile+chain+operator": lambda: (ROOT / "src", compile_backend),
                   "floor": lambda: (ROOT / "src", None),
                   "floor+compile": lambda: (ROOT / "src", compile_backend),
                   "floor+compile+chain": lambda: (ROOT / "src", compile_backend)}
        variants = {name.replace("+compile", f"+compile({compile_backend})"):
                    (*sources[name](), name.startswith("floor"), "+chain" in name, name.endswith("+operator"))
                    for name in wanted}
        started = {name: start(src, backend, args.steps, args.device, floor, chain, operator)
                   for name, (src, backend, floor, chain, operator) in variants.items()}
        procs = {name: proc for name, (proc, _) in started.items()}
        machine = next(iter(started.values()))[1]
        warmup = {name: round(ready["warmup_s"], 2) for name, (_, ready) in started.items() if "warmup_s" in ready}
        runs = {name: [] for name in procs}
        for _ in range(args.rounds):
            for name, proc in procs.items():
                runs[name].append(ask(proc))
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    per = {name: statistics.median(r["per_layer_chunk_s"] for r in rs) for name, rs in runs.items()}
    replayed = {name: statistics.median(r["replay_per_layer_chunk_s"] for r in rs) for name, rs in runs.items()
                if rs[0].get("replay_per_layer_chunk_s") is not None}
    index = {name: statistics.median(r["varlen_index_per_layer_chunk_s"] for r in rs) for name, rs in runs.items()
             if "varlen_index_per_layer_chunk_s" in rs[0]}
    counted = {kind: {name: rs[0][kind] for name, rs in runs.items() if kind in rs[0]} for kind in COUNTS}
    result = {
        "what": "host time per decoder layer and chunk, forward + backward, tiny model (arithmetic ~0)",
        "command": "python benchmarks/bench_host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "plan": {"lengths": LENGTHS, "chunks": CHUNKS, "actions": ACTIONS},
        "device": machine["device"], "torch": machine["torch"],
        "clock": "wall, device synchronised" if args.device == "cuda" else "main thread CPU time",
        "old_rev": None if "before" not in per else args.old_src or args.old_rev,
        "rounds": args.rounds, "steps_per_round": args.steps,
        "per_layer_chunk_us": {name: round(s * 1e6, 1) for name, s in per.items()},
        "ratio_before_over_after": {name: round(per["before"] / s, 2) for name, s in per.items()
                                    if name != "before" and "before" in per},
        "a_third_of_before_us": round(per["before"] / 3 * 1e6, 1) if "before" in per else None,
        "replayed_calls_per_layer_chunk_us": {name: round(t * 1e6, 1) for name, t in replayed.items()},
        "replayed_share_of_step": {name: round(replayed[name] / per[name], 2) for name in replayed},
        "varlen_index_per_layer_chunk_us": {name: round(t * 1e6, 3) for name, t in index.items()},
        "varlen_index_ratio_before_over_after": (round(index["before"] / index["after"], 1)
                                                 if {"before", "after"} <= set(index) else None),
        **{f"{kind}_per_layer_chunk": counted[kind] for kind in COUNTS},
        "warmup_s": warmup,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=1) + "\n")
    tmp_out.replace(out)
    print(json.dumps({k: result[k] for k in ("per_layer_chunk_us", "ratio_before_over_after", "a_third_of_before_us",
                                             "replayed_calls_per_layer_chunk_us", "replayed_share_of_step",
                                             "varlen_index_per_layer_chunk_us",
                                             "varlen_index_ratio_before_over_after",
                                             *(f"{kind}_per_layer_chunk" for kind in COUNTS))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
