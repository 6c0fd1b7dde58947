"""Reading and writing the project's files: strict JSON in and out, and the one atomic writer.

    data = read_json(path, "plan", StepPlan.from_dict)   # a one-line UserError for any bad file
    write_atomic(path, json_text(data))                   # readers see the old file or the new
    write_atomic(path, blocks, durable=True)              # streamed, then the folder fsynced too

Every file lengthwise writes goes through `write_atomic`: a temporary file beside the target,
flushed and fsynced, given the usual permissions, renamed over the target. `durable=True` also
fsyncs the folder, so the rename itself survives a power cut (checkpoints need that: their
manifest is written last and must never name a file the disk lost). The content may be text,
bytes, an iterable of byte blocks (a large file streamed one piece at a time, e.g. one tensor's
host copy at a time) or a callable that writes into the open binary file (numpy's `save`).

Torch-free and at the bottom floor: the plan type, the cost model's profile reader, the
simulator's pictures and the runtime's checkpoints all use it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from lengthwise.errors import UserError

Content = str | bytes | Iterable[bytes | memoryview] | Callable[[BinaryIO], object]


def read_json(path: str | Path, what: str, parse):
    """`parse(dict)` of a JSON file; a missing, unreadable or malformed file (not UTF-8, not
    JSON, NaN or Infinity in it, a field of the wrong type) is a one-line UserError."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"), parse_constant=_reject_constant)
        return parse(data)
    except FileNotFoundError:
        raise UserError(f"no {what} file at {path}") from None
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not a lengthwise {what}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise UserError(f"{path} is not a readable lengthwise {what} ({str(exc)[:200]})") from None


def _reject_constant(name: str):
    raise UserError(f"{name} is not a number a lengthwise file may hold: write a finite value")


def json_text(data, *, indent: int | None = 1) -> str:
    """JSON for output: strict (a non-finite float is a one-line UserError naming where it is,
    never a bare NaN that no JSON reader accepts)."""
    try:
        return json.dumps(data, indent=indent, allow_nan=False)
    except ValueError:
        raise UserError(f"result holds a non-finite number at {_first_non_finite(data) or '?'}; "
                        "this is a bug in lengthwise, please report the command") from None


def _first_non_finite(data, path: str = "") -> str | None:
    if isinstance(data, float) and not math.isfinite(data):
        return path or "top level"
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, (list, tuple)) else ()
    for key, value in items:
        found = _first_non_finite(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def write_atomic(path: str | Path, content: Content, *, durable: bool = False) -> None:
    """Write a file so that a reader sees the old content or the new, never half of it: a
    temporary file beside it, flushed to disk, given the usual permissions (0666 less the
    umask; mkstemp makes 0600), then renamed over the target; with `durable` the folder is
    fsynced after the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            _fill(f, content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def _fill(f: BinaryIO, content: Content) -> None:
    if isinstance(content, str):
        f.write(content.encode())
    elif isinstance(content, (bytes, bytearray, memoryview)):
        f.write(content)
    elif callable(content):
        content(f)
    else:
        for block in content:
            f.write(block)


def fsync_dir(folder: str | Path) -> None:
    """Make renames and removals inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
