"""Checkpoints of a distributed run: each rank's own shards of the model and optimizer, as data,
plus each rank's sampler position and random-number generators, sealed by a manifest.

    save_checkpoint(folder, step=7, model=model, optimizer=opt, held=held, extras={"sampler": s.state_dict()})
    path = latest_checkpoint(folder)                       # newest intact one, or None (collective)
    extras = load_checkpoint(path, model=model, optimizer=opt, held=held)

Layout of one checkpoint, `folder/step-000007/` (`shards.py`): per rank `shards-R.safetensors`
(the tensors it holds: its FSDP2 / TP shards as they lie in its memory, its stage's whole
parameters otherwise, and the matching AdamW moments and step counts) and `shards-R.json`
(each piece's offsets in the global tensor and the global shape, and the optimizer's
non-tensor values: lr, betas, weight decay, ... per parameter), per rank `rank-R.json` (step,
sampler state, Python and NumPy RNG states) and `rank-R.safetensors` (torch RNG state), rank
0's `config.json` (the model's Hugging Face config, for `lengthwise export`), and `MANIFEST.json`
(runtime/manifest.py), written by rank 0 after every rank has finished: the sha256 of every
file. A checkpoint without it (a rank died while saving) or whose files differ from it is
skipped, and the group resumes from the newest intact one; rank 0 names the skipped ones.

Safety: every file is JSON or safetensors; nothing on the load path unpickles. Checkpoints of
earlier versions (torch.distributed.checkpoint's pickled `.metadata` and `.distcp` items) are
refused in one line naming --allow-pickle-checkpoint, which loads them through
`legacy_dcp.py`, the one module that unpickles, for one's own old runs.

Rewriting a step (a run resumed from an earlier one saves it again) first removes its manifest,
then the old folder, so a kill in the middle never leaves old and new files under a manifest.

No rank gathers anything: each writes the pieces it holds (replicas once, `shards.local_pieces`)
and reads the parts of saved pieces that overlap its own, so a run at another dp (other FSDP2
shards) loads its new shards directly (`load_checkpoint`'s `saved_rank` names the saved rank
whose RNG states it continues from). The optimizer state is flattened per parameter
(`flatten_optimizer_state_dict`), so stages with different parameters never write the same key
with different contents (torchtitan does the same for pipeline stages).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lengthwise.errors import UserError
from lengthwise.files import write_atomic
from lengthwise.runtime.checkpoint import SINGLE, rng_state, set_rng_state
from lengthwise.runtime.checkpoint import latest_checkpoint as newest_local
from lengthwise.runtime.distributed import legacy_dcp
from lengthwise.runtime.finite import check_finite_across_ranks
from lengthwise.runtime.distributed.agree import broadcast_json
from lengthwise.runtime.distributed.shards import (
    LAYOUT,
    PieceReader,
    local_pieces,
    local_region,
    read_index,
    write_pieces,
)
from lengthwise.runtime.manifest import (
    DamagedCheckpoint,
    remove_manifest,
    verify_manifest,
    write_manifest,
)

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
DISTRIBUTED = "distributed"
"""The manifest's `kind` of a distributed checkpoint."""
_MISSING = object()
Writes = Callable[[str], bool]
"""writes(parameter name): whether this rank writes its plain (not DTensor) copy of a parameter
and its optimizer state; the other holders of that copy leave it to that rank."""


def checkpoint_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:06d}"


def save_checkpoint(folder: str | Path, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    held: dict[str, torch.nn.Parameter], extras: dict | None = None,
                    also: Callable[[Path], None] | None = None, state: dict | None = None,
                    writes: Writes | None = None) -> Path:
    """Collective (barriers only): every rank calls it after the optimizer step of `step`.
    `also(path)`, when given, is called on every rank after the folder is cleared and before the
    manifest (rank 0's config.json goes there). `state`: the {group: {key: tensor or JSON
    value}} saved instead of the held parameters and the optimizer's state dict (a Hydraulis
    run's owned shards)."""
    path = checkpoint_path(folder, step)
    rank = dist.get_rank()
    if state is None:
        state = model_state(model, optimizer, held)
    tensors, values = _split(state)
    # before anything is cleared or written: every rank refuses together if any shard is not finite
    check_finite_across_ranks(tensors, step=step, device=_device(model, tensors))
    if rank == 0:
        _clear(path)
        path.mkdir(parents=True)
    dist.barrier()
    write_pieces(path, rank, local_pieces(tensors, writes=_by_parameter(writes)), values)
    del tensors
    plain, rng = rng_state()
    write_atomic(path / f"rank-{rank}.json", json.dumps({"step": step, **(extras or {}), "rng": plain}),
                 durable=True)
    write_atomic(path / f"rank-{rank}.safetensors", save(rng), durable=True)
    if also is not None:
        also(path)
    dist.barrier()
    if rank == 0:
        write_manifest(path, meta={"kind": DISTRIBUTED, "layout": LAYOUT, "nproc": dist.get_world_size(),
                                   "step": step})
    dist.barrier()
    return path


