"""Training checkpoints: one directory per step, written whole or not at all, verified on load.

    save_checkpoint(out, step=40, model=model, optimizer=opt, trainer={"sampler": ...})
    path = latest_checkpoint(out)                      # newest intact out/step-NNNNNN, or None
    trainer = load_checkpoint(path, model, opt)        # weights, optimizer, RNG restored

Layout of `out/step-000040/`:

    config.json, model.safetensors   Hugging Face format: loads with from_pretrained, and
                                     as `lengthwise train --model out/step-000040`
    optimizer.safetensors            the optimizer's tensors (AdamW's moments and step counts)
    optimizer.json                   the rest of its state_dict: parameter groups (lr, betas,
                                     weight decay, ...) and where each tensor goes
    rng.json, rng.safetensors        Python and NumPy RNG states; torch CPU (and CUDA) states
    trainer.json                     step, sampler position, the run's config
    MANIFEST.json                    sha256 of every other file, written last (manifest.py)

Nothing is unpickled: every file is JSON or safetensors, and none is read before the manifest
has matched every file. The directory is assembled as `out/.tmp-step-000040-XXXX` and renamed
into place with os.replace, so a run killed while saving leaves the previous checkpoint as the
latest. A damaged newest checkpoint (a flipped byte, a truncated or edited file) is named on
stderr and the previous intact one resumed.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save, save_file

from lengthwise.errors import UserError
from lengthwise.files import fsync_dir, write_atomic
from lengthwise.runtime.manifest import (
    MANIFEST,
    newest_intact,
    step_folders,
    verify_manifest,
    write_manifest,
)
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.weights import load_weights, save_pretrained
from lengthwise.unreadable import refuse_unreadable

SINGLE = "single"
"""The manifest's `kind` of a single-process checkpoint (a distributed one says "distributed")."""
LEGACY_MARKS = ("trainer.json", "COMPLETE")
"""Files of a finished checkpoint of earlier versions (single-process, distributed), which had no manifest."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(out: str | Path, *, step: int, model: CausalLM, optimizer: torch.optim.Optimizer,
                    trainer: dict) -> Path:
    """Write out/step-NNNNNN atomically; returns its path. `trainer` (JSON-able) is stored
    with the step in trainer.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    final = out / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".tmp-{final.name}-"))
    try:
        save_pretrained(model, tmp)
        save_optimizer(optimizer, tmp)
        save_rng(tmp, "rng")
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer}, indent=1))
        write_manifest(tmp, meta={"kind": SINGLE, "step": step})
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _replace_dir(src: Path, dst: Path) -> None:
    """os.replace for directories: a non-empty dst is moved aside first (rename cannot
    overwrite it), then removed; the parent is fsynced so the rename survives a crash."""
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".old-{dst.name}-"))
        (dst / MANIFEST).unlink(missing_ok=True)  # a crash from here on leaves no complete-looking copy
        dst.replace(old / dst.name)
    src.replace(dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out: str | Path, *, notify=None) -> Path | None:
    """The newest intact checkpoint under `out` (single-process or distributed), or None.
    Newer damaged or incomplete ones are named through notify(line), by default on stderr;
    a UserError when only damaged ones or ones of an older lengthwise are left (starting
    afresh would overwrite them)."""
    found = newest_intact(out, notify=notify or _warn)
    if found is not None:
        return found[0]
    legacy = [folder for _, folder in step_folders(out) if any((folder / name).is_file() for name in LEGACY_MARKS)]
    if legacy:
        raise UserError(f"{legacy[0]} was written by an older lengthwise (no {MANIFEST}; its optimizer and RNG "
                        f"state are pickles, which this version does not load): move it away or use another --out")
    return None


def _warn(line: str) -> None:
    print(f"lengthwise: {line}", file=sys.stderr)


def load_checkpoint(path: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer) -> dict:
    """Verify `path` against its manifest, then restore weights, optimizer state and RNG
    states; returns trainer.json."""
    path = Path(path)
    meta = verify_manifest(path)
    if meta.get("kind") != SINGLE:
        nproc = meta.get("nproc")
        raise UserError(f"{path} was written by a distributed run" + (f" of {nproc} processes" if nproc else "")
                        + "; resume it with the same --nproc (or torchrun --nproc-per-node)")
    with refuse_unreadable(path, "lengthwise checkpoint"):  # a resealed manifest vouches for bytes, not form
        load_weights(model, path)
        load_optimizer(optimizer, path)
        load_rng(path, "rng")
        return json.loads((path / "trainer.json").read_text())


def save_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """optimizer.state_dict() as optimizer.safetensors (its tensors) + optimizer.json (the rest)."""
    tensors: dict[str, torch.Tensor] = {}
    state = optimizer.state_dict()
    encoded = {"state": {str(pid): {key: _encode(value, f"state.{pid}.{key}", tensors)
                                    for key, value in entry.items()}
                         for pid, entry in state["state"].items()},
               "param_groups": [{key: _encode(value, f"group.{i}.{key}", tensors) for key, value in group.items()}
                                for i, group in enumerate(state["param_groups"])]}
    save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, directory / "optimizer.safetensors")
    (directory / "optimizer.json").write_text(json.dumps(encoded, indent=1))


def load_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    tensors = load_file(directory / "optimizer.safetensors")
    encoded = json.loads((directory / "optimizer.json").read_text())
    state = {"state": {int(pid): {key: _decode(value, tensors) for key, value in entry.items()}
                       for pid, entry in encoded["state"].items()},
             "param_groups": [{key: _decode(value, tensors) for key, value in group.items()}
                              for group in encoded["param_groups"]]}
    optimizer.load_state_dict(state)


def _encode(value, name: str, tensors: dict[str, torch.Tensor]):
    """A state_dict value as JSON: tensors by name into `tensors`, tuples tagged (betas)."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return {"tensor": name}
    if isinstance(value, tuple):
        return {"tuple": list(value)}
    return value


def _decode(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, dict) and value.keys() == {"tensor"}:
        return tensors[value["tensor"]]
    if isinstance(value, dict) and value.keys() == {"tuple"}:
        return tuple(value["tuple"])
    return value


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """This process's RNG states: Python's and NumPy's as JSON, torch's as tensors."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return plain, tensors


def set_rng_state(plain: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))


def save_rng(directory: Path, stem: str) -> None:
    """`stem`.json and `stem`.safetensors in `directory` (atomically, each)."""
    plain, tensors = rng_state()
    write_atomic(directory / f"{stem}.json", json.dumps(plain).encode(), durable=True)
    write_atomic(directory / f"{stem}.safetensors", save(tensors), durable=True)


def load_rng(directory: Path, stem: str) -> None:
    set_rng_state(json.loads((directory / f"{stem}.json").read_text()),
                  load_file(directory / f"{stem}.safetensors"))
