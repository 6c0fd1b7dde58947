"""What a run shows while it trains: the progress bar, the metrics file, TensorBoard, and the
message of a step that went non-finite.

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
from typing import TYPE_CHECKING

from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.outputs import append_metrics

if TYPE_CHECKING:
    from lengthwise.runtime.train.loop import StepRecord


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
