"""Data parallelism: the same plan on every rank, gradients summed once per step.

Every rank samples and plans the same global batch itself (planning is deterministic for a
seed), so nothing but a fingerprint travels: `check_same_plan` all-gathers 16 bytes of a hash
of the plan once per step and raises a UserError naming the ranks that disagree, before any
rank runs a plan the others do not.

Gradients. Each chunk's loss is already divided by the global batch's loss-token count
(runtime/loss.py), so the gradient of one process running the whole batch is the SUM of the
gradients every rank computed for its part: over data-parallel replicas, over the CP ranks of a
stage (each saw a share of the tokens), and, for tied embeddings, over the first and the last
stage. `GradReducer` groups parameters by the exact set of ranks holding them, and all-reduces
(SUM) each group's gradients in flat buckets once, after the stage's last backward.

Two ways, chosen when the rank's model is built (`parallel/build.build_rank_model`):

- FSDP2 (`parallel/fsdp.py`, the default for plans with uniform pipelines and zero >= 1):
  `fully_shard` over the dp x cp ranks of a stage does the sum (a reduce-scatter into each
  rank's shard, once per step: gradient sync stays off until the stage's last backward);
  `GradReducer(sharded=True)` then only sums what FSDP cannot see, the tied embedding's shards
  of the first and the last stage.
- Heterogeneous pipelines with tp > 1 somewhere: `parallel/hetero_reducer.HeteroReducer` (TP
  shards of different widths cannot share an all-reduce).
- Replicated (zero 0, heterogeneous pipelines at tp 1, or a whole model on every rank): `GradReducer`
  groups parameters by the exact set of ranks holding them and all-reduces (SUM) each group's
  gradients in flat buckets once, after the stage's last backward, launched asynchronously
  together. DDP is not used: it fires its all-reduces from gradient hooks during every backward,
  and a plan runs many (one per backward unit's cell, with K/V roots and re-forwards between).

With tensor parallelism the sums run per TP rank (TP ranks hold different shards), except for
K/V projections replicated over TP, whose gradients are partial per TP rank.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.distributed.mesh import Mesh, Place, PlanLayout
from lengthwise.runtime.distributed.stats import CommStats
from lengthwise.runtime.model import CausalLM, StagePart, parameter_names
from lengthwise.runtime.parallel.tensor_parallel import tp_partial_names

BUCKET_ELEMENTS = 1 << 22
"""Elements per all-reduce bucket (32 MiB of float64, 8 MiB of bfloat16)."""


def plan_fingerprint(plan: StepPlan) -> str:
    """Hex digest of everything the executor reads from the plan (not the planner's metrics,
    which hold timings)."""
    data = {k: v for k, v in plan.to_dict().items() if k != "metrics"}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def check_same_plan(plan: StepPlan, device=None) -> None:
    """All-gather each rank's plan fingerprint (16 bytes); UserError naming the odd ranks.
    `device`: where the collective's tensor lives (cuda with NCCL)."""
    digest = bytes.fromhex(plan_fingerprint(plan))[:16]
    mine = torch.tensor(list(digest), dtype=torch.uint8).view(torch.int64).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    prints = [t.cpu().view(torch.uint8).numpy().tobytes().hex()[:12] for t in gathered]
    if len(set(prints)) > 1:
        raise UserError(_mismatch_message(prints))


