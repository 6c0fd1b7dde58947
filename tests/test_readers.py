"""Every reader validates: plan, profile and lengths files with a wrong type, a value out of range
or a broken invariant are one-line errors (exit 2) naming the file and field, and `--json`
output is strict JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fuzz_cases import base_plans, base_profile, run_cli
from lengthwise.errors import UserError
from lengthwise.files import json_text
from lengthwise.workloads.lengths import read_lengths


def one_line_error(*argv: str) -> str:
    code, out, err = run_cli(list(argv))
    assert code == 2, (code, out[:300], err)
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""
    return err


def packing_plan() -> dict:
    return json.loads(base_plans()[0])


def simulate_error(tmp_path, doc: dict) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return one_line_error("simulate", str(path), "--json")


@pytest.mark.parametrize("field, value, fragment", [
    ("zero", None, "field zero must be an integer in [0, 3], got None"),
    ("pipelines", [], "field pipelines must be a list of at least 1"),
    ("lengths", [100, 0], "lengths[1] must be an integer in [1, 1099511627776], got 0"),
    ("lengths", [100, -1], "got -1"),
    ("lengths", [1, 2**63], "got 9223372036854775808"),
    ("planner", 7, "field planner must be a string"),
    ("model", "qwen", "field model must be a JSON object"),
])
def test_plan_field_of_wrong_type_or_range_is_one_line(tmp_path, field, value, fragment):
    doc = packing_plan()
    doc[field] = value
    assert fragment in simulate_error(tmp_path, doc)


@pytest.mark.parametrize("field, value, fragment", [
    ("cp", 0, "pipeline 0: field cp must be an integer in [1, 1048576], got 0"),
    ("tp", "2", "field tp must be an integer in [1, 1048576], got '2'"),
    ("stages", [], "field stages must be a list of at least 1"),
    ("chunks", "0[0:10]", "field chunks must be a list"),
    ("extra_comm_s", -1.0, "field extra_comm_s must be a finite number >= 0"),
])
def test_pipeline_field_of_wrong_type_or_range_is_one_line(tmp_path, field, value, fragment):
    doc = packing_plan()
    doc["pipelines"][0][field] = value
    assert fragment in simulate_error(tmp_path, doc)


@pytest.mark.parametrize("section, field, value, fragment", [
    ("cluster", "inter_bw_gbps", 0, "field inter_bw_gbps must be a finite number >= 0.001, got 0"),
    ("cluster", "gpu_memory_gb", 1e300, "field gpu_memory_gb must be a number in [0.001, 1.04858e+06]"),
    ("cluster", "intra_latency_us", -5, "field intra_latency_us must be a finite number >= 0"),
    ("model", "hidden", 0, "field hidden must be an integer in [1, 16777216], got 0"),
    ("model", "vocab", "151936", "field vocab must be an integer"),
    ("model", "tied_embeddings", 1, "field tied_embeddings must be true or false"),
])
def test_model_and_cluster_fields_of_a_plan_are_range_checked(tmp_path, section, field, value, fragment):
    doc = packing_plan()
    doc[section][field] = value
    assert fragment in simulate_error(tmp_path, doc)


def test_simulate_validates_the_plan_it_reads(tmp_path):
    doc = packing_plan()
    doc["lengths"] = [n * 10 for n in doc["lengths"]]   # would report 10x the tokens per second
    assert "the file was edited" in simulate_error(tmp_path, doc)
    del doc["loss_tokens"], doc["metrics"]["loss_tokens"]   # edited more carefully
    err = simulate_error(tmp_path, doc)
    assert "invalid plan" in err and "missing" in err
    doc = packing_plan()
    doc["pipelines"].pop()                              # would raise the MFU
    assert "missing" in simulate_error(tmp_path, doc)


def test_duplicated_tokens_and_empty_chunks_are_rejected(tmp_path):
    doc = packing_plan()
    doc["pipelines"][0]["chunks"].append(doc["pipelines"][0]["chunks"][0])
    assert "appear twice" in simulate_error(tmp_path, doc)
    doc = packing_plan()
    doc["pipelines"][0]["chunks"].append("")
    assert "invalid plan" in simulate_error(tmp_path, doc)


def test_recompute_of_more_layers_than_the_stage_has_is_rejected_without_a_cost_model(tmp_path):
    doc = packing_plan()
    doc["pipelines"][0]["stages"][0] = doc["pipelines"][0]["stages"][0].replace("F0", "F0.r1000000000000", 1)
    assert "recomputes 1000000000000 layers but the stage has 12" in simulate_error(tmp_path, doc)


def test_nan_in_a_plan_file_is_rejected(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(packing_plan()).replace('"zero": 1', '"zero": NaN'))
    assert "NaN is not a number a lengthwise file may hold" in one_line_error("simulate", str(path))


def test_a_valid_plan_still_simulates(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(base_plans()[1])
    code, out, _ = run_cli(["simulate", str(path), "--json"])
    assert code == 0 and json.loads(out)["tokens"] == sum(json.loads(base_plans()[1])["lengths"])


def write_profile(tmp_path, doc: dict) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    return str(path)


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["schemes"]["tp1-cp1"].update(fwd=[1e-12, -2e-7, 3e-5]), "fwd[1] must be a finite number >= 0"),
    (lambda d: d["schemes"]["tp1-cp1"].update(bwd=[1.0, 2.0]), "field bwd must be a list of 3 numbers"),
    (lambda d: d["schemes"]["tp1-cp1"].update(fwd=[0, 0, 0]), "not all zero"),
    (lambda d: d["schemes"]["tp1-cp1"].update(head_fwd=[float("inf"), 0]), "Infinity is not a number"),
    (lambda d: d.update(kv_bytes_per_token_layer=2**41), "kv_bytes_per_token_layer must be a number of bytes"),
    (lambda d: d.update(activation_bytes_per_token_layer=-1), "activation_bytes_per_token_layer must be a finite"),
    (lambda d: d["schemes"].update({"tp0-cp1": d["schemes"]["tp1-cp1"]}), "the key must read tpT-cpC"),
])
def test_profile_with_bad_coefficients_is_one_line(tmp_path, edit, fragment):
    doc = base_profile()
    edit(doc)
    path = write_profile(tmp_path, doc)
    err = one_line_error("plan", "--planner", "packing", "--profile", "lmsys", "--batch-size", "8",
                         "--context-length", "4096", "--overlong", "truncate", "--model", "qwen2.5-0.5b",
                         "--profile-file", path)
    assert fragment in err and path in err


@pytest.mark.parametrize("content, fragment", [
    (b"12\n\xff\xfe\n", "is not UTF-8 text"),
    (f"12\n{2**63}\n".encode(), f"length {2**63} is over 1099511627776"),
    (f"{2**40 + 1}\n".encode(), "is over 1099511627776 (2^40) tokens"),
    (b"12\n1e3\n", "'1e3' is not an integer length"),
])
def test_bad_lengths_files_are_one_line(tmp_path, content, fragment):
    path = tmp_path / "lengths.txt"
    path.write_bytes(content)
    assert fragment in one_line_error("workload", "--lengths", str(path))


def test_lengths_up_to_2_to_the_40_are_read(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text(f"1\n{2**40}\n")
    assert read_lengths(path).tolist() == [1, 2**40]


def test_npy_lengths_over_the_limit_are_rejected(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, np.array([5, 2**63 + 1], dtype=np.uint64))
    with pytest.raises(UserError, match="is over 1099511627776"):
        read_lengths(path)


def test_json_output_never_holds_a_bare_nan():
    assert json.loads(json_text({"a": [1.0, 2]})) == {"a": [1.0, 2]}
    with pytest.raises(UserError, match=r"non-finite number at a\.1"):
        json_text({"a": [1.0, math.nan]})


def test_every_sequence_one_token_plans_with_chunkflow_and_auto(tmp_path):
    path = tmp_path / "ones.txt"
    path.write_text("1\n1\n1\n1\n")
    for planner in ("chunkflow", "auto"):
        code, out, err = run_cli(["plan", "--planner", planner, "--lengths", str(path), "--batch-size", "4",
                                  "--model", "qwen2.5-0.5b", "--dp", "2", "--json"])
        assert code == 0, err
        assert json.loads(out)["lengths"] == [1, 1, 1, 1]


def test_verify_of_a_batch_without_loss_tokens_is_one_line():
    err = one_line_error("verify", "--model-config", "tiny", "--lengths", "1,1,1")
    assert "no loss to compare" in err
