"""Training runs that several test files read, run once per session (`conftest.py` holds the
fixtures). Each costs worker processes and seconds of CPU; a file reading one must only read it
(copy it to change or resume it)."""

from __future__ import annotations

from pathlib import Path

TRAIN_ARGS = ["--dtype", "float64", "--context-length", "96", "--batch-size", "3", "--lr", "1e-2",
              "--chunk-size", "32", "--k", "1", "--threads", "1", "--no-progress"]
"""Steps of 3 stdlib documents cut to 96 tokens; ChunkFlow chunks of 32 with K = 1, so long
documents are split and re-forwarded. Clipping (norm 1) is active: the gradient norms are 5-14."""
DP2_ARGS = [*TRAIN_ARGS, "--nproc", "2", "--dp", "2", "--save-every", "1"]
DP2_STEPS = 3


def train_dp2(out: Path) -> Path:
    """`lengthwise train` on 2 local processes (dp 2, FSDP2), DP2_STEPS steps, a checkpoint after
    each, metrics in OUT/metrics.jsonl: read by tests/test_train_distributed.py (weights, rank 0's
    metrics, resume) and tests/test_checkpoint_safety.py (the distributed checkpoint's files,
    damage, fallback)."""
    from lengthwise.cli import main

    assert main(["train", *DP2_ARGS, "--steps", str(DP2_STEPS), "--out", str(out)]) == 0
    return out
