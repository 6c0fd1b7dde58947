"""Mutated input files and what running the CLI on them must end in (shared by
test_fuzz_inputs.py, at a few dozen cases per kind, and benchmarks/fuzz_inputs.py, at 1,000).

Four kinds of input, each a file or flags the CLI reads:

- plans: real plans (packing, ChunkFlow with split sequences, Skrull with CP placement, SlimPack
  with backward units, InfiniPipe with recomputation) with 1-3 mutations at random places in
  their JSON (wrong types, 0, -1, 10^12, 2^63, NaN, deleted fields, edited chunk strings,
  lengths x 10, a pipeline dropped or duplicated), run through `simulate PLAN --json`;
- lengths files: lines of integers in and out of range, other numbers, other text, bytes that
  are not UTF-8, run through `workload` and `plan`;
- cost profiles: a valid profile with the same kinds of mutations, run through `plan
  --profile-file` and `simulate --profile-file`;
- training settings: a `--config` TOML file of known and unknown keys with values of every type
  (NaN, infinities, negatives, huge integers, strings, lists) and `train` flags drawn the same
  way, run through `lengthwise train` up to the point where training would start (the training
  loops are replaced by a stand-in that records the validated settings).

Every case must end in success or a one-line error with exit status 2 (no traceback, no
"bug in lengthwise" message), and a success must print only finite numbers and a result
consistent with its input (simulated tokens equal the plan's tokens, times positive).
"""

from __future__ import annotations

import copy
import functools
import io
import json
import math
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

from hypothesis import strategies as st

from lengthwise.cli import main
from lengthwise.cost import CostModel
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset

MODEL = "qwen2.5-0.5b"
BASE_LENGTHS = [9000, 300, 120, 4000, 50, 700, 2200, 10, 1, 2]
WEIRD_VALUES = [None, 0, -1, 1, 2, 3, 10**12, 2**40 + 1, 2**63, -(2**63), 1.5, -0.0, 1e308,
                float("nan"), float("inf"), float("-inf"), True, False, "2", "", "x", [], {}, [1, 2], [[]]]
NUMBERS_IN_TEXT = [0, 1, 2, 7, 99, 4097, 10**12, 2**40, 2**40 + 1, 2**63]


# ---- running the CLI ----

def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `lengthwise ARGV` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:   # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def _no_constants(name: str):
    raise AssertionError(f"output JSON holds {name}")


def finite_numbers(data) -> bool:
    if isinstance(data, float):
        return math.isfinite(data)
    if isinstance(data, dict):
        return all(finite_numbers(v) for v in data.values())
    if isinstance(data, list):
        return all(finite_numbers(v) for v in data)
    return True


def check_outcome(code: int, out: str, err: str, *, json_out: bool) -> dict | None:
    """Assert the case ended properly; returns the parsed JSON output of a success."""
    assert code in (0, 2), f"exit status {code}: {err[-500:]}"
    if code == 2:
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "bug in lengthwise" not in err, err
        return None
    if not json_out:
        assert not re.search(r"\b(nan|inf|infinity)\b", out, re.IGNORECASE), out
        return None
    data = json.loads(out, parse_constant=_no_constants)
    assert finite_numbers(data), out[:500]
    return data


# ---- the valid starting points ----

def _request(lengths: list[int], *, dp: int = 2, pp: int = 2, cp: int = 1, options=None) -> PlanRequest:
    model = model_preset(MODEL)
    scheme = ParallelScheme(dp=dp, pp=pp, cp=cp)
    cluster = cluster_preset("h100", scheme.num_gpus)
    return PlanRequest(lengths=lengths, model=model, cluster=cluster, scheme=scheme,
                       cost=CostModel(model=model, cluster=cluster), context_length=16384,
                       options=dict(options or {}))


