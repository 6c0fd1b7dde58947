"""A training checkpoint as a consolidated Hugging Face model folder (`lengthwise export`).

    export_checkpoint("run/step-000040", "my-model")    # -> my-model/config.json, model.safetensors

Every file is checked against the checkpoint's manifest before it is read. The weights come from
the checkpoint's Hugging Face copy (single-process checkpoints), or from the ranks' shards of a
distributed one (`distributed/shards.py`), consolidated offline in this one process, tensor by
tensor: each parameter is assembled whole from its pieces, written, and dropped before the next
is read, so exporting a 70B run needs one tensor's memory, not the model's. Names and shapes are
checked against the model's config (a meta model: no memory) before anything is written, so a
folder that transformers would refuse is never produced; the weights keep the dtype they were
trained in. The folder is written under a temporary name and renamed into place.

A distributed checkpoint of an earlier version (torch.distributed.checkpoint's pickled files) is
refused unless `allow_pickle` (--allow-pickle-checkpoint), which reads it whole via `legacy_dcp`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from lengthwise.errors import UserError
from lengthwise.runtime.distributed import legacy_dcp
from lengthwise.runtime.distributed.shards import PieceReader, read_index, torch_dtype, write_safetensors
from lengthwise.runtime.manifest import MANIFEST, newest_intact, verify_manifest
from lengthwise.runtime.model import meta_model
from lengthwise.runtime.weights import WEIGHTS_NAME, expected_names, hf_config_dict, tensor_sources, _open
from lengthwise.specs import ModelSpec

MODEL_PREFIX = "model."
"""Key prefix of the weights in a distributed checkpoint's shards (checkpoint_dist.py)."""
Fetch = Callable[[str], torch.Tensor]


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, model_config: str | Path | None = None,
                      allow_pickle: bool = False, notify: Callable[[str], None] | None = None) -> Path:
    """Write `out`/config.json and `out`/model.safetensors from a checkpoint folder, or from the
    newest intact checkpoint of a run folder (newer damaged ones named through notify, and the
    step chosen); returns `out`."""
    notify = notify or _warn
    folder = _checkpoint_folder(Path(checkpoint), notify)
    meta = verify_manifest(folder)
    notify(f"exporting step {meta.get('step')} from {folder}")
    config = Path(model_config) if model_config else folder / "config.json"
    if not config.is_file():
        raise UserError(f"{folder} carries no config.json: give the model's config with --model-config")
    spec = _model_spec(config)
    with _weights(folder, meta, spec, allow_pickle) as (shapes, fetch):
        _write_folder(Path(out), spec, shapes, fetch)
    return Path(out)


