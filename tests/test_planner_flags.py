"""Planner options: one dataclass per planner (planners/options.py) and one flag per option name
in `plan`, `train`, `verify` and `compare`, built from those classes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from lengthwise.cli import main
from lengthwise.commands.planner_flags import (add_planner_option_args, check_options_used, options_for,
                                               planner_options)
from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.planners import PLANNER_NAMES, PlanRequest, get_planner
from lengthwise.planners.options import (PLANNER_OPTIONS, ChunkFlowOptions, HydraulisOptions, build_options,
                                         option_defaults, option_flag)
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset

COMMANDS = ("plan", "train", "verify", "compare")
TINY_PLAN = ["plan", "--profile", "tiny", "--batch-size", "16", "--model", "tiny", "--cluster", "cpu",
             "--context-length", "512", "--json"]


def help_text(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def option_fields():
    return [(p, f) for p, cls in PLANNER_OPTIONS.items() for f in dataclasses.fields(cls)]


def test_every_planner_has_an_options_class_of_keyword_only_fields_with_help():
    assert list(PLANNER_OPTIONS) == list(PLANNER_NAMES)
    for planner, f in option_fields():
        assert f.kw_only and f.metadata["help"], (planner, f.name)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_planner_option_is_one_flag_of_the_command(command, capsys):
    text = help_text(command, capsys)
    declared = re.findall(r"^  (--[a-z][a-z0-9-]*)", text, flags=re.M)
    assert len(declared) == len(set(declared))
    flags = {option_flag(f) for _, f in option_fields()} - {None}
    assert flags <= set(declared)
    assert {"--chunk-size", "--k"} <= flags


def test_help_names_each_planner_and_its_default(capsys):
    text = " ".join(help_text("plan", capsys).split())
    assert "infinipipe: HiGHS seconds per checkpointing MILP" in text
    assert "(default 0.1)" in text and "(default 0.02)" in text  # milp_time_limit_s of both planners


def test_flags_reach_the_planner(capsys):
    assert main([*TINY_PLAN, "--planner", "chunkflow", "--chunk-size", "64", "--k", "2"]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert options["chunk_size"] == 64 and options["k"] == 2


def test_a_flag_the_planner_does_not_take_is_a_one_line_error(capsys):
    assert main([*TINY_PLAN, "--planner", "packing", "--k", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "planner packing has no option k" in err and "\n" not in err


def test_defaults_come_from_the_dataclass():
    assert option_defaults("chunkflow") == {"chunk_size": None, "k": None}
    assert option_defaults("infinipipe")["milp_time_limit_s"] == 0.1
    assert option_defaults("auto")["schemes"] == {}


def test_compare_gives_each_planner_only_its_options():
    options = {"chunk_size": 64, "micro_batch_size": 2}
    assert options_for("chunkflow", options) == {"chunk_size": 64}
    assert options_for("padding", options) == {"micro_batch_size": 2}
    assert options_for("packing", options) == {}
    check_options_used(["chunkflow", "padding"], options)
    with pytest.raises(UserError, match="no planner compared takes option micro_batch_size"):
        check_options_used(["chunkflow", "packing"], options)


# ---- `none` is none, by a flag and by --option (issue 27 item 7) ----

def parsed_options(*words: str) -> dict:
    parser = argparse.ArgumentParser()
    add_planner_option_args(parser)
    return planner_options(parser.parse_args(list(words)))


@pytest.mark.parametrize("words, expected", [
    (["--recompute", "none"], {"recompute": "none"}),
    (["--option", "recompute=none"], {"recompute": "none"}),
    (["--checkpointing", "none"], {"checkpointing": "none"}),
    (["--option", "checkpointing=none"], {"checkpointing": "none"}),
    (["--recompute", "full", "--checkpointing", "adaptive"], {"recompute": "full", "checkpointing": "adaptive"}),
    (["--chunk-size", "none"], {}),                        # None: the planner chooses, as if not given
    (["--option", "chunk_size=none"], {"chunk_size": None}),
    (["--option", "max_tp=none", "--k", "2"], {"max_tp": None, "k": 2}),
])
def test_none_is_read_as_none_by_flags_and_option(words, expected):
    assert parsed_options(*words) == expected


def test_none_reaches_the_planner_as_no_recomputation():
    """`--recompute none` on a batch whose longest sequence needs recomputation is refused
    (it used to become `auto`, which recomputes); `auto` plans it at the cheapest level that
    fits (MLP blocks), `full` and `mlp` as asked."""
    cost = CostModel(model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster_preset("h100", 2))
    plain = cost.max_seq_len(tp=2, pp=1)
    req = PlanRequest(lengths=[plain + 1, 100], model=cost.model, cluster=cost.cluster,
                      scheme=ParallelScheme(tp=2), cost=cost, context_length=2 * plain)
    for words, outcome in ((["--recompute", "none"], None), (["--option", "recompute=none"], None),
                           (["--recompute", "auto"], "mlp"), (["--recompute", "full"], "full"),
                           (["--recompute", "mlp"], "mlp")):
        req.options = parsed_options(*words)
        if outcome is None:
            with pytest.raises(UserError, match="longest one pipeline"):
                get_planner("packing")(req)
        else:
            assert get_planner("packing")(req).options["recompute"] == outcome


def test_a_none_value_of_a_choice_field_is_its_none_choice():
    assert build_options("padding", {"recompute": None}).recompute == "none"
    assert build_options("infinipipe", {"checkpointing": None}).checkpointing == "none"
    assert build_options("chunkflow", {"chunk_size": None}).chunk_size is None


# ---- the options classes are what planners read ----

def test_take_options_builds_the_planners_class_with_defaults():
    opts = build_options("chunkflow", {"k": 2})
    assert isinstance(opts, ChunkFlowOptions) and opts.k == 2 and opts.chunk_size is None
    assert build_options("hydraulis", {}) == HydraulisOptions()


@pytest.mark.parametrize("planner, given, message", [
    ("chunkflow", {"chunk_size": 0}, "chunkflow option chunk_size must be a positive number of tokens or 'auto'"),
    ("hydraulis", {"util_threshold": 1.5}, "hydraulis option util_threshold must be a number in (0, 1)"),
    ("infinipipe", {"score": "fast"}, "infinipipe option score must be one of simulate, estimate"),
    ("slimpack", {"dp_merge": "yes"}, "slimpack option dp_merge must be true or false"),
    ("auto", {"preselect": 0}, "auto option preselect must be a positive integer"),
    ("padding", {"recompute": "some"}, "padding option recompute must be one of none, mlp, full, auto"),
])
def test_a_value_the_field_refuses_is_a_one_line_user_error(planner, given, message):
    with pytest.raises(UserError) as err:
        build_options(planner, given)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError):  # the class itself checks, whoever builds it
        PLANNER_OPTIONS[planner](**given)


def test_an_options_object_plans_and_the_plan_file_keeps_a_dict(capsys):
    cost = CostModel(model=MODEL_PRESETS["tiny"], cluster=cluster_preset("cpu", 1))
    req = PlanRequest(lengths=[300, 40, 17, 90], model=cost.model, cluster=cost.cluster,
                      scheme=ParallelScheme(), cost=cost, context_length=512,
                      options=ChunkFlowOptions(chunk_size=64, k=2))
    plan = get_planner("chunkflow")(req)
    assert plan.options == {"chunk_size": 64, "k": 2}
    assert json.loads(json.dumps(plan.to_dict()))["options"] == {"chunk_size": 64, "k": 2}
    with pytest.raises(UserError, match="planner padding takes PaddingOptions"):
        get_planner("padding")(PlanRequest(**{**vars(req), "options": ChunkFlowOptions()}))


def test_the_baselines_share_one_recompute_declaration(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no hyphenated line breaks in the help
    baselines = ("padding", "packing", "megatron", "static-cp", "sorted", "token-balanced")
    declared = {id(f) for p in baselines for f in dataclasses.fields(PLANNER_OPTIONS[p]) if f.name == "recompute"}
    assert len(declared) == 1
    text = " ".join(help_text("plan", capsys).split())
    assert text.count("as the papers' Megatron-LM ran it") == 1
    assert f"{', '.join(baselines)}: activation recomputation" in text


def test_compare_checks_each_planners_options_before_planning():
    with pytest.raises(UserError, match="chunkflow option chunk_size must be"):
        options_for("chunkflow", {"chunk_size": "big", "micro_batch_size": 2})
