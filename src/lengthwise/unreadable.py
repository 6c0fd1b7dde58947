"""Readers of files a user hands over refuse what they cannot read in one line.

    with refuse_unreadable(path, "lengthwise checkpoint"):
        tensors = load_file(path / "optimizer.safetensors")
        state = json.loads((path / "optimizer.json").read_text())

A checkpoint folder's manifest proves its files are the ones written with it, not that they
are well formed: whoever rewrites a file can rewrite MANIFEST.json to match ("resealing"). So
the reads themselves must fail cleanly: a safetensors header that does not parse, bytes that
are not UTF-8, JSON of the wrong shape (a missing key, a list for a mapping), a tensor that is
not where the JSON says. Inside this block each of those becomes one UserError naming the file
set and the cause, never a traceback. Programmer errors outside a read are not caught here.
Imports no PyTorch or safetensors: their errors are recognised by type name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lengthwise.errors import UserError

READ_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError, RuntimeError)
"""What a malformed file raises on its way in: decoding (UnicodeDecodeError and JSONDecodeError are
ValueErrors), wrong JSON shapes (KeyError, TypeError, AttributeError, IndexError), a short file
(EOFError, OSError), and torch's own checks when a state dict is applied (RuntimeError)."""

FOREIGN_ERRORS = ("SafetensorError",)
"""Error types of libraries that may be absent on the planning side, matched by name."""


@contextmanager
def refuse_unreadable(path: str | Path, what: str) -> Iterator[None]:
    """Turn a read error inside the block into UserError('PATH is not a readable WHAT (cause)');
    a UserError raised inside passes through unchanged."""
    try:
        yield
    except UserError:
        raise
    except READ_ERRORS as exc:
        raise _refusal(path, what, exc) from None
    except Exception as exc:
        if type(exc).__name__ not in FOREIGN_ERRORS:
            raise
        raise _refusal(path, what, exc) from None


def _refusal(path: str | Path, what: str, exc: BaseException) -> UserError:
    cause = " ".join(str(exc).split())[:160] or type(exc).__name__
    return UserError(f"{path} is not a readable {what} ({type(exc).__name__}: {cause}); "
                     "it is damaged or was not written by lengthwise: use another one")
