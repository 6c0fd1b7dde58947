"""The measurements of a dry run (`dryrun.py`): what the operations run inside one dispatch mode
allocate, compute and send, under fake tensors. Its own module because it measures whatever
runs inside it, not only a rank's step: tests/test_dryrun.py and benchmarks/bench_head_memory.py
measure one layer or the LM head with it directly.

- memory: `torch.distributed._tools.mem_tracker.MemTracker`, which follows every storage and
  sorts it into parameters, gradients, optimizer states, activations (made in forward) and
  temporaries (made in backward). Its per-module snapshots assume each module runs once per
  step, which a pipeline of chunks breaks, so only its storage accounting is used here, and
  without module hooks at all (the trackers' module hooks keep module inputs alive until they
  exit, which would count storages the executor has freed). FSDP2's unsharded bf16 weights
  and fp32 accumulated gradients are not module parameters to it: they appear under
  activations and temporaries.
- FLOPs: `torch.utils.flop_counter.FlopCounterMode`, with formulas added (`flop_formulas.py`)
  for the CPU flash-attention kernel that the `cpu-flash` backend calls (it knows the CUDA ones):
  causal calls count only the (query, key) pairs on or below the diagonal, the pairs the kernel
  computes and the cost model counts (`cost/flops.py`); backward counts 2.5 times the forward,
  as flash backward recomputes the scores (slimpack.txt §2.2.2). An operator that has its own
  kernel runs as that kernel, not as the counter's decomposition of it (`_runs_as_one_kernel`),
  so the memory tracker sees the executor's allocations, not the decomposition's intermediates.
- communication: the bytes of every tensor handed to a c10d operation, by kind (send,
  all_reduce, all_gather, reduce_scatter, broadcast).

The three share one dispatch mode (`_Measuring`), which does per operation what the three
modes stacked did (communication outermost, FLOPs, memory innermost), with one dispatch to the
fake mode instead of three: a LLaMA-70B rank's step dispatches millions of operations, about
two thirds of them `prim.device` queries from autograd and views, and the fake mode's own
work per operation is what remains of the cost (tests/test_dryrun.py checks the numbers
against the stacked modes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_is_leaf, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

MEMORY_CATEGORIES = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
                     "Optstate": "optimizer", "Activation": "activations", "Temp": "temporaries",
                     "Other": "other"}
"""MemTracker's categories, under this project's names."""

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
