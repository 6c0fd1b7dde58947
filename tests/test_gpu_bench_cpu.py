"""The GPU benchmarks' code paths, run here at tiny sizes on CPU; and the varlen check, which
needs CUDA and skips without it.

The scripts live in benchmarks/ (not a package): they are loaded from their files and their
`main(argv)` is called in this process. One tiny profile, measured once, serves both."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script

torch = pytest.importorskip("torch")

from lengthwise.cli import main as cli_main
from lengthwise.runtime.profile import check_backend


@pytest.fixture(autouse=True)
def one_thread():
    """The test machine's cores are shared: one intra-op thread keeps tiny runs quick."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)




@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen attention needs CUDA")
@pytest.mark.parametrize("compiled", ["", "apart", "chain"], ids=["eager", "compiled", "chained"])
def test_varlen_step_never_makes_the_host_wait_for_the_device(compiled):
    """One step (forward and backward) of packed rows and a sequence cut into three chunks, bf16,
    varlen: after a first step (compilation, the head's one probe), a second one under PyTorch's
    sync debug mode "error", which raises at any operation that makes the host wait for the
    device (a blocking copy, a value read). Eager, compiled, and chained (the attention an
    operator inside the layers' region, `row_op`)."""
    from lengthwise.plan.ir import Action, Chunk, PipelinePlan, StepPlan
    from lengthwise.runtime.compile import compile_layers
    from lengthwise.runtime.execute import run_step
    from lengthwise.runtime.model import build_model
    from lengthwise.specs import ModelSpec, cluster_preset

    spec = ModelSpec(name="tiny", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn=96, vocab=128)
    model = build_model(spec, dtype=torch.bfloat16, device="cuda", seed=0)
    if compiled:
        compile_layers(model, chain=compiled == "chain")
    chunks = [Chunk.parse(c) for c in ("0[0:40]", "0[40:80]+1[0:24]", "0[80:120]+2[0:16]")]
    actions = [Action.parse(a) for a in ("F0", "F1", "F2", "B2", "B1", "B0")]
    plan = StepPlan(planner="hand", model=spec, cluster=cluster_preset("cpu", 1), lengths=[120, 24, 16],
                    pipelines=[PipelinePlan(chunks=chunks, stages=[actions])])
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in plan.lengths]
    run_step(model, plan, tokens, backend="varlen")
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = run_step(model, plan, tokens, backend="varlen")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item() and all(p.grad is not None for p in model.parameters())


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny-qwen.json"
    code = cli_main(["profile", "--model", "tiny-qwen", "--device", "cpu", "--layers", "1", "--min-tokens", "16",
                     "--max-tokens", "64", "--max-context", "256", "--repeats", "1", "--warmup", "0",
                     "--out", str(path), "--json"])
    assert code == 0
    return str(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen attention needs CUDA")
def test_varlen_matches_reference_in_bf16_with_contexts_and_gqa():
    for heads, kv_heads, head_dim in ((14, 2, 64), (12, 2, 128)):  # qwen2.5-0.5b, qwen2.5-1.5b
        check = check_backend("varlen", device="cuda", dtype=torch.bfloat16, heads=heads, kv_heads=kv_heads,
                              head_dim=head_dim)
        assert check.backend == "varlen" and check.passed, check.to_dict()


def test_backend_check_measures_rounding_error_of_the_dtype():
    """The check's harness on CPU: the reference in float32 is within 1e-4 of float64, in
    bfloat16 visibly worse but within bf16 tolerance; the context pieces get gradients."""
    small = {"heads": 4, "kv_heads": 2, "head_dim": 16}
    f32 = check_backend("reference", device="cpu", dtype=torch.float32, **small)
    bf16 = check_backend("reference", device="cpu", dtype=torch.bfloat16, **small)
    assert f32.passed and bf16.passed and set(f32.error) == {"out", "dq", "dk", "dv", "dcontext"}
    assert max(f32.error.values()) < 1e-5 < min(bf16.error.values()) and max(bf16.error.values()) < 2e-2


def test_finetune_benchmark_runs_tiny_on_cpu_and_writes_valid_json(tmp_path, monkeypatch, tiny_profile):
    bench = load_script("bench_gpu_finetune", monkeypatch)
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--out", str(out), "--profile-file", f"tiny-qwen={tiny_profile}"]) == 0
    result = json.loads(out.read_text())
    assert result["format"] == "lengthwise.bench_gpu_finetune/1" and result["device_type"] == "cpu"
    assert result["torch"] == torch.__version__ and "--tiny" in result["command"] and result["seed"] == 0
    runs = result["models"]["tiny-qwen"]["runs"]
    assert [r["system"] for r in runs] == list(bench.SYSTEMS)
    for r in runs:
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["peak_memory_bytes"] > 0, r
    first_losses = [r["first_loss"] for r in runs]  # same weights, same tokens: the same loss
    assert max(first_losses) - min(first_losses) < 1e-4 * first_losses[0]
    chunkflow = runs[-1]
    assert chunkflow["chunk_size"] == 64 and chunkflow["k"] >= 1
    scan = result["models"]["tiny-qwen"]["memory_scan"]
    assert [r["longest"] for r in scan] == [128, 256, 512] and all(r["kv_state_bytes"] > 0 for r in scan)
    assert {t["check"].split(": ", 1)[1] for t in result["targets"]} >= {"chunkflow / hf-padded tokens/s",
                                                                          "chunkflow / packing tokens/s"}


def test_a_timed_step_that_compiled_is_named_and_left_out_of_the_throughput(monkeypatch):
    bench = load_script("bench_gpu_finetune", monkeypatch)
    seconds = iter([1.0, 2.0, 9.0, 2.0])  # warm-up, then three timed steps; the 9 s one compiled
    graphs = iter([0, 4, 4, 4, 4, 6, 6, 6])  # dynamo's graph count before and after each step
    monkeypatch.setattr(bench, "timed", lambda fn, dev: (next(seconds), 3.0))
    monkeypatch.setattr(bench, "compiled_graphs", lambda: next(graphs))

    class Runner:
        compiled, plan_ms, splits, plan_info, model = True, [], [], {}, torch.nn.Linear(2, 2)

        def prepare(self, lengths):
            return None

        def step(self, *args):
            raise AssertionError("timed is replaced")

    s = bench.Settings(models=["tiny-qwen"], contexts=[256], systems=["packing"], warmup=1, steps=3,
                       peak_tflops=1.0)
    spec = bench.model_preset("tiny-qwen")
    row = bench._measure(Runner(), [[10, 20]] * 4, bench.Device.pick("cpu", "float32"), s, spec)
    assert row["steps_compiling"] == [1] and row["new_graphs_per_step"] == [0, 2, 0] and row["steady"]
    assert row["step_times_s"] == [2.0, 9.0, 2.0] and row["step_time_s"] == 2.0
    assert row["tokens_per_s"] == pytest.approx(2 * 30 / 4.0) and row["tokens"] == 60


def test_warm_timed_runs_every_timed_batch_once_before_timing_it(monkeypatch):
    bench = load_script("bench_gpu_finetune", monkeypatch)
    ran, graphs = [], [0]

    def fake_timed(fn, dev):  # a batch compiles the first time it runs, never again
        lengths = fn.args[0]
        graphs[0] += 0 if lengths in ran else 2
        ran.append(lengths)
        return 1.0, float(len(ran))

    monkeypatch.setattr(bench, "timed", fake_timed)
    monkeypatch.setattr(bench, "compiled_graphs", lambda: graphs[0])
    planned = []

    class Runner:
        compiled, plan_ms, splits, plan_info, model = True, [], [], {}, torch.nn.Linear(2, 2)

        def prepare(self, lengths):
            planned.append(lengths)
            return None

        def step(self, *args):
            raise AssertionError("timed is replaced")

    batches = [[10], [20], [30]]
    spec = bench.model_preset("tiny-qwen")
    for warm_timed, order, steady in ((False, [[10], [20], [30]], False), (True, [[10], [20], [30], [20], [30]], True)):
        ran.clear(), planned.clear()
        s = bench.Settings(models=["tiny-qwen"], contexts=[256], systems=["packing"], warmup=1, steps=2,
                           peak_tflops=1.0, warm_timed=warm_timed)
        row = bench._measure(Runner(), batches, bench.Device.pick("cpu", "float32"), s, spec)
        assert ran == order and planned == batches  # each batch planned once
        assert row["steady"] is steady and row["warm_timed"] is warm_timed
        assert row["new_graphs_per_step"] == ([0, 0] if warm_timed else [2, 2])
        assert row["losses"] == [float(i + 1) for i in range(len(order))] and row["tokens"] == 50


def test_padded_groups_respect_the_token_budget(monkeypatch):
    hf = load_script("hf_baselines", monkeypatch)
    lengths = [100, 20, 30, 250, 10, 10, 10, 60]
    groups = hf.padded_groups(lengths, 256)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[i] for i in g) <= 256 or len(g) == 1 for g in groups)
    assert groups[0] == [0, 1] and [3] in groups  # consecutive, a long one alone


