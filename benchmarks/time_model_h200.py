"""The time model against the first H200 run's measured steps, offline (no GPU, no torch).

    python benchmarks/time_model_h200.py        # writes benchmarks/results/time_model_h200.json

Reads the copies of that run's files in benchmarks/results/h200-2026-11-27/ (README there: one
NVIDIA H200, torch 2.11, bfloat16). Each measured step's global batch is drawn again with the
project's sampler (chunkflow-eval lengths, seed 0, 64 sequences, 32K context, truncated, as
bench_common.sample_batches drew them) and planned as the benchmark planned it (with the
profile as it was then, so the same plan: the file's tokens, longest sequence, chunks and
ChunkSize are checked by tests/test_time_model_h200.py). The plan is then simulated with that
profile completed (cost/estimate.py: host floors refitted from its samples, the backward's
key-slicing term and the step terms estimated from bandwidth) and compared with the measured
step, counting only what the measurement ran: bench_gpu_finetune.py times run_step + the
optimizer step (no gradient norm), sim_fidelity.py run_step alone. Predicted figures are
simulated; measured ones are the H200's. Each row carries its terms (sim/terms.py), and its
prediction with the key slicing at the nominal bandwidth (as before it was calibrated).

Also written: the calibration of that slicing's share of the bandwidth on the 6 Qwen2.5-0.5B
fine-tune steps (`slice_share_from_steps`; cost/estimate.SLICE_BANDWIDTH_SHARE is it rounded),
and per profile each term's held-out error (`fit_report`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

from scipy.optimize import minimize_scalar

from lengthwise.cost import CostModel, Profile
from lengthwise.cost.estimate import (SLICE_BANDWIDTH_SHARE, complete_profile, profile_samples,
                                      segment_token_seconds)
from lengthwise.cost.efficiency import COEFFICIENTS, H200_PEAK_TFLOPS, describe_fit, fit_throughput, rounded
from lengthwise.cost.fit import fit_floor_time, fit_head, held_out_error, predict
from lengthwise.files import json_text, write_atomic
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.sim import simulate_plan
from lengthwise.sim.terms import step_time_terms
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import profile_source

DATA = Path(__file__).resolve().parent / "results" / "h200-2026-11-27"
GPU_MEMORY_GB = 139.8
"""The H200's memory as torch reported it (about 139-140 GiB; the plans are the same over that range)."""
TARGET = 0.10


