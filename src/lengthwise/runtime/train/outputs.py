"""A training run's output folder: one writer at a time, a default name, and a metrics file
that never runs ahead of the checkpoints.

    folder = default_run_folder()                  # lengthwise-runs/run-20261124-024115
    with OutputLock(out):                          # a second `train` on `out` is a UserError
        trim_metrics("out/metrics.jsonl", step=40) # on resume: drop lines of steps after 40
        append_metrics("out/metrics.jsonl", [{"step": 41, ...}])

The lock is advisory (fcntl.flock on `out/.lock`, which names the holder's pid): the kernel
drops it when the holder dies, however it dies, so a killed run never leaves a stale lock.
Metrics lines are appended only after the checkpoint of their step (or the next one) is saved
and trimmed to the resumed step on resume, so a resumed run neither repeats nor loses a line.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Self

from lengthwise.errors import UserError
from lengthwise.paths import check_writable  # noqa: F401  (train's flags use it here)
from lengthwise.files import write_atomic
from lengthwise.runtime.train.config import TrainConfig

LOCK_NAME = ".lock"
RUNS_FOLDER = "lengthwise-runs"
"""Where `lengthwise train` without --out puts its run folders (in the working directory)."""
METRICS_NAME = "metrics.jsonl"
TOKENIZER_FOLDER = "tokenizer"


def default_run_folder(root: str | Path = RUNS_FOLDER, *, now: float | None = None) -> Path:
    """A new folder name under `root` for a run given no --out: run-YYYYmmdd-HHMMSS (a suffix
    -2, -3, ... when that exists). Not created here."""
    stamp = time.strftime("run-%Y%m%d-%H%M%S", time.localtime(now))
    folder, n = Path(root) / stamp, 1
    while folder.exists():
        n += 1
        folder = Path(root) / f"{stamp}-{n}"
    return folder


class OutputLock:
    """Holds an exclusive advisory lock on `out` for the `with` block."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self._fd: int | None = None
        self.created: Path | None = None
        """The outermost folder made for this run, removed if the run fails unused."""

    def __enter__(self) -> Self:
        try:
            self.created = _first_missing(self.out)
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"--out {self.out}: cannot write there ({exc.strerror}); give a writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(f"--out {self.out} is in use by another lengthwise train (pid {holder}); "
                            f"wait for it to finish or give another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._fd is None:
            return
        if exc_type is not None and self.created is not None and _unused(self.out):
            shutil.rmtree(self.created, ignore_errors=True)  # a failed start leaves nothing behind
        os.close(self._fd)  # closing drops the flock; the file stays (removing it would race)
        self._fd = None


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (None if `path` exists)."""
    path, missing = path.absolute(), None
    while not path.exists():
        path, missing = path.parent, path
    return missing


def _unused(out: Path) -> bool:
    """Holds nothing of value: no checkpoint and no metrics line (the lock, a copied tokenizer
    and an empty TensorBoard log may be there)."""
    for path in out.iterdir():
        if path.name == METRICS_NAME and path.stat().st_size == 0:
            continue
        if path.name not in (LOCK_NAME, TOKENIZER_FOLDER, "tensorboard") and not path.name.startswith("."):
            return False
    return True


def with_outputs(config: TrainConfig, *, out: str | None = None) -> TrainConfig:
    """A run without --out writes to `out`, by default a new folder under lengthwise-runs/
    (a --resume run too: its checkpoints go there, the resumed folder is left as it is); the metrics go to OUT/metrics.jsonl unless --metrics is given. Both paths
    are checked writable here, before anything runs, without creating anything."""
    changes = {}
    if config.out is None:
        changes["out"] = out or str(default_run_folder())
    folder = changes.get("out", config.out)
    if config.metrics is None and folder is not None:
        changes["metrics"] = str(Path(folder) / METRICS_NAME)
    config = dataclasses.replace(config, **changes)
    if config.out is not None:
        check_writable(Path(config.out) / LOCK_NAME, "--out")
    if config.metrics is not None:
        check_writable(config.metrics, "--metrics")
    return config


def owns_metrics(config: TrainConfig, *, resumed: bool) -> bool:
    """Whether the metrics file's lines past the start step are this run's own, left by a killed
    attempt: on resume, or when the file lives in the output folder. A fresh run appending to a
    file elsewhere keeps what the file held."""
    if config.metrics is None:
        return False
    return resumed or (config.out is not None and Path(config.metrics).parent == Path(config.out))


def trim_metrics(path: str | Path, step: int) -> int:
    """Keep the lines of steps <= `step` (a resume from that step); returns lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            number = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            dropped += 1  # a line cut short by a kill
            continue
        if number <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        write_atomic(path, "".join(f"{line}\n" for line in kept))
    return dropped


def append_metrics(path: str | Path, lines: Iterable[dict]) -> None:
    text = "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)
    if text:
        with Path(path).open("a") as f:
            f.write(text)


DEBRIS_PREFIXES = (".tmp-step-", ".old-step-", ".tmp-tokenizer-")
"""Folders a save killed half-way leaves under the output folder."""


def remove_debris(out: str | Path) -> list[Path]:
    """Remove what killed saves left under `out`; returns it. Only while holding the lock."""
    out = Path(out)
    found = [p for p in out.iterdir() if p.is_dir() and p.name.startswith(DEBRIS_PREFIXES)] if out.is_dir() else []
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found



def save_tokenizer(tokenizer_dir: str | Path, out: str | Path) -> Path:
    """Copy the tokenizer's files to out/tokenizer (whole or not at all), so the run's output
    holds what its token ids mean; a copy already there is replaced."""
    source, final = Path(tokenizer_dir), Path(out) / TOKENIZER_FOLDER
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".tmp-{TOKENIZER_FOLDER}-"))
    try:
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            target = tmp / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
