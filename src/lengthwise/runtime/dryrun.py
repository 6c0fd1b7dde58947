"""One rank of a full-size job, run for real on this CPU without its memory or its peers: the
executor's own code under fake tensors and the fake process group, measured.

    report = dryrun_rank(plan, rank=5)               # a 7B model on rank 5 of 32, in seconds
    report.peak_memory_bytes, report.memory_bytes["activations"], report.flops, report.comm_bytes

Fake tensors (`torch._subclasses.fake_tensor.FakeTensorMode`) carry shapes, dtypes and
storages but no data, so building a 70B model and running its step costs no memory; the fake
process group (`fake` backend with `FakeStore`) completes every send, receive and collective at
once. What the executor allocates and computes is then observed with PyTorch's own tools:

- memory: `torch.distributed._tools.mem_tracker.MemTracker`, which follows every storage and
  sorts it into parameters, gradients, optimizer states, activations (made in forward) and
  temporaries (made in backward). Its per-module snapshots assume each module runs once per
  step, which a pipeline of chunks breaks, so only its storage accounting is used here, and
  without module hooks at all (the trackers' module hooks keep module inputs alive until they
  exit, which would count storages the executor has freed). FSDP2's unsharded bf16 weights
  and fp32 accumulated gradients are not module parameters to it: they appear under
  activations and temporaries.
- FLOPs: `torch.utils.flop_counter.FlopCounterMode`, with formulas added for the CPU
  flash-attention kernel that the `cpu-flash` backend calls (the counter knows the CUDA ones):
  causal calls count only the (query, key) pairs on or below the diagonal, the pairs the kernel
  computes and the cost model counts (`cost/flops.py`); backward counts 2.5 times the forward,
  as flash backward recomputes the scores (slimpack.txt §2.2.2). DTensor's sharding
  propagation, which runs an operator at its global shape to learn the output's shape, is kept
  out of the counts (`_shape_propagation_unobserved`). An operator that has its own kernel
  runs as that kernel, not as the counter's decomposition of it (`_runs_as_one_kernel`), so
  the memory tracker sees the executor's allocations, not the decomposition's intermediates.
- communication: the bytes of every tensor handed to a c10d operation, by kind (send,
  all_reduce, all_gather, reduce_scatter, broadcast).

The three share one dispatch mode (`_Measuring`), which does per operation what the three
modes stacked did (communication outermost, FLOPs, memory innermost), with one dispatch to the
fake mode instead of three: a LLaMA-70B rank's step dispatches millions of operations, about
two thirds of them `prim.device` queries from autograd and views, and the fake mode's own
work per operation is what remains of the cost (tests/test_dryrun.py checks the numbers
against the stacked modes).

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
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_is_leaf, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.distributed.mesh import Mesh, plan_world_size
from lengthwise.runtime.parallel.step import run_rank_step
from lengthwise.runtime.flop_formulas import cpu_flash_flop_formulas, plan_attention, varlen_flop_formulas
from lengthwise.runtime.layout import clear_bias_cache
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.parallel.build import ParallelOptions, build_rank_model
from lengthwise.runtime.distributed.fake import fake_world
from lengthwise.sim.inputs import heterogeneous

MEMORY_CATEGORIES = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
                     "Optstate": "optimizer", "Activation": "activations", "Temp": "temporaries",
                     "Other": "other"}
"""MemTracker's categories, under this project's names."""

MASTER_DTYPE = torch.float32
"""Weights and optimizer states are kept in fp32 (master weights); FSDP2 computes in the run's dtype."""

COMM_KINDS = {"send": "send", "alltoall_base_": "all_to_all", "allreduce_": "all_reduce", "allgather_": "all_gather",
              "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
              "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
              "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast"}
"""c10d operation -> kind. Receives are not counted: every byte received is sent by a peer."""

TP_COMM_KINDS = {"all_gather_into_tensor": "tp_all_gather", "reduce_scatter_tensor": "tp_reduce_scatter",
                 "all_reduce": "tp_all_reduce", "all_to_all_single": "tp_all_to_all"}
"""Functional collective (`_c10d_functional`) -> kind. In the executor only DTensor issues
them, i.e. tensor parallelism: sequence parallelism's all-gathers and reduce-scatters of
activations, and the TP sums of the sequence-parallel norms' partial weight gradients (FSDP2
and the rest call c10d directly, counted under `COMM_KINDS`)."""


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


class _NoModuleHooks:
    """What MemTracker asks of its ModTracker (forward or backward? which modules are
    running?), without ModTracker's per-module autograd hooks. Those hooks hold every module
    input that requires grad (a received activation, a K/V context leaf, with its gradient)
    until the tracker exits, so storages a run frees after their backward stayed counted: in a
    small chunkflow run, every context leaf's K/V gradient, 8% of the peak."""

    parents: set = set()

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def get_known_fqn(self, module) -> None:
        return None

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        return None


