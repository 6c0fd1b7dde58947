"""Fit a measured cost profile: which chunks to time, and the least-squares fit of their times.

    chunks = profile_chunks(min_tokens=512, max_tokens=32768, max_context=131072)
    fitted = measure_profile(measurer, chunks, head_tokens=[512, 2048, 8192], model_name="qwen2.5-0.5b")
    write_atomic(path, json.dumps(fitted.profile.to_dict()))   # fitted.errors: held-out error per pass

The time model is hydraulis.txt B.2's T(l) = a*l^2 + b*l + c with the quadratic term read as
attention pairs (cost/time.py): per layer T = a * keys + b * tokens + c, forward and backward
fitted separately; the LM head T = b * tokens + c. The three terms are only separable when the
measured chunks vary keys and tokens independently, so the grid mixes, for each token count T:
one whole document (keys ~ T^2/2), T split into 16 and into 4 packed documents (keys ~ T^2/32,
T^2/8), and one slice with a context of T and of 3T earlier tokens (keys ~ 1.5 T^2, 3.5 T^2).

Per layer the time is max(f + g * segments, a * keys + b * tokens + c) (cost/time.py): below a
few thousand tokens the measured times are flat (the host launching kernels, plus a little per
document of the row), above they grow with the work. The grid also packs T tokens as 64
documents, so the per-segment term is measured at the segment counts real batches have.

Fitting: scipy's bounded least squares (all five coefficients >= 0) on residuals divided by the
measured time, so the fit minimises relative error (a 512-token chunk counts as much as a 32K
one; unweighted, the largest chunks would decide everything and small chunks, which pipelines
run most, would be off by 2x), from a few starting points, the lowest cost kept. The LM head's
b * tokens + c is a non-negative linear least squares on the same relative rows.
A seeded quarter of the chunks is held out; the coefficients written are fitted on the rest and
`errors` gives their error on the held-out chunks.

Step terms (cost/time.StepTerms): when the measurer can (`time_embed`, `time_optimizer`,
`time_chunk_overhead`), the embedding's forward and backward at the head's token counts (fitted
b * tokens + c), the host's per-chunk work outside the layers, and one fused AdamW step and one
gradient norm over tensors of the whole model's parameter shapes.

Memory: activation bytes per token per layer is the slope of bytes held after a forward against
tokens, over the chunks without context (a slice's context K/V belongs to the K/V state, which
`kv_bytes_per_token_layer` measures). The LM head's held and peak bytes per token (the peak
includes the loss's float32 logits, about 10 x vocab bytes per token at once) go to the meta as
`head_activation_bytes_per_token` and `head_peak_bytes_per_token`: Profile has no field for them
yet, and the cost model's analytic head term, 2 x (vocab + hidden) bytes, is below both.

No PyTorch here: a `Measurer` (runtime/profile.py on a real device, a fake in tests) does the
timing; this module plans and fits.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
from scipy.optimize import least_squares, nnls

from lengthwise.cost.flops import chunk_work
from lengthwise.cost.time import Profile, SchemeFit, StepTerms, layer_seconds, scheme_key
from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk, Segment

PACKED_DOCS = (64, 16, 4)
"""A chunk of T tokens is also measured as this many equal packed documents."""
CONTEXT_FACTORS = (1, 3)
"""A slice of T tokens is also measured with a context of this many times T earlier tokens."""


@dataclass(kw_only=True)
class Timing:
    """One measurement of a chunk (or of the LM head) on the measurer's layers."""

    fwd_s: float
    """Forward seconds, all measured layers together."""
    bwd_s: float
    """Backward seconds, all measured layers together."""
    activation_bytes: float | None = None
    """Bytes held from the forward to the backward (None when not measured)."""
    peak_bytes: float | None = None
    """Highest bytes above the start during forward and backward, transients included."""


class Measurer(Protocol):
    """What measure_profile needs of a device (runtime/profile.TorchMeasurer, or a fake)."""

    layers: int
    """Decoder layers every chunk measurement runs through."""

    def time_chunk(self, chunk: Chunk) -> Timing: ...

    def time_head(self, tokens: int) -> Timing: ...

    def kv_bytes_per_token_layer(self) -> float: ...

    def describe(self) -> dict:
        """device, dtype, backend, versions: recorded in the profile's meta."""


@dataclass(kw_only=True)
class Sample:
    """One timed chunk, per-layer quantities derived from it."""

    chunk: str
    """The chunk's string form (plan/ir.py)."""
    tokens: float
    keys: float
    """Attention (query, key) pairs, contexts included (cost/flops.py)."""
    context_free: bool
    """No segment attends to earlier tokens outside the row."""
    fwd_s: float
    """Forward seconds per layer."""
    bwd_s: float
    activation_bytes: float | None
    """Bytes held per layer."""
    peak_bytes: float | None
    """Highest bytes above the start during forward and backward, all measured layers (the
    profile has no field for it; recorded for the simulator's transient terms)."""
    held_out: bool = False
    segments: int = 1
    """Segments of the chunk's row."""


