"""Checkpoints are data, and damaged ones are never read: a pickle payload or a flipped byte in
any file of a single-process or a distributed checkpoint is caught by its manifest, resume
falls back to the newest intact checkpoint (saying so) or refuses, and the payload never runs.

Each training run happens once (tiny model, float64, two or three steps); every damage case
works on a copy of its checkpoint folder. The distributed cases check every file through the
scan rank 0 runs for the group (`checkpoint.latest_checkpoint`) and the load path's verification;
one real 2-process resume over two damaged steps shows the group falls back and ends at the
weights of the undamaged run.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from lengthwise.cli import main
from lengthwise.errors import UserError
from lengthwise.runtime.checkpoint import latest_checkpoint, load_checkpoint
from lengthwise.runtime.distributed.shards import LAYOUT
from lengthwise.runtime.export import checkpoint_weights
from lengthwise.runtime.manifest import MANIFEST, DamagedCheckpoint, list_files, verify_manifest, write_manifest
from lengthwise.runtime.model import build_model
from lengthwise.runtime.train.loop import make_optimizer, train
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.weights import read_tensors
from lengthwise.specs import model_preset

from shared_runs import DP2_ARGS, DP2_STEPS

SINGLE_FILES = ["config.json", "model.safetensors", "optimizer.json", "optimizer.safetensors", "rng.json",
                "rng.safetensors", "trainer.json", MANIFEST]
DIST_FILES = ["config.json", "rank-0.json", "rank-0.safetensors", "rank-1.json", "rank-1.safetensors", "shards-0.json",
              "shards-0.safetensors", "shards-1.json", "shards-1.safetensors", MANIFEST]
DIST_ARGS = DP2_ARGS
"""The settings of the shared dp 2 run (`shared_runs.train_dp2`, 3 steps), for resuming its copies."""


class Payload:
    """Unpickling this creates the file `marker` (what an attacker's os.system would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def damage(path: Path, kind: str, marker: Path) -> None:
    if kind == "flip":
        flip_byte(path)
    else:
        path.write_bytes(payload_bytes(marker))


def small(**changes) -> TrainConfig:
    base = {"dtype": "float64", "context_length": 96, "batch_size": 3, "steps": 2, "lr": 1e-2,
            "progress": False, "options": {"chunk_size": 32, "k": 1}, "threads": 1}
    return TrainConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    train(small(out=str(out), save_every=1))
    return out


@pytest.fixture(scope="module")
def dist_run(dp2_run) -> Path:
    """The session's dp 2 run of 3 steps (conftest.dp2_run, read by tests/test_train_distributed.py
    too): only read here, copied before any change."""
    assert DP2_STEPS == 3  # the tests below damage and resume steps 1-3
    return dp2_run


def copy_run(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_the_payload_is_real(tmp_path):
    """Unpickled, the planted bytes do create the marker: the tests below would see it run."""
    marker = tmp_path / "ran"
    pickle.loads(payload_bytes(marker))
    assert marker.exists()


def test_the_file_lists_are_the_checkpoints_files(single_run, dist_run):
    assert list_files(single_run / "step-000002") + [MANIFEST] == sorted(SINGLE_FILES[:-1]) + [MANIFEST]
    assert list_files(dist_run / "step-000003") + [MANIFEST] == sorted(DIST_FILES[:-1]) + [MANIFEST]
    assert verify_manifest(dist_run / "step-000003") == {"format": "lengthwise-checkpoint", "version": 1,
                                                         "kind": "distributed", "layout": LAYOUT, "nproc": 2,
                                                         "step": 3}


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "trainer.json", MANIFEST])
def test_single_process_resume_falls_back_and_runs_nothing(single_run, tmp_path, capsys, name):
    """Real resumes (every file and both damages take the same path: the next test runs the scan
    resume uses, and the load, on each)."""
    out, marker = copy_run(single_run, tmp_path), tmp_path / "ran"
    damage(out / "step-000002" / name, "pickle", marker)
    resumed = train(small(out=str(out), steps=2))
    assert resumed.resumed_from == out / "step-000001" and resumed.start_step == 1
    err = capsys.readouterr().err
    assert f"checkpoint {out / 'step-000002'} is " in err and "skipping it" in err
    assert f"resuming from {out / 'step-000001'}, the newest intact checkpoint" in err
    # step 2, trained again, was rewritten whole: intact, and bit-identical to the undamaged run
    verify_manifest(out / "step-000002")
    rerun, original = read_tensors(out / "step-000002"), read_tensors(single_run / "step-000002")
    assert all(torch.equal(rerun[k], original[k]) for k in original)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["flip", "pickle"])
