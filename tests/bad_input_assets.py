"""Files rows of the bad-input table share (tests/test_bad_input.py), built once per module and
only when a row names them: edited plans, a text corpus, a checkpoint and resealed or damaged
copies of it, a token cache and damaged copies of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lengthwise.cli import main

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


ASSET_GROUPS = {"plan": ("plan.json", "extra.json", "negative-option.json", "dropped-stage.json", "layers-4-0.json"),
                "data": ("docs", "binary", "mixed"),
                "ckpt": (*RESEALS, "step-999", "distributed-no-nproc", "nan-model", "garbage-model", "run"),
                "cache": ("tok", "docs.jsonl", "cache")}
"""Which maker builds each top-level name under {a}."""


def asset_groups(argv: list[str]) -> set[str]:
    names = {a.split("{a}/", 1)[1].split("/")[0] for a in argv if "{a}/" in a}
    return {g for g, members in ASSET_GROUPS.items() for n in names
            if n in members or (g == "cache" and n.startswith("cache"))}


MAKERS = {"plan": _plan_variants, "data": _data, "ckpt": _checkpoints, "cache": _token_caches}
NEEDS = {"ckpt": ("data",)}
"""Groups another group's maker uses."""