def _device(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.device:
    """Where this rank's collectives run: its tensors' device (its parameters' when it holds none)."""
    first = next(iter(tensors.values()), None)
    return first.device if first is not None else next(model.parameters()).device


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, held: dict[str, torch.nn.Parameter]) -> dict:
    """What a checkpoint holds of a rank: its parameters (its shards) and its optimizer's
    flattened state dict (no copies: DTensors and tensors as the rank holds them)."""
    return {"model": {n: p.detach() for n, p in held.items()},
            "optim": get_optimizer_state_dict(model, optimizer, options=_FLAT)}


def _split(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """{group.key: tensor} and {group.key: JSON value} of a {group: {key: value}} state."""
    tensors, values = {}, {}
    for group, items in state.items():
        for key, value in items.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{group}.{key}"] = value
            else:
                values[f"{group}.{key}"] = _encode(value)
    return tensors, values


def _encode(value):
    """A JSON value, tuples tagged (AdamW's betas); UserError on anything else (never pickled)."""
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise UserError(f"cannot write a {type(value).__name__} to a checkpoint as data")


def _decode(value):
    if isinstance(value, dict) and value.keys() == {"tuple"}:
        return tuple(_decode(v) for v in value["tuple"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def parameter_of(key: str) -> str | None:
    """The parameter a flat state key belongs to (model.X, optim.state.X.exp_avg), else None."""
    if key.startswith("model."):
        return key[len("model."):]
    if key.startswith("optim.state."):
        return key[len("optim.state."):].rsplit(".", 1)[0]
    return None


def _by_parameter(writes: Writes | None) -> Callable[[str], bool] | None:
    if writes is None:
        return None

    def by_key(key: str) -> bool:
        name = parameter_of(key)
        return name is None or writes(name)
    return by_key


def _clear(path: Path) -> None:
    """Unmark, then remove, an earlier save of this step."""
    if path.exists():
        remove_manifest(path)
        (path / "COMPLETE").unlink(missing_ok=True)  # the completion mark of earlier versions
        shutil.rmtree(path)


def latest_checkpoint(folder: str | Path) -> Path | None:
    """Collective: the newest intact checkpoint under `folder` (either kind: `load_checkpoint`
    refuses a single-process one with a message), chosen by rank 0, which names the damaged
    or incomplete newer ones on stderr."""
    verdict = None
    if dist.get_rank() == 0:
        try:
            found = newest_local(folder)
            verdict = {"path": None if found is None else str(found)}
        except (UserError, OSError) as exc:  # every rank must get a verdict, or the others would wait
            verdict = {"error": str(exc)}
    verdict = _from_rank0(verdict)
    if "error" in verdict:
        raise DamagedCheckpoint(verdict["error"])
    return None if verdict["path"] is None else Path(verdict["path"])


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    held: dict[str, torch.nn.Parameter], check: Callable[[dict], None] | None = None,
                    saved_rank: Callable[[int], int] | None = None, state: dict | None = None,
                    allow_pickle: bool = False) -> dict:
    """Collective: check `path` against its manifest (rank 0 hashes, every rank gets the
    verdict), load weights and optimizer state in place, restore this rank's RNGs; returns its
    extras (step, sampler, ...).

    `check(extras)`: called on every rank with the saved rank 0's extras before anything is
    loaded (the caller refuses a checkpoint of another pipeline shape there, by name). Saved by
    another number of processes (another dp): each rank reads its new shards from the saved
    pieces; `saved_rank(nproc)` names the saved rank whose RNG states this rank continues from,
    and the extras must be the same on every saved rank (they are global: step, sampler
    position), or the load is refused naming the field. Without `saved_rank`, the process
    count must match.

    `state`: the {group: {key: tensor}} `save_checkpoint` was given instead of the model and
    optimizer; loaded into those tensors in place (sizes checked first). `allow_pickle`: load
    a checkpoint of an earlier version (torch.distributed.checkpoint's pickles); refused
    without it."""
    meta = _verified_meta(path)
    if meta.get("kind") == SINGLE:
        raise UserError(f"{path} is a single-process checkpoint; resume it without --nproc / torchrun")
    legacy = legacy_dcp.is_legacy(path, meta)
    if legacy:
        legacy_dcp.refuse(path, allow_pickle)
    nproc, world = meta.get("nproc"), dist.get_world_size()
    if check is not None:
        check(json.loads((path / "rank-0.json").read_text()))
    if nproc != world and saved_rank is None:
        raise UserError(f"{path} was written by {nproc} processes, this run has {world}; resume with "
                        f"--nproc {nproc} (and the same --dp/--pp/--cp/--tp)")
    source = dist.get_rank() if nproc == world else _resharded_source(path, nproc, saved_rank)
    if dist.get_rank() == 0:
        print(f"lengthwise train: resuming step {meta.get('step')} from {path}", file=sys.stderr)
    if legacy:
        _load_legacy(path, model=model, optimizer=optimizer, held=held, state=state)
    elif state is not None:
        load_state(path, state, source)
    else:
        optim_state = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        full = {"model": {n: p.detach() for n, p in held.items()}, "optim": optim_state}
        load_state(path, full, source)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=full["optim"], options=_FLAT)
    extras = json.loads((path / f"rank-{source}.json").read_text())
    set_rng_state(extras.pop("rng"), load_file(path / f"rank-{source}.safetensors"))
    return extras


def load_state(path: Path, state: dict, source: int) -> None:
    """Fill every tensor of `state` ({group: {key: tensor or value}}) in place from the saved
    pieces that overlap it, after checking every key's presence and global shape; its JSON
    values are replaced by the saved ones (saved rank `source`'s, else any rank's)."""
    index, values = read_index(path)
    tensors, _ = _split(state)
    with PieceReader(path, index) as reader:
        for key, tensor in tensors.items():
            _check_shape(path, reader, key, tuple(tensor.shape))
        for key, tensor in tensors.items():
            region = local_region(tensor.detach())
            reader.fill(key, region.tensor, region.offsets, region.global_shape)
    ranks = [source, *sorted(r for r in values if r != source)]
    for group, items in state.items():
        for key, value in items.items():
            if isinstance(value, torch.Tensor):
                continue
            name = f"{group}.{key}"
            found = next((values[r][name] for r in ranks if name in values.get(r, {})), _MISSING)
            if found is _MISSING:
                raise UserError(f"{path} holds no {name}: is it a checkpoint of this model and run?")
            items[key] = _decode(found)


def _check_shape(path: Path, reader: PieceReader, key: str, shape: tuple[int, ...]) -> None:
    saved = reader.global_shape(key)
    name = key[len("model."):] if key.startswith("model.") else key
    if saved is None:
        raise UserError(f"{path} holds no {name} (shape {list(shape)}): is it a checkpoint of this model?")
    if saved != shape:
        raise UserError(f"{path} holds {name} of shape {list(saved)}, this model's is {list(shape)}: "
                        "resume with the model it was trained with")


def _load_legacy(path: Path, *, model, optimizer, held, state) -> None:
    """An earlier version's DCP checkpoint, after --allow-pickle-checkpoint (`legacy_dcp`)."""
    if state is not None:
        legacy_dcp.load_in_place(path, state)
        return
    optim_state = get_optimizer_state_dict(model, optimizer, options=_FLAT)
    full = {"model": {n: p.detach() for n, p in held.items()}, "optim": optim_state}
    legacy_dcp.load_held(path, full, held)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=full["optim"], options=_FLAT)


