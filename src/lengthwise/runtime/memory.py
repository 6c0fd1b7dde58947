"""Measure the memory autograd keeps for backward: what ChunkFlow's K bounds (chunkflow §4.2).

    with SavedTensorMeter(exclude=model.parameters()) as meter:
        run_step(model, plan, token_ids)
    meter.peak_bytes

Counts each storage once however many ops save it (views of one activation share it), leaves
out parameters (they live anyway), and follows each saved tensor until autograd releases it
(after the backward that used it, or when its graph is dropped). The K/V state store is
outside autograd and not counted here, except where a chunk's graph saves context K/V that
the store also holds (`KVStore.nbytes` gives the store's own bytes).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a tensor, or of a DTensor's local piece (FSDP2 / TP parameters and the
    activations of tensor-parallel layers); None for a tensor subclass without one of its own
    (nothing to count: its data lives in tensors counted where they are saved)."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    try:
        storage = tensor.untyped_storage()
        storage.data_ptr()
    except RuntimeError:
        return None
    return storage


class SavedTensorMeter:
    """Current and peak bytes of unique storages saved for backward inside the `with` block."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {s.data_ptr() for t in exclude if (s := _storage(t)) is not None}
        self._refs: dict[int, int] = {}
        """storage pointer -> saved tensors holding it."""
        self._sizes: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        storage = _storage(tensor)
        if storage is None:
            return tensor
        ptr = storage.data_ptr()
        if ptr in self._excluded or storage.nbytes() == 0:
            return tensor
        if self._refs.get(ptr, 0) == 0:
            self._sizes[ptr] = storage.nbytes()
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        return _Held(self, ptr, tensor)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.current_bytes -= self._sizes.pop(ptr)


class _Held:
    """A saved tensor's stand-in; autograd drops it when the tensor is no longer needed."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: SavedTensorMeter, ptr: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self):
        self.meter._release(self.ptr)
