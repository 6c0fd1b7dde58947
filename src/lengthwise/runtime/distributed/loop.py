"""A small distributed training loop over the executor, with checkpoints and resume.

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 -m lengthwise.runtime.distributed.loop \\
        --out runs/a --steps 4 --dp 2 --pp 2 --chunk-size 32 --k 1
    python -m lengthwise.runtime.distributed.loop --help

Every rank samples the same global batch (profile lengths, seeded and resumable), plans it,
draws the same token ids, runs its stage (`step.run_rank_step`), and updates the parameters
it holds with AdamW. A checkpoint (`checkpoint_dist`) is written every --checkpoint-every steps;
at start the loop resumes from the newest complete checkpoint in --out, so when torchrun
restarts the group after a rank died, training continues from there and ends with the weights
an uninterrupted run reaches (bit for bit: the same sums in the same order). Rank 0 writes the
final weights to OUT/final.pt (a dict of Hugging Face names to tensors).

This is the distributed part of training only; `lengthwise train` (another module) is the
user-facing command. `--fail-at STEP:RANK:ACTION` kills that rank with SIGKILL after that
action of that step, once (a marker file in --out remembers it), to test recovery.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from lengthwise.cost import CostModel
from lengthwise.plan.ir import StepPlan, write_atomic
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.distributed.checkpoint_dist import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from lengthwise.runtime.distributed.dp import held_parameters
from lengthwise.runtime.distributed.launch import init_from_torchrun
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.distributed.step import gather_grads_like, run_rank_step
from lengthwise.runtime.model import build_model
from lengthwise.runtime.verify import random_tokens
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import profile_source

FAULT_MARKER = "fault-injected"


@dataclass(kw_only=True)
class LoopConfig:
    """One run of the loop."""

    out: Path
    """Folder for checkpoints, the fault marker and final.pt."""
    steps: int
    """Optimizer steps in all."""
    checkpoint_every: int = 1
    """Steps between checkpoints."""
    model: str = "tiny"
    planner: str = "chunkflow"
    options: dict = field(default_factory=dict)
    """Planner options (chunk_size, k, ...)."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    profile: str = "lmsys"
    """Length profile of the batches."""
    context_length: int = 96
    """Longer sequences are truncated to this many tokens."""
    batch_size: int = 8
    """Sequences per global batch."""
    seed: int = 0
    lr: float = 1e-3
    fail_at: tuple[int, int, int] | None = None
    """(step, rank, action index): kill that rank there, once."""


def plan_batch(config: LoopConfig, lengths: list[int]) -> StepPlan:
    spec = model_preset(config.model)
    scheme = ParallelScheme(dp=config.dp, pp=config.pp, cp=config.cp)
    cluster = cluster_preset("cpu", scheme.num_gpus)
    request = PlanRequest(lengths=list(lengths), model=spec, cluster=cluster, scheme=scheme,
                          cost=CostModel(model=spec, cluster=cluster), context_length=config.context_length,
                          seed=config.seed, options=dict(config.options))
    return get_planner(config.planner)(request)


def train(config: LoopConfig, mesh: Mesh) -> None:
    config.out.mkdir(parents=True, exist_ok=True)
    sampler = GlobalBatchSampler(profile_source(config.profile, config.context_length, "truncate"),
                                 seed=config.seed, batch_size=config.batch_size)
    first = plan_batch(config, copy.deepcopy(sampler).next_batch().lengths)
    model = build_model(first.model, dtype=torch.float64, device=mesh.device, seed=config.seed)
    layout = mesh.layout(first)
    held = held_parameters(model, first, layout.place)
    optimizer = torch.optim.AdamW(held.values(), lr=config.lr)
    start = 0
    if (path := latest_checkpoint(config.out)) is not None:
        extras = load_checkpoint(path, model=model, optimizer=optimizer, held=held)
        sampler.load_state_dict(extras["sampler"])
        start = extras["step"]
        _log(config, mesh, {"resumed_from": str(path.name), "step": start})
    for step in range(start, config.steps):
        batch = sampler.next_batch()
        plan = plan_batch(config, batch.lengths)
        tokens = random_tokens(plan.lengths, plan.model.vocab, config.seed + 1 + batch.index)
        optimizer.zero_grad(set_to_none=True)
        result = run_rank_step(model, plan, tokens, mesh=mesh, after_action=_fault(config, step, mesh.rank))
        optimizer.step()
        _log(config, mesh, {"step": step, "loss": result.loss})
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
            save_checkpoint(config.out, step=step + 1, model=model, optimizer=optimizer, held=held,
                            extras={"sampler": sampler.state_dict()})
    _save_final(config.out / "final.pt", model, first, layout)


def train_single_process(config: LoopConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same run on one process with `run_step` (no checkpoints): final weights and losses,
    to check a distributed run against (equal up to the order of floating-point sums)."""
    from lengthwise.runtime.execute import run_step

    sampler = GlobalBatchSampler(profile_source(config.profile, config.context_length, "truncate"),
                                 seed=config.seed, batch_size=config.batch_size)
    model = optimizer = None
    losses = []
    for _ in range(config.steps):
        batch = sampler.next_batch()
        plan = plan_batch(config, batch.lengths)
        if model is None:
            model = build_model(plan.model, dtype=torch.float64, seed=config.seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        optimizer.zero_grad(set_to_none=True)
        tokens = random_tokens(plan.lengths, plan.model.vocab, config.seed + 1 + batch.index)
        losses.append(float(run_step(model, plan, tokens)))
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _log(config: LoopConfig, mesh: Mesh, record: dict) -> None:
    """One JSON line in OUT/log.jsonl, from rank 0."""
    if mesh.rank == 0:
        with open(config.out / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def _fault(config: LoopConfig, step: int, rank: int):
    """The action hook that kills this rank at config.fail_at, the first time only."""
    marker = config.out / FAULT_MARKER
    if config.fail_at is None or config.fail_at[:2] != (step, rank) or marker.exists():
        return None

    def kill_after(index: int) -> None:
        if index == config.fail_at[2]:
            write_atomic(marker, f"step {step} rank {rank} action {index}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    return kill_after


def _save_final(path: Path, model, plan: StepPlan, layout) -> None:
    weights = gather_grads_like(model, layout, plan, lambda p: p.detach().cpu())
    if weights is not None:
        blob = io.BytesIO()
        torch.save(weights, blob)
        write_atomic(path, blob.getvalue())
    dist.barrier()


def parse_args(argv: list[str] | None = None) -> LoopConfig:
    p = argparse.ArgumentParser(prog="python -m lengthwise.runtime.distributed.loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=1)
    p.add_argument("--model-config", default="tiny")
    p.add_argument("--planner", default="chunkflow")
    p.add_argument("--chunk-size", type=int)
    p.add_argument("--k", type=int)
    for name in ("dp", "pp", "cp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context-length", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-at", metavar="STEP:RANK:ACTION", help="kill a rank there once (recovery tests)")
    a = p.parse_args(argv)
    options = {k: v for k, v in (("chunk_size", a.chunk_size), ("k", a.k)) if v is not None}
    fail = tuple(int(x) for x in a.fail_at.split(":")) if a.fail_at else None
    return LoopConfig(out=a.out, steps=a.steps, checkpoint_every=a.checkpoint_every, model=a.model_config,
                      planner=a.planner, options=options, dp=a.dp, pp=a.pp, cp=a.cp, batch_size=a.batch_size,
                      context_length=a.context_length, seed=a.seed, fail_at=fail)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    mesh = init_from_torchrun()
    try:
        train(config, mesh)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
