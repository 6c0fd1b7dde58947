"""One training step of a StepPlan across processes: this rank's stage as a plain loop.

    mesh = Mesh.from_default_group()                       # after init_process_group
    result = run_rank_step(model, plan, token_ids, mesh=mesh)
    result.loss                                            # the global loss, on every rank

Per step, on every rank: check that all ranks hold the same plan (`dp.check_same_plan`), build
the runner of this rank's (pipeline, stage, CP rank) with a torch.distributed transport, run its
action list in order (a receive blocks until the neighbour stage has sent; chunkflow §4.3's
state-aware 1F1B, infinipipe §4 and slimpack §4.2 schedules are all such lists), wait for the
last sends, sum gradients over the ranks holding each parameter once (`dp.GradReducer`), and
all-reduce the loss. The result equals one process running the whole plan (`run_step`):
within float64 round-off, since the sums run in another order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.attention import resolve_backend
from lengthwise.runtime.checks import check_executable
from lengthwise.runtime.distributed.cp_stage import CPRows
from lengthwise.runtime.parallel.dp import GradReducer, check_same_plan, holds, match_grad_layouts
from lengthwise.runtime.distributed.mesh import Mesh, PlanLayout
from lengthwise.runtime.distributed.p2p import DistributedTransport, ReceiveTimeout, StepFailed
from lengthwise.runtime.distributed.stats import CommStats
from lengthwise.runtime.model import CausalLM, parameter_names
from lengthwise.runtime.weights import VOCAB_ROWS
from lengthwise.runtime.parallel.fsdp import FsdpSteps, is_fsdp
from lengthwise.runtime.parallel.hetero_reducer import HeteroReducer  # heterogeneous tp: hydraulis §5.2 exchange
from lengthwise.runtime.stage import StageRunner


@dataclass(kw_only=True)
class RankStepResult:
    """What one rank did in one step."""

    loss: float
    """The global batch's loss (sum of token cross-entropies / loss tokens), same on every rank."""
    layout: PlanLayout
    """Who ran what."""
    stats: CommStats = field(default_factory=CommStats)
    """Elements this rank sent."""
    num_actions: int = 0
    """Actions this rank ran."""
    loop_s: float = 0.0
    """Seconds in the action loop (compute, waits and bookkeeping)."""
    sharding: str = "replicated"
    """replicated (whole parameters, `dp.GradReducer`), fsdp-per-chunk (ZeRO-3: all-gathers
    around every forward and backward) or fsdp-per-step (gathered once for the step)."""


def run_rank_step(model: CausalLM, plan: StepPlan, token_ids: list[torch.Tensor], *, mesh: Mesh,
                  backend: str = "auto", check_plan: bool = True,
                  after_action: Callable[[int], None] | None = None, dry: bool = False,
                  reduce_grads: bool = True) -> RankStepResult:
    """Forward and backward of this rank's part of `plan`, gradients summed across ranks.
    `after_action(index)` runs after each action (progress, fault injection in tests). `dry`:
    a dry run on fake tensors (`runtime/dryrun.py`), where no value can be read back: the input
    and plan checks are skipped and the loss is not formed (NaN). `reduce_grads=False` leaves
    each rank's own gradients unsummed (the caller sums them: `train/dist.HeteroRankExecutor`
    pushes them straight to the owners of the optimizer state)."""
    if not dry:
        check_executable(plan, model.spec, token_ids)
    if check_plan and not dry:
        check_same_plan(plan, mesh.device)
    layout = mesh.layout(plan)
    stats = CommStats()
    runner, transport = make_runner(model, plan, token_ids, mesh=mesh, layout=layout, stats=stats,
                                    backend=backend)
    fsdp = None
    if is_fsdp(model):
        fsdp = FsdpSteps(model, plan, layout, zero=plan.zero)
        fsdp.begin()
        runner.before_backward_cell = fsdp.before_backward_cell
    started = time.perf_counter()
    run_actions(runner, after_action)
    transport.finish()
    loop_s = time.perf_counter() - started
    if fsdp is not None:
        fsdp.end()
        stats.dp_elements += fsdp.reduced_elements(mesh.device_mesh["dp_cp"].size())
        stats.dp_buckets += len(fsdp.modules)
    if fsdp is None:  # sequence-parallel norms' gradients are partial over TP: summed here (FSDP2 does it itself)
        match_grad_layouts(model)
    if not reduce_grads:
        assert fsdp is None, "FSDP2 sums its gradients itself"
    elif fsdp is None and mesh.device_mesh is None and any(p.tp > 1 for p in plan.pipelines):
        key = (plan.model, tuple((p.tp, p.pp, p.cp, tuple(p.layers_per_stage or ())) for p in plan.pipelines))
        stats.dp_elements += HeteroReducer(model, plan, layout, key=key).reduce()
    else:
        GradReducer(model=model, plan=plan, layout=layout, mesh=mesh, stats=stats,
                    sharded=fsdp is not None).reduce()
    loss = float("nan") if dry else global_loss(runner, mesh, counts=layout.place.tp_rank == 0)
    sharding = "replicated" if fsdp is None else "fsdp-per-chunk" if fsdp.per_chunk else "fsdp-per-step"
    return RankStepResult(loss=loss, layout=layout, stats=stats, num_actions=len(runner.actions), loop_s=loop_s,
                          sharding=sharding)


