"""The fake process group as a context: one rank of a world that exists only in this process.

    with fake_world(rank=3, world_size=256), FakeTensorMode(...):
        ...   # build and run rank 3's part; collectives return at once, nothing is sent

The dry run (`runtime/dryrun.py`) and the checkpoint-footprint measurement
(`runtime/parallel/checkpoint_scale.py`) run one rank of a full-size job this way.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_world(rank: int, world_size: int):
    """The fake process group as the default group, as `rank` of `world_size`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