@dataclass(kw_only=True)
class FitError:
    """Relative error of fitted against measured times on the held-out measurements."""

    mean: float
    """Mean absolute percentage error, as a fraction (0.03 = 3%)."""
    max: float
    count: int
    """Held-out measurements."""


@dataclass(kw_only=True)
class FittedProfile:
    profile: Profile
    errors: dict[str, FitError]
    """Keyed fwd, bwd, head_fwd, head_bwd."""
    samples: list[Sample]


# ---- which chunks to measure ------------------------------------------------------------------

def profile_chunks(*, min_tokens: int, max_tokens: int, max_context: int) -> list[Chunk]:
    """For each power-of-two T in [min_tokens, max_tokens]: one document, T as 16 and as 4
    packed documents, and a slice of T tokens after a context of T and 3T (those within
    max_context tokens of sequence)."""
    if not 1 <= min_tokens <= max_tokens:
        raise UserError(f"need 1 <= --min-tokens ({min_tokens}) <= --max-tokens ({max_tokens})")
    chunks, t = [], min_tokens
    while t <= max_tokens:
        chunks.append(Chunk((Segment(0, 0, t),)))
        for docs in PACKED_DOCS:
            if t // docs >= 1:
                chunks.append(_packed(t, docs))
        for factor in CONTEXT_FACTORS:
            if (factor + 1) * t <= max_context:
                chunks.append(Chunk((Segment(0, factor * t, (factor + 1) * t),)))
        t *= 2
    return chunks


def _packed(tokens: int, docs: int) -> Chunk:
    """`docs` documents of tokens // docs tokens, the first one taking the remainder."""
    size = tokens // docs
    lengths = [size + tokens - size * docs] + [size] * (docs - 1)
    return Chunk(tuple(Segment(i, 0, n) for i, n in enumerate(lengths)))


def head_token_counts(min_tokens: int, max_tokens: int) -> list[int]:
    """Powers of two between the bounds, at least three (the head fit has two unknowns)."""
    counts, t = [], min_tokens
    while t <= max_tokens:
        counts.append(t)
        t *= 2
    while len(counts) < 3:
        counts.append(counts[-1] * 2)
    return counts


# ---- measuring ---------------------------------------------------------------------------------

def measure_profile(measurer: Measurer, chunks: list[Chunk], head_tokens: list[int], *, model_name: str,
                    holdout: float = 0.25, seed: int = 0, progress=None) -> FittedProfile:
    """Time every chunk and head size, fit the coefficients on the training part, and measure
    their error on the held-out part."""
    if not 0.0 <= holdout < 1.0:
        raise UserError(f"--holdout {holdout} must be in [0, 1)")
    samples = [_sample(measurer, c, progress) for c in chunks]
    heads = [(n, measurer.time_head(n)) for n in head_tokens]
    _mark_held_out(samples, holdout, seed)
    train = [s for s in samples if not s.held_out] or samples
    test = [s for s in samples if s.held_out]
    layers, errors = fit_layers(train, test)
    head_fwd = fit_head([n for n, _ in heads], [t.fwd_s for _, t in heads])
    head_bwd = fit_head([n for n, _ in heads], [t.bwd_s for _, t in heads])
    errors.update(head_fwd=_head_error(head_fwd, heads, "fwd_s"), head_bwd=_head_error(head_bwd, heads, "bwd_s"))
    fit = SchemeFit(**layers, head_fwd=head_fwd, head_bwd=head_bwd)
    step = measure_step_terms(measurer, head_tokens)
    meta = {**measurer.describe(), "measured_layers": measurer.layers, "holdout": holdout, "seed": seed,
            "held_out_error": {k: asdict(v) for k, v in errors.items()},
            "head_activation_bytes_per_token": _head_slope(heads, "activation_bytes"),
            "head_peak_bytes_per_token": _head_slope(heads, "peak_bytes"),
            "samples": [asdict(s) for s in samples],
            "head_samples": [{"tokens": n, **asdict(t)} for n, t in heads]}
    profile = Profile(device=meta.get("device", "unknown"), model=model_name,
                      schemes={scheme_key(1, 1): fit}, step=step,
                      activation_bytes_per_token_layer=activation_slope(samples),
                      kv_bytes_per_token_layer=float(measurer.kv_bytes_per_token_layer()), meta=meta)
    return FittedProfile(profile=profile, errors=errors, samples=samples)


