"""Where a run's sequence lengths come from: a profile, a lengths file or a corpus.

A `LengthSource` is either infinite (a profile: every draw is fresh) or a finite population
(a lengths file or a corpus, after the overlong policy). Planners only need lengths; the
executor also needs token ids, which `tokens(seq_id)` gives for corpus sources.

Overlong policy on a profile: `drop` samples the profile conditioned on length <= context (the
papers' "exclude longer sequences"), `truncate` clips each draw, `error` refuses a profile whose
longest sequence exceeds the context -- decided from the profile, not from a lucky draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lengthwise.errors import UserError
from lengthwise.workloads.corpus import Corpus, load_corpus
from lengthwise.workloads.lengths import apply_overlong, overlong_keep, read_lengths
from lengthwise.workloads.profiles import LengthProfile, get_profile


@dataclass(frozen=True, kw_only=True)
class LengthSource:
    """Sequence lengths to sample global batches from."""

    name: str
    """What the user chose, e.g. "profile lmsys" or "data stdlib"."""
    profile: LengthProfile | None = None
    """The distribution for an infinite source; None for a finite one."""
    lengths: np.ndarray | None = None
    """Finite sources: each sequence's length (tokens) after the overlong policy."""
    seq_ids: np.ndarray | None = None
    """Finite sources: the index in the file/corpus of each entry of `lengths` (drop skips)."""
    corpus: Corpus | None = None
    """Corpus sources: the documents whose token ids `tokens()` returns."""
    context_length: int | None = None
    """Longest sequence allowed (tokens); None for no limit."""
    overlong: str = "error"
    """What happened to sequences over the context: error, truncate or drop."""
    overlong_count: int = 0
    """Finite sources: how many sequences were over the context length (dropped or cut)."""

    def overlong_note(self) -> str | None:
        """One line saying how many sequences the overlong policy dropped or cut, or None."""
        if not self.overlong_count:
            return None
        done = "dropped" if self.overlong == "drop" else "cut to the context length"
        total = self.overlong_count + (len(self.lengths) if self.overlong == "drop" else len(self.lengths) - self.overlong_count)
        return (f"{self.name}: {self.overlong_count:,} of {total:,} sequences are over --context-length "
                f"{self.context_length:,} and were {done} (--overlong {self.overlong})")

    @property
    def is_finite(self) -> bool:
        return self.profile is None

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` lengths drawn from a profile, after the overlong policy (infinite sources)."""
        assert self.profile is not None
        if self.context_length is None or self.overlong == "error":
            return self.profile.sample(n, rng)
        if self.overlong == "drop":
            return self.profile.sample(n, rng, below=self.context_length + 1)
        return np.minimum(self.profile.sample(n, rng), self.context_length)

    def describe_lengths(self, samples: int | None, seed: int) -> np.ndarray:
        """Lengths to summarise: `samples` draws (default 100,000) from a profile; a finite
        population whole, or `samples` of it drawn without replacement."""
        rng = np.random.default_rng(seed)
        if not self.is_finite:
            return self.draw(100_000 if samples is None else samples, rng)
        if samples is None or samples >= self.lengths.size:
            return self.lengths
        return self.lengths[rng.choice(self.lengths.size, size=samples, replace=False)]

    def tokens(self, seq_id: int) -> np.ndarray:
        """Token ids of sequence `seq_id` (a corpus index), cut to the context if truncating."""
        if self.corpus is None:
            raise UserError(f"{self.name} has lengths only; training needs --data PATH")
        ids = self.corpus.documents[seq_id]
        if self.context_length is None or len(ids) <= self.context_length:
            return ids
        return np.array(ids[: self.context_length])  # a copy: a view would keep the whole document alive


def profile_source(name: str, context_length: int | None = None,
                   overlong: str = "error") -> LengthSource:
    profile = get_profile(name)
    if context_length is not None and context_length < 1:
        raise UserError(f"--context-length {context_length} must be at least 1 token")
    if context_length is not None and overlong == "error" and profile.max_length > context_length:
        raise UserError(f"profile {name} reaches {profile.max_length} tokens > --context-length "
                        f"{context_length}; pass --overlong drop (exclude them, as the papers "
                        f"do) or --overlong truncate")
    return LengthSource(name=f"profile {name}", profile=profile, context_length=context_length,
                        overlong=overlong)


def lengths_file_source(path: str, context_length: int | None = None,
                        overlong: str = "error") -> LengthSource:
    return _finite(f"lengths {path}", read_lengths(path), None, context_length, overlong)


def corpus_source(spec: str, tokenizer_dir: str | None = None, context_length: int | None = None,
                  overlong: str = "error", text_field: str = "text", cache_dir: str | None = None) -> LengthSource:
    corpus = load_corpus(spec, tokenizer_dir, text_field=text_field, cache_dir=cache_dir)
    return _finite(f"data {spec}", corpus.lengths, corpus, context_length, overlong)


def _finite(name, raw: np.ndarray, corpus, context_length, overlong) -> LengthSource:
    lengths = apply_overlong(raw, context_length, overlong)
    if lengths.size == 0:
        raise UserError(f"every sequence of {name} is longer than --context-length "
                        f"{context_length} (shortest {int(raw.min())}); raise it")
    over = int((raw > context_length).sum()) if context_length is not None else 0
    return LengthSource(name=name, lengths=lengths, corpus=corpus, context_length=context_length,
                        overlong=overlong, seq_ids=overlong_keep(raw, context_length, overlong),
                        overlong_count=over)