class _StorageTracker(MemTracker):
    """MemTracker's storage accounting without its per-module snapshots (see module docstring),
    and without a dispatch mode of its own: `_Measuring` hands it every operation's outputs
    (`observe`), which is what MemTracker's `__torch_dispatch__` does with them."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModuleHooks()

    def track_params(self, model: torch.nn.Module) -> None:
        self._track_module_params_and_buffers(model, install_grad_hooks=True)

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def __enter__(self) -> _StorageTracker:
        """MemTracker's `__enter__` (optimizer hooks, `UntypedStorage.resize_` followed, the
        peak started from the current snapshot) without pushing it as a dispatch mode."""
        if self._depth == 0:
            self._fake_mode_on_entry = active_fake_mode()
            self._register_global_optimizer_hook()
            self._track_resize()
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()}
        self._depth += 1
        return self

    def __exit__(self, *args) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._deregister_param_and_optimizer_hooks()
            self._restore_resize()

    def run(self, func, args, kwargs):
        """MemTracker's `__torch_dispatch__` for a non-DTensor operation: run it (the fake mode's
        `wait_tensor` is its input, as in eager), then account for its outputs' storages and
        the peak, unless it runs under another fake mode than the run's."""
        fake = _active_fake_mode()
        if func is _WAIT_TENSOR and fake is not None:
            out = args[0]
        else:
            out = func(*args, **kwargs)
        if fake is self._fake_mode_on_entry:
            backward = torch._C._current_graph_task_id() != -1  # `_NoModuleHooks.is_bw`
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif backward and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            _each_tensor(out, reftype, self._track)
            self._new_peak(backward)
        return out

    def device_of(self, args):
        """`run` for `prim.device` of a fake tensor (no tensor out, no storage changed; the
        peak is still updated, as after any operation: a gradient hook may have grown the
        memory since), answered as the fake mode's dispatch (or, outside it, the fake tensor's)
        answers it, without the dispatch."""
        fake = _active_fake_mode()
        out = _FAKE_DEVICE(args)
        if fake is self._fake_mode_on_entry:
            self._new_peak(torch._C._current_graph_task_id() != -1)
        return out

    def _new_peak(self, backward: bool) -> None:
        """MemTracker's `_update_peak_stats`, for a tracker without module snapshots (none are
        taken here): the snapshot's keys are enums and "Total", its values ints, so a dict copy
        is its deep copy."""
        if self.memory_tracking:
            return self._update_peak_stats(_ModState.PEAK_BW if backward else _ModState.PEAK_FW)
        for dev, snap in self._curr_mem_snap.items():
            total = snap[_TOTAL_KEY]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(snap)


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_DEVICE = torch.ops.prim.device.default
_FAKE_DEVICE = _DISPATCH_META_HANDLERS[_DEVICE]


