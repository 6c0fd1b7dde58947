"""Starting the processes: torchrun, or local workers for trying things on one machine.

    torchrun --nproc-per-node 4 -m lengthwise verify --dp 2 --pp 2        # any launcher
    lengthwise verify --nproc 4 --dp 2 --pp 2                             # local CPU workers

Under torchrun (detected with torch's own `is_torchelastic_launched`), `init_from_torchrun`
joins the group torchrun describes: NCCL on GPUs (cuda:LOCAL_RANK), gloo on CPU. `spawn` starts
`nproc` local processes with torch.multiprocessing (start method spawn, gloo or NCCL, a FileStore in a
temporary folder for the rendezvous, so no port is guessed) and runs `fn(rank, *args)` in each.
Rank 0's return value comes back to the caller. When a worker fails, the others are stopped
and the caller gets a UserError with the failing ranks' messages, the earliest root cause
first (a UserError or a timed-out receive rather than the broken connections it left behind).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lengthwise.errors import UserError
from lengthwise.plan.ir import write_atomic
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.distributed.step import StepFailed

DEFAULT_TIMEOUT_S = 300.0
"""Collective and receive time-out, seconds (a stage may wait for a long chunk upstream)."""


def under_torchrun() -> bool:
    """Whether this process was started by torchrun / torch.distributed.run."""
    return dist.is_torchelastic_launched()


def init_from_torchrun(*, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> Mesh:
    """Join torchrun's process group (gloo on CPU, NCCL on CUDA) and return its mesh."""
    use_cuda = torch.device(device).type == "cuda"
    if not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("nccl" if use_cuda else "gloo", store=_attempt_store(rank, world, timeout_s),
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    if use_cuda:
        local = dist.get_node_local_rank(fallback_rank=dist.get_rank() % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return Mesh.from_default_group(device=device, timeout_s=timeout_s)


def _attempt_store(rank: int, world: int, timeout_s: float):
    """torchrun's rendezvous store, under a prefix of the restart attempt.

    torchrun (c10d rendezvous) shares one TCP store across restarts of the group, and
    init_process_group("env://") reads keys the previous attempt left there: gloo then
    connects to the dead ranks' addresses (pytorch issue 135712). The variables read here are
    torchrun's interface to its workers, the ones env:// reads anyway."""
    env = os.environ
    hosted_by_agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                          is_master=not hosted_by_agent and rank == 0, timeout=timedelta(seconds=timeout_s),
                          multi_tenant=not hosted_by_agent)
    return dist.PrefixStore(f"lengthwise/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def spawn(fn, nproc: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo"):
    """Run `fn(rank, *args)` in `nproc` local processes (gloo, or nccl with cuda:rank as each
    one's device); returns rank 0's result."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="lengthwise-spawn-") as folder:
        try:
            mp.start_processes(_worker, args=(fn, nproc, folder, timeout_s, args, backend), nprocs=nproc,
                               start_method="spawn", join=True)
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            raise UserError(_failure_report(Path(folder), nproc)) from None
        result = Path(folder) / "result.pickle"
        return pickle.loads(result.read_bytes()) if result.exists() else None


def _worker(rank: int, fn, nproc: int, folder: str, timeout_s: float, args: tuple, backend: str) -> None:
    torch.set_num_threads(1)  # nproc workers share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=nproc,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, *args)
    except Exception as exc:  # noqa: BLE001 -- any failure: recorded for the parent, then exit 1
        write_atomic(Path(folder) / f"error-{rank}.txt", f"{_kind(exc)}\n{exc}")
        if _kind(exc) == "other":  # a bug, not a named failure: keep the traceback on stderr
            traceback.print_exc()
        raise SystemExit(1) from None
    if rank == 0 and result is not None:
        write_atomic(Path(folder) / "result.pickle", pickle.dumps(result))
    dist.destroy_process_group()


def _kind(exc: BaseException) -> str:
    return "root" if isinstance(exc, UserError | StepFailed) else "other"


def _failure_report(folder: Path, nproc: int) -> str:
    """The failing ranks' messages, root causes first."""
    found = []
    for rank in range(nproc):
        path = folder / f"error-{rank}.txt"
        if path.exists():
            kind, _, message = path.read_text().partition("\n")
            lines = message.strip().splitlines() or ["?"]
            found.append((kind != "root", rank, lines[0] if kind == "root" else lines[-1]))
    if not found:
        return f"a worker of {nproc} died without a message (killed, or out of memory)"
    found.sort()
    shown = "; ".join(f"rank {rank}: {message}" for _, rank, message in found[:2])
    more = f" (and {len(found) - 2} more ranks)" if len(found) > 2 else ""
    return shown + more
