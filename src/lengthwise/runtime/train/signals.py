"""Stopping a training run on Ctrl-C (SIGINT) or a scheduler's SIGTERM without losing work.

    with StopRequest() as stop:                    # installs the handlers, restores them after
        while training:
            run_one_step()
            if executor.agree_stop(stop.requested):  # between steps; collective when distributed
                save_checkpoint_and_leave()

A signal handler that raises (Python's default KeyboardInterrupt) can fire anywhere: inside a
finaliser such as the memory meter's `_Held.__del__`, where Python prints and drops it, or
half-way through an optimizer update. Here the first signal only sets a flag; the loop reads it
between steps, so the step in flight finishes, a checkpoint is written and the run leaves with
exit code 130. A second signal of the same kind leaves at once (exit 130, no checkpoint).

Signals are counted per kind because one Ctrl-C may arrive twice over, as two kinds: the
terminal sends SIGINT to every process of the foreground group, `lengthwise train --nproc`'s
workers included, and their parent forwards SIGTERM as well (a scheduler's SIGTERM reaches the
parent alone). Two Ctrl-C presses are two SIGINTs; a SIGTERM followed by another is two
SIGTERMs. torchrun starts its workers in sessions of their own and passes the signal it got on
to them, once; it then waits 30 s before killing them (torch.distributed.elastic's agent), which
bounds the step and checkpoint a stopping run can still finish under torchrun.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from typing import Self

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 130
"""Exit code of an interrupted run (128 + SIGINT, the shell's convention)."""


class StopRequest:
    """Turns the first SIGINT / SIGTERM into a flag; a second one of the same kind exits now.

    Only the main thread may install handlers; elsewhere (a test's worker thread) the flag
    can still be set with `request()`."""

    def __init__(self, *, forward_to_children: bool = False, quiet: bool = False):
        self.forward_to_children = forward_to_children
        """Pass each signal on to this process's multiprocessing children as SIGTERM (the
        parent of `--nproc` workers, which a scheduler's SIGTERM reaches alone)."""
        self.quiet = quiet
        """Print nothing (ranks other than 0)."""
        self.signum: int | None = None
        """The first signal received, if any."""
        self._counts: dict[int, int] = {}
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """Whether this process was asked to stop."""
        return self.signum is not None

    def request(self, signum: int = signal.SIGINT) -> None:
        """Ask to stop, as the first signal does."""
        if self.signum is None:
            self.signum = signum

    def _handle(self, signum: int, frame) -> None:
        self._counts[signum] = self._counts.get(signum, 0) + 1
        if self.forward_to_children:
            for child in multiprocessing.active_children():
                _signal_quietly(child.pid, signal.SIGTERM)
        if self._counts[signum] > 1:
            self._say(f"lengthwise train: second {signal.Signals(signum).name}: leaving now, without a checkpoint")
            os._exit(EXIT_INTERRUPTED)  # at once: no finalisers, no waiting for the step
        if self.signum is None:
            self._say(f"lengthwise train: {signal.Signals(signum).name}: finishing this step, then saving a "
                      f"checkpoint (send it again to leave at once)")
        self.request(signum)

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(f"\n{line}", file=sys.stderr, flush=True)


def _signal_quietly(pid: int | None, signum: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # the child has just exited
        pass
