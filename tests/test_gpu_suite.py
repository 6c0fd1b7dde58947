"""The one-command GPU suite (benchmarks/gpu_suite.sh): its budget, its bookkeeping of failed,
timed-out and skipped steps, and one end-to-end run of `gpu_suite.sh --tiny` on CPU that must
leave every step's JSON with the fields the GPU run will be read for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"




@pytest.fixture
def suite(monkeypatch):
    return load_script("gpu_suite", monkeypatch)


def test_gpu_steps_fit_eight_minutes_and_write_inside_one_folder(suite, tmp_path):
    steps = suite.suite_steps(tmp_path, tiny=False, cuda=True)
    assert sum(s.limit_s for s in steps) <= suite.SUITE_LIMIT_S == 480
    assert len({s.name for s in steps}) == len(steps) and not any(s.skip_reason for s in steps)
    for s in steps:
        if s.output:
            assert not Path(s.output).is_absolute() and "/" not in s.output
        for a in (a.split("=", 1)[-1] for a in s.argv if a.endswith(".json")):  # written here, or committed
            assert str(tmp_path) in a or (ROOT / a).is_file(), a
    long_step = next(s for s in steps if "--long-sequence" in s.argv)
    assert long_step.argv[long_step.argv.index("--long-sequence") + 1] == "65536-131072"
    assert long_step.argv[long_step.argv.index("--chunk-size") + 1] == "8192"  # the long one must split


def test_a_step_past_its_limit_is_killed_and_the_suite_records_it(suite, tmp_path):
    (tmp_path / "logs").mkdir()
    slow = suite.Step(name="slow", argv=[sys.executable, "-c", "import time; time.sleep(60)"], limit_s=1,
                      output="slow.json")
    failing = suite.Step(name="failing", argv=[sys.executable, "-c", "raise SystemExit(3)"], limit_s=30)
    silent = suite.Step(name="silent", argv=[sys.executable, "-c", "pass"], limit_s=30, output="never.json")
    blocked = suite.Step(name="blocked", argv=["false"], limit_s=30, needs=["slow.json"])
    env = suite.step_env(tiny=True)
    records = {s.name: suite.run_step(s, tmp_path, env) for s in (slow, failing, silent, blocked)}
    assert records["slow"]["rc"] == 124 and records["slow"]["status"] == "timeout"
    assert records["slow"]["wall_s"] < 30
    assert records["failing"]["rc"] == 3 and records["failing"]["status"] == "failed"
    assert records["silent"]["rc"] == 0 and records["silent"]["status"] == "failed"
    assert "without writing never.json" in records["silent"]["reason"]
    assert records["blocked"]["status"] == "skipped" and "slow.json" in records["blocked"]["reason"]


def test_a_verify_that_fails_only_compiled_turns_compile_off_for_the_later_steps(suite, tmp_path, monkeypatch):
    fails_compiled = ("import json, sys; sys.exit(1) if '--no-compile' not in sys.argv else "
                      "print(json.dumps({'passed': True}))")
    records_argv = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"
    steps = [suite.Step(name="verify", argv=[sys.executable, "-c", fails_compiled], limit_s=30, output="verify.json",
                        stdout_is_output=True, compiles=True, decides_compile=True),
             suite.Step(name="measure", argv=[sys.executable, "-c", records_argv, str(tmp_path / "m.json")],
                        limit_s=30, output="m.json", compiles=True),
             suite.Step(name="other", argv=[sys.executable, "-c", records_argv, str(tmp_path / "o.json")],
                        limit_s=30, output="o.json")]
    monkeypatch.setattr(suite, "suite_steps", lambda *a, **k: steps)
    monkeypatch.setattr(suite, "describe_machine", lambda tiny: {"device": "cpu", "device_type": "cpu", "commit": None})
    assert suite.main(["--out", str(tmp_path)]) == 1  # the compiled verify failed: recorded, not hidden
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {r["name"]: r["status"] for r in summary["steps"]}
    assert status == {"verify": "failed", "verify-no-compile": "ok", "measure": "ok", "other": "ok"}
    assert summary["compile"].startswith("off: verify failed compiled")
    assert json.loads((tmp_path / "verify-no-compile.json").read_text()) == {"passed": True}
    assert json.loads((tmp_path / "m.json").read_text()) == ["--no-compile"]
    assert json.loads((tmp_path / "o.json").read_text()) == []  # a step without the switch is left as it is


def test_old_src_adds_the_before_variant_to_the_host_overhead_step(suite, tmp_path):
    host = next(s for s in suite.suite_steps(tmp_path, tiny=False, cuda=True, old_src="/old/src")
                if s.name == "host-overhead")
    assert host.argv[host.argv.index("--variants") + 1] == "before,after"
    assert host.argv[host.argv.index("--old-src") + 1] == "/old/src"
    assert suite.main(["--list", "--old-src", str(tmp_path)]) == 2  # no lengthwise package there


def test_host_overhead_measures_pytorchs_floor_beside_the_executor(monkeypatch, tmp_path):
    bench = load_script("bench_host_overhead", monkeypatch)
    out = tmp_path / "host.json"
    assert bench.main(["--variants", "floor", "--rounds", "1", "--steps", "1", "--out", str(out)]) == 0
    host = json.loads(out.read_text())
    assert set(host["per_layer_chunk_us"]) == {"floor"} and host["per_layer_chunk_us"]["floor"] > 0
    # the floor runs no lengthwise code: nothing of the executor's counts or replay for it
    assert host["dispatched_ops_per_layer_chunk"] == {} and host["replayed_calls_per_layer_chunk_us"] == {}
    assert host["a_third_of_before_us"] is None and host["ratio_before_over_after"] == {}
    with pytest.raises(SystemExit, match="--variants"):
        bench.main(["--variants", "floor,sideways", "--out", str(out)])


def test_experiments_fit_eight_minutes_and_name_the_chained_cases(suite, tmp_path, capsys, monkeypatch):
    """`--experiments`: the GPU's waiting list as suite steps, limits within 8 minutes, the
    breakdown comparing chained and default compilation on the same case, in a folder of its
    own (the steps' scripts run tiny in their own tests; the runner is the suite's, run end to
    end by the tiny suite's test)."""
    steps = suite.experiment_steps(tmp_path, tiny=False, cuda=True)
    assert sum(s.limit_s for s in steps) <= suite.SUITE_LIMIT_S and not any(s.skip_reason for s in steps)
    assert [s.name for s in steps] == ["sync-check", "verify-chain", "chain-breakdown", "softmax-grad"]
    chained = next(s for s in steps if s.name == "verify-chain")
    assert "--compile-chain" in chained.argv and chained.argv[chained.argv.index("--backend") + 1] == "varlen"
    breakdown = next(s for s in steps if s.name == "chain-breakdown")
    cases = breakdown.argv[breakdown.argv.index("--cases") + 1].split(",")
    assert "qwen2.5-1.5b:chunkflow@8192" in cases and "qwen2.5-1.5b:chunkflow@8192:chain" in cases
    assert all(a.startswith(str(tmp_path)) for a in breakdown.argv if a.endswith(".json") and "=" not in a)
    tiny = suite.experiment_steps(tmp_path, tiny=True, cuda=False)
    assert tiny[0].skip_reason and all("--tiny" in s.argv for s in tiny[2:]) and "cpu" in tiny[1].argv
    monkeypatch.delenv("OUT", raising=False)
    machine = {"device": "NVIDIA H200"}
    assert suite.default_out(machine, False, experiments=True).name.endswith("-experiments-nvidia-h200")
    assert suite.default_out(machine, False).name.endswith("-nvidia-h200") and "experiments" not in str(
        suite.default_out(machine, False))
    assert suite.main(["--experiments", "--list", "--out", str(tmp_path)]) == 0
    assert "chain-breakdown" in capsys.readouterr().out


def test_every_batch_gets_one_long_sequence_in_range(monkeypatch):
    common = load_script("bench_common", monkeypatch)
    batches = [[100, 200, 300], [50, 60], [7]]
    longer = common.with_long_sequence(batches, 1000, 2000, seed=3)
    assert [len(b) for b in longer] == [3, 2, 1]
    for before, after in zip(batches, longer):
        assert sum(1000 <= n <= 2000 for n in after) == 1
        assert sorted(n for n in after if n < 1000) in (sorted(before[:i] + before[i + 1:]) for i in range(len(before)))
    assert longer == common.with_long_sequence(batches, 1000, 2000, seed=3)


def _load(out: Path, name: str) -> dict:
    path = out / name
    assert path.is_file(), f"{name} missing"
    return json.loads(path.read_text())


def test_tiny_suite_runs_every_step_on_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "suite"
    proc = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), "--tiny", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _load(out, "summary.json")
    assert summary["format"] == "lengthwise.gpu_suite/1" and summary["tiny"] is True
    assert {"device", "torch", "cuda", "transformers", "commit", "wall_s"} <= set(summary)
    steps = {r["name"]: r for r in summary["steps"]}
    assert steps.pop("varlen-check")["status"] == "skipped"
    assert summary["steps"][0]["reason"].startswith("needs CUDA")
    for r in steps.values():
        assert r["rc"] == 0 and r["status"] == "ok" and r["wall_s"] > 0 and (out / r["log"]).is_file(), r

    assert _load(out, "verify.json")["passed"] is True
    assert _load(out, "profile-tiny-qwen.json")["format"] == "lengthwise.profile/1"
    host = _load(out, "host-overhead.json")
    assert host["device"] == "cpu" and host["per_layer_chunk_us"]["after"] > 0
    assert host["dispatched_ops_per_layer_chunk"]["after"] > 0
    fidelity = _load(out, "sim-fidelity-0.5b-32k.json")
    assert fidelity["format"] == "lengthwise.sim_fidelity/1" and fidelity["step_time_mape"] >= 0

    main = _load(out, "finetune-0.5b-32k.json")
    runs = {r["system"]: r for r in main["models"]["tiny-qwen"]["runs"]}
    assert main["complete"] and set(runs) == {"packing", "chunkflow", "hf-packed"}
    assert all(r["warm_timed"] and len(r["losses"]) == 3 for r in runs.values()), runs  # 1 warm-up, 1 rerun, 1 timed
    assert all(r["tokens_per_s"] > 0 for r in runs.values()), runs
    # the same weights (seeded once, copied after) and tokens: the same first loss up to float32
    # rounding over a few hundred tokens' log-probabilities summed in different orders
    first = runs["packing"]["first_loss"]
    assert all(r["first_loss"] == pytest.approx(first, rel=1e-5) for r in runs.values()), runs
    # FlexAttention has no backward on CPU: the anchor falls back to sdpa and says why
    assert runs["hf-packed"]["attn_implementation"] == "sdpa" and "cpu" in runs["hf-packed"]["attn_fallback_reason"]
    assert {r["ratio"] for r in main["ratios"]} >= {"chunkflow / hf-packed (sdpa) tokens/s"}

    larger = {r["system"]: r for r in _load(out, "finetune-1.5b-32k.json")["models"]["tiny-qwen"]["runs"]}
    assert set(larger) == {"packing", "chunkflow"} and larger["chunkflow"]["chunk_size"] == 128
    long = {r["system"]: r for r in _load(out, "finetune-0.5b-128k-long.json")["models"]["tiny-qwen"]["runs"]}
    chunkflow = long["chunkflow"]
    assert all(160 <= n <= 256 for n in chunkflow["longest_per_step"])
    assert chunkflow["split_sequences_per_step"] and min(chunkflow["split_sequences_per_step"]) >= 1
