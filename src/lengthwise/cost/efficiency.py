"""The built-in efficiency curve (cost/time.Throughput), fitted to measured profiles.

    fitted = fit_throughput([(spec_05b, profile_05b), (spec_15b, profile_15b)], peak_tflops=989.0,
                            measured_on="NVIDIA H200")
    rounded(fitted.throughput)   # {"linear_mfu": 0.49, "half_tokens": 0.0, "attention_mfu": 0.31,
                                 #  "layer_overhead_s": 0.0013}: Throughput's defaults

`python benchmarks/time_model_h200.py` runs this on the two 2026-11-27 H200 profiles (completed
by cost/estimate.py) and writes the result; Throughput's defaults are those numbers rounded to
two figures, and tests/test_time_model_h200.py refits them from the committed files.

What is fitted: the analytic model's per-layer time (cost/model_time.py, one GPU, tp 1) of each
timed chunk, `layer_overhead_s + linear FLOPs / (peak x linear_mfu x x / (x + half_tokens))
+ attention FLOPs / (peak x attention_mfu)`, backward with the model's FLOP ratios (2 and 2.5),
against the measured time, by least relative error (scipy's bounded least squares, several
starting points, the lowest cost kept). Which chunks: those whose measured time is the device's
work, i.e. where the profile's own fit puts its device line above its host floor (cost/time.py);
the analytic model has no host floor, and a chunk on the floor says how fast the host issues
kernels, not how fast the GPU runs them. The backward is taken net of the key-slicing term of
the code that measured it (cost/estimate.py), which today's executor no longer pays.

What the H200 profiles say (the numbers in Throughput): GEMMs of Qwen2.5-0.5B and 1.5B widths
run at 49% of the 989 TFLOP/s peak, attention at 31%, and each layer pass costs a fixed 1.3 ms
more; half_tokens fits to 0: above the host floor (chunks of 2-16K tokens) no rise of GEMM
efficiency with size is left to see, so a small chunk's inefficiency is that fixed cost
amortised over less work. Holding that fixed cost at the 40 us the curve assumed before (kernel
launches alone) and fitting the rest gives 33% / 320 tokens / 29% at 14% mean error (4.8% with
it free): the data want the fixed cost. Caveats, for models and hardware beyond these: wider
models' GEMMs run nearer the peak; the fixed cost is the code measured then (main at 1b723e1:
eager, per-layer host work and synchronisation), which the hot-path work has since cut, and it
weighs on every micro-batch of a simulated baseline that runs many; H100 SXM has the H200's
peak but less memory bandwidth.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.optimize import least_squares

from lengthwise.cost.estimate import profile_samples
from lengthwise.cost.model import CostModel
from lengthwise.cost.time import Profile, Throughput, layer_seconds
from lengthwise.errors import UserError
from lengthwise.specs import ClusterSpec, ModelSpec

H200_PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H200 SXM, TFLOP/s (NVIDIA's data sheet; the same as the H100 SXM's)."""
COEFFICIENTS = ("linear_mfu", "half_tokens", "attention_mfu", "layer_overhead_s")
SCALES = np.array([1.0, 1e3, 1.0, 1e-3])
"""Typical sizes of (linear_mfu, half_tokens, attention_mfu, layer_overhead_s)."""
STARTS = ((0.5, 0.3, 0.4, 0.1), (0.3, 2.0, 0.3, 1.0), (0.7, 0.0, 0.5, 2.0))
UPPER = np.array([1.0, 1e3, 1.0, 1e3])
"""MFUs at most 1 (of peak); half_tokens at most 1M; the overhead at most 1 s."""


@dataclasses.dataclass(kw_only=True)
class FittedThroughput:
    throughput: Throughput
    """Unrounded."""
    chunks: int
    """Timed chunk passes (forward and backward counted apart) it was fitted on."""
    error: dict
    """Relative error on them: mean, max."""


