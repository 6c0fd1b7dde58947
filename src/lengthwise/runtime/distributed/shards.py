"""A distributed checkpoint's tensors as data: each rank's own pieces in safetensors, described in JSON.

    pieces = local_pieces(state, writes=...)       # this rank's (key, local tensor, offsets, global shape)
    write_pieces(folder, rank, pieces, values)      # shards-R.safetensors + shards-R.json
    index = read_index(folder)                      # every rank's JSON: where each piece of each key lies
    with PieceReader(folder, index) as reader:
        reader.fill("model.x", local, offsets, global_shape)   # this rank's region, from any pieces
        whole = reader.whole("model.x")                        # one full tensor (export)

Why our own layout rather than torch.distributed.checkpoint's `.metadata`: DCP's metadata is a
pickle and its non-tensor items are pickled too (BYTE_IO, read by torch's unrestricted loader,
weights_only off), so loading one runs whatever its author put there. Here the tensors are safetensors
(a JSON header and raw bytes) and everything else JSON, so nothing a checkpoint holds is ever
executed. Each rank writes the pieces it holds, as they lie in its memory: a DTensor's local
tensor (an FSDP2 shard, a TP shard) with its offsets in the global tensor and the global shape,
a plain tensor whole (offsets 0). Nothing is gathered: the save holds no more than the rank's
own shards, plus one piece copied to the host at a time when it lives on a GPU.

Replicas are written once where that costs no communication: a DTensor piece by the ranks at
coordinate 0 of each mesh dimension it is replicated over, a plain tensor by the rank the
caller's `writes(key)` names. Pieces written twice anyway (a tied embedding on the first and the
last stage, a heterogeneous run's pipelines splitting a parameter differently) hold equal values
where they overlap, and each element is read once.

Loading reads, for each of this rank's tensors, the parts of saved pieces that overlap its region
(`safe_open(...).get_slice`, which maps the file and copies only those bytes), so a run at
another dp (other FSDP2 shard boundaries) loads its own shards from whichever files hold them.
`whole(key)` assembles one full tensor from its pieces, which `lengthwise export` does key by
key, writing each before reading the next.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Replicate

from lengthwise.errors import UserError
from lengthwise.files import write_atomic

TENSORS = "shards-{rank}.safetensors"
INDEX = "shards-{rank}.json"
_INDEX_NAME = re.compile(r"shards-(\d+)\.json")
LAYOUT = "lengthwise-shards-1"
"""The manifest's `layout` of a checkpoint in this format (earlier ones were DCP's)."""

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


@dataclass(frozen=True)
class Piece:
    """One saved piece of a tensor: where it lies (file, name in it) and which region it covers."""

    key: str
    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Local:
    """This rank's piece of one state entry: its tensor as held, its region of the global tensor."""

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def local_region(tensor: torch.Tensor) -> Local:
    """The local tensor of `tensor` (a DTensor's own piece, sharing its storage; a plain tensor
    itself) with its offsets and the global shape. Key left empty."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape)
        return Local("", local, tuple(int(o) for o in offsets), tuple(tensor.shape))
    return Local("", tensor, (0,) * tensor.dim(), tuple(tensor.shape))


def is_primary(tensor: DTensor) -> bool:
    """Whether this rank writes its piece of `tensor`: coordinate 0 on every mesh dimension the
    tensor is replicated over (the others hold the same values)."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, tensor.placements) if isinstance(p, Replicate))


def local_pieces(state: dict[str, torch.Tensor], *, writes: Callable[[str], bool] | None = None) -> list[Local]:
    """The pieces this rank writes of a flat {key: tensor} state: DTensors' local pieces where this
    rank is primary, plain tensors where `writes(key)` (None: all). No tensor is copied."""
    out = []
    for key, tensor in state.items():
        if isinstance(tensor, DTensor):
            if not is_primary(tensor):
                continue
        elif writes is not None and not writes(key):
            continue
        region = local_region(tensor.detach())
        out.append(Local(key, region.tensor, region.offsets, region.global_shape))
    return out


