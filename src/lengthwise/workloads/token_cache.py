"""Tokenised corpora on disk: token ids in a memory-mapped file, built once, shared by runs and ranks.

    key = cache_key({"data": ..., "files": file_identity(paths), "tokenizer": tokenizer_identity(dir)})
    documents, lengths, vocab = open_or_build(cache_dir, key, build=lambda: token_arrays, vocab_size=V)

Tokenising a large corpus with a Hugging Face tokenizer takes minutes, and every rank of a
distributed run used to do it at start-up. Here the first process to need a corpus writes, under
`cache_dir`:

    KEY.bin            every document's ids end to end, uint32
    KEY.lengths.npy    each document's length (int64); offsets are its running sum
    KEY.json           vocab size, counts, format version: written last, it marks the entry complete

and every later process (another rank, a resumed run, `lengthwise workload`) maps KEY.bin and reads
only the lengths, which is all a planner needs; a document's ids are read when it is trained on.
Processes that start together take an advisory lock on KEY.lock (fcntl.flock): one builds, the
others wait and then map its files. Each file is written to a temporary name and renamed, so a
killed build leaves no entry that looks complete.

The key hashes what decides the ids: the data's files (path, size, modification time: cheap,
and any edit changes it), the tokenizer's files (their bytes), the text field and the format.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from lengthwise.errors import UserError
from lengthwise.files import write_atomic

FORMAT = 1
"""Version of the layout above; part of the key."""
ID_DTYPE = np.uint32


def file_identity(paths: Iterable[Path]) -> list[list]:
    """[path, size, mtime_ns] of each file: changes when any of them is edited, added or removed."""
    rows = []
    for path in paths:
        stat = path.stat()
        rows.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return rows


def tokenizer_identity(tokenizer_dir: str | Path) -> str:
    """sha256 over the names and bytes of the tokenizer folder's files."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(tokenizer_dir).rglob("*") if p.is_file()):
        digest.update(path.relative_to(tokenizer_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(parts: dict) -> str:
    text = json.dumps({**parts, "format": FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class MappedDocuments(Sequence):
    """documents[i]: document i's ids as an int64 array, read from the mapped file."""

    def __init__(self, ids: np.ndarray, lengths: np.ndarray):
        self._ids, self._offsets = ids, np.concatenate([[0], np.cumsum(lengths)])

    def __len__(self) -> int:
        return self._offsets.size - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._ids[self._offsets[i]:self._offsets[i + 1]].astype(np.int64)


def open_or_build(cache_dir: str | Path, key: str, *, build: Callable[[], Iterable[np.ndarray]],
                  vocab_size: int) -> tuple[MappedDocuments, np.ndarray, int]:
    """(documents, lengths, vocab_size) of entry `key`, building it from `build()`'s arrays first
    if no process has (module docstring)."""
    folder = Path(cache_dir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = os.open(folder / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"--token-cache {folder}: cannot write there ({exc.strerror}); give a writable folder") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait here, then read
        if not (folder / f"{key}.json").is_file():
            _build(folder, key, build(), vocab_size)
    finally:
        os.close(lock)
    return _open(folder, key)


def _build(folder: Path, key: str, arrays: Iterable[np.ndarray], vocab_size: int) -> None:
    if vocab_size > np.iinfo(ID_DTYPE).max:
        raise UserError(f"a vocabulary of {vocab_size} ids does not fit the token cache's {ID_DTYPE.__name__}")
    lengths = []

    def write_ids(f) -> None:
        for ids in arrays:
            f.write(np.asarray(ids, dtype=ID_DTYPE).tobytes())
            lengths.append(len(ids))

    write_atomic(folder / f"{key}.bin", write_ids)
    write_atomic(folder / f"{key}.lengths.npy", lambda f: np.save(f, np.array(lengths, dtype=np.int64)))
    meta = {"vocab_size": vocab_size, "documents": len(lengths), "tokens": int(sum(lengths)), "format": FORMAT}
    write_atomic(folder / f"{key}.json", json.dumps(meta))


def _open(folder: Path, key: str) -> tuple[MappedDocuments, np.ndarray, int]:
    """The entry's files, each checked against the others before use: any mismatch or unreadable
    file is one UserError naming the entry (delete it to rebuild), never a traceback mid-run."""
    damaged = UserError(f"token cache entry {folder / key}.* is damaged; delete those files to rebuild it")
    try:
        meta = json.loads((folder / f"{key}.json").read_bytes().decode("utf-8"))
        lengths = np.load(folder / f"{key}.lengths.npy", allow_pickle=False)
        bin_bytes = (folder / f"{key}.bin").stat().st_size
    except (OSError, ValueError, EOFError):  # JSON, UTF-8 and .npy errors are ValueErrors
        raise damaged from None
    if not _consistent(meta, lengths, bin_bytes):
        raise damaged
    ids = (np.memmap(folder / f"{key}.bin", dtype=ID_DTYPE, mode="r", shape=(meta["tokens"],))
           if meta["tokens"] else np.zeros(0, dtype=ID_DTYPE))
    return MappedDocuments(ids, lengths), lengths, int(meta["vocab_size"])


def _consistent(meta, lengths: np.ndarray, bin_bytes: int) -> bool:
    """The manifest, the lengths and the ids file agree: counts, sums and the file's size."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return False
    counts = [meta.get(k) for k in ("documents", "tokens", "vocab_size")]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return False
    if lengths.ndim != 1 or lengths.dtype != np.int64 or lengths.size != meta["documents"]:
        return False
    if lengths.size and lengths.min() < 0:
        return False
    return int(lengths.sum()) == meta["tokens"] and bin_bytes == meta["tokens"] * np.dtype(ID_DTYPE).itemsize