def fit_throughput(measured: list[tuple[ModelSpec, Profile]], *, peak_tflops: float, measured_on: str,
                   hold: dict[str, float] | None = None) -> FittedThroughput:
    """The Throughput whose analytic layer times best match the device-bound chunks of the
    given (model, completed profile) pairs (module docstring); `hold` fixes some of the four
    coefficients (by name) and fits the others."""
    groups = [g for spec, profile in measured for g in _device_groups(spec, profile)]
    count = sum(len(g.seconds) for g in groups)
    if count < len(SCALES):
        raise UserError(f"{count} device-bound chunk timings cannot fit {len(SCALES)} coefficients")
    cluster = ClusterSpec(name=measured_on, num_gpus=1, gpus_per_node=1, peak_tflops=peak_tflops)
    held = np.array([(hold or {}).get(k, np.nan) for k in COEFFICIENTS]) / SCALES
    free = np.isnan(held)

    def full(p):
        return np.where(free, _spread(p, free), held)

    def residuals(p):
        throughput = _throughput(full(p), measured_on)
        return np.concatenate([g.predict(cluster, throughput) / g.seconds - 1.0 for g in groups])

    best = min((least_squares(residuals, np.array(x0)[free], bounds=(0.0, UPPER[free])) for x0 in STARTS),
               key=lambda r: r.cost)
    errs = np.abs(residuals(best.x))
    return FittedThroughput(throughput=_throughput(full(best.x), measured_on), chunks=count,
                            error={"mean": float(errs.mean()), "max": float(errs.max())})


def _spread(p, free: np.ndarray) -> np.ndarray:
    """The free coefficients `p` at their places among all four (the held ones NaN)."""
    out = np.full(len(free), np.nan)
    out[free] = p
    return out


def _throughput(p, measured_on: str) -> Throughput:
    mfu, half, attn, overhead = (float(v) for v in np.asarray(p) * SCALES)
    return Throughput(linear_mfu=max(mfu, 1e-6), half_tokens=half, attention_mfu=max(attn, 1e-6),
                      layer_overhead_s=overhead, measured_on=measured_on, source="fitted (cost/efficiency.py)")


@dataclasses.dataclass(kw_only=True)
class _Group:
    """One model's device-bound passes of one direction, as arrays."""

    spec: ModelSpec
    backward: bool
    tokens: np.ndarray
    keys: np.ndarray
    seconds: np.ndarray
    """Measured per-layer seconds (backward: net of the key-slicing term)."""

    def predict(self, cluster: ClusterSpec, throughput: Throughput) -> np.ndarray:
        cost = CostModel(model=self.spec, cluster=cluster, throughput=throughput)
        return cost.works_time(self.tokens, self.keys, layers=1, backward=self.backward)


def _device_groups(spec: ModelSpec, profile: Profile) -> list[_Group]:
    """The passes the profile's fit puts on the device's line, forward and backward apart."""
    fit = profile.schemes.get("tp1-cp1")
    if fit is None or not fit.has_floor:
        raise UserError(f"profile of {profile.model}: needs a tp1-cp1 fit with a host floor (cost/estimate.py)")
    samples, groups = profile_samples(profile), []
    for backward, work, floor, seg in ((False, fit.fwd, fit.fwd_floor, 0.0),
                                       (True, fit.bwd, fit.bwd_floor, fit.bwd_segment_tokens)):
        chosen = [s for s in samples if layer_seconds(work, (0.0, 0.0), s.keys, s.tokens, s.segments, seg)
                  > floor[0] + floor[1] * s.segments]
        groups.append(_Group(spec=spec, backward=backward, tokens=np.array([s.tokens for s in chosen]),
                             keys=np.array([s.keys for s in chosen]),
                             seconds=np.array([(s.bwd_s if backward else s.fwd_s) - seg * s.segments * s.tokens
                                               for s in chosen])))
    return groups


def rounded(throughput: Throughput) -> dict[str, float]:
    """The four coefficients as Throughput's defaults hold them: two significant figures
    (half_tokens to whole tokens first)."""
    values = {k: getattr(throughput, k) for k in COEFFICIENTS}
    values["half_tokens"] = round(values["half_tokens"])
    return {k: float(f"{v:.2g}") for k, v in values.items()}


def describe_fit(fitted: FittedThroughput) -> str:
    t = fitted.throughput
    return (f"linear_mfu {t.linear_mfu:.3f}, half_tokens {t.half_tokens:.0f}, attention_mfu {t.attention_mfu:.3f}, "
            f"layer_overhead_s {t.layer_overhead_s:.3g} on {fitted.chunks} chunk passes (relative error mean "
            f"{fitted.error['mean']:.1%}, max {fitted.error['max']:.1%})")
