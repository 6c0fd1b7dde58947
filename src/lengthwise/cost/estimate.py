"""Complete a profile written before the step terms and host floors existed (cost/time.py), or
fitted while the device's line still had a constant (cost/fit.fit_floor_time says why it has none).

    profile = complete_profile(Profile.load("old.json"), model_preset("qwen2.5-0.5b"))
    profile.step.estimated        # {"optimizer_s": "7 x 2 bytes per parameter at 4.8 TB/s (H200)", ...}
    profile.meta["completed"]     # what was refitted or estimated, for reports

Nothing here is fitted to step times. The layer terms are refitted from the profile's own raw
samples (meta.samples, with their recorded hold-out), a measurement; the other terms are
physical estimates from the model's shapes, the profile's dtype and the device's nominal memory
bandwidth (cost/time.DEVICE_BANDWIDTH):

- the backward's key slicing, per segment x token of a row (`SLICE_PASSES`), in profiles of
  code that packed each layer's keys per segment (`packs_keys_per_segment`): the bytes it
  moves at `SLICE_BANDWIDTH_SHARE` of the nominal bandwidth (the nominal rate; its docstring
  says how measured steps checked it), known in the refit, so the fitted line is what remains;
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
from lengthwise.errors import UserError
from lengthwise.fields import Fields
from lengthwise.plan.ir import Chunk
from lengthwise.specs import ModelSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
ADAMW_TENSORS = 7
"""Tensors of a parameter's size fused AdamW reads or writes per step (module docstring)."""


def complete_profile(profile: Profile, model: ModelSpec, *, slice_share: float | None = None) -> Profile:
    """The profile with the slicing term estimated (where its code sliced keys per segment)
    and the layer terms refitted from its samples where it lacks them, and estimated step
    terms where it has none; unchanged (the same object) when it lacks nothing.
    `slice_share`: the slicing's share of nominal bandwidth (default SLICE_BANDWIDTH_SHARE)."""
    fit = profile.schemes.get(SCHEME)
    dtype = str(profile.meta.get("dtype", "bfloat16"))
    share = SLICE_BANDWIDTH_SHARE if slice_share is None else slice_share
    seg = segment_token_seconds(model, device=profile.device, dtype=dtype, share=share)
    needs_seg = fit is not None and fit.bwd_segment_tokens == 0.0 and seg > 0.0 and packs_keys_per_segment(profile)
    needs_floor = fit is not None and not fit.has_floor
    constant = fit is not None and fit.has_floor and (fit.fwd[2] > 0.0 or fit.bwd[2] > 0.0)
    refit = (needs_seg or needs_floor or constant) and bool(profile.meta.get("samples"))
    if profile.step is not None and not refit:
        return profile
    meta, schemes = dict(profile.meta), dict(profile.schemes)
    completed = dict(meta.get("completed", {}))
    if refit:
        seg = seg if needs_seg else fit.bwd_segment_tokens
        schemes[SCHEME], errors = _refit(profile, fit, seg)
        completed["layers"] = ("device line refitted without its constant (fitted before cost/fit.fit_floor_time "
                               "dropped it)" if constant and not (needs_seg or needs_floor) else
                               "host floor and straight line refitted from this profile's samples (cost/fit.fit_layers)")
        if needs_seg:
            completed["bwd_segment_tokens"] = (f"2 (K, V) x {SLICE_PASSES} passes x {model.kv_dim} x "
                                               f"{DTYPE_BYTES.get(dtype, 2)} bytes per segment x token at "
                                               f"{share:.2f} x {device_bandwidth(profile.device) / 1e12:.3g} TB/s")
        meta["held_out_error_refit"] = {k: dataclasses.asdict(v) for k, v in errors.items()}
    step = profile.step
    if step is None:
        step = estimate_step_terms(model, device=profile.device, dtype=dtype)
        completed.update(step.estimated)
    meta["completed"] = completed
    return dataclasses.replace(profile, schemes=schemes, step=step, meta=meta)


