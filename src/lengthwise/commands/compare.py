"""Compare planners on the same global batches, model and cluster, in simulation.

    lengthwise compare                                   # chunkflow-eval, qwen2.5-7b, 32 H100s, 32K context
    lengthwise compare --profile lmsys-skrull --model qwen2.5-0.5b --gpus 32 --batch-size 64 --planners packing,skrull
    lengthwise compare --profile commoncrawl --model llama2-7b --cluster a800 --gpus 16 --tokens-per-batch 200000 --planners all --json
    lengthwise compare --profile tiny --model tiny --cluster cpu --gpus 1 --batch-size 32 --batches 2 --out /tmp/report
    lengthwise compare --model qwen2.5-0.5b --gpus 8 --planners packing,chunkflow --profile-file profiles/qwen2.5-0.5b-h100.json

For B sampled global batches it plans with each planner (at its best parallel scheme for this
cluster and model: every planner searches the same list of feasible schemes, each judged by its
mean step over the selection set, the first 4 batches and the batch holding the longest sequence,
and refused where one of them does not fit; `--scheme` fixes one for all),
simulates every plan, and prints
per planner: mean step time, tokens/s, speedup over the best baseline and over `megatron` (the
baseline ChunkFlow, InfiniPipe, SlimPack and Hydraulis measured against), bubble ratio, DP
imbalance, peak memory and whether it fits, and planning time. All times are simulated. It
writes OUT/report.md with the table, a Gantt chart per planner for the first batch, a length
histogram and a bar chart of speedups. Sequences over the context length are dropped unless
--overlong says otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from lengthwise.files import json_text
from lengthwise.commands.common import add_workload_args, lengths_source_from_args
from lengthwise.commands.planner_flags import (
    add_planner_option_args,
    check_options_used,
    options_for,
    planner_options,
)
from lengthwise.commands.profile import add_profile_file_arg, load_profile_file
from lengthwise.errors import UserError
from lengthwise.limits import BATCH_SEQUENCES, BATCHES, GPUS, TOKENS_PER_BATCH, check_size
from lengthwise.paths import check_writable
from lengthwise.metrics import GIB, PEAK_MEMORY_GIB
from lengthwise.report import CompareSetup, all_planners, run_compare, summarise, time_model
from lengthwise.report_files import write_report
from lengthwise.specs import CLUSTER_PRESETS, ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.sampler import GlobalBatchSampler

DEFAULT_PROFILE = "chunkflow-eval"
DEFAULT_CONTEXT = 32768


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PRESET|config.json", default="qwen2.5-7b",
                        help="model preset or Hugging Face config.json (default qwen2.5-7b)")
    parser.add_argument("--cluster", metavar="PRESET", default="h100",
                        help=f"GPU type: {', '.join(CLUSTER_PRESETS)} (default h100)")
    parser.add_argument("--gpus", metavar="N", type=int, default=32, help="GPUs (default 32)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--batch-size", metavar="N", type=int, help="sequences per global batch (default 256)")
    size.add_argument("--tokens-per-batch", metavar="T", type=int, help="tokens per global batch instead")
    parser.add_argument("--batches", metavar="B", type=int, default=4, help="global batches sampled (default 4)")
    parser.add_argument("--planners", metavar="a,b,...|all", default="all",
                        help="planners to compare (default all)")
    parser.add_argument("--zero", metavar="Z", type=int, default=1, help="ZeRO stage 0-3 (default 1)")
    parser.add_argument("--scheme", metavar="dpD-tpT-ppP-cpC",
                        help="one parallel scheme for every planner (default: each planner searches the "
                             "same list of feasible schemes and keeps its fastest)")
    parser.add_argument("--out", metavar="DIR", default="compare-report",
                        help="folder for report.md and pictures (default compare-report)")
    parser.add_argument("--no-pictures", action="store_true", help="write report.md without the PNGs")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--confirm", action="store_true",
                        help="run the winner's fullest rank (highest simulated peak, on its fullest batch) "
                             "through the executor under fake tensors, as `lengthwise dryrun` does, and say "
                             "whether its measured peak memory fits a GPU (needs torch; a 7B rank takes about "
                             "a minute)")
    add_profile_file_arg(parser)
    add_planner_option_args(parser)
    add_workload_args(parser)
    parser.set_defaults(overlong="drop")


def run(args: argparse.Namespace) -> int:
    check_writable(Path(args.out) / "report.md", "--out")
    if args.confirm:
        require_torch()  # before the comparison, not after it
    setup = build_setup(args)
    total = len(setup.batches) * len([p for p in setup.planners if p != "auto"])
    with tqdm(total=total, desc="planning + simulating", unit="plan", disable=args.json, leave=False) as bar:
        rows = run_compare(setup, progress=bar)
    summary = summarise(rows)
    summary["setup"] = describe(setup, args)
    if args.confirm:
        summary["confirm"] = confirm_winner(rows, summary, setup)
    write_report(Path(args.out), setup, rows, summary, pictures=not args.no_pictures)
    print(json_text(summary) if args.json else format_table(summary, args.out))
    return 0


def require_torch() -> None:
    try:
        import torch  # noqa: F401  (the dry run's executor)
    except ImportError:
        raise UserError("--confirm runs the executor under fake tensors and needs PyTorch: "
                        "pip install torch==2.13.0, or drop --confirm") from None


def confirm_winner(rows: dict, summary: dict, setup: CompareSetup) -> dict:
    """Dry-run the rank of the winner's plans with the highest simulated peak memory.

    The winner is the fastest planner whose plans all fit in simulation (`auto` when compared:
    the per-batch best). Its batch with the highest simulated peak is taken, and in that plan
    the (pipeline, stage) with the highest peak; its first rank runs the executor's own code
    under fake tensors and the fake process group (`lengthwise dryrun`), measuring what it
    allocates. Fits means the measured peak is within the GPU's usable memory (capacity less the
    cost model's reserve)."""
    require_torch()
    from lengthwise.commands.dryrun import dryrun_rows
    from lengthwise.cost import CostModel
    from lengthwise.sim.rank import rank_places

    fitting = {n: r for n, r in summary["planners"].items() if r.get("fits") and "error" not in r}
    if not fitting:
        return {"error": "no planner's plans fit in simulation: nothing to confirm"}
    winner = "auto" if "auto" in fitting else min(fitting, key=lambda n: fitting[n]["step_time_s"])
    runs = [(b, r) for b, r in enumerate(rows[winner].runs) if r.plan is not None and r.result is not None]
    b, run = max(runs, key=lambda br: max(p for row in br[1].result.peak_memory for p in row))
    peaks = run.result.peak_memory
    p, s = max(((p, s) for p, row in enumerate(peaks) for s in range(len(row))), key=lambda ps: peaks[ps[0]][ps[1]])
    rank = next(i for i, place in enumerate(rank_places(run.plan)) if (place.pipeline, place.stage) == (p, s))
    out = {"planner": winner, "chosen_planner": run.plan.metrics.get("chosen_planner", run.plan.planner),
           "batch": b, "rank": rank}
    try:
        row = dryrun_rows(run.plan, [rank])[str(rank)]
    except UserError as exc:
        return {**out, "error": f"not confirmed: {exc}"}
    capacity = CostModel(model=setup.model, cluster=setup.cluster).capacity_bytes / GIB
    measured = row["peak_memory_gib"]["measured"]
    return {**out, "place": row["place"], "measured_peak_gib": measured,
            "simulated_peak_gib": row["peak_memory_gib"]["simulated"], "capacity_gib": capacity,
            "fits": measured <= capacity, "dryrun_s": row["dryrun_s"]}


