"""Session set-up shared by the test files.

The fork server that local workers are started from (`runtime/distributed/forkserver.py`)
imports torch and its distributed packages once, seconds of CPU. Started by the first test that
starts workers, it makes that test wait for the imports; started once collection is done, it
imports on the other core while the first tests run. It imports transformers' models too: the
distributed verification tests compare with them on rank 0 (`forkserver.ORACLE`). Only when the
collected tests imported torch: a run of the planning tests alone starts no server.

What collection imported (torch, transformers, the test modules: some 10^6 objects) lives to the
end of the session: it is frozen out of the cyclic collector, whose full collections during the
tests would otherwise walk all of it (a few tenths of a second each).

The server starts under pytest's capture, as it did inside the first such test: its output and that of
multiprocessing's resource tracker (which names the semaphores of workers a test killed when
the session ends) go to the capture, not the terminal.

The README's test command runs the files on two workers (pytest-xdist, `-n 2 --dist loadfile`:
a file's tests stay on one worker, so its worker pools and module fixtures start once). A worker
takes the next file when it is done with one, in collection order, so the files that start
many processes come first (`SLOW_FIRST`, the slowest files of a timed run): started last, one
of them would keep one core busy after the other has finished.

Training runs that more than one test file reads (`shared_runs.py`) are session fixtures here:
each runs once, in whichever file asks first.
"""

from __future__ import annotations

import gc
import sys

import pytest

from shared_runs import train_dp2


SLOW_FIRST = ("test_gpu_suite.py", "test_distributed_fault.py", "test_parallel_exec.py", "test_hetero_train.py",
              "test_train_interrupt.py", "test_train_parallel.py", "test_hetero_exec.py", "test_checkpoint_scale.py",
              "test_dryrun.py")
"""Test files by their wall time in a timed run, slowest first (ordering only: any file may be missing)."""


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order


def pytest_collection_finish(session) -> None:
    gc.freeze()
    if "torch" not in sys.modules:
        return
    from lengthwise.runtime.distributed.forkserver import start_fork_server

    capture = session.config.pluginmanager.getplugin("capturemanager")
    if capture is None or not capture.is_globally_capturing():
        start_fork_server(oracle=True)
        return
    capture.resume_global_capture()
    try:
        start_fork_server(oracle=True)
    finally:
        capture.suspend_global_capture()


@pytest.fixture(scope="session")
def dp2_run(tmp_path_factory):
    """`shared_runs.train_dp2`: one 2-process run that two test files read."""
    return train_dp2(tmp_path_factory.mktemp("dp2"))