def _resharded_source(path: Path, nproc: int, saved_rank: Callable[[int], int]) -> int:
    """The saved rank this one continues from; UserError when the saved ranks' extras (other
    than their RNG states) differ, since those cannot be split over another process count."""
    extras = [json.loads((path / f"rank-{r}.json").read_text()) for r in range(nproc)]
    for key in sorted({k for e in extras for k in e} - {"rng"}):
        values = [json.dumps(e.get(key), sort_keys=True) for e in extras]
        if len(set(values)) > 1:
            odd = next(r for r, v in enumerate(values) if v != values[0])
            raise UserError(f"{path}: its ranks saved different {key!r} (rank 0 and rank {odd} differ), which "
                            f"cannot be resharded; resume with --nproc {nproc}")
    return saved_rank(nproc)


def _verified_meta(path: Path) -> dict:
    verdict = None
    if dist.get_rank() == 0:
        try:
            verdict = {"meta": verify_manifest(path)}
        except (UserError, OSError) as exc:  # every rank must get a verdict, or the others would wait
            verdict = {"error": str(exc)}
    verdict = _from_rank0(verdict)
    if "error" in verdict:
        raise DamagedCheckpoint(verdict["error"])
    return verdict["meta"]


def _from_rank0(value: dict | None) -> dict:
    return broadcast_json(value, _collective_device())


def _collective_device() -> torch.device:
    """Where the default group's tensors must live: the current GPU with NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
