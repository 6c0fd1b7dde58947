"""Planner-option flags, built from the options classes (planners/options.py) for `plan`, `train`,
`verify` and `compare`: one flag per option name, its help and default written only there.

    add_planner_option_args(parser)       # --chunk-size, --k, --micro-batch-size, ... and --option
    options = planner_options(args)       # {"chunk_size": 64} : only what was given
    options_for("chunkflow", options)     # the part of `options` chunkflow takes

A name several planners share (micro_batch_size, milp_time_limit_s) is one flag whose help lists
each planner's meaning and default. `--option KEY=VALUE` sets any option by its name.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from lengthwise.errors import UserError
from lengthwise.planners.options import PLANNER_OPTIONS, option_flag


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
    """'planner: help (default X)' for each planner taking the option; None defaults say so in
    their help text, so only set ones are shown."""
    parts = []
    for planner, f in entries:
        default = "" if f.default is None else f" (default {_show(f.default)})"
        parts.append(f"{planner}: {f.metadata['help']}{default}")
    return "; ".join(parts)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_planner_option_args(parser: argparse.ArgumentParser) -> None:
    """One flag per planner option name, plus the generic --option KEY=VALUE."""
    group = parser.add_argument_group("planner options (each applies to the planners named in its help)")
    for flag, entries in _flag_fields().items():
        f = entries[0][1]
        group.add_argument(flag, dest=f"planner_option_{f.name}", metavar=f.metadata["metavar"],
                           type=parse_value, default=None, help=_help(entries))
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
    """The options `planner` takes, out of options meant for several planners (compare)."""
    names = {f.name for f in dataclasses.fields(PLANNER_OPTIONS[planner])}
    return {k: v for k, v in options.items() if k in names}


def check_options_used(planners: list[str], options: dict[str, Any]) -> None:
    """Every option is taken by at least one of the planners run (compare)."""
    taken = set().union(*({f.name for f in dataclasses.fields(PLANNER_OPTIONS[p])} for p in planners))
    unused = sorted(set(options) - taken)
    if unused:
        raise UserError(f"no planner compared takes option {', '.join(unused)}: "
                        f"drop it or add a planner that does to --planners")


def parse_option(text: str) -> tuple[str, object]:
    """`key=value` -> (key, value), the value read by `parse_value`."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"--option {text!r}: expected KEY=VALUE, e.g. micro_batch_size=4")
    return key.strip().replace("-", "_"), parse_value(raw)


def parse_value(raw: str) -> object:
    """int, float, true/false or none when the text reads as one, else the string itself."""
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