@functools.cache
def base_plans() -> tuple[str, ...]:
    """JSON of five real plans with every feature a plan file can carry."""
    cases = [("packing", _request(BASE_LENGTHS)),
             ("chunkflow", _request(BASE_LENGTHS, options={"chunk_size": 2048, "k": 1})),
             ("skrull", _request(BASE_LENGTHS, cp=2)),
             ("slimpack", _request(BASE_LENGTHS, options={"num_micropacks": 4})),
             ("infinipipe", _request(BASE_LENGTHS, options={"num_slices": 3, "score": "estimate"}))]
    return tuple(get_planner(name)(req).to_json() for name, req in cases)


def base_profile() -> dict:
    fit = {"fwd": [1e-12, 2e-7, 3e-5], "bwd": [2.5e-12, 4e-7, 5e-5], "head_fwd": [1e-6, 1e-5],
           "head_bwd": [2e-6, 2e-5]}
    return {"format": "lengthwise.profile/1", "device": "fuzz", "model": MODEL,
            "schemes": {"tp1-cp1": fit, "tp2-cp1": copy.deepcopy(fit)},
            "activation_bytes_per_token_layer": 30000.0, "kv_bytes_per_token_layer": 4096.0, "meta": {}}


# ---- mutations ----

def _places(doc, path=()):
    """Every (path) into the JSON tree, the root excluded."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield path + (key,)
        yield from _places(value, path + (key,))


def _edit_text(draw, text: str) -> str:
    numbers = list(re.finditer(r"[0-9]+", text))
    how = draw(st.sampled_from(["number", "drop", "append", "junk"]))
    if how == "number" and numbers:
        m = draw(st.sampled_from(numbers))
        return text[:m.start()] + str(draw(st.sampled_from(NUMBERS_IN_TEXT))) + text[m.end():]
    if how == "drop" and text:
        i = draw(st.integers(0, len(text) - 1))
        return text[:i] + text[i + 1:]
    if how == "append":
        return text + draw(st.sampled_from(["+0[0:1]", " F0", " B0", ".r1000000000000", "/pad5", "@9", "/padx"]))
    return draw(st.sampled_from(["", "?", "F", "0[0:0]", "0[5:1]", "٣[0:1]"]))


def _mutate_at(draw, doc, path) -> None:
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    how = draw(st.sampled_from(["value", "value", "delete", "scale", "text", "duplicate"]))
    if how == "delete":
        del parent[key]
    elif how == "scale" and isinstance(value, (int, float)) and not isinstance(value, bool):
        parent[key] = value * draw(st.sampled_from([10, -1, 0, 1000]))
    elif how == "text" and isinstance(value, str):
        parent[key] = _edit_text(draw, value)
    elif how == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(value))
    else:
        parent[key] = copy.deepcopy(draw(st.sampled_from(WEIRD_VALUES)))


def _whole_plan_edit(draw, doc: dict) -> None:
    how = draw(st.sampled_from(["lengths x10", "drop pipeline", "duplicate pipeline", "swap lengths", "spec field",
                                "none"]))
    if how == "spec field":   # the model's and cluster's numbers feed every cost: hit them often
        section = doc[draw(st.sampled_from(["model", "cluster"]))]
        section[draw(st.sampled_from(sorted(section)))] = copy.deepcopy(draw(st.sampled_from(WEIRD_VALUES)))
    if how == "lengths x10" and isinstance(doc.get("lengths"), list):
        doc["lengths"] = [n * 10 if isinstance(n, int) else n for n in doc["lengths"]]
    elif how == "drop pipeline" and doc.get("pipelines"):
        doc["pipelines"].pop(draw(st.integers(0, len(doc["pipelines"]) - 1)))
    elif how == "duplicate pipeline" and doc.get("pipelines"):
        doc["pipelines"].append(copy.deepcopy(doc["pipelines"][0]))
    elif how == "swap lengths" and len(doc.get("lengths", [])) > 1:
        doc["lengths"][0], doc["lengths"][1] = doc["lengths"][1], doc["lengths"][0]


@st.composite
def mutated_json(draw, base: dict, whole_edit=None) -> dict:
    doc = copy.deepcopy(base)
    if whole_edit is not None:
        whole_edit(draw, doc)
    for _ in range(draw(st.integers(0 if whole_edit else 1, 3))):
        places = list(_places(doc))
        if not places:
            break
        _mutate_at(draw, doc, draw(st.sampled_from(places)))
    return doc


@st.composite
def mutated_plans(draw) -> dict:
    base = json.loads(draw(st.sampled_from(base_plans())))
    return draw(mutated_json(base, _whole_plan_edit))


def mutated_profiles():
    return mutated_json(base_profile())


@st.composite
def lengths_files(draw) -> bytes:
    line = st.one_of(
        st.integers(1, 20000).map(str),
        st.sampled_from(["0", "-1", "-0", "+5", str(2**40), str(2**40 + 1), str(2**63), str(2**64), "9" * 30,
                         "1.5", "1e3", "nan", "inf", "0x10", "1_000", "٣", "12 13", "# comment", "", "  7  "]),
        st.text(max_size=8))
    valid = st.one_of(st.integers(1, 20000).map(str), st.sampled_from(["# comment", "", "  7  ", str(2**40)]))
    lines = draw(st.lists(valid if draw(st.booleans()) else line, min_size=0, max_size=12))
    data = "\n".join(lines).encode("utf-8")
    if draw(st.integers(0, 9)) == 0:
        data += draw(st.sampled_from([b"\xff\xfe", b"\x80", b"\xc3", b"\x00"]))
    return data


# ---- one case of each kind ----

def plan_case(doc: dict, tmp: Path) -> dict | None:
    path = tmp / "plan.json"
    path.write_text(json.dumps(doc))
    result = check_outcome(*run_cli(["simulate", str(path), "--json"]), json_out=True)
    if result is not None:   # accepted: the result must follow from the (valid) plan
        assert result["tokens"] == sum(doc["lengths"]), (result["tokens"], sum(doc["lengths"]))
        assert result["step_time_s"] > 0 and 0 <= result["bubble_ratio"] <= 1
        assert result["mfu"] is None or 0 < result["mfu"] <= 1, result["mfu"]
    return result


def lengths_case(data: bytes, tmp: Path, planner: str) -> dict | None:
    path = tmp / "lengths.txt"
    path.write_bytes(data)
    check_outcome(*run_cli(["workload", "--lengths", str(path), "--json"]), json_out=True)
    plan = check_outcome(*run_cli(["plan", "--planner", planner, "--lengths", str(path), "--batch-size", "16",
                                   "--context-length", "4096", "--overlong", "truncate", "--model", MODEL,
                                   "--dp", "2", "--resample", "--json"]), json_out=True)
    if plan is not None:
        assert all(1 <= n <= 4096 for n in plan["lengths"]), plan["lengths"]
    return plan


def profile_case(doc: dict, tmp: Path) -> dict | None:
    path, plan_path = tmp / "profile.json", tmp / "base-plan.json"
    path.write_text(json.dumps(doc))
    if not plan_path.exists():
        plan_path.write_text(base_plans()[0])
    check_outcome(*run_cli(["plan", "--planner", "packing", "--profile", "lmsys", "--batch-size", "32",
                            "--context-length", "4096", "--overlong", "truncate", "--model", MODEL,
                            "--profile-file", str(path), "--json"]), json_out=True)
    result = check_outcome(*run_cli(["simulate", str(plan_path), "--profile-file", str(path), "--json"]),
                           json_out=True)
    if result is not None:
        assert result["step_time_s"] > 0 and 0 <= result["bubble_ratio"] <= 1
    return result


PLANNERS_FOR_LENGTHS = ["packing", "chunkflow", "token-balanced", "skrull", "padding", "sorted"]


# ---- training settings ----

SETTING_FLAGS = {
    "--lr": float, "--weight-decay": float, "--grad-clip": float, "--min-lr": float, "--timeout": float,
    "--warmup-steps": int, "--steps": int, "--batch-size": int, "--tokens-per-batch": int,
    "--context-length": int, "--dp": int, "--pp": int, "--cp": int, "--tp": int, "--zero": int,
    "--nproc": int, "--seed": int, "--threads": int, "--save-every": int, "--eval-every": int,
    "--eval-sequences": int, "--dtype": str, "--device": str, "--lr-schedule": str, "--overlong": str,
    "--planner": str,
}
"""`train` flags with a value, and the type their valid values have (paths are left out: the
case gives --out itself)."""
SETTING_TEXT = ["nan", "NaN", "inf", "-inf", "1e308", "1e999", "-1", "0", "1", "2", "3", "4", "1e-3", "0.1",
                "-0.0", str(2**63), str(2**31), "1.5", "", "x", "float64", "bfloat16", "cosine", "constant",
                "drop", "truncate", "packing", "chunkflow", "hydraulis", "auto", "cpu", "cuda"]


@st.composite
def training_settings(draw) -> tuple[str, list[str]]:
    """(TOML text, flags): a config file of 0-6 keys and 0-6 flags, each with a weird value."""
    from lengthwise.runtime.train.config import FIELDS

    keys = draw(st.lists(st.one_of(st.sampled_from(sorted(FIELDS)), st.sampled_from(["lr_", "options", "x"])),
                         max_size=6, unique=True))
    lines = []
    for key in keys:
        value = draw(st.one_of(st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1", "2", "1e-3", "1.5e308",
                                                str(2**63 - 1), "true", "false", '"x"', '""', "[]", "[1, 2]",
                                                "{a = 1}", '"float64"', '"auto"', '"cosine"']),
                               st.integers(-(2**63), 2**63 - 1).map(str),
                               st.floats(allow_nan=True, allow_infinity=True).map(_toml_float)))
        lines.append(f"{key} = {value}")
    if draw(st.integers(0, 9)) == 0:
        lines.append(draw(st.sampled_from(["[section]", "lr = ", "= 1", "lr = 1\nlr = 2", "\x00"])))
    flags = []
    for flag in draw(st.lists(st.sampled_from(sorted(SETTING_FLAGS)), max_size=6, unique=True)):
        flags += [flag, draw(st.one_of(st.sampled_from(SETTING_TEXT), st.integers(-5, 10**6).map(str)))]
    if draw(st.integers(0, 4)) == 0:
        flags.append(draw(st.sampled_from(["--no-sequence-parallel", "--skip-nonfinite", "--no-progress"])))
    return "\n".join(lines) + "\n", flags


def _toml_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)


class _Accepted(Exception):
    """Raised by the stand-in training loop: the settings got through validation."""

    def __init__(self, config):
        super().__init__("accepted")
        self.config = config


def _stand_in(config, *args, **kwargs):
    raise _Accepted(config)


def settings_case(toml_text: str, flags: list[str], tmp: Path) -> dict | None:
    """`train --config FILE FLAGS --out DIR` to where training would start: success (the settings
    the loop would get, checked in range and finite) or a one-line error with exit 2."""
    config_path = tmp / "train.toml"
    config_path.write_text(toml_text, encoding="utf-8", errors="surrogateescape")
    argv = ["train", "--config", str(config_path), *flags, "--out", str(tmp / "run"), "--no-progress"]
    with mock.patch("lengthwise.runtime.train.loop.train", _stand_in), \
            mock.patch("lengthwise.runtime.train.dist_launch.train_distributed", _stand_in):
        try:
            code, out, err = run_cli(argv)
            check_outcome(code, out, err, json_out=False)
            assert code == 2, f"train {flags} exited {code} without reaching the training loop"
            return None
        except _Accepted as accepted:
            config = accepted.config
    for name in ("lr", "weight_decay", "grad_clip", "min_lr", "timeout"):
        value = getattr(config, name)
        assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, (name, value)
    assert config.lr > 0 and config.min_lr <= config.lr, (config.lr, config.min_lr)
    for name in ("steps", "dp", "pp", "cp", "tp", "context_length", "eval_sequences"):
        assert isinstance(getattr(config, name), int) and getattr(config, name) >= 1, (name, getattr(config, name))
    assert config.warmup_steps >= 0 and config.seed >= 0 and config.zero in (0, 1, 2, 3), config
    config.validate()  # what the loop got passes validation again
    return config.to_dict()
