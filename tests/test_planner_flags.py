"""Planner options: one dataclass per planner (planners/options.py) and one flag per option name
in `plan`, `train`, `verify` and `compare`, built from those classes."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from lengthwise.cli import main
from lengthwise.commands.planner_flags import check_options_used, options_for
from lengthwise.errors import UserError
from lengthwise.planners import PLANNER_NAMES
from lengthwise.planners.options import PLANNER_OPTIONS, option_defaults, option_flag

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
