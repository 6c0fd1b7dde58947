"""A training checkpoint as a consolidated Hugging Face model folder (`lengthwise export`).

    export_checkpoint("run/step-000040", "my-model")    # -> my-model/config.json, model.safetensors

Every file is checked against the checkpoint's manifest before it is read. The weights come from
the checkpoint's own Hugging Face copy when it has one (single-process checkpoints, and
distributed ones whose rank 0 wrote a consolidated copy), else from its
torch.distributed.checkpoint shards, read whole in this process (`_load_state_dict_from_keys`,
no process group): only the `model.` entries, each a full tensor under its Hugging Face name.
The result is loaded back into this package's model with its shapes checked against the config
before anything is written, so a folder that transformers would refuse is never produced.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lengthwise.errors import UserError
from lengthwise.runtime.manifest import newest_intact, verify_manifest
from lengthwise.runtime.model import CausalLM
from lengthwise.runtime.weights import WEIGHTS_NAME, load_state, read_tensors, save_pretrained
from lengthwise.specs import ModelSpec

MODEL_PREFIX = "model."
"""Key prefix of the weights in a distributed checkpoint's DCP state (checkpoint_dist.py)."""


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, model_config: str | Path | None = None) -> Path:
    """Write `out`/config.json and `out`/model.safetensors from a checkpoint folder, or from the
    newest intact checkpoint of a run folder; returns `out`."""
    folder = _checkpoint_folder(Path(checkpoint))
    verify_manifest(folder)
    config = Path(model_config) if model_config else folder / "config.json"
    if not config.is_file():
        raise UserError(f"{folder} carries no config.json: give the model's config with --model-config")
    spec = ModelSpec.from_hf_config(config)
    tensors = read_tensors(folder) if (folder / WEIGHTS_NAME).is_file() else _dcp_weights(folder)
    dtype = next(iter(tensors.values())).dtype if tensors else torch.float32  # kept as trained
    with torch.device("meta"):
        model = CausalLM(spec, dtype=dtype)
    model = model.to_empty(device="cpu")
    load_state(model, tensors)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    return out


def _checkpoint_folder(path: Path) -> Path:
    if not path.is_dir():
        raise UserError(f"no checkpoint folder at {path}")
    if (path / "MANIFEST.json").is_file():
        return path
    found = newest_intact(path)
    if found is None:
        raise UserError(f"{path} holds no checkpoint (no step-NNNNNN folder with a MANIFEST.json)")
    return found[0]


def _dcp_weights(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not (folder / ".metadata").is_file():
        raise UserError(f"{folder} has neither {WEIGHTS_NAME} nor torch.distributed.checkpoint shards")
    state = _load_state_dict_from_keys(checkpoint_id=str(folder))
    weights = state.get("model")
    if not isinstance(weights, dict) or not weights:
        flat = {k[len(MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
        weights = flat
    if not weights:
        raise UserError(f"{folder}: its shards hold no model weights ({', '.join(sorted(state)[:4])} ...)")
    return {name: tensor.detach().cpu() for name, tensor in weights.items()}
