"""What every rank must agree on before it trains, checked collectively and without pickle.

    check_same_settings(config.to_dict(), device, ignore=("threads", ...))   # at start
    value = broadcast_json(value_on_rank0, device)                            # rank 0's, everywhere

The ranks of a run are started separately (torchrun, a scheduler, by hand), so one may get
another `--lr` or config file; its replica would then drift from the others while the plan
fingerprints (dp.check_same_plan) still agree, because the plan does not depend on the learning
rate. Rank 0's resolved settings are broadcast as JSON, each rank compares them with its own,
and the differing fields are combined (all-reduce MAX of one flag per field, which NCCL and gloo
both support), so every rank raises the same one-line error naming the fields, rank 0's values
and the ranks that differ.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from lengthwise.errors import UserError

_ABSENT = object()
"""A field one rank's settings lack (another version of lengthwise)."""


def broadcast_json(value, device: torch.device | None = None):
    """Rank 0's JSON-able `value` on every rank (a length, then UTF-8 bytes)."""
    device = device or torch.device("cpu")
    data = json.dumps(value, sort_keys=True).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return json.loads(buffer.cpu().numpy().tobytes())


def check_same_settings(settings: dict, device: torch.device | None = None, *, ignore: tuple[str, ...] = (),
                        what: str = "training configuration") -> None:
    """UserError on every rank when some rank's `settings` differ from rank 0's in a field
    not in `ignore` (fields that may differ per process: threads, progress bar, ...)."""
    mine = json.loads(json.dumps({k: v for k, v in settings.items() if k not in ignore}, sort_keys=True))
    reference = broadcast_json(mine, device)
    fields = sorted(set(reference) | set(mine))
    differs = [float(mine.get(name, _ABSENT) != reference.get(name, _ABSENT)) for name in fields]
    rank, world = dist.get_rank(), dist.get_world_size()
    table = torch.zeros(world, len(fields) + 1, dtype=torch.float32, device=device)
    table[rank, :-1] = torch.tensor(differs)
    table[rank, -1] = float(any(differs))
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # each row is written by one rank only
    odd_ranks = [r for r in range(world) if table[r, -1] > 0]
    if not odd_ranks:
        return
    odd_fields = [name for i, name in enumerate(fields) if table[:, i].max() > 0]
    shown = ", ".join(f"{name} (rank 0: {json.dumps(reference.get(name))})" for name in odd_fields)
    raise UserError(f"rank{'s' if len(odd_ranks) > 1 else ''} {', '.join(map(str, odd_ranks))} "
                    f"{'were' if len(odd_ranks) > 1 else 'was'} started with another {what} than rank 0: "
                    f"{shown}; start every rank with the same flags and config file")
