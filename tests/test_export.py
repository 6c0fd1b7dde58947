"""`lengthwise export`: a training checkpoint becomes a Hugging Face folder transformers loads,
with the trained weights exactly."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lengthwise.cli import main
from lengthwise.runtime.manifest import write_manifest
from lengthwise.runtime.weights import read_tensors


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "--steps", "2", "--batch-size", "4", "--context-length", "64", "--out", str(out)]) == 0
    return out


def test_exported_folder_loads_in_transformers_with_the_trained_weights(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "--hf", str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    step = sorted(run_dir.glob("step-*"))[-1]
    trained = read_tensors(step)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    loaded = model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name


def test_export_reads_distributed_checkpoint_shards(run_dir, tmp_path):
    """A checkpoint with only torch.distributed.checkpoint shards (no Hugging Face copy)."""
    import torch.distributed.checkpoint as dcp

    step = sorted(run_dir.glob("step-*"))[-1]
    weights = read_tensors(step)
    shards = tmp_path / "step-000002"
    dcp.save({"model": dict(weights)}, checkpoint_id=str(shards))
    (shards / "config.json").write_text((step / "config.json").read_text())
    write_manifest(shards, meta={"kind": "distributed", "nproc": 1, "step": 2})
    assert main(["export", str(shards), "--hf", str(tmp_path / "hf")]) == 0
    exported = read_tensors(tmp_path / "hf")
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[n], weights[n]) for n in weights)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]


def test_a_damaged_checkpoint_is_refused_by_name(run_dir, tmp_path, capsys):
    import shutil

    step = sorted(run_dir.glob("step-*"))[-1]
    copy = tmp_path / step.name
    shutil.copytree(step, copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert main(["export", str(copy), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err and not (tmp_path / "hf").exists()
