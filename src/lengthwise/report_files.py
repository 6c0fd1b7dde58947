"""The files `lengthwise compare` writes: report.md, a Gantt chart per planner for the first
batch, a length histogram and a bar chart of speedups. Every file is written atomically."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from lengthwise.metrics import PEAK_MEMORY_GIB
from lengthwise.files import write_atomic
from lengthwise.report import CompareSetup, PlannerRow
from lengthwise.sim.gantt import draw_gantt
from lengthwise.workloads.plot import histogram_png

COLUMNS = ("planner", "scheme", "step time (s)", "tokens/s", "speedup vs best baseline", "bubble ratio",
           "DP slowest/fastest", "peak memory (GiB)", "fits", "planning ms (mean / max)")


def write_report(out: Path, setup: CompareSetup, rows: dict[str, PlannerRow], summary: dict,
                 *, pictures: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pics = draw_pictures(out, setup, rows, summary) if pictures else []
    write_atomic(out / "report.md", markdown(summary, pics))


def draw_pictures(out: Path, setup: CompareSetup, rows: dict[str, PlannerRow], summary: dict) -> list[str]:
    lengths = np.array([n for batch in setup.batches for n in batch])
    write_atomic(out / "lengths.png", histogram_png(lengths, title="sampled batches"))
    names = ["lengths.png"]
    for name, row in rows.items():
        first = row.runs[0] if row.runs else None
        if first is not None and first.result is not None and first.result.timeline is not None:
            draw_gantt(first.result, out / f"gantt-{name}.png",
                       label=f"{name}, batch 0 of {len(setup.batches)} (the report's table: mean over batches)")
            names.append(f"gantt-{name}.png")
    write_atomic(out / "speedup.png", speedup_png(summary["planners"]))
    return names + ["speedup.png"]


def speedup_png(planners: dict) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [n for n, r in planners.items() if r.get("speedup_vs_best_baseline")]
    values = [planners[n]["speedup_vs_best_baseline"] for n in names]
    fig = Figure(figsize=(max(4, 0.8 * len(names) + 2), 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars = ax.bar(names, values, color=["#888" if planners[n]["fits"] else "#d44" for n in names])
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel("speedup vs best baseline (simulated)")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def markdown(summary: dict, pictures: list[str]) -> str:
    s = summary["setup"]
    lines = [
        "# lengthwise compare (simulated)", "",
        f"Workload `{s['workload']}`, model `{s['model']}`, {s['gpus']} x `{s['cluster']}`, context "
        f"{s['context_length']:,} tokens, {s['batches']} global batches of {s['sequences_per_batch']} sequences "
        f"({s['tokens_per_batch']} tokens), seed {s['seed']}. Every time below is simulated by the cost model.", "",
        f"Chunk times: {s['time_model']['text']}.", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
    ]
    lines += [table_row(name, r) for name, r in summary["planners"].items()]
    auto = summary["planners"].get("auto", {})
    if auto.get("chosen"):
        chosen = ", ".join(f"{k} {v}x" for k, v in sorted(auto["chosen"].items(), key=lambda kv: -kv[1]))
        lines += ["", f"`auto` chose: {chosen}."]
    for name, r in summary["planners"].items():
        if r.get("tuned"):
            options = ", ".join(f"`{k}={v}`" for k, v in r["tuned"].items())
            lines += ["", f"`{name}` ran every batch with {options}, chosen by its own search on the "
                          "scheme-selection batches."]
    c = summary.get("confirm")
    if c and "error" not in c:
        lines += ["", f"Confirmed by a dry run (fake tensors, the executor's own code): `{c['planner']}` "
                      f"batch {c['batch']}, rank {c['rank']} ({c['place']}) measured a peak of "
                      f"{c['measured_peak_gib']:.2f} GiB against {c['simulated_peak_gib']:.2f} GiB simulated and "
                      f"{c['capacity_gib']:.1f} GiB usable: {'fits' if c['fits'] else 'does NOT fit'}."]
    elif c:
        lines += ["", f"Dry-run confirmation: {c['error']}"]
    lines += [""] + [f"![{p}]({p})" for p in pictures]
    return "\n".join(lines) + "\n"


def table_row(name: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | {r['scheme']} | skipped: {r['error']} |" + " |" * (len(COLUMNS) - 3)
    speed = f"{r['speedup_vs_best_baseline']:.2f}x" if r["speedup_vs_best_baseline"] else "-"
    dp = f"{r['dp_imbalance']:.2f}" if r["dp_imbalance"] else "-"
    return (f"| {name} | {r['scheme']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {speed} | "
            f"{r['bubble_ratio']:.1%} | {dp} | {r[PEAK_MEMORY_GIB]:.1f} | {r['fits']} | "
            f"{r['planning_ms_mean']:.1f} / {r['planning_ms_max']:.1f} |")
