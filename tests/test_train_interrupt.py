"""Ctrl-C during `lengthwise train`: the first SIGINT (or SIGTERM) finishes the step, writes a
checkpoint, prints the resume command and exits 130; that command finishes the run exactly as
an uninterrupted one; a second signal leaves at once. Real subprocesses (signals need them),
tiny model, float64."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lengthwise
from lengthwise.cli import build_parser, main
from lengthwise.commands.train import config_from_args
from lengthwise.runtime.checkpoint import latest_checkpoint
from lengthwise.runtime.train.loop import train

BASE = ("--dtype", "float64", "--context-length", "64", "--batch-size", "3", "--steps", "5", "--lr", "1e-2",
        "--threads", "1", "--no-progress")
ARGS = (*BASE, "--chunk-size", "32", "--k", "1")
SRC = str(Path(lengthwise.__file__).resolve().parents[1])


def start(cwd: Path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lengthwise", "train", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen, limit_s: float = 120.0) -> None:
    """Until the metrics file has `count` lines (the steps are done and reported)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().count("\n") >= count:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"{path} never reached {count} lines")


def test_first_sigint_checkpoints_and_the_printed_command_finishes_exactly(tmp_path):
    out = tmp_path / "run"
    proc = start(tmp_path, *ARGS, "--out", str(out))
    wait_for_lines(out / "metrics.jsonl", 1, proc)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    saved = sorted(p.name for p in out.glob("step-*"))
    assert saved and saved[-1] < "step-000005", saved  # stopped early, with a checkpoint
    command = stdout.strip().splitlines()[-1].strip()
    assert command.startswith("lengthwise train") and f"--out {out}" in command
    # the printed command, run as printed, finishes the run
    assert main(shlex.split(command)[1:]) == 0
    resumed = load_file(out / "step-000005" / "model.safetensors")
    whole = train(config_from_args(build_parser(only="train").parse_args(["train", *ARGS]))).model
    for name, tensor in whole.state_dict().items():
        if name in resumed:  # tied weights are stored once
            assert torch.equal(resumed[name], tensor), name
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]  # each step reported once, across the interruption


def test_second_signal_leaves_at_once(tmp_path):
    out = tmp_path / "run"
    proc = start(tmp_path, "--steps", "50", "--batch-size", "64", "--context-length", "256", "--threads", "1",
                 "--no-progress", "--out", str(out))
    wait_for_lines(out / "metrics.jsonl", 1, proc, limit_s=300)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "leaving now" in stderr and "Traceback" not in stderr


def test_default_run_writes_to_a_named_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *ARGS, "--steps", "1"]) == 0
    (folder,) = (tmp_path / "lengthwise-runs").iterdir()
    assert (folder / "step-000001").is_dir() and (folder / "metrics.jsonl").is_file()
    captured = capsys.readouterr()
    assert str(folder.relative_to(tmp_path)) in captured.err
    assert f"checkpoint {folder.relative_to(tmp_path)}/step-000001" in captured.out


def test_sigterm_to_a_distributed_run_stops_every_rank_at_one_step(tmp_path):
    """A scheduler's SIGTERM reaches the launcher alone: it passes it on, the ranks agree on the
    step to stop after, and all of them write that step's checkpoint (a rank stopping at another
    step would leave the others waiting in the save, and the run would time out)."""
    out = tmp_path / "run"
    proc = start(tmp_path, *BASE, "--nproc", "2", "--dp", "2", "--planner", "packing", "--out", str(out))
    wait_for_lines(out / "metrics.jsonl", 1, proc, limit_s=300)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 5
    assert [p.name for p in out.glob("step-*")] == [f"step-{len(steps):06d}"]
    assert latest_checkpoint(out) == out / f"step-{len(steps):06d}"  # complete: every rank finished it
    command = stdout.strip().splitlines()[-1].strip()
    assert command.startswith("lengthwise train") and "--nproc 2" in command and f"--out {out}" in command
