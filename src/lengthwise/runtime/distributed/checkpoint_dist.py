"""Checkpoints of a distributed run: model and optimizer with torch.distributed.checkpoint (DCP),
plus each rank's sampler position and random-number generators, sealed by a manifest.

    save_checkpoint(folder, step=7, model=model, optimizer=opt, held=held, extras={"sampler": s.state_dict()})
    path = latest_checkpoint(folder)                       # newest intact one, or None (collective)
    extras = load_checkpoint(path, model=model, optimizer=opt, held=held)

Layout of one checkpoint, `folder/step-000007/`: DCP's files (one shard file per rank and a
`.metadata`), per rank `rank-R.json` (step, sampler state, Python and NumPy RNG states) and
`rank-R.safetensors` (torch RNG state), and `MANIFEST.json` (runtime/manifest.py), written by
rank 0 after every rank has finished: the sha256 of every file. A checkpoint without it (a rank
died while saving) or whose files differ from it is skipped, and the group resumes from the
newest intact one; rank 0 names the skipped ones on stderr.

Safety: DCP's `.metadata` is a pickle, which DCP unpickles on load (its tensor shards load with
`weights_only=True`); it is read only after rank 0 has matched every file to the manifest, so a
damaged or half-written checkpoint never reaches the unpickler. That is no defence against a
checkpoint crafted elsewhere (its author can write a matching manifest): never resume one from
an untrusted source. Everything else is JSON or safetensors.

Rewriting a step (a run resumed from an earlier one saves it again) first removes its manifest,
then the old folder, so a kill in the middle never leaves old and new files under a manifest.

Each rank saves only the parameters it holds (its stage's; under FSDP2 / TP its DTensor
shards, which DCP records with their global shapes and offsets), keyed by their Hugging Face
names; replicas of a piece hold identical values (gradients are summed before the update) and
DCP writes each piece once. Loading reshards: a run at another dp (other FSDP2 shards) reads
the pieces it now holds (`load_checkpoint`'s `saved_rank`). The optimizer state is flattened per
parameter (`flatten_optimizer_state_dict`), so stages with different parameters never write
the same key with different contents (torchtitan does the same for pipeline stages).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lengthwise.errors import UserError
from lengthwise.runtime.checkpoint import SINGLE, rng_state, set_rng_state
from lengthwise.runtime.checkpoint import latest_checkpoint as newest_local
from lengthwise.runtime.distributed.agree import broadcast_json
from lengthwise.runtime.manifest import (
    DamagedCheckpoint,
    remove_manifest,
    verify_manifest,
    write_manifest,
    write_synced,
)

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
DISTRIBUTED = "distributed"
"""The manifest's `kind` of a distributed checkpoint."""


def checkpoint_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:06d}"


