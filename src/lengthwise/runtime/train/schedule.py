"""Learning rate over the run, settings changed on resume, and steps that went non-finite.

    scheduler = make_scheduler(optimizer, config, done=start_step)   # torch's LambdaLR
    changes = apply_settings(optimizer, config, saved_config)      # new --lr / --weight-decay
    bad = first_nonfinite(model.named_parameters())                # name of a NaN/inf gradient

The schedule is a closed form of the step number (linear warm-up, then constant or half a
cosine down to min_lr), so a resumed run only sets the step: the learning rate of every step
is bit-identical to the uninterrupted run's, and no scheduler state has to be checkpointed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lengthwise.runtime.train.config import TrainConfig


def lr_factor(index: int, config: TrainConfig) -> float:
    """Multiplier of config.lr for the step with 0-based `index` (the (index + 1)-th step)."""
    warmup = config.warmup_steps
    if index < warmup:
        return (index + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return 1.0
    span = max(config.steps - warmup - 1, 1)
    progress = min((index - warmup) / span, 1.0)
    low = config.min_lr / config.lr
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, *,
                   done: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `optimizer` positioned for step `done + 1` (`done` steps already run):
    call its step() after each optimizer step."""
    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr  # LambdaLR's base; a resumed --lr replaces the saved one
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda index: lr_factor(index, config),
                                             last_epoch=done - 1)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def apply_settings(optimizer: torch.optim.Optimizer, config: TrainConfig, saved: dict) -> list[str]:
    """Put this run's lr and weight decay into an optimizer restored from a checkpoint (its
    parameter groups hold the old ones); returns a line per setting that changed. Weight decay
    goes to the groups that had it (matrices), never to norms and biases."""
    changes = []
    for key, flag in (("lr", "--lr"), ("weight_decay", "--weight-decay")):
        old, new = saved.get(key), getattr(config, key)
        if old is not None and old != new:
            changes.append(f"{flag} {old:g} -> {new:g}")
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = config.lr
        if group["weight_decay"] != 0.0:
            group["weight_decay"] = config.weight_decay
    return changes


def first_nonfinite(named: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """The first parameter (in model order) whose gradient holds a NaN or an infinity."""
    for name, param in named:
        if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
            return name
    return None
