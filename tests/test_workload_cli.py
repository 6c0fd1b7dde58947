"""`lengthwise workload`, run in-process: published shares, JSON keys, plot, user errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lengthwise.cli import main

K = 1024
CHUNKFLOW_TABLE_2 = {1: .9817, 4: .9972, 8: .9983, 32: .9992, 128: .9998}
SKRULL_TABLE_1_CHATQA2 = {1: .2192, 4: .3148, 8: .4043, 32: .9986, 128: 1.0}


def _json(capsys, *argv) -> dict:
    assert main(["workload", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _user_error(capsys, *argv) -> str:
    assert main(["workload", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("profile,table", [("chunkflow-eval", CHUNKFLOW_TABLE_2),
                                           ("chatqa2", SKRULL_TABLE_1_CHATQA2)])
def test_json_shares_reproduce_published_tables(capsys, profile, table):
    stats = _json(capsys, "--profile", profile, "--samples", "100000")
    assert stats["count"] == 100_000
    for k, share in table.items():
        assert abs(stats["share_below"][str(k * K)] - share) < 0.005


def test_json_has_every_documented_key(capsys):
    stats = _json(capsys, "--profile", "lmsys", "--samples", "2000")
    thresholds = ["1024", "4096", "8192", "32768", "131072"]
    for key in ("share_below", "token_share_below", "attention_share_below"):
        assert list(stats[key]) == thresholds
        assert all(0 <= v <= 1 for v in stats[key].values())
    assert set(stats["percentiles"]) >= {"p50", "p90", "p99", "max"}
    assert stats["mean"] > 0
    # Attention weighs long sequences more than tokens do, tokens more than counts.
    assert (stats["attention_share_below"]["1024"] < stats["token_share_below"]["1024"]
            < stats["share_below"]["1024"])


def test_same_seed_same_output_other_seed_differs(capsys):
    a = _json(capsys, "--profile", "lmsys", "--samples", "500", "--seed", "4")
    b = _json(capsys, "--profile", "lmsys", "--samples", "500", "--seed", "4")
    c = _json(capsys, "--profile", "lmsys", "--samples", "500", "--seed", "5")
    assert a == b and a != c


def test_table_lists_every_threshold(capsys):
    assert main(["workload", "--profile", "tiny", "--samples", "1000"]) == 0
    out = capsys.readouterr().out
    for row in ("1K", "4K", "8K", "32K", "128K"):
        assert f" {row} " in out
    assert "profile tiny: 1,000 sequences" in out


def test_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "sub" / "hist.png"
    assert main(["workload", "--profile", "tiny", "--samples", "500", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lengths_file_and_npy_are_described_whole(capsys, tmp_path):
    (tmp_path / "l.txt").write_text("100\n2000\n5000\n")
    np.save(tmp_path / "l.npy", np.array([100, 2000, 5000]))
    for name in ("l.txt", "l.npy"):
        stats = _json(capsys, "--lengths", str(tmp_path / name))
        assert stats["count"] == 3 and stats["share_below"]["4096"] == pytest.approx(2 / 3)


def test_stdlib_corpus_with_truncation(capsys):
    stats = _json(capsys, "--data", "stdlib", "--context-length", "4096", "--overlong",
                  "truncate", "--samples", "200")
    assert stats["count"] == 200 and stats["percentiles"]["max"] <= 4096


def test_unknown_profile_lists_valid_names(capsys):
    err = _user_error(capsys, "--profile", "nope")
    assert "unknown profile 'nope'" in err and "chunkflow-eval" in err and "github" in err


@pytest.mark.parametrize("bad", ["0", "-3"])
def test_nonpositive_length_in_file_names_the_line(capsys, tmp_path, bad):
    (tmp_path / "l.txt").write_text(f"5\n{bad}\n")
    assert "l.txt:2: length" in _user_error(capsys, "--lengths", str(tmp_path / "l.txt"))


def test_overlong_sequence_names_its_index(capsys, tmp_path):
    (tmp_path / "l.txt").write_text("5\n9000\n7\n")
    err = _user_error(capsys, "--lengths", str(tmp_path / "l.txt"), "--context-length", "8192")
    assert "sequence 1 has 9000 tokens > context length 8192" in err


def test_missing_source_and_bad_samples_are_user_errors(capsys):
    assert "--profile NAME" in _user_error(capsys)
    assert "--samples 0" in _user_error(capsys, "--profile", "tiny", "--samples", "0")


def test_help_opens_with_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["workload", "--help"])
    assert exc.value.code == 0
    assert "lengthwise workload --profile lmsys" in capsys.readouterr().out


def test_overlong_policy_says_how_many_sequences_it_dropped_or_cut(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("100\n5000\n9000\n300\n")
    for policy, done in (("drop", "dropped"), ("truncate", "cut to the context length")):
        assert main(["workload", "--lengths", str(path), "--context-length", "4096", "--overlong", policy]) == 0
        err = capsys.readouterr().err
        assert f"2 of 4 sequences are over --context-length 4,096 and were {done}" in err
