"""Complete a profile written before the step terms and host floors existed (cost/time.py).

    profile = complete_profile(Profile.load("old.json"), model_preset("qwen2.5-0.5b"))
    profile.step.estimated        # {"optimizer_s": "7 x 2 bytes per parameter at 4.8 TB/s (H200)", ...}
    profile.meta["completed"]     # what was refitted or estimated, for reports

Nothing here is fitted to step times. The layer floors are refitted from the profile's own raw
samples (meta.samples, with their recorded hold-out), a measurement; the other terms are
physical estimates from the model's shapes, the profile's dtype and the device's nominal memory
bandwidth (cost/time.DEVICE_BANDWIDTH):

- optimizer step: fused AdamW on weights, gradients and moments all in the profile's dtype (what
  `torch.optim.AdamW(model.parameters(), fused=True)` keeps for a bf16 model, as the benchmarks
  and a one-device run use): it reads weight, gradient and two moments and writes weight and two
  moments, 7 x dtype bytes per parameter;
- gradient norm: reads each gradient once, 1 x dtype bytes per parameter;
- embedding: forward reads and writes tokens x hidden values; backward zeroes the table's
  gradient (vocab x hidden), reads the incoming gradient and adds it into the table's rows;
- per-chunk host overhead: 0 (not measured: a stage's work around its layers is small beside
  the layers' own host floor, which the profile measured).

An unknown device (no bandwidth) leaves the estimated terms at 0 and says so.
"""

from __future__ import annotations

import dataclasses

from lengthwise.cost.fit import Sample, fit_layers
from lengthwise.cost.time import Profile, StepTerms, device_bandwidth
from lengthwise.plan.ir import Chunk
from lengthwise.specs import ModelSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
ADAMW_TENSORS = 7
"""Tensors of a parameter's size fused AdamW reads or writes per step (module docstring)."""


def complete_profile(profile: Profile, model: ModelSpec) -> Profile:
    """The profile with host floors refitted from its samples where it has none, and estimated
    step terms where it has none; unchanged (the same object) when it lacks neither."""
    needs_floor = any(not fit.has_floor for fit in profile.schemes.values()) and profile.meta.get("samples")
    if profile.step is not None and not needs_floor:
        return profile
    meta = dict(profile.meta)
    completed = dict(meta.get("completed", {}))
    schemes = dict(profile.schemes)
    if needs_floor:
        schemes, errors = _refit_floors(profile)
        completed["layers"] = "host floor refitted from this profile's samples (cost/fit.fit_layers)"
        meta["held_out_error_refit"] = {k: dataclasses.asdict(v) for k, v in errors.items()}
    step = profile.step
    if step is None:
        step = estimate_step_terms(model, device=profile.device, dtype=str(meta.get("dtype", "bfloat16")))
        completed.update(step.estimated)
    meta["completed"] = completed
    return dataclasses.replace(profile, schemes=schemes, step=step, meta=meta)


def _refit_floors(profile: Profile):
    """tp1-cp1's layer terms refitted from meta.samples (the only scheme `lengthwise profile`
    measures); other schemes are kept."""
    samples = [_sample(d) for d in profile.meta["samples"]]
    train = [s for s in samples if not s.held_out] or samples
    test = [s for s in samples if s.held_out]
    layers, errors = fit_layers(train, test)
    schemes = dict(profile.schemes)
    key = "tp1-cp1"
    if key in schemes:
        schemes[key] = dataclasses.replace(schemes[key], **layers)
    return schemes, errors


def _sample(d: dict) -> Sample:
    chunk = Chunk.parse(d["chunk"])
    return Sample(chunk=d["chunk"], tokens=float(d["tokens"]), keys=float(d["keys"]),
                  context_free=bool(d.get("context_free", True)), fwd_s=float(d["fwd_s"]), bwd_s=float(d["bwd_s"]),
                  activation_bytes=None, peak_bytes=None, held_out=bool(d.get("held_out", False)),
                  segments=len(chunk.segments))


def estimate_step_terms(model: ModelSpec, *, device: str, dtype: str) -> StepTerms:
    """StepTerms from the model's shapes and the device's nominal bandwidth (module docstring)."""
    bw, size = device_bandwidth(device), DTYPE_BYTES.get(dtype, 2)
    if bw is None:
        reason = f"not estimated: no memory bandwidth known for device {device!r}; taken as 0"
        return StepTerms(estimated={k: reason for k in ("embed_fwd", "embed_bwd", "optimizer_s", "grad_norm_s")}
                         | {"chunk_overhead_s": "not measured; taken as 0"})
    params, row = model.num_params, model.hidden * size
    tb = f"{bw / 1e12:.3g} TB/s ({device})"
    return StepTerms(
        embed_fwd=(2 * row / bw, 0.0), embed_bwd=(3 * row / bw, model.vocab * row / bw),
        optimizer_s=ADAMW_TENSORS * size * params / bw, grad_norm_s=size * params / bw,
        estimated={"embed_fwd": f"reads and writes tokens x hidden x {size} bytes at {tb}",
                   "embed_bwd": f"zeroes vocab x hidden, reads and adds tokens x hidden, x {size} bytes at {tb}",
                   "optimizer_s": f"fused AdamW: {ADAMW_TENSORS} x {size} bytes x {params:,} parameters at {tb}",
                   "grad_norm_s": f"reads {size} bytes x {params:,} gradients at {tb}",
                   "chunk_overhead_s": "not measured; taken as 0"})