def save_checkpoint(folder: str | Path, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    held: dict[str, torch.nn.Parameter], extras: dict | None = None,
                    also: Callable[[Path], None] | None = None, state: dict | None = None) -> Path:
    """Collective: every rank calls it after the optimizer step of `step`. `also(path)`, when
    given, is called on every rank after the folder is cleared and before the manifest (rank 0's
    Hugging Face copy of the weights goes there). `state`: the tensors DCP saves instead of the
    held parameters and the optimizer's state dict (a Hydraulis run's owned shards)."""
    path = checkpoint_path(folder, step)
    if dist.get_rank() == 0:
        _clear(path)
    dist.barrier()
    if state is None:
        state = {"model": {n: p.detach() for n, p in held.items()},
                 "optim": get_optimizer_state_dict(model, optimizer, options=_FLAT)}
    dcp.save(state, checkpoint_id=str(path))
    plain, tensors = rng_state()
    rank = dist.get_rank()
    write_synced(path / f"rank-{rank}.json", json.dumps({"step": step, **(extras or {}), "rng": plain}).encode())
    write_synced(path / f"rank-{rank}.safetensors", save(tensors))
    if also is not None:
        also(path)
    dist.barrier()
    if rank == 0:
        write_manifest(path, meta={"kind": DISTRIBUTED, "nproc": dist.get_world_size(), "step": step})
    dist.barrier()
    return path


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
                    saved_rank: Callable[[int], int] | None = None, state: dict | None = None) -> dict:
    """Collective: check `path` against its manifest (rank 0 hashes, every rank gets the
    verdict), load weights and optimizer state in place, restore this rank's RNGs; returns its
    extras (step, sampler, ...).

    `check(extras)`: called on every rank with the saved rank 0's extras before anything is
    loaded (the caller refuses a checkpoint of another pipeline shape there, by name). Saved by
    another number of processes (another dp): DCP reshards the parameters and optimizer states;
    `saved_rank(nproc)` names the saved rank whose RNG states this rank continues from, and the
    extras must be the same on every saved rank (they are global: step, sampler position), or
    the load is refused naming the field. Without `saved_rank`, the process count must match.

    `state`: the nested dict of tensors `save_checkpoint` was given instead of the model and
    optimizer; loaded into those tensors in place (sizes checked first)."""
    meta = _verified_meta(path)
    if meta.get("kind") == SINGLE:
        raise UserError(f"{path} is a single-process checkpoint; resume it without --nproc / torchrun")
    nproc, world = meta.get("nproc"), dist.get_world_size()
    if check is not None:
        check(json.loads((path / "rank-0.json").read_text()))
    if nproc != world and saved_rank is None:
        raise UserError(f"{path} was written by {nproc} processes, this run has {world}; resume with "
                        f"--nproc {nproc} (and the same --dp/--pp/--cp/--tp)")
    source = dist.get_rank() if nproc == world else _resharded_source(path, nproc, saved_rank)
    if state is not None:
        _load_in_place(path, state)
    else:
        check_shapes(path, held)
        optim_state = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        state = {"model": {n: p.detach() for n, p in held.items()}, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optim"], options=_FLAT)
    extras = json.loads((path / f"rank-{source}.json").read_text())
    set_rng_state(extras.pop("rng"), load_file(path / f"rank-{source}.safetensors"))
    return extras


def _load_in_place(path: Path, state: dict) -> None:
    """DCP-load `state` (one level of nesting, tensors) into its own tensors; UserError naming
    the first tensor the checkpoint lacks or holds at another size."""
    tensors = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for group, items in state.items():
        for key, tensor in items.items():
            saved = tensors.get(f"{group}.{key}")
            if saved is None or tuple(getattr(saved, "size", ())) != tuple(tensor.shape):
                found = "holds no" if saved is None else f"holds another size of ({list(saved.size)})"
                raise UserError(f"{path} {found} {group}.{key} (size {list(tensor.shape)}): is it a checkpoint "
                                "of this model and run?")
    loaded = {group: dict(items) for group, items in state.items()}
    dcp.load(loaded, checkpoint_id=str(path))
    with torch.no_grad():
        for group, items in state.items():
            for key, tensor in items.items():
                if loaded[group][key] is not tensor:  # DCP may hand back a new tensor instead of filling ours
                    tensor.copy_(loaded[group][key])


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


def check_shapes(path: Path, held: dict[str, torch.nn.Parameter]) -> None:
    """UserError naming the first parameter whose shape in the checkpoint differs from this
    model's (or which it lacks), before DCP loads anything. DCP's `.metadata` is read, which
    only happens after the manifest check (module docstring)."""
    tensors = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, param in held.items():
        saved = tensors.get(f"model.{name}")
        if saved is None:
            raise UserError(f"{path} holds no {name} (shape {list(param.shape)}): is it a checkpoint of this model?")
        if tuple(saved.size) != tuple(param.shape):
            raise UserError(f"{path} holds {name} of shape {list(saved.size)}, this model's is {list(param.shape)}: "
                            "resume with the model it was trained with")


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
