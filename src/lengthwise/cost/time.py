"""Compute time of a chunk on one stage: analytic throughput curve, or a measured profile.

Analytic (hydraulis.txt appendix C, infinipipe.txt appendix B): small GEMMs under-use the GPU, so
the achieved fraction of peak rises with the tokens each GPU multiplies at once and falls with
the TP degree, which shrinks every GEMM: eff(x) = linear_mfu * x / (x + half_tokens * tp), with x
the chunk's tokens per GPU. Attention runs at `attention_mfu` of peak. Each layer pass adds a
fixed `layer_overhead_s`, so a small chunk's achieved share of peak is that cost amortised over
less work. The defaults (`Throughput`) are fitted to the layer times of the 2026-11-27 H200
profiles of Qwen2.5-0.5B and 1.5B (cost/efficiency.py says on which chunks, and what they do not
cover: wider models, the hot-path code, other GPUs); with a profile given, the schemes it holds
use its measured times instead. Reports name which (`CostModel.time_source`) and the hardware
it was measured on.

Profiled (hydraulis.txt B.2): T(l) = a*l^2 + b*l + c per parallel scheme. For a packed chunk we
use its attention pairs in place of l^2/2 (the quadratic term is attention, which does not cross
documents), so the device's work per layer is a * keys + b * tokens + c. A small chunk does not
keep the device busy: its time is the host's, which launches the layer's kernels whatever the
chunk's size, plus a few per document of the row (the slices and joins of its keys). So per
layer, forward and backward fitted apart (cost/fit.py, scipy least squares on relative error):

    T = max(f + g * segments, a * keys + b * tokens + c)

the host floor (f, g: `fwd_floor`/`bwd_floor`) or the device's work, whichever is longer (host
and device run concurrently; the profile's samples fit an exponent of a smooth maximum at its
upper bound, i.e. the plain max). A profile without floors (written before they existed) has
f = g = 0: the straight line, as before. Where a floor is fitted, c is 0: what a pass costs
whatever its work is the floor's (cost/fit.fit_floor_time says what a free c did on the H200).

Where the measured code joined each layer's keys segment by segment (runtime/layout.pack_keys:
the reference backend, and every backend before the flash ones read the row's keys whole), the
backward also hands each segment's key slice a gradient of the whole row's K and V (a slice's
backward zero-fills a row-sized tensor, which autograd then adds into the sum), device work that
grows with segments x tokens: `bwd_segment_tokens`, e, in the device's line (+ e * segments *
tokens).

What else a step costs (`StepTerms`, measured by `lengthwise profile`, or estimated for older
profiles, `estimated` naming which):

- embedding (first stage): b * tokens + c forward and backward;
- LM head and loss (last stage): `head_fwd`/`head_bwd`, b * tokens + c;
- host overhead per chunk action: the stage's work around its layers for one chunk (layout,
  positions, rotary tables), seconds per action;
- optimizer step (fused AdamW over the model's parameters) and gradient norm (the
  clip_grad_norm_ reduction), once at the step's end, seconds for the whole model, a stage
  paying its share of the parameters (sim/simulate.py: after its gradient reduction).

Within a stage the host runs ahead of the device (no host syncs in a step), so the simulator
takes a stage's layer time as the longer of its host floors' sum and its device lines' sum
(sim/terms.host_overlap).

Estimates (cost/estimate.complete_profile), physical, never fitted to step times: the layer
terms are refitted from the profile's own raw samples (meta.samples); e is 2 (K, V) x 4 passes
x kv_dim x dtype bytes at SLICE_BANDWIDTH_SHARE (1.0: the nominal rate, checked on six measured
0.5B steps, its docstring says how) of the device's memory bandwidth (DEVICE_BANDWIDTH,
e.g. H200 4.8 TB/s); the optimizer step is the bytes fused AdamW moves (7 tensors of the
profile's dtype per parameter: reads weight, gradient and two moments, writes weight and
moments) over the bandwidth; the gradient norm reads each gradient once; the embedding moves
its rows (forward: read and write tokens x hidden; backward: the same plus zeroing the table's
gradient); the per-chunk host overhead is 0 (not measured).

Measured on one NVIDIA H200 (`python benchmarks/time_model_h200.py`, tests/test_time_model_h200.py).
The 2026-11-27 profiles and steps (eager code; copies in benchmarks/results/h200-2026-11-27/):
held-out error of the per-layer fit, mean over the 8 held-out samples, Qwen2.5-0.5B forward
11.3% / backward 9.4%, Qwen2.5-1.5B 8.1% / 3.7% (the straight line: 15.3/17.5% and 7.6/17.6%);
the 0.5B misses are its held-out chunks under the host floor, whose times scatter 1.3-2.3 ms at
equal work. Whole measured steps (10: 0.5B packing and chunkflow, 1.5B ChunkSize 8192,
sim_fidelity's two batches): mean error 4.8%, all 10 within 10% (the straight line without step
terms: 27.7%). The 2026-11-28 calls (compiled layers, each with the profile measured in the same
call; benchmarks/results/gpu-2026-11-28-nvidia-h200/): 13 Qwen2.5-0.5B steps, mean error 7.7%
(21.1% with the device's line fitted with a free constant, as those profiles recorded it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from lengthwise.errors import UserError
from lengthwise.fields import Fields
from lengthwise.files import read_json


@dataclass(kw_only=True)
class Throughput:
    """The analytic throughput curve. The defaults are fitted to the layer times of the
    2026-11-27 H200 profiles (cost/efficiency.py: what was fitted, on which chunks, and what it
    does not cover), rounded to two figures; `python benchmarks/time_model_h200.py` fits them
    again and tests/test_time_model_h200.py checks they agree."""

    linear_mfu: float = 0.49
    """Fraction of peak reached by the layers' GEMMs."""
    half_tokens: float = 0.0
    """Tokens per GPU (at tp = 1) at which GEMMs reach half of linear_mfu (0: no size
    dependence beyond layer_overhead_s's, which is what the H200 profiles showed)."""
    attention_mfu: float = 0.31
    """Fraction of peak reached by flash-style attention."""
    layer_overhead_s: float = 1.3e-3
    """Fixed time per layer per pass, seconds."""
    measured_on: str = "NVIDIA H200"
    """The hardware the coefficients were measured on, for reports."""
    source: str = ("built-in curve fitted to the Qwen2.5-0.5B and 1.5B profiles of 2026-11-27 "
                   "(cost/efficiency.py)")
    """Where the coefficients come from, for reports."""

    def describe(self) -> str:
        return f"{self.source}, measured on {self.measured_on}"

    def linear_efficiency(self, tokens_per_gpu: float, tp: int) -> float:
        x = max(tokens_per_gpu, 1.0)
        return self.linear_mfu * x / (x + self.half_tokens * tp)


