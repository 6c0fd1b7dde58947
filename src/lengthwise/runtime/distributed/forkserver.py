"""The fork server local workers are started from (`launch.spawn`), and starting it early.

Imports no torch: a command that will start local workers calls `start_fork_server()` before it
imports torch itself, so the server imports torch (`PRELOAD`, seconds of CPU) on another core
while the command does; `spawn` later finds it running. Without an early start the server
starts at the first `spawn`, which then waits for its imports.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

PRELOAD = ["numpy", "scipy.optimize", "torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch._dynamo"]
"""What the fork server imports once, before it forks any worker: third-party libraries only.
This package is imported by each worker from the caller's `sys.path` (the server's could differ,
and a worker must run the caller's code)."""


ORACLE = ["transformers", "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2"]
"""The transformers models the verification oracle builds (`runtime/verify.build_hf_twin`),
imported by the server too when the workers will compare with them: rank 0 would otherwise
import them (a second or two) while the other ranks wait. Missing ones are skipped."""


def available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def start_fork_server(*, oracle: bool = False) -> None:
    """Start the server (it begins importing PRELOAD, and ORACLE with `oracle`, at once) unless
    it runs already; nothing where the platform has no fork server. Later starts of workers
    reuse it."""
    if available():
        multiprocessing.set_forkserver_preload(PRELOAD + (ORACLE if oracle else []))  # when the server first starts
        multiprocessing.forkserver.ensure_running()
