"""`lengthwise profile` and `--profile-file`: the fit recovers known coefficients from a fake
timer, reports its held-out error, and a measured profile changes what plan, simulate and
compare predict. One real CPU run of the torch measurer at tiny size."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lengthwise.cli import main
from lengthwise.commands import profile as profile_command
from lengthwise.cost import CostModel, Profile, SchemeFit
from lengthwise.cost.fit import Timing, fit_time, head_token_counts, measure_profile, predict, profile_chunks
from lengthwise.cost.flops import chunk_work
from lengthwise.plan.ir import Chunk, StepPlan
from lengthwise.files import write_atomic
from lengthwise.specs import MODEL_PRESETS, cluster_preset

FWD, BWD = (3e-12, 4e-8, 0.0), (7e-12, 9e-8, 0.0)  # no constant in the device line (cost/fit.fit_floor_time)
HEAD_FWD, HEAD_BWD = (2e-7, 3e-5), (5e-7, 4e-5)
ACT_PER_TOKEN_LAYER, KV_PER_TOKEN_LAYER = 1234.0, 512.0


class FakeMeasurer:
    """Times from known coefficients, optionally with a seeded multiplicative jitter."""

    layers = 3

    def __init__(self, jitter: float = 0.0):
        self.rng, self.jitter, self.chunks_timed = np.random.default_rng(7), jitter, []

    def _noise(self) -> float:
        return 1.0 + self.jitter * self.rng.uniform(-1, 1)

    def time_chunk(self, chunk):
        self.chunks_timed.append(str(chunk))
        w = chunk_work(chunk)
        return Timing(fwd_s=self.layers * predict(FWD, w.keys, w.tokens) * self._noise(),
                      bwd_s=self.layers * predict(BWD, w.keys, w.tokens) * self._noise(),
                      activation_bytes=self.layers * ACT_PER_TOKEN_LAYER * w.tokens + 4096)

    def time_head(self, tokens):
        return Timing(fwd_s=(HEAD_FWD[0] * tokens + HEAD_FWD[1]) * self._noise(),
                      bwd_s=(HEAD_BWD[0] * tokens + HEAD_BWD[1]) * self._noise(), activation_bytes=600.0 * tokens)

    def kv_bytes_per_token_layer(self):
        return KV_PER_TOKEN_LAYER

    def describe(self):
        return {"device": "fake", "dtype": "bfloat16", "backend": "varlen"}


def _grid():
    return profile_chunks(min_tokens=512, max_tokens=32768, max_context=131072)


def test_exact_timer_gives_back_its_coefficients():
    fitted = measure_profile(FakeMeasurer(), _grid(), head_token_counts(512, 16384), model_name="tiny")
    fit = fitted.profile.schemes["tp1-cp1"]
    for got, want in ((fit.fwd, FWD), (fit.bwd, BWD), (fit.head_fwd, HEAD_FWD), (fit.head_bwd, HEAD_BWD)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert all(e.max < 1e-6 for e in fitted.errors.values())
    assert fitted.profile.activation_bytes_per_token_layer == pytest.approx(ACT_PER_TOKEN_LAYER)
    assert fitted.profile.kv_bytes_per_token_layer == KV_PER_TOKEN_LAYER
    assert fitted.profile.meta["head_activation_bytes_per_token"] == pytest.approx(600.0)


def test_grid_varies_keys_independently_of_tokens():
    """Three or more key counts per token count, so a (keys), b (tokens), c (1) are separable."""
    by_tokens = {}
    for chunk in _grid():
        w = chunk_work(chunk)
        by_tokens.setdefault(w.tokens, set()).add(w.keys)
    assert len(by_tokens) == 7 and all(len(keys) >= 3 for keys in by_tokens.values())


def test_fit_minimises_relative_not_absolute_error():
    """A 1% error on the largest chunk must not cost the smallest one 50%."""
    keys, tokens = [100, 10_000, 1e8], [10, 100, 1e4]
    seconds = [predict(FWD, k, t) for k, t in zip(keys, tokens)]
    seconds[-1] *= 1.01
    coef = fit_time(keys, tokens, seconds)
    assert abs(predict(coef, keys[0], tokens[0]) / seconds[0] - 1) < 0.02


def test_hold_out_is_seeded_and_excluded_from_the_fit():
    a = measure_profile(FakeMeasurer(0.05), _grid(), [512, 1024, 2048], model_name="tiny", seed=3)
    b = measure_profile(FakeMeasurer(0.05), _grid(), [512, 1024, 2048], model_name="tiny", seed=3)
    held = [s.chunk for s in a.samples if s.held_out]
    assert held == [s.chunk for s in b.samples if s.held_out] and len(held) == round(0.25 * len(a.samples))
    assert a.errors["fwd"].count == len(held)


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_profile_command_with_fake_timer_recovers_coefficients(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile_command, "build_measurer", lambda args, spec: FakeMeasurer(jitter=0.02))
    out_path = tmp_path / "p.json"
    code, out, _ = _run(["profile", "--model", "tiny", "--out", str(out_path)], capsys)
    assert code == 0 and f"wrote {out_path}" in out and "held-out error mean" in out
    profile = Profile.load(out_path)
    fit = profile.fit_for(1, 1)
    np.testing.assert_allclose(fit.fwd[1:], FWD[1:], rtol=0.05)
    np.testing.assert_allclose(fit.bwd[1:], BWD[1:], rtol=0.05)
    np.testing.assert_allclose(fit.fwd[0], FWD[0], rtol=0.05)
    err = profile.meta["held_out_error"]
    assert err["fwd"]["count"] >= 5 and err["fwd"]["mean"] < 0.02 and err["bwd"]["max"] < 0.05
    assert profile.model == "tiny" and profile.meta["command"].startswith("lengthwise profile")


def _profile_file(tmp_path, scale: float = 10.0) -> str:
    """A tiny-model profile whose times are `scale` x a fixed fit."""
    fit = SchemeFit(fwd=tuple(scale * x for x in FWD), bwd=tuple(scale * x for x in BWD),
                    head_fwd=tuple(scale * x for x in HEAD_FWD), head_bwd=tuple(scale * x for x in HEAD_BWD))
    profile = Profile(device="fake", model="tiny", schemes={"tp1-cp1": fit})
    path = tmp_path / f"profile-{scale}.json"
    write_atomic(path, json.dumps(profile.to_dict()))
    return str(path)


def _write_plan(tmp_path, capsys, *extra) -> str:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, [300, 40, 17, 90, 500, 60, 33])))
    path = tmp_path / "plan.json"
    code, _, err = _run(["plan", "--planner", "packing", "--lengths", str(lengths), "--batch-size", "7", "--model", "tiny",
                         "--cluster", "cpu", "--out", str(path), *extra], capsys)
    assert code == 0, err
    return str(path)


def test_profile_file_sets_simulated_step_time_to_the_fitted_sum(tmp_path, capsys):
    """pp = 1, dp = 1: the step is each chunk's forward then backward, back to back."""
    plan_path, profile_path = _write_plan(tmp_path, capsys), _profile_file(tmp_path)
    _, analytic, _ = _run(["simulate", plan_path, "--json"], capsys)
    code, measured, _ = _run(["simulate", plan_path, "--json", "--profile-file", profile_path], capsys)
    plan, fit = StepPlan.load(plan_path), Profile.load(profile_path).fit_for(1, 1)
    layers = plan.model.num_layers
    expected = 0.0
    for chunk in plan.pipelines[0].chunks:
        w = chunk_work(chunk)
        for body, (hb, hc) in ((fit.fwd, fit.head_fwd), (fit.bwd, fit.head_bwd)):
            expected += layers * predict(body, w.keys, w.tokens) + hb * w.tokens + hc
    assert code == 0 and json.loads(measured)["step_time_s"] == pytest.approx(expected, rel=1e-12)
    assert json.loads(analytic)["step_time_s"] != pytest.approx(expected, rel=1e-3)