@dataclass(kw_only=True)
class SchemeFit:
    """Per-layer seconds = max(f + g * segments, a * keys + b * tokens + c), forward and backward."""

    fwd: tuple[float, float, float]
    """(a, b, c): the device's work."""
    bwd: tuple[float, float, float]
    head_fwd: tuple[float, float] = (0.0, 0.0)
    """LM head seconds = b * tokens + c (last stage)."""
    head_bwd: tuple[float, float] = (0.0, 0.0)
    fwd_floor: tuple[float, float] = (0.0, 0.0)
    """(f, g): the host floor, seconds per layer pass and per segment of the row."""
    bwd_floor: tuple[float, float] = (0.0, 0.0)
    bwd_segment_tokens: float = 0.0
    """e: backward device seconds per (segment x token) of the row (module docstring: each
    segment's key slice hands back a gradient of the whole row's K and V)."""

    @property
    def has_floor(self) -> bool:
        return any(self.fwd_floor) or any(self.bwd_floor)


def layer_seconds(work: tuple[float, float, float], floor: tuple[float, float], keys, tokens, segments,
                  segment_tokens: float = 0.0):
    """One layer pass: the host floor or the device's work, whichever is longer (numbers or
    numpy arrays; a zero floor leaves the straight line's value unchanged)."""
    a, b, c = work
    f, g = floor
    line = a * keys + b * tokens + c
    if segment_tokens:
        line = line + segment_tokens * segments * tokens
    if f == 0.0 and g == 0.0:
        return line
    import numpy as np

    return np.maximum(f + g * segments, line) if isinstance(line, np.ndarray) else max(f + g * segments, line)