def test_sim_fidelity_runs_tiny_on_cpu_and_writes_valid_json(tmp_path, monkeypatch, tiny_profile):
    fidelity = load_script("sim_fidelity", monkeypatch)
    out = tmp_path / "fidelity.json"
    assert fidelity.main(["--tiny", "--out", str(out), "--profile-file", tiny_profile]) == 0
    result = json.loads(out.read_text())
    assert result["format"] == "lengthwise.sim_fidelity/1" and result["planner"] == "chunkflow"
    assert len(result["batches"]) == 2 and result["profile_file"] == tiny_profile
    for row in result["batches"]:
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0 and row["chunk_size"] == 64
        assert row["step_error"] == pytest.approx(abs(row["predicted_step_s"] / row["measured_step_s"] - 1))
    assert result["step_time_mape"] == pytest.approx(sum(r["step_error"] for r in result["batches"]) / 2)
    assert [t["check"] for t in result["targets"]] == ["step_time_mape", "peak_memory_mape"]
    assert result["compiled"] is False  # the tiny profile was measured eager on CPU


def test_sim_fidelity_compiles_the_layers_as_the_profile_measured_them(monkeypatch):
    fidelity = load_script("sim_fidelity", monkeypatch)
    cpu, cuda = fidelity.Device.pick("cpu", "float32"), type("Cuda", (), {"device": "cuda"})()
    assert fidelity.measured_as_profiled(None, {"compiled": True}, cpu) is True
    assert fidelity.measured_as_profiled(None, {"compiled": False}, cuda) is False
    assert fidelity.measured_as_profiled(None, {}, cuda) is True  # an older profile: the device's default
    assert fidelity.measured_as_profiled(None, {}, cpu) is False
    assert fidelity.measured_as_profiled(False, {"compiled": True}, cpu) is False  # --no-compile wins


