"""What one rank's checkpoint save holds at full size, measured on fake tensors.

    footprint = save_footprint(plan, rank=0)     # a LLaMA-70B rank of 256, on this CPU, in seconds
    footprint.written_bytes <= footprint.own_bytes

The rank's stage is built as the distributed executor builds it (`parallel/build.build_rank_model`:
TP, FSDP2 over dp x cp with fp32 master weights, as `dryrun.py` does), AdamW is given its states,
and the save's own code then forms the pieces it would write (`checkpoint_dist.model_state`,
`shards.local_pieces`) under the fake process group, with every collective counted. The save
writes its pieces one at a time from the tensors the rank already holds, so what it holds beyond
the training state is one piece's host copy at most (none on CPU): `written_bytes` (the pieces)
against `own_bytes` (the rank's parameter shards and optimizer states), and `largest_piece_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.distributed.checkpoint_dist import _by_parameter, _split, model_state
from lengthwise.runtime.parallel.dp import local
from lengthwise.runtime.distributed.mesh import Mesh, plan_world_size
from lengthwise.runtime.distributed.shards import local_pieces
from lengthwise.runtime.parallel.step import first_holders
from lengthwise.runtime.parallel.build import ParallelOptions, build_rank_model
from lengthwise.runtime.distributed.fake import fake_world


@dataclass(frozen=True)
class SaveFootprint:
    rank: int
    world_size: int
    own_bytes: int
    """The rank's parameter shards and optimizer states, as trained."""
    written_bytes: int
    """The pieces its save writes (each a tensor it holds; replicas left to another rank)."""
    largest_piece_bytes: int
    """The most one host copy can hold while a piece is written from a GPU."""
    pieces_not_own: int
    """Pieces that are not views of the rank's own storages (0: nothing was copied or gathered)."""
    collectives: int
    """Collective operations the save issued (0: no gather)."""


class _Collectives(TorchDispatchMode):
    """Counts the c10d operations dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def save_footprint(plan: StepPlan, rank: int, *, dtype: torch.dtype = torch.bfloat16) -> SaveFootprint:
    world_size = plan_world_size(plan)
    with fake_world(rank, world_size), FakeTensorMode(allow_non_fake_inputs=True):
        mesh = Mesh.from_default_group(timeout_s=60)
        model = build_rank_model(plan, mesh, dtype=torch.float32, fake=True,
                                 options=ParallelOptions(param_dtype=dtype))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()  # the states every step after the first holds
        optimizer.zero_grad(set_to_none=True)
        held = dict(model.named_parameters())
        own = [local(p) for p in held.values()] + [local(v) for s in optimizer.state.values() for v in s.values()
                                                    if isinstance(v, torch.Tensor)]
        storages = {t.untyped_storage()._cdata for t in own}
        first = first_holders(model, plan, mesh.layout(plan))
        counter = _Collectives()
        with counter:
            tensors, _ = _split(model_state(model, optimizer, held))
            with unset_fake_temporarily():  # DTensor's offset arithmetic makes small real tensors
                pieces = local_pieces(tensors, writes=_by_parameter(lambda name: first.get(name) == rank))
        return SaveFootprint(rank=rank, world_size=world_size, own_bytes=sum(t.numel() * t.element_size() for t in own),
                             written_bytes=sum(p.nbytes for p in pieces),
                             largest_piece_bytes=max(p.nbytes for p in pieces),
                             pieces_not_own=sum(p.tensor.untyped_storage()._cdata not in storages for p in pieces),
                             collectives=counter.count)
