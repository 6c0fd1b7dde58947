"""The LM head backward's softmax gradient on one block of logits, as the step compiles it and
in variants of that compilation: time per call, bandwidth, and agreement with the eager path.

    PYTHONPATH=src:benchmarks python3 benchmarks/bench_softmax_grad.py --out OUT.json   # a GPU, ~1 minute
    python benchmarks/bench_softmax_grad.py --tiny --out /tmp/softmax_grad.json       # CPU, seconds

Why: in the H200 step breakdown (`results/gpu-2026-11-28-nvidia-h200/breakdown/`) the compiled
softmax gradient (`loss._fused_softmax_grad`, one pointwise kernel per column block: read the
bf16 logits, write the bf16 gradient) took 17 ms of a 0.5B step at about 0.84 TB/s, a fifth of
the H200's bandwidth. Its block width is a symbol in the compiled code (dynamic shapes), so each
element's row and column come from a division of its flat index by that symbol. The variants
say whether that is what it costs:

- `eager`: the eager path (a wide copy, then `loss._softmax_grad_in_place`: four passes on it);
- `dynamic`: as the step compiles it (`compile.compiled`: dynamic shapes, the backend given);
- `nd-tiling`: the same with inductor's `triton.prefer_nd_tiling` (rows and columns from two
  grid axes, no division; inductor only);
- `static-width`: the width marked static (`torch._dynamo.mark_static`): a graph per width,
  rows still dynamic.

Shapes (GPU): Qwen2.5-0.5B's step at 23,845 tokens, whose column blocks are 2,688 wide (the last
1,408 of 151,936), bf16 logits, float32 row vectors, as `_BlockedHeadLoss.backward` calls it.
--tiny: 64 rows, blocks of 256 and 96 columns, float32, aot_eager (no inductor on a CPU test).
Every variant's output is compared with the eager one (`max_abs_diff`, and `agrees` within the
output dtype's rounding of values at most 1). Times: median over `--repeats` calls after
warm-up (compilation), the device synchronised around each call; bandwidth counts the block
read and the gradient written once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench_common import write_results
from lengthwise.runtime.loss import _fused_softmax_grad, _softmax_grad_in_place, block_rows
from lengthwise.runtime.profile import device_name, synchronize

QWEN_VOCAB = 151_936
STEP_TOKENS = 23_845
"""The 0.5B breakdown step's tokens (its batch 0)."""
VARIANTS = ("eager", "dynamic", "nd-tiling", "static-width")


def inputs(rows: int, columns: int, dtype: torch.dtype, device, seed: int = 0):
    """A block's logits, its rows' log-sum-exps (of these logits, so that the softmax is one's),
    label columns (some outside the block), whether the block holds them, and the rows' scales."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x_TC = (torch.randn(rows, columns, generator=gen) * 3).to(dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    lse_T = torch.logsumexp(x_TC.to(wide), -1)
    local_T = torch.randint(-columns // 4, columns + columns // 4, (rows,), generator=gen)
    hit_T = (local_T >= 0) & (local_T < columns)
    scale_T = torch.rand(rows, generator=gen, dtype=wide)
    return [t.to(device) for t in (x_TC, lse_T, local_T, hit_T, scale_T)], wide


def variant(name: str, backend: str):
    """fn(x_TC, lse_T, local_T, hit_T, scale_T, wide) for the variant, or a reason it does not run."""
    if name == "eager":
        return lambda x, lse, local, hit, scale, wide: _softmax_grad_in_place(  # a copy even where x is wide
            x.to(wide, copy=True), lse, local, hit, scale, torch.arange(x.shape[0], device=x.device), x.dtype)
    if name == "nd-tiling" and backend != "inductor":
        return "inductor only"
    options = {"triton.prefer_nd_tiling": True} if name == "nd-tiling" else None
    fn = torch.compile(_fused_softmax_grad, dynamic=True, backend=backend, options=options)
    if name != "static-width":
        return fn

    def static(x, *rest):
        torch._dynamo.mark_static(x, 1)
        return fn(x, *rest)
    return static


def time_calls(fn, args, device, repeats: int) -> float:
    for _ in range(3):  # compilation, allocator
        fn(*args)
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn(*args)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, small blocks, aot_eager")
    ap.add_argument("--backend", help="compile backend (default inductor; --tiny aot_eager)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True, help="results JSON")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = args.backend or ("aot_eager" if args.tiny else "inductor")
    rows = 64 if args.tiny else STEP_TOKENS
    if args.tiny:
        widths = [256, 96]
    else:
        width = block_rows(rows, torch.float32)
        widths = [width, QWEN_VOCAB % width or width]
    results = []

    def save():  # after every variant: a run cut short keeps what it measured
        write_results(args.out, {"what": "LM head backward: softmax gradient of one block of logits",
                                 "device": device_name(device), "torch": torch.__version__, "dtype": str(dtype),
                                 "backend": backend, "repeats": args.repeats, "results": results,
                                 "complete": len(results) == len(widths) * len(VARIANTS)},
                      __file__, argv if argv is not None else sys.argv[1:])

    for columns in widths:
        args_, wide = inputs(rows, columns, dtype, device)
        x_TC, *rest = args_
        reference = _softmax_grad_in_place(x_TC.to(wide, copy=True), *rest, torch.arange(rows, device=device), dtype)
        tolerance = torch.finfo(dtype).eps  # outputs are at most 1 in magnitude: one rounding of the output
        for name in VARIANTS:
            fn = variant(name, backend)
            row = {"variant": name, "rows": rows, "columns": columns}
            if isinstance(fn, str):
                results.append({**row, "skipped": fn})
                save()
                continue
            out = fn(*args_, wide)
            diff = (out.to(torch.float64) - reference.to(torch.float64)).abs().max().item()
            seconds = time_calls(fn, (*args_, wide), device, args.repeats)
            moved = rows * columns * 2 * dtype.itemsize
            results.append({**row, "us": seconds * 1e6, "gb_per_s": moved / seconds / 1e9,
                            "max_abs_diff": diff, "agrees": diff <= tolerance})
            print(f"{columns:>6} {name:<13} {seconds * 1e6:9.1f} us {moved / seconds / 1e9:8.1f} GB/s diff {diff:.2e}",
                  file=sys.stderr)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
