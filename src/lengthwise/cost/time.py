"""Compute time of a chunk on one stage: analytic throughput curve, or a measured profile.

Analytic (hydraulis.txt appendix C, infinipipe.txt appendix B): small GEMMs under-use the GPU, so
the achieved fraction of peak rises with the tokens each GPU multiplies at once and falls with
the TP degree, which shrinks every GEMM: eff(x) = linear_mfu * x / (x + half_tokens * tp), with x
the chunk's tokens per GPU. Attention runs at `attention_mfu` of peak. Each layer adds a fixed
kernel-launch overhead. Defaults are round numbers typical of bf16 training on Hopper-class GPUs
(about 60% of peak for large GEMMs, half of that at 256 tokens); `lengthwise profile` measures
real ones.

Profiled (hydraulis.txt B.2): T(l) = a*l^2 + b*l + c per parallel scheme. For a packed chunk we
use its attention pairs in place of l^2/2 (the quadratic term is attention, which does not cross
documents), so per layer T = a * keys + b * tokens + c, fitted separately for forward and backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from lengthwise.errors import UserError
from lengthwise.fields import Fields
from lengthwise.plan.ir import read_json


@dataclass(kw_only=True)
class Throughput:
    """The analytic throughput curve."""

    linear_mfu: float = 0.6
    """Fraction of peak reached by large GEMMs."""
    half_tokens: float = 256.0
    """Tokens per GPU (at tp = 1) at which GEMMs reach half of linear_mfu."""
    attention_mfu: float = 0.45
    """Fraction of peak reached by flash-style attention."""
    layer_overhead_s: float = 40e-6
    """Fixed time per layer per pass (kernel launches), seconds."""

    def linear_efficiency(self, tokens_per_gpu: float, tp: int) -> float:
        x = max(tokens_per_gpu, 1.0)
        return self.linear_mfu * x / (x + self.half_tokens * tp)


@dataclass(kw_only=True)
class SchemeFit:
    """Per-layer seconds = a * keys + b * tokens + c, for forward and backward."""

    fwd: tuple[float, float, float]
    bwd: tuple[float, float, float]
    head_fwd: tuple[float, float] = (0.0, 0.0)
    """LM head seconds = b * tokens + c (last stage)."""
    head_bwd: tuple[float, float] = (0.0, 0.0)


@dataclass(kw_only=True)
class Profile:
    """Measured cost coefficients for one model on one device (written by `lengthwise profile`)."""

    device: str = "unknown"
    model: str = "unknown"
    schemes: dict[str, SchemeFit] = field(default_factory=dict)
    """Keyed by scheme_key(tp, cp)."""
    activation_bytes_per_token_layer: float | None = None
    kv_bytes_per_token_layer: float | None = None
    meta: dict = field(default_factory=dict)

    def fit_for(self, tp: int, cp: int) -> SchemeFit | None:
        return self.schemes.get(scheme_key(tp, cp))

    def to_dict(self) -> dict:
        return {
            "format": "lengthwise.profile/1", "device": self.device, "model": self.model,
            "schemes": {k: vars(v) for k, v in self.schemes.items()},
            "activation_bytes_per_token_layer": self.activation_bytes_per_token_layer,
            "kv_bytes_per_token_layer": self.kv_bytes_per_token_layer, "meta": self.meta,
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
                "kv_bytes_per_token_layer", "meta"))
        schemes = {key: _scheme_fit(key, v) for key, v in f.mapping("schemes").items()}
        byte_fields = ("activation_bytes_per_token_layer", "kv_bytes_per_token_layer")
        for name in byte_fields:
            value = f.optional_number(name)
            if value is not None and value > 2**40:   # 0 means not measured (the analytic model's)
                raise f.fail(name, "a number of bytes in [0, 2^40]", value)
        return cls(device=f.string("device", default="unknown"), model=f.string("model", default="unknown"),
                   schemes=schemes, activation_bytes_per_token_layer=f.optional_number(byte_fields[0]),
                   kv_bytes_per_token_layer=f.optional_number(byte_fields[1]), meta=f.mapping("meta", default={}))

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
    f.only(("fwd", "bwd", "head_fwd", "head_bwd"))
    counts = {"fwd": 3, "bwd": 3, "head_fwd": 2, "head_bwd": 2}
    coef = {name: f.numbers(name, count=n, default=(0.0,) * n if name.startswith("head") else None)
            for name, n in counts.items()}
    for name, values in coef.items():
        if max(values) > MAX_COEFFICIENT_S:
            raise f.fail(name, f"coefficients of at most {MAX_COEFFICIENT_S:g} seconds", list(values))
        if name in ("fwd", "bwd") and sum(values) <= 0:
            raise f.fail(name, "coefficients not all zero (a layer pass takes time)", list(values))
    return SchemeFit(**coef)


def scheme_key(tp: int, cp: int) -> str:
    return f"tp{tp}-cp{cp}"
