"""Training checkpoints: one directory per step, written whole or not at all.

    save_checkpoint(out, step=40, model=model, optimizer=opt, trainer={"sampler": ...})
    path = latest_checkpoint(out)                      # out/step-000040, or None
    trainer = load_checkpoint(path, model, opt)        # weights, optimizer, RNG restored

Layout of `out/step-000040/`:

    config.json, model.safetensors   Hugging Face format: loads with from_pretrained, and
                                     as `lengthwise train --model out/step-000040`
    optimizer.pt                     torch.save(optimizer.state_dict())
    rng.json, rng.pt                 Python and NumPy RNG states; torch CPU (and CUDA) states
    trainer.json                     step, sampler position, the run's config

The directory is assembled as `out/.tmp-step-000040-XXXX` and renamed into place with
os.replace, so a run killed while saving leaves the previous checkpoint as the latest. All
files load with torch.load(weights_only=True) or as JSON: no pickled code.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from lengthwise.errors import UserError
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.weights import load_weights, save_pretrained

_STEP_DIR = re.compile(r"step-(\d+)")
DIST_MARKER = "COMPLETE"
"""Written last into a distributed run's checkpoint (runtime/distributed/checkpoint_dist.py),
holding its number of processes."""


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
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        _save_rng(tmp)
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer}, indent=1))
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _replace_dir(src: Path, dst: Path) -> None:
    """os.replace for directories: a non-empty dst is moved aside first (rename cannot
    overwrite it), then removed."""
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".old-{dst.name}-"))
        os.replace(dst, old / dst.name)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out: str | Path) -> Path | None:
    """The checkpoint with the highest step under `out`, or None."""
    out = Path(out)
    if not out.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in out.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return max(steps)[1] if steps else None


def load_checkpoint(path: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer) -> dict:
    """Restore weights, optimizer state and RNG states from `path`; returns trainer.json."""
    path = Path(path)
    if (path / DIST_MARKER).is_file():
        raise UserError(f"{path} was written by a distributed run of {(path / DIST_MARKER).read_text().strip()} "
                        f"processes; resume it with the same --nproc (or torchrun --nproc-per-node)")
    if not (path / "trainer.json").is_file():
        raise UserError(f"--resume {path}: not a checkpoint (no trainer.json); give an "
                        f"out/step-NNNNNN directory written by lengthwise train")
    load_weights(model, path)
    device = next(model.parameters()).device
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device,
                                         weights_only=True))
    _load_rng(path)
    return json.loads((path / "trainer.json").read_text())


def _save_rng(directory: Path) -> None:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    (directory / "rng.json").write_text(json.dumps({
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}))
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    torch.save(states, directory / "rng.pt")


def _load_rng(directory: Path) -> None:
    saved = json.loads((directory / "rng.json").read_text())
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    states = torch.load(directory / "rng.pt", weights_only=True)
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(states["cuda"]))
