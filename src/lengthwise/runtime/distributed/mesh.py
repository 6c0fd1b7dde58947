"""Which process runs which part of a StepPlan, and the process groups between them.

Ranks are laid out pipeline by pipeline (each pipeline is one data-parallel replica, possibly
with its own tp x pp x cp, as Hydraulis plans), stage by stage inside a pipeline, then CP rank,
TP rank innermost (TP talks several times per layer, CP once per layer: both sit on
neighbouring ranks, i.e. inside one node):

    plan: 2 pipelines, pp=2, cp=2          rank = offset(pipeline) + (stage * cp + cp_rank) * tp + tp_rank
    pipeline 0: stage 0 -> ranks 0 1,  stage 1 -> ranks 2 3
    pipeline 1: stage 0 -> ranks 4 5,  stage 1 -> ranks 6 7

A rank talks point-to-point and in CP collectives only with ranks of its own TP rank: each TP
shard of a stage is a pipeline of its own for activations' sake (activations between stages are
replicated over TP, K/V state is the rank's own heads).

Groups are created on demand and cached by their member ranks. torch.distributed requires
every process to call `new_group` for every group in the same order; every rank holds the same
plan (checked by `dp.check_same_plan`), so every rank asks for the same groups in the same
(sorted) order. The `Mesh` object is passed around explicitly: no global process group
singleton beyond torch's own default group, no environment-variable switches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan


@dataclass(frozen=True, kw_only=True)
class Place:
    """What one rank runs."""

    pipeline: int
    """Index into StepPlan.pipelines."""
    stage: int
    """Pipeline stage (0 = embedding side)."""
    cp_rank: int
    """Position inside the stage's context-parallel group, 0 .. cp - 1."""
    tp_rank: int = 0
    """Position inside the stage's tensor-parallel group, 0 .. tp - 1."""

    def __str__(self) -> str:
        tp = f" tp rank {self.tp_rank}" if self.tp_rank else ""
        return f"pipeline {self.pipeline} stage {self.stage} cp rank {self.cp_rank}{tp}"


def plan_places(plan: StepPlan) -> list[Place]:
    """Place of every rank, indexed by rank (the layout in the module docstring)."""
    return [Place(pipeline=p, stage=s, cp_rank=c, tp_rank=t) for p, pipe in enumerate(plan.pipelines)
            for s in range(pipe.pp) for c in range(pipe.cp) for t in range(pipe.tp)]


def plan_world_size(plan: StepPlan) -> int:
    return len(plan_places(plan))


def check_world_size(plan: StepPlan, world_size: int) -> None:
    """UserError showing the arithmetic when the plan needs a different number of processes."""
    terms = " + ".join(f"pp({p.pp}) * cp({p.cp})" + (f" * tp({p.tp})" if p.tp > 1 else "")
                       for p in plan.pipelines)
    needed = plan_world_size(plan)
    if needed != world_size:
        raise UserError(f"the plan needs {terms} = {needed} processes, got {world_size}: "
                        f"launch with --nproc {needed} (or torchrun --nproc-per-node {needed})")


@dataclass(kw_only=True)
class Mesh:
    """This process's rank, its device, and the process groups of the current plan."""

    rank: int
    world_size: int
    device: torch.device
    """Where this rank's model lives (cpu with gloo, cuda:local_rank with nccl)."""
    timeout_s: float = 300.0
    """Seconds a point-to-point receive may wait before the step fails with a named error."""
    device_mesh: DeviceMesh | None = None
    """The (pp, dp, cp, tp) DeviceMesh of the plan the model was parallelised for (FSDP2, TP);
    None for a replicated model (`runtime/parallel/device_mesh.py`)."""
    compute_dtype: torch.dtype | None = None
    """Activation dtype when FSDP2 computes in another dtype than the master weights (bf16
    over fp32); None: the parameters' dtype."""
    _groups: dict[tuple[int, ...], object] = field(default_factory=dict, repr=False)

    @classmethod
    def from_default_group(cls, *, device: torch.device | str | None = None, timeout_s: float = 300.0) -> Mesh:
        """The mesh of an initialised default process group; `device` by default from its
        backend: the current CUDA device with NCCL, else the CPU."""
        assert dist.is_initialized(), "init_process_group first (launch.init_from_torchrun / spawn)"
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=torch.device(device),
                   timeout_s=timeout_s)

    def layout(self, plan: StepPlan) -> PlanLayout:
        """Places of the plan's ranks, with every group the plan needs created (collective)."""
        check_world_size(plan, self.world_size)
        layout = PlanLayout(places=plan_places(plan), rank=self.rank)
        self.ensure_groups(layout.cp_groups())
        return layout

    def ensure_groups(self, rank_sets: list[tuple[int, ...]]) -> None:
        """Create the missing groups; every rank must pass the same list (collective)."""
        for ranks in sorted(set(rank_sets)):
            if len(ranks) > 1 and ranks not in self._groups:
                self._groups[ranks] = dist.new_group(list(ranks))

    def group(self, ranks: tuple[int, ...]):
        """The cached group of exactly these ranks (this rank must be one of them)."""
        assert self.rank in ranks, (self.rank, ranks)
        return self._groups[ranks]


@dataclass(frozen=True, kw_only=True)
class PlanLayout:
    """The ranks of one plan: who runs what, and who talks to whom."""

    places: list[Place]
    """Place of every rank, indexed by rank."""
    rank: int
    """This process's rank."""

    @property
    def place(self) -> Place:
        return self.places[self.rank]

    def rank_of(self, pipeline: int, stage: int, cp_rank: int, tp_rank: int = 0) -> int:
        return self._index[(pipeline, stage, cp_rank, tp_rank)]

    @cached_property
    def _index(self) -> dict[tuple[int, int, int, int], int]:
        return {(p.pipeline, p.stage, p.cp_rank, p.tp_rank): r for r, p in enumerate(self.places)}

    def stage_ranks(self, pipeline: int, stage: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The CP group of one stage of one pipeline (ranks of one TP rank)."""
        return tuple(r for r, p in enumerate(self.places)
                     if (p.pipeline, p.stage, p.tp_rank) == (pipeline, stage, tp_rank))

    def cp_groups(self) -> list[tuple[int, ...]]:
        return sorted({self.stage_ranks(p.pipeline, p.stage, p.tp_rank) for p in self.places})

    @property
    def my_cp_ranks(self) -> tuple[int, ...]:
        return self.stage_ranks(self.place.pipeline, self.place.stage, self.place.tp_rank)
