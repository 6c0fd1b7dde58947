"""One rank of a full-size job, run for real on this CPU without its memory or its peers: the
executor's own code under fake tensors and the fake process group, measured.

    report = dryrun_rank(plan, rank=5)               # a 7B model on rank 5 of 32, in seconds
    report.peak_memory_bytes, report.memory_bytes["activations"], report.flops, report.comm_bytes

Fake tensors (`torch._subclasses.fake_tensor.FakeTensorMode`) carry shapes, dtypes and
storages but no data, so building a 70B model and running its step costs no memory; the fake
process group (`fake` backend with `FakeStore`) completes every send, receive and collective at
once. What the executor allocates, computes and sends is then observed with PyTorch's own tools,
in one dispatch mode (`measure.py`: MemTracker's storage accounting, FlopCounterMode with
formulas for the CPU flash-attention kernel, the bytes of every c10d operation). DTensor's
sharding propagation, which runs an operator at its global shape to learn the output's shape,
is kept out of the counts (`_shape_propagation_unobserved`).

The step runs as the distributed executor runs it (`run_rank_step`): this rank's stage built
alone (`parallel.build.build_rank_model`: tensor parallelism, FSDP2 over dp x cp with fp32
master weights and compute in the run's dtype), its actions, the gradient reduction, then an
AdamW step whose states exist already (steady state). A heterogeneous plan (pipelines of other
tp x pp x cp, Hydraulis) runs as `train/dist_hetero.py` runs it instead: the stage in the run's
dtype without FSDP2, its gradients left local, then the push of the bf16 gradients to their
owners among the holders, AdamW on the owned fp32 master shard and the pull of the bf16 weights
(`_HeteroOptimisation`: the executor's exchange itself; it keeps no index maps). A value the
executor would read back from the device (a loss to print) does not exist under fake tensors, so the loss is not formed.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import _disable_current_modes

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.distributed.mesh import Mesh, plan_world_size
from lengthwise.runtime.parallel.step import run_rank_step
from lengthwise.runtime.flop_formulas import cpu_flash_flop_formulas, plan_attention, varlen_flop_formulas
from lengthwise.runtime.layout import clear_bias_cache
from lengthwise.runtime.measure import CommBytes, LocalFlopCounter, _Measuring, _StorageTracker, _peak_by_category
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.parallel.build import ParallelOptions, build_rank_model
from lengthwise.runtime.distributed.fake import fake_world
from lengthwise.sim.inputs import heterogeneous

MASTER_DTYPE = torch.float32
"""Weights and optimizer states are kept in fp32 (master weights); FSDP2 computes in the run's dtype."""


@dataclass(kw_only=True)
class RankMeasurement:
    """What one rank's step allocated, computed and sent (bytes and FLOPs)."""

    rank: int
    world_size: int
    peak_memory_bytes: int
    memory_bytes: dict[str, int]
    """By category at the moment of the peak."""
    flops: int
    comm_bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    """Wall time of the dry run itself."""


def dryrun_rank(plan: StepPlan, rank: int, *, dtype: torch.dtype = torch.bfloat16,
                backend: str | None = None, sequence_parallel: bool = True) -> RankMeasurement:
    """Run `rank`'s part of one training step of `plan` on fake tensors and measure it
    (`sequence_parallel`: `parallel/build.ParallelOptions`; `backend`: the attention path,
    default `plan_attention(plan)`)."""
    backend = backend or plan_attention(plan)
    world_size = plan_world_size(plan)
    started = time.perf_counter()
    clear_bias_cache()  # cached masks are real tensors or another run's fake ones
    _forget_sharding_propagation()
    hetero = heterogeneous(plan)
    with fake_world(rank, world_size), FakeTensorMode(allow_non_fake_inputs=True):
        mesh = Mesh.from_default_group(timeout_s=60)
        if hetero:  # the propagation part in the run's dtype; the optimisation part apart
            model = build_rank_model(plan, mesh, dtype=dtype, fake=True,
                                     options=ParallelOptions(data_parallel="replicate",
                                                             sequence_parallel=sequence_parallel))
            exchange = _HeteroOptimisation(model, plan, mesh)
            optimizer = exchange.optimizer
        else:
            model = build_rank_model(plan, mesh, dtype=MASTER_DTYPE, fake=True,
                                     options=ParallelOptions(param_dtype=dtype if _sharded(plan) else None,
                                                             sequence_parallel=sequence_parallel))
            optimizer = _optimizer_in_steady_state(model)
        tokens = [torch.randint(0, plan.model.vocab, (n,)) for n in plan.lengths]
        memory, comm = _StorageTracker(), CommBytes()
        memory.track_params(model)
        memory.track_external(optimizer)
        if hetero:
            exchange.track(memory)
        flops = LocalFlopCounter(display=False, custom_mapping={**cpu_flash_flop_formulas(), **varlen_flop_formulas()})
        with memory, _Measuring(memory, flops, comm), _shape_propagation_unobserved():
            run_rank_step(model, plan, tokens, mesh=mesh, backend=backend, dry=True, reduce_grads=not hetero)
            if hetero:
                exchange.step()
            else:
                optimizer.step()
        peak = _peak_by_category(memory)
    clear_bias_cache()
    _forget_sharding_propagation()
    return RankMeasurement(rank=rank, world_size=world_size, peak_memory_bytes=sum(peak.values()),
                           memory_bytes=peak, flops=int(flops.get_total_flops()), comm_bytes=dict(comm.bytes),
                           seconds=time.perf_counter() - started)


