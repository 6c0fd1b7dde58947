"""Fine-tuning throughput and memory on one GPU: transformers (padded, packed) against lengthwise
packing and ChunkFlow, on chunkflow-eval's long-tail lengths (chunkflow.txt §6).

    python benchmarks/bench_gpu_finetune.py                       # 0.5B + 1.5B, 32K + 128K, all systems (GPU)
    python benchmarks/bench_gpu_finetune.py --models qwen2.5-1.5b --contexts 32768 --systems chunkflow,packing
    python benchmarks/bench_gpu_finetune.py --profile-file qwen2.5-0.5b=p05.json --no-scan
    python benchmarks/bench_gpu_finetune.py --contexts 131072 --long-sequence 65536-131072 --systems chunkflow
    python benchmarks/bench_gpu_finetune.py --tiny --out /tmp/bench.json    # CPU, tiny model, a few seconds

Per model (Qwen2.5 architectures, random weights, bf16 weights, gradients and AdamW states) and
context length: `--warmup` + `--steps` global batches of `--batch-size` sequences from the
chunkflow-eval length profile (longer ones truncated to the context; with --long-sequence LO-HI one
sequence of each batch replaced by one of LO..HI tokens, so every step holds a sequence that
ChunkFlow must split), random token ids, and for
each system a fresh model and AdamW from the same seed, run over the same batches:

- hf-padded: transformers' model, right-padded micro-batches within a context-length token
  budget (hf_baselines.py);
- hf-packed: transformers' model, padding-free rows via position_ids, with the best attention
  transformers has without flash-attn: flex_attention (document BlockMask) where it can train,
  else SDPA; each hf row names its `attn_implementation` (hf_baselines.py);
- packing: lengthwise's `packing` plan on the lengthwise executor;
- chunkflow: lengthwise's `chunkflow` plan with (ChunkSize, K) from its grid search
  (chunk_size="auto", scored by the simulator with this device's measured profile).

Reported per system, over the measured steps: tokens/s (real tokens, not pads), MFU (the FLOPs of
training every sequence unpacked, attention included, as lengthwise.cost.flops.
sequence_model_flops counts them, over step time x peak: 989 TFLOP/s on H100/H200), peak memory
(torch.cuda.max_memory_allocated; on CPU the saved-for-backward bytes), planning time (not in the
step time: training plans a step ahead), the first step's loss (the same for every system: same
weights and tokens). Then ChunkFlow's peak memory at one fixed ChunkSize (K=1) on a batch whose
longest sequence grows 32K -> 64K -> 128K -> 256K, with the K/V state (and its gradient) the cost
model predicts subtracted. The first context's targets (issue 8) are checked into `targets`.
Out-of-memory or a planner's "does not fit" is recorded as that system's error, not raised.
The cost profile is measured first (bench_common.acquire_profile) unless --profile-file gives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_common import (
    RESULTS,
    Device,
    acquire_profile,
    allocated,
    empty_cache,
    is_oom,
    random_token_ids,
    sample_batches,
    slug,
    timed,
    with_long_sequence,
    write_results,
)
from finetune_checks import check_targets, chunkflow_ratios
from hf_baselines import (
    PACKED_ATTENTION,
    build_hf,
    check_packing_supported,
    configure_attention,
    hf_packed_step,
    hf_padded_step,
    packed_rows,
)

from lengthwise.cost import CostModel
from lengthwise.cost.flops import sequence_model_flops
from lengthwise.errors import UserError
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.execute import run_step
from lengthwise.runtime.compile import compile_layers, compile_wanted
from lengthwise.runtime.model import build_model
from lengthwise.runtime.profile import check_backend
from lengthwise.runtime.train.step import PeakMemory
from lengthwise.specs import ParallelScheme, model_preset

SYSTEMS = ("hf-padded", "hf-packed", "packing", "chunkflow")


@dataclass(kw_only=True)
class Settings:
    """One benchmark run's choices (the --tiny defaults in `tiny_settings`)."""

    models: list[str]
    """Model presets."""
    contexts: list[int]
    """Context lengths, tokens; the first one's results are checked against the targets."""
    systems: list[str]
    batch_size: int = 64
    """Sequences per global batch."""
    warmup: int = 2
    """Untimed steps first (allocator, kernels, AdamW states)."""
    steps: int = 4
    """Timed steps."""
    warm_timed: bool = False
    """Run every timed batch once untimed too, after the warm-up batches and before the timed
    steps: each of its chunk lengths has then compiled, so a timed step measures the step, not
    a compilation (`_measure`)."""
    chunk_size: str = "auto"
    """ChunkFlow's ChunkSize: "auto" (§5 grid search) or tokens."""
    scan_contexts: list[int] = dataclasses.field(default_factory=lambda: [32768, 65536, 131072, 262144])
    """Longest sequence of the memory scan's batches, tokens; empty skips the scan."""
    scan_chunk_size: int = 8192
    """The fixed ChunkSize of the memory scan, tokens."""
    workload: str = "chunkflow-eval"
    lr: float = 1e-5
    hf_checkpointing: bool = False
    """transformers' gradient checkpointing (off: the default a fine-tuning script starts from)."""
    peak_tflops: float | None = None
    """Peak FLOP/s for MFU (default: 989 on H100/H200, else the cluster preset's)."""
    long_sequence: tuple[int, int] | None = None
    """(low, high): each batch gets one sequence of low..high tokens in place of a sampled one."""
    hf_attention: str = "auto"
    """hf-packed's attention: auto (flex_attention where it trains, else sdpa), or one of them."""
    seed: int = 0
    compile: bool | None = None
    """torch.compile each decoder layer of lengthwise's model; None: on CUDA."""
    tiny: bool = False