def _active_fake_mode():
    """`torch._guards.active_fake_mode()` outside tracing (none here): the fake mode on the
    dispatch stack, which PyTorch keeps in one slot."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _each_tensor(value, reftype, track) -> None:
    """`track(reftype, t)` for every tensor in an operation's output, in pytree order (what
    MemTracker's `tree_map_only(torch.Tensor, ...)` visits): a tensor, or tuples and lists
    of them; other containers through pytree; a leaf that is no tensor (a device, a c10d
    work handle) holds none."""
    if isinstance(value, torch.Tensor):
        track(reftype, value)
    elif type(value) is tuple or type(value) is list:
        for item in value:
            _each_tensor(item, reftype, track)
    elif not tree_is_leaf(value):  # returned structs, sizes
        tree_map_only(torch.Tensor, lambda t: track(reftype, t), value)


def _peak_by_category(tracker: MemTracker) -> dict[str, int]:
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    out: dict[str, int] = {}
    for key, nbytes in snapshot.items():
        name = MEMORY_CATEGORIES.get(getattr(key, "value", key))
        if name is not None:
            out[name] = out.get(name, 0) + int(nbytes)
    return out


class LocalFlopCounter(FlopCounterMode):
    """FlopCounterMode's formulas and totals for what this rank computes: a DTensor operation
    (tensor parallelism) is let through to be split into the local operations on its shards,
    which are then counted, instead of being counted once at its global shape (as MemTracker
    does it). Not entered itself: `_Measuring` counts each operation through it.

    Only the total is kept ("Global"): the per-module breakdown's ModuleTracker hooks every
    module call's inputs and outputs until the counter exits, which kept the K/V gradients and
    activations of finished backwards alive for the memory tracker to count (a small chunkflow
    stage's peak read 28.5 MB instead of 24.6)."""

    def count(self, func, out, args, kwargs):
        return self._count_flops(func._overloadpacket, out, args, kwargs)


_NOT_COUNTED = frozenset({
    torch.ops.aten.sym_is_contiguous.default, torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format, torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default, torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default, torch.ops.aten.stride.default, torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default, torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default, torch.ops.aten.sym_numel.default, torch.ops.aten.dim.default,
    torch.ops.prim.layout.default})
"""Metadata queries FlopCounterMode hands on untouched (`NotImplemented`)."""


class _Measuring(TorchDispatchMode):
    """The three measurements in one dispatch mode, each operation dispatched once to the fake
    mode below: the communication bytes (`CommBytes`), then FlopCounterMode's handling (a
    composite operation decomposed, its parts counted; else run and counted by its packet's
    formula), with MemTracker's (`_StorageTracker.run`) as the run. It replaces three stacked
    modes (communication outermost, then FLOPs, then memory), which saw every operation in
    that order and did the same per operation, at three times the dispatch cost.

    Operations are neither added nor removed: a DTensor operation goes on (`NotImplemented`)
    to be split into its local operations, which come back here (the FLOP and memory modes did
    that, and the communication mode counted no DTensor operation: none is a c10d one)."""

    def __init__(self, memory: _StorageTracker, flops: LocalFlopCounter, comm: CommBytes) -> None:
        super().__init__()
        self.memory, self.flops, self.comm = memory, flops, comm
        self._ops: dict[int, tuple] = {}
        """id(operator) -> (operator, its communication kind or None, handed on untouched,
        decomposable, has a FLOP formula): what the three modes looked up per call, looked up
        once per operator (operators live as long as the process)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor):
            return self.memory.device_of(args)  # two thirds of all calls: autograd and views ask
        kwargs = kwargs or {}
        op = self._ops.get(id(func))
        if op is None:
            op = self._ops[id(func)] = self._describe(func)
        _, comm, untouched, decomposes, counted = op
        if comm is not None:
            self.comm.add(comm, args)
        if untouched or DTensor in types:
            return NotImplemented
        if decomposes:
            with self:
                out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        out = self.memory.run(func, args, kwargs)
        if counted:
            self.flops.count(func, out, args, kwargs)
        return out

    def _describe(self, func) -> tuple:
        # FlopCounterMode's tests, in its order: an operator that runs as its own kernel is run
        # uncounted (`_runs_as_one_kernel`; none has a formula: the registry is keyed by packet,
        # so no overload is "in" it); metadata queries are handed on; a composite is decomposed.
        one_kernel = _runs_as_one_kernel(func) and func not in self.flops.flop_registry
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        decomposes = not one_kernel and func is not _DEVICE and (
            key in getattr(func, "py_kernels", {}) or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))
        return (func, _comm_kind(func), func in _NOT_COUNTED and not one_kernel, decomposes,
                not one_kernel and func._overloadpacket in self.flops.flop_registry)


def _runs_as_one_kernel(func) -> bool:
    """Whether the executor runs `func` as its own kernel although it also has a composite
    decomposition. FlopCounterMode decomposes every operator it has no formula for, to count
    the matmuls a composite may hide; for such an operator that decomposition is not what runs
    (`aten.silu_backward`, the SwiGLU backward's: one CPU or CUDA kernel writing one output, but
    decomposed into sigmoid, 1 - sigmoid, products and sums), and the memory tracker outside the
    counter saw its intermediates: six more [tokens, ffn / tp] buffers at a layer's backward, up
    to 2.5 GiB of a Qwen2.5-7B rank's measured peak that no device allocates."""
    return (isinstance(func, torch._ops.OpOverload) and func.namespace == "aten"
            and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CPU")
            and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"))


class CommBytes:
    """Bytes of the tensors handed to each kind of c10d operation (`add`, per operation)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, args) -> None:
        if kind.startswith("tp_"):  # the input is this rank's share (all-gather) or whole input
            self.bytes[kind] = self.bytes.get(kind, 0) + _nbytes(args[0])
        else:
            self.bytes[kind] = self.bytes.get(kind, 0) + _sent_bytes(kind, args)


def _comm_kind(func) -> str | None:
    """COMM_KINDS' or TP_COMM_KINDS' kind of an operator, or None."""
    namespace, _, name = func.name().partition("::")
    name = name.split(".")[0]
    if namespace == "c10d":
        return COMM_KINDS.get(name)
    if namespace == "_c10d_functional":
        return TP_COMM_KINDS.get(name)
    return None


def _sent_bytes(kind: str, args) -> int:
    """The input this rank contributes: the buffer of a send, all-reduce or broadcast; its own
    share for an all-gather; its whole input for a reduce-scatter."""
    if kind in ("all_gather", "reduce_scatter"):
        return _nbytes(args[1])
    if kind == "all_to_all":  # (output, input, group, output splits, input splits): what leaves the rank
        send, group = args[1], dist.ProcessGroup.unbox(args[2])
        own = args[4][group.rank()] if args[4] else send.numel() // group.size()
        return (send.numel() - own) * send.element_size()
    return _nbytes(args[0])


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0
