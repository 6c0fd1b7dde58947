"""`lengthwise export`: a training checkpoint becomes a Hugging Face folder transformers loads,
with the trained weights exactly."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lengthwise.cli import main
from lengthwise.runtime.distributed.shards import LAYOUT, Local, write_pieces
from lengthwise.runtime.manifest import write_manifest
from lengthwise.runtime.weights import read_tensors


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "--steps", "2", "--batch-size", "4", "--context-length", "64", "--save-every", "1",
                 "--out", str(out)]) == 0
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


def _halves(weights: dict[str, torch.Tensor], rank: int) -> list[Local]:
    """Rank `rank` of two's row-half of every weight (a 1-row tensor: rank 0 holds it whole)."""
    out = []
    for name, tensor in weights.items():
        rows = tensor.shape[0]
        cut = (rows + 1) // 2
        start, stop = (0, cut) if rank == 0 else (cut, rows)
        piece = tensor[start:stop]
        out.append(Local(f"model.{name}", piece, (start, *[0] * (tensor.dim() - 1)), tuple(tensor.shape)))
    return out


def test_export_consolidates_distributed_shards_one_tensor_at_a_time(run_dir, tmp_path, capsys):
    """A checkpoint whose weights are two ranks' row halves (shards-R.safetensors + JSON index)."""
    step = sorted(run_dir.glob("step-*"))[-1]
    weights = read_tensors(step)
    shards = tmp_path / "step-000002"
    shards.mkdir()
    for rank in (0, 1):
        write_pieces(shards, rank, _halves(weights, rank), {})
    (shards / "config.json").write_text((step / "config.json").read_text())
    write_manifest(shards, meta={"kind": "distributed", "layout": LAYOUT, "nproc": 2, "step": 2})
    assert main(["export", str(shards), "--hf", str(tmp_path / "hf")]) == 0
    assert f"exporting step 2 from {shards}" in capsys.readouterr().err
    exported = read_tensors(tmp_path / "hf")
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[n], weights[n]) for n in weights)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]


def test_a_pickled_dcp_checkpoint_needs_the_explicit_flag(run_dir, tmp_path, capsys):
    """An earlier version's torch.distributed.checkpoint folder: refused in one line naming
    --allow-pickle-checkpoint; with the flag it exports as before."""
    import torch.distributed.checkpoint as dcp

    step = sorted(run_dir.glob("step-*"))[-1]
    weights = read_tensors(step)
    legacy = tmp_path / "step-000002"
    dcp.save({"model": dict(weights)}, checkpoint_id=str(legacy))
    (legacy / "config.json").write_text((step / "config.json").read_text())
    write_manifest(legacy, meta={"kind": "distributed", "nproc": 1, "step": 2})
    assert main(["export", str(legacy), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--allow-pickle-checkpoint" in errors[0] and "Traceback" not in err
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert main(["export", str(legacy), "--hf", str(tmp_path / "hf"), "--allow-pickle-checkpoint"]) == 0
    exported = read_tensors(tmp_path / "hf")
    assert all(torch.equal(exported[n], weights[n]) for n in weights)


def test_export_of_a_run_names_the_step_and_the_damaged_newer_one(run_dir, tmp_path, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    newest = sorted(copy.glob("step-*"))[-1]
    (newest / "trainer.json").write_text("{}")
    assert main(["export", str(copy), "--hf", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    older = sorted(copy.glob("step-*"))[-2]
    assert f"{newest} is damaged: trainer.json" in err and f"exporting step 1 from {older}" in err


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