def tiny_settings(args) -> Settings:
    """CPU-sized: tiny Qwen-shaped model, a 256-token context, ChunkSize 64, one timed step."""
    return Settings(models=["tiny-qwen"], contexts=[256], systems=_systems(args.systems), batch_size=8,
                    warmup=1, steps=1, warm_timed=args.warm_timed,
                    chunk_size=args.chunk_size if args.chunk_size != "auto" else "64",
                    scan_contexts=[] if args.no_scan else [128, 256, 512], scan_chunk_size=64,
                    workload="tiny", lr=args.lr, long_sequence=args.long_sequence, hf_attention=args.hf_attention,
                    seed=args.seed, tiny=True, compile=args.compile)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b", help="comma-separated presets")
    ap.add_argument("--contexts", default="32768,131072", help="comma-separated context lengths")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"some of {', '.join(SYSTEMS)}; packing:eager or chunkflow:eager: not compiled; "
                         "packing:chain or chunkflow:chain: compiled, up to four layers in one region, attention included")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warm-timed", action="store_true",
                    help="run each timed batch once untimed first (its chunk lengths compiled before it is timed)")
    ap.add_argument("--chunk-size", default="auto", help="ChunkFlow ChunkSize: auto or tokens")
    ap.add_argument("--scan-contexts", default="32768,65536,131072,262144")
    ap.add_argument("--scan-chunk-size", type=int, default=8192)
    ap.add_argument("--no-scan", action="store_true", help="skip the memory scan")
    ap.add_argument("--hf-checkpointing", action="store_true", help="gradient checkpointing for transformers")
    ap.add_argument("--hf-attention", default="auto", choices=PACKED_ATTENTION,
                    help="hf-packed attention: auto = flex_attention where it trains, else sdpa")
    ap.add_argument("--long-sequence", type=_length_range, metavar="LO-HI",
                    help="one sequence of LO..HI tokens per batch (at most the context), e.g. 65536-131072")
    ap.add_argument("--profile-file", action="append", default=[], metavar="MODEL=FILE",
                    help="use this measured profile for MODEL instead of measuring one")
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile each decoder layer of lengthwise's model (default: on CUDA)")
    ap.add_argument("--tiny", action="store_true", help="tiny model and sizes (runs on CPU in seconds)")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/gpu_finetune_<device>.json)")
    return ap.parse_args(argv)


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO-HI in tokens, e.g. 65536-131072") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < LO <= HI")
    return bounds


def _systems(text: str) -> list[str]:
    """The systems named; lengthwise's may carry ":eager" (its layers and head not compiled,
    whatever --compile says: compiled against eager in one process) or ":chain" (compiled with
    up to four layers in one region, attention included, `runtime/compile.py`)."""
    names = [s for s in text.split(",") if s]
    unknown = [s for s in names if s not in SYSTEMS and not (
        s.endswith((":eager", ":chain")) and s.removesuffix(":eager").removesuffix(":chain") in ("packing", "chunkflow"))]
    if unknown:
        raise SystemExit(f"unknown system {', '.join(unknown)}: use some of {', '.join(SYSTEMS)}")
    return names


def settings_from_args(args) -> Settings:
    if args.tiny:
        return tiny_settings(args)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    return Settings(models=args.models.split(","), contexts=ints(args.contexts), systems=_systems(args.systems),
                    batch_size=args.batch_size, warmup=args.warmup, steps=args.steps, warm_timed=args.warm_timed,
                    chunk_size=args.chunk_size,
                    scan_contexts=[] if args.no_scan else ints(args.scan_contexts),
                    scan_chunk_size=args.scan_chunk_size, lr=args.lr, hf_checkpointing=args.hf_checkpointing,
                    peak_tflops=args.peak_tflops, long_sequence=args.long_sequence, hf_attention=args.hf_attention,
                    seed=args.seed, compile=args.compile)