def test_packed_anchor_falls_back_to_sdpa_with_the_reason(monkeypatch):
    """flex_attention cannot train on CPU: auto picks sdpa and says why, an explicit request is
    refused; a compiler failure where flex_attention should work falls back too, an OOM does not."""
    hf_baselines = load_script("hf_baselines", monkeypatch)
    from lengthwise.errors import UserError
    from lengthwise.runtime.model import build_model
    from lengthwise.specs import model_preset

    cpu = torch.device("cpu")
    implementation, reason = hf_baselines.packed_attention("auto", cpu)
    assert implementation == "sdpa" and "cpu" in reason
    with pytest.raises(UserError, match="--hf-attention"):
        hf_baselines.packed_attention("flex_attention", cpu)
    spec = model_preset("tiny-qwen")
    hf = hf_baselines.build_hf(build_model(spec, dtype=torch.float32, device=cpu, seed=0), checkpointing=False)
    assert hf_baselines.configure_attention(hf, "hf-padded", "auto", spec.vocab) == {"attn_implementation": "sdpa"}
    monkeypatch.setattr(hf_baselines, "flex_unavailable", lambda device: None)

    def no_compiler(model, vocab):
        raise RuntimeError("backend='inductor' raised: no working C compiler")

    monkeypatch.setattr(hf_baselines, "warm_up_flex", no_compiler)
    info = hf_baselines.configure_attention(hf, "hf-packed", "auto", spec.vocab)
    assert info["attn_implementation"] == "sdpa" == hf.config._attn_implementation
    assert "failed to compile" in info["attn_fallback_reason"] and "C compiler" in info["attn_fallback_reason"]

    def out_of_memory(model, vocab):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(hf_baselines, "warm_up_flex", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        hf_baselines.configure_attention(hf, "hf-packed", "auto", spec.vocab)


def test_step_breakdown_tiny_writes_every_case_with_its_kernel_and_host_counts(tmp_path, monkeypatch):
    """gpu_step_breakdown.py --tiny: each case runs its batches once untimed, then timed, then
    one profiled step; on CPU no device kernels (idle share None), the host's ATen calls
    counted; the union of overlapping intervals counted once."""
    breakdown = load_script("gpu_step_breakdown", monkeypatch)
    assert breakdown.union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert breakdown.kind_of("nvjet_sm90_tst_128x256_64x4") == "gemm"
    assert breakdown.kind_of("void pytorch_flash::flash_bwd_dq_dk_dv_loop") == "attention"
    assert breakdown.kind_of("triton_poi_fused_mul_silu_0") == "triton"
    assert breakdown.parse_case("qwen2.5-1.5b:chunkflow@8192:chain") == ("qwen2.5-1.5b", "chunkflow", 8192, ":chain")
    assert breakdown.parse_case("tiny-qwen:packing:eager") == ("tiny-qwen", "packing", None, ":eager")
    out = tmp_path / "breakdown.json"
    assert breakdown.main(["--tiny", "--cases", "tiny-qwen:packing,tiny-qwen:chunkflow@64:chain", "--steps", "2",
                           "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in cases] == ["tiny-qwen:packing", "tiny-qwen:chunkflow@64:chain"]
    for case in cases:
        assert len(case["step_times_s"]) == 2 and case["tokens_per_s"] > 0
        step = case["profiled_step"]
        assert step["host"]["aten_ops"] > 0 and step["device_idle_share"] is None
        assert step["host"]["syncs"] == 0 and case["sync_sites"] is None  # no CUDA runtime here
    assert max(cases[1]["chunks_per_step"]) > max(cases[0]["chunks_per_step"])  # ChunkSize 64 splits rows


def test_sync_sites_counts_each_synchronising_call_by_its_line(monkeypatch):
    """The sync debug mode's warnings, counted per calling line (CUDA stood in for: the mode
    switch is a no-op here and the step warns as the mode would)."""
    import warnings

    breakdown = load_script("gpu_step_breakdown", monkeypatch)
    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")  # the line counted
        warnings.warn("called a synchronizing CUDA operation")

    sites = breakdown.sync_sites(step)
    assert modes == ["warn", "default"]
    assert sorted(sites.values()) == [1, 3] and all(site.startswith(__file__) for site in sites)


def test_sim_fidelitys_peak_counts_the_gradients_only_once_the_simulator_holds_them(monkeypatch):
    """The simulated peak above model states (`peak_above_states`): the simulator makes the
    gradients at the first backward's end. One chunk (F0 B0): the peak is that backward's, before
    any gradient, so it is taken above the states without them. A small chunk's step first,
    then a long one (F0 B0 F1 B1): the peak is the second backward's, gradients held, so it is
    taken above every state."""
    from plan_helpers import hand_plan

    from lengthwise.cost import CostModel
    from lengthwise.sim import simulate_plan
    from lengthwise.specs import model_preset

    fidelity = load_script("sim_fidelity", monkeypatch)
    spec = model_preset("qwen2.5-0.5b")
    for lengths, pipeline, grads_held in (([4096], ("0[0:4096]", ["F0 B0"]), False),
                                          ([64, 8192], ("0[0:64] 1[0:8192]", ["F0 B0 F1 B1"]), True)):
        plan = hand_plan(spec, lengths, [pipeline])
        cost = CostModel(model=spec, cluster=plan.cluster)
        result = simulate_plan(plan, cost)
        grads = cost.grad_bytes(layers=spec.num_layers, first=True, last=True)
        curves = result.timeline.memory
        expected = curves.peak[0] - curves.base[0] - (grads if grads_held else 0.0)
        assert grads > 0 and fidelity.peak_above_states(result, grads) == expected


def test_softmax_grad_variants_agree_with_the_eager_block(monkeypatch, tmp_path):
    bench = load_script("bench_softmax_grad", monkeypatch)
    out = tmp_path / "softmax_grad.json"
    assert bench.main(["--tiny", "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["variant"], r["columns"]) for r in rows} == {(v, c) for v in bench.VARIANTS for c in (256, 96)}
    ran = [r for r in rows if "skipped" not in r]
    assert {r["variant"] for r in ran} == {"eager", "dynamic", "static-width"}  # nd-tiling: inductor only
    assert all(r["agrees"] and r["us"] > 0 for r in ran), ran
