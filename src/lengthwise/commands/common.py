"""Arguments every command that reads a workload shares (workload, plan, compare, verify, ...).

    from lengthwise.commands.common import add_workload_args, batch_lengths_from_args
    def register(parser):
        add_workload_args(parser)
    def run(args):
        lengths = batch_lengths_from_args(args, batch_size=256)   # one global batch

Choose exactly one source: `--profile NAME` (a published distribution), `--lengths FILE` (one
integer a line, or .npy) or `--data PATH` (stdlib, .jsonl, .parquet, or a folder of text,
tokenized by `--tokenizer DIR` or byte-level).
"""

from __future__ import annotations

import argparse
import sys

from lengthwise.errors import UserError
from lengthwise.limits import CONTEXT_LENGTH, check_size
from lengthwise.workloads.lengths import OVERLONG_POLICIES
from lengthwise.workloads.profiles import profile_names
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import (LengthSource, corpus_source, lengths_file_source,
                                         profile_source)


ATTENTION_BACKENDS = ("auto", "reference", "cpu-flash", "varlen")
"""runtime.attention.BACKENDS, named here without importing torch (a test keeps them equal)."""


def add_backend_arg(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """--backend, the attention backend of commands that run the model."""
    parser.add_argument("--backend", choices=ATTENTION_BACKENDS, default=default,
                        help="attention backend (default auto: varlen on CUDA in 16 bits, else cpu-flash on CPU; "
                             "reference is one masked call per row, the yardstick)")


def add_compile_arg(parser: argparse.ArgumentParser) -> None:
    """--compile / --no-compile: torch.compile each decoder layer (default None: on CUDA only)."""
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each decoder layer, attention left out (default: on CUDA, off on CPU, "
                             "where compiling costs more than a short run gains)")
    parser.add_argument("--compile-chain", action="store_true", default=None,
                        help="compile up to four layers in one region with the flash attention inside it: fewer "
                             "compiled calls a layer, longer compilation (implies --compile; not yet measured on a "
                             "GPU; runtime/compile.py)")


def compile_choice(args: argparse.Namespace) -> tuple[bool | None, bool]:
    """(compile, chain) from --compile/--no-compile and --compile-chain."""
    if args.compile_chain and args.compile is False:
        raise UserError("--compile-chain compiles the layers: drop --no-compile")
    return (True if args.compile_chain else args.compile), bool(args.compile_chain)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Add --profile/--lengths/--data, --tokenizer, --text-field, --context-length, --overlong
    and --seed to `parser`."""
    group = parser.add_argument_group("workload (choose one source)")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--profile", metavar="NAME",
                        help=f"published length distribution: {', '.join(profile_names())}")
    source.add_argument("--lengths", metavar="FILE",
                        help="sequence lengths, one integer a line, or a 1-D .npy array")
    source.add_argument("--data", metavar="PATH",
                        help="documents: 'stdlib' (Python's own sources, no download), "
                             "a .jsonl or .parquet file, or a folder of .txt/.md/.py files")
    group.add_argument("--tokenizer", metavar="DIR",
                       help="local Hugging Face tokenizer folder for --data (default: bytes, "
                            "vocab 260)")
    group.add_argument("--text-field", metavar="NAME", default="text",
                       help="JSONL field / Parquet column holding the text (default: text)")
    group.add_argument("--context-length", metavar="L", type=int,
                       help="longest sequence allowed, in tokens (default: no limit)")
    group.add_argument("--overlong", choices=OVERLONG_POLICIES, default="error",
                       help="sequences over the context length: error (default), truncate, "
                            "or drop them")
    group.add_argument("--resample", action="store_true",
                       help="allow a lengths file or corpus smaller than the batch: its sequences are reused")
    group.add_argument("--seed", metavar="S", type=int, default=0,
                       help="seed for sampling and shuffling (default: 0)")


def lengths_source_from_args(args: argparse.Namespace) -> LengthSource:
    """The LengthSource the workload arguments name."""
    if args.seed < 0:
        raise UserError(f"--seed {args.seed} must be >= 0")
    check_size("--context-length", args.context_length, CONTEXT_LENGTH)
    if args.tokenizer is not None and args.data is None:
        raise UserError("--tokenizer applies to --data PATH only")
    if args.profile is not None:
        return profile_source(args.profile, args.context_length, args.overlong)
    if args.lengths is not None:
        return lengths_file_source(args.lengths, args.context_length, args.overlong)
    if args.data is not None:
        return corpus_source(args.data, args.tokenizer, args.context_length, args.overlong,
                             text_field=args.text_field)
    raise UserError("choose a workload: --profile NAME, --lengths FILE or --data PATH")


def batch_lengths_from_args(args: argparse.Namespace, batch_size: int) -> list[int]:
    """Lengths of the first global batch of `batch_size` sequences for `args.seed`. A lengths file
    or corpus with fewer sequences than the batch is an error unless --resample asks to reuse them."""
    source = lengths_source_from_args(args)
    if source.is_finite and len(source.lengths) < batch_size and not getattr(args, "resample", False):
        raise UserError(f"{source.name} holds {len(source.lengths)} sequences, fewer than the batch of {batch_size}: "
                        "lower --batch-size, or pass --resample to draw the batch from them with reuse")
    note = source.overlong_note()
    if note:
        print(note, file=sys.stderr)
    sampler = GlobalBatchSampler(source, seed=args.seed, batch_size=batch_size)
    return list(sampler.next_batch().lengths)