def test_profile_file_changes_the_chunkflow_grid_search_in_plan(tmp_path, capsys):
    grids = []
    for extra in ([], ["--profile-file", _profile_file(tmp_path)]):
        code, out, _ = _run(["plan", "--planner", "chunkflow", "--option", "chunk_size=auto", "--profile", "tiny",
                             "--batch-size", "16", "--model", "tiny", "--cluster", "cpu", "--json", *extra], capsys)
        assert code == 0
        grids.append([row["step_time_s"] for row in json.loads(out)["metrics"]["grid"]])
    assert len(grids[0]) == len(grids[1]) and all(a != pytest.approx(b, rel=1e-3) for a, b in zip(*grids))


def test_profile_file_changes_compare_step_times(tmp_path, capsys):
    steps = []
    for scale in (None, 10.0, 20.0):
        extra = ["--profile-file", _profile_file(tmp_path, scale)] if scale else []
        code, out, _ = _run(["compare", "--profile", "tiny", "--model", "tiny", "--cluster", "cpu", "--gpus", "1",
                             "--batch-size", "16", "--batches", "1", "--planners", "packing", "--no-pictures",
                             "--out", str(tmp_path / "report"), "--json", *extra], capsys)
        assert code == 0
        steps.append(json.loads(out)["planners"]["packing"]["step_time_s"])
        source = json.loads(out)["setup"]["time_model"]  # the report says which times it used
        assert (source["efficiency"], source["measured_on"]) == (("profile", "fake") if scale else
                                                                 ("built-in curve", "NVIDIA H200"))
    assert steps[0] != pytest.approx(steps[1], rel=1e-3)
    assert steps[2] == pytest.approx(2 * steps[1], rel=1e-9)  # every fitted term doubled


