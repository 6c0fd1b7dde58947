"""Planner-option flags, built from the options classes (planners/options.py) for `plan`, `train`,
`verify` and `compare`: one flag per option name, its help and default written only there.

    add_planner_option_args(parser)       # --chunk-size, --k, --micro-batch-size, ... and --option
    options = planner_options(args)       # {"chunk_size": 64} : only what was given
    options_for("chunkflow", options)     # the part of `options` chunkflow takes

A name several planners share (micro_batch_size, milp_time_limit_s) is one flag whose help lists
each planner's meaning and default. `--option KEY=VALUE` sets any option by its name. Values are
read the same way by a flag and by --option: `none` is the choice "none" of a choice option
(`--recompute none`, `--checkpointing none`) and Python's None (the planner chooses) elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from lengthwise.errors import UserError
from lengthwise.planners.options import PLANNER_OPTIONS, build_options, option_flag, option_names


def _flag_fields() -> dict[str, list[tuple[str, dataclasses.Field]]]:
    """flag -> [(planner, field), ...] over every planner's options that have a flag."""
    flags: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for planner, cls in PLANNER_OPTIONS.items():
        for f in dataclasses.fields(cls):
            flag = option_flag(f)
            if flag is not None:
                flags.setdefault(flag, []).append((planner, f))
    return flags


def _help(entries: list[tuple[str, dataclasses.Field]]) -> str:
    """'planner, planner: help (default X)' for each help text of the option (planners sharing
    a field, like the baselines' recompute, share one entry); None defaults say so in their help
    text, so only set ones are shown."""
    by_text: dict[str, list[str]] = {}
    for planner, f in entries:
        default = "" if f.default is None else f" (default {_show(f.default)})"
        by_text.setdefault(f"{f.metadata['help']}{default}", []).append(planner)
    return "; ".join(f"{', '.join(planners)}: {text}" for text, planners in by_text.items())


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_planner_option_args(parser: argparse.ArgumentParser) -> None:
    """One flag per planner option name, plus the generic --option KEY=VALUE."""
    group = parser.add_argument_group("planner options (each applies to the planners named in its help)")
    for flag, entries in _flag_fields().items():
        f = entries[0][1]
        group.add_argument(flag, dest=f"planner_option_{f.name}", metavar=f.metadata["metavar"],
                           type=value_reader(f.name), default=None, help=_help(entries))
    group.add_argument("--option", metavar="KEY=VALUE", action="append", default=[],
                       help="any planner option by name, repeatable (e.g. micro_batch_size=4)")


def planner_options(args: argparse.Namespace) -> dict[str, Any]:
    """The planner options given on the command line (flags win over --option)."""
    options = dict(parse_option(text) for text in args.option)
    for name, value in vars(args).items():
        if name.startswith("planner_option_") and value is not None:
            options[name.removeprefix("planner_option_")] = value
    return options


def options_for(planner: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options `planner` takes, out of options meant for several planners (compare), checked
    by the planner's options class before any planning starts."""
    names = option_names(planner)
    taken = {k: v for k, v in options.items() if k in names}
    build_options(planner, taken)
    return taken


def check_options_used(planners: list[str], options: dict[str, Any]) -> None:
    """Every option is taken by at least one of the planners run (compare)."""
    taken = set().union(*(option_names(p) for p in planners))
    unused = sorted(set(options) - taken)
    if unused:
        raise UserError(f"no planner compared takes option {', '.join(unused)}: "
                        f"drop it or add a planner that does to --planners")


def parse_option(text: str) -> tuple[str, object]:
    """`key=value` -> (key, value), the value read as the option's flag reads it (`value_reader`)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"--option {text!r}: expected KEY=VALUE, e.g. micro_batch_size=4")
    name = key.strip().replace("-", "_")
    return name, value_reader(name)(raw)


def value_reader(name: str) -> Callable[[str], object]:
    """How the option `name` reads its text: a choice of its choices (in any planner) as that
    string, anything else by `parse_value`."""
    choices = {c for _, f in _fields_named(name) for c in f.metadata["check"].choices}

    def read(raw: str) -> object:
        return raw.strip() if raw.strip() in choices else parse_value(raw)

    return read


def _fields_named(name: str) -> list[tuple[str, dataclasses.Field]]:
    return [(p, f) for p, cls in PLANNER_OPTIONS.items() for f in dataclasses.fields(cls) if f.name == name]


def parse_value(raw: str) -> object:
    """int, float, true/false or none (None) when the text reads as one, else the string itself."""
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
