"""Measure this device's cost profile for a model and write it as JSON for --profile-file.

    lengthwise profile --model qwen2.5-0.5b --out profiles/qwen2.5-0.5b-h100.json          # on a GPU
    lengthwise profile --model qwen2.5-1.5b --max-tokens 65536 --max-context 262144 --out p15.json
    lengthwise profile --model tiny --device cpu --min-tokens 16 --max-tokens 256 --max-context 1024 --out /tmp/tiny.json
    lengthwise plan --planner chunkflow --option chunk_size=auto --profile chunkflow-eval --model qwen2.5-0.5b --cluster h100 --profile-file profiles/qwen2.5-0.5b-h100.json

Times forward and backward of chunks on a model cut to --layers decoder layers (random weights):
for each power of two T from --min-tokens to --max-tokens, one document of T tokens, T tokens
as 64, 16 and 4 packed documents, and a slice of T tokens after a context of T and of 3T (up to
--max-context tokens of sequence); then the LM head from --min-tokens to --head-max-tokens. It
fits per layer T = max(f + g*segments, a*keys + b*tokens + c) (forward and backward apart,
cost/fit.py), the head's
b*tokens + c, activation bytes per token per layer and K/V bytes per token per layer, writes the
profile (format lengthwise.profile/1, scheme tp1-cp1) and prints the fit's error on a seeded
quarter of the chunks held out of the fit. The embedding, the per-chunk host work, one optimizer
step and one gradient norm are measured too (the profile's `step`). The default attention backend is varlen on CUDA and
cpu-flash on a CPU; either is first checked against the reference backend (result in the
profile's meta.backend_check).
"""

from __future__ import annotations

import argparse

from lengthwise.files import json_text
from lengthwise.commands.common import add_backend_arg, add_compile_arg, compile_choice
from lengthwise.errors import UserError
from lengthwise.limits import CONTEXT_LENGTH, LAYERS, REPEATS, check_size
from lengthwise.paths import check_writable
from lengthwise.files import write_atomic
from lengthwise.specs import ModelSpec, model_preset

DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PRESET|config.json", default="qwen2.5-0.5b",
                        help="model preset or Hugging Face config.json (default qwen2.5-0.5b)")
    parser.add_argument("--device", default="auto", help="torch device (default auto: cuda when present, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="model dtype (default auto: bfloat16 on cuda, float32 on cpu)")
    add_backend_arg(parser)
    add_compile_arg(parser)
    parser.add_argument("--layers", metavar="L", type=int, default=2,
                        help="decoder layers measured (default 2; with --compile-chain at least 4, one chained region, "
                             "so a layer carries a quarter of its call as in a deep stage)")
    parser.add_argument("--min-tokens", metavar="T", type=int, default=512, help="smallest chunk (default 512)")
    parser.add_argument("--max-tokens", metavar="T", type=int, default=32768, help="largest chunk (default 32768)")
    parser.add_argument("--max-context", metavar="T", type=int,
                        help="longest sequence a measured slice belongs to (default 4 x --max-tokens)")
    parser.add_argument("--head-max-tokens", metavar="T", type=int,
                        help="largest LM-head measurement (default min(--max-tokens, 16384): its float32 "
                             "logits take 4 x vocab bytes per token)")
    parser.add_argument("--repeats", metavar="R", type=int, default=3,
                        help="timed runs per chunk, median kept (default 3)")
    parser.add_argument("--warmup", metavar="W", type=int, default=1, help="untimed runs first (default 1)")
    parser.add_argument("--holdout", metavar="FRAC", type=float, default=0.25,
                        help="share of chunks held out of the fit to measure its error (default 0.25)")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="weights, inputs and hold-out (default 0)")
    parser.add_argument("--out", metavar="PROFILE.json", help="where to write (default profile-MODEL.json)")
    parser.add_argument("--json", action="store_true", help="print the profile JSON instead of the summary")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lengthwise.cost.fit import head_token_counts, measure_profile, profile_chunks

    spec = model_preset(args.model)
    _check_sizes(args, spec.name)
    chunks = profile_chunks(min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                            max_context=args.max_context or 4 * args.max_tokens)
    heads = head_token_counts(args.min_tokens, args.head_max_tokens or min(args.max_tokens, 16384))
    measurer = build_measurer(args, spec)
    with tqdm(total=len(chunks), desc="timing chunks", unit="chunk", disable=args.json, leave=False) as bar:
        fitted = measure_profile(measurer, chunks, heads, model_name=spec.name, holdout=args.holdout,
                                 seed=args.seed, progress=bar)
    fitted.profile.meta["backend_check"] = backend_check(measurer, spec)
    fitted.profile.meta["command"] = "lengthwise profile " + " ".join(_argv(args))
    from lengthwise.cost.estimate import complete_profile

    fitted.profile = complete_profile(fitted.profile, spec)  # the key-slicing term, where the code slices keys
    out = args.out or f"profile-{spec.name}.json"
    write_atomic(out, json_text(fitted.profile.to_dict()))
    print(json_text(fitted.profile.to_dict()) if args.json else summary(fitted, out))
    return 0


