"""Output paths checked before any work starts: a run that could not write its result should
fail in its first second, not after an hour (one line, exit 2)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from lengthwise.errors import UserError


FOLDER_FLAGS = ("--out", "--hf")
"""Flags that name a folder: the file probed inside it is not what the message names."""


def check_writable(path: str | Path, flag: str) -> None:
    """UserError now, before any training, if a file could not be created at `path`: a probe
    file is created and removed in the nearest existing folder above it (permission bits alone
    mislead root, and read-only file systems such as /proc)."""
    path = Path(path).absolute()
    shown = path.parent if flag in FOLDER_FLAGS else path
    if path.is_dir():  # the folder itself, not its parent, even for --out
        raise UserError(f"{flag} {path} is a folder; give a file path")
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
        if path.exists():
            with path.open("a"):
                pass
    except OSError as exc:
        raise UserError(f"{flag} {shown}: cannot write there ({exc.strerror or exc}); give a writable path") from None
