"""Real documents and their token ids: JSONL, Parquet, folders of text, or the Python stdlib.

    corpus = load_corpus("stdlib")                 # ~870 .py files, no download, byte tokens
    corpus = load_corpus("data/chat.jsonl", text_field="content")
    corpus = load_corpus("data/", tokenizer_dir="models/qwen2.5-0.5b")  # a local HF tokenizer
    corpus.lengths[i] == len(corpus.documents[i])

Without a tokenizer directory the ByteTokenizer is used: a document's ids are BOS, its UTF-8
bytes (0..255), EOS, so vocab 260 matches the `tiny` model preset and a document of n bytes is a
sequence of n + 2 tokens. Documents are kept as text and tokenized when indexed (byte
tokenization is a copy), so the stdlib corpus costs about 13 MB, not 4 bytes per token.
Empty or whitespace-only documents are skipped: they hold nothing to learn.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lengthwise.errors import UserError
from lengthwise.workloads.token_cache import cache_key, file_identity, open_or_build, tokenizer_identity

TEXT_SUFFIXES = (".txt", ".md", ".py")
"""Files a folder corpus reads, one document each."""


@dataclass(frozen=True, kw_only=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus four special ids; vocab_size 260."""

    bos_id: int = 256
    """Begins every document."""
    eos_id: int = 257
    """Ends every document."""
    pad_id: int = 258
    """Fills unused positions of a padded row; never in a document."""
    unk_id: int = 259
    """Reserved; bytes cover every input so it is never produced."""
    vocab_size: int = 260
    """Number of ids (the `tiny` model preset's vocab)."""

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.empty(len(data) + 2, dtype=np.int64)
        ids[0], ids[-1] = self.bos_id, self.eos_id
        ids[1:-1] = np.frombuffer(data, dtype=np.uint8)
        return ids

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if int(i) < 256)
        return data.decode("utf-8", errors="replace")