def _check_sizes(args: argparse.Namespace, model_name: str) -> None:
    for name in ("layers", "min_tokens", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup} must be >= 0")
    if not 0.0 <= args.holdout < 1.0:
        raise UserError(f"--holdout {args.holdout} must be in [0, 1)")
    check_size("--layers", args.layers, LAYERS)
    check_size("--repeats", args.repeats, REPEATS)
    check_size("--warmup", args.warmup, REPEATS, least=0)
    for name in ("min_tokens", "max_tokens", "max_context", "head_max_tokens"):
        check_size(f"--{name.replace('_', '-')}", getattr(args, name), CONTEXT_LENGTH)
    check_writable(args.out or f"profile-{model_name}.json", "--out")  # before an hour of timing, not after


def build_measurer(args: argparse.Namespace, spec: ModelSpec):
    """The device's TorchMeasurer (tests replace this function with a fake)."""
    import torch

    from lengthwise.runtime.profile import TorchMeasurer

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    compile, chain = compile_choice(args)
    return TorchMeasurer(spec, layers=args.layers, device=device, dtype=getattr(torch, dtype_name),
                         backend=args.backend, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                         compile=compile, compile_chain=chain)


def backend_check(measurer, spec: ModelSpec) -> dict | None:
    """The timed backend against the reference on this device (None when it is the reference)."""
    backend = getattr(measurer, "backend", None)
    if backend in (None, "reference"):
        return None
    from lengthwise.runtime.profile import check_backend

    return check_backend(backend, device=measurer.device, dtype=measurer.dtype, heads=spec.num_heads,
                         kv_heads=spec.num_kv_heads, head_dim=spec.head_dim).to_dict()


def _argv(args: argparse.Namespace) -> list[str]:
    skip = {"command", "func"}
    return [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip and v not in (None, False)]


def summary(fitted, out: str) -> str:
    p, e = fitted.profile, fitted.errors
    fit = p.schemes["tp1-cp1"]
    m = p.meta
    lines = [(f"profile of {p.model} on {p.device} ({m.get('dtype')}, {m.get('backend')} attention, "
              f"layers measured: {m.get('measured_layers')}, chunks: {len(fitted.samples)})")]
    refit = m.get("held_out_error_refit", {})
    for name, (a, b, c), (f, g) in (("forward", fit.fwd, fit.fwd_floor), ("backward", fit.bwd, fit.bwd_floor)):
        key = "fwd" if name == "forward" else "bwd"
        err = refit.get(key) or vars(e[key])
        seg = f" + {fit.bwd_segment_tokens:.3g} s/(segment x token)" if key == "bwd" and fit.bwd_segment_tokens else ""
        lines.append(f"  {name:<8} per layer: max({f:.4g} s + {g:.3g} s/segment, {a:.4g} s/key + {b:.4g} s/token "
                     f"+ {c:.4g} s{seg})   held-out error mean {err['mean']:.1%}, max {err['max']:.1%} "
                     f"({err['count']} chunks)")
    for name, (b, c) in (("head fwd", fit.head_fwd), ("head bwd", fit.head_bwd)):
        err = e[name.replace(" ", "_")]
        lines.append(f"  {name:<8}: {b:.4g} s/token + {c:.4g} s   error mean {err.mean:.1%}, max {err.max:.1%}")
    if p.step is not None:
        st = p.step
        lines.append(f"  embedding: fwd {st.embed_fwd[0]:.3g} s/token + {st.embed_fwd[1]:.3g} s, bwd "
                     f"{st.embed_bwd[0]:.3g} s/token + {st.embed_bwd[1]:.3g} s; per chunk {st.chunk_overhead_s:.3g} s; "
                     f"optimizer step {st.optimizer_s:.3g} s, gradient norm {st.grad_norm_s:.3g} s (whole model)"
                     + (f"; estimated: {', '.join(st.estimated)}" if st.estimated else ""))
    act = p.activation_bytes_per_token_layer
    lines.append(f"  activations {act:,.0f} bytes/token/layer; K/V {p.kv_bytes_per_token_layer:,.0f} bytes/token/layer"
                 if act is not None else f"  K/V {p.kv_bytes_per_token_layer:,.0f} bytes/token/layer")
    check = m.get("backend_check")
    if check:
        worst = max(check["error"].values())
        lines.append(f"  {check['backend']} vs reference: {'passed' if check['passed'] else 'FAILED'} "
                     f"(largest relative error {worst:.2e}, tolerance {check['tolerance']:.0e})")
    lines.append(f"wrote {out}")
    return "\n".join(lines)


def add_profile_file_arg(parser: argparse.ArgumentParser) -> None:
    """--profile-file FILE, for commands that build a CostModel."""
    parser.add_argument("--profile-file", metavar="PROFILE.json",
                        help="measured cost profile from `lengthwise profile` (default: the analytic model)")


def load_profile_file(path: str | None, model: ModelSpec):
    """The Profile at `path` (None when no path), checked to be for `model`; a profile written
    before the host floors and step terms is completed (cost/estimate.py: floors refitted
    from its samples, step terms estimated, `meta.completed` saying which)."""
    from lengthwise.cost import Profile
    from lengthwise.cost.estimate import complete_profile

    if not path:
        return None
    profile = Profile.load(path)
    if profile.model not in ("unknown", model.name):
        raise UserError(f"{path} was measured for model {profile.model}, not {model.name}: "
                        f"measure one with `lengthwise profile --model {model.name}`")
    return complete_profile(profile, model)
