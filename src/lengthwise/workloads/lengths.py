"""Lengths files, the overlong policy, and the statistics `lengthwise workload` prints.

A lengths file holds one integer per line, 1 to 2^40 (blank lines and `#` comments are skipped),
or a 1-D integer `.npy` array. The statistics weigh each sequence three ways: by count, by
tokens (activation memory and linear FLOPs grow with L) and by attention work (grows with L²,
so a 128K sequence costs as much attention as 16,384 sequences of 1K).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from lengthwise.errors import UserError
from lengthwise.fields import MAX_LENGTH

THRESHOLDS = (1024, 4096, 8192, 32768, 131072)
"""Lengths (tokens) at which the papers' tables report shares: 1K, 4K, 8K, 32K, 128K."""

OVERLONG_POLICIES = ("error", "truncate", "drop")


def read_lengths(path: str | Path) -> np.ndarray:
    """Sequence lengths (int64) from a text file (one integer a line) or a `.npy` array."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"lengths file {path} is a folder; give a file of lengths (one integer a line, or .npy)")
    if not path.is_file():
        raise UserError(f"lengths file {path} does not exist")
    if path.suffix == ".npy":
        return _check_positive(_read_npy(path), path, first_line=None)
    return _read_text(path)


def _read_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise UserError(f"{path} is not a readable .npy array ({str(exc)[:200]})") from None
    if not isinstance(array, np.ndarray) or array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise UserError(f"{path} holds a {getattr(array, 'ndim', '?')}-D {getattr(array, 'dtype', '?')} array; "
                        f"a lengths file needs a 1-D integer array")
    if array.size and (array.max() > MAX_LENGTH):
        i = int(np.argmax(array > MAX_LENGTH))
        raise UserError(f"{path}[{i}]: length {int(array[i])} is over {MAX_LENGTH} (2^40) tokens")
    return array.astype(np.int64)


def _read_text(path: Path) -> np.ndarray:
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start}); a lengths file holds one integer a line") from None
    except OSError as exc:
        raise UserError(f"cannot read lengths file {path}: {exc.strerror or exc}") from None
    values, line_numbers = [], []
    for number, line in enumerate(content.splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not re.fullmatch(r"[+-]?[0-9]{1,20}", text):
            raise UserError(f"{path}:{number}: {text[:40]!r} is not an integer length")
        value = int(text)
        if value > MAX_LENGTH:
            raise UserError(f"{path}:{number}: length {value} is over {MAX_LENGTH} (2^40) tokens")
        values.append(value)
        line_numbers.append(number)
    if not values:
        raise UserError(f"{path} holds no lengths; write one integer per line")
    return _check_positive(np.array(values, dtype=np.int64), path, first_line=line_numbers)


def _check_positive(lengths: np.ndarray, path: Path, first_line: list[int] | None) -> np.ndarray:
    if lengths.size == 0:
        raise UserError(f"{path} holds no lengths")
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        i = int(bad[0])
        where = f"{path}:{first_line[i]}" if first_line else f"{path}[{i}]"
        raise UserError(f"{where}: length {int(lengths[i])} is not positive "
                        f"({bad.size} such entries); every sequence needs at least one token")
    return lengths


def overlong_keep(lengths: np.ndarray, context_length: int | None, policy: str) -> np.ndarray:
    """Indices of the sequences that survive `policy` (all of them unless policy is drop)."""
    lengths = np.asarray(lengths)
    if context_length is None or policy != "drop":
        return np.arange(lengths.size)
    return np.flatnonzero(lengths <= context_length)


def apply_overlong(lengths, context_length: int | None, policy: str = "error") -> np.ndarray:
    """Lengths after handling sequences longer than `context_length` tokens.

    error: a UserError naming the first such sequence; truncate: cut to the context length
    (the tail tokens are lost); drop: exclude them, as chunkflow §6.1 does for its 32K/256K runs.
    """
    assert policy in OVERLONG_POLICIES, policy
    lengths = np.asarray(lengths, dtype=np.int64)
    if context_length is None:
        return lengths
    if context_length < 1:
        raise UserError(f"--context-length {context_length} must be at least 1 token")
    over = np.flatnonzero(lengths > context_length)
    if over.size == 0:
        return lengths
    if policy == "error":
        i = int(over[0])
        raise UserError(f"sequence {i} has {int(lengths[i])} tokens > context length "
                        f"{context_length} ({over.size} such sequences); raise --context-length "
                        f"or pass --overlong truncate|drop")
    if policy == "truncate":
        return np.minimum(lengths, context_length)
    return lengths[lengths <= context_length]


def length_stats(lengths) -> dict:
    """Count, mean, percentiles and the share of sequences, tokens and attention FLOPs (~L²)
    under each threshold in THRESHOLDS (keys are the threshold as a string)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    assert lengths.size > 0
    as_float = lengths.astype(np.float64)
    return {
        "count": int(lengths.size),
        "mean": float(as_float.mean()),
        "percentiles": {f"p{q}": float(np.percentile(as_float, q)) for q in (50, 90, 99)}
                       | {"max": int(lengths.max()), "min": int(lengths.min())},
        "share_below": _shares(as_float, np.ones_like(as_float)),
        "token_share_below": _shares(as_float, as_float),
        "attention_share_below": _shares(as_float, as_float * as_float),
    }


def _shares(lengths: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    total = weights.sum()  # divide after summing so that "all below" is exactly 1.0
    return {str(t): float(weights[lengths < t].sum() / total) for t in THRESHOLDS}
