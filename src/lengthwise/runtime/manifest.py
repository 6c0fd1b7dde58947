"""A checkpoint's manifest: the sha256 digest of every file in its folder, written last.

    write_manifest(folder, meta={"kind": "single", "step": 40})   # after every other file
    meta = verify_manifest(folder)            # DamagedCheckpoint naming the first problem
    folder, meta = newest_intact(out, notify=print)  # the newest good step folder, or None

`MANIFEST.json` is the checkpoint's completion mark: a folder without one was never finished
(the writer died, or a rewrite of the step began), and a folder whose files differ from it in
size or digest, miss one of them or hold one it does not list, is damaged. Both are refused
before any of its files is read, so nothing deserialises a truncated or altered file. The
check works on any layout (Hugging Face weights, sharded safetensors and their JSON
indexes, per-rank JSON), since it only lists and hashes the folder's files.

What the manifest does not do: make a checkpoint from somewhere else trustworthy. Whoever
writes the files can write a matching manifest; it detects damage (disk, a killed or concurrent
writer, a hand edit), not malice: what keeps a crafted checkpoint from running code is that its
readers parse only JSON and safetensors (an earlier version's pickled torch.distributed.checkpoint
files load only with --allow-pickle-checkpoint, `distributed/legacy_dcp.py`).

Writes are durable in order: every listed file is fsynced while it is hashed, then the manifest
is written to a temporary name, fsynced, renamed into place, and the folder fsynced, so after a
crash a manifest never names contents that did not reach the disk.

Cost: hashing reads every file once (sha256 runs at roughly 0.5-2 GB/s on one core; up to
MAX_HASHERS files are hashed side by side); a resume
hashes the checkpoint it picks twice, once to choose it and once right before loading it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lengthwise.errors import UserError
from lengthwise.files import fsync_dir, write_atomic

MANIFEST = "MANIFEST.json"
FORMAT = "lengthwise-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")
_BLOCK = 1 << 20
MAX_HASHERS = 8
"""Files hashed at once."""


class DamagedCheckpoint(UserError):
    """A checkpoint folder that is incomplete or whose files differ from its manifest."""


def list_files(folder: Path) -> list[str]:
    """Every file under `folder` but the manifest, as sorted POSIX paths relative to it."""
    found = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()]
    return sorted(name for name in found if name != MANIFEST)


def file_digest(path: Path, *, sync: bool = False) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file; `sync` also fsyncs it (the writer's side)."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
        if sync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def write_manifest(folder: str | Path, *, meta: dict) -> Path:
    """Hash (and fsync) every file of `folder`, then write MANIFEST.json with `meta`
    (JSON-able: what kind of checkpoint, its step, ...). Call it after the last other file."""
    folder = Path(folder)
    names = list_files(folder)
    with _hashers(len(names)) as pool:
        digests = pool.map(lambda name: file_digest(folder / name, sync=True), names)
        files = {name: {"bytes": size, "sha256": digest} for name, (size, digest) in zip(names, digests)}
    body = {"format": FORMAT, "version": VERSION, **meta, "files": files}
    path = folder / MANIFEST
    write_atomic(path, json.dumps(body, indent=1), durable=True)
    return path


def remove_manifest(folder: str | Path) -> None:
    """Unmark a checkpoint as complete (durably) before its files are rewritten or removed."""
    path = Path(folder) / MANIFEST
    if path.exists():
        path.unlink()
        fsync_dir(path.parent)


def verify_manifest(folder: str | Path) -> dict:
    """Check every file of `folder` against its manifest; returns the manifest's meta (all
    keys but `files`). DamagedCheckpoint (one line, naming the folder and the first problem)
    when it is incomplete or damaged."""
    folder = Path(folder)
    problem, body = _problem(folder)
    if problem is not None:
        raise DamagedCheckpoint(f"checkpoint {folder} {problem}")
    return {k: v for k, v in body.items() if k != "files"}


def _problem(folder: Path) -> tuple[str | None, dict]:
    if not folder.is_dir():
        return "is not a directory", {}
    path = folder / MANIFEST
    if not path.is_file():
        return (f"is incomplete: it has no {MANIFEST} (a save that did not finish, a checkpoint "
                f"of an older lengthwise, or not a checkpoint folder)"), {}
    body, problem = _read_manifest(path)
    if problem is not None:
        return problem, {}
    listed = body["files"]
    for name in list_files(folder):
        if name not in listed:
            return f"is damaged: it holds {name}, which its {MANIFEST} does not list", body
    with _hashers(len(listed)) as pool:
        problems = pool.map(lambda item: _file_problem(folder, *item), listed.items())
        for name, problem in zip(listed, problems):
            if problem is not None:
                return f"is damaged: {name} {problem}", body
    return None, body


def _hashers(num_files: int) -> ThreadPoolExecutor:
    """Threads to hash files side by side (hashlib and file reads release the GIL): a
    distributed checkpoint has a shard per rank."""
    return ThreadPoolExecutor(max_workers=max(1, min(num_files, os.cpu_count() or 1, MAX_HASHERS)),
                              thread_name_prefix="lengthwise-sha256")


def _read_manifest(path: Path) -> tuple[dict, str | None]:
    try:
        body = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError) as exc:
        return {}, f"is damaged: its {MANIFEST} is not JSON ({exc})"
    if not (isinstance(body, dict) and body.get("format") == FORMAT and isinstance(body.get("files"), dict)):
        return {}, f"is damaged: its {MANIFEST} is not a {FORMAT} manifest"
    if body.get("version") != VERSION:
        return {}, f"has manifest version {body.get('version')!r}; this lengthwise reads version {VERSION}"
    for name, entry in body["files"].items():
        if not (_plain_name(name) and isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            return {}, f"is damaged: its {MANIFEST} has a malformed entry {name!r}"
    return body, None


def _plain_name(name: str) -> bool:
    """A relative path inside the folder (no absolute path, no `..`)."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def _file_problem(folder: Path, name: str, entry: dict) -> str | None:
    path = folder / name
    if not path.exists() and not path.is_symlink():
        return "is missing"
    if path.is_symlink() or not path.is_file():  # a link or a FIFO could point anywhere, or never end
        return "is not a regular file"
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"has {size} bytes, its manifest says {entry['bytes']}"
        if file_digest(path)[1] != entry["sha256"]:
            return "differs from its manifest (sha256)"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None


def step_folders(out: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-NNNNNN` folder under `out`, newest first."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def newest_intact(out: str | Path, *, notify: Callable[[str], None] | None = None) -> tuple[Path, dict] | None:
    """The newest step folder under `out` that passes `verify_manifest`, with its meta; each
    newer one that does not is named through notify(line). None when there is none; a
    DamagedCheckpoint when every one with a manifest is damaged (starting afresh would then
    hide the loss of the run; incomplete ones alone are what a run killed in its first save
    leaves, and are skipped)."""
    damaged, skipped = [], False
    for _, folder in step_folders(out):
        try:
            meta = verify_manifest(folder)
        except DamagedCheckpoint as exc:
            if (folder / MANIFEST).exists():
                damaged.append(str(exc))
            if notify is not None:
                notify(f"{exc}; skipping it")
            skipped = True
            continue
        if notify is not None and skipped:
            notify(f"resuming from {folder}, the newest intact checkpoint")
        return folder, meta
    if damaged:
        raise DamagedCheckpoint(f"no intact checkpoint under {out}: {damaged[0]}; move the damaged step "
                                f"folders away (or use another --out) to start afresh")
    return None