def make_runner(model: CausalLM, plan: StepPlan, token_ids, *, mesh: Mesh, layout: PlanLayout,
                stats: CommStats, backend: str):
    """This rank's stage runner and its transport."""
    param = next(model.parameters())
    place = layout.place
    transport = DistributedTransport(layout=layout, timeout_s=mesh.timeout_s, stats=stats, dtype=mesh.compute_dtype)
    dtype = mesh.compute_dtype or param.dtype
    common = {"model": model, "plan": plan, "pipeline": place.pipeline, "stage": place.stage, "token_ids": token_ids,
              "transport": transport, "backend": resolve_backend(backend, param.device, dtype)}
    pipe = plan.pipelines[place.pipeline]
    if pipe.cp == 1:
        return StageRunner(**common), transport
    rows = CPRows(pipe, cp_rank=place.cp_rank, cp_group=mesh.group(layout.my_cp_ranks), stats=stats,
                  backend=common["backend"])
    return StageRunner(**common, rows=rows), transport


def run_actions(runner: StageRunner, after_action: Callable[[int], None] | None = None,
                before_action: Callable[[int], None] | None = None) -> None:
    """The stage's actions in order; a receive that never comes ends the step with the stage
    and the action named."""
    while not runner.done:
        if before_action is not None:
            before_action(runner.next_index)
        try:
            runner.step()
        except ReceiveTimeout as exc:
            raise StepFailed(f"{runner.where()}: {exc}") from None
        if after_action is not None:
            after_action(runner.next_index - 1)


def global_loss(runner: StageRunner, mesh: Mesh, *, counts: bool = True) -> float:
    """Sum of every last stage's loss parts (the other ranks, and TP ranks but the first, add 0)."""
    total = runner.loss_sum.detach()
    total = total.to(device=mesh.device, dtype=torch.float64).reshape(1)
    if not (runner.is_last and counts):
        total = torch.zeros_like(total)
    dist.all_reduce(total)
    return float(total.item())


def gather_grads(model: CausalLM, layout: PlanLayout, plan: StepPlan, *, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Every parameter's (reduced) gradient, on rank `dst`, each from the lowest rank holding it."""
    return gather_grads_like(model, layout, plan, _grad_or_zeros, dst=dst)


def gather_grads_like(model: CausalLM, layout: PlanLayout, plan: StepPlan,
                      value: Callable[[torch.nn.Parameter], torch.Tensor], *, dst: int = 0):
    """{name: value(param)} over all parameters, whole, on rank `dst` (None elsewhere), each
    taken from the lowest rank holding the parameter (collective). Sharded values (FSDP2,
    TP) are assembled first (`full_tensor`, collective over the ranks of the stage)."""
    first_holder = first_holders(model, plan, layout)
    mine = {}
    for name, param in model.named_parameters():
        whole = value(param)
        if isinstance(whole, DTensor):
            whole = whole.full_tensor()
        if first_holder[name] == layout.rank:
            mine[name] = _unpadded(name, whole.detach(), model.spec.vocab).cpu()
    gathered = [None] * dist.get_world_size() if layout.rank == dst else None
    dist.gather_object(mine, gathered, dst=dst)
    if layout.rank != dst:
        return None
    return {name: t for part in gathered for name, t in part.items()}


def _unpadded(name: str, tensor: torch.Tensor, vocab: int) -> torch.Tensor:
    """The real vocabulary's rows of a tensor padded for TP (`parallel/tensor_parallel.py`)."""
    return tensor[:vocab] if name in VOCAB_ROWS else tensor


def first_holders(model: CausalLM, plan: StepPlan, layout: PlanLayout) -> dict[str, int]:
    """Per parameter of the whole model, the lowest rank holding it (any TP rank)."""
    return {name: min(r for r, place in enumerate(layout.places) if holds(name, plan, place, model))
            for name in parameter_names(model.spec)}


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)