def _json(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@functools.lru_cache(maxsize=None)
def _all_batches(count: int) -> tuple[tuple[int, ...], ...]:
    sampler = GlobalBatchSampler(profile_source("chunkflow-eval", 32768, "truncate"), seed=0, batch_size=64)
    return tuple(tuple(sampler.next_batch().lengths) for _ in range(count))


def _batches(count: int) -> list[list[int]]:
    """The first `count` global batches (the benchmarks' draws: seed 0, 64 sequences)."""
    return [list(b) for b in _all_batches(count)]


@functools.lru_cache(maxsize=None)
def _models(name: str, share: float = SLICE_BANDWIDTH_SHARE):
    """(spec, cluster, the raw profile's cost model, the completed profile's) with the key
    slicing at `share` of the nominal bandwidth."""
    spec = model_preset(name)
    cluster = dataclasses.replace(cluster_preset("h100", 1), name="NVIDIA H200", gpu_memory_gb=GPU_MEMORY_GB)
    raw = Profile.load(DATA / f"profile-{name}.json")
    return spec, cluster, CostModel(model=spec, cluster=cluster, profile=raw), \
        CostModel(model=spec, cluster=cluster, profile=complete_profile(raw, spec, slice_share=share))


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


@functools.lru_cache(maxsize=None)
def _row_plan(row_id: str):
    """(lengths, plan) of a row: its batch drawn again, planned with the raw profile."""
    row = next(r for r in h200_rows() if r["id"] == row_id)
    spec, cluster, raw, _ = _models(row["model"])
    lengths = _batches(row["batch"] + 1)[row["batch"]]
    return lengths, _plan(spec, cluster, raw, lengths, row["planner"], row["options"], row["seed"])


def predict_row(row: dict, share: float = SLICE_BANDWIDTH_SHARE) -> dict:
    """The reconstructed plan, the simulated step (what the measurement ran) and its terms."""
    completed = _models(row["model"], share)[3]
    lengths, plan = _row_plan(row["id"])
    result = simulate_plan(plan, completed)
    terms = step_time_terms(plan, completed)
    not_run = terms["grad_norm"] + (0.0 if row["optimizer"] else terms["optimizer"])
    return {"plan": plan, "lengths": lengths, "predicted": result.step_time_s - not_run, "terms": terms,
            "step_end": result.step_end_s}


CALIBRATION_ROWS = ("0.5b-packing-step", "0.5b-chunkflow-step")
"""The rows the slicing's bandwidth share is calibrated on (id prefixes): bench_gpu_finetune's
6 Qwen2.5-0.5B steps. The other 4 (sim_fidelity's, the 1.5B's) check it."""


def slice_share_from_steps() -> float:
    """The share of nominal bandwidth at which the key slicing makes the simulated
    CALIBRATION_ROWS match their measured steps best (least squares of relative error, in
    [0.05, 1]); cost/estimate.SLICE_BANDWIDTH_SHARE is this rounded to 0.05."""
    rows = [r for r in h200_rows() if r["id"].startswith(CALIBRATION_ROWS)]

    def cost(share: float) -> float:
        return sum((predict_row(r, share)["predicted"] / r["measured"] - 1) ** 2 for r in rows)

    return float(minimize_scalar(cost, bounds=(0.05, 1.0), method="bounded", options={"xatol": 1e-4}).x)


def fit_report(name: str) -> dict:
    """Per term of the completed profile, its error on measurements it was not fitted to:
    layers on the recorded hold-out (also split by which side of the max predicts each held-out
    chunk: the host floor or the device's line), the LM head leaving one of its six sizes out;
    and the training fit's relative RMS of the backward with the slicing at several bandwidth
    shares (flat: the samples do not measure it)."""
    spec, _, raw, done = _models(name)
    fit, samples = done.profile.schemes["tp1-cp1"], profile_samples(done.profile)
    test, out = [s for s in samples if s.held_out], {}
    for key, coef in (("fwd", (fit.fwd, fit.fwd_floor, 0.0)),
                      ("bwd", (fit.bwd, fit.bwd_floor, fit.bwd_segment_tokens))):
        floor = coef[1]
        host = [s for s in test if predict(coef, s.keys, s.tokens, s.segments) == floor[0] + floor[1] * s.segments]
        out[key] = {part: vars(held_out_error(coef, chunks, f"{key}_s")) for part, chunks in
                    (("held_out", test), ("held_out_on_host_floor", host),
                     ("held_out_on_device_line", [s for s in test if s not in host]))}
    for key in ("fwd", "bwd"):
        out[f"head_{key}"] = {"leave_one_out": _head_leave_one_out(done.profile.meta["head_samples"], f"{key}_s")}
    out["bwd_training_rms_by_slice_share"] = {share: _training_rms(spec, raw.profile, share)
                                              for share in (1.0, 0.5, SLICE_BANDWIDTH_SHARE, 0.2)}
    return out


def _head_leave_one_out(heads: list[dict], field: str) -> dict:
    errs = []
    for i, h in enumerate(heads):
        rest = heads[:i] + heads[i + 1:]
        b, c = fit_head([r["tokens"] for r in rest], [r[field] for r in rest])
        errs.append(abs(b * h["tokens"] + c - h[field]) / h[field])
    return {"mean": statistics.fmean(errs), "max": max(errs), "count": len(errs)}


def _training_rms(spec, profile, share: float) -> float:
    """Relative RMS of the backward's refit on the training chunks, the slicing at `share`."""
    seg = segment_token_seconds(spec, device=profile.device, dtype=profile.meta.get("dtype", "bfloat16"), share=share)
    train = [s for s in profile_samples(profile) if not s.held_out]
    work, floor = fit_floor_time([s.keys for s in train], [s.tokens for s in train], [s.segments for s in train],
                                 [s.bwd_s for s in train], seg)
    return statistics.fmean((predict((work, floor, seg), s.keys, s.tokens, s.segments) / s.bwd_s - 1) ** 2
                            for s in train) ** 0.5



COMPILED = Path(__file__).resolve().parent / "results" / "gpu-2026-11-28-nvidia-h200"
COMPILED_RUNS = {"run1": COMPILED, "run2": COMPILED / "run2", "run3": COMPILED / "run3"}
"""The 2026-11-28 H200 calls (compiled layers): each with its own Qwen2.5-0.5B profile, measured
compiled in the same call."""


@functools.lru_cache(maxsize=None)
def _compiled_models(run: str):
    """(spec, cluster, the run's profile as measured, completed: the device line refitted)."""
    spec = model_preset("qwen2.5-0.5b")
    cluster = dataclasses.replace(cluster_preset("h100", 1), name="NVIDIA H200", gpu_memory_gb=GPU_MEMORY_GB)
    raw = Profile.load(COMPILED_RUNS[run] / "profile-qwen2.5-0.5b.json")
    return spec, cluster, CostModel(model=spec, cluster=cluster, profile=raw), \
        CostModel(model=spec, cluster=cluster, profile=complete_profile(raw, spec))


def compiled_rows() -> list[dict]:
    """Every compiled 0.5B step of the 2026-11-28 calls: bench_gpu_finetune's packing and
    chunkflow steps at 32K (run_step + optimizer; the eager row has no eager profile to be
    simulated with, and the 1.5B rows were planned with the eager 2026-11-27 profile) and
    sim_fidelity's batches (run_step)."""
    rows = []
    for run, folder in COMPILED_RUNS.items():
        bench = json.loads((folder / "finetune-0.5b-32k.json").read_text())["models"]["qwen2.5-0.5b"]["runs"]
        for r in (r for r in bench if r["system"] in ("packing", "chunkflow")):
            options = {} if r["system"] == "packing" else {"chunk_size": "auto"}
            for i, seconds in enumerate(r["step_times_s"]):
                rows.append({"id": f"{run}-0.5b-{r['system']}-step{i + 1}", "run": run, "planner": r["system"],
                             "options": options, "batch": 1 + i, "measured": seconds, "optimizer": True,
                             "seed": None, "chunk_size": r.get("chunk_size")})
        fidelity = json.loads((folder / "sim-fidelity-0.5b-32k.json").read_text())
        for i, b in enumerate(fidelity["batches"]):
            rows.append({"id": f"{run}-0.5b-simfidelity-batch{i}", "run": run, "planner": "chunkflow",
                         "options": {"chunk_size": "auto"}, "batch": i, "measured": b["measured_step_s"],
                         "optimizer": False, "seed": 0, "chunk_size": b["chunk_size"], "chunks": b["chunks"]})
    return rows


def predict_compiled_row(row: dict) -> dict:
    """The row's batch planned with the run's profile as measured (as the benchmark planned it),
    simulated with it completed (the device line refitted without its constant), and with it as
    measured (the fit then)."""
    spec, cluster, raw, completed = _compiled_models(row["run"])
    lengths = _batches(row["batch"] + 1)[row["batch"]]
    plan = _plan(spec, cluster, raw, lengths, row["planner"], row["options"], row["seed"])

    def step(cost) -> float:
        terms = step_time_terms(plan, cost)
        return simulate_plan(plan, cost).step_time_s - terms["grad_norm"] - (0.0 if row["optimizer"] else
                                                                             terms["optimizer"])
    return {"plan": plan, "lengths": lengths, "predicted": step(completed), "as_fitted_then": step(raw)}


def straight_line_step(row: dict, plan) -> float:
    """What simulate predicted before: the profile's own straight-line fit, no step terms."""
    spec, cluster, raw, _ = _models(row["model"])
    return simulate_plan(plan, raw).step_time_s


def builtin_curve(hold: dict[str, float] | None = None):
    """cost/efficiency.fit_throughput on the two completed H200 profiles: Throughput's defaults
    are its coefficients rounded (cost/efficiency.rounded). `hold`: coefficients kept fixed."""
    return fit_throughput([(_models(n)[0], _models(n)[3].profile) for n in ("qwen2.5-0.5b", "qwen2.5-1.5b")],
                          peak_tflops=H200_PEAK_TFLOPS, measured_on="NVIDIA H200", hold=hold)


def _curve_json(curve) -> dict:
    return {"fitted": {k: getattr(curve.throughput, k) for k in COEFFICIENTS}, "rounded": rounded(curve.throughput),
            "chunk_passes": curve.chunks, "error": curve.error}


def main(argv: list[str] | None = None) -> int:
    out = Path(__file__).resolve().parent / "results" / "time_model_h200.json"
    rows = []
    for row in h200_rows():
        got = predict_row(row)
        old, nominal = straight_line_step(row, got["plan"]), predict_row(row, 1.0)["predicted"]
        rows.append({"row": row["id"], "model": row["model"], "planner": row["planner"], "batch": row["batch"],
                     "tokens": sum(got["lengths"]), "chunks": len(got["plan"].pipelines[0].chunks),
                     "measured_s": row["measured"], "timed": "run_step + optimizer" if row["optimizer"] else "run_step",
                     "calibration": row["id"].startswith(CALIBRATION_ROWS),
                     "predicted_s": got["predicted"], "error": got["predicted"] / row["measured"] - 1,
                     "slicing_at_nominal_bandwidth_s": nominal,
                     "slicing_at_nominal_bandwidth_error": nominal / row["measured"] - 1,
                     "straight_line_s": old, "straight_line_error": old / row["measured"] - 1,
                     "terms_s": got["terms"]})
        print(f"{row['id']:<26} measured {row['measured']:.4f} s  predicted {got['predicted']:.4f} s "
              f"({rows[-1]['error']:+.1%}; slicing at nominal bandwidth "
              f"{rows[-1]['slicing_at_nominal_bandwidth_error']:+.1%}; "
              f"straight line {rows[-1]['straight_line_error']:+.1%})")
    fits = {}
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        done = complete_profile(Profile.load(DATA / f"profile-{name}.json"), model_preset(name))
        fits[name] = {"held_out_error": done.meta["held_out_error_refit"], "per_term": fit_report(name),
                      "straight_line_held_out_error": {k: done.meta["held_out_error"][k] for k in ("fwd", "bwd")},
                      "scheme": vars(done.schemes["tp1-cp1"]), "step": done.step.to_dict(),
                      "completed": done.meta["completed"]}
    compiled = []
    for row in compiled_rows():
        got = predict_compiled_row(row)
        compiled.append({"row": row["id"], "planner": row["planner"], "batch": row["batch"],
                         "tokens": sum(got["lengths"]), "chunks": len(got["plan"].pipelines[0].chunks),
                         "chunk_size": got["plan"].metrics.get("chunk_size"), "measured_s": row["measured"],
                         "timed": "run_step + optimizer" if row["optimizer"] else "run_step",
                         "predicted_s": got["predicted"], "error": got["predicted"] / row["measured"] - 1,
                         "as_fitted_then_s": got["as_fitted_then"],
                         "as_fitted_then_error": got["as_fitted_then"] / row["measured"] - 1})
        print(f"{row['id']:<32} measured {row['measured']:.4f} s  predicted {got['predicted']:.4f} s "
              f"({compiled[-1]['error']:+.1%}; the fit as then {compiled[-1]['as_fitted_then_error']:+.1%})")
    compiled_mape = statistics.fmean(abs(r["error"]) for r in compiled)
    mape = statistics.fmean(abs(r["error"]) for r in rows)
    within = sum(abs(r["error"]) <= TARGET for r in rows)
    checked = [r for r in rows if not r["calibration"]]
    share = slice_share_from_steps()
    calibration = {"rows": [r["row"] for r in rows if r["calibration"]], "slice_share_fitted": share,
                   "slice_share_used": SLICE_BANDWIDTH_SHARE,
                   "checked_rows_mape": statistics.fmean(abs(r["error"]) for r in checked),
                   "checked_rows_max_error": max(abs(r["error"]) for r in checked)}
    curve = builtin_curve()
    builtin = {**_curve_json(curve), "peak_tflops": H200_PEAK_TFLOPS, "measured_on": "NVIDIA H200",
               "overhead_held_at_40us": _curve_json(builtin_curve({"layer_overhead_s": 40e-6}))}
    results = {"format": "lengthwise.time_model_h200/1", "device": "NVIDIA H200 (measured 2026-11-27)",
               "predicted": "simulated (cost/time.py time model)", "rows": rows, "step_time_mape": mape,
               "rows_within_10_percent": within, "rows_total": len(rows), "slice_calibration": calibration,
               "builtin_curve": builtin, "fits": fits,
               "compiled_runs": {"device": "NVIDIA H200 (measured 2026-11-28, layers compiled)", "rows": compiled,
                                 "step_time_mape": compiled_mape,
                                 "as_fitted_then_mape": statistics.fmean(abs(r["as_fitted_then_error"])
                                                                         for r in compiled),
                                 "rows_within_10_percent": sum(abs(r["error"]) <= TARGET for r in compiled)},
               "command": "python benchmarks/time_model_h200.py"}
    write_atomic(out, json_text(results))
    print(f"key slicing at {share:.3f} of nominal bandwidth fits the {len(calibration['rows'])} calibration steps "
          f"(used: {SLICE_BANDWIDTH_SHARE}); the {len(checked)} others: MAPE {calibration['checked_rows_mape']:.1%}")
    print(f"built-in efficiency curve (cost/time.Throughput): {describe_fit(curve)}")
    print(f"compiled (2026-11-28): step time MAPE {compiled_mape:.1%}, "
          f"{results['compiled_runs']['rows_within_10_percent']} of {len(compiled)} steps within {TARGET:.0%}")
    print(f"step time MAPE {mape:.1%}, {within} of {len(rows)} steps within {TARGET:.0%}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