# ---- one system on one context -----------------------------------------------------------------

def plan_request(spec, dev: Device, profile, lengths, context, options) -> PlanRequest:
    cluster = dev.cluster()
    return PlanRequest(lengths=list(lengths), model=spec, cluster=cluster, scheme=ParallelScheme(),
                       cost=CostModel(model=spec, cluster=cluster, profile=profile), context_length=context,
                       options=options)


class Runner:
    """One system's model, optimizer and per-batch step."""

    def __init__(self, system: str, spec, dev: Device, s: Settings, profile, context: int):
        self.eager, self.chain = system.endswith(":eager"), system.endswith(":chain")
        system = system.removesuffix(":eager").removesuffix(":chain")
        self.system, self.spec, self.dev, self.s, self.profile, self.context = system, spec, dev, s, profile, context
        if system == "hf-packed":
            check_packing_supported()
        model = seeded_model(spec, dev, s.seed)
        self.compiled = not system.startswith("hf") and not self.eager and compile_wanted(s.compile, dev.device)
        if self.compiled:
            compile_layers(model, chain=self.chain)
        self.model = build_hf(model, checkpointing=s.hf_checkpointing) if system.startswith("hf") else model
        self.plan_ms, self.plan_info, self.splits = [], {}, []
        if self.model is not model:
            del model
            self.plan_info = configure_attention(self.model, system, s.hf_attention, spec.vocab)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=s.lr, fused=dev.cuda)

    def prepare(self, lengths: list[int]):
        """The step's plan (lengthwise systems), timed apart from the step."""
        if self.system == "hf-padded":
            return None
        if self.system == "hf-packed":
            return packed_rows(lengths, self.context)
        options = {} if self.system == "packing" else {"chunk_size": _chunk_size(self.s.chunk_size)}
        plan_s, plan = timed(lambda: get_planner(self.system)(
            plan_request(self.spec, self.dev, self.profile, lengths, self.context, options)), self.dev)
        self.plan_ms.append(plan_s * 1e3)
        self.plan_info = {k: plan.metrics[k] for k in ("chunk_size", "k") if k in plan.metrics}
        self.splits.append(split_sequences(plan))
        return plan

    def step(self, lengths, plan, token_ids) -> float:
        if self.system == "hf-padded":
            loss = hf_padded_step(self.model, lengths, token_ids, budget=self.context)
        elif self.system == "hf-packed":
            loss = hf_packed_step(self.model, plan, lengths, token_ids)
        else:
            loss = run_step(self.model, plan, token_ids, backend="auto")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)


_INITIAL: dict[tuple, dict[str, torch.Tensor]] = {}
"""Each (model, dtype, seed)'s seeded weights, kept on the host after the first build."""


def seeded_model(spec, dev: Device, seed: int):
    """`build_model(spec, seed=seed)` on the device, every system from the same weights. The
    seeded initialiser draws float64 noise on the host, one generator per parameter (2.4 s per
    100M parameters on a 2-core x86 CI machine: 37 s for 1.5B); the first build's weights are kept on the host and
    copied into the next systems' models instead of drawn again (same values, bit for bit)."""
    key = (spec.name, dev.dtype, seed)
    if key not in _INITIAL:
        model = build_model(spec, dtype=dev.dtype, device=dev.device, seed=seed)
        _INITIAL[key] = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        return model
    model = build_model(spec, dtype=dev.dtype, device=dev.device)  # storage only, filled below
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_INITIAL[key][name])
    return model


def split_sequences(plan) -> int:
    """How many sequences the plan cuts into more than one segment."""
    return len({seg.seq_id for p in plan.pipelines for c in p.chunks for seg in c.segments
                if seg.start > 0 or seg.stop < plan.lengths[seg.seq_id]})


def _chunk_size(text: str):
    return "auto" if text == "auto" else int(text)


