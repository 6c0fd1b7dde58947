"""Every bad input to `lengthwise plan` ends with one stderr line naming the fix and exit code 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

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
    path = lengths_file(tmp_path, 100, 60000)
    err = one_line_error(capsys, "--planner", "packing", "--lengths", path, "--batch-size", "2",
                         "--context-length", "65536", "--model", "qwen2.5-7b", "--pp", "4")
    assert "has 60000 tokens >" in err and "longest one pipeline" in err


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


# ---- files several rows share, made once per module (lazily: only rows naming {a} build them) ----

TRAIN_SMALL = ["--batch-size", "2", "--context-length", "32", "--threads", "1", "--no-progress", "--device", "cpu"]
"""The tiny model on the assets' text folder: what every train row that gets past its flags runs."""


def _plan_variants(folder: Path) -> None:
    """A valid tiny plan (dp 2 x pp 2, 4 GPUs) and four edits of it the readers must refuse."""
    assert main(["plan", "--planner", "packing", "--profile", "tiny", "--batch-size", "8", "--model", "tiny",
                 "--cluster", "cpu", "--dp", "2", "--pp", "2", "--out", str(folder / "plan.json")]) == 0
    base = json.loads((folder / "plan.json").read_text())
    edits = {
        "extra.json": lambda d: d["pipelines"][0].update(extra_comm_s=1e308),
        "negative-option.json": lambda d: d["options"].update(chunk_size=-5),
        "dropped-stage.json": lambda d: d["pipelines"][1].update(stages=d["pipelines"][1]["stages"][:1]),
        "layers-4-0.json": lambda d: d["pipelines"][0].update(layers_per_stage=[d["model"]["num_layers"], 0]),
    }
    for name, edit in edits.items():
        plan = json.loads(json.dumps(base))
        edit(plan)
        (folder / name).write_text(json.dumps(plan))


def _reseal(step_dir: Path, damage, **meta) -> None:
    """Damage a checkpoint file, then rewrite MANIFEST.json to match (what an attacker would do)."""
    from lengthwise.runtime.manifest import write_manifest

    damage(step_dir)
    (step_dir / "MANIFEST.json").unlink()
    write_manifest(step_dir, meta={"kind": "single", "step": 1, **meta})


RESEALS = {
    "model-header": lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
    "optimizer-header": lambda d: (d / "optimizer.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{garbage"),
    "optimizer-json": lambda d: (d / "optimizer.json").write_bytes(b"\xff\xfe not utf-8"),
    "rng-json": lambda d: (d / "rng.json").write_bytes(b"\xc3\x28"),
    "rng-tensors": lambda d: (d / "rng.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"[1, 2, 3, 4, 5, 6]"),
    "trainer-json": lambda d: (d / "trainer.json").write_bytes(b"\x80{}"),
}


def _checkpoints(folder: Path) -> None:
    """One single-process checkpoint after step 1, and resealed or edited copies of it."""
    assert main(["train", "--data", str(folder / "docs"), "--steps", "1", "--out", str(folder / "run"),
                 *TRAIN_SMALL]) == 0
    good = folder / "run" / "step-000001"
    copies = {name: (damage, {}) for name, damage in RESEALS.items()}
    copies |= {"step-999": (lambda d: None, {"step": 999}),
               "distributed-no-nproc": (lambda d: None, {"kind": "distributed"})}
    for name, (damage, meta) in copies.items():
        target = folder / name / "step-000001"
        shutil.copytree(good, target)
        _reseal(target, damage, **meta)
    nan = folder / "nan-model"
    shutil.copytree(good, nan)
    _poison(nan / "model.safetensors")
    garbage = folder / "garbage-model"
    shutil.copytree(good, garbage)
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file at all")


def _poison(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    first = sorted(tensors)[0]
    tensors[first].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


def _token_caches(folder: Path) -> None:
    """A tokenizer, a JSONL corpus, its token cache, and four copies of the cache each damaged in one file."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from lengthwise.workloads.corpus import load_corpus

    words = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate("the a cat dog sat ran on mat".split())}}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                         unk_token="[UNK]").save_pretrained(folder / "tok")
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": "the cat sat on the mat " * (i + 1)}) + "\n"
                                               for i in range(8)))
    load_corpus(str(folder / "docs.jsonl"), str(folder / "tok"), cache_dir=str(folder / "cache"))
    damages = {
        "lengths": lambda c: next(c.glob("*.lengths.npy")).write_bytes(b"\x93NUMPY garbage"),
        "bin": lambda c: next(c.glob("*.bin")).unlink(),
        "json": lambda c: next(c.glob("*.json")).write_text('{"format": 1, "documents": "many"}'),
        "truncated-bin": lambda c: next(c.glob("*.bin")).write_bytes(next(c.glob("*.bin")).read_bytes()[:-4]),
    }
    for name, damage in damages.items():
        shutil.copytree(folder / "cache", folder / f"cache-{name}")
        damage(folder / f"cache-{name}")


def _data(folder: Path) -> None:
    (folder / "docs").mkdir()
    for i in range(6):
        (folder / "docs" / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 4)
    (folder / "binary").mkdir()
    for i in range(3):
        (folder / "binary" / f"{i}.txt").write_bytes(bytes(range(128, 256)) * 3)
    shutil.copytree(folder / "docs", folder / "mixed")
    (folder / "mixed" / "blob.txt").write_bytes(b"\xff\xfe" * 50)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Builds each group of shared files the first time a row names one of them."""
    folder = tmp_path_factory.mktemp("assets")
    built: set = set()
    makers = {"plan": _plan_variants, "data": _data, "ckpt": _checkpoints, "cache": _token_caches}
    needs = {"ckpt": ("data",)}

    def need(group: str) -> Path:
        for first in (*needs.get(group, ()), group):
            if first not in built:
                makers[first](folder)
                built.add(first)
        return folder

    return need


ASSET_GROUPS = {"plan": ("plan.json", "extra.json", "negative-option.json", "dropped-stage.json", "layers-4-0.json"),
                "data": ("docs", "binary", "mixed"),
                "ckpt": (*RESEALS, "step-999", "distributed-no-nproc", "nan-model", "garbage-model", "run"),
                "cache": ("tok", "docs.jsonl", "cache")}
"""Which maker builds each top-level name under {a}."""


def asset_groups(argv: list[str]) -> set[str]:
    names = {a.split("{a}/", 1)[1].split("/")[0] for a in argv if "{a}/" in a}
    return {g for g, members in ASSET_GROUPS.items() for n in names
            if n in members or (g == "cache" and n.startswith("cache"))}


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
