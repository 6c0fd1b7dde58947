"""Simulate one step of a plan: step time, bubbles, data-parallel imbalance, memory, pictures.

    lengthwise simulate plan.json
    lengthwise simulate plan.json --json --gantt step.png --memory-plot memory.png
    lengthwise simulate --stages 4 --fwd 4,2,1,1                  # chunkflow figure 2: 56, 57.14%
    lengthwise simulate --stages 4 --fwd 2,2,2,2 --groups 2-3 --schedule state-aware-1f1b --k 2
    lengthwise simulate --stages 4 --fwd 1,1,1,1,1,1,1,1 --schedule gpipe --json

With a PLAN.json the cost model (analytic, or `--profile-file FILE` measured) gives every
action's time, transfers and memory. The direct mode takes raw forward times (any unit) of chunks
issued in the order given; backward takes `--bwd-ratio` times as long, there is no
communication, and memory counts activations in forward-time units. `--groups 2-3` says chunks 2
and 3 are consecutive slices of one sequence (forward in order, backward in reverse).
`--json` keys include makespan, step_time_s, bubble_ratio, reforward_counted_as_busy, busy,
idle, reforward, dp_imbalance, dp_imbalance_spread, peak_memory, fits, tokens_per_s, mfu.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lengthwise.errors import UserError
from lengthwise.limits import DIRECT_CHUNKS, MAX_DIRECT_TIME, STAGES, check_size
from lengthwise.paths import check_writable
from lengthwise.files import json_text
from lengthwise.plan.schedules import SCHEDULE_NAMES


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", nargs="?", help="a StepPlan written by `lengthwise plan`")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")
    parser.add_argument("--gantt", metavar="FILE.png", help="write a Gantt chart of the step")
    parser.add_argument("--memory-plot", metavar="FILE.png", help="write memory over time per stage")
    parser.add_argument("--profile-file", "--cost-profile", dest="cost_profile", metavar="FILE",
                        help="measured cost profile JSON from `lengthwise profile` (plan mode)")
    direct = parser.add_argument_group("direct mode (no plan: raw forward times)")
    direct.add_argument("--stages", metavar="P", type=int, help="pipeline stages")
    direct.add_argument("--fwd", metavar="T1,T2,...", help="forward time of each chunk, in issue order")
    direct.add_argument("--bwd-ratio", metavar="R", type=float, default=2.0,
                        help="backward time over forward time (default 2)")
    direct.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b", help="default 1f1b")
    direct.add_argument("--groups", metavar="I-J,...",
                        help="chunk ranges that are consecutive slices of one sequence, e.g. 2-3,5-8")
    direct.add_argument("--k", metavar="K", type=int,
                        help="ChunkFlow's K: activations kept per split sequence (state-aware-1f1b default 1)")


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--gantt", args.gantt), ("--memory-plot", args.memory_plot)):
        if path:
            check_writable(path, flag)
    result = _simulate_direct(args) if args.fwd is not None else _simulate_plan_file(args)
    if args.json:
        print(json_text(result.to_dict()))
    else:
        print(format_result(result))
    if args.gantt or args.memory_plot:
        from lengthwise.sim.gantt import draw_gantt, draw_memory  # matplotlib only when drawing
        if args.gantt:
            draw_gantt(result, args.gantt, label=_label(args))
        if args.memory_plot:
            draw_memory(result, args.memory_plot)
    return 0


def _simulate_plan_file(args):
    from lengthwise.commands.profile import load_profile_file
    from lengthwise.cost import CostModel
    from lengthwise.plan.validate import load_plan
    from lengthwise.sim import simulate_plan

    if args.plan is None:
        raise UserError("give a PLAN.json, or --stages and --fwd for the direct mode")
    if args.stages is not None or args.groups or args.k is not None:
        raise UserError("--stages/--groups/--k belong to the direct mode: drop them or drop PLAN.json and give --fwd")
    plan = load_plan(args.plan)
    profile = load_profile_file(args.cost_profile, plan.model)
    return simulate_plan(plan, CostModel(model=plan.model, cluster=plan.cluster, profile=profile))


def _simulate_direct(args):
    from lengthwise.sim import simulate_times

    if args.plan is not None:
        raise UserError("give either PLAN.json or --fwd (the direct mode), not both")
    if args.stages is None:
        raise UserError("the direct mode needs --stages P as well as --fwd")
    check_size("--stages", args.stages, STAGES, least=None)  # below 1: direct_input says so
    times = parse_floats(args.fwd, "--fwd")
    check_direct_inputs(times, args.bwd_ratio)
    return simulate_times(times, args.stages, bwd_ratio=args.bwd_ratio,
                          schedule=args.schedule, groups=parse_groups(args.groups), k=args.k)


def parse_floats(text: str, flag: str) -> list[float]:
    """'4,2,1,1' -> [4.0, 2.0, 1.0, 1.0]; an empty item ('3,,4') is an error, not a skipped chunk."""
    items = text.split(",")
    if any(not x.strip() for x in items):
        raise UserError(f"{flag} {text!r} has an empty item: give one number per chunk, like 4,2,1,1")
    check_size(f"{flag} count", len(items), DIRECT_CHUNKS)
    try:
        return [float(x) for x in items]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated numbers like 4,2,1,1") from None


def check_direct_inputs(times: list[float], bwd_ratio: float) -> None:
    """Forward times and the backward ratio finite, >= 0 and at most MAX_DIRECT_TIME."""
    for i, t in enumerate(times):
        if not 0 <= t <= MAX_DIRECT_TIME:   # False for NaN too
            raise UserError(f"--fwd time {i} is {t}: give finite times in [0, {MAX_DIRECT_TIME:g}]")
    if not 0 <= bwd_ratio <= MAX_DIRECT_TIME:
        raise UserError(f"--bwd-ratio {bwd_ratio}: give a finite ratio in [0, {MAX_DIRECT_TIME:g}]")


def parse_groups(text: str | None) -> list[tuple[int, int]]:
    """'2-3,5-8' -> [(2, 3), (5, 8)] (inclusive ranges)."""
    out = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        first, sep, last = part.partition("-")
        if not sep or not first.strip().isdigit() or not last.strip().isdigit():
            raise UserError(f"--groups part {part!r}: expected FIRST-LAST chunk indices like 2-3")
        out.append((int(first), int(last)))
    return out


def _label(args: argparse.Namespace) -> str:
    """What the chart shows: the plan's planner and file, or the direct mode's chunk times."""
    if args.fwd is not None:
        return f"{args.schedule}, {args.stages} stages, chunk times {args.fwd}"
    planner = json.loads(Path(args.plan).read_text()).get("planner", "?")  # read and checked before
    return f"{planner}, plan {Path(args.plan).name}"


def format_result(r) -> str:
    unit = r.time_unit
    lines = [(f"simulated step time {r.step_time_s:.6g} {unit}  (makespan {r.makespan:.6g} {unit}), "
              f"bubble ratio {r.bubble_ratio:.2%}")]
    if len(r.pipeline_makespan) > 1:
        ratio = "n/a" if r.dp_imbalance is None else f"{r.dp_imbalance:.3f}x"
        lines.append(f"data-parallel imbalance {ratio} slowest/fastest, spread {r.dp_imbalance_spread:.1%}")
    if r.tokens_per_s is not None:
        mfu = "" if r.mfu is None else f", MFU {r.mfu:.1%}"
        lines.append(f"{r.tokens:,} tokens, {r.tokens_per_s:,.0f} tokens/s{mfu}")
    scale, munit = (2**30, "GiB") if r.memory_unit == "bytes" else (1.0, r.memory_unit)
    cap = f", capacity {r.capacity_bytes / scale:.1f}" if r.capacity_bytes else ""
    lines.append(f"peak memory per stage ({munit}{cap}):")
    shown = r.peak_memory[:8]
    for p, row in enumerate(shown):
        busy = " ".join(f"{b:.4g}" for b in r.busy[p])
        lines.append(f"  pipeline {p}: " + " ".join(f"{m / scale:.4g}" for m in row) + f"   busy ({unit}): {busy}")
    if len(r.peak_memory) > len(shown):
        lines.append(f"  ... {len(r.peak_memory) - len(shown)} more pipelines; highest peak "
                     f"{max(max(row) for row in r.peak_memory) / scale:.4g}")
    if r.fits is not None:
        lines.append("fits in memory: " + ("yes" if r.fits else "NO"))
    if r.time_source:
        lines.append(f"chunk times: {r.time_source}")
    return "\n".join(lines)
