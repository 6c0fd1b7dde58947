"""Tier 3: `lengthwise train` on 2 processes (pp2, chunkflow, gloo, float64) survives a rank
killed in the middle of a step: torchrun restarts the group, training resumes from the last
complete checkpoint (torch.distributed.checkpoint), and ends at the weights of a run never
interrupted.

Under torchrun this file is the worker: it parses the `train` command's own flags and runs
`train_distributed`, what `lengthwise train` runs under torchrun, with one fault hook that kills
a rank (SIGKILL) after one action of one step, once (a marker file in the output remembers it).

A second run without restarts checks torchrun's failure summary: the killed rank's exit code,
signal and last action (lengthwise's status note, kept in the worker's error file).

The uninterrupted reference is single-process `train` of the same plans: equal up to the order
of floating-point sums (measured: largest weight difference 1.6e-15, losses identical). Two
processes, not the dp2 x pp2 of 4 it once used: most of its time is starting processes twice
(about 30 s with 4), and resuming a data-parallel run is covered by
tests/test_train_distributed.py and tests/test_train_parallel.py.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # a torchrun worker: no collections while it imports (see the end)
    gc.disable()

import pytest
import torch.distributed as dist

from lengthwise.cli import build_parser
from lengthwise.commands.train import config_from_args, summary
from lengthwise.files import write_atomic
from lengthwise.runtime.train.dist_launch import train_distributed
from lengthwise.runtime.train.loop import train
from lengthwise.runtime.export import checkpoint_weights

TRAIN_ARGS = ["--dtype", "float64", "--context-length", "96", "--batch-size", "6", "--steps", "2",
              "--dp", "1", "--pp", "2", "--chunk-size", "32", "--k", "1", "--lr", "1e-3",
              "--threads", "1", "--no-progress"]
FAIL_AT = (2, 1, 3)
"""(step, rank, action index): step 2 (the last), rank 1 (pipeline 0, stage 1), after its 4th action:
the restarted group resumes from step 1's checkpoint."""
FAULT_MARKER = "fault-injected"


def test_killed_rank_resumes_from_checkpoint_to_uninterrupted_weights(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", __file__, *TRAIN_ARGS, "--out", str(out), "--save-every", "1",
               "--metrics", str(out / "metrics.jsonl")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / FAULT_MARKER).read_text().startswith("step 2 rank 1 action 3")
    assert "steps 2-2 of 2 (resumed from" in done.stdout and "step-000001)" in done.stdout

    reference = _train_single_process()
    weights, expected = checkpoint_weights(out / "step-000002"), reference.model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert (weights[name] - tensor).abs().max() <= 1e-12, name
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2]  # step 2 of the killed attempt never ended
    assert [line["loss"] for line in logged] == pytest.approx([r.loss for r in reference.records], rel=1e-12)


def test_torchrun_summary_names_the_killed_rank_and_its_last_action(tmp_path):
    """No restart: torchrun's failure summary shows rank 1's signal and what it last did (its
    error file holds lengthwise's status note)."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "0", __file__, *TRAIN_ARGS, "--out", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    start = done.stderr.index("rank      : 1 (local_rank: 1)")  # rank 1's entry (root cause or not)
    entry = done.stderr[start:done.stderr.index("\n", done.stderr.index("traceback :", start))]
    assert "exitcode  : -9" in entry, entry  # the signal's name beside it: torchrun's wording, not on torch 2.11
    assert "lengthwise, last action of this rank: step 2, pipeline 0 stage 1 cp rank 0: finished action 3 (" in entry


def _train_single_process():
    args = build_parser(only="train").parse_args(["train", *TRAIN_ARGS])
    return train(config_from_args(args))


def _kill_once(out: Path):
    """The after_action hook: SIGKILL this rank at FAIL_AT, unless a marker says it happened."""
    marker = out / FAULT_MARKER

    def after_action(step: int, index: int) -> None:
        if (step, dist.get_rank(), index) == FAIL_AT and not marker.exists():
            write_atomic(marker, f"step {step} rank {dist.get_rank()} action {index}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    return after_action


def _worker(argv: list[str]) -> int:
    """One torchrun worker: `lengthwise train ARGV` with the fault hook."""
    config = config_from_args(build_parser(only="train").parse_args(["train", *argv]))
    result = train_distributed(config, after_action=_kill_once(Path(config.out)))
    if result is not None:
        print(summary(config, result))
    return 0


if __name__ == "__main__":
    # The imports above (torch, its distributed packages) made some 10^6 objects that live as long
    # as the worker: kept out of collections, instead of a dozen full ones during the imports
    # (about 0.8 s of each worker's start-up, six workers here).
    gc.freeze()
    gc.enable()
    raise SystemExit(_worker(sys.argv[1:]))


def _say_rank(rank: int) -> int:
    print(f"worker {rank} on stdout", flush=True)
    print(f"worker {rank} on stderr", file=sys.stderr, flush=True)
    return rank


def test_local_workers_write_to_the_callers_current_streams(capfd):
    """Workers forked from the fork server (started once, with the streams of that moment) still
    write to the streams the caller has now: a caller that redirected its output, or a test
    capturing it, sees every rank's lines."""
    from lengthwise.runtime.distributed.launch import spawn

    with capfd.disabled():  # the server (if not running yet) starts with uncaptured streams
        assert spawn(_say_rank, 2) == 0
    capfd.readouterr()
    assert spawn(_say_rank, 2) == 0  # forked from that server, under capture
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"worker {rank} on stdout" in out
        assert f"worker {rank} on stderr" in err
