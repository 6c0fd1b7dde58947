"""Checkpoints of a distributed run: model and optimizer with torch.distributed.checkpoint (DCP),
plus each rank's sampler position and random-number generators.

    save_checkpoint(folder, step=7, model=model, optimizer=opt, held=held, extras={"sampler": s.state_dict()})
    path = latest_checkpoint(folder)                       # newest complete one, or None
    extras = load_checkpoint(path, model=model, optimizer=opt, held=held)

Layout of one checkpoint, `folder/step-000007/`: DCP's files (one shard file per rank and a
`.metadata`), `rank-R.pt` per rank (step, sampler state, torch / Python / NumPy RNG states),
and `COMPLETE`, written by rank 0 after every rank has finished. A checkpoint without
`COMPLETE` (a rank died while saving) is ignored, so a restarted group resumes from the last
one all ranks finished.

Each rank saves only the parameters its stage holds (`dp.held_parameters`), keyed by their
Hugging Face names; data-parallel and CP replicas hold identical values (gradients are summed
before the update) and DCP writes each key once. The optimizer state is flattened per
parameter (`flatten_optimizer_state_dict`), so stages with different parameters never write
the same key with different contents (torchtitan does the same for pipeline stages).
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lengthwise.plan.ir import write_atomic

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
COMPLETE = "COMPLETE"


def checkpoint_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:06d}"


def save_checkpoint(folder: str | Path, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    held: dict[str, torch.nn.Parameter], extras: dict | None = None) -> Path:
    """Collective: every rank calls it after the optimizer step of `step`."""
    path = checkpoint_path(folder, step)
    state = {"model": {n: p.detach() for n, p in held.items()},
             "optim": get_optimizer_state_dict(model, optimizer, options=_FLAT)}
    dcp.save(state, checkpoint_id=str(path))
    blob = io.BytesIO()
    torch.save({"step": step, **(extras or {}), "rng": rng_state()}, blob)
    write_atomic(path / f"rank-{dist.get_rank()}.pt", blob.getvalue())
    dist.barrier()
    if dist.get_rank() == 0:
        write_atomic(path / COMPLETE, f"{dist.get_world_size()}\n")
    dist.barrier()
    return path


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest checkpoint every rank finished writing."""
    done = sorted(p.parent for p in Path(folder).glob(f"step-*/{COMPLETE}"))
    return done[-1] if done else None


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    held: dict[str, torch.nn.Parameter]) -> dict:
    """Load weights and optimizer state in place, restore this rank's RNGs; returns its extras
    (step, sampler, ...)."""
    optim_state = get_optimizer_state_dict(model, optimizer, options=_FLAT)
    state = {"model": {n: p.detach() for n, p in held.items()}, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optim"], options=_FLAT)
    extras = torch.load(path / f"rank-{dist.get_rank()}.pt", weights_only=False)
    set_rng_state(extras.pop("rng"))
    return extras


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
