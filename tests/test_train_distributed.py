"""Tier 3: `lengthwise train --nproc N` (local gloo workers, float64, tiny model) trains to the
weights one process reaches with the same plan settings, reports from rank 0 only, resumes
bit-exactly from its checkpoint (each rank's shards), and refuses degrees that do not multiply to N.

The single-process runs execute the same dp / pp plan on one process (`run_step`); the sums run
in another order, so weights agree to round-off (largest difference measured: 3e-14 with dp2,
whose gradients are summed across ranks, 2e-16 with pp2)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lengthwise.cli import build_parser, main
from lengthwise.commands.train import config_from_args
from lengthwise.runtime.train.loop import train
from lengthwise.runtime.export import checkpoint_weights
from tolerance import reduction_tolerance

from shared_runs import DP2_STEPS, TRAIN_ARGS

ARGS = [*TRAIN_ARGS, "--steps", "2"]
"""Two steps of `shared_runs.TRAIN_ARGS`; the dp 2 run (`conftest.dp2_run`, shared with
tests/test_checkpoint_safety.py) takes DP2_STEPS = 3."""


def single_process(*argv: str):
    config = config_from_args(build_parser(only="train").parse_args(["train", *ARGS, *argv]))
    return train(config)


def distributed(out, *argv: str) -> None:
    assert main(["train", *ARGS, *argv, "--out", str(out), "--metrics", str(out / "metrics.jsonl")]) == 0


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                        atol: float) -> None:
    assert weights.keys() == expected.keys()
    for name, tensor in weights.items():
        assert (tensor - expected[name]).abs().max() <= atol, name


def test_dp2_reaches_the_single_process_weights(dp2_run):
    reference = single_process("--dp", "2", "--steps", str(DP2_STEPS))
    assert_same_weights(checkpoint_weights(dp2_run / f"step-{DP2_STEPS:06d}"), reference.model.state_dict(),
                        atol=1e-10)
    losses = [line["loss"] for line in metrics(dp2_run)]
    assert losses == pytest.approx([r.loss for r in reference.records], rel=1e-12)


def test_only_rank_0_writes_metrics(dp2_run):
    assert [line["step"] for line in metrics(dp2_run)] == list(range(1, DP2_STEPS + 1))


def test_distributed_resume_is_bit_identical(dp2_run, tmp_path):
    """Resume from the next-to-last checkpoint of the dp2 run: the last step ends at the same
    weights, bit for bit."""
    last = f"step-{DP2_STEPS:06d}"
    before = f"step-{DP2_STEPS - 1:06d}"
    shutil.copytree(dp2_run / before, tmp_path / before)
    distributed(tmp_path, "--nproc", "2", "--dp", "2", "--steps", str(DP2_STEPS))
    assert_same_weights(checkpoint_weights(tmp_path / last), checkpoint_weights(dp2_run / last), atol=0.0)
    assert metrics(tmp_path)[0]["loss"] == metrics(dp2_run)[-1]["loss"]


def test_pp2_reaches_the_single_process_weights_and_held_out_loss(tmp_path):
    """With a held-out slice: evaluated sharded, each stage on its own rank (nothing gathered)."""
    held_out = ("--eval-every", "2", "--eval-sequences", "4")
    distributed(tmp_path, "--nproc", "2", "--pp", "2", *held_out)
    reference = single_process("--pp", "2", *held_out)
    assert_same_weights(checkpoint_weights(tmp_path / "step-000002"), reference.model.state_dict(), atol=1e-10)
    # the weights differ by reordered sums; the loss reduces 4 sequences of <= 96 tokens, each
    # logit a sum over the hidden width (128)
    tolerance = reduction_tolerance(torch.float64, 4 * 96 * 128)
    assert [line.get("eval_loss") for line in metrics(tmp_path)] == \
        [None, pytest.approx(reference.records[1].eval_loss, rel=tolerance)]


def test_degrees_not_matching_nproc_are_one_line(capsys):
    assert main(["train", *ARGS, "--nproc", "4", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "dp(2) * pp(1) * cp(1) = 2 processes, --nproc gives 4" in err

