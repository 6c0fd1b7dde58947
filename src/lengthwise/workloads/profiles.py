"""Published sequence-length distributions as CDF tables, sampled deterministically.

A profile is a list of knots `(length, share)` meaning "a fraction `share` of sequences is
shorter than `length` tokens" (K = 1024 throughout). Between two knots the CDF is linear in
log(length) -- piecewise log-linear, i.e. lengths inside one bracket are log-uniform -- which is
the least-committal shape that keeps the long tail long. A continuous length x is drawn by
inverting that CDF and the sequence length is floor(x); since every knot is an integer,
P(floor(x) < knot) equals the knot's share exactly, so the published shares are reproduced up
to sampling noise (about 0.1 percentage point at 100,000 samples).

Papers publish only a few shares (under 1K/4K/8K/32K/128K and the longest). The shortest
length and a median are assumptions; each profile's docstring says which knots are published
and which are assumed. The last knot is `longest + 1` with share 1, so `max_length` is the
published longest sequence.

    >>> p = get_profile("chunkflow-eval")
    >>> lengths = p.sample(1000, np.random.default_rng(0))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lengthwise.errors import UserError

K = 1024


@dataclass(frozen=True, kw_only=True)
class LengthProfile:
    """A sequence-length distribution given by CDF knots, log-linear in between."""

    name: str
    """Name used by `--profile`."""
    knots: tuple[tuple[int, float], ...]
    """(length in tokens, fraction of sequences shorter than it); lengths strictly increasing,
    shares non-decreasing from 0 at the first knot (the minimum length) to 1 at the last
    (the longest length + 1)."""
    source: str
    """Where the published knots come from (paper and table)."""

    def __post_init__(self):
        lengths = [k[0] for k in self.knots]
        shares = [k[1] for k in self.knots]
        assert all(a < b for a, b in zip(lengths, lengths[1:])), self.name
        assert all(a <= b for a, b in zip(shares, shares[1:])), self.name
        assert shares[0] == 0.0 and shares[-1] == 1.0 and lengths[0] >= 1, self.name

    @property
    def min_length(self) -> int:
        """Shortest length the profile can produce (tokens)."""
        return self.knots[0][0]

    @property
    def max_length(self) -> int:
        """Longest length the profile can produce (tokens)."""
        return self.knots[-1][0] - 1

    def share_below(self, length: float) -> float:
        """Fraction of sequences shorter than `length` tokens (the CDF, log-linear between knots)."""
        lengths, shares = self._arrays()
        clipped = np.clip(length, lengths[0], lengths[-1])
        return float(np.interp(np.log(clipped), np.log(lengths), shares))

    def sample(self, n: int, rng: np.random.Generator, *, below: int | None = None) -> np.ndarray:
        """`n` lengths (int64). `below` conditions on length < below: the papers' "exclude
        sequences longer than the context", without changing how many are drawn."""
        top = 1.0 if below is None else self.share_below(below)
        if top <= 0.0:
            raise UserError(f"profile {self.name} has no sequence shorter than {below} tokens "
                            f"(shortest is {self.min_length}); raise --context-length")
        u = rng.random(n) * top
        return np.floor(self._quantile(u)).astype(np.int64)

    def _quantile(self, u: np.ndarray) -> np.ndarray:
        lengths, shares = self._arrays()
        # Flat brackets (equal shares) carry no mass; drop their left knot so interp is monotone.
        keep = np.append(np.diff(shares) > 0, True)
        x = np.exp(np.interp(u, shares[keep], np.log(lengths[keep])))
        return np.minimum(x, lengths[-1] - 1e-9)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.array([k[0] for k in self.knots], dtype=np.float64)
        shares = np.array([k[1] for k in self.knots], dtype=np.float64)
        return lengths, shares


def _profile(name: str, source: str, knots: list[tuple[int, float]]) -> LengthProfile:
    return LengthProfile(name=name, source=source, knots=tuple(knots))


def lmsys() -> LengthProfile:
    """LMSysChat1M as ChunkFlow measures it (chunkflow Table 1).

    Published: <1K 90.499%, <4K 99.539%, <8K 99.908%, <32K 99.987%, <128K 99.996%, longest 303K.
    Assumed: shortest 16 tokens, median 256 tokens (a short chat exchange).
    """
    return _profile("lmsys", "chunkflow Table 1", [
        (16, 0.0), (256, 0.5), (1 * K, 0.90499), (4 * K, 0.99539), (8 * K, 0.99908),
        (32 * K, 0.99987), (128 * K, 0.99996), (303 * K + 1, 1.0)])


def chunkflow_eval() -> LengthProfile:
    """ChunkFlow's long-context fine-tuning evaluation set (chunkflow Table 2, §6.1).

    Published: <1K 98.17%, <4K 99.72%, <8K 99.83%, <32K 99.92%, <128K 99.98%, longest 256K.
    Assumed: shortest 16 tokens, median 256 tokens.
    """
    return _profile("chunkflow-eval", "chunkflow Table 2", [
        (16, 0.0), (256, 0.5), (1 * K, 0.9817), (4 * K, 0.9972), (8 * K, 0.9983),
        (32 * K, 0.9992), (128 * K, 0.9998), (256 * K + 1, 1.0)])


