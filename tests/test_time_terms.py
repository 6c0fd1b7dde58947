"""The time model's host floor and step terms (cost/time.py, cost/fit.py, cost/estimate.py,
sim/terms.py): the fit recovers a known floor, old profiles load and are completed with their
estimates named, bad step terms are one-line errors, the simulator adds each term where the
step runs it, and without a profile nothing changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lengthwise.cli import main
from lengthwise.cost import CostModel, Profile, SchemeFit
from lengthwise.cost.efficiency import fit_throughput
from lengthwise.cost.estimate import SLICE_BANDWIDTH_SHARE, complete_profile, estimate_step_terms
from lengthwise.cost.fit import Timing, fit_floor_time, head_token_counts, measure_profile, profile_chunks
from lengthwise.cost.flops import chunk_work
from lengthwise.cost.time import StepTerms, Throughput, layer_seconds
from lengthwise.errors import UserError
from lengthwise.plan.ir import Chunk
from lengthwise.files import write_atomic
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.sim import simulate_plan
from lengthwise.sim.terms import step_time_terms
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset, model_preset

WORK, FLOOR = (3e-12, 4e-8, 0.0), (2e-3, 6e-5)  # the device's line has no constant (fit.fit_floor_time)


class FloorMeasurer:
    """Times max(floor, line) per layer exactly, plus known step terms."""

    layers = 2

    def time_chunk(self, chunk):
        w = chunk_work(chunk)
        t = self.layers * layer_seconds(WORK, FLOOR, w.keys, w.tokens, w.segments)
        return Timing(fwd_s=t, bwd_s=2 * t, activation_bytes=100.0 * w.tokens)

    def time_head(self, tokens):
        return Timing(fwd_s=1e-7 * tokens + 1e-4, bwd_s=2e-7 * tokens + 1e-4)

    def time_embed(self, tokens):
        return Timing(fwd_s=1e-9 * tokens + 1e-5, bwd_s=3e-9 * tokens + 2e-5)

    def time_optimizer(self):
        return 0.004, 0.0005

    def time_chunk_overhead(self):
        return 3e-4

    def kv_bytes_per_token_layer(self):
        return 512.0

    def describe(self):
        return {"device": "fake", "dtype": "bfloat16", "backend": "varlen"}


def test_fit_recovers_a_host_floor_and_the_line_above_it():
    fitted = measure_profile(FloorMeasurer(), profile_chunks(min_tokens=512, max_tokens=32768, max_context=131072),
                             head_token_counts(512, 16384), model_name="tiny")
    fit = fitted.profile.schemes["tp1-cp1"]
    np.testing.assert_allclose(fit.fwd_floor, FLOOR, rtol=1e-3)
    np.testing.assert_allclose(fit.fwd[1:], WORK[1:], rtol=1e-3)
    assert fitted.errors["fwd"].max < 1e-3 and fitted.errors["bwd"].max < 1e-3
    step = fitted.profile.step
    assert step.optimizer_s == 0.004 and step.chunk_overhead_s == 3e-4 and not step.estimated
    np.testing.assert_allclose(step.embed_bwd, (3e-9, 2e-5), rtol=1e-6)
    again = Profile.from_dict(json.loads(json.dumps(fitted.profile.to_dict())))
    assert again.schemes["tp1-cp1"] == fit and again.step == step


def test_flat_small_chunks_need_the_floor():
    """Data flat below a knee: the straight line's intercept cannot follow both sides."""
    tokens = np.array([512, 1024, 2048, 4096, 8192, 16384, 32768], float)
    seconds = np.maximum(2e-3, 2e-7 * tokens)
    work, floor = fit_floor_time(np.zeros(7), tokens, np.ones(7), seconds)
    predicted = np.maximum(floor[0] + floor[1], work[1] * tokens + work[2])
    assert np.abs(predicted / seconds - 1).max() < 1e-3


def _old_profile(device="NVIDIA H200") -> Profile:
    """A profile as written before host floors and step terms, with raw samples."""
    fitted = measure_profile(FloorMeasurer(), profile_chunks(min_tokens=512, max_tokens=8192, max_context=32768),
                             [512, 1024, 2048], model_name="qwen2.5-0.5b")
    d = fitted.profile.to_dict()
    d.pop("step")
    d["device"] = device
    d["schemes"] = {"tp1-cp1": {k: v for k, v in d["schemes"]["tp1-cp1"].items()
                                if k in ("fwd", "bwd", "head_fwd", "head_bwd")}}
    return Profile.from_dict(json.loads(json.dumps(d)))


def test_old_profile_loads_and_completion_names_every_estimate():
    old = _old_profile()
    assert old.step is None and not old.schemes["tp1-cp1"].has_floor
    spec = model_preset("qwen2.5-0.5b")
    done = complete_profile(old, spec)
    fit = done.schemes["tp1-cp1"]
    bound = 8 * spec.kv_dim * 2 / 4.8e12  # 2 (K, V) x 4 passes x kv_dim x 2 bytes at H200 bandwidth
    assert fit.has_floor and fit.bwd_segment_tokens == pytest.approx(bound / SLICE_BANDWIDTH_SHARE)
    assert set(done.step.estimated) == {"embed_fwd", "embed_bwd", "optimizer_s", "grad_norm_s", "chunk_overhead_s"}
    assert done.step.optimizer_s == pytest.approx(7 * 2 * spec.num_params / 4.8e12)
    assert "layers" in done.meta["completed"] and done.meta["held_out_error_refit"]["fwd"]["count"] > 0
    assert complete_profile(done, spec) is done   # nothing left to complete