def build_setup(args: argparse.Namespace) -> CompareSetup:
    if not (args.profile or args.lengths or args.data):
        args.profile = DEFAULT_PROFILE
    args.context_length = args.context_length or DEFAULT_CONTEXT
    check_size("--gpus", args.gpus, GPUS)
    check_size("--batches", args.batches, BATCHES)
    check_size("--batch-size", args.batch_size, BATCH_SEQUENCES)
    check_size("--tokens-per-batch", args.tokens_per_batch, TOKENS_PER_BATCH)
    planners, options = parse_planners(args.planners), planner_options(args)
    check_options_used(planners, options)
    model = model_preset(args.model)
    cluster = cluster_preset(args.cluster, args.gpus)
    sampler = GlobalBatchSampler(lengths_source_from_args(args), seed=args.seed,
                                 batch_size=None if args.tokens_per_batch else (args.batch_size or 256),
                                 token_budget=args.tokens_per_batch)
    batches = [list(map(int, sampler.next_batch().lengths)) for _ in range(args.batches)]
    scheme = fixed_scheme(args.scheme, model, args.gpus, args.zero)
    return CompareSetup(model=model, cluster=cluster, context_length=args.context_length, batches=batches,
                        planners=planners, zero=args.zero, seed=args.seed, scheme=scheme,
                        profile=load_profile_file(args.profile_file, model),
                        options={p: options_for(p, options) for p in planners})


