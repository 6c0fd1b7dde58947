"""`lengthwise train` across processes: the single-process loop with one rank's executor.

    torchrun --nproc-per-node 4 -m lengthwise train --dp 2 --pp 2 --out ckpt     # any launcher
    lengthwise train --nproc 2 --dp 2 --dtype float64 --steps 4                  # local workers

First every rank checks that it was started with rank 0's training settings (`agree.
check_same_settings`: lr, weight decay, data, ...; a one-line error naming the fields otherwise).
Then every rank runs `train.run_training`, the loop a single process runs: it samples the same
global batch (same seed, same sampler position), plans it in its own planning thread (a plan is
a function of the batch and the seed only), and hands it to a `RankExecutor`, which

- checks once per step that every rank holds the same plan (`dp.check_same_plan`: a 16-byte
  hash, all-gathered) and that the ranks' stages are those of the first step;
- runs this rank's (pipeline, stage, CP rank) part (`step.run_rank_step`), which ends with each
  gradient summed over the ranks holding its parameter;
- clips with the global gradient norm (`dp.global_grad_norm`, each parameter counted once) and
  steps AdamW over the parameters this rank holds (`dp.held_parameters`); every holder of a
  parameter sees the same summed gradient, so the replicas stay equal;
- notes each action in its `RankStatus`, which the launcher shows if the rank dies;
- checkpoints with `checkpoint_dist` (torch.distributed.checkpoint shards, plus each rank's
  sampler position and RNG states, sealed by a manifest), and rank 0 adds the gathered weights as config.json and
  model.safetensors, so a distributed checkpoint is also a model directory for `--model`.

Rank 0 alone writes the metrics and shows the progress bar. Resume is exact as on one process
(tests/test_distributed_fault.py kills a rank mid-step under torchrun). The final weights equal a
single-process run with the same plan settings up to the order of floating-point sums
(tests/test_train_distributed.py: within 1e-10 in float64 after two AdamW steps).

Each rank builds the whole model (seeded, so every copy starts equal) and updates only its
stage's parameters: simple, and memory-bound for models whose full weights do not fit one
device. Which parameters a rank holds comes from the first batch's plan and may not change;
every planner with fixed dp / pp / cp and layers per stage keeps it, and a plan that moves
stages is refused with the step named.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
import lengthwise.runtime.distributed.checkpoint_dist as checkpoint_dist
from lengthwise.runtime.distributed.dp import (
    check_same_plan,
    global_grad_norm,
    held_parameters,
)
from lengthwise.runtime.distributed.agree import check_same_settings
from lengthwise.runtime.distributed.launch import (
    RankStatus,
    init_from_torchrun,
    spawn,
    under_torchrun,
)
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.distributed.step import gather_grads_like, run_rank_step
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.train.config import TrainConfig, check_degrees
from lengthwise.runtime.train.executor import RESUME_MUST_MATCH, PreparedStep, StepOutcome
from lengthwise.runtime.train.loop import (
    Setup,
    TrainResult,
    make_optimizer,
    resolve_device,
    run_training,
)
from lengthwise.runtime.train.outputs import default_run_folder, with_outputs
from lengthwise.runtime.train.schedule import first_nonfinite
from lengthwise.runtime.train.signals import StopRequest
from lengthwise.runtime.train.step import PeakMemory, is_padded
from lengthwise.runtime.weights import load_state, save_pretrained
from lengthwise.workloads.sampler import GlobalBatchSampler

AfterAction = Callable[[int, int], None]
"""Called as after_action(step, action_index) after each action of this rank (fault tests)."""


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
        dist.destroy_process_group()
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
    """This rank's part of `config`, in an initialised process group of dp * pp * cp ranks."""
    with StopRequest(quiet=mesh.rank != 0) as stop:  # from here a signal waits for a step boundary
        check_same_settings(config.to_dict(), mesh.device, ignore=PER_PROCESS)
        setup = Setup(config, device=mesh.device)
        return run_training(setup, RankExecutor(setup, mesh, after_action=after_action, status=status), stop=stop)