def measure_step_terms(measurer, head_tokens: list[int]) -> StepTerms | None:
    """The step's terms outside the layers, from a measurer that times them (None when it
    cannot: cost/estimate.complete_profile estimates them then)."""
    if not all(hasattr(measurer, n) for n in ("time_embed", "time_optimizer", "time_chunk_overhead")):
        return None
    embeds = [(n, measurer.time_embed(n)) for n in head_tokens]
    optimizer_s, grad_norm_s = measurer.time_optimizer()
    return StepTerms(embed_fwd=fit_head([n for n, _ in embeds], [t.fwd_s for _, t in embeds]),
                     embed_bwd=fit_head([n for n, _ in embeds], [t.bwd_s for _, t in embeds]),
                     chunk_overhead_s=float(measurer.time_chunk_overhead()), optimizer_s=float(optimizer_s),
                     grad_norm_s=float(grad_norm_s))


def _sample(measurer: Measurer, chunk: Chunk, progress) -> Sample:
    timing, layers, work = measurer.time_chunk(chunk), measurer.layers, chunk_work(chunk)
    if progress is not None:
        progress.update(1)
    held = None if timing.activation_bytes is None else timing.activation_bytes / layers
    return Sample(chunk=str(chunk), tokens=work.tokens, keys=work.keys, segments=len(chunk.segments),
                  context_free=all(s.start == 0 for s in chunk.segments),
                  fwd_s=timing.fwd_s / layers, bwd_s=timing.bwd_s / layers, activation_bytes=held,
                  peak_bytes=timing.peak_bytes)


def _mark_held_out(samples: list[Sample], holdout: float, seed: int) -> None:
    """A seeded `holdout` share of the samples (at least one when holdout > 0 and there are
    enough left to fit three coefficients)."""
    count = round(holdout * len(samples))
    if holdout > 0:
        count = max(count, 1)
    count = min(count, max(len(samples) - 3, 0))
    for i in np.random.default_rng(seed).permutation(len(samples))[:count]:
        samples[i].held_out = True


# ---- the fits ----------------------------------------------------------------------------------

def fit_time(keys, tokens, seconds) -> tuple[float, float, float]:
    """Non-negative (a, b, c) of seconds = a * keys + b * tokens + c, least relative error
    (the straight line, without a host floor)."""
    x = np.column_stack([np.asarray(keys, float), np.asarray(tokens, float), np.ones(len(seconds))])
    return tuple(float(v) for v in _relative_nnls(x, seconds))


FLOOR_SCALES = np.array([1e-11, 1e-8, 1e-3, 1e-5])
"""Typical sizes of (a, b, f, g) in seconds per pair, token, pass, segment: the solver works on
coefficients divided by these, so its steps are of one order in every direction."""
FLOOR_STARTS = (1.0, 0.1, 3.0)
"""Starting points (every scaled coefficient equal to one of these); the lowest cost is kept:
a maximum of two terms has a local minimum where either term is inactive."""


def fit_floor_time(keys, tokens, segments, seconds, segment_tokens: float = 0.0
                   ) -> tuple[tuple[float, float, float], tuple[float, float]]:
    """((a, b, 0), (f, g)) of seconds = max(f + g * segments, a * keys + b * tokens
    + segment_tokens * segments * tokens), all >= 0, least relative error
    (scipy.optimize.least_squares); `segment_tokens` is known, not fitted.

    The device's line has no constant (c = 0, kept in the tuple for the file format): a layer
    pass's device time is its work, and what a pass costs whatever its work is the host floor
    f. With a free constant the fit could not tell them apart where the samples sit on the
    floor: on the H200 (2026-11-28, compiled layers) every sample up to 16K tokens took 2-3 ms,
    and the fit put 2.3 ms into c and a per-token slope of a twentieth of the matmuls' own into
    b, so 30K-token steps were simulated 18-24% short; with c = 0 the same samples give 7-8%
    (benchmarks/results/time_model_h200.json, `compiled_runs`)."""
    k, t, n = (np.asarray(v, float) for v in (keys, tokens, segments))
    known = segment_tokens * n * t
    y = np.asarray(seconds, float)
    if len(y) < len(FLOOR_SCALES):
        raise UserError(f"{len(y)} measurements cannot fit {len(FLOOR_SCALES)} coefficients: widen the token range")
    if (y <= 0).any():
        raise UserError("a measured time is not positive: the timer is too coarse for the smallest chunks; "
                        "raise --min-tokens or --repeats")

    def residuals(p):
        a, b, f, g = p * FLOOR_SCALES
        return np.maximum(f + g * n, a * k + b * t + known) / y - 1.0

    if not all(np.isfinite(residuals(np.full(len(FLOOR_SCALES), x0))).all() for x0 in FLOOR_STARTS):
        raise UserError("measured chunks too large to fit (a time model's terms overflow): check the samples")
    try:
        best = min((least_squares(residuals, np.full(len(FLOOR_SCALES), x0), bounds=(0.0, np.inf))
                    for x0 in FLOOR_STARTS), key=lambda r: r.cost)
    except ValueError as exc:  # non-finite values inside the solver
        raise UserError(f"the time model's fit failed on these samples ({exc})") from None
    a, b, f, g = (float(v) for v in best.x * FLOOR_SCALES)
    return (a, b, 0.0), (f, g)


