"""Every other file lengthwise reads is data too: a pickle payload planted in a plan, a cost
profile, a lengths file (text or .npy), a token-cache entry or a tokenizer folder (its files,
or a config naming remote code) is refused in one line and never runs.
(Checkpoints: tests/test_checkpoint_safety.py.)"""

from __future__ import annotations

import builtins
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from lengthwise.cli import main
from lengthwise.errors import UserError


class Payload:
    """Unpickling (or importing, for the remote-code file) this creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def payload(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert "Traceback" not in err and len(errors) == 1, err
    return errors[0]


def test_the_payload_is_real(tmp_path):
    pickle.loads(payload(tmp_path / "ran"))
    assert (tmp_path / "ran").exists()


def test_a_plan_file_payload(tmp_path, capsys):
    plan, marker = tmp_path / "plan.json", tmp_path / "ran"
    plan.write_bytes(payload(marker))
    assert main(["simulate", str(plan)]) == 2
    assert str(plan) in one_error_line(capsys) and not marker.exists()


def test_a_profile_file_payload(tmp_path, capsys):
    profile, marker = tmp_path / "profile.json", tmp_path / "ran"
    profile.write_bytes(payload(marker))
    code = main(["plan", "--planner", "packing", "--profile", "tiny", "--batch-size", "4", "--model", "qwen2.5-0.5b",
                 "--profile-file", str(profile), "--out", str(tmp_path / "plan.json")])
    assert code == 2 and str(profile) in one_error_line(capsys) and not marker.exists()


@pytest.mark.parametrize("suffix", [".txt", ".npy"])
def test_a_lengths_file_payload(tmp_path, capsys, suffix):
    lengths, marker = tmp_path / f"lengths{suffix}", tmp_path / "ran"
    if suffix == ".npy":  # an object array: numpy pickles its items
        np.save(lengths, np.array([Payload(marker), 5], dtype=object), allow_pickle=True)
    else:
        lengths.write_bytes(payload(marker))
    assert main(["workload", "--lengths", str(lengths)]) == 2
    assert str(lengths) in one_error_line(capsys) and not marker.exists()


@pytest.fixture
def tokenizer_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate("the a cat dog".split())}}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                         unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def _corpus(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": "the cat a dog " * (i + 1)}) + "\n" for i in range(6)))
    return path


@pytest.mark.parametrize("part", ["json", "lengths.npy"])
def test_a_token_cache_payload(tmp_path, tokenizer_dir, part):
    from lengthwise.workloads.corpus import load_corpus

    data, cache, marker = _corpus(tmp_path / "c.jsonl"), tmp_path / "cache", tmp_path / "ran"
    load_corpus(str(data), str(tokenizer_dir), cache_dir=str(cache))
    entry = next(cache.glob(f"*.{part}"))
    if part == "json":
        entry.write_bytes(payload(marker))
    else:
        np.save(entry, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(UserError) as caught:
        load_corpus(str(data), str(tokenizer_dir), cache_dir=str(cache))
    assert "\n" not in str(caught.value) and not marker.exists()


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
def test_a_tokenizer_file_payload(tmp_path, tokenizer_dir, name):
    from lengthwise.workloads.corpus import load_hf_tokenizer

    marker = tmp_path / "ran"
    (tokenizer_dir / name).write_bytes(payload(marker))
    try:
        load_hf_tokenizer(str(tokenizer_dir))
    except UserError as exc:
        assert "\n" not in str(exc)
    assert not marker.exists()


def test_a_tokenizer_naming_remote_code_is_refused(tmp_path, tokenizer_dir):
    from lengthwise.workloads.corpus import load_hf_tokenizer

    marker = tmp_path / "ran"
    (tokenizer_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                           "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config |= {"auto_map": {"AutoTokenizer": [None, "evil.EvilTokenizer"]}, "tokenizer_class": "EvilTokenizer"}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as caught:
        load_hf_tokenizer(str(tokenizer_dir))
    assert "\n" not in str(caught.value) and not marker.exists()