def _mismatch_message(prints: list[str]) -> str:
    by_print: dict[str, list[int]] = {}
    for rank, fp in enumerate(prints):
        by_print.setdefault(fp, []).append(rank)
    groups = sorted(by_print.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    parts = [f"ranks {ranks} have plan {fp}" for fp, ranks in groups]
    return ("the ranks planned different global batches (" + "; ".join(parts) + "): every rank must "
            "sample the same batch (same seed and sampler position) and plan it with the same "
            "planner and options")


def stage_layer_range(plan: StepPlan, place: Place, num_layers: int) -> range:
    counts = plan.pipelines[place.pipeline].stage_layers(num_layers)
    first = sum(counts[:place.stage])
    return range(first, first + counts[place.stage])


def stage_part(plan: StepPlan, place: Place) -> StagePart:
    """The modules the rank at `place` builds (`model.build_model(..., part=...)`)."""
    last = place.stage == plan.pipelines[place.pipeline].pp - 1
    return StagePart(layers=stage_layer_range(plan, place, plan.model.num_layers), first=place.stage == 0, last=last)


def holds(name: str, plan: StepPlan, place: Place, model: CausalLM) -> bool:
    """Whether the rank at `place` computes a gradient for parameter `name`."""
    pipe = plan.pipelines[place.pipeline]
    return stage_holds(name, layers=stage_layer_range(plan, place, model.spec.num_layers), first=place.stage == 0,
                       last=place.stage == pipe.pp - 1, tied=model.spec.tied_embeddings)


def stage_holds(name: str, *, layers: range, first: bool, last: bool, tied: bool) -> bool:
    """Whether a stage with decoder layers `layers` (the first and / or the last stage) holds
    parameter `name`."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layers
    if name == "model.embed_tokens.weight":
        return first or (last and tied)
    assert name in ("model.norm.weight", "lm_head.weight"), name
    return last


def held_parameters(model: CausalLM, plan: StepPlan, place: Place) -> dict[str, torch.nn.Parameter]:
    """The parameters of the rank's stage (tied embeddings: on the first and the last stage)."""
    return {n: p for n, p in model.named_parameters() if holds(n, plan, place, model)}


def holder_sets(model: CausalLM, plan: StepPlan, layout: PlanLayout) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the ranks whose gradients of it are summed: those holding it with this
    rank's TP rank (TP ranks hold different shards, or, for replicated parameters such as the
    norms, equal gradients). Every parameter of the whole model, whatever this rank builds."""
    tp_rank = layout.place.tp_rank
    return {name: tuple(r for r, place in enumerate(layout.places)
                        if place.tp_rank == tp_rank and holds(name, plan, place, model))
            for name in parameter_names(model.spec)}


def reduction_classes(model: CausalLM, plan: StepPlan, layout: PlanLayout, *,
                      sharded: bool) -> dict[str, list[tuple[int, ...]]]:
    """Per parameter, the disjoint rank sets over which its gradient is summed.

    Replicated parameters: the holders of each TP rank (TP ranks hold different shards), or all
    holders for K/V weights replicated over TP (`tensor_parallel.tp_partial_names`).
    Under FSDP2 (`sharded`), FSDP already summed over dp x cp, and each rank holds its own
    shard: what is left is the sum over stages of one (pipeline, CP rank, TP rank) coordinate,
    i.e. the tied embedding of the first and the last stage."""
    partial = tp_partial_names(model.spec, max(p.tp for p in plan.pipelines))
    out = {}
    for name in parameter_names(model.spec):
        over_tp = partial(name)  # replicated K/V weights: each TP rank holds a part of the gradient
        classes: dict[tuple, list[int]] = {}
        for r, place in enumerate(layout.places):
            if holds(name, plan, place, model):
                tp_key = () if over_tp else (place.tp_rank,)
                key = (place.pipeline, place.cp_rank, *tp_key) if sharded else tp_key
                classes.setdefault(key, []).append(r)
        out[name] = [tuple(c) for c in classes.values()]
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of a DTensor (sharing its storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def tp_sharded(param: torch.Tensor) -> bool:
    """Whether the TP ranks hold different pieces of `param` (else they hold equal copies)."""
    if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
        return False
    return param.placements[param.device_mesh.mesh_dim_names.index("tp")].is_shard()


def match_grad_layouts(model: torch.nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements, so that each rank's local piece
    of the gradient is the piece of the parameter it holds (what the norm and the optimizer
    read). Without FSDP2, DTensor leaves some gradients in another layout: the vocabulary-
    parallel embedding's (rows Shard(0) over TP) comes back Replicate, whole on every TP rank,
    which `global_grad_norm` then counted tp times. Replicate to Shard is a local slice."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def global_grad_norm(model: CausalLM, plan: StepPlan, layout: PlanLayout, device=None) -> torch.Tensor:
    """2-norm of the whole model's gradient after the step's reductions (collective), a float64
    scalar on `device`: each piece of each parameter counted once, by the lowest rank of its
    reduction class (and by TP rank 0 for TP-replicated parameters). For gradient clipping,
    which must scale every rank's gradients by the same factor.

    No host sync: one `torch._foreach_norm` per (device, dtype) of the counted pieces and one
    all-reduce; the caller reads the result once."""
    classes = reduction_classes(model, plan, layout, sharded=isinstance(model, FSDPModule))
    counted = []
    for name, p in model.named_parameters():
        mine = next((c for c in classes[name] if layout.rank in c), None)  # None: a whole model's other stages
        if p.grad is None or mine is None or mine[0] != layout.rank or not (layout.place.tp_rank == 0 or tp_sharded(p)):
            continue
        counted.append(local(p.grad))
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for grads in _by_device_and_dtype(counted):
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        total += torch.stack(norms).to(total.device).pow(2).sum()
    dist.all_reduce(total)
    return total.sqrt()[0]


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors in groups that one foreach call takes."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


class GradReducer:
    """Sums each parameter's gradient (its local piece) over its reduction class, in flat buckets."""

    def __init__(self, *, model: CausalLM, plan: StepPlan, layout: PlanLayout, mesh: Mesh,
                 stats: CommStats, sharded: bool = False, bucket_elements: int = BUCKET_ELEMENTS):
        self.model, self.mesh, self.stats, self.bucket_elements = model, mesh, stats, bucket_elements
        classes = reduction_classes(model, plan, layout, sharded=sharded)
        mesh.ensure_groups([c for cs in classes.values() for c in cs])  # collective: same list everywhere
        self.sets = {name: next(c for c in cs if layout.rank in c) for name, cs in classes.items()
                     if any(layout.rank in c for c in cs)}
        self.params = dict(model.named_parameters())
    def reduce(self) -> None:
        """All-reduce (SUM) every held gradient; a held parameter with no gradient counts as 0."""
        pending = []
        for ranks, names in self._my_groups():
            group = self.mesh.group(ranks)
            for bucket in self._buckets(names):
                flat = torch.cat([self._grad(n).reshape(-1) for n in bucket])
                pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
                self.stats.dp_elements += flat.numel()
                self.stats.dp_buckets += 1
        for work, flat, bucket in pending:
            work.wait()
            self._scatter_back(flat, bucket)

    def _my_groups(self) -> list[tuple[tuple[int, ...], list[str]]]:
        groups: dict[tuple[int, ...], list[str]] = {}
        for name, ranks in self.sets.items():
            if self.mesh.rank in ranks and len(ranks) > 1:
                groups.setdefault(ranks, []).append(name)
        return sorted(groups.items())

    def _buckets(self, names: list[str]) -> list[list[str]]:
        buckets, size = [[]], 0
        for name in names:
            numel = local(self.params[name]).numel()
            if buckets[-1] and size + numel > self.bucket_elements:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += numel
        return buckets

    def _grad(self, name: str) -> torch.Tensor:
        param = self.params[name]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return local(param.grad)

    def _scatter_back(self, flat: torch.Tensor, names: list[str]) -> None:
        at = 0
        for name in names:
            grad = local(self.params[name].grad)
            grad.copy_(flat[at:at + grad.numel()].view_as(grad))
            at += grad.numel()