def write_pieces(folder: Path, rank: int, pieces: list[Local], values: dict) -> None:
    """shards-R.safetensors (the pieces, streamed one at a time) and shards-R.json (their regions
    and the JSON `values`), each written to a temporary name, fsynced and renamed."""
    name = TENSORS.format(rank=rank)
    entries = {p.key: {"offsets": list(p.offsets), "shape": list(p.tensor.shape), "global_shape": list(p.global_shape),
                       "dtype": _dtype_name(p.tensor.dtype)} for p in pieces}
    write_safetensors(folder / name, ((p.key, p.tensor) for p in pieces),
                      [(p.key, p.tensor.dtype, tuple(p.tensor.shape)) for p in pieces])
    body = {"layout": LAYOUT, "file": name, "tensors": entries, "values": values}
    write_atomic(folder / INDEX.format(rank=rank), json.dumps(body), durable=True)


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise UserError(f"cannot write a tensor of dtype {dtype} to a checkpoint")
    return _DTYPES[dtype]


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      header: list[tuple[str, torch.dtype, tuple[int, ...]]], *, metadata: dict | None = None) -> None:
    """A safetensors file written tensor by tensor (`header`: each tensor's name, dtype and shape,
    in the order `tensors` yields them), so that only one tensor's host copy exists at a time."""
    head, start = {}, 0
    for key, dtype, shape in header:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        head[key] = {"dtype": _dtype_name(dtype), "shape": list(shape), "data_offsets": [start, start + size]}
        start += size
    if metadata:
        head["__metadata__"] = metadata
    encoded = json.dumps(head, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    expected = [(k, d, s) for k, d, s in header]

    def blocks() -> Iterator[bytes | memoryview]:
        yield len(encoded).to_bytes(8, "little")
        yield encoded
        for (key, tensor), (name, dtype, shape) in zip(tensors, expected, strict=True):
            assert key == name and tensor.dtype == dtype and tuple(tensor.shape) == shape, key
            host = tensor.detach().to("cpu").contiguous().reshape(-1)
            if host.numel():
                yield memoryview(host.view(torch.uint8).numpy())
            del host

    write_atomic(path, blocks(), durable=True)


def read_index(folder: Path) -> tuple[dict[str, list[Piece]], dict[int, dict]]:
    """(key -> its distinct saved pieces, saved rank -> its JSON values) from every shards-R.json.
    UserError (one line) on a malformed index: the manifest says the files are as written, not
    that their author was this program."""
    pieces: dict[str, dict[tuple, Piece]] = {}
    values: dict[int, dict] = {}
    for path in sorted(folder.iterdir()):
        match = _INDEX_NAME.fullmatch(path.name)
        if match is None:
            continue
        rank = int(match.group(1))
        body = _read_json(path)
        if body.get("layout") != LAYOUT or body.get("file") != TENSORS.format(rank=rank):
            raise UserError(f"{path} is not a {LAYOUT} index of rank {rank}")
        values[rank] = body.get("values", {})
        for key, entry in body.get("tensors", {}).items():
            piece = _piece(path, key, body["file"], entry)
            pieces.setdefault(key, {}).setdefault((piece.offsets, piece.shape), piece)
    return {key: list(found.values()) for key, found in pieces.items()}, values


def _read_json(path: Path) -> dict:
    try:
        body = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise UserError(f"{path} is not a JSON object")
    return body


def _piece(path: Path, key: str, file: str, entry: dict) -> Piece:
    try:
        offsets, shape, full = (tuple(int(v) for v in entry[k]) for k in ("offsets", "shape", "global_shape"))
        dtype = str(entry["dtype"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{path}: malformed entry for {key}") from None
    if not (len(offsets) == len(shape) == len(full)
            and all(0 <= o and o + s <= g for o, s, g in zip(offsets, shape, full))):
        raise UserError(f"{path}: {key}'s piece at {list(offsets)} of shape {list(shape)} lies outside {list(full)}")
    return Piece(key, file, offsets, shape, full, dtype)


class PieceReader:
    """Reads regions of saved tensors from the pieces that cover them (files opened once, mapped)."""

    def __init__(self, folder: Path, index: dict[str, list[Piece]]):
        self.folder, self.index, self._open = folder, index, {}

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()

    def global_shape(self, key: str) -> tuple[int, ...] | None:
        pieces = self.index.get(key)
        return None if not pieces else pieces[0].global_shape

    def fill(self, key: str, target: torch.Tensor, offsets: tuple[int, ...], global_shape: tuple[int, ...]) -> None:
        """Copy the saved values of the region `offsets` + `target.shape` of `key` into `target`;
        UserError when the checkpoint lacks the key, has another global shape, or leaves part
        of the region uncovered."""
        pieces = self.index.get(key)
        if not pieces:
            raise UserError(f"{self.folder} holds no {key}: is it a checkpoint of this model and run?")
        if pieces[0].global_shape != tuple(global_shape):
            raise UserError(f"{self.folder} holds {key} of shape {list(pieces[0].global_shape)}, this run's is "
                            f"{list(global_shape)}: resume with the model it was trained with")
        covered = torch.zeros(target.shape, dtype=torch.bool)  # pieces of other splits may overlap (replicas)
        with torch.no_grad():
            for piece in pieces:
                overlap = _overlap(piece.offsets, piece.shape, offsets, tuple(target.shape))
                if overlap is None or bool(covered[overlap[1]].all()):
                    continue
                source, dest = overlap
                target[dest].copy_(self._read(piece, source))
                covered[dest] = True
        if not bool(covered.all()):
            raise UserError(f"{self.folder}: its pieces of {key} cover {int(covered.sum())} of the {target.numel()} "
                            f"elements this rank holds; the checkpoint is incomplete")

    def whole(self, key: str) -> torch.Tensor:
        """One full tensor of `key`, assembled from its pieces."""
        pieces = self.index[key]
        out = torch.empty(pieces[0].global_shape, dtype=torch_dtype(pieces[0].dtype))
        self.fill(key, out, (0,) * out.dim(), tuple(out.shape))
        return out

    def _read(self, piece: Piece, region: tuple[slice, ...]) -> torch.Tensor:
        """`region` of a saved piece, read from its file; UserError when the file disagrees with its index."""
        try:
            if piece.file not in self._open:
                self._open[piece.file] = safe_open(str(self.folder / piece.file), framework="pt")
            handle = self._open[piece.file]
            part = handle.get_slice(piece.key)
            if tuple(part.get_shape()) != piece.shape:
                raise ValueError(f"shape {part.get_shape()}, its index says {list(piece.shape)}")
            return part[region] if piece.shape else handle.get_tensor(piece.key)
        except Exception as exc:  # noqa: BLE001 -- safetensors' own errors: one line naming the file
            raise UserError(f"{self.folder / piece.file}: cannot read {piece.key} ({exc})") from None


def torch_dtype(name: str) -> torch.dtype:
    for dtype, short in _DTYPES.items():
        if short == name:
            return dtype
    raise UserError(f"unknown tensor dtype {name!r} in a checkpoint index")


def _overlap(p_off, p_shape, t_off, t_shape) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """(slices into the piece, slices into the target) of the region both cover, or None."""
    source, dest = [], []
    for po, ps, to, ts in zip(p_off, p_shape, t_off, t_shape):
        lo, hi = max(po, to), min(po + ps, to + ts)
        if lo >= hi:
            return None
        source.append(slice(lo - po, hi - po))
        dest.append(slice(lo - to, hi - to))
    return tuple(source), tuple(dest)