STEP_TERMS = ("embed_fwd", "embed_bwd", "chunk_overhead_s", "optimizer_s", "grad_norm_s")


@dataclass(kw_only=True)
class StepTerms:
    """What a step costs outside the decoder layers and the LM head (module docstring)."""

    embed_fwd: tuple[float, float] = (0.0, 0.0)
    """Embedding forward seconds = b * tokens + c (first stage)."""
    embed_bwd: tuple[float, float] = (0.0, 0.0)
    chunk_overhead_s: float = 0.0
    """Host seconds per chunk action (forward or backward) on a stage, beyond its layers."""
    optimizer_s: float = 0.0
    """One optimizer step over the whole model's parameters, seconds."""
    grad_norm_s: float = 0.0
    """The gradient norm over the whole model's gradients, seconds."""
    estimated: dict[str, str] = field(default_factory=dict)
    """Term name -> how it was estimated, for terms not measured."""

    def to_dict(self) -> dict:
        return {"embed_fwd": list(self.embed_fwd), "embed_bwd": list(self.embed_bwd),
                "chunk_overhead_s": self.chunk_overhead_s, "optimizer_s": self.optimizer_s,
                "grad_norm_s": self.grad_norm_s, "estimated": dict(self.estimated)}


DEVICE_BANDWIDTH = {"H200": 4.8e12, "GH200": 4.0e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "A800": 2.039e12,
                    "L40S": 0.864e12}
"""Nominal HBM bandwidth, bytes/s, by a name the device string contains (vendor data sheets),
first match in this order; for estimated terms only."""


def device_bandwidth(device: str) -> float | None:
    for tag, bw in DEVICE_BANDWIDTH.items():
        if tag in device:
            return bw
    return None