SCHEME = "tp1-cp1"
"""The scheme `lengthwise profile` measures (others, if any, are kept as they are)."""
SLICE_PASSES = 4
"""Whole-row passes per segment in the backward of the key row's slices (runtime/layout.
pack_keys: each slice's backward allocates a zero gradient of the whole row, 1 write, and
autograd adds it into the sum, 2 reads and 1 write), for K and for V."""


SLICE_BANDWIDTH_SHARE = 1.0
"""Share of the nominal bandwidth the key slicing's kernels reach: the nominal rate itself. Each
segment of a row costs, per layer, six small kernels (for K and V: a row-sized zero fill, a
copy into it, an add into the sum). The profiles cannot measure it (their rows hold 1, 4 and 16
segments, where slicing is under a tenth of a layer), so it was once calibrated on the
2026-11-27 H200 fine-tune steps of Qwen2.5-0.5B (one chunk of 64 documents), which gave 0.35
while the layer fit's device line kept a constant. Since the device line has none
(cost/fit.fit_floor_time), the same calibration runs into its upper bound, 1.0: the steps ask
for no slower slicing than the nominal rate, and nothing here is taken from step times any
more. `python benchmarks/time_model_h200.py` derives it again (`slice_share_from_steps`,
checked by tests/test_time_model_h200.py)."""


def packs_keys_per_segment(profile: Profile) -> bool:
    """Whether the code that measured `profile` joined each layer's keys segment by segment
    (runtime/layout.pack_keys), so its backward pays the slicing term: the reference backend
    always; the flash backends before the attention read the row's keys as they are (commit
    5a53b77, which also added `compiled` to the measurer's description in meta)."""
    return profile.meta.get("backend") == "reference" or "compiled" not in profile.meta


def segment_token_seconds(model: ModelSpec, *, device: str, dtype: str, share: float = SLICE_BANDWIDTH_SHARE) -> float:
    """e of SchemeFit.bwd_segment_tokens: 2 x SLICE_PASSES x kv_dim x dtype bytes per segment
    and token of a row, at `share` of the device's bandwidth (0 when it is unknown)."""
    bw = device_bandwidth(device)
    return 0.0 if bw is None else 2 * SLICE_PASSES * model.kv_dim * DTYPE_BYTES.get(dtype, 2) / (bw * share)


def _refit(profile: Profile, fit, seg: float):
    """The scheme's layer terms refitted from meta.samples with the known slicing term, on
    the samples' recorded hold-out."""
    samples = profile_samples(profile)
    train = [s for s in samples if not s.held_out] or samples
    test = [s for s in samples if s.held_out]
    layers, errors = fit_layers(train, test, seg)
    return dataclasses.replace(fit, **layers, bwd_segment_tokens=seg), errors


def profile_samples(profile: Profile) -> list[Sample]:
    """The timed chunks of meta.samples, checked, with their recorded hold-out."""
    raw = profile.meta.get("samples")
    if not isinstance(raw, list):
        raise UserError("profile meta.samples must be a list of timed chunks")
    return [_sample(d, i) for i, d in enumerate(raw)]


SAMPLE_RANGES = {"tokens": (1, 2**40), "keys": (0, 2**80), "fwd_s": (1e-9, 1e3), "bwd_s": (1e-9, 1e3)}
"""What a timed chunk of meta.samples may hold (a damaged file would overflow the fit)."""


def _sample(d, i: int) -> Sample:
    """meta.samples[i], checked (a damaged file is a one-line error, not a traceback)."""
    f = Fields(d, f"profile meta.samples[{i}]")
    chunk = Chunk.parse(f.string("chunk"))
    values = {k: f.number(k) for k in ("tokens", "keys", "fwd_s", "bwd_s")}
    for key, (lo, hi) in SAMPLE_RANGES.items():
        if not lo <= values[key] <= hi:
            raise f.fail(key, f"a number in [{lo:g}, {hi:g}]", values[key])
    return Sample(chunk=str(chunk), tokens=values["tokens"], keys=values["keys"],
                  context_free=bool(d.get("context_free", True)), fwd_s=values["fwd_s"], bwd_s=values["bwd_s"],
                  activation_bytes=None, peak_bytes=None, held_out=f.data.get("held_out") is True,
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
