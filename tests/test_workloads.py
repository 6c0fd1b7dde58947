"""Workloads: published profiles, lengths files, corpora, overlong policy, resumable sampler."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lengthwise.errors import UserError
from lengthwise.workloads import (ByteTokenizer, GlobalBatchSampler, apply_overlong,
                                  corpus_source, get_profile, length_stats, lengths_file_source,
                                  load_corpus, profile_names, profile_source, read_lengths)

K = 1024
# (profile, {threshold: published share below it}, published longest), K = 1024.
PUBLISHED = [
    ("lmsys", {1: .90499, 4: .99539, 8: .99908, 32: .99987, 128: .99996}, 303 * K),   # chunkflow T1
    ("chunkflow-eval", {1: .9817, 4: .9972, 8: .9983, 32: .9992, 128: .9998}, 256 * K),  # chunkflow T2
    ("wikipedia", {1: .8788, 4: .9934, 8: .9992, 32: .9999, 128: 1.0}, 78 * K),   # skrull T1
    ("lmsys-skrull", {1: .8712, 4: .9935, 8: .9987, 32: .9998, 128: .9999}, 1643 * K),  # skrull T1
    ("chatqa2", {1: .2192, 4: .3148, 8: .4043, 32: .9986, 128: 1.0}, 99 * K),   # skrull T1
]


@pytest.mark.parametrize("name,table,longest", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_profile_cdf_passes_through_published_points(name, table, longest):
    profile = get_profile(name)
    for k, share in table.items():
        assert profile.share_below(k * K) == pytest.approx(share, abs=1e-12)
    assert profile.max_length == longest


@pytest.mark.parametrize("name,table,longest", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_sampled_shares_match_published_within_half_a_point(name, table, longest):
    lengths = get_profile(name).sample(100_000, np.random.default_rng(0))
    shares = length_stats(lengths)["share_below"]
    for k, share in table.items():
        assert abs(shares[str(k * K)] - share) < 0.005, (k, shares[str(k * K)], share)
    assert lengths.max() <= longest


def test_github_tail_holds_published_token_share():
    # infinipipe §1: 91.5% <= 8K; 0.6% > 64K holding 21.6% of tokens.
    lengths = get_profile("github").sample(1_000_000, np.random.default_rng(0)).astype(float)
    assert (lengths <= 8 * K).mean() == pytest.approx(0.915, abs=0.002)
    assert (lengths > 64 * K).mean() == pytest.approx(0.006, abs=0.0005)
    assert lengths[lengths > 64 * K].sum() / lengths.sum() == pytest.approx(0.216, abs=0.01)


def test_every_profile_samples_within_its_bounds():
    for name in profile_names():
        profile = get_profile(name)
        lengths = profile.sample(20_000, np.random.default_rng(1))
        assert lengths.dtype == np.int64
        assert profile.min_length <= lengths.min() and lengths.max() <= profile.max_length


def test_tiny_profile_fits_cpu_training():
    profile = get_profile("tiny")
    assert (profile.min_length, profile.max_length) == (8, 512)


def test_sampling_is_deterministic_for_a_seed():
    profile = get_profile("lmsys")
    a = profile.sample(1000, np.random.default_rng(7))
    b = profile.sample(1000, np.random.default_rng(7))
    c = profile.sample(1000, np.random.default_rng(8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_unknown_profile_lists_valid_names():
    with pytest.raises(UserError, match="chunkflow-eval.*chatqa2"):
        get_profile("nope")


def test_profile_drop_keeps_count_and_stays_within_context():
    source = profile_source("chatqa2", context_length=8 * K, overlong="drop")
    lengths = source.draw(10_000, np.random.default_rng(0))
    assert lengths.size == 10_000 and lengths.max() <= 8 * K
    # Conditioning on < 8K+1 rescales the published shares: P(<1K | <8K) = 21.92 / 40.43.
    assert (lengths < K).mean() == pytest.approx(0.2192 / 0.4043, abs=0.015)


def test_profile_truncate_clips_to_context():
    source = profile_source("chatqa2", context_length=4 * K, overlong="truncate")
    lengths = source.draw(10_000, np.random.default_rng(0))
    assert lengths.max() == 4 * K


def test_profile_longer_than_context_is_an_error_by_default():
    with pytest.raises(UserError, match=r"lmsys reaches 310272 tokens > --context-length "
                                        r"32768.*--overlong"):
        profile_source("lmsys", context_length=32 * K)


def test_lengths_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("# lengths\n10\n\n20  # a comment\n30\n")
    assert read_lengths(path).tolist() == [10, 20, 30]


@pytest.mark.parametrize("bad", ["0", "-5"])
def test_nonpositive_length_names_its_line(tmp_path, bad):
    path = tmp_path / "l.txt"
    path.write_text(f"10\n\n{bad}\n7\n")
    with pytest.raises(UserError, match=rf"l.txt:3: length {bad} is not positive"):
        read_lengths(path)


def test_lengths_npy_round_trips_and_rejects_floats(tmp_path):
    np.save(tmp_path / "ok.npy", np.array([3, 1, 4], dtype=np.int32))
    assert read_lengths(tmp_path / "ok.npy").tolist() == [3, 1, 4]
    np.save(tmp_path / "bad.npy", np.array([1.5]))
    with pytest.raises(UserError, match="1-D integer"):
        read_lengths(tmp_path / "bad.npy")


def test_overlong_error_names_sequence_index_and_length():
    with pytest.raises(UserError, match=r"sequence 2 has 900 tokens > context length 512 "
                                        r"\(2 such"):
        apply_overlong([10, 20, 900, 1000], 512, "error")


def test_overlong_truncate_and_drop():
    assert apply_overlong([10, 900], 512, "truncate").tolist() == [10, 512]
    assert apply_overlong([10, 900, 30], 512, "drop").tolist() == [10, 30]


def test_dropped_sequences_keep_their_original_ids(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("10\n900\n30\n")
    source = lengths_file_source(str(path), context_length=512, overlong="drop")
    assert source.seq_ids.tolist() == [0, 2] and source.lengths.tolist() == [10, 30]


def test_length_stats_weigh_by_count_tokens_and_attention():
    stats = length_stats([1000, 3000])
    assert stats["share_below"]["1024"] == 0.5
    assert stats["token_share_below"]["1024"] == pytest.approx(0.25)
    assert stats["attention_share_below"]["1024"] == pytest.approx(0.1)  # 1e6 / (1e6 + 9e6)


def test_byte_tokenizer_round_trips_with_bos_eos():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == 256 and ids[-1] == 257 and ids.max() < tok.vocab_size == 260
    assert len(ids) == len("héllo".encode()) + 2 and tok.decode(ids) == "héllo"


def test_jsonl_corpus_uses_the_text_field(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in ["ab", "   ", "cde"]) + "\n")
    corpus = load_corpus(str(path), text_field="body")
    assert corpus.lengths.tolist() == [4, 5]  # blank document skipped; BOS + bytes + EOS
    assert [len(d) for d in corpus.documents] == corpus.lengths.tolist()


def test_jsonl_missing_field_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{"other": 1}\n')
    with pytest.raises(UserError, match=r"c.jsonl:2: no string field 'text'.*--text-field"):
        load_corpus(str(path))


def test_parquet_corpus_reads_the_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["one", "three"]}), tmp_path / "c.parquet")
    assert load_corpus(str(tmp_path / "c.parquet")).lengths.tolist() == [5, 7]


def test_folder_corpus_reads_text_files_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.py").write_text("zz")
    (tmp_path / "a.md").write_text("a")
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 9)
    corpus = load_corpus(str(tmp_path))
    assert [ByteTokenizer().decode(d) for d in corpus.documents] == ["a", "zz"]


def test_local_hf_tokenizer_tokenizes_and_appends_eos(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                         unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "c.jsonl").write_text('{"text": "hello world foo"}\n')
    corpus = load_corpus(str(tmp_path / "c.jsonl"), tokenizer_dir=str(tmp_path / "tok"))
    assert corpus.documents[0].tolist() == [2, 3, 0, 1] and corpus.lengths.tolist() == [4]


def test_missing_tokenizer_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="--tokenizer .* is not a directory"):
        load_corpus("stdlib", tokenizer_dir=str(tmp_path / "absent"))


def test_stdlib_corpus_is_deterministic_and_lengths_match_documents():
    a, b = load_corpus("stdlib"), load_corpus("stdlib")
    assert len(a.documents) > 100 and np.array_equal(a.lengths, b.lengths)
    for i in (0, len(a.documents) // 2, len(a.documents) - 1):
        assert len(a.documents[i]) == a.lengths[i]
        assert np.array_equal(a.documents[i], b.documents[i])


def test_truncated_corpus_tokens_fit_the_context():
    source = corpus_source("stdlib", context_length=256, overlong="truncate")
    batch = GlobalBatchSampler(source, seed=0, batch_size=8).next_batch()
    for seq_id, length in zip(batch.seq_ids, batch.lengths):
        assert len(source.tokens(seq_id)) == length <= 256


def _resume_matches_uninterrupted(source, **kw):
    straight = GlobalBatchSampler(source, seed=3, **kw)
    expected = [straight.next_batch() for _ in range(9)]
    first = GlobalBatchSampler(source, seed=3, **kw)
    got = [first.next_batch() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = GlobalBatchSampler(source, seed=3, **kw)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(5)]
    assert got == expected


def test_sampler_resume_neither_skips_nor_repeats(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("\n".join(str(n) for n in range(1, 24)))
    finite = lengths_file_source(str(path))
    _resume_matches_uninterrupted(finite, batch_size=5)       # crosses epoch boundaries
    _resume_matches_uninterrupted(finite, token_budget=60)
    _resume_matches_uninterrupted(profile_source("lmsys"), batch_size=300)
    _resume_matches_uninterrupted(profile_source("tiny"), token_budget=2000)


def test_each_epoch_visits_every_sequence_once(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("\n".join(str(n) for n in range(1, 24)))
    sampler = GlobalBatchSampler(lengths_file_source(str(path)), seed=0, batch_size=5)
    ids = [i for _ in range(23) for i in sampler.next_batch().seq_ids]  # 5 epochs exactly
    for epoch in range(5):
        assert sorted(ids[epoch * 23:(epoch + 1) * 23]) == list(range(23))
    assert ids[:23] != ids[23:46]  # each epoch is reshuffled


def test_token_budget_batches_are_maximal():
    sampler = GlobalBatchSampler(profile_source("tiny"), seed=0, token_budget=4096)
    for _ in range(5):
        batch = sampler.next_batch()
        following = sampler._stream(sampler._cursor, sampler._cursor + 1)[1][0]
        assert batch.num_tokens <= 4096 < batch.num_tokens + following


def test_resume_with_another_seed_is_refused():
    sampler = GlobalBatchSampler(profile_source("tiny"), seed=1, batch_size=4)
    with pytest.raises(UserError, match="seed=0 but this run has 1"):
        sampler.load_state_dict(GlobalBatchSampler(profile_source("tiny"), seed=0,
                                                   batch_size=4).state_dict())


def test_token_budget_below_longest_sequence_is_refused():
    with pytest.raises(UserError, match="token budget 100 is below the longest sequence"):
        GlobalBatchSampler(profile_source("tiny"), token_budget=100)


def test_planning_side_imports_no_torch():
    code = ("import sys, lengthwise.workloads, lengthwise.commands.workload; "
            "lengthwise.workloads.load_corpus('stdlib'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