def run_system(system: str, spec, dev: Device, s: Settings, profile, context: int, batches) -> dict:
    row = {"system": system, "context": context}
    runner = None
    try:
        runner = Runner(system, spec, dev, s, profile, context)
        row.update(_measure(runner, batches, dev, s, spec))
    except (UserError, RuntimeError) as exc:
        if not (isinstance(exc, UserError) or is_oom(exc)):
            raise
        row["error"] = ("out of memory: " if is_oom(exc) else "") + str(exc).splitlines()[0][:300]
    finally:
        del runner
        gc.collect()
        empty_cache(dev)
    return row


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's own count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _measure(runner: Runner, batches, dev: Device, s: Settings, spec) -> dict:
    """Throughput over the timed steps that compiled nothing. A compiled layer recompiles when a
    chunk crosses a size its kernels were specialised for (inductor's size guards). On the H200
    the 1.5B chunkflow step whose batch first held a short chunk (1,512 tokens) took 6.6 s
    against 0.9 s for the step before; on CPU the same chunks recompile both layer regions at
    that step (guard `4097 <= tokens`). Such a step is a one-time cost, not the step time: it is reported
    (`steps_compiling`, `step_times_s`) and left out of tokens/s and MFU, unless every timed step
    compiled (then all are kept and `steady` is false). With `warm_timed` every timed batch runs
    once untimed first, so that no timed step compiles (the suite's 128K row times one step: at
    6010257 its chunkflow step compiled two graphs while timed, 13.9 s against packing's 6.3).
    Each batch is planned once; `losses` holds every step's loss in the order run."""
    rows, losses, plans = [], [], {}

    def run(i: int):
        lengths = batches[i]
        if i not in plans:
            plans[i] = runner.prepare(lengths)
        token_ids = random_token_ids(lengths, spec.vocab, s.seed + i)
        graphs = compiled_graphs()
        with PeakMemory(runner.model) as peak:
            seconds, loss = timed(functools.partial(runner.step, lengths, plans[i], token_ids), dev)
        losses.append(loss)
        return {"seconds": seconds, "lengths": lengths, "peak": peak.bytes, "memory_kind": peak.kind,
                "new_graphs": compiled_graphs() - graphs}

    timed_batches = range(s.warmup, len(batches))
    for i in [*range(s.warmup), *(timed_batches if s.warm_timed else ())]:
        run(i)
    rows = [run(i) for i in timed_batches]
    steady = [r for r in rows if not r["new_graphs"]]
    kept = steady or rows
    total = sum(r["seconds"] for r in kept)
    tokens = sum(sum(r["lengths"]) for r in kept)
    flops = sum(sequence_model_flops(spec, n) for r in kept for n in r["lengths"])
    times = [r["seconds"] for r in rows]
    return {"tokens_per_s": tokens / total, "mfu": flops / (total * dev.peak_tflops(s.peak_tflops) * 1e12),
            "step_time_s": statistics.fmean(r["seconds"] for r in kept), "step_times_s": times, "tokens": tokens,
            "steady": bool(steady), "steps_compiling": [i for i, r in enumerate(rows) if r["new_graphs"]],
            "new_graphs_per_step": [r["new_graphs"] for r in rows], "warm_timed": s.warm_timed,
            "longest_per_step": [max(r["lengths"]) for r in rows], "peaks": [r["peak"] for r in rows],
            "peak_memory_bytes": max(r["peak"] for r in rows), "memory_kind": rows[0]["memory_kind"], "first_loss": losses[0], "losses": losses,
            "planning_ms_mean": statistics.fmean(runner.plan_ms) if runner.plan_ms else None,
            **({"split_sequences_per_step": runner.splits[s.warmup:]} if runner.splits else {}), **runner.plan_info,
            "compiled": runner.compiled}


# ---- memory scan ---------------------------------------------------------------------------------

