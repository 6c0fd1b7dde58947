"""Pictures of a simulated step: a Gantt chart of every stage and memory over time.

    lengthwise simulate plan.json --gantt step.png --memory-plot memory.png
    lengthwise simulate --stages 4 --fwd 4,2,1,1 --gantt fig2.png       # chunkflow figure 2

One row per stage, grouped by pipeline (pipeline 0 on top, stage 0 first). Forward, no-grad
forward (N), re-forward, backward and communication (point-to-point hand-offs as thin bars on
the receiving stage, context-parallel exchange inside actions, gradient reduction after the
last backward) have their own colours; chunk numbers are written where a bar is wide enough.
At most `max_rows` rows are drawn (whole pipelines, the slowest first), so a 1,000-stage step
stays readable. Uses matplotlib's Agg canvas directly (no pyplot state); files are written
atomically.
"""

from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lengthwise.files import write_atomic
from lengthwise.sim.simulate import SimResult

COLOURS = {"forward": "#4c8bd6", "no-grad forward": "#a9c8ee", "re-forward": "#f2a541",
           "backward": "#5aae61", "communication": "#b0b0b0", "gradient reduction": "#7f6aa8"}


def shown_pipelines(result: SimResult, max_rows: int) -> list[int]:
    """Pipelines to draw: the slowest first, as many whole pipelines as fit in max_rows."""
    order = np.argsort(-np.asarray(result.pipeline_makespan), kind="stable")
    offs = result.timeline.stage_offsets
    out, rows = [], 0
    for p in order.tolist():
        pp = offs[p + 1] - offs[p]
        if out and rows + pp > max_rows:
            break
        out.append(p)
        rows += pp
    return sorted(out)


def draw_gantt(result: SimResult, path, *, max_rows: int = 64, max_labels: int = 800, label: str = "") -> None:
    """Write a Gantt chart PNG of the simulated step; `label` heads the title (the planner and
    the batch, e.g. "chunkflow, batch 0 of 4 (the report's table is the mean over them)")."""
    tl = result.timeline
    pipes = shown_pipelines(result, max_rows)
    row_of = _row_positions(tl.stage_offsets, pipes)
    height = min(2.0 + 0.3 * len(row_of), 24.0)
    fig = Figure(figsize=(14, height), dpi=110)
    ax = fig.add_subplot()
    span = max(result.step_time_s, result.makespan, 1e-12)
    _draw_tasks(ax, tl, row_of, span, max_labels)
    _draw_sync(ax, tl, row_of)
    ax.set_yticks(list(row_of.values()))
    ax.set_yticklabels([_row_name(tl.stage_offsets, g) for g in row_of], fontsize=_tick_size(len(row_of)))
    ax.set_ylim(max(row_of.values(), default=0) + 0.8, -0.8)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"time ({result.time_unit})")
    shown = f"{len(pipes)} of {len(result.pipeline_makespan)} pipelines" if len(pipes) < len(result.pipeline_makespan) else ""
    head = f"{label}: " if label else ""
    ax.set_title(f"{head}simulated step {result.step_time_s:.4g} {result.time_unit}, makespan "
                 f"{result.makespan:.4g}, bubble ratio {result.bubble_ratio:.2%}  {shown}".strip(), fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.6 / height - 0.05), ncol=len(COLOURS), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    _save(fig, path)


def _row_positions(stage_offsets: list[int], pipes: list[int]) -> dict[int, float]:
    """Global stage -> y position, with a half-row gap between pipelines."""
    rows, y = {}, 0.0
    for p in pipes:
        for g in range(stage_offsets[p], stage_offsets[p + 1]):
            rows[g] = y
            y += 1.0
        y += 0.5
    return rows


def _row_name(stage_offsets: list[int], g: int) -> str:
    p = int(np.searchsorted(stage_offsets, g, side="right") - 1)
    return f"p{p} s{g - stage_offsets[p]}"


def _tick_size(rows: int) -> float:
    return 9 if rows <= 16 else 7 if rows <= 40 else 5


def _category(kind: int, reforward: bool) -> str:
    if kind == 2:
        return "backward"
    if kind == 1:
        return "no-grad forward"
    return "re-forward" if reforward else "forward"