def lmsys_skrull() -> LengthProfile:
    """LMsysChat1M as Skrull measures it (skrull Table 1, §3.1).

    Published: <1K 87.12%, <4K 99.35%, <8K 99.87%, <32K 99.98%, <128K 99.99%, longest 1643K.
    Assumed: shortest 16 tokens, median 256 tokens.
    """
    return _profile("lmsys-skrull", "skrull Table 1", [
        (16, 0.0), (256, 0.5), (1 * K, 0.8712), (4 * K, 0.9935), (8 * K, 0.9987),
        (32 * K, 0.9998), (128 * K, 0.9999), (1643 * K + 1, 1.0)])


def wikipedia() -> LengthProfile:
    """Wikipedia articles (skrull Table 1, §3.1).

    Published: <1K 87.88%, <4K 99.34%, <8K 99.92%, <32K 99.99%, <128K 100.0%, longest 78K.
    Assumed: shortest 32 tokens, median 384 tokens (a short article).
    """
    return _profile("wikipedia", "skrull Table 1", [
        (32, 0.0), (384, 0.5), (1 * K, 0.8788), (4 * K, 0.9934), (8 * K, 0.9992),
        (32 * K, 0.9999), (78 * K + 1, 1.0)])


def chatqa2() -> LengthProfile:
    """ChatQA2-Long-SFT, bimodal: about 40% under 8K, 60% between 8K and 32K (skrull Table 1).

    Published: <1K 21.92%, <4K 31.48%, <8K 40.43%, <32K 99.86%, <128K 100.0%, longest 99K.
    Assumed: shortest 64 tokens; log-uniform inside each bracket (so no separate median knot).
    """
    return _profile("chatqa2", "skrull Table 1", [
        (64, 0.0), (1 * K, 0.2192), (4 * K, 0.3148), (8 * K, 0.4043), (32 * K, 0.9986),
        (99 * K + 1, 1.0)])


def github() -> LengthProfile:
    """GitHub code files for continual pre-training (infinipipe §1, Fig. 2; slimpack §2.1.1).

    Published: 91.5% have at most 8K tokens; 0.6% exceed 64K and hold 21.6% of all tokens
    (infinipipe §1). Assumed: shortest 16 tokens, median 1K, 80% under 4K (slimpack §2.1.1's
    "nearly 80% shorter than 4K"), 99.935% under 256K and longest 512K -- the last two chosen
    so that the >64K tail holds 21.6% of tokens, as published (log-uniform brackets give
    21.6% analytically; a 100,000-sample draw lands within about a point of it).
    """
    return _profile("github", "infinipipe §1 (+ assumptions)", [
        (16, 0.0), (1 * K, 0.5), (4 * K, 0.80), (8 * K + 1, 0.915), (64 * K + 1, 0.994),
        (256 * K, 0.99935), (512 * K + 1, 1.0)])


def commoncrawl() -> LengthProfile:
    """CommonCrawl web pages (RefinedWeb), as Hydraulis trains on them (hydraulis §3, Fig. 14).

    No shares are published: hydraulis Fig. 14 only shows that the longest sequence among 1.6M
    sampled tokens varies widely between iterations and often stays below a 32K context. All
    knots are assumptions shaped by that and by slimpack §2.1.1 (most documents short, a thin
    tail past 128K): shortest 32, median 512, 90% under 2K, 99% under 8K, 99.9% under 32K,
    99.99% under 128K, longest 512K.
    """
    return _profile("commoncrawl", "assumed (hydraulis Fig. 14, slimpack §2.1.1)", [
        (32, 0.0), (512, 0.5), (2 * K, 0.90), (8 * K, 0.99), (32 * K, 0.999),
        (128 * K, 0.9999), (512 * K + 1, 1.0)])


def tiny() -> LengthProfile:
    """Short sequences for training on a CPU: 8..512 tokens, median 64, 90% under 256 (all
    assumed), still long-tailed so packing and splitting have something to do."""
    return _profile("tiny", "assumed (CPU-sized)", [
        (8, 0.0), (64, 0.5), (256, 0.9), (513, 1.0)])


PROVENANCE = {
    "lmsys": "published shares (chunkflow Table 1); shortest and median assumed",
    "chunkflow-eval": "published shares (chunkflow Table 2); shortest and median assumed",
    "lmsys-skrull": "published shares (skrull Table 1); shortest and median assumed",
    "wikipedia": "published shares (skrull Table 1); shortest and median assumed",
    "chatqa2": "published shares (skrull Table 1); shortest assumed",
    "github": "partly assumed: <8K and the >64K tail published (infinipipe §1), the other knots chosen to match",
    "commoncrawl": "entirely assumed: no paper's text publishes its shares (histograms are figures only)",
    "tiny": "assumed (CPU-sized)",
}
"""Profile -> how much of it a paper publishes (`workload --help` says the same)."""


def _catalogue() -> dict[str, Callable[[], LengthProfile]]:
    builders = [lmsys, chunkflow_eval, lmsys_skrull, wikipedia, chatqa2, github, commoncrawl,
                tiny]
    return {b.__name__.replace("_", "-"): b for b in builders}


def profile_names() -> list[str]:
    """Names accepted by `get_profile` / `--profile`."""
    return list(_catalogue())


def get_profile(name: str) -> LengthProfile:
    """The profile called `name`; a UserError listing the valid names otherwise."""
    builder = _catalogue().get(name)
    if builder is None:
        raise UserError(f"unknown profile {name!r}; choose one of: {', '.join(profile_names())}")
    return builder()