class _ByteDocuments(Sequence):
    """Documents held as bytes, tokenized by ByteTokenizer when indexed."""

    def __init__(self, texts: list[bytes], tokenizer: ByteTokenizer):
        self._texts, self._tokenizer = texts, tokenizer

    def __len__(self) -> int:
        return len(self._texts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._tokenizer.encode(self._texts[i])


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """Documents as token id arrays, in a deterministic order."""

    name: str
    """Where the documents came from (the spec given to load_corpus)."""
    documents: Sequence
    """documents[i] is a 1-D int64 array of token ids (tokenized on access where lazy)."""
    lengths: np.ndarray
    """lengths[i] == len(documents[i]) (tokens), int64."""
    vocab_size: int
    """Size of the tokenizer's vocabulary (ids are below it)."""


def load_corpus(spec: str, tokenizer_dir: str | None = None, *, text_field: str = "text",
                cache_dir: str | None = None) -> Corpus:
    """Documents from `spec`: "stdlib", a .jsonl/.parquet file, a text file, a folder, or a
    Hugging Face `datasets` folder (save_to_disk). With a tokenizer and `cache_dir`, the ids
    come from the token cache (token_cache.py), tokenised only the first time."""
    hf_tokenizer = None if tokenizer_dir is None else load_hf_tokenizer(tokenizer_dir)
    if hf_tokenizer is not None and cache_dir is not None:
        return _cached_corpus(spec, tokenizer_dir, hf_tokenizer, text_field, cache_dir)
    texts = _nonempty_texts(spec, text_field)
    if hf_tokenizer is not None:
        return _hf_corpus(spec, texts, hf_tokenizer)
    tokenizer = ByteTokenizer()
    lengths = np.array([len(t) + 2 for t in texts], dtype=np.int64)  # BOS + bytes + EOS
    return Corpus(name=spec, documents=_ByteDocuments(texts, tokenizer), lengths=lengths,
                  vocab_size=tokenizer.vocab_size)


def _nonempty_texts(spec: str, text_field: str) -> list[bytes]:
    texts = [t for t in _read_texts(spec, text_field) if t.strip()]
    if not texts:
        raise UserError(f"--data {spec} holds no non-empty documents")
    return texts


def _cached_corpus(spec: str, tokenizer_dir: str, tokenizer, text_field: str, cache_dir: str) -> Corpus:
    key = cache_key({"data": spec, "files": file_identity(input_files(spec)), "text_field": text_field,
                     "tokenizer": tokenizer_identity(tokenizer_dir)})
    build = lambda: (_hf_ids(text, tokenizer) for text in _nonempty_texts(spec, text_field))  # noqa: E731
    documents, lengths, vocab = open_or_build(cache_dir, key, build=build, vocab_size=len(tokenizer))
    return Corpus(name=spec, documents=documents, lengths=lengths, vocab_size=vocab)


def input_files(spec: str) -> list[Path]:
    """The files `spec`'s documents are read from (what the token cache's key covers)."""
    if spec == "stdlib":
        return stdlib_files()
    path = Path(spec)
    if is_hf_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_dir():
        return _folder_files(path)
    return [path] if path.is_file() else []


def _read_texts(spec: str, text_field: str) -> list[bytes]:
    if spec == "stdlib":
        return [p.read_bytes() for p in stdlib_files()]
    path = Path(spec)
    if is_hf_dataset(path):
        return _read_hf_dataset(path, text_field)
    if path.is_dir():
        return _text_files(spec, _folder_files(path))
    if not path.is_file():
        raise UserError(f"--data {spec} is neither 'stdlib', a file nor a folder")
    if path.suffix == ".jsonl":
        return _read_jsonl(path, text_field)
    if path.suffix == ".parquet":
        return _read_parquet(path, text_field)
    if path.suffix in TEXT_SUFFIXES:
        return _text_files(spec, [path])
    raise UserError(f"--data {spec}: unknown file type {path.suffix!r}; use .jsonl, .parquet, "
                    f"{', '.join(TEXT_SUFFIXES)} or a folder")


def stdlib_files() -> list[Path]:
    """The Python standard library's own .py sources, sorted by relative path; test suites and
    site-packages are left out (test data holds deliberately broken encodings)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for folder, subfolders, names in os.walk(root):  # pruned: site-packages alone can hold 10^5 files
        subfolders[:] = [s for s in subfolders if s not in skip]
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _folder_files(folder: Path) -> list[Path]:
    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _text_files(spec: str, files: list[Path]) -> list[bytes]:
    """The files' bytes. Files that are not UTF-8 (binary data, another encoding) would train
    the byte model on noise without a word: all of them is an error, some of them a notice."""
    texts = [p.read_bytes() for p in files]
    binary = [p for p, data in zip(files, texts) if not _is_utf8(data)]
    if binary and len(binary) == len(files):
        raise UserError(f"--data {spec}: none of its {len(files)} file(s) is UTF-8 text (first: {binary[0]}); "
                        "give text documents")
    if binary:
        print(f"lengthwise: notice: --data {spec}: {len(binary)} of {len(files)} files are not UTF-8 text "
              f"(first: {binary[0]}); they are read as raw bytes", file=sys.stderr)
    return texts


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _read_jsonl(path: Path, text_field: str) -> list[bytes]:
    texts = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}:{number}: not UTF-8 text (byte {exc.start} of the line); "
                                "JSON Lines files are UTF-8") from None
            if line.strip():
                texts.append(_jsonl_text(line, path, number, text_field).encode("utf-8"))
    return texts


def _jsonl_text(line: str, path: Path, number: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise UserError(f"{path}:{number}: no string field {text_field!r}; "
                        f"pass --text-field NAME for the field holding the text")
    return record[text_field]


def _read_parquet(path: Path, text_field: str) -> list[bytes]:
    try:
        import pyarrow.parquet as pq  # optional: only Parquet corpora need it
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow; pip install pyarrow") from None
    schema = pq.read_schema(path)
    if text_field not in schema.names:
        raise UserError(f"{path} has no column {text_field!r} (columns: "
                        f"{', '.join(schema.names)}); pass --text-field NAME")
    column = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    return [(t or "").encode("utf-8") for t in column]


def _hf_corpus(spec: str, texts: list[bytes], tokenizer) -> Corpus:
    documents = [_hf_ids(text, tokenizer) for text in texts]
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    return Corpus(name=spec, documents=documents, lengths=lengths, vocab_size=len(tokenizer))


def _hf_ids(text: bytes, tokenizer) -> np.ndarray:
    ids = tokenizer(text.decode("utf-8", errors="replace"), verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids = ids + [eos]  # documents end with EOS, as with the byte tokenizer
    return np.array(ids, dtype=np.int64)


HF_DATASET_MARKS = ("dataset_dict.json", "state.json")
"""Files `datasets.Dataset(Dict).save_to_disk` writes at the top of its folder."""


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / mark).is_file() for mark in HF_DATASET_MARKS)


def _read_hf_dataset(path: Path, text_field: str) -> list[bytes]:
    """The text column of a save_to_disk folder (a DatasetDict: its train split)."""
    try:
        import datasets  # optional: only Hugging Face dataset folders need it
    except ImportError:
        raise UserError(f"--data {path} is a Hugging Face datasets folder; reading it needs the datasets "
                        f"package (pip install datasets)") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise UserError(f"--data {path} has splits {', '.join(data)} and no 'train'; save the split to "
                            f"train on by itself")
        data = data["train"]
    if text_field not in data.column_names:
        raise UserError(f"{path} has no column {text_field!r} (columns: {', '.join(data.column_names)}); "
                        f"pass --text-field NAME")
    return [(t or "").encode("utf-8") for t in data[text_field]]


def load_hf_tokenizer(tokenizer_dir: str):
    """A Hugging Face tokenizer from a local directory (never downloads)."""
    if not Path(tokenizer_dir).is_dir():
        raise UserError(f"--tokenizer {tokenizer_dir} is not a directory; give a local folder "
                        f"holding tokenizer.json / tokenizer_config.json")
    from transformers import AutoTokenizer  # lazy: planning must not load transformers' torch
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        why = " ".join(str(exc).split())  # transformers' messages span lines; ours is one
        raise UserError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer ({why})") from None
