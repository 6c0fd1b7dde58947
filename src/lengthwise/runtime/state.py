"""The K/V state store of one pipeline stage (chunkflow §4.2, Algorithm 2's StateStore).

A slice of a split sequence leaves behind, for every layer of the stage, its post-rotary k and
v: later slices of the same sequence attend to them (their *context*). In backward the later
slices run first and hand each earlier slice the gradient of its k and v, accumulated here
until the earlier slice's own backward consumes it.

Storage: per split sequence and per layer, one k and one v buffer [P, G, E], allocated at the
sequence's first stored slice (dtype, device and the local heads of that slice's k, so a
tensor-parallel shard's buffer holds its own heads). P is the sequence's stored prefix, the
end of its last slice that a later slice reads (the start of its last slice on the stage;
`stored_prefix`), known from the plan. A slice's k and v are copied into its rows
[start:stop); a later slice with context [0:c) reads `buffer[:c]`, one view whatever the
number of slices before it, so attention gets one context piece and concatenates nothing.
The gradients owed to earlier slices are likewise one zero-initialised accumulator per layer
[P, G, E] for k and for v (allocated at the first later slice's backward): a later slice's
backward adds its context's gradient into rows [:c), and an earlier slice's backward reads
its rows [start:stop) as a view. Additions happen in the order they did with one accumulator
per slice (zero + the first is exact), so the sums are the same bit for bit.

Rows are written through an alias (`Tensor.data`) that does not bump the buffer's autograd
version counter: a later slice's write touches rows no earlier context view covers, and a
context view saved for backward must not be reported as modified in place. A slice whose
rows are already there (its `N` forward left them and its `F` re-forward recomputes them)
is not written again, so the context a later slice already attended to stays as it was.

Only slices that have a later slice (stop < the sequence's length) are stored. A slice is
forgotten right after the last action of the stage that needs it (`last_uses`), and the
sequence's buffers and accumulators are freed with its last stored slice, so the store holds
at most the K/V of the sequences in flight: infinipipe eq. 5's K/V term.

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

    def __init__(self, prefix_rows: dict[int, int]):
        self._rows = prefix_rows
        """seq_id -> P, the rows of the sequence's buffers (`stored_prefix`)."""
        self._kv: dict[int, list[KV]] = {}
        """Per sequence: (k [P, G, E], v [P, G, E]) for each layer of the stage."""
        self._grads: dict[int, list[KV]] = {}
        """Per sequence: (dk [P, G, E], dv [P, G, E]) for each layer, summed over the later
        slices' backwards."""
        self._by_seq: dict[int, dict[int, SliceKey]] = {}
        """seq_id -> start -> key of the slices whose rows are written and not yet freed."""
        self._owed: set[SliceKey] = set()
        """Slices some later slice's backward has added a gradient for."""

    def put(self, key: SliceKey, kv_per_layer: list[KV]) -> None:
        """Copy slice `key`'s k, v (per layer, [stop - start, G, E]) into its rows."""
        seq_id, start, stop = key
        slices = self._by_seq.setdefault(seq_id, {})
        if slices.get(start) == key:
            return  # rows already written (an N forward before this F re-forward)
        rows = self._rows.get(seq_id, 0)
        if stop > rows:
            raise ValueError(f"slice {key} ends after the {rows} rows planned for sequence {seq_id}'s K/V")
        buffers = self._kv.get(seq_id)
        if buffers is None:
            buffers = self._kv[seq_id] = [(k.new_empty((rows, *k.shape[1:])), v.new_empty((rows, *v.shape[1:])))
                                          for k, v in kv_per_layer]
        with torch.no_grad():
            for (k_buf, v_buf), (k, v) in zip(buffers, kv_per_layer):
                k_buf.data[start:stop].copy_(k)
                v_buf.data[start:stop].copy_(v)
        slices[start] = key

    def kv(self, key: SliceKey) -> list[KV]:
        """Per layer, views of slice `key`'s rows."""
        seq_id, start, stop = key
        return [(k[start:stop], v[start:stop]) for k, v in self._kv[seq_id]]

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

    def context(self, seq_id: int, stop: int, *, grad: bool, where: str) -> list[KV]:
        """Per layer, the context [0, stop) of sequence `seq_id` as one view of its buffers,
        detached from any graph and a leaf requiring grad when `grad` (its .grad is what
        `add_grads` takes back)."""
        self.context_keys(seq_id, stop, where=where)
        return [(k[:stop].detach().requires_grad_(grad), v[:stop].detach().requires_grad_(grad))
                for k, v in self._kv[seq_id]]

    def add_grads(self, seq_id: int, stop: int, grads_per_layer: list[KV]) -> None:
        """Accumulate dk, dv [stop, G, E] that a later slice's backward produced for the
        context [0, stop) of sequence `seq_id`."""
        held = self._grads.get(seq_id)
        if held is None:
            held = self._grads[seq_id] = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in self._kv[seq_id]]
        for (dk_acc, dv_acc), (dk, dv) in zip(held, grads_per_layer):
            dk_acc[:stop] += dk
            dv_acc[:stop] += dv
        self._owed.update(key for key in self._by_seq.get(seq_id, {}).values() if key[2] <= stop)

    def pop_grads(self, key: SliceKey) -> list[KV] | None:
        """Per layer, views of the gradient rows owed to slice `key`; None when no later slice
        added any."""
        if key not in self._owed:
            return None
        self._owed.discard(key)
        seq_id, start, stop = key
        return [(dk[start:stop], dv[start:stop]) for dk, dv in self._grads[seq_id]]

    def free(self, key: SliceKey) -> None:
        """Forget slice `key`; with the sequence's last stored slice, free its buffers."""
        self._owed.discard(key)
        slices = self._by_seq.get(key[0], {})
        if slices.get(key[1]) == key:
            del slices[key[1]]
        if not slices:
            self._by_seq.pop(key[0], None)
            self._kv.pop(key[0], None)
            self._grads.pop(key[0], None)

    @property
    def keys(self) -> list[SliceKey]:
        return [key for slices in self._by_seq.values() for key in slices.values()]

    @property
    def buffers(self) -> dict[int, list[KV]]:
        """seq_id -> per layer (k, v) buffers, for inspection."""
        return dict(self._kv)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V state and K/V gradients held."""
        tensors = [t for kvs in [*self._kv.values(), *self._grads.values()] for kv in kvs for t in kv]
        return sum(t.numel() * t.element_size() for t in tensors)


def stored_prefix(chunks: list[Chunk], lengths: list[int]) -> dict[int, int]:
    """seq_id -> rows of its K/V buffers: the end of its last slice that a later slice reads
    (sequences with no such slice are absent)."""
    rows: dict[int, int] = {}
    for chunk in chunks:
        for s in stored_segments(chunk, lengths):
            rows[s.seq_id] = max(rows.get(s.seq_id, 0), s.stop)
    return rows


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