def test_profile_of_code_that_reads_the_row_keys_whole_gets_no_slicing_term():
    """Since the flash backends read a row's keys as they are (the measurer's meta names
    `compiled` from then on), no segment's keys are sliced and joined: the term stays 0; the
    reference backend still joins them."""
    old = _old_profile()
    for backend, expected in (("varlen", 0.0), ("reference", 1.0)):
        new = Profile.from_dict({**old.to_dict(), "meta": {**old.meta, "compiled": True, "backend": backend}})
        seg = complete_profile(new, model_preset("qwen2.5-0.5b")).schemes["tp1-cp1"].bwd_segment_tokens
        assert (seg > 0.0) == bool(expected), backend


def test_efficiency_fit_recovers_a_known_curve():
    """Chunk times made by the analytic model with known coefficients, every chunk above a
    negligible host floor: cost/efficiency.fit_throughput gives the coefficients back."""
    spec, truth = model_preset("qwen2.5-0.5b"), Throughput(linear_mfu=0.55, half_tokens=700.0, attention_mfu=0.4,
                                                           layer_overhead_s=2e-4)
    cost = CostModel(model=spec, cluster=cluster_preset("h100", 1), throughput=truth)
    samples = []
    for chunk in profile_chunks(min_tokens=512, max_tokens=16384, max_context=65536):
        w = chunk_work(chunk)
        fwd, bwd = (float(cost.works_time([w.tokens], [w.keys], layers=1, backward=b)[0]) for b in (False, True))
        samples.append({"chunk": str(chunk), "tokens": w.tokens, "keys": w.keys, "fwd_s": fwd, "bwd_s": bwd})
    fit = SchemeFit(fwd=WORK, bwd=WORK, fwd_floor=(1e-9, 0.0), bwd_floor=(1e-9, 0.0))
    profile = Profile(device="fake", model=spec.name, schemes={"tp1-cp1": fit}, meta={"samples": samples})
    got = fit_throughput([(spec, profile)], peak_tflops=989.0, measured_on="fake").throughput
    for name in ("linear_mfu", "half_tokens", "attention_mfu", "layer_overhead_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-3), name


def test_unknown_device_estimates_nothing_and_says_so():
    terms = estimate_step_terms(model_preset("qwen2.5-0.5b"), device="fake", dtype="bfloat16")
    assert terms.optimizer_s == 0.0 and "no memory bandwidth known" in terms.estimated["optimizer_s"]


@pytest.mark.parametrize("step", [{"optimizer_s": -1.0}, {"optimizer_s": float("inf")}, {"embed_fwd": [1.0]},
                                  {"estimated": {"x": 3}}, {"typo_s": 1.0}])
def test_bad_step_terms_are_one_line_errors(step):
    d = Profile(device="fake", model="tiny", schemes={"tp1-cp1": SchemeFit(fwd=WORK, bwd=WORK)}).to_dict()
    d["step"] = step
    with pytest.raises(UserError) as err:
        Profile.from_dict(json.loads(json.dumps(d, allow_nan=True)))
    assert "\n" not in str(err.value)


def _plan(spec, cost, lengths, chunk_size):
    request = PlanRequest(lengths=lengths, model=spec, cluster=cost.cluster, scheme=ParallelScheme(), cost=cost,
                          context_length=4096, options={"chunk_size": chunk_size})
    return get_planner("chunkflow")(request)


def test_simulated_one_stage_step_adds_every_term_once():
    spec = model_preset("qwen2.5-0.5b")
    profile = complete_profile(_old_profile(), spec)
    profile.step = StepTerms(embed_fwd=(1e-9, 1e-5), embed_bwd=(2e-9, 1e-5), chunk_overhead_s=1e-3,
                             optimizer_s=0.01, grad_norm_s=0.002)
    cost = CostModel(model=spec, cluster=cluster_preset("h100", 1), profile=profile)
    plan = _plan(spec, cost, [3000, 700, 90, 2500, 40, 1200], 1024)
    result, terms = simulate_plan(plan, cost), step_time_terms(plan, cost)
    actions = sum(len(a) for a in plan.pipelines[0].stages)
    assert terms["host"] == pytest.approx(actions * 1e-3)
    assert terms["optimizer"] == pytest.approx(0.01) and terms["grad_norm"] == pytest.approx(0.002)
    assert result.step_end_s == pytest.approx(0.012)
    assert result.step_time_s == pytest.approx(sum(terms.values()), rel=1e-12)


def test_analytic_model_is_unchanged_by_the_step_terms():
    spec = MODEL_PRESETS["tiny"]
    cost = CostModel(model=spec, cluster=cluster_preset("cpu"))
    plan = _plan(spec, cost, [300, 70, 9, 250, 4, 120], 128)
    result = simulate_plan(plan, cost)
    assert result.step_end_s == 0.0
    assert cost.step_end_time(layers=spec.num_layers, first=True, last=True) == 0.0
    assert sum(step_time_terms(plan, cost).values()) == pytest.approx(result.step_time_s, rel=1e-12)


def test_simulate_with_an_old_profile_file_completes_it(tmp_path, capsys):
    path = tmp_path / "old.json"
    write_atomic(path, json.dumps(_old_profile().to_dict()))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("3000\n700\n90\n2500\n")
    plan = tmp_path / "plan.json"
    assert main(["plan", "--planner", "packing", "--lengths", str(lengths), "--batch-size", "4", "--model",
                 "qwen2.5-0.5b", "--cluster", "h100", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan), "--json", "--profile-file", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["step_end_s"] > 0
