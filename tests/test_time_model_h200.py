"""The time model against the first H200 run's measured steps (tests/data/h200/README.md).

Each measured step's global batch is drawn again with the project's sampler (chunkflow-eval
lengths, seed 0, 64 sequences, 32K context, truncated, as the benchmarks drew them) and planned
as the benchmark planned it (with the profile as it was, so the same plan); the reconstruction
is checked against what the files recorded (tokens, longest sequence, chunks, ChunkSize). The
plan is then simulated with that profile completed (cost/estimate.py: host floors refitted from
its samples, step terms estimated from bandwidth) and compared with the measured step, counting
only what the measurement ran: bench_gpu_finetune.py times run_step + the optimizer step (no
gradient norm), sim_fidelity.py times run_step alone.

Target (issue 26): every step within 10%, per-layer held-out error <= 5% mean. Rows and fits
that miss it are marked xfail(strict) with their residual, so the day they pass the test says so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lengthwise.cost import CostModel, Profile
from lengthwise.cost.estimate import complete_profile
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.sim import simulate_plan
from lengthwise.sim.terms import step_time_terms
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import profile_source

DATA = Path(__file__).parent / "data" / "h200"
GPU_MEMORY_GB = 139.8
"""The H200's memory as torch reported it (about 139-140 GiB; the plans are the same over that range)."""
TARGET = 0.10


def _json(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def _batches(count: int) -> list[list[int]]:
    sampler = GlobalBatchSampler(profile_source("chunkflow-eval", 32768, "truncate"), seed=0, batch_size=64)
    return [list(sampler.next_batch().lengths) for _ in range(count)]


def _models(name: str):
    spec = model_preset(name)
    cluster = dataclasses.replace(cluster_preset("h100", 1), name="NVIDIA H200", gpu_memory_gb=GPU_MEMORY_GB)
    raw = Profile.load(DATA / f"profile-{name}.json")
    return spec, cluster, CostModel(model=spec, cluster=cluster, profile=raw), \
        CostModel(model=spec, cluster=cluster, profile=complete_profile(raw, spec))


def _plan(spec, cluster, cost, lengths, planner: str, options: dict, seed: int | None):
    kw = {} if seed is None else {"seed": seed}
    return get_planner(planner)(PlanRequest(lengths=list(lengths), model=spec, cluster=cluster, scheme=ParallelScheme(),
                                            cost=cost, context_length=32768, options=options, **kw))


def h200_rows() -> list[dict]:
    """Every measured step: (file, row label, model, planner, options, batch index, measured
    seconds, what it timed, what the file recorded about the batch)."""
    rows = []
    bench = _json("gpu_finetune_0.5b_32k.json")["models"]["qwen2.5-0.5b"]["runs"]
    for run in bench:
        if run["system"] not in ("packing", "chunkflow"):
            continue
        options = {} if run["system"] == "packing" else {"chunk_size": "auto"}
        for i, seconds in enumerate(run["step_times_s"]):
            rows.append({"id": f"0.5b-{run['system']}-step{i + 1}", "model": "qwen2.5-0.5b", "planner": run["system"],
                         "options": options, "batch": 1 + i, "measured": seconds, "optimizer": True, "seed": None,
                         "longest": run["longest_per_step"][i], "chunk_size": run.get("chunk_size")})
    run = _json("gpu_finetune_1.5b_32k_chunkflow8k.json")["models"]["qwen2.5-1.5b"]["runs"][0]
    for i, seconds in enumerate(run["step_times_s"]):
        rows.append({"id": f"1.5b-chunkflow8k-step{i + 1}", "model": "qwen2.5-1.5b", "planner": "chunkflow",
                     "options": {"chunk_size": 8192}, "batch": 1 + i, "measured": seconds, "optimizer": True,
                     "seed": None, "longest": run["longest_per_step"][i], "chunk_size": 8192})
    for i, b in enumerate(_json("sim_fidelity_0.5b_32k.json")["batches"]):
        rows.append({"id": f"0.5b-simfidelity-batch{i}", "model": "qwen2.5-0.5b", "planner": "chunkflow",
                     "options": {"chunk_size": "auto"}, "batch": i, "measured": b["measured_step_s"],
                     "optimizer": False, "seed": 0, "longest": b["longest"], "chunk_size": b["chunk_size"],
                     "tokens": b["tokens"], "chunks": b["chunks"]})
    return rows


def predict_row(row: dict) -> dict:
    """The reconstructed plan, the simulated step (what the measurement ran) and its terms."""
    spec, cluster, raw, completed = _models(row["model"])
    lengths = _batches(row["batch"] + 1)[row["batch"]]
    plan = _plan(spec, cluster, raw, lengths, row["planner"], row["options"], row["seed"])
    result = simulate_plan(plan, completed)
    terms = step_time_terms(plan, completed)
    not_run = terms["grad_norm"] + (0.0 if row["optimizer"] else terms["optimizer"])
    return {"plan": plan, "lengths": lengths, "predicted": result.step_time_s - not_run, "terms": terms,
            "step_end": result.step_end_s}


ROWS = h200_rows()
MISSES = {"0.5b-simfidelity-batch1": -0.11}
"""Residuals (predicted / measured - 1) of the rows this model misses, when it was written."""


def _marks(row):
    if row["id"] in MISSES:
        return [pytest.mark.xfail(strict=True, reason=f"~{MISSES[row['id']]:+.0%}: the 0.5B step's one chunk "
                                  "holds 30K tokens of 64 documents, beyond the profile's samples "
                                  "(16K tokens, 16 documents)")]
    return []


@pytest.fixture(scope="module")
def predictions() -> dict:
    return {row["id"]: predict_row(row) for row in ROWS}


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


@pytest.mark.parametrize("row", [pytest.param(r, id=r["id"], marks=_marks(r)) for r in ROWS])
def test_h200_step_within_target(row, predictions):
    predicted = predictions[row["id"]]["predicted"]
    assert abs(predicted / row["measured"] - 1) <= TARGET


def test_model_beats_the_straight_line_on_every_h200_step(predictions):
    """Against the profile's own straight-line fit with no step terms (what simulate used)."""
    for row in ROWS:
        spec, cluster, raw, _ = _models(row["model"])
        plan = predictions[row["id"]]["plan"]
        old = simulate_plan(plan, raw).step_time_s
        assert abs(predictions[row["id"]]["predicted"] / row["measured"] - 1) < abs(old / row["measured"] - 1)


@pytest.mark.parametrize("name", ["qwen2.5-1.5b",
                                  pytest.param("qwen2.5-0.5b", marks=pytest.mark.xfail(
                                      strict=True, reason="fwd 11.4%, bwd 8.7%: its small chunks' times scatter "
                                      "1.3-2.3 ms at equal work"))])
def test_layer_fit_held_out_error_within_5_percent(name):
    errors = complete_profile(Profile.load(DATA / f"profile-{name}.json"), model_preset(name)).meta[
        "held_out_error_refit"]
    recorded = _json(f"profile-{name}.json")["meta"]["held_out_error"]
    for key in ("fwd", "bwd"):
        assert errors[key]["count"] == recorded[key]["count"]   # the same held-out samples
        assert errors[key]["mean"] < recorded[key]["mean"]      # better than the straight line
    assert max(errors["fwd"]["mean"], errors["bwd"]["mean"]) <= 0.05
