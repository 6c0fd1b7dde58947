"""What a trainer is expected to have: warm-up and cosine learning rates (resumed exactly), a
held-out loss, the tokenizer kept with the run, a token cache built once, Hugging Face dataset
folders and TensorBoard where installed. Tiny model, float64, a few short steps."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch

from lengthwise.errors import UserError
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.loop import Setup, train
from lengthwise.runtime.train.schedule import lr_factor
from lengthwise.workloads import corpus as corpus_module
from lengthwise.workloads.corpus import load_corpus
from lengthwise.workloads.token_cache import open_or_build


def small(**changes) -> TrainConfig:
    base = {"dtype": "float64", "context_length": 64, "batch_size": 3, "steps": 4, "lr": 1e-2,
            "progress": False, "options": {"chunk_size": 32, "k": 1}, "threads": 1, "device": "cpu"}
    return TrainConfig(**{**base, **changes})


def test_warmup_then_cosine_reaches_min_lr_at_the_last_step():
    config = small(steps=10, warmup_steps=2, lr_schedule="cosine", min_lr=1e-3)
    factors = [lr_factor(i, config) for i in range(config.steps)]
    assert factors[:3] == [1 / 3, 2 / 3, 1.0]
    assert all(a > b for a, b in zip(factors[2:], factors[3:], strict=False))
    assert factors[-1] * config.lr == pytest.approx(config.min_lr, rel=1e-12)
    assert all(lr_factor(i, small(steps=10)) == 1.0 for i in range(10))  # constant, no warm-up


def test_a_scheduled_run_resumes_bit_identically(tmp_path):
    schedule = {"warmup_steps": 1, "lr_schedule": "cosine", "min_lr": 1e-4}
    whole = train(small(**schedule))
    train(small(**schedule, steps=2, out=str(tmp_path)))
    resumed = train(small(**schedule, out=str(tmp_path)))
    assert [r.lr for r in resumed.records] == [r.lr for r in whole.records[2:]]
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_held_out_loss_every_n_steps_on_sequences_never_trained_on(tmp_path):
    config = small(eval_every=2, eval_sequences=4, metrics=str(tmp_path / "m.jsonl"))
    result = train(config)
    assert [r.eval_loss is not None for r in result.records] == [False, True, False, True]
    assert all(math.isfinite(r.eval_loss) for r in result.records if r.eval_loss is not None)
    held = set(Setup(config).eval_ids)
    assert len(held) == 4 and not held & {i for r in result.records for i in r.seq_ids}
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [("eval_loss" in line) for line in lines] == [False, True, False, True]


def test_holding_out_every_document_is_a_user_error(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some text")
    with pytest.raises(UserError, match="--eval-sequences 16 would hold out all 1 documents"):
        Setup(small(data=str(tmp_path / "docs"), eval_every=1))


@pytest.fixture
def tokenizer_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate("the a cat dog sat ran on mat".split())}}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                         unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def _documents(path, count: int = 12) -> None:
    words = "the a cat dog sat ran on mat".split()
    path.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % 8] for j in range(5 + i))}) + "\n"
                            for i in range(count)))


def test_token_cache_is_built_once_and_reused(tmp_path, tokenizer_dir, monkeypatch):
    data, cache = tmp_path / "c.jsonl", tmp_path / "cache"
    _documents(data)
    plain = load_corpus(str(data), str(tokenizer_dir))
    first = load_corpus(str(data), str(tokenizer_dir), cache_dir=str(cache))
    assert len(list(cache.glob("*.bin"))) == 1
    monkeypatch.setattr(corpus_module, "_hf_ids", lambda *a: pytest.fail("re-tokenised a cached corpus"))
    again = load_corpus(str(data), str(tokenizer_dir), cache_dir=str(cache))
    for corpus in (first, again):
        assert corpus.lengths.tolist() == plain.lengths.tolist() and corpus.vocab_size == plain.vocab_size
        assert all(a.tolist() == b.tolist() for a, b in zip(corpus.documents, plain.documents, strict=True))
    monkeypatch.undo()
    _documents(data, count=13)  # an edited corpus is another entry
    assert load_corpus(str(data), str(tokenizer_dir), cache_dir=str(cache)).lengths.size == 13
    assert len(list(cache.glob("*.bin"))) == 2


def test_training_with_a_tokenizer_keeps_it_with_the_run(tmp_path, tokenizer_dir):
    data = tmp_path / "c.jsonl"
    _documents(data)
    out = tmp_path / "run"
    result = train(small(steps=2, data=str(data), tokenizer=str(tokenizer_dir), token_cache=str(tmp_path / "cache"),
                         out=str(out)))
    assert len(result.records) == 2 and math.isfinite(result.records[-1].loss)
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert list((tmp_path / "cache").glob("*.lengths.npy"))


def test_hugging_face_dataset_folder(tmp_path):
    folder = tmp_path / "ds"
    try:
        import datasets
    except ImportError:
        folder.mkdir()
        (folder / "state.json").write_text("{}")
        with pytest.raises(UserError, match="needs the datasets package"):
            load_corpus(str(folder))
        return
    datasets.Dataset.from_dict({"text": ["hello", "", "world!"]}).save_to_disk(str(folder))
    corpus = load_corpus(str(folder))
    assert corpus.lengths.tolist() == [7, 8]  # BOS + bytes + EOS, the empty document skipped
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["abc"]}),
                                   "test": datasets.Dataset.from_dict({"body": ["held out"]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    assert load_corpus(str(tmp_path / "dd"), text_field="body").lengths.tolist() == [5]  # the train split


def test_tensorboard_logs_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    train(small(steps=2, out=str(tmp_path)))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_concurrent_openers_of_one_cache_entry_build_it_once(tmp_path):
    """Ranks starting together: one builds under the entry's lock, the others wait and map it."""
    builds = []

    def build():
        builds.append(1)
        return (np.arange(n, dtype=np.int64) for n in (3, 5, 2))

    results = [None] * 4

    def opener(i):
        results[i] = open_or_build(tmp_path, "k" * 32, build=build, vocab_size=10)

    threads = [threading.Thread(target=opener, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    for documents, lengths, vocab in results:
        assert lengths.tolist() == [3, 5, 2] and vocab == 10
        assert [d.tolist() for d in documents] == [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1]]
