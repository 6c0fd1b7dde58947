"""The `lengthwise` command. Each sub-command lives in `lengthwise.commands.<name>` and is
imported only when used, so `lengthwise plan` never loads PyTorch.

    lengthwise workload --profile lmsys --samples 100000
    lengthwise plan --planner packing --profile lmsys --batch-size 512 --model qwen2.5-7b --cluster h100 --dp 8 --pp 4
    lengthwise --help
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lengthwise.errors import UserError

# name -> one-line summary; the module lengthwise.commands.<name> has register() and run().
COMMANDS = {
    "workload": "describe a length distribution (profile, lengths file or corpus)",
    "plan": "plan one global batch with a planner and write the StepPlan",
    "compare": "compare planners on sampled batches in simulation and write a report",
    "simulate": "simulate one step of a plan (or raw chunk times): timeline, bubbles, memory",
    "verify": "execute a plan in PyTorch and compare loss and gradients with unpacked training",
    "profile": "measure this device's chunk times and memory and fit a cost profile (--profile-file)",
    "train": "train a model on documents, each global batch planned (AdamW, checkpoints, resume)",
    "dryrun": "run ranks of a plan at full size on fake tensors: measured memory, FLOPs, bytes vs simulated",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake in one line, without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="lengthwise", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, summary in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=summary)
            continue
        module = importlib.import_module(f"lengthwise.commands.{name}")
        p = sub.add_parser(name, help=summary, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.register(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(only=chosen)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if not argv else 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"lengthwise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lengthwise: interrupted", file=sys.stderr)
        return 130