def memory_scan(spec, dev: Device, s: Settings, profile, shorts: list[int]) -> list[dict]:
    """ChunkFlow (fixed ChunkSize, K = 1) on one long sequence of each scan length plus the
    first batch's sequences that fit a chunk; peak memory above weights and gradients."""
    model = build_model(spec, dtype=dev.dtype, device=dev.device, seed=s.seed)
    cm = CostModel(model=spec, cluster=dev.cluster(), profile=profile)
    rows = []
    for i, longest in enumerate([s.scan_contexts[0], *s.scan_contexts]):  # the first run warms up
        lengths = [longest] + shorts
        row = {"longest": longest, "chunk_size": s.scan_chunk_size}
        try:
            plan = get_planner("chunkflow")(plan_request(spec, dev, profile, lengths, longest,
                                                         {"chunk_size": s.scan_chunk_size, "k": 1}))
            token_ids = random_token_ids(lengths, spec.vocab, s.seed)
            base = allocated(dev)
            with PeakMemory(model) as peak:
                run_step(model, plan, token_ids, backend="auto")
            model.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline
            context = s.scan_chunk_size * ((longest - 1) // s.scan_chunk_size)
            # K/V state + its gradient buffers (infinipipe eq. 9-10); the CPU meter sees only the
            # K/V that attention saves, not the gradient buffers
            kv = (2 if dev.cuda else 1) * cm.kv_bytes(context, layers=spec.num_layers)
            row.update(peak_bytes=peak.bytes - base, kv_state_bytes=kv, peak_minus_kv_bytes=peak.bytes - base - kv,
                       memory_kind=peak.kind)
        except (UserError, RuntimeError) as exc:
            if not (isinstance(exc, UserError) or is_oom(exc)):
                raise
            row["error"] = str(exc).splitlines()[0][:300]
        if i > 0:
            rows.append(row)
    del model
    empty_cache(dev)
    return rows


def scan_spread(rows: list[dict]) -> float | None:
    """(max - min) / min of peak memory minus K/V state over the scan."""
    values = [r["peak_minus_kv_bytes"] for r in rows if "peak_minus_kv_bytes" in r]
    return (max(values) - min(values)) / min(values) if len(values) >= 2 and min(values) > 0 else None


# ---- per model, targets, output -------------------------------------------------------------------

def bench_model(name: str, dev: Device, s: Settings, profile_files: dict, out_dir: Path, entry: dict,
                save=lambda: None) -> None:
    """Fill `entry` with the model's runs, calling `save` after each (a run cut short by a
    time limit keeps the systems it finished)."""
    spec = model_preset(name)
    profile, path = acquire_profile(spec, dev, tiny=s.tiny, given=profile_files.get(name), out_dir=out_dir)
    entry.update({"profile_file": path, "profile_held_out_error": profile.meta.get("held_out_error"), "runs": []})
    if dev.cuda:
        entry["varlen_check"] = check_backend("varlen", device=dev.device, dtype=dev.dtype, heads=spec.num_heads,
                                              kv_heads=spec.num_kv_heads, head_dim=spec.head_dim).to_dict()
    first_batch = None
    for context in s.contexts:
        batches = sample_batches(s.workload, context, s.batch_size, s.warmup + s.steps, s.seed)
        if s.long_sequence:
            batches = with_long_sequence(batches, *s.long_sequence, seed=s.seed)
        first_batch = first_batch or batches[0]
        for system in s.systems:
            entry["runs"].append(run_system(system, spec, dev, s, profile, context, batches))
            print(_row_line(name, entry["runs"][-1]), file=sys.stderr)
            save()
    if s.scan_contexts:
        shorts = [n for n in first_batch if n <= s.scan_chunk_size][: s.batch_size - 1]
        entry["memory_scan"] = memory_scan(spec, dev, s, profile, shorts)
        entry["memory_scan_spread"] = scan_spread(entry["memory_scan"])


def _row_line(model: str, r: dict) -> str:
    head = f"{model:<14}{r['context']:>8}  {r['system']:<10}"
    if "error" in r:
        return head + f"  {r['error'][:90]}"
    return (head + f"{r['tokens_per_s']:>12,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"peak {r['peak_memory_bytes'] / 2**30:7.2f} GiB  step {r['step_time_s']:.3f} s  "
            f"loss {r['first_loss']:.4f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    s = settings_from_args(args)
    dev = Device.pick(args.device, args.dtype)
    if not dev.cuda and not s.tiny:
        raise SystemExit("full sizes need a GPU; on CPU add --tiny")
    if s.long_sequence and s.long_sequence[1] > min(s.contexts):
        print(f"--long-sequence {s.long_sequence[1]} exceeds the context {min(s.contexts)}: lower HI or raise "
              "--contexts", file=sys.stderr)
        return 2
    profile_files = dict(text.split("=", 1) for text in args.profile_file)
    out = Path(args.out) if args.out else RESULTS / f"gpu_finetune_{'tiny_' if s.tiny else ''}{slug(dev.name)}.json"
    import transformers

    results = {"format": "lengthwise.bench_gpu_finetune/1", **dev.describe(),
               "transformers": transformers.__version__, "seed": s.seed,
               "settings": dataclasses.asdict(s), "complete": False, "models": {}}

    def save():
        results.update(targets=check_targets(results["models"], s), ratios=chunkflow_ratios(results["models"]))
        write_results(out, results, __file__, argv)

    for name in s.models:
        results["models"][name] = {}
        bench_model(name, dev, s, profile_files, out.parent, results["models"][name], save)
    results["complete"] = True
    save()
    for c in results["targets"]:
        print(f"{c['check']}: {c['value']} (target {c['target']}): {c['met']}", file=sys.stderr)
    for r in results["ratios"]:
        print(f"{r['model']} @{r['context']}: {r['ratio']}: {r['value']:.3f}", file=sys.stderr)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