@dataclass(kw_only=True)
class Profile:
    """Measured cost coefficients for one model on one device (written by `lengthwise profile`)."""

    device: str = "unknown"
    model: str = "unknown"
    schemes: dict[str, SchemeFit] = field(default_factory=dict)
    """Keyed by scheme_key(tp, cp)."""
    activation_bytes_per_token_layer: float | None = None
    kv_bytes_per_token_layer: float | None = None
    step: StepTerms | None = None
    """Terms outside the layers (None in profiles written before them: cost/fit.complete_profile)."""
    meta: dict = field(default_factory=dict)

    def fit_for(self, tp: int, cp: int) -> SchemeFit | None:
        return self.schemes.get(scheme_key(tp, cp))

    def to_dict(self) -> dict:
        return {
            "format": "lengthwise.profile/1", "device": self.device, "model": self.model,
            "schemes": {k: vars(v) for k, v in self.schemes.items()},
            "activation_bytes_per_token_layer": self.activation_bytes_per_token_layer,
            "kv_bytes_per_token_layer": self.kv_bytes_per_token_layer,
            **({"step": self.step.to_dict()} if self.step is not None else {}), "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        """A profile from its JSON object: every coefficient finite and in range, arrays of the
        right length, scheme keys tpT-cpC (a damaged profile would otherwise give negative busy
        time or NaN step times)."""
        f = Fields(d, "profile")
        if f.data.get("format") != "lengthwise.profile/1":
            raise UserError("not a lengthwise profile: the JSON lacks format 'lengthwise.profile/1'")
        f.only(("format", "device", "model", "schemes", "activation_bytes_per_token_layer",
                "kv_bytes_per_token_layer", "step", "meta"))
        schemes = {key: _scheme_fit(key, v) for key, v in f.mapping("schemes").items()}
        byte_fields = ("activation_bytes_per_token_layer", "kv_bytes_per_token_layer")
        for name in byte_fields:
            value = f.optional_number(name)
            if value is not None and value > 2**40:   # 0 means not measured (the analytic model's)
                raise f.fail(name, "a number of bytes in [0, 2^40]", value)
        return cls(device=f.string("device", default="unknown"), model=f.string("model", default="unknown"),
                   schemes=schemes, activation_bytes_per_token_layer=f.optional_number(byte_fields[0]),
                   kv_bytes_per_token_layer=f.optional_number(byte_fields[1]),
                   step=_step_terms(f.data["step"]) if f.data.get("step") is not None else None,
                   meta=f.mapping("meta", default={}))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return read_json(path, "profile", cls.from_dict)


MAX_COEFFICIENT_S = 1e3
"""Largest per-pair, per-token or per-pass coefficient a profile may hold, seconds (measured ones
are below 1e-3; this only keeps damaged files from overflowing step times to infinity)."""


def _scheme_fit(key: str, data) -> SchemeFit:
    """One scheme's coefficients: fwd/bwd (a, b, c), head_fwd/head_bwd (b, c), each finite,
    >= 0 and at most MAX_COEFFICIENT_S; a layer pass must cost some time."""
    where = f"profile scheme {key}"
    if not re.fullmatch(r"tp[1-9][0-9]{0,6}-cp[1-9][0-9]{0,6}", key):
        raise UserError(f"{where}: the key must read tpT-cpC, e.g. tp2-cp1")
    f = Fields(data, where)
    counts = {"fwd": 3, "bwd": 3, "head_fwd": 2, "head_bwd": 2, "fwd_floor": 2, "bwd_floor": 2}
    f.only((*counts, "bwd_segment_tokens"))
    coef = {name: f.numbers(name, count=n, default=None if name in ("fwd", "bwd") else (0.0,) * n)
            for name, n in counts.items()}
    seg = f.optional_number("bwd_segment_tokens") or 0.0
    if seg > MAX_COEFFICIENT_S:
        raise f.fail("bwd_segment_tokens", f"at most {MAX_COEFFICIENT_S:g} seconds", seg)
    for name, values in coef.items():
        if max(values) > MAX_COEFFICIENT_S:
            raise f.fail(name, f"coefficients of at most {MAX_COEFFICIENT_S:g} seconds", list(values))
        if name in ("fwd", "bwd") and sum(values) <= 0:
            raise f.fail(name, "coefficients not all zero (a layer pass takes time)", list(values))
    return SchemeFit(**coef, bwd_segment_tokens=seg)


def _step_terms(data) -> StepTerms:
    """The step terms of a profile: finite, >= 0, at most MAX_COEFFICIENT_S each."""
    f = Fields(data, "profile step")
    f.only((*STEP_TERMS, "estimated"))
    pairs = {name: f.numbers(name, count=2, default=(0.0, 0.0)) for name in ("embed_fwd", "embed_bwd")}
    singles = {name: f.optional_number(name) or 0.0 for name in STEP_TERMS[2:]}
    for name, value in {**pairs, **singles}.items():
        values = value if isinstance(value, tuple) else (value,)
        if min(values) < 0 or max(values) > MAX_COEFFICIENT_S:
            raise f.fail(name, f"seconds in [0, {MAX_COEFFICIENT_S:g}]", value)
    estimated = f.mapping("estimated", default={})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in estimated.items()):
        raise f.fail("estimated", "an object of term names to strings", estimated)
    return StepTerms(**pairs, **singles, estimated=dict(estimated))


def scheme_key(tp: int, cp: int) -> str:
    return f"tp{tp}-cp{cp}"