def layout_signature(plan: StepPlan, num_layers: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """What fixes each rank's stage and parameters: every pipeline's pp, cp and layers per stage."""
    return [(pipe.pp, pipe.cp, tuple(pipe.stage_layers(num_layers))) for pipe in plan.pipelines]


class RankExecutor:
    """One rank's step, optimizer and checkpoints (the module docstring lists what a step does)."""

    must_match = RESUME_MUST_MATCH + ("dp", "pp", "cp")
    """Config fields a checkpoint must share with the run resuming it."""
    result_model = None
    """No rank holds the whole trained model (the checkpoints do)."""

    def __init__(self, setup: Setup, mesh: Mesh, *, after_action: AfterAction | None = None,
                 status: RankStatus | None = None):
        config = setup.config
        check_degrees(config, mesh.world_size, "the process group")
        self.config, self.model, self.mesh, self.after_action = config, setup.model, mesh, after_action
        self.status = status or RankStatus(None)
        self.nproc, self.is_reporter = mesh.world_size, mesh.rank == 0
        self.first_plan = setup.plan(GlobalBatchSampler(setup.source, seed=config.seed,
                                                        **config.sampler_size).next_batch())
        self._check_unpadded(self.first_plan, 1)
        self.layout = mesh.layout(self.first_plan)  # collective: creates the CP groups
        self.held = held_parameters(self.model, self.first_plan, self.layout.place)
        self.optimizer = make_optimizer(self.model, config, held=self.held.values())

    def step(self, prepared: PreparedStep, step: int) -> StepOutcome:
        plan, model = prepared.plan, self.model
        check_same_plan(plan, self.mesh.device)
        self._check_unpadded(plan, step)
        self._check_layout(plan, step)
        self.optimizer.zero_grad(set_to_none=True)
        hook = functools.partial(self._after_action, plan, step)
        self.status.note(f"step {step}: starting the actions of {self.layout.place}")
        with PeakMemory(model) as peak:
            done = run_rank_step(model, plan, prepared.token_ids, mesh=self.mesh, backend=self.config.backend,
                                 check_plan=False, after_action=hook)
        self.status.note(f"step {step}: gradient norm and optimizer step, after the actions of {self.layout.place}")
        grad_norm = global_grad_norm(model, plan, done.layout, device=self.mesh.device)
        outcome = StepOutcome(loss=done.loss, grad_norm=grad_norm, peak_memory_bytes=self._largest(peak.bytes),
                              memory_kind=peak.kind)
        if not outcome.finite:  # the loss and the norm are global: every rank skips the update
            outcome.nonfinite_param = first_nonfinite(self.held.items())
            return outcome
        if self.config.grad_clip:  # the rule of clip_grad_norm_, with the norm over all ranks
            torch.nn.utils.clip_grads_with_norm_(list(self.held.values()), self.config.grad_clip,
                                                 torch.tensor(grad_norm, dtype=torch.float64))
        self.optimizer.step()
        return outcome

    def agree_stop(self, requested: bool) -> bool:
        """Whether any rank was asked to stop (collective, at every step boundary), so that all
        stop after the same step and write one complete checkpoint."""
        flag = torch.tensor([int(requested)], dtype=torch.int64, device=self.mesh.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def eval_model(self) -> CausalLM | None:
        """Rank 0's model with every stage's current weights (collective); None elsewhere."""
        weights = gather_grads_like(self.model, self.layout, self.first_plan, lambda p: p.detach().cpu())
        if weights is None:
            return None
        load_state(self.model, weights)
        return self.model

    def _check_unpadded(self, plan: StepPlan, step: int) -> None:
        if is_padded(plan):
            raise UserError(f"step {step}: --planner {self.config.planner} pads micro-batches, which run as "
                            f"padded rows on one process only; use --planner packing (the same batches, "
                            f"unpadded) across processes")

    def _after_action(self, plan: StepPlan, step: int, index: int) -> None:
        """Note the action for the launcher's report, then the caller's hook (fault tests)."""
        place = self.layout.place
        actions = plan.pipelines[place.pipeline].stages[place.stage]
        self.status.note(f"step {step}, {self.layout.place}: finished action {index} ({actions[index]}) "
                         f"of {len(actions)}")
        if self.after_action is not None:
            self.after_action(step, index)

    def _check_layout(self, plan: StepPlan, step: int) -> None:
        layers = self.model.spec.num_layers
        now, first = layout_signature(plan, layers), layout_signature(self.first_plan, layers)
        if now != first:
            raise UserError(f"step {step}: the plan's pipelines (pp, cp, layers per stage) are {now}, "
                            f"step 1's were {first}; across processes each rank keeps its stage, so "
                            f"use planner options that keep them the same every step")

    def _largest(self, value: int) -> int:
        """The largest `value` over the ranks (collective)."""
        total = torch.tensor([value], dtype=torch.int64, device=self.mesh.device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return int(total.item())

    def latest_checkpoint(self, out: str) -> Path | None:
        """The newest intact checkpoint (collective; a single-process one too, so that `load`
        can say so rather than overwrite it)."""
        return checkpoint_dist.latest_checkpoint(out)

    def load(self, path: Path) -> dict:
        """Verify, then restore this rank's parameters, optimizer state and RNGs; returns its
        trainer state."""
        self.status.note(f"loading checkpoint {path}")
        return checkpoint_dist.load_checkpoint(path, model=self.model, optimizer=self.optimizer, held=self.held)

    def save(self, step: int, trainer: dict) -> Path:
        self.status.note(f"step {step}: saving its checkpoint")
        return checkpoint_dist.save_checkpoint(self.config.out, step=step, model=self.model,
                                               optimizer=self.optimizer, held=self.held, extras=trainer,
                                               also=self._save_weights)

    def _save_weights(self, path: Path) -> None:
        """Rank 0 writes the whole model in Hugging Face format, each tensor from its lowest holder
        (collective). Rank 0's copies of other stages' parameters are brought up to date on the way."""
        weights = gather_grads_like(self.model, self.layout, self.first_plan, lambda p: p.detach().cpu())
        if weights is not None:
            load_state(self.model, weights)
            save_pretrained(self.model, path)