def fixed_scheme(text: str | None, model, gpus: int, zero: int) -> ParallelScheme | None:
    """--scheme parsed and checked against the model and the GPUs, or None to search."""
    if text is None:
        return None
    scheme = ParallelScheme.parse(text, zero=zero)
    scheme.validate(model, num_gpus=gpus)
    return scheme


def parse_planners(text: str) -> list[str]:
    known = all_planners()
    if text == "all":
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"unknown planner {', '.join(unknown) or text!r}: use 'all' or some of {', '.join(known)}")
    return names


def describe(setup: CompareSetup, args: argparse.Namespace) -> dict:
    return {"model": setup.model.name, "cluster": setup.cluster.name, "gpus": setup.cluster.num_gpus,
            "workload": args.profile or args.lengths or args.data, "context_length": setup.context_length,
            "batches": len(setup.batches), "sequences_per_batch": [len(b) for b in setup.batches],
            "tokens_per_batch": [sum(b) for b in setup.batches], "seed": setup.seed, "simulated": True,
            "profile_file": args.profile_file, "time_model": time_model(setup)}


def format_table(summary: dict, out: str) -> str:
    s = summary["setup"]
    head = (f"{s['workload']}, {s['model']} on {s['gpus']} x {s['cluster']}, context {s['context_length']:,}, "
            f"{s['batches']} batches (simulated)")
    lines = [head, f"chunk times: {s['time_model']['text']}", table_lines(summary["planners"])]
    if "confirm" in summary:
        lines.append(confirm_line(summary["confirm"]))
    lines.append(f"report: {out}/report.md")
    return "\n".join(lines)


def confirm_line(c: dict) -> str:
    who = c.get("planner", "")
    if c.get("chosen_planner") and c["chosen_planner"] != who:
        who = f"{who} ({c['chosen_planner']})"
    if "error" in c:
        return f"confirm: {who + ': ' if who else ''}{c['error']}"
    verdict = "fits" if c["fits"] else "DOES NOT FIT"
    return (f"confirm: {who}, batch {c['batch']}, rank {c['rank']} ({c['place']}): measured peak "
            f"{c['measured_peak_gib']:.1f} GiB (simulated {c['simulated_peak_gib']:.1f}) of "
            f"{c['capacity_gib']:.1f} GiB usable: {verdict} (dry run on fake tensors, {c['dryrun_s']:.0f} s)")


def table_lines(planners: dict) -> str:
    cols = f"{'planner':<15}{'scheme':<18}{'step s':>9}{'tokens/s':>12}{'speedup':>9}{'vs meg.':>9}{'bubble':>8}" \
           f"{'DP max/min':>11}{'peak GiB':>9}{'fits':>6}{'plan ms':>9}"
    rows = [cols]
    for name, r in planners.items():
        if "error" in r:
            rows.append(f"{name:<15}{r['scheme']:<18}  skipped: {r['error'][:70]}")
            continue
        speed = f"{r['speedup_vs_best_baseline']:.2f}x" if r["speedup_vs_best_baseline"] else "-"
        meg = f"{r['speedup_vs_megatron']:.2f}x" if r.get("speedup_vs_megatron") else "-"
        dp = f"{r['dp_imbalance']:.2f}" if r["dp_imbalance"] else "-"
        rows.append(f"{name:<15}{r['scheme']:<18}{r['step_time_s']:>9.2f}{r['tokens_per_s']:>12,.0f}{speed:>9}{meg:>9}"
                    f"{r['bubble_ratio']:>8.1%}{dp:>11}{r[PEAK_MEMORY_GIB]:>9.1f}{str(r['fits']):>6}"
                    f"{r['planning_ms_mean']:>9.1f}")
    for name, r in planners.items():
        if r.get("tuned"):
            options = ", ".join(f"{k}={v}" for k, v in r["tuned"].items())
            rows.append(f"{name}: {options} (its own search on the {r.get('selection_batches', 0)} scheme-selection "
                        "batches, then fixed)")
    return "\n".join(rows)
