"""Every bad input to `lengthwise plan` ends with one stderr line naming the fix and exit code 2."""

from __future__ import annotations

import pytest
from bad_input_assets import MAKERS, NEEDS, RESEALS, TRAIN_SMALL, asset_groups

from lengthwise.cli import main

SMALL = ["--model", "qwen2.5-1.5b", "--cluster", "h100"]


def lengths_file(tmp_path, *lengths: int) -> str:
    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{n}\n" for n in lengths))
    return str(path)


def one_line_error(capsys, *argv: str) -> str:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own errors (a missing flag) exit from inside parsing
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.out == ""
    return captured.err


def test_unknown_planner_lists_the_valid_ones(capsys):
    err = one_line_error(capsys, "--planner", "fastest", "--profile", "lmsys", *SMALL)
    assert "unknown planner 'fastest'" in err and "padding, packing, megatron, static-cp, sorted, token-balanced" in err


def test_unknown_model_preset_lists_the_presets(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", "--model", "gpt5")
    assert "unknown model 'gpt5'" in err and "qwen2.5-7b" in err


def test_unknown_cluster_preset_lists_the_presets(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", "--cluster", "tpu")
    assert "unknown cluster 'tpu'" in err and "h100" in err


def test_unknown_profile_is_one_line(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "nope", *SMALL)
    assert "nope" in err


@pytest.mark.parametrize("bad", [0, -5])
def test_non_positive_length_is_rejected(capsys, tmp_path, bad):
    err = one_line_error(capsys, "--planner", "packing", "--lengths", lengths_file(tmp_path, 10, bad, 30), *SMALL)
    assert str(bad) in err


def test_overlong_sequence_under_policy_error_names_the_policies(capsys, tmp_path):
    path = lengths_file(tmp_path, 100, 9000)
    err = one_line_error(capsys, "--planner", "packing", "--lengths", path, "--context-length", "8192", *SMALL)
    assert "9000" in err and "8192" in err


def test_overlong_sequence_dropped_or_truncated_plans(capsys, tmp_path):
    path = lengths_file(tmp_path, 100, 9000)
    for policy, batch in (("drop", "1"), ("truncate", "2")):  # dropping leaves one sequence
        assert main(["plan", "--planner", "packing", "--lengths", path, "--batch-size", batch,
                     "--context-length", "8192", "--overlong", policy, *SMALL]) == 0
    capsys.readouterr()


def test_pp_that_does_not_divide_the_layers_shows_them(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", "--model", "qwen2.5-7b", "--pp", "3")
    assert "pp(3) does not divide the layers: qwen2.5-7b has 28" in err


def test_tp_that_does_not_divide_the_heads_shows_them(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", "--model", "qwen2.5-7b", "--tp", "3")
    assert "tp(3) does not divide the heads: qwen2.5-7b has 28" in err


@pytest.mark.parametrize("flag,value", [("--dp", "0"), ("--pp", "-1"), ("--zero", "5")])
def test_bad_degree_or_zero_stage(capsys, flag, value):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", *SMALL, flag, value)
    assert value in err


def test_model_states_that_do_not_fit_say_how_much_is_needed(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", "--model", "qwen2.5-72b")
    assert "GiB of model states" in err and "GiB" in err.split("but")[-1]


def test_sequence_over_pipeline_memory_names_it_and_the_limit(capsys, tmp_path):
    path = lengths_file(tmp_path, 100, 100000)
    err = one_line_error(capsys, "--planner", "packing", "--lengths", path, "--batch-size", "2",
                         "--context-length", "131072", "--model", "qwen2.5-7b", "--pp", "4")
    assert "has 100000 tokens >" in err and "longest one pipeline" in err


def test_option_without_equals_sign(capsys):
    err = one_line_error(capsys, "--planner", "padding", "--profile", "lmsys", *SMALL, "--option", "micro_batch_size")
    assert "expected KEY=VALUE" in err


def test_option_the_planner_does_not_take(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", *SMALL, "--k", "2")
    assert "planner packing has no option k" in err


def test_non_positive_micro_batch_size(capsys):
    err = one_line_error(capsys, "--planner", "padding", "--profile", "lmsys", *SMALL, "--option", "micro_batch_size=0")
    assert "micro_batch_size must be a positive integer" in err


def test_zero_batch_size(capsys):
    err = one_line_error(capsys, "--planner", "packing", "--profile", "lmsys", *SMALL, "--batch-size", "0")
    assert "--batch-size 0" in err


def test_missing_workload_source(capsys):
    err = one_line_error(capsys, "--planner", "packing", *SMALL)
    assert "--profile" in err


def test_missing_planner_flag_is_an_argparse_error(capsys):
    err = one_line_error(capsys, "--profile", "lmsys")
    assert "--planner" in err


@pytest.mark.parametrize("argv,message", [
    (["simulate", "{tmp}/missing.json"], "no plan file at"),
    (["simulate", "{tmp}/broken.json"], "is not a readable lengthwise plan"),
    (["plan", "--planner", "packing", "--profile", "tiny", "--batch-size", "8", "--model", "tiny",
      "--cluster", "cpu", "--profile-file", "{tmp}/missing.json"], "no profile file at"),
    (["plan", "--planner", "packing", "--profile", "tiny", "--batch-size", "8", "--model", "tiny",
      "--cluster", "cpu", "--profile-file", "{tmp}/broken.json"], "is not a readable lengthwise profile"),
])
def test_missing_or_broken_json_files_are_one_line_errors(tmp_path, capsys, argv, message):
    (tmp_path / "broken.json").write_text("{not json")
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


# ---- every command: bad input ends in one line naming the fix, exit 2, nothing on stdout ----

def _files(tmp_path):
    (tmp_path / "short.txt").write_text("100\n200\n")
    (tmp_path / "nonint.txt").write_text("abc\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken.json").write_text('{"x":')
    (tmp_path / "adir").mkdir()
    (tmp_path / "latin1.toml").write_bytes(b"steps = 3\nplanner = \"caf\xe9\"\n")
    return tmp_path


# ---- files several rows share: tests/bad_input_assets.py ----

@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Builds each group of shared files the first time a row names one of them."""
    folder = tmp_path_factory.mktemp("assets")
    built: set = set()

    def need(group: str):
        for first in (*NEEDS.get(group, ()), group):
            if first not in built:
                MAKERS[first](folder)
                built.add(first)
        return folder

    return need


TABLE = [
    (["plan", "--planner", "packing", "--profile", "lmsys", "--batch-size", "-3"], "--batch-size -3 must be at least 1"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--seed", "-1"], "--seed -1"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--context-length", "0"], "--context-length 0"),
    (["plan", "--planner", "packing", "--lengths", "{t}/empty.txt"], "holds no lengths"),
    (["plan", "--planner", "packing", "--lengths", "{t}/nonint.txt"], "'abc' is not an integer length"),
    (["plan", "--planner", "packing", "--lengths", "{t}/short.txt", "--batch-size", "64"], "--resample"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--out", "/proc/x/plan.json"], "cannot write there"),
    (["plan", "--planner", "chunkflow", "--profile", "lmsys"], "raise --tp/--pp or the ZeRO stage"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--tp", "3"], "tp(3) does not divide the heads"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--model", "{t}/missing.json"], "no model config"),
    (["simulate", "{t}/adir"], "Is a directory"),
    (["simulate", "{t}/broken.json"], "not a readable lengthwise plan"),
    (["simulate", "{t}/missing.json"], "no plan file"),
    (["simulate", "--stages", "0", "--fwd", "1,2"], "stages >= 1"),
    (["simulate", "--stages", "2", "--fwd", "1,-2"], "finite times"),
    (["simulate", "--stages", "2", "--fwd", "a,b"], "comma-separated numbers"),
    (["simulate", "--stages", "2", "--fwd", "1,1", "--groups", "5-9"], "group 5-9"),
    (["simulate", "--stages", "2", "--fwd", "1,1", "--gantt", "/proc/x/g.png"], "cannot write there"),
    (["compare", "--gpus", "0"], "must be at least 1"),
    (["compare", "--batches", "0"], "must be at least 1"),
    (["compare", "--planners", "nope"], "unknown planner 'nope'"),
    (["compare", "--scheme", "dp3-tp9"], "!= gpus(32)"),
    (["compare", "--scheme", "garbage"], "dpD-tpT-ppP-cpC"),
    (["compare", "--out", "/proc/x/rep", "--batches", "1", "--planners", "packing"], "cannot write there"),
    (["workload", "--profile", "nope"], "unknown profile 'nope'"),
    (["workload", "--profile", "lmsys", "--samples", "0"], "--samples 0"),
    (["workload", "--lengths", "{t}/missing.txt"], "does not exist"),
    (["verify", "--lengths", "200,-3,5"], "length 2 is -3"),
    (["verify", "--compile-chain", "--no-compile"], "--compile-chain compiles the layers: drop --no-compile"),
    (["profile", "--model", "tiny", "--compile-chain", "--no-compile"], "--compile-chain compiles the layers"),
    (["train", "--compile-chain", "--no-compile"], "compile_chain (--compile-chain) compiles the layers"),
    (["verify", "--model-config", "{t}/missing.json"], "no model config"),
    (["train", "--steps", "0"], "steps 0"),
    (["train", "--lr", "inf"], "finite"),
    (["train", "--metrics", "/proc/m.jsonl"], "cannot write there"),
    (["train", "--batch-size", "0"], "batch_size 0"),
    (["dryrun", "{t}/missing.json"], "no plan file"),
    (["dryrun", "{t}/broken.json"], "not a readable lengthwise plan"),
    (["export", "{t}/adir", "--hf", "{t}/out"], "holds no checkpoint"),
    (["export", "{t}/nothere", "--hf", "{t}/out"], "no checkpoint folder"),
    (["profile", "--model", "nope"], "unknown model 'nope'"),
    # sizes: every count bounded before any work (lengthwise/limits.py), the bound and why named
    (["workload", "--profile", "lmsys", "--samples", "99999999999999999999"], "over the limit of 100,000,000 draws"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--batch-size", "1000000000000"],
     "over the limit of 1,000,000 sequences"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--dp", "1000000"], "GPUs is over the limit of 65,536"),
    (["plan", "--planner", "packing", "--profile", "tiny", "--model", "tiny", "--cluster", "cpu", "--dp", "100000"],
     "dp(100000) x tp(1) x pp(1) x cp(1) = 100,000 GPUs"),
    (["plan", "--planner", "packing", "--profile", "tiny", "--model", "tiny", "--cluster", "cpu",
      "--context-length", "99999999999999999999"], "--context-length 99999999999999999999 is over the limit"),
    (["workload", "--profile", "lmsys", "--context-length", "99999999999999999999"], "is over the limit"),
    (["compare", "--batches", "100000000000"], "--batches 100000000000 is over the limit of 1,000 batches"),
    (["compare", "--gpus", "10000000"], "--gpus 10000000 is over the limit"),
    (["compare", "--tokens-per-batch", "99999999999999"], "--tokens-per-batch 99999999999999 is over the limit"),
    (["verify", "--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["verify", "--batch-size", "-4"], "--batch-size -4 must be at least 1"),
    (["verify", "--batch-size", "3"], "the built-in batch 200,30,17,60,5 has 5 sequences"),
    (["verify", "--lengths", "9,8,7", "--batch-size", "2"], "--lengths 9,8,7 has 3 sequences"),
    (["verify", "--nproc", "100000"], "--nproc 100000 is over the limit of 256 processes"),
    (["simulate", "--stages", "100000", "--fwd", "1,1"], "--stages 100000 is over the limit of 1,024 stages"),
    (["simulate", "--stages", "2", "--fwd", "3,,4"], "has an empty item"),
    (["train", "--context-length", "99999999999999999999"], "context_length 99999999999999999999 is over the limit"),
    (["train", "--batch-size", "10000000"], "batch_size 10000000 is over the limit"),
    (["train", "--nproc", "100000"], "nproc 100000 is over the limit"),
    (["train", "--dp", "300000"], "= 300,000 GPUs is over the limit"),
    (["train", "--threads", "100000"], "threads 100000 is over the limit of 1,024 threads"),
    (["train", "--timeout", "1e300"], "--timeout 1e+300 must be a number of seconds in (0, 604,800]"),
    (["verify", "--timeout", "nan"], "--timeout nan must be a number of seconds"),
    (["dryrun", "{a}/plan.json", "--ranks", ",".join(["0"] * 300)], "--ranks count 300 is over the limit of 256"),
    (["profile", "--model", "tiny", "--repeats", "100000"], "--repeats 100000 is over the limit of 1,000 repeats"),
    (["profile", "--model", "tiny", "--max-tokens", "99999999999999999999"], "--max-tokens 99999999999999999999 is over"),
    (["profile", "--model", "tiny", "--out", "/proc/p.json"], "--out /proc: cannot write there"),
    # paths named as what they are
    (["workload", "--profile", "lmsys", "--samples", "10", "--plot", "/proc/x.png"], "--plot /proc/x.png: cannot write"),
    (["workload", "--profile", "lmsys", "--samples", "10", "--plot", "{t}/adir"], "adir is a folder; give a file"),
    (["workload", "--lengths", "{t}/adir"], "adir is a folder; give a file of lengths"),
    (["plan", "--planner", "packing", "--profile", "lmsys", "--out", "{t}/adir"], "--out {t}/adir is a folder"),
    (["export", "{t}/adir", "--hf", "/proc/x"], "--hf /proc/x: cannot write there"),
    (["export", "{t}/adir", "--hf", "{t}/short.txt"], "is a file; give a folder"),
    (["train", "--config", "{t}/latin1.toml"], "not UTF-8 text"),
    (["train", "--config", "{t}/adir"], "is a folder; give a TOML file"),
    # rates AdamW cannot apply, non-finite and unreadable state
    (["train", "--weight-decay", "1e300"], "keep the product below 1"),
    (["train", "--lr", "1e300"], "over the largest float32 number"),
    (["train", "--model", "{a}/nan-model", "--skip-nonfinite", "--data", "{a}/docs", *TRAIN_SMALL],
     "holds NaN or infinite values"),
    (["train", "--model", "{a}/garbage-model", "--data", "{a}/docs", *TRAIN_SMALL],
     "is not a readable safetensors file"),
    (["train", "--data", "{a}/binary", *TRAIN_SMALL], "none of its 3 file(s) is UTF-8 text"),
    *[(["train", "--resume", f"{{a}}/{name}/step-000001", "--data", "{a}/docs", "--steps", "2", "--out", "{t}/run",
        *TRAIN_SMALL], "is not a readable") for name in RESEALS],
    (["train", "--resume", "{a}/step-999/step-000001", "--data", "{a}/docs", "--steps", "2", "--out", "{t}/run",
      *TRAIN_SMALL], "MANIFEST.json says 999"),
    (["train", "--resume", "{a}/distributed-no-nproc/step-000001", "--data", "{a}/docs", "--steps", "2",
      "--out", "{t}/run", *TRAIN_SMALL], "written by a distributed run; resume it"),
    (["train", "--resume", "{a}/run/step-000001", "--data", "{a}/docs", "--steps", "2", "--out", "{t}/run",
      "--text-field", "body", *TRAIN_SMALL], "trained with --text-field text, this run has body"),
    *[(["train", "--data", "{a}/docs.jsonl", "--tokenizer", "{a}/tok", "--token-cache", f"{{a}}/cache-{name}",
        *TRAIN_SMALL], "token cache entry") for name in ("lengths", "bin", "json", "truncated-bin")],
    # plans the readers and the validator refuse
    (["simulate", "{a}/extra.json"], "field extra_comm_s must be a number of seconds in [0, 1e+06]"),
    (["simulate", "{a}/negative-option.json"], "options.chunk_size is -5"),
    (["simulate", "{a}/dropped-stage.json"], "use 3 of the cluster's 4 GPUs"),
    (["simulate", "{a}/layers-4-0.json"], "splits its layers [2, 2] over its stages, pipeline 0"),
    (["dryrun", "{a}/layers-4-0.json"], "replicas must hold the same layers"),
]


@pytest.mark.parametrize("argv,fix", TABLE, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in enumerate(TABLE)])
def test_bad_input_is_one_line_naming_the_fix(tmp_path, capsys, assets, argv, fix):
    folder = _files(tmp_path)
    shared = [assets(group) for group in sorted(asset_groups(argv))][-1:] or [None]
    argv = [a.replace("{t}", str(folder)).replace("{a}", str(shared[0])) for a in argv]
    capsys.readouterr()  # what building the shared files printed
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert fix.replace("{t}", str(folder)) in captured.err, captured.err
    assert "None" not in captured.err, captured.err  # a message never shows a Python None
    assert not (folder / "out").exists()


# ---- inputs that are valid but unlikely to be meant: the run goes on, with a notice on stderr ----

NOTICES = [
    (["train", "--data", "{a}/docs", "--warmup-steps", "100", "--steps", "1", "--out", "{t}/run", *TRAIN_SMALL],
     "--warmup-steps 100 is not shorter than --steps 1: the learning rate never leaves the warm-up and peaks at 1%"),
    (["train", "--data", "{a}/mixed", "--steps", "1", "--out", "{t}/run", *TRAIN_SMALL],
     "1 of 7 files are not UTF-8 text"),
    (["plan", "--planner", "packing", "--profile", "tiny", "--batch-size", "8", "--model", "tiny", "--cluster", "cpu",
      "--dp", "40"], "--dp 40 pipelines for 8 sequences; at least 32 pipeline(s) get no sequence"),
    (["train", "--resume", "{a}/run/step-000001", "--data", "{a}/docs", "--steps", "2", "--out", "{t}/run",
      "--dtype", "float64", "--lr-schedule", "cosine", "--min-lr", "0.001", "--grad-clip", "0.5",
      "--planner", "packing", *TRAIN_SMALL],
     "with --planner chunkflow -> packing, --steps 1 -> 2, --lr-schedule constant -> cosine, --min-lr 0 -> 0.001, "
     "--grad-clip 1 -> 0.5, --dtype float32 -> float64"),
]


@pytest.mark.parametrize("argv,notice", NOTICES, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in enumerate(NOTICES)])
def test_unlikely_input_runs_with_a_notice(tmp_path, capsys, assets, argv, notice):
    shared = [assets(group) for group in sorted(asset_groups(argv))][-1:] or [None]
    argv = [a.replace("{t}", str(tmp_path)).replace("{a}", str(shared[0])) for a in argv]
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert notice in captured.err and "Traceback" not in captured.err, captured.err


def test_plan_summary_lists_at_most_32_pipelines(capsys):
    assert main(["plan", "--planner", "packing", "--profile", "tiny", "--batch-size", "64", "--model", "tiny",
                 "--cluster", "cpu", "--dp", "40"]) == 0
    out = capsys.readouterr().out
    assert "... 8 more pipelines (--json prints them all)" in out and len(out.splitlines()) < 40
