"""Starting the processes: torchrun, or local workers for trying things on one machine.

    torchrun --nproc-per-node 4 -m lengthwise verify --dp 2 --pp 2        # any launcher
    lengthwise verify --nproc 4 --dp 2 --pp 2                             # local CPU workers

Under torchrun (detected with torch's own `is_torchelastic_launched`), `init_from_torchrun`
joins the group torchrun describes: NCCL on GPUs (cuda:LOCAL_RANK), gloo on CPU. `spawn` starts
`nproc` local processes with torch.multiprocessing (start method forkserver, which forks each
worker from a server that imported torch once, or spawn where the platform lacks it; gloo or
NCCL, a FileStore in a temporary folder for the rendezvous, so no port is guessed) and runs `fn(rank, *args)` in each.
Each worker starts by freezing what it inherited from the server (`gc.freeze`): those objects
live as long as the worker, and a collection walking them costs about 0.5-0.9 s per worker
(every page of the inherited heap copied on write).
Rank 0's return value comes back to the caller through a pipe it made for its workers. When a worker fails, the others are stopped
and the caller gets a UserError with the failing ranks' messages, the earliest root cause
first (a UserError or a timed-out receive rather than the broken connections it left behind).

A rank that dies without raising (SIGKILL, the out-of-memory killer, a crash in native code)
cannot say why, so `spawn(..., with_status=True)` hands each worker a `RankStatus`: a small
file the rank rewrites in place with what it last did (a page-cache write per note, no fsync:
it only has to outlive the process, not the machine). The report then names the dead rank,
its signal or exit code, and its last note, ahead of the others' broken connections. Under
torchrun, `RankStatus.for_torchrun` writes the note where torchrun's failure summary shows it,
beside the dead rank's exit code and signal.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lengthwise.errors import UserError
from lengthwise.files import write_atomic
from lengthwise.runtime.distributed import forkserver
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.distributed.p2p import StepFailed

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


class RankStatus:
    """What this rank did last, kept in a file for the launcher (`note` is cheap enough to call
    after every action). RankStatus(None) notes nothing.

    Under torchrun the file is the worker's error file (TORCHELASTIC_ERROR_FILE, torchrun's
    interface for a worker to explain its failure), in the JSON form torchrun reads: a worker
    killed by a signal then appears in torchrun's failure summary with its exit code, signal
    and last action, and, being the first to stop noting, as the root cause."""

    SIZE = 1024
    """Bytes of the file: each note overwrites it whole, so a reader never sees two notes mixed."""
    TEXT = 400
    """Characters of a note kept (the rest of SIZE leaves room for torchrun's JSON)."""

    def __init__(self, path: Path | None, *, elastic: bool = False):
        self._fd = None if path is None else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._elastic = elastic

    @classmethod
    def for_torchrun(cls) -> RankStatus:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        return cls(Path(path) if path else None, elastic=True)

    def note(self, text: str) -> None:
        if self._fd is None:
            return
        text = text[:self.TEXT]
        if self._elastic:  # the shape torchrun's ProcessFailure reads; trailing blanks are valid JSON
            text = json.dumps({"message": {"message": f"lengthwise, last action of this rank: {text}",
                                           "extraInfo": {"timestamp": str(int(time.time()))}}})
        os.pwrite(self._fd, text.encode()[:self.SIZE].ljust(self.SIZE), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def read(path: Path) -> str | None:
        text = path.read_bytes().decode(errors="replace").strip() if path.exists() else ""
        return text or None


def spawn(fn, nproc: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo",
          with_status: bool = False):
    """Run `fn(rank, *args)` in `nproc` local processes (gloo, or nccl with cuda:rank as each
    one's device); returns rank 0's result. `with_status`: call fn(rank, *args, status=RankStatus)."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="lengthwise-spawn-") as folder:
        sys.stdout.flush()
        sys.stderr.flush()
        streams = (_InheritedFd(1), _InheritedFd(2))
        method = _start_method()
        reader, writer = multiprocessing.get_context(method).Pipe(duplex=False)
        context = mp.start_processes(_worker, args=(fn, nproc, folder, timeout_s, args, backend, with_status, streams,
                                                    writer),
                                     nprocs=nproc, start_method=method, join=False)
        writer.close()
        result = None
        try:
            while not context.join(timeout=0.1):
                result = _received(reader, result)
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            ended = [Ended(rank, p.pid, p.exitcode, first=rank == exc.error_index)
                     for rank, p in enumerate(context.processes)]
            raise UserError(_failure_report(Path(folder), ended)) from None
        finally:
            result = _received(reader, result)
            reader.close()
        return result


def _received(reader, result):
    """Rank 0's result, once it has sent it: it comes through a pipe the caller made for its own
    workers (never through a file another process could have written), read as it is sent so
    that a result larger than the pipe's buffer never blocks the worker."""
    while reader.poll():
        try:
            result = reader.recv()
        except EOFError:
            break
    return result


def _start_method() -> str:
    """`forkserver` where the platform has it, else `spawn`. Workers are forked from one server
    process that imported torch once (`forkserver.PRELOAD`) and never initialised a
    device or ran an operator, so each worker starts in a fraction of a second instead of
    importing torch anew (seconds of CPU each: on a 2-core machine a 4-process run spent most of
    its CPU time importing). The server holds no CUDA context, which is what makes forking safe
    for NCCL workers too. A command may have started it already (`forkserver.start_fork_server`)."""
    if not forkserver.available():
        return "spawn"
    multiprocessing.set_forkserver_preload(forkserver.PRELOAD)  # takes effect when the server first starts
    return "forkserver"


class _InheritedFd:
    """The caller's file descriptor `fd`, handed to a worker as it starts. A forked server's
    workers inherit the server's stdout and stderr, those of the moment it started; they write
    to the caller's current ones instead, as spawned workers do (a test capturing output, a
    caller that redirected it since)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while the worker starts: the start method passes the fd along
        return (_detach_fd, (multiprocessing.reduction.DupFd(self.fd),))


def _detach_fd(dup) -> int:
    return dup.detach()


def _worker(rank: int, fn, nproc: int, folder: str, timeout_s: float, args: tuple, backend: str,
            with_status: bool, streams: tuple[int, int] = (), results=None) -> None:
    gc.freeze()  # what the fork server imported lives as long as the worker: keep it out of collections
    for target, fd in enumerate(streams, start=1):
        if fd != target:  # spawn passes the descriptor under its own number
            os.dup2(fd, target)
            os.close(fd)
    torch.set_num_threads(1)  # nproc workers share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    status = RankStatus(Path(folder) / f"status-{rank}.txt")
    status.note("joining the process group")
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=nproc,
                            timeout=timedelta(seconds=timeout_s))
    status.note("started")
    try:
        result = fn(rank, *args, status=status) if with_status else fn(rank, *args)
    except Exception as exc:  # noqa: BLE001 -- any failure: recorded for the parent, then exit 1
        write_atomic(Path(folder) / f"error-{rank}.txt", f"{_kind(exc)}\n{exc}")
        if _kind(exc) == "other":  # a bug, not a named failure: keep the traceback on stderr
            traceback.print_exc()
        raise SystemExit(1) from None
    status.note("finished")
    status.close()
    if rank == 0 and result is not None and results is not None:
        results.send_bytes(pickle.dumps(result))  # plain bytes: torch's shared-memory tensors would die with this process
    if results is not None:
        results.close()
    del result
    end_process_group()


def end_process_group() -> None:
    """Destroy the process groups once nothing of the run holds them any more.

    An FSDP2 model lives in reference cycles (its hooks and state point back at its modules),
    so it outlives the function that built it until the cyclic collector runs, holding the
    process groups of its DeviceMesh. Destroyed after the groups, or in whatever order the
    interpreter's exit picks, the gloo group aborted the process ('terminate called without an
    active exception', SIGABRT, on 2 of 9 runs of `verify --nproc 2 --tp 2 --zero 1`; its rank 1
    finishes first, while rank 0 still compares with the oracle). Collecting first frees the
    model while its groups are intact."""
    gc.collect()
    dist.destroy_process_group()


def _kind(exc: BaseException) -> str:
    return "root" if isinstance(exc, UserError | StepFailed) else "other"


@dataclass(frozen=True)
class Ended:
    """How one worker ended, once the group has stopped."""

    rank: int
    pid: int | None
    exitcode: int | None
    """0, a positive exit code, or minus the signal that ended it."""
    first: bool
    """The worker whose end stopped the group (the others were then stopped with SIGTERM)."""

    @property
    def stopped_by_launcher(self) -> bool:
        return not self.first and self.exitcode == -signal.SIGTERM

    def how(self) -> str:
        if self.exitcode is not None and self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            oom = " (the out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
            return f"rank {self.rank} (pid {self.pid}) was killed by {name}{oom}"
        return f"rank {self.rank} (pid {self.pid}) exited with code {self.exitcode} without a message"


def _failure_report(folder: Path, ended: list[Ended]) -> str:
    """One line: the ranks that died without a message first (signal, last action), then the
    failing ranks' messages, root causes first (ranks with the same message share it), then a
    rank still running when the group was stopped (a stopped or stuck rank), with its last action."""
    found = []
    for rank in range(len(ended)):
        path = folder / f"error-{rank}.txt"
        if path.exists():
            kind, _, message = path.read_text().partition("\n")
            lines = message.strip().splitlines() or ["?"]
            found.append((kind != "root", rank, lines[0] if kind == "root" else lines[-1]))
    silent = [e for e in ended if e.exitcode != 0 and not (folder / f"error-{e.rank}.txt").exists()]
    dead = [_with_last(folder, e.rank, e.how()) for e in sorted(silent, key=lambda e: not e.first)
            if not e.stopped_by_launcher]
    running = [_with_last(folder, e.rank, f"rank {e.rank} was still running") for e in silent
               if e.stopped_by_launcher and RankStatus.read(folder / f"status-{e.rank}.txt") not in (None, "finished")]
    found.sort()
    by_message: dict[str, list[int]] = {}
    for _, rank, message in found:
        by_message.setdefault(message, []).append(rank)
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
             for message, ranks in list(by_message.items())[:2]]
    more = f" (and {len(by_message) - 2} more messages)" if len(by_message) > 2 else ""
    shown = dead[:2] + parts + running[:1]
    if not shown:
        return f"a worker of {len(ended)} died without a message (killed, or out of memory)"
    return "; ".join(shown) + more


def _with_last(folder: Path, rank: int, text: str) -> str:
    last = RankStatus.read(folder / f"status-{rank}.txt")
    return text + (f", its last action: {last}" if last else "")