def fit_layers(train: list[Sample], test: list[Sample], bwd_segment_tokens: float = 0.0
               ) -> tuple[dict, dict[str, FitError]]:
    """SchemeFit's layer fields (fwd, bwd, fwd_floor, bwd_floor) fitted on `train` (the
    backward with the known per-segment-token term), and their held-out errors on `test`
    (keyed fwd, bwd)."""
    out, errors = {}, {}
    for name in ("fwd", "bwd"):
        field, seg = f"{name}_s", bwd_segment_tokens if name == "bwd" else 0.0
        work, floor = fit_floor_time([s.keys for s in train], [s.tokens for s in train],
                                     [s.segments for s in train], [getattr(s, field) for s in train], seg)
        out[name], out[f"{name}_floor"] = work, floor
        errors[name] = held_out_error((work, floor, seg), test, field)
    return out, errors


def fit_head(tokens, seconds) -> tuple[float, float]:
    """Non-negative (b, c) of seconds = b * tokens + c, least relative error."""
    x = np.column_stack([np.asarray(tokens, float), np.ones(len(seconds))])
    return tuple(float(v) for v in _relative_nnls(x, seconds))


def _relative_nnls(x: np.ndarray, seconds) -> np.ndarray:
    y = np.asarray(seconds, float)
    if len(y) < x.shape[1]:
        raise UserError(f"{len(y)} measurements cannot fit {x.shape[1]} coefficients: widen the token range")
    if (y <= 0).any():
        raise UserError("a measured time is not positive: the timer is too coarse for the smallest chunks; "
                        "raise --min-tokens or --repeats")
    weighted = x / y[:, None]  # row i divided by y_i: residuals become relative errors
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0  # keys are all zero when nothing attends (never in practice)
    coef, _ = nnls(weighted / scale, np.ones(len(y)))
    return coef / scale


def predict(coef, keys: float, tokens: float, segments: float = 1) -> float:
    """One layer pass: coef is (a, b, c) (the straight line) or ((a, b, c), (f, g), e)."""
    if len(coef) == 3 and not isinstance(coef[0], tuple):
        return layer_seconds(coef, (0.0, 0.0), keys, tokens, segments)
    work, floor, seg = coef
    return layer_seconds(work, floor, keys, tokens, segments, seg)


def held_out_error(coef, test: list[Sample], field: str) -> FitError:
    """Absolute percentage errors of the fit on the held-out samples."""
    errs = [abs(predict(coef, s.keys, s.tokens, s.segments) - getattr(s, field)) / getattr(s, field) for s in test]
    return FitError(mean=statistics.fmean(errs) if errs else 0.0, max=max(errs, default=0.0), count=len(errs))


def _head_error(coef, heads: list[tuple[int, Timing]], field: str) -> FitError:
    """Relative error of the head fit on its own measurements (two unknowns, few sizes: no
    hold-out; count says how many it was checked on)."""
    b, c = coef
    errs = [abs(b * n + c - getattr(t, field)) / getattr(t, field) for n, t in heads]
    return FitError(mean=statistics.fmean(errs), max=max(errs), count=len(errs))


def activation_slope(samples: list[Sample]) -> float | None:
    """Bytes per token per layer: slope of held bytes against tokens over context-free chunks."""
    pts = [(s.tokens, s.activation_bytes) for s in samples if s.context_free and s.activation_bytes is not None]
    if len({t for t, _ in pts}) < 2:
        return None
    slope, _ = np.polyfit([t for t, _ in pts], [b for _, b in pts], 1)
    return max(float(slope), 0.0)


def _head_slope(heads: list[tuple[int, Timing]], field: str) -> float | None:
    """Bytes per token of the LM head's `field` (held, or peak with the loss's transients)."""
    pts = [(n, getattr(t, field)) for n, t in heads if getattr(t, field) is not None]
    if len({n for n, _ in pts}) < 2:
        return None
    slope, _ = np.polyfit([n for n, _ in pts], [b for _, b in pts], 1)
    return max(float(slope), 0.0)
