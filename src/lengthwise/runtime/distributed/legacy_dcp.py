"""THE ONE PICKLE LOADER: distributed checkpoints of earlier lengthwise versions, opt-in only.

Earlier versions wrote distributed checkpoints with torch.distributed.checkpoint's file layout:
a `.metadata` that is a Python pickle, and `.distcp` shards whose non-tensor items (AdamW's lr,
betas, ...) are pickled too and read by torch's unrestricted loader (weights_only off). Loading such a file
runs whatever code its author put in it. This module is the only place lengthwise reads them,
and only when the user passes `--allow-pickle-checkpoint` (to `train` or `export`) for a run of
their own: without the flag the checkpoint is refused in one line (`refuse`).

tests/test_no_pickle.py scans src/ for pickle loads and allow-lists this file by name; keep
every such call here, and nothing here reachable without the flag.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lengthwise.errors import UserError

FLAG = "--allow-pickle-checkpoint"
METADATA = ".metadata"


def is_legacy(folder: Path, meta: dict) -> bool:
    """Whether `folder` (manifest verified, meta its manifest's meta) is a DCP checkpoint."""
    from lengthwise.runtime.distributed.shards import LAYOUT

    return meta.get("layout") != LAYOUT or (folder / METADATA).exists()


def refuse(folder: Path, allow: bool) -> None:
    """UserError (one line) unless `allow`: the checkpoint would be unpickled."""
    if not allow:
        raise UserError(f"{folder} is a torch.distributed.checkpoint of an earlier lengthwise, whose {METADATA} "
                        f"and .distcp files are pickles that run code when loaded; if you wrote it yourself, "
                        f"rerun with {FLAG}")


def load_held(path: Path, state: dict, held: dict[str, torch.Tensor]) -> None:
    """Load the model and flattened optimizer state dict `state` in place (the old path)."""
    tensors = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, param in held.items():
        saved = tensors.get(f"model.{name}")
        if saved is None:
            raise UserError(f"{path} holds no {name} (shape {list(param.shape)}): is it a checkpoint of this model?")
        if tuple(saved.size) != tuple(param.shape):
            raise UserError(f"{path} holds {name} of shape {list(saved.size)}, this model's is {list(param.shape)}: "
                            "resume with the model it was trained with")
    dcp.load(state, checkpoint_id=str(path))


def load_in_place(path: Path, state: dict) -> None:
    """DCP-load `state` (one level of nesting, tensors) into its own tensors."""
    tensors = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for group, items in state.items():
        for key, tensor in items.items():
            saved = tensors.get(f"{group}.{key}")
            if saved is None or tuple(getattr(saved, "size", ())) != tuple(tensor.shape):
                raise UserError(f"{path} holds no {group}.{key} of size {list(tensor.shape)}: is it a checkpoint "
                                "of this model and run?")
    loaded = {group: dict(items) for group, items in state.items()}
    dcp.load(loaded, checkpoint_id=str(path))
    with torch.no_grad():
        for group, items in state.items():
            for key, tensor in items.items():
                if loaded[group][key] is not tensor:  # DCP may hand back a new tensor instead of filling ours
                    tensor.copy_(loaded[group][key])


def model_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every `model.` entry, whole, read in this process without a process group (export)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = _load_state_dict_from_keys(checkpoint_id=str(folder))
    weights = state.get("model")
    if not isinstance(weights, dict) or not weights:
        weights = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    if not weights:
        raise UserError(f"{folder}: its shards hold no model weights")
    return {name: tensor.detach().cpu() for name, tensor in weights.items()}
