"""Tier 3: a 4-process run (dp2 x pp2, chunkflow, gloo, float64) survives a rank killed in the
middle of a step: torchrun restarts the group, training resumes from the last complete
torch.distributed.checkpoint, and ends at the weights of a run never interrupted.

The uninterrupted reference here is the same loop on one process (`train_single_process`):
equal up to the order of floating-point sums (measured max relative difference about 1e-15).
Checked by hand once (not here: two more 4-process launches cost about 30 s): an uninterrupted
4-process torchrun run and the interrupted one end with bit-identical weights.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from lengthwise.runtime.distributed.loop import (
    FAULT_MARKER,
    parse_args,
    train_single_process,
)

LOOP_ARGS = ["--steps", "3", "--dp", "2", "--pp", "2", "--chunk-size", "32", "--k", "1", "--batch-size", "6"]


def test_killed_rank_resumes_from_checkpoint_to_uninterrupted_weights(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "1", "-m", "lengthwise.runtime.distributed.loop", "--out", str(out),
               *LOOP_ARGS, "--fail-at", "1:1:3"]  # step 1, rank 1 (pipeline 0, stage 1), after its 4th action
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / FAULT_MARKER).read_text().startswith("step 1 rank 1 action 3")
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert {"resumed_from": "step-000001", "step": 1} in log

    weights = torch.load(out / "final.pt")
    reference, losses = train_single_process(parse_args(["--out", str(out), *LOOP_ARGS]))
    assert weights.keys() == reference.keys()
    for name, ref in reference.items():
        assert torch.allclose(weights[name], ref, rtol=1e-12, atol=1e-15), name
    logged = {r["step"]: r["loss"] for r in log if "loss" in r}
    assert sorted(logged) == [0, 1, 2]
    for step, loss in enumerate(losses):
        assert abs(logged[step] - loss) <= 1e-12 * abs(loss)
