"""What runs one training step's plan: the `Executor` interface the training loop
(runtime/train/loop.py) drives, and `LocalExecutor`, one process running the whole plan.

An executor owns what differs between one process and many: which part of the plan runs here,
which parameters the optimizer updates, how the gradient norm is taken, and the checkpoint
format. The distributed one, one rank of dp * pp * cp * tp, is `runtime/train/dist.py`'s `RankExecutor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.schedule import first_nonfinite
from lengthwise.runtime.train.step import PeakMemory, forward_backward
from lengthwise.workloads.sampler import GlobalBatch

RESUME_MUST_MATCH = ("model", "data", "tokenizer", "text_field", "context_length", "overlong", "seed",
                     "eval_every", "eval_sequences")
"""Config fields a resumed run must share with its checkpoint (they define the data stream
and the weights' shape); the sampler checks its own batch size / token budget."""


@dataclass(kw_only=True)
class PreparedStep:
    """A batch ready to execute: what the worker thread hands the training loop."""

    batch: GlobalBatch
    plan: StepPlan
    token_ids: list[torch.Tensor]
    planning_ms: float
    sampler_state: dict
    """The sampler's position after this batch: what a checkpoint after it stores."""


@dataclass(kw_only=True)
class StepOutcome:
    """What an executor's step gave (the same on every rank of a distributed run)."""

    loss: float
    """Mean token cross-entropy of the global batch (nats), before the update."""
    grad_norm: float
    """Global gradient 2-norm before clipping."""
    peak_memory_bytes: int
    """Peak memory of the step (the largest over the ranks)."""
    memory_kind: str
    """saved_for_backward or cuda_max_allocated."""
    nonfinite_param: str | None = None
    """When the loss or gradient norm is not finite (the optimizer did not step): the first
    parameter, in model order, whose gradient is; None if only the loss is."""
    switch: dict | None = None
    """The cost of a strategy switch before the step, if there was one (`train/dist_hetero.py`)."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class Executor(Protocol):
    """Runs each step's plan and owns the optimizer and the checkpoints."""

    is_reporter: bool
    nproc: int
    must_match: tuple[str, ...]
    result_model: CausalLM | None

    optimizer: torch.optim.Optimizer

    def step(self, prepared: PreparedStep, step: int) -> StepOutcome: ...
    def agree_stop(self, requested: bool) -> bool: ...
    def held_out_loss(self, setup) -> float | None: ...
    def latest_checkpoint(self, out: str) -> Path | None: ...
    def load(self, path: Path) -> dict: ...
    def save(self, step: int, trainer: dict) -> Path: ...


class LocalExecutor:
    """This process runs the whole plan (`forward_backward`), AdamW over every parameter,
    checkpoints as Hugging Face directories (runtime/checkpoint.py)."""

    is_reporter = True
    """Writes the metrics and the progress bar."""
    nproc = 1
    must_match = RESUME_MUST_MATCH
    """Config fields a checkpoint must share with the run resuming it."""

    def __init__(self, config: TrainConfig, model: CausalLM, optimizer: torch.optim.Optimizer):
        self.config, self.model, self.optimizer = config, model, optimizer
        self.result_model = model

    def step(self, prepared: PreparedStep, step: int) -> StepOutcome:
        model, config = self.model, self.config
        self.optimizer.zero_grad(set_to_none=True)
        with PeakMemory(model) as peak:
            loss = forward_backward(model, prepared.plan, prepared.token_ids, backend=config.backend)
        params = [p for p in model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)  # clip_grad_norm_'s two halves
        # the step's one host sync: loss and norm read together
        loss_value, norm_value = torch.stack([loss.detach().double().reshape(()),
                                              grad_norm.to(loss.device, torch.float64)]).tolist()
        outcome = StepOutcome(loss=loss_value, grad_norm=norm_value, peak_memory_bytes=peak.bytes,
                              memory_kind=peak.kind)
        if not outcome.finite:  # no update: name the first bad gradient for the caller
            outcome.nonfinite_param = first_nonfinite(model.named_parameters())
            return outcome
        if config.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, config.grad_clip, grad_norm)
        self.optimizer.step()
        return outcome

    def agree_stop(self, requested: bool) -> bool:
        """Whether to stop after this step (one process: its own signal flag)."""
        return requested

    def held_out_loss(self, setup) -> float:
        """The held-out loss of the current weights (`heldout.py`)."""
        from lengthwise.runtime.train.heldout import held_out_loss

        return held_out_loss(self.model, setup.source, setup.eval_ids, backend=setup.config.backend)

    def latest_checkpoint(self, out: str) -> Path | None:
        return latest_checkpoint(out)

    def load(self, path: Path) -> dict:
        """Restore weights, optimizer and RNGs from `path`; returns its trainer state."""
        return load_checkpoint(path, self.model, self.optimizer)

    def save(self, step: int, trainer: dict) -> Path:
        return save_checkpoint(self.config.out, step=step, model=self.model, optimizer=self.optimizer,
                               trainer=trainer)