def checkpoint_weights(checkpoint: str | Path, *, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every weight of a checkpoint, whole, by Hugging Face name (tests and small models: the
    whole model in memory; `export_checkpoint` streams)."""
    folder = _checkpoint_folder(Path(checkpoint), lambda line: None)
    meta = verify_manifest(folder)
    spec = _model_spec(folder / "config.json")
    with _weights(folder, meta, spec, allow_pickle) as (shapes, fetch):
        return {name: fetch(name) for name in shapes}


def _model_spec(config: Path) -> ModelSpec:
    """The model of a Hugging Face config.json; UserError (one line) when it is not JSON."""
    try:
        json.loads(config.read_bytes())
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{config} is not a JSON config ({exc.__class__.__name__}): give the model's config with "
                        f"--model-config") from None
    return ModelSpec.from_hf_config(config)


def _warn(line: str) -> None:
    print(f"lengthwise export: {line}", file=sys.stderr)


def _checkpoint_folder(path: Path, notify: Callable[[str], None]) -> Path:
    if not path.is_dir():
        raise UserError(f"no checkpoint folder at {path}")
    if (path / MANIFEST).is_file():
        return path
    found = newest_intact(path, notify=notify)
    if found is None:
        raise UserError(f"{path} holds no checkpoint (no step-NNNNNN folder with a {MANIFEST})")
    return found[0]


class _weights:
    """Context: (name -> saved shape and dtype, fetch(name) -> the whole tensor) of a checkpoint,
    its names and shapes checked against `spec` first."""

    def __init__(self, folder: Path, meta: dict, spec: ModelSpec, allow_pickle: bool):
        self.folder, self.meta, self.spec, self.allow_pickle = folder, meta, spec, allow_pickle
        self.reader: PieceReader | None = None

    def __enter__(self) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Fetch]:
        folder, spec = self.folder, self.spec
        expected = expected_names(meta_model(spec, dtype=torch.float32))
        if (folder / WEIGHTS_NAME).is_file():
            shapes, fetch = _hf_file(folder)
        elif self.meta.get("kind") == "distributed" and legacy_dcp.is_legacy(folder, self.meta):
            legacy_dcp.refuse(folder, self.allow_pickle)
            tensors = legacy_dcp.model_weights(folder)
            shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
            fetch = tensors.__getitem__
        else:
            shapes, fetch = self._shards(folder)
        _check(folder, expected, shapes, vocab=spec.vocab)
        names = list(expected)
        return {n: ((*expected[n],), shapes[n][1]) for n in names}, lambda name: _unpadded(fetch(name), spec.vocab,
                                                                                          expected[name])

    def _shards(self, folder: Path):
        index, _ = read_index(folder)
        self.reader = PieceReader(folder, index)
        shapes = {}
        for key, pieces in index.items():
            if key.startswith(MODEL_PREFIX):
                shapes[key[len(MODEL_PREFIX):]] = (pieces[0].global_shape, torch_dtype(pieces[0].dtype))
        if not shapes:
            raise UserError(f"{folder} holds neither {WEIGHTS_NAME} nor model shards")
        return shapes, lambda name: self.reader.whole(MODEL_PREFIX + name)

    def __exit__(self, *exc) -> None:
        if self.reader is not None:
            self.reader.__exit__()


def _hf_file(folder: Path):
    sources = tensor_sources(folder)
    shapes = {}
    for name, source in sources.items():
        with _open(source.file) as handle:
            shapes[name] = (source.shape, torch_dtype(handle.get_slice(name).get_dtype()))

    def fetch(name: str) -> torch.Tensor:
        with _open(sources[name].file) as handle:
            return handle.get_tensor(name)
    return shapes, fetch


def _check(folder: Path, expected: dict[str, tuple[int, ...]], shapes: dict, *, vocab: int) -> None:
    """UserError naming the first weight the checkpoint lacks or holds at another shape than the
    config's (vocabulary rows padded for TP are cut back to the vocabulary)."""
    for name, shape in expected.items():
        if name not in shapes:
            raise UserError(f"{folder} holds no {name}: is config.json the model's?")
        saved = shapes[name][0]
        if name in ("model.embed_tokens.weight", "lm_head.weight") and saved and saved[0] >= vocab:
            saved = (vocab, *saved[1:])
        if tuple(saved) != tuple(shape):
            raise UserError(f"{folder} holds {name} of shape {list(shapes[name][0])}, its config says "
                            f"{list(shape)}: give the model's config with --model-config")


def _unpadded(tensor: torch.Tensor, vocab: int, shape: tuple[int, ...]) -> torch.Tensor:
    return tensor[:vocab].contiguous() if tuple(tensor.shape) != tuple(shape) else tensor


def _write_folder(out: Path, spec: ModelSpec, shapes: dict, fetch: Fetch) -> None:
    """config.json and model.safetensors, streamed, into a temporary folder renamed to `out`
    (an existing `out` keeps its other files: only these two are replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".export-"))
    try:
        names = list(shapes)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                yield name, fetch(name)
        write_safetensors(tmp / WEIGHTS_NAME, tensors(), [(n, shapes[n][1], shapes[n][0]) for n in names],
                          metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(spec), indent=1))
        (tmp / WEIGHTS_NAME).replace(out / WEIGHTS_NAME)
        (tmp / "config.json").replace(out / "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
