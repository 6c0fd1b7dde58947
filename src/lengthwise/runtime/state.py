"""The K/V state store of one pipeline stage (chunkflow §4.2, Algorithm 2's StateStore).

A slice of a split sequence leaves behind, for every layer of the stage, its post-rotary k and
v: later slices of the same sequence attend to them (their *context*). In backward the later
slices run first and hand each earlier slice the gradient of its k and v, accumulated here
until the earlier slice's own backward consumes it.

Only slices that have a later slice (stop < the sequence's length) are stored, and each entry
is freed right after the last action of the stage that needs it (`last_uses`), so the store
holds at most the K/V of the sequences in flight: infinipipe eq. 5's K/V term.

Keys are `SliceKey = (seq_id, start, stop)`.
"""

from __future__ import annotations

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import BACKWARD, Action, Chunk, Segment

SliceKey = tuple[int, int, int]
KV = tuple[torch.Tensor, torch.Tensor]


def slice_key(segment: Segment) -> SliceKey:
    return (segment.seq_id, segment.start, segment.stop)


class KVStore:
    """K/V of earlier slices and the gradients owed to them, for one stage's layers."""

    def __init__(self):
        self._kv: dict[SliceKey, list[KV]] = {}
        """Per slice: (k [t, G, E], v [t, G, E]) for each layer of the stage."""
        self._grads: dict[SliceKey, list[list[torch.Tensor]]] = {}
        """Per slice: [dk, dv] for each layer, summed over the later slices' backwards."""
        self._by_seq: dict[int, dict[int, SliceKey]] = {}
        """seq_id -> start -> key, to find a slice's context."""

    def put(self, key: SliceKey, kv_per_layer: list[KV]) -> None:
        self._kv[key] = kv_per_layer
        self._by_seq.setdefault(key[0], {})[key[1]] = key

    def kv(self, key: SliceKey) -> list[KV]:
        return self._kv[key]

    def context_keys(self, seq_id: int, stop: int, *, where: str) -> list[SliceKey]:
        """The stored slices that tile [0, stop) of sequence `seq_id`, oldest first."""
        found, at = [], 0
        slices = self._by_seq.get(seq_id, {})
        while at < stop:
            key = slices.get(at)
            if key is None or key[2] > stop:
                raise UserError(
                    f"{where}: the chunk needs the K/V of tokens [{at}:{stop}) of sequence {seq_id}, "
                    "which no earlier forward on this stage left: run the earlier slices first, "
                    "on the same pipeline")
            found.append(key)
            at = key[2]
        return found

    def add_grads(self, key: SliceKey, grads_per_layer: list[KV]) -> None:
        """Accumulate dk, dv that a later slice's backward produced for slice `key`."""
        held = self._grads.get(key)
        if held is None:
            self._grads[key] = [[dk.clone(), dv.clone()] for dk, dv in grads_per_layer]
            return
        for acc, (dk, dv) in zip(held, grads_per_layer):
            acc[0] += dk
            acc[1] += dv

    def pop_grads(self, key: SliceKey) -> list[list[torch.Tensor]] | None:
        return self._grads.pop(key, None)

    def free(self, key: SliceKey) -> None:
        self._kv.pop(key, None)
        self._grads.pop(key, None)
        starts = self._by_seq.get(key[0], {})
        if starts.get(key[1]) == key:
            del starts[key[1]]

    @property
    def keys(self) -> list[SliceKey]:
        return list(self._kv)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V state and K/V gradients held."""
        tensors = [t for kvs in self._kv.values() for kv in kvs for t in kv]
        tensors += [t for gs in self._grads.values() for g in gs for t in g]
        return sum(t.numel() * t.element_size() for t in tensors)


def stored_segments(chunk: Chunk, lengths: list[int]) -> list[Segment]:
    """Segments of the chunk whose K/V a later slice will read."""
    return [s for s in chunk.segments if s.stop < lengths[s.seq_id]]


def last_uses(actions: list[Action], chunks: list[Chunk], lengths: list[int]) -> dict[int, list[SliceKey]]:
    """action index -> the slices whose K/V state is no longer needed after that action.

    A slice's state is used by its own forwards and backward and by the forwards of the later
    slices of its sequence (which read it as context)."""
    by_seq: dict[int, list[SliceKey]] = {}
    for chunk in chunks:
        for s in stored_segments(chunk, lengths):
            by_seq.setdefault(s.seq_id, []).append(slice_key(s))
    last: dict[SliceKey, int] = {}
    for index, action in enumerate(actions):
        for s in chunks[action.chunk].segments:
            if s.stop < lengths[s.seq_id]:
                last[slice_key(s)] = index
            if action.kind != BACKWARD:
                for key in by_seq.get(s.seq_id, []):
                    if key[2] <= s.start:
                        last[key] = index
    frees: dict[int, list[SliceKey]] = {}
    for key, index in last.items():
        frees.setdefault(index, []).append(key)
    return frees
