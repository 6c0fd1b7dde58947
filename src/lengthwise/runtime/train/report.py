"""What a run shows while it trains: each step's record, the progress bar, the metrics file,
TensorBoard, and the message of a step that went non-finite.

    reporter = Reporter(config, shown=rank == 0, step=start_step)
    reporter.step(record)      # after the step's checkpoint, if it had one
    reporter.close()

The JSONL metrics are always written (when the run has a metrics path); TensorBoard, through
torch.utils.tensorboard, logs the same numbers to OUT/tensorboard when the tensorboard package
is installed.
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass

from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.outputs import append_metrics


@dataclass(kw_only=True)
class StepRecord:
    """What one optimizer step did; `metrics()` is its metrics-file line."""

    step: int
    """Steps completed, counting from 1."""
    loss: float
    """Mean token cross-entropy of the global batch (nats), before the update."""
    tokens: int
    """Real tokens in the global batch."""
    seq_ids: tuple[int, ...]
    """The batch's sequences (corpus indices), in sampler order."""
    step_s: float
    """Wall time of the step, seconds, waiting for its plan included."""
    wait_ms: float
    """Of that, time spent waiting for the planning thread, milliseconds."""
    planning_ms: float
    """Time the planner (and plan validation) took in the worker thread, milliseconds."""
    peak_memory_bytes: int
    """Saved-for-backward bytes (CPU) or CUDA max_memory_allocated, this step (the largest
    over the ranks of a distributed run)."""
    memory_kind: str
    """saved_for_backward or cuda_max_allocated."""
    grad_norm: float
    """Global gradient 2-norm before clipping."""
    planner: str
    """Planner that made the step's plan."""
    padding_fraction: float
    """Padding share of the plan's row tokens."""
    lr: float = 0.0
    """Learning rate the step used (schedule.lr_factor)."""
    eval_loss: float | None = None
    """Held-out loss after the step, on steps that evaluated (config.eval_every)."""
    skipped: bool = False
    """The loss or gradient norm was not finite and the update was skipped (skip_nonfinite)."""
    nonfinite_param: str | None = None
    """On a skipped step: the first parameter whose gradient was not finite, if any."""
    switch: dict | None = None
    """When the step's plan changed the parallel strategy (Hydraulis across processes): what
    the switch cost (`train/dist_hetero.py`)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def metrics(self) -> dict:
        return {"step": self.step, "loss": json_number(self.loss), "tokens": self.tokens,
                "sequences": len(self.seq_ids), "tokens_per_s": self.tokens_per_s,
                "step_s": self.step_s, "peak_memory_bytes": self.peak_memory_bytes,
                "memory_kind": self.memory_kind, "planning_ms": self.planning_ms,
                "wait_ms": self.wait_ms, "grad_norm": json_number(self.grad_norm), "planner": self.planner,
                "padding_fraction": self.padding_fraction, "lr": self.lr,
                **({"eval_loss": self.eval_loss} if self.eval_loss is not None else {}),
                **({"skipped": True} if self.skipped else {}),
                **({"switch": self.switch} if self.switch is not None else {})}


class Reporter:
    """Progress bar, metrics lines and TensorBoard of one process (all silent unless `shown`)."""

    def __init__(self, config: TrainConfig, *, shown: bool, step: int):
        from tqdm import tqdm  # the bar's import is slow; only a training run pays it

        self.config, self.shown = config, shown
        self.progress = tqdm(total=config.steps, initial=step, desc="train", unit="step",
                             disable=not (config.progress and shown), dynamic_ncols=True)
        self.writer = open_tensorboard(config.out) if shown else None

    def step(self, record: StepRecord) -> None:
        if not self.shown:
            return
        postfix = {"loss": f"{record.loss:.4f}", "tok_s": f"{record.tokens_per_s:,.0f}"}
        if record.eval_loss is not None:
            postfix["eval"] = f"{record.eval_loss:.4f}"
        self.progress.set_postfix(postfix, refresh=False)
        self.progress.update(1)
        line = record.metrics()
        if self.config.metrics is not None:
            append_metrics(self.config.metrics, [line])
        log_tensorboard(self.writer, line)

    def close(self) -> None:
        self.progress.close()
        if self.writer is not None:
            self.writer.close()


def json_number(value: float) -> float | None:
    """JSON has no NaN or infinity: a skipped step's non-finite value is written as null."""
    return value if math.isfinite(value) else None


def open_tensorboard(out: str | Path | None):
    """A SummaryWriter logging to out/tensorboard, or None when there is no output folder or
    the tensorboard package is not installed."""
    if out is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(Path(out) / "tensorboard"))


def log_tensorboard(writer, line: dict) -> None:
    """One metrics line as scalars at its step (numbers only)."""
    if writer is None:
        return
    step = line["step"]
    for key, value in line.items():
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
            writer.add_scalar("eval/loss" if key == "eval_loss" else f"train/{key}", value, step)
    writer.flush()


def nonfinite_message(record: StepRecord, kept: Path | None) -> str:
    """One line: the step, what was not finite, the first parameter with a non-finite gradient,
    which checkpoint remains, and what to change."""
    what = f"the loss is {record.loss}" if not math.isfinite(record.loss) else f"the gradient norm is {record.grad_norm}"
    where = f" (first non-finite gradient: {record.nonfinite_param})" if record.nonfinite_param else ""
    keeps = f"the last checkpoint, {kept}, is kept" if kept else "no checkpoint was written"
    return (f"step {record.step}: {what}{where}; training stopped before the update and {keeps}. "
            f"Lower --lr or --grad-clip, or pass --skip-nonfinite to skip such steps")
