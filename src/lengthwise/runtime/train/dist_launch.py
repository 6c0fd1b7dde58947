"""Starting `lengthwise train` across processes: local workers or torchrun, each rank checking
its settings against rank 0's and running the training loop with its executor
(`dist.RankExecutor`, or `dist_hetero.HeteroRankExecutor` for Hydraulis). Kept apart from both
executors so that neither imports the other's module (dist_hetero builds on dist)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from lengthwise.errors import UserError
from lengthwise.runtime.distributed.agree import check_same_settings
from lengthwise.runtime.distributed.launch import (
    RankStatus,
    end_process_group,
    init_from_torchrun,
    spawn,
    under_torchrun,
)
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.dist import AfterAction, RankExecutor
from lengthwise.runtime.train.dist_hetero import HeteroRankExecutor
from lengthwise.runtime.train.loop import Setup, TrainResult, resolve_device, run_training
from lengthwise.runtime.train.outputs import default_run_folder, with_outputs
from lengthwise.runtime.train.signals import StopRequest


def train_distributed(config: TrainConfig, *, after_action: AfterAction | None = None) -> TrainResult | None:
    """Under torchrun: this rank's part of the run (the result on rank 0, None elsewhere).
    Otherwise config.nproc local workers; returns rank 0's result."""
    if under_torchrun():
        return _train_under_torchrun(config, after_action)
    assert config.nproc is not None, "a distributed run needs torchrun or config.nproc"
    device = resolve_device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < config.nproc:
        raise UserError(f"--nproc {config.nproc} on CUDA needs {config.nproc} GPUs, this machine has "
                        f"{torch.cuda.device_count()}: use fewer processes or --device cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    return spawn(_spawned_rank, config.nproc, config, device.type, after_action, backend=backend,
                 timeout_s=config.timeout, with_status=True)


def _train_under_torchrun(config: TrainConfig, after_action: AfterAction | None) -> TrainResult | None:
    if config.nproc is not None:
        raise UserError(f"--nproc {config.nproc} starts local workers; under torchrun leave it out "
                        "(torchrun --nproc-per-node sets the number of processes)")
    mesh = init_from_torchrun(device=resolve_device(config.device).type, timeout_s=config.timeout)
    try:
        result = train_on_rank(_torchrun_outputs(config), mesh, after_action=after_action,
                               status=RankStatus.for_torchrun())
    finally:
        end_process_group()
    return result if mesh.rank == 0 else None


def _torchrun_outputs(config: TrainConfig) -> TrainConfig:
    """Without --out, rank 0 names the run folder and tells the others (their clocks may differ)."""
    chosen = [str(default_run_folder()) if dist.get_rank() == 0 else None]
    if config.out is None:
        dist.broadcast_object_list(chosen, src=0)
    return with_outputs(config, out=chosen[0]) if dist.get_rank() == 0 else \
        dataclasses.replace(config, out=config.out or chosen[0])


def _spawned_rank(rank: int, config: TrainConfig, device_type: str, after_action: AfterAction | None, *,
                  status: RankStatus) -> TrainResult | None:
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    mesh = Mesh.from_default_group(device=device, timeout_s=config.timeout)
    result = train_on_rank(config, mesh, after_action=after_action, status=status)
    return result if rank == 0 else None


PER_PROCESS = ("threads", "progress", "metrics", "device", "token_cache")
"""Config fields that may differ between the ranks of one run (the rest must be equal): only
rank 0 writes the metrics and shows progress; caches and thread counts are per machine."""


def train_on_rank(config: TrainConfig, mesh: Mesh, *, after_action: AfterAction | None = None,
                  status: RankStatus | None = None) -> TrainResult:
    """This rank's part of `config`, in an initialised process group of dp * pp * cp * tp ranks."""
    with StopRequest(quiet=mesh.rank != 0) as stop:  # from here a signal waits for a step boundary
        check_same_settings(config.to_dict(), mesh.device, ignore=PER_PROCESS)
        setup = Setup(config, device=mesh.device, whole_model=False)
        return run_training(setup, rank_executor(setup, mesh, after_action=after_action, status=status), stop=stop)


def rank_executor(setup: Setup, mesh: Mesh, **kwargs) -> "RankExecutor":
    """The executor of this run: `dist_hetero.HeteroRankExecutor` (optimizer state owned by
    the ranks holding it, strategy switches) for Hydraulis, whose pipelines may differ from each other and
    from step to step; `RankExecutor` otherwise."""
    if setup.config.planner == "hydraulis":
        return HeteroRankExecutor(setup, mesh, **kwargs)
    return RankExecutor(setup, mesh, **kwargs)