def _draw_tasks(ax, tl, row_of: dict[int, float], span: float, max_labels: int) -> None:
    t = tl.tasks
    gstage = np.asarray(tl.stage_offsets[:-1])[t.pipeline] + t.stage
    keep = np.flatnonzero(np.isin(gstage, list(row_of)))
    bars: dict[tuple[float, str], list] = {}
    wide = keep[(tl.finish[keep] - tl.start[keep]) > span / 90]
    label = set(wide.tolist()) if len(wide) <= max_labels else set()
    for i in keep.tolist():
        y, width = row_of[int(gstage[i])], tl.finish[i] - tl.start[i]
        compute = width - tl.comm[i]
        bars.setdefault((y, _category(int(t.kind[i]), bool(t.reforward[i]))), []).append((tl.start[i], compute))
        if tl.comm[i] > 0:
            bars.setdefault((y, "communication"), []).append((tl.start[i] + compute, tl.comm[i]))
        if i in label:
            ax.text(tl.start[i] + width / 2, y, str(int(t.index[i])), ha="center", va="center", fontsize=7)
        _draw_send(ax, tl, i, int(gstage[i]), int(t.kind[i]), row_of)
    edge = 0.4 if len(row_of) <= 16 else 0.0  # white gaps would wash out narrow bars
    for (y, cat), xs in bars.items():
        ax.broken_barh(xs, (y - 0.4, 0.8), facecolors=COLOURS[cat], edgecolor="white", linewidth=edge)


def _draw_send(ax, tl, i: int, g: int, kind: int, row_of: dict[int, float]) -> None:
    """A hand-off as a thin bar along the bottom of the receiving stage's row (sends are zero
    where there is no neighbour, so the target is always in the same pipeline)."""
    if tl.send[i] <= 0:
        return
    target = g - 1 if kind == 2 else g + 1
    if target in row_of:
        ax.broken_barh([(tl.finish[i], tl.send[i])], (row_of[target] + 0.3, 0.12),
                       facecolors=COLOURS["communication"])


def _draw_sync(ax, tl, row_of: dict[int, float]) -> None:
    for g, y in row_of.items():
        width = tl.sync_end[g] - tl.sync_start[g]
        if width > 0:
            ax.broken_barh([(tl.sync_start[g], width)], (y - 0.4, 0.8), facecolors=COLOURS["gradient reduction"])


def draw_memory(result: SimResult, path, *, max_pipelines: int = 4, max_lines: int = 16) -> None:
    """Write a PNG of memory held over time, one line per stage, one panel per pipeline."""
    tl, mem = result.timeline, result.timeline.memory
    pipes = shown_pipelines(result, max_rows=max_lines * max_pipelines)[:max_pipelines]
    scale, unit = (2.0**30, "GiB") if result.memory_unit == "bytes" else (1.0, result.memory_unit)
    fig = Figure(figsize=(11, 2.6 * len(pipes) + 0.8), dpi=110)
    end = max(result.step_time_s, result.makespan)
    for n, p in enumerate(pipes):
        ax = fig.add_subplot(len(pipes), 1, n + 1)
        for g in range(tl.stage_offsets[p], min(tl.stage_offsets[p + 1], tl.stage_offsets[p] + max_lines)):
            times, levels = mem.time[mem.stage == g], mem.level[mem.stage == g]
            settled = np.r_[times[1:] != times[:-1], True]  # a free and an alloc at one instant: no dip
            times, levels = times[settled], levels[settled]
            xs = np.r_[0.0, times, end]
            ys = np.r_[mem.base[g], levels, levels[-1] if len(levels) else mem.base[g]] / scale
            ax.step(xs, ys, where="post", linewidth=1.0, label=f"stage {g - tl.stage_offsets[p]}")
        if result.capacity_bytes:
            ax.axhline(result.capacity_bytes / scale, color="red", linestyle="--", linewidth=0.8, label="capacity")
        ax.set_ylabel(f"pipeline {p} ({unit})", fontsize=8)
        ax.legend(fontsize=6, ncol=4, loc="upper right")
        ax.grid(alpha=0.3)
    fig.axes[-1].set_xlabel(f"time ({result.time_unit})")
    left = len(result.pipeline_makespan) - len(pipes)
    more = f"; {len(pipes)} of {len(result.pipeline_makespan)} pipelines shown ({left} left out)" if left else ""
    fig.suptitle(f"simulated memory held per stage (model states, activations, K/V state and gradients){more}",
                 fontsize=10)
    _save(fig, path)


def _save(fig: Figure, path) -> None:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    write_atomic(path, buf.getvalue())
