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
- runs this rank's (pipeline, stage, CP rank, TP rank) part (`step.run_rank_step`), which ends
  with each gradient summed over the ranks holding its parameter (FSDP2's reduce-scatter into
  each rank's shard, or `dp.GradReducer`);
- clips with the global gradient norm (`dp.global_grad_norm`, each piece counted once) and
  steps AdamW over the rank's own parameters (its shards); every holder of a piece sees the
  same summed gradient, so replicas stay equal;
- notes each action in its `RankStatus`, which the launcher shows if the rank dies;
- checkpoints with `checkpoint_dist` (each rank's own shards in safetensors with a JSON index,
  plus each rank's sampler position and RNG states, sealed by a manifest; rank 0 adds the
  model's config.json); `lengthwise export` turns one into a model directory for `--model`.

Rank 0 alone writes the metrics and shows the progress bar. Resume is exact as on one process
(tests/test_distributed_fault.py kills a rank mid-step under torchrun). The final weights equal a
single-process run with the same plan settings up to the order of floating-point sums
(tests/test_train_distributed.py: within 1e-10 in float64 after two AdamW steps;
tests/test_train_parallel.py: dp2 x tp2, pp2 x tp2 and a dp4 -> dp2 resume).

Each rank builds only its part of the model (`parallel/build.build_rank_model`, as `verify`
does): its stage's layers (embedding on the first stage, norm and head on the last), split over
the stage's TP ranks with DTensor when tp > 1, and sharded over the stage's dp x cp ranks with
FSDP2 when the plan's pipelines are uniform and zero >= 1 (ZeRO-3 with zero 3); seeded weights
are the same values whatever the split, or read from a Hugging Face folder (--model DIR), each
rank reading its stage's tensors. AdamW holds that rank's `model.parameters()` (its shards),
and with --dtype bfloat16 under FSDP2 those are float32 master weights while forward and
backward run in bfloat16 (`MixedPrecisionPolicy`). Zero 0 keeps whole stage parameters on
every replica (`dp.GradReducer`). Which stage a rank holds comes from the first batch's plan
and may not change; every planner with fixed dp / pp / cp / tp and layers per stage keeps it,
and a plan that moves stages is refused with the step named.

--planner hydraulis runs on `dist_hetero.HeteroRankExecutor` instead (`dist_launch.rank_executor`): its
pipelines may each have their own tp x pp x cp and change from step to step; the optimizer
state is dealt element by element over all ranks and a strategy switch moves none of it.

No rank holds the whole model, ever: checkpoints write each rank's shards as they lie
(`distributed/shards.py`), export consolidates them offline one tensor at a time, and the
held-out loss runs sharded on the training mesh (`held_out_loss`).

A checkpoint resumes at another dp (same pp, cp and tp): each rank reads its new FSDP2 shards of
the parameters and AdamW states from the saved pieces that overlap them, the per-rank extras must agree (sampler position, step), and each new rank takes
the random-number states of the saved rank at its (pipeline mod old dp, stage, CP rank, TP
rank) place (training draws from no global generator, so this choice changes no result).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
from lengthwise.files import write_atomic
import lengthwise.runtime.distributed.checkpoint_dist as checkpoint_dist
from lengthwise.runtime.parallel.dp import (
    check_same_plan,
    global_grad_norm,
    local,
    match_grad_layouts,
)
from lengthwise.runtime.distributed.launch import RankStatus
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.parallel.step import first_holders, run_rank_step
from lengthwise.runtime.compile import compile_layers, compile_wanted
from lengthwise.runtime.model import parameter_names
from lengthwise.runtime.parallel.build import ParallelOptions, build_rank_model
from lengthwise.runtime.parallel.device_mesh import uniform_degrees
from lengthwise.runtime.train.config import TrainConfig, check_degrees
from lengthwise.runtime.train.executor import RESUME_MUST_MATCH, PreparedStep, StepOutcome
from lengthwise.runtime.train.heldout import held_out_batch, plan_held_out
from lengthwise.runtime.train.loop import Setup, make_optimizer, weights_folder
from lengthwise.runtime.train.step import PeakMemory, is_padded
from lengthwise.runtime.weights import hf_config_dict
from lengthwise.workloads.sampler import GlobalBatchSampler

ROUND_ROBIN = "round-robin"
"""A checkpoint's `optimizer_layout` extra when its optimizer state was dealt element by element
over all ranks (the Hydraulis executor's layout before OWNED_BY_HOLDERS)."""
OWNED_BY_HOLDERS = "owned-by-holders"
"""A checkpoint's `optimizer_layout` extra when each element's optimizer state is owned by one of
the ranks holding it (`dist_hetero.HeteroRankExecutor`, `parallel/hetero.py`)."""

AfterAction = Callable[[int, int], None]
"""Called as after_action(step, action_index) after each action of this rank (fault tests)."""


def layout_signature(plan: StepPlan, num_layers: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """What fixes each rank's stage and parameters: every pipeline's pp, cp and layers per stage."""
    return [(pipe.pp, pipe.cp, tuple(pipe.stage_layers(num_layers))) for pipe in plan.pipelines]


class RankExecutor:
    """One rank's step, optimizer and checkpoints (the module docstring lists what a step does)."""

    must_match = RESUME_MUST_MATCH
    """Config fields a checkpoint must share with the run resuming it; pp, cp and tp too, checked
    before anything loads (`_check_shape_of_run`, where checkpoints older than --tp count as
    tp 1); dp may differ (resharding)."""
    result_model = None
    """No rank holds the whole trained model (the checkpoints do)."""

    def __init__(self, setup: Setup, mesh: Mesh, *, after_action: AfterAction | None = None,
                 status: RankStatus | None = None):
        config = setup.config
        check_degrees(config, mesh.world_size, "the process group")
        self.config, self.mesh, self.after_action = config, mesh, after_action
        self.status = status or RankStatus(None)
        self.nproc, self.is_reporter = mesh.world_size, mesh.rank == 0
        self.first_plan = setup.plan(GlobalBatchSampler(setup.source, seed=config.seed,
                                                        **config.sampler_size).next_batch())
        self._check_unpadded(self.first_plan, 1)
        self._build()

    def _build(self) -> None:
        """This rank's model, layout and optimizer for the first plan."""
        config, mesh = self.config, self.mesh
        self.status.note(f"building its part of the model for {config.model}")
        self.model = build_rank_model(self.first_plan, mesh, **rank_model_args(config, self.first_plan))
        if compile_wanted(True if config.compile_chain else config.compile, mesh.device):
            compile_layers(self.model, chain=config.compile_chain)
        self.layout = mesh.layout(self.first_plan)
        self.held = dict(self.model.named_parameters())  # its stage's (shards of) parameters
        self.optimizer = make_optimizer(self.model, config)

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
        match_grad_layouts(model)
        norm = global_grad_norm(model, plan, done.layout, device=self.mesh.device)
        grad_norm = float(norm)  # the step's one read of the norm
        outcome = StepOutcome(loss=done.loss, grad_norm=grad_norm, peak_memory_bytes=self._largest(peak.bytes),
                              memory_kind=peak.kind)
        if not outcome.finite:  # the loss and the norm are global: every rank skips the update
            outcome.nonfinite_param = self._first_nonfinite()
            return outcome
        if self.config.grad_clip:  # clip_grads_with_norm_'s rule on each rank's pieces, the norm over all ranks
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            for grads in _grads_by_dtype(self.held.values()):
                torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        self.optimizer.step()
        return outcome

    def _first_nonfinite(self) -> str | None:
        """The first parameter, in model order, with a NaN or infinity in any rank's piece of its
        gradient (collective)."""
        mine = [name for name, p in self.held.items()
                if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())]
        every = [None] * self.mesh.world_size
        dist.all_gather_object(every, mine)
        bad = {name for names in every for name in names}
        return next((name for name in parameter_names(self.model.spec) if name in bad), None)

    def agree_stop(self, requested: bool) -> bool:
        """Whether any rank was asked to stop (collective, at every step boundary), so that all
        stop after the same step and write one complete checkpoint."""
        flag = torch.tensor([int(requested)], dtype=torch.int64, device=self.mesh.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def held_out_loss(self, setup) -> float | None:
        """The held-out loss, run sharded on the training mesh as one more planned batch
        (`heldout.plan_held_out`): every rank its own stage and shards, nothing gathered; the
        step's gradients are dropped (collective; the value on rank 0, None elsewhere)."""
        batch, token_ids = held_out_batch(setup.source, setup.eval_ids)
        if not token_ids:
            return float("nan") if self.is_reporter else None
        plan = plan_held_out(setup, batch, options=self._held_out_options())
        self._check_unpadded(plan, 0)
        self._check_held_out_layout(plan)
        self.status.note("held-out loss: running the held-out batch")
        done = run_rank_step(self.model, plan, token_ids, mesh=self.mesh, backend=self.config.backend,
                             **self._held_out_step_args())
        self._drop_grads()
        return done.loss if self.is_reporter else None

    def _held_out_options(self) -> dict | None:
        return None

    def _held_out_step_args(self) -> dict:
        return {}

    def _check_held_out_layout(self, plan: StepPlan) -> None:
        layers = self.model.spec.num_layers
        if layout_signature(plan, layers) != layout_signature(self.first_plan, layers):
            raise UserError(f"the held-out batch's plan moves stages ({layout_signature(plan, layers)}, training's "
                            f"are {layout_signature(self.first_plan, layers)}); use planner options that keep "
                            f"them the same, or fewer --eval-sequences")

    def _drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

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
        """Verify, then restore this rank's parameters, optimizer state and RNGs (resharded when
        the checkpoint was written at another dp); returns its trainer state."""
        self.status.note(f"loading checkpoint {path}")
        return checkpoint_dist.load_checkpoint(path, model=self.model, optimizer=self.optimizer, held=self.held,
                                               check=functools.partial(self._check_shape_of_run, path),
                                               saved_rank=self._saved_rank,
                                               allow_pickle=self.config.allow_pickle_checkpoint)

    def _check_shape_of_run(self, path: Path, extras: dict) -> None:
        """UserError naming the degrees when the checkpoint's pp, cp or tp differ from this
        run's (only dp may change: FSDP2 shards are resharded, stages and TP shards are not)."""
        saved, config = extras.get("config", {}), self.config
        if extras.get("optimizer_layout") in (ROUND_ROBIN, OWNED_BY_HOLDERS):
            raise UserError(f"{path} holds a Hydraulis run's optimizer state; resume it with "
                            f"--planner hydraulis and --nproc {extras.get('nproc')}")
        degrees = ("dp", "pp", "cp", "tp")
        if any(saved.get(d, 1) != getattr(config, d) for d in degrees[1:]):
            then = " x ".join(f"{d}={saved.get(d, 1)}" for d in degrees)
            now = " x ".join(f"{d}={getattr(config, d)}" for d in degrees)
            use = " ".join(f"--{d} {saved.get(d, 1)}" for d in degrees[1:])
            raise UserError(f"{path} was trained with {then}, this run has {now}: a resumed run may change "
                            f"dp only; use {use}")

    def _saved_rank(self, nproc: int) -> int:
        """The rank of a checkpoint written by `nproc` processes at this rank's place, its pipeline
        taken modulo the saved dp (ranks run pipeline by pipeline, `distributed/mesh.py`)."""
        per_pipeline = self.config.pp * self.config.cp * self.config.tp
        pipeline, within = divmod(self.mesh.rank, per_pipeline)
        return (pipeline % (nproc // per_pipeline)) * per_pipeline + within

    def save(self, step: int, trainer: dict) -> Path:
        self.status.note(f"step {step}: saving its checkpoint")
        return checkpoint_dist.save_checkpoint(self.config.out, step=step, model=self.model,
                                               optimizer=self.optimizer, held=self.held, extras=trainer,
                                               also=self._save_config, writes=self._writes())

    def _writes(self) -> Callable[[str], bool]:
        """writes(name): whether this rank writes its plain copy of parameter `name` (the lowest
        rank holding it does; DTensor pieces are deduplicated by their placements)."""
        first = first_holders(self.model, self.plan_for_layout, self.layout)
        return lambda name: first.get(name) == self.mesh.rank

    @property
    def plan_for_layout(self) -> StepPlan:
        """The plan whose layout this rank's parameters follow."""
        return self.first_plan

    def _save_config(self, path: Path) -> None:
        """Rank 0 writes the model's Hugging Face config.json (`lengthwise export` reads it); no
        rank writes the whole model: export consolidates the shards offline."""
        if self.mesh.rank == 0:
            write_atomic(path / "config.json", json.dumps(hf_config_dict(self.model.spec), indent=1))


def rank_model_args(config: TrainConfig, plan: StepPlan) -> dict:
    """`build_rank_model`'s keywords for this run: weights seeded or from --model DIR; with
    --dtype bfloat16 under FSDP2, float32 master weights and bfloat16 compute (without FSDP2,
    bfloat16 parameters, as one process trains); tensor parallelism with or without sequence
    parallelism as config.sequence_parallel says."""
    folder = weights_folder(config.model)
    dtype = getattr(torch, config.dtype)
    sharded = plan.zero > 0 and uniform_degrees(plan) is not None
    param_dtype = None
    if dtype == torch.bfloat16 and sharded:
        dtype, param_dtype = torch.float32, torch.bfloat16
    return {"dtype": dtype, "seed": None if folder else config.seed, "weights": folder,
            "options": ParallelOptions(data_parallel="fsdp", param_dtype=param_dtype,
                                       sequence_parallel=config.sequence_parallel)}


def _grads_by_dtype(params) -> list[list[torch.Tensor]]:
    """The local gradient pieces of `params`, grouped by dtype and device (one foreach call each)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            grad = local(param.grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return list(groups.values())
