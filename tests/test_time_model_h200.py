"""The time model against the first H200 run's measured steps (benchmarks/results/
h200-2026-11-27/README.md; the reconstruction is benchmarks/time_model_h200.py's).

Each measured step's global batch is drawn again with the project's sampler (chunkflow-eval
lengths, seed 0, 64 sequences, 32K context, truncated, as the benchmarks drew them) and planned
as the benchmark planned it (with the profile as it was, so the same plan); the reconstruction
is checked against what the files recorded (tokens, longest sequence, chunks, ChunkSize). The
plan is then simulated with that profile completed (cost/estimate.py: host floors refitted from
its samples, step terms estimated from bandwidth) and compared with the measured step, counting
only what the measurement ran: bench_gpu_finetune.py times run_step + the optimizer step (no
gradient norm), sim_fidelity.py times run_step alone.

Target (issue 26): every step within 10%, per-layer held-out error <= 5% mean. The key
slicing's share of the bandwidth (cost/estimate.SLICE_BANDWIDTH_SHARE) is calibrated on the 6
0.5B fine-tune steps; the test re-derives it. Fits that miss the target are marked
xfail(strict) with their residual, so the day they pass the test says so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lengthwise.cost import Profile, Throughput
from lengthwise.cost.efficiency import rounded
from lengthwise.cost.estimate import SLICE_BANDWIDTH_SHARE, complete_profile
from lengthwise.specs import model_preset

_spec = importlib.util.spec_from_file_location(
    "time_model_h200", Path(__file__).resolve().parents[1] / "benchmarks" / "time_model_h200.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
DATA, TARGET, _json = bench.DATA, bench.TARGET, bench._json

ROWS = bench.h200_rows()


@pytest.fixture(scope="module")
def predictions() -> dict:
    return {row["id"]: bench.predict_row(row) for row in ROWS}


def test_batches_and_plans_are_the_measured_ones(predictions):
    """The sampler and planner give back the batches the files recorded."""
    bench = _json("gpu_finetune_0.5b_32k.json")["models"]["qwen2.5-0.5b"]["runs"]
    for row in ROWS:
        got = predictions[row["id"]]
        assert max(got["lengths"]) == row["longest"] and len(got["lengths"]) == 64, row["id"]
        if row.get("chunk_size") is not None and row["planner"] == "chunkflow":
            assert got["plan"].metrics["chunk_size"] == row["chunk_size"], row["id"]
        if "tokens" in row:
            assert sum(got["lengths"]) == row["tokens"] and len(got["plan"].pipelines[0].chunks) == row["chunks"]
    timed = [p for p in predictions if p.startswith("0.5b-packing")]
    assert sum(sum(predictions[p]["lengths"]) for p in timed) == next(r["tokens"] for r in bench
                                                                       if r["system"] == "packing")


def test_one_stage_step_is_the_sum_of_its_terms(predictions):
    for row in ROWS:
        got = predictions[row["id"]]
        run = got["terms"]["grad_norm"] + (0.0 if row["optimizer"] else got["terms"]["optimizer"])
        assert got["predicted"] + run == pytest.approx(sum(got["terms"].values()), rel=1e-12)
        assert got["terms"]["layers"] > got["terms"]["head"] > got["terms"]["optimizer"] > 0


@pytest.mark.parametrize("row", [pytest.param(r, id=r["id"]) for r in ROWS])
def test_h200_step_within_target(row, predictions):
    predicted = predictions[row["id"]]["predicted"]
    assert abs(predicted / row["measured"] - 1) <= TARGET


def test_slice_share_is_the_calibration_on_the_0_5b_steps_rounded():
    """cost/estimate.SLICE_BANDWIDTH_SHARE is what the 6 calibration steps give, to 0.05."""
    assert round(bench.slice_share_from_steps() / 0.05) * 0.05 == pytest.approx(SLICE_BANDWIDTH_SHARE)


def test_builtin_curve_is_the_fit_to_the_h200_profiles_rounded():
    """cost/time.Throughput's defaults are cost/efficiency.fit_throughput on the committed
    H200 profiles to two figures (issue 29: the built-in curve fitted to those measurements)."""
    assert rounded(bench.builtin_curve().throughput) == rounded(Throughput())
    assert Throughput().measured_on == "NVIDIA H200"


def test_model_beats_the_straight_line_on_the_h200_steps(predictions):
    """Against the profile's own straight-line fit with no step terms (what simulate used): on
    every 0.5B step (33-36% under), and over all steps. On the two 1.5B steps the straight line
    is within 3-5% (their chunks, 8K tokens of 7-33 documents, sit above the host floor) and the
    model within 5.2% and 8.8%."""
    errors = {}
    for row in ROWS:
        old = bench.straight_line_step(row, predictions[row["id"]]["plan"])
        errors[row["id"]] = (abs(predictions[row["id"]]["predicted"] / row["measured"] - 1), abs(old / row["measured"] - 1))
    assert all(new < old for key, (new, old) in errors.items() if key.startswith("0.5b"))
    assert sum(new for new, _ in errors.values()) < sum(old for _, old in errors.values())


def _held_out(name: str) -> tuple[dict, dict]:
    """(the completed profile's held-out errors, the straight line's as recorded)."""
    errors = complete_profile(Profile.load(DATA / f"profile-{name}.json"), model_preset(name)).meta[
        "held_out_error_refit"]
    return errors, _json(f"profile-{name}.json")["meta"]["held_out_error"]


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_layer_fit_beats_the_straight_line_on_held_out_chunks(name):
    errors, recorded = _held_out(name)
    for key in ("fwd", "bwd"):
        assert errors[key]["count"] == recorded[key]["count"]   # the same held-out samples
    mean = lambda e: (e["fwd"]["mean"] + e["bwd"]["mean"]) / 2  # noqa: E731
    assert mean(errors) < mean(recorded)


@pytest.mark.xfail(strict=True, reason="issue 26's 5% target is not met by the fit with the device's line through "
                   "the origin (cost/fit.fit_floor_time): 0.5B fwd 11.3%, bwd 9.4%; 1.5B fwd 8.1%, bwd 3.7% (with a "
                   "free constant the 1.5B met it, but compiled profiles were then simulated 18-24% short). The "
                   "0.5B's held-out chunks under the host floor scatter 1.3-2.3 ms at equal work")
@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_layer_fit_held_out_error_within_5_percent(name):
    errors, _ = _held_out(name)
    assert max(errors["fwd"]["mean"], errors["bwd"]["mean"]) <= 0.05
