"""Plan one global batch with a planner, validate the plan, and write it as JSON.

    lengthwise plan --planner packing --profile lmsys --batch-size 512 --model qwen2.5-7b --cluster h100 --dp 8 --pp 4
    lengthwise plan --planner token-balanced --profile lmsys --batch-size 512 --model qwen2.5-7b --dp 8 --pp 4 --out plan.json
    lengthwise plan --planner padding --option micro_batch_size=4 --profile tiny --batch-size 64 --model tiny --cluster cpu
    lengthwise plan --planner sorted --lengths lengths.txt --context-length 32768 --overlong drop --model llama2-7b --dp 2 --tp 4 --json
    lengthwise plan --planner chunkflow --option chunk_size=auto --profile chunkflow-eval --model qwen2.5-0.5b --profile-file p.json

The cluster gets dp x tp x pp x cp GPUs. The summary lists, per pipeline (data-parallel rank),
its chunks, tokens and predicted forward FLOPs, then the padding fraction and planning time;
`--json` prints the whole plan instead. `--context-length` defaults to the batch's longest
sequence rounded up to a power of two. Every planner option has its flag (`--chunk-size`, `--k`,
`--micro-batch-size`, ...: planners/options.py), and `--option key=value` sets any by name.
`--profile-file` replaces the analytic cost model with a measured one (`lengthwise profile`).
"""

from __future__ import annotations

import argparse
import sys

from lengthwise.commands.common import add_workload_args, batch_lengths_from_args
from lengthwise.commands.planner_flags import add_planner_option_args, planner_options
from lengthwise.commands.profile import add_profile_file_arg, load_profile_file
from lengthwise.limits import BATCH_SEQUENCES, CONTEXT_LENGTH, check_gpus, check_size
from lengthwise.paths import check_writable
from lengthwise.plan.ir import StepPlan
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PLANNER_NAMES, PlanRequest, get_planner
from lengthwise.specs import CLUSTER_PRESETS, ParallelScheme, cluster_preset, model_preset

SHOWN_PIPELINES = 32
"""Pipelines listed one a line in the summary; the rest are counted (the JSON has every one)."""


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--planner", metavar="NAME", required=True,
                        help=f"one of {', '.join(PLANNER_NAMES)}")
    parser.add_argument("--batch-size", metavar="N", type=int, default=512,
                        help="sequences in the global batch (default 512)")
    parser.add_argument("--model", metavar="PRESET|config.json", default="qwen2.5-7b",
                        help="model preset or Hugging Face config.json (default qwen2.5-7b)")
    parser.add_argument("--cluster", metavar="PRESET", default="h100",
                        help=f"GPU type: {', '.join(CLUSTER_PRESETS)} (default h100)")
    for name, text in (("dp", "data-parallel pipelines"), ("tp", "tensor-parallel degree"),
                       ("pp", "pipeline stages"), ("cp", "context-parallel degree")):
        parser.add_argument(f"--{name}", metavar=name[0].upper(), type=int, default=1, help=f"{text} (default 1)")
    parser.add_argument("--zero", metavar="Z", type=int, default=1, help="ZeRO stage 0-3 (default 1)")
    parser.add_argument("--out", metavar="PLAN.json", help="write the plan here (atomically)")
    parser.add_argument("--json", action="store_true", help="print the plan JSON instead of the summary")
    add_profile_file_arg(parser)
    add_planner_option_args(parser)
    add_workload_args(parser)


def run(args: argparse.Namespace) -> int:
    planner = get_planner(args.planner)
    request = build_request(args)
    plan = planner(request)
    validate_plan(plan, request.cost)
    if args.out:
        plan.save(args.out)
    print(plan.to_json() if args.json else summary(plan, request, args.out))
    return 0


def build_request(args: argparse.Namespace) -> PlanRequest:
    """Specs, cost model and batch lengths from the arguments; fails early on bad degrees."""
    from lengthwise.cost import CostModel

    check_size("--batch-size", args.batch_size, BATCH_SEQUENCES)
    check_size("--context-length", args.context_length, CONTEXT_LENGTH)
    check_gpus(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp)
    if args.out:
        check_writable(args.out, "--out")
    model = model_preset(args.model)
    scheme = ParallelScheme(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, zero=args.zero)
    scheme.validate(model)
    cluster = cluster_preset(args.cluster, scheme.num_gpus)
    cost = CostModel(model=model, cluster=cluster, profile=load_profile_file(args.profile_file, model))
    lengths = batch_lengths_from_args(args, args.batch_size)  # the workload's own errors come first
    note_idle_pipelines(scheme.dp, len(lengths))
    cost.check_states_fit(tp=scheme.tp, pp=scheme.pp, dp=scheme.dp, cp=scheme.cp, zero=scheme.zero)
    return PlanRequest(lengths=lengths, model=model, cluster=cluster, scheme=scheme, cost=cost,
                       context_length=args.context_length or default_context_length(lengths),
                       seed=args.seed, options=planner_options(args))


def note_idle_pipelines(dp: int, sequences: int) -> None:
    """A notice on stderr when the batch has fewer sequences than pipelines: some get nothing to
    run (a planner may still split one sequence over several, by context parallelism)."""
    if dp > sequences:
        print(f"lengthwise: notice: --dp {dp} pipelines for {sequences} sequences; at least "
              f"{dp - sequences} pipeline(s) get no sequence", file=sys.stderr)


def default_context_length(lengths: list[int]) -> int:
    """The batch's longest sequence rounded up to a power of two (how context lengths are set)."""
    return 1 << (max(max(lengths, default=1), 1) - 1).bit_length()


def summary(plan: StepPlan, request: PlanRequest, out: str | None) -> str:
    m, s = plan.metrics, request.scheme
    lines = [
        f"{plan.planner}: {len(plan.lengths)} sequences, {sum(plan.lengths):,} tokens "
        f"(longest {max(plan.lengths):,}, context length {request.context_length:,}), "
        f"{plan.model.name} on {s.num_gpus} x {plan.cluster.name} as {s} zero{s.zero}",
        f"  {'pipeline':>8}  {'chunks':>6}  {'tokens':>9}  {'fwd TFLOP':>10}",
    ]
    flops = m["forward_flops_per_pipeline"]
    for p in range(min(len(plan.pipelines), SHOWN_PIPELINES)):
        lines.append(f"  {p:>8}  {m['chunks_per_pipeline'][p]:>6}  {m['tokens_per_pipeline'][p]:>9,}  "
                     f"{flops[p] / 1e12:>10,.1f}")
    if len(plan.pipelines) > SHOWN_PIPELINES:
        lines.append(f"  ... {len(plan.pipelines) - SHOWN_PIPELINES:,} more pipelines (--json prints them all)")
    busy = [f for f in flops if f > 0]
    spread = f"{max(busy) / min(busy):.3f}" if busy else "n/a"
    lines.append(f"  padding {m['padding_fraction']:.1%} of row tokens; max/min forward FLOPs {spread}; "
                 f"planned in {m['planning_ms']:.1f} ms; valid")
    used = sum(pipe.tp * pipe.cp * pipe.pp for pipe in plan.pipelines)
    if used < s.num_gpus:  # e.g. a Hydraulis strategy without the parts whose model states do not fit
        lines.append(f"  {s.num_gpus - used:,} of the {s.num_gpus:,} GPUs run no pipeline of this plan")
    lines.append(f"  wrote {out}" if out else "  (not written: add --out PLAN.json)")
    return "\n".join(lines)