def _sharded(plan: StepPlan) -> bool:
    """Whether the executor runs FSDP2 for this plan (then compute is in the run's dtype over
    fp32 master weights); otherwise parameters are kept in fp32 and computed in fp32."""
    return plan.zero > 0 and len({(p.pp, p.tp, p.cp) for p in plan.pipelines}) == 1


class _HeteroOptimisation:
    """The optimisation part of a heterogeneous plan's rank as `train/dist_hetero.py` keeps it,
    and its step: push, AdamW on the owned shard, pull, through the executor's own
    `parallel/hetero.HeteroExchange` (its layout follows from the plan alone,
    `strategy_holdings`, so nothing is gathered): the fp32 master shard of the elements this
    rank owns with AdamW's two moments per parameter view, in steady state, and the push's and
    pull's buffers allocated and released as the executor does, split over the ranks exactly as
    its all-to-alls are. As in the executor, the gradients travel in the run's dtype and are
    summed and stepped in fp32; AdamW runs without foreach, as the other dry runs' optimizers
    (a GPU's foreach AdamW would add transients of the shard's size). Clipping scales the shard
    in place (no allocation) and is left out."""

    def __init__(self, model: CausalLM, plan: StepPlan, mesh: Mesh) -> None:
        from lengthwise.runtime.parallel.dp import held_parameters
        from lengthwise.runtime.parallel.hetero import HeteroExchange
        from lengthwise.runtime.parallel.hetero_reducer import plan_pipelines, strategy_holdings, whole_shapes

        with unset_fake_temporarily():
            shapes = whole_shapes(plan.model)
            holdings, dims = strategy_holdings(plan.model, plan_pipelines(plan), list(shapes))
            self.exchange = ex = HeteroExchange(shapes, holdings, dims=dims, device=mesh.device)
        self.params = held_parameters(model, plan, mesh.layout(plan).place)
        self.master = ex.master = torch.empty(ex.shard_size, dtype=MASTER_DTYPE, device=mesh.device)
        self.views = {n: torch.nn.Parameter(ex.master_view(n)) for n in shapes}
        matrices = [v for n, v in self.views.items() if len(shapes[n]) >= 2]
        vectors = [v for n, v in self.views.items() if len(shapes[n]) < 2]
        self.optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                            {"params": vectors, "weight_decay": 0.0}], lr=1e-4, foreach=False)
        for view in self.views.values():
            self.optimizer.state[view] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(view),
                                          "exp_avg_sq": torch.zeros_like(view)}

    def track(self, tracker: MemTracker) -> None:
        from torch.distributed._tools.mem_tracker import _MemRefType

        tracker._update_and_maybe_create_winfos(self.master, _MemRefType.OPT)  # the views' storage

    def step(self) -> None:
        """`HeteroRankExecutor.step` after the actions."""
        ex = self.exchange
        # push (`HeteroReducer.local_grads`, `HeteroExchange.push`)
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.params.items()}
        flat = torch.cat([_local(grads[n]).reshape(-1) for n in ex.held_names()])
        del grads
        grad = ex.push(flat, dtype=MASTER_DTYPE)
        del flat  # the executor's push returns
        squares = grad.double().pow(2).sum().reshape(1)
        dist.all_reduce(squares)
        for name, view in self.views.items():
            view.grad = ex.master_view(name, grad)
        self.optimizer.step()
        # pull (`HeteroExchange.pull`, `HeteroReducer.load_values`)
        dtype = next(iter(self.params.values())).dtype
        out = ex.pull(dtype=dtype)
        start = 0
        with torch.no_grad():
            for n in ex.held_names():
                target = _local(self.params[n])
                target.copy_(out[start:start + target.numel()].view_as(target))
                start += target.numel()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _optimizer_in_steady_state(model: CausalLM) -> torch.optim.Optimizer:
    """AdamW with its states already allocated, as they are in every step after the first."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _forget_sharding_propagation() -> None:
    """Empty DTensor's sharding-propagation caches. Their keys compare device meshes by shape
    and dimension names, so another rank's run (a TP group of other ranks, in a fake world
    since destroyed) would hand its cached output specs, with that run's mesh and dead process
    groups, to this one."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


@contextmanager
def _shape_propagation_unobserved():
    """Keep DTensor's sharding propagation out of the measurements. On the first call of an
    operator at a new shape, DTensor runs the operator once on fake tensors of the GLOBAL shapes
    to learn its output's metadata (`ShardingPropagator._propagate_tensor_meta_non_cached`);
    that run computes nothing on the device, but the dispatch modes above would count its FLOPs
    (an unsharded matmul) and its storages. It runs here with those modes suspended."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def unobserved(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = unobserved
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