def test_profile_of_another_model_is_a_one_line_error(tmp_path, capsys):
    plan_path = _write_plan(tmp_path, capsys)
    other = Profile(device="fake", model="qwen2.5-7b", schemes={})
    path = tmp_path / "other.json"
    write_atomic(path, json.dumps(other.to_dict()))
    code, _, err = _run(["simulate", plan_path, "--profile-file", str(path)], capsys)
    assert code == 2 and "measured for model qwen2.5-7b, not tiny" in err and len(err.strip().splitlines()) == 1


def test_bad_profile_sizes_exit_2(tmp_path, capsys):
    for argv in (["--min-tokens", "64", "--max-tokens", "32"], ["--repeats", "0"], ["--holdout", "1.5"]):
        code, _, err = _run(["profile", "--model", "tiny", "--device", "cpu", "--max-context", "256",
                             "--out", str(tmp_path / "x.json"), *argv], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, argv


def test_torch_measurer_on_cpu_writes_a_loadable_profile(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)  # the test machine's cores are shared
    out_path = tmp_path / "tiny.json"
    code, out, _ = _run(["profile", "--model", "tiny", "--device", "cpu", "--layers", "1", "--min-tokens", "16",
                         "--max-tokens", "64", "--max-context", "256", "--repeats", "1", "--warmup", "0",
                         "--out", str(out_path)], capsys)
    assert code == 0 and "held-out error" in out
    profile = Profile.load(out_path)
    spec = MODEL_PRESETS["tiny"]
    assert profile.kv_bytes_per_token_layer == 2 * spec.kv_dim * 4  # float32 k and v
    assert profile.activation_bytes_per_token_layer > spec.hidden * 4  # at least the layer's input
    assert profile.meta["dtype"] == "float32" and profile.meta["backend"] == "cpu-flash"
    assert profile.meta["backend_check"]["passed"] and "cpu-flash vs reference: passed" in out
    assert len(profile.meta["samples"]) == 16  # 3 sizes x (1 document, 16 and 4 packed, 2 slices), one 64-packed
    cost = CostModel(model=spec, cluster=cluster_preset("cpu"), profile=profile)
    assert cost.forward_time(Chunk.parse("0[0:64]"), layers=4) > 0


def test_a_chunks_timed_runs_hold_only_its_layers(monkeypatch):
    """The chunk's rotary tables and attention index are made once, before its timed runs (the
    stage makes them once per chunk; the simulator charges them as the per-chunk host term):
    within the warm-up and repeats only the layers run."""
    torch = pytest.importorskip("torch")
    from lengthwise.runtime import profile as profile_module
    from lengthwise.runtime.layout import RowIndex

    measurer = profile_module.TorchMeasurer(MODEL_PRESETS["tiny"], layers=2, device="cpu", repeats=3, warmup=1)
    made, build, rope = [], RowIndex.build, measurer.model.rope
    monkeypatch.setattr(RowIndex, "build", classmethod(lambda cls, *a, **k: made.append("index") or build(*a, **k)))
    monkeypatch.setattr(measurer.model, "rope", lambda *a: made.append("rope") or rope(*a))
    runs = []
    run = measurer._chunk_run
    monkeypatch.setattr(measurer, "_chunk_run", lambda *a: runs.append(len(made)) or run(*a))
    timing = measurer.time_chunk(Chunk.parse("0[0:24]+1[0:8]"))
    assert timing.fwd_s > 0 and timing.bwd_s > 0
    assert sorted(made) == ["index", "rope"] and runs == [2] * 4  # made before the 4 runs, never inside


def test_a_chained_profile_measures_one_whole_region():
    """With --compile-chain the measurer times CHAIN_LAYERS layers however few --layers asks
    for: one region's call shared by four layers, as in a deep stage, not by two."""
    pytest.importorskip("torch")
    from lengthwise.runtime import profile as profile_module
    from lengthwise.runtime.model import CHAIN_LAYERS

    spec = MODEL_PRESETS["tiny"]
    chained = profile_module.TorchMeasurer(spec, layers=2, device="cpu", compile=True, compile_chain=True)
    assert chained.layers == min(CHAIN_LAYERS, spec.num_layers) > 2 and chained.describe()["chained"]
    plain = profile_module.TorchMeasurer(spec, layers=2, device="cpu", compile=True)
    assert plain.layers == 2 and not plain.describe()["chained"]


def test_planning_side_of_profiles_imports_no_torch():
    code = ("import sys, lengthwise.cost.fit, lengthwise.commands.profile, lengthwise.commands.plan, "
            "lengthwise.commands.compare, lengthwise.commands.simulate; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
