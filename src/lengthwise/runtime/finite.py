"""Nothing non-finite is ever saved: one check of the weights and optimizer state before a save.

    bad = nonfinite_state(model.named_parameters(), optimizer)   # None, or the first bad one's name
    check_saveable(model, optimizer, step=7)                     # UserError naming it

The loss and gradient norm are checked every step (loop.py), but they do not cover everything a
checkpoint holds: a weight decay with lr * weight_decay far above 1 multiplies every matrix by
a huge negative number, so the weights are infinite after an update whose loss was finite, and
weights loaded non-finite stay so while every step is skipped. So right before any save the
state itself is checked.

Cost: one fused reduction per device (`torch._foreach_norm` with ord=inf, the largest |x| of
each tensor: NaN or inf exactly when the tensor holds one, and never overflowing as a 2-norm's
squares would), stacked and tested with one host sync, at save time only. The per-tensor search
for a name runs only once something is found.

A distributed run checks its local shards (`all_finite` gives the flag without a sync) and must
agree across ranks before saving (an all-reduce of the flag), else one rank would refuse while
the others wait in the save's collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from lengthwise.errors import UserError


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (this rank's part), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _checked(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out = [_local(t).detach() for t in tensors]
    return [t for t in out if t.is_floating_point() and t.numel() > 0]


def all_finite(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One 0-d bool tensor per device (no host sync): whether every element of `tensors` on that
    device is finite."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in _checked(tensors):
        by_device.setdefault(t.device, []).append(t)
    flags = []
    for group in by_device.values():
        largest = torch._foreach_norm(group, ord=math.inf)  # NaN/inf iff the tensor holds one
        flags.append(torch.isfinite(torch.stack([x.to(torch.float64 if x.device.type == "cpu" else torch.float32)
                                                 for x in largest])).all())
    return flags


def first_nonfinite_tensor(named: dict) -> object | None:
    """The first key of `named` (name -> tensor) whose tensor holds a NaN or an infinity, or None.
    One fused check; the per-tensor search only when it fails."""
    if all(bool(flag) for flag in all_finite(named.values())):
        return None
    return next(k for k, t in named.items() if t.is_floating_point() and not bool(torch.isfinite(_local(t)).all()))


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors (AdamW's moments, step counts), named by their parameter
    (`names`: id(parameter) -> name) as 'optimizer exp_avg of NAME'."""
    out = {}
    for i, (param, state) in enumerate(optimizer.state.items()):
        owner = names.get(id(param), f"parameter {i}")
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer {key} of {owner}"] = value
    return out


def nonfinite_state(named_parameters: Iterable[tuple[str, torch.Tensor]],
                    optimizer: torch.optim.Optimizer | None) -> str | None:
    """Name of the first weight or optimizer tensor with a NaN or an infinity, or None."""
    named = dict(named_parameters)
    if optimizer is not None:
        named |= optimizer_tensors(optimizer, {id(t): n for n, t in named.items()})
    return first_nonfinite_tensor(named)


def check_saveable(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, step: int,
                   kept: Callable[[], object] = lambda: None) -> None:
    """UserError, before anything is written, when the state a checkpoint after `step` would hold
    is not finite. `kept()`: the newest checkpoint already on disk, named as what remains (asked
    only then: finding it hashes its files)."""
    bad = nonfinite_state(model.named_parameters(), optimizer)
    if bad is None:
        return
    last = kept()
    keeps = f"the last checkpoint, {last}, is kept" if last else "no checkpoint was written"
    raise UserError(f"step {step}: {bad} holds NaN or infinite values, so it is not saved and {keeps}; "
                    "lower --lr or --weight-decay, or start from finite weights")


def check_saveable_across_ranks(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, step: int,
                                device: torch.device, group=None) -> None:
    """check_saveable for one rank of a distributed run: every rank calls it right before the
    save (it is a collective: one all-reduce of a flag over `group`, default the world), and all
    of them refuse together when any rank's shards hold a NaN or an infinity."""
    named = dict(model.named_parameters())
    if optimizer is not None:
        named |= optimizer_tensors(optimizer, {id(t): n for n, t in named.items()})
    check_finite_across_ranks(named, step=step, device=device, group=group)


def check_finite_across_ranks(named: dict, *, step: int, device: torch.device, group=None) -> None:
    """The collective check on what this rank is about to save (`named`: name -> tensor, its
    shards): one all-reduce of a flag, so every rank refuses together."""
    import torch.distributed as dist

    flags = [flag.to(device) for flag in all_finite(named.values())]
    ok = (torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)).to(torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # int32: NCCL reduces no bools
    if bool(ok):
        return
    bad = first_nonfinite_tensor(named)
    where = f"{bad} on rank {dist.get_rank()}" if bad is not None else "another rank's weights or optimizer state"
    raise UserError(f"step {step}: {where} holds NaN or infinite values, so nothing is saved and the last "
                    "checkpoint is kept; lower --lr or --weight-decay, or start from finite weights")