@pytest.mark.parametrize("name", SINGLE_FILES)
def test_a_damaged_checkpoint_is_skipped_and_refused_by_name(single_run, tmp_path, name, kind):
    out, marker = copy_run(single_run, tmp_path), tmp_path / "ran"
    damage(out / "step-000002" / name, kind, marker)
    assert latest_checkpoint(out, notify=lambda line: None) == out / "step-000001"
    model = build_model(model_preset("tiny"), dtype=torch.float64, device=torch.device("cpu"), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DamagedCheckpoint, match=r"step-000002 is damaged: \S+ ") as caught:
        load_checkpoint(out / "step-000002", model, make_optimizer(model, small()))
    assert "\n" not in str(caught.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing was read
    assert not marker.exists()


@pytest.mark.parametrize("name", [n for n in SINGLE_FILES if n != MANIFEST])
def test_a_payload_with_a_matching_manifest_is_still_not_unpickled(single_run, tmp_path, name):
    """A crafted checkpoint passes the manifest; the loaders themselves read only JSON and
    safetensors, so the payload fails to parse instead of running (config.json is not read on
    resume: the model's shape comes from --model)."""
    out, marker = copy_run(single_run, tmp_path), tmp_path / "ran"
    step = out / "step-000002"
    (step / name).write_bytes(payload_bytes(marker))
    write_manifest(step, meta={"kind": "single", "step": 2})
    model = build_model(model_preset("tiny"), dtype=torch.float64, device=torch.device("cpu"), seed=0)
    try:
        load_checkpoint(step, model, make_optimizer(model, small()))
        outcome = "loaded"
    except (ValueError, SafetensorError) as exc:  # JSON and UTF-8 errors are ValueErrors
        outcome = f"refused: {type(exc).__name__}"
    assert outcome.startswith("loaded" if name == "config.json" else "refused")
    assert not marker.exists()


def test_an_edited_step_in_trainer_json_is_caught(single_run, tmp_path):
    out = copy_run(single_run, tmp_path)
    path = out / "step-000002" / "trainer.json"
    trainer = json.loads(path.read_text())
    path.write_text(json.dumps({**trainer, "step": 1}, indent=1))
    with pytest.raises(DamagedCheckpoint, match="trainer.json (has .* bytes|differs from its manifest)"):
        verify_manifest(out / "step-000002")
    assert latest_checkpoint(out) == out / "step-000001"


def test_incomplete_and_unlisted_files_are_named(single_run, tmp_path):
    out = copy_run(single_run, tmp_path)
    (out / "step-000002" / "extra.pt").write_bytes(b"x")
    with pytest.raises(DamagedCheckpoint, match="holds extra.pt, which its MANIFEST.json does not list"):
        verify_manifest(out / "step-000002")
    (out / "step-000002" / "extra.pt").unlink()
    (out / "step-000002" / "optimizer.safetensors").unlink()
    with pytest.raises(DamagedCheckpoint, match="optimizer.safetensors is missing"):
        verify_manifest(out / "step-000002")
    (out / "step-000001" / MANIFEST).unlink()
    with pytest.raises(DamagedCheckpoint, match="step-000001 is incomplete: it has no MANIFEST.json"):
        verify_manifest(out / "step-000001")


def test_every_checkpoint_damaged_is_refused_not_restarted(single_run, tmp_path, capsys):
    """Starting afresh over damaged checkpoints would hide the loss: one line, exit 2."""
    out = copy_run(single_run, tmp_path)
    for step in ("step-000001", "step-000002"):
        flip_byte(out / step / "model.safetensors")
    code = main(["train", "--dtype", "float64", "--context-length", "96", "--batch-size", "3", "--steps", "2",
                 "--chunk-size", "32", "--k", "1", "--threads", "1", "--no-progress", "--out", str(out)])
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lengthwise train: error: no intact checkpoint under") and "Traceback" not in last


@pytest.mark.parametrize("kind", ["flip", "pickle"])
@pytest.mark.parametrize("name", DIST_FILES)
def test_distributed_checkpoint_damage_is_caught_before_reading(dist_run, tmp_path, capsys, name, kind):
    """What rank 0 runs for the group: the scan skips the damaged step, the load verifies first."""
    out, marker = copy_run(dist_run, tmp_path), tmp_path / "ran"
    damage(out / "step-000003" / name, kind, marker)
    assert latest_checkpoint(out) == out / "step-000002"
    assert f"checkpoint {out / 'step-000003'} is " in capsys.readouterr().err
    with pytest.raises(UserError, match="step-000003 is damaged"):
        verify_manifest(out / "step-000003")
    assert not marker.exists()


def test_distributed_resume_falls_back_over_damaged_steps(dist_run, tmp_path, capfd):
    """Step 3's shard index carries a payload, step 2 has a flipped byte in a shard: the two
    processes resume from step 1, rewrite steps 2 and 3, and end at the undamaged weights."""
    out, marker = copy_run(dist_run, tmp_path), tmp_path / "ran"
    damage(out / "step-000003" / "shards-0.json", "pickle", marker)
    damage(out / "step-000002" / "shards-1.safetensors", "flip", marker)
    assert main(["train", *DIST_ARGS, "--steps", "3", "--out", str(out)]) == 0
    captured = capfd.readouterr()
    assert "(resumed from" in captured.out and "step-000001)" in captured.out
    assert f"checkpoint {out / 'step-000003'} is damaged: shards-0.json" in captured.err
    assert f"checkpoint {out / 'step-000002'} is damaged: shards-1.safetensors" in captured.err
    assert not marker.exists()
    for step in ("step-000002", "step-000003"):
        verify_manifest(out / step)
        rerun, original = checkpoint_weights(out / step), checkpoint_weights(dist_run / step)
        assert all(torch.equal(rerun[k], original[k]) for k in original), step


def test_a_distributed_checkpoint_resumed_on_one_process_names_the_processes(dist_run, tmp_path):
    out = copy_run(dist_run, tmp_path)
    with pytest.raises(UserError, match="written by a distributed run of 2 processes; resume it with the same --nproc"):
        train(small(out=str(out), steps=4))


def test_a_checkpoint_of_an_older_version_is_not_overwritten(single_run, tmp_path):
    """Its folder has trainer.json but no manifest: refused by name rather than restarted over."""
    out = copy_run(single_run, tmp_path)
    for step in ("step-000001", "step-000002"):
        (out / step / MANIFEST).unlink()
    with pytest.raises(UserError, match="step-000002 was written by an older lengthwise"):
        latest_checkpoint(out, notify=lambda line: None)


def test_resume_of_a_damaged_path_is_one_line_exit_2(single_run, tmp_path, capsys):
    out = copy_run(single_run, tmp_path)
    flip_byte(out / "step-000002" / "optimizer.safetensors")
    code = main(["train", "--dtype", "float64", "--context-length", "96", "--batch-size", "3", "--steps", "3",
                 "--chunk-size", "32", "--k", "1", "--threads", "1", "--no-progress",
                 "--resume", str(out / "step-000002")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "step-000002 is damaged: optimizer.safetensors differs from its manifest (sha256)" in err


def test_a_file_replaced_by_a_link_is_not_followed(single_run, tmp_path):
    out = copy_run(single_run, tmp_path)
    target = out / "step-000002" / "optimizer.safetensors"
    target.unlink()
    target.symlink_to(out / "step-000001" / "optimizer.safetensors")
    with pytest.raises(DamagedCheckpoint, match="optimizer.safetensors is not a regular file"):
        verify_manifest(out / "step-000002")


@pytest.mark.parametrize("outside", ["../secret.bin", "absolute"])
def test_a_manifest_entry_outside_the_folder_is_refused(tmp_path, outside):
    """A manifest may name only files inside its folder: an entry with `..` or an absolute path
    is refused even when the file it points at exists and matches its size and digest."""
    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not the checkpoint's")
    write_manifest(folder, meta={"step": 1})
    manifest = json.loads((folder / MANIFEST).read_text())
    name = str(secret) if outside == "absolute" else outside
    manifest["files"][name] = {"bytes": secret.stat().st_size,
                               "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DamagedCheckpoint, match="malformed entry"):
        verify_manifest(folder)


def _read_like_a_resume(step: Path) -> None:
    """What a resuming rank reads, without a process group: every piece of every saved tensor
    into a tensor of its global shape, the optimizer's JSON values, each rank's extras and RNG
    states (`checkpoint_dist.load_state`, then the extras' readers)."""
    from safetensors.torch import load_file

    from lengthwise.runtime.checkpoint import set_rng_state
    from lengthwise.runtime.distributed.checkpoint_dist import load_state
    from lengthwise.runtime.distributed.shards import read_index, torch_dtype

    index, values = read_index(step)
    state: dict = {}
    for key, pieces in index.items():
        group, name = key.split(".", 1)
        state.setdefault(group, {})[name] = torch.zeros(pieces[0].global_shape, dtype=torch_dtype(pieces[0].dtype))
    for key in values.get(0, {}):
        group, name = key.split(".", 1)
        state.setdefault(group, {})[name] = None
    load_state(step, state, 0)
    for rank in (0, 1):
        extras = json.loads((step / f"rank-{rank}.json").read_text())
        set_rng_state(extras.pop("rng"), load_file(step / f"rank-{rank}.safetensors"))


@pytest.mark.parametrize("name", [n for n in DIST_FILES if n != MANIFEST])
def test_a_distributed_payload_with_a_matching_manifest_is_never_unpickled(dist_run, tmp_path, capsys, name):
    """Every file of a distributed checkpoint replaced by a pickle payload and the manifest
    rewritten to match: `lengthwise export` refuses it in one line (exit 2) and the resume's
    readers fail to parse it (config.json is not read on resume); the payload never runs."""
    out, marker = copy_run(dist_run, tmp_path), tmp_path / "ran"
    step = out / "step-000003"
    (step / name).write_bytes(payload_bytes(marker))
    write_manifest(step, meta={"kind": "distributed", "layout": LAYOUT, "nproc": 2, "step": 3})
    assert main(["export", str(step), "--hf", str(tmp_path / "hf")]) == (0 if name.startswith("rank-") else 2)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(errors) == (0 if name.startswith("rank-") else 1), err
    if name != "config.json":
        with pytest.raises((UserError, ValueError, SafetensorError)) as caught:
            _read_like_a_resume(step)
        assert "\n" not in str(caught.value)
    assert not marker.exists()


def test_a_crafted_distributed_checkpoint_is_refused_by_a_real_resume(dist_run, tmp_path, capfd):
    """Two processes resume a step whose shard index is a payload under a matching manifest:
    one line, exit 2, nothing run."""
    out, marker = copy_run(dist_run, tmp_path), tmp_path / "ran"
    step = out / "step-000003"
    (step / "shards-1.json").write_bytes(payload_bytes(marker))
    write_manifest(step, meta={"kind": "distributed", "layout": LAYOUT, "nproc": 2, "step": 3})
    assert main(["train", *DIST_ARGS, "--steps", "4", "--out", str(out)]) == 2
    err = capfd.readouterr().err
    assert "shards-1.json is not JSON" in err and "Traceback" not in err
    assert not marker.exists()


def test_an_earlier_versions_pickled_checkpoint_needs_the_flag(dist_run, tmp_path, capfd):
    """A torch.distributed.checkpoint `.metadata` (a pickle, here a payload) under a matching
    manifest of the earlier layout: resume refuses it in one line naming --allow-pickle-checkpoint
    and never unpickles it."""
    out, marker = copy_run(dist_run, tmp_path), tmp_path / "ran"
    step = out / "step-000003"
    (step / ".metadata").write_bytes(payload_bytes(marker))
    write_manifest(step, meta={"kind": "distributed", "nproc": 2, "step": 3})
    assert main(["train", *DIST_ARGS, "--steps", "4", "--out", str(out)]) == 2
    err = capfd.readouterr().err
    line = next(line for line in err.splitlines() if "error:" in line)
    assert "--allow-pickle-checkpoint" in line and "Traceback" not in err
    assert main(["export", str(step), "--hf", str(tmp_path / "hf")]) == 2
    assert "--allow-pickle-checkpoint" in capfd.readouterr().err
    assert not marker.exists()


def _as_earlier_version(step: Path, legacy: Path) -> None:
    """`step` rewritten in the earlier layout: torch.distributed.checkpoint files (pickled
    `.metadata`) holding the whole tensors and optimizer values, the same extras, a manifest of
    the earlier kind."""
    import torch.distributed.checkpoint as dcp

    from lengthwise.runtime.distributed.checkpoint_dist import _decode
    from lengthwise.runtime.distributed.shards import PieceReader, read_index

    index, values = read_index(step)
    state: dict = {"model": {}, "optim": {}}
    with PieceReader(step, index) as reader:
        for key in index:
            group, name = key.split(".", 1)
            state[group][name] = reader.whole(key)
    for key, value in values[0].items():
        group, name = key.split(".", 1)
        state[group][name] = _decode(value)
    dcp.save(state, checkpoint_id=str(legacy))
    for path in step.iterdir():
        if path.name.startswith("rank-") or path.name == "config.json":
            shutil.copy(path, legacy / path.name)
    write_manifest(legacy, meta={"kind": "distributed", "nproc": 2, "step": 2})


def test_with_the_flag_an_earlier_versions_checkpoint_resumes_as_before(dist_run, tmp_path):
    """--allow-pickle-checkpoint: step 2 in the earlier layout resumes, and step 3 ends at the
    weights of the run that never stopped."""
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(dist_run / "step-000001", out / "step-000001")
    _as_earlier_version(dist_run / "step-000002", out / "step-000002")
    assert main(["train", *DIST_ARGS, "--steps", "3", "--out", str(out)]) == 2  # refused without the flag
    assert main(["train", *DIST_ARGS, "--steps", "3", "--out", str(out), "--allow-pickle-checkpoint"]) == 0
    resumed, original = checkpoint_weights(out / "step-000003"), checkpoint_weights(dist_run / "step-000003")
    assert all(torch.equal(resumed[k], original[k]) for k in original)
