"""Tier 3: a distributed run that fails says which rank and why, in one line: a rank killed
mid-step is named with its signal and its last action (not as the others' broken connection),
and ranks started with different training settings refuse to start, naming the field."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from lengthwise.errors import UserError
from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.dist_launch import train_distributed, train_on_rank


def tiny(**changes) -> TrainConfig:
    base = {"dtype": "float64", "context_length": 96, "batch_size": 3, "steps": 2, "lr": 1e-2, "progress": False,
            "options": {"chunk_size": 32, "k": 1}, "threads": 1, "nproc": 2, "pp": 2}
    return TrainConfig(**{**base, **changes})


def kill_rank_1(step: int, index: int) -> None:
    """after_action hook: rank 1 dies by SIGKILL after its third action of step 1."""
    if (step, dist.get_rank(), index) == (1, 1, 2):
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_rank_is_named_with_its_signal_and_last_action():
    with pytest.raises(UserError) as caught:
        train_distributed(tiny(), after_action=kill_rank_1)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("rank 1 (pid ") and "was killed by SIGKILL" in message
    assert ", its last action: step 1, pipeline 0 stage 1 cp rank 0: finished action 2 (" in message


def _train_with_rank_lr(rank: int) -> None:
    """Rank 1 gets another lr and weight decay, and another thread count (which may differ)."""
    config = tiny(lr=1e-2 * (rank + 1), weight_decay=0.1 + rank, threads=rank + 1)
    train_on_rank(config, Mesh.from_default_group())


def test_a_rank_with_another_lr_refuses_to_train():
    with pytest.raises(UserError) as caught:
        spawn(_train_with_rank_lr, 2, timeout_s=60)
    message = str(caught.value)
    assert message == ("ranks 0, 1: rank 1 was started with another training configuration than rank 0: "
                       "lr (rank 0: 0.01), weight_decay (rank 0: 0.1); start every rank with the same flags "
                       "and config file")


def _one_fails_one_waits(rank: int, *, status) -> None:
    if rank == 1:
        status.note("waiting for a message that never comes")
    dist.barrier()  # rank 1's note is written before rank 0 fails
    if rank == 0:
        raise UserError("rank 0 gave up")
    time.sleep(60)  # stopped by the launcher once rank 0 has failed


def test_a_rank_still_running_when_another_fails_is_named_with_its_last_action():
    with pytest.raises(UserError) as caught:
        spawn(_one_fails_one_waits, 2, timeout_s=60, with_status=True)
    assert str(caught.value) == ("rank 0: rank 0 gave up; rank 1 was still running, its last action: "
                                 "waiting for a message that never comes")
