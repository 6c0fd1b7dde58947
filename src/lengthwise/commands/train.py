"""Train a model on real documents, each global batch planned by a planner.

    lengthwise train                                   # tiny model, stdlib corpus, ~1 min on 2 CPU cores
    lengthwise train --steps 200 --metrics m.jsonl --out ckpt --save-every 50
    lengthwise train --out ckpt --steps 400            # resumes from the latest checkpoint in ckpt
    lengthwise train --planner packing --batch-size 16 --context-length 1024
    lengthwise train --config run.toml --lr 1e-3       # flags override the file
    lengthwise train --model ckpt/step-000200 --data docs.jsonl --tokenizer tok/ --device cuda
    lengthwise train --nproc 2 --dp 2 --out ckpt       # 2 local worker processes (gloo on CPU)
    torchrun --nproc-per-node 4 -m lengthwise train --dp 2 --pp 2 --device cuda --out ckpt

The model is a preset (--model tiny, the default), a Hugging Face config.json (random weights,
seeded by --seed), or a directory with config.json and model.safetensors (weights loaded by
their Hugging Face names; every checkpoint directory is one). Documents come from --data
(default stdlib: Python's own sources, byte tokens, no download), cut to --context-length
(default 512) tokens. Every global batch (--batch-size sequences, default 16, or
--tokens-per-batch) is planned by --planner (default chunkflow) in a background thread while
the previous step runs, then executed exactly as planned, with AdamW, gradient clipping and a
progress bar showing loss and tokens/s. --metrics appends a JSON line per step; --out writes a
checkpoint (HF weights, optimizer, sampler position, RNG states) every --save-every steps and
after the last, and a later run with the same --out resumes from the latest, bit-exactly.

With --nproc N (local workers: gloo on CPU, NCCL on CUDA with one GPU each) or under torchrun,
the plan's dp x pp x cp ranks (N = dp * pp * cp) run the same loop, each its own pipeline stage:
every rank plans the same batch (checked by a plan hash each step), AdamW updates the
parameters the rank holds, clipping uses the global gradient norm, rank 0 alone writes metrics
and the progress bar, and checkpoints are torch.distributed.checkpoint shards (plus the whole
model as model.safetensors) that a run with the same N resumes exactly. Without either, one
process runs every pipeline and stage of the plan.

A TOML --config takes the same settings by their long names with underscores (batch_size,
tokens_per_batch, ...) and planner options as a table:

    steps = 100
    planner = "chunkflow"
    [options]
    chunk_size = 128
"""

from __future__ import annotations

import argparse

from lengthwise.commands.common import add_backend_arg, add_workload_args
from lengthwise.commands.planner_flags import add_planner_option_args, planner_options
from lengthwise.errors import UserError
from lengthwise.runtime.train.config import (
    DEVICES,
    DTYPES,
    TrainConfig,
    load_toml,
    merge,
)

_WORKLOAD_HELP = {
    "context_length": "longest sequence trained on, tokens (default 512)",
    "overlong": "documents over the context length: truncate (default), drop or error",
    "data": "documents: 'stdlib' (default; Python's own sources, no download), a .jsonl or "
            ".parquet file, or a folder of .txt/.md/.py files",
}


def register(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (flags override it)")
    parser.add_argument("--model", metavar="PRESET|DIR|config.json",
                        help=f"model preset, HF config.json, or HF directory with weights (default {d.model})")
    parser.add_argument("--planner", metavar="NAME", help=f"planner for every batch (default {d.planner})")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--batch-size", metavar="N", type=int, help="sequences per global batch (default 16)")
    size.add_argument("--tokens-per-batch", metavar="T", type=int, help="token budget per global batch")
    _add_numbers(parser, d)
    _add_runtime(parser, d)
    _add_outputs(parser)
    add_planner_option_args(parser)
    add_workload_args(parser)
    for action in parser._actions:  # the shared workload flags, with this command's defaults
        if action.dest in _WORKLOAD_HELP:
            action.help = _WORKLOAD_HELP[action.dest]
    parser.set_defaults(text_field=None, overlong=None, seed=None)  # None: not given


def _add_numbers(parser: argparse.ArgumentParser, d: TrainConfig) -> None:
    parser.add_argument("--steps", metavar="N", type=int, help=f"total optimizer steps (default {d.steps})")
    parser.add_argument("--lr", metavar="LR", type=float, help=f"AdamW learning rate (default {d.lr:g})")
    parser.add_argument("--weight-decay", metavar="WD", type=float,
                        help=f"AdamW weight decay on matrices (default {d.weight_decay:g})")
    parser.add_argument("--grad-clip", metavar="NORM", type=float,
                        help=f"clip the gradient 2-norm to this; 0 = off (default {d.grad_clip:g})")


def _add_runtime(parser: argparse.ArgumentParser, d: TrainConfig) -> None:
    parser.add_argument("--dtype", choices=DTYPES, help=f"parameter dtype (default {d.dtype})")
    parser.add_argument("--device", choices=DEVICES, help="auto: cuda when available (default)")
    add_backend_arg(parser, default=None)
    parser.add_argument("--dp", metavar="D", type=int, help="data-parallel pipelines in the plan (default 1)")
    parser.add_argument("--pp", metavar="P", type=int, help="pipeline stages in the plan (default 1)")
    parser.add_argument("--cp", metavar="C", type=int, help="context-parallel ranks per stage in the plan (default 1)")
    parser.add_argument("--nproc", metavar="N", type=int,
                        help="run on N local worker processes, N = dp * pp * cp (gloo on CPU, NCCL on CUDA)")
    parser.add_argument("--cluster", metavar="PRESET", help="cluster the planner sizes for (default cpu)")
    parser.add_argument("--threads", metavar="N", type=int,
                        help="CPU threads for torch (default 1 on CPU, torch's choice with CUDA)")


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON line per step")
    parser.add_argument("--out", metavar="DIR", help="checkpoint directory (auto-resumes from its latest)")
    parser.add_argument("--save-every", metavar="N", type=int, help="checkpoint every N steps (and after the last)")
    parser.add_argument("--resume", metavar="DIR", help="resume from this checkpoint directory")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given."""
    if args.profile is not None or args.lengths is not None:
        raise UserError("training needs documents: use --data PATH (or the default stdlib), "
                        "not --profile/--lengths")
    config = load_toml(args.config) if args.config else TrainConfig()
    flags = {name: getattr(args, name) for name in (
        "model", "planner", "batch_size", "tokens_per_batch", "steps", "lr", "weight_decay",
        "grad_clip", "dtype", "device", "backend", "threads", "dp", "pp", "cp", "nproc", "cluster", "metrics", "out",
        "save_every", "resume", "progress", "data", "tokenizer", "text_field", "context_length",
        "overlong", "seed")}
    flags["options"] = planner_options(args) or None
    config = merge(config, flags)
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    from lengthwise.runtime.distributed.launch import under_torchrun
    from lengthwise.runtime.train.loop import train

    config = config_from_args(args)
    if config.nproc is not None or under_torchrun():
        from lengthwise.runtime.train.dist import train_distributed

        result = train_distributed(config)
        if result is None:  # a rank other than 0: rank 0 reports
            return 0
    else:
        result = train(config)
    print(summary(config, result))
    return 0


def summary(config: TrainConfig, result) -> str:
    records = result.records
    if not records:
        return f"train: already at step {result.start_step} of {config.steps} ({result.resumed_from}); nothing to do"
    first, last = records[0], records[-1]
    tokens = sum(r.tokens for r in records)
    seconds = sum(r.step_s for r in records)
    where = f" on {result.nproc} processes" if result.nproc > 1 else ""
    lines = [f"train: {config.model} on {config.data}, planner {config.planner}{where}, steps "
             f"{result.start_step + 1}-{last.step} of {config.steps}"
             + (f" (resumed from {result.resumed_from})" if result.resumed_from else ""),
             (f"  loss {first.loss:.4f} -> {last.loss:.4f}; {tokens:,} tokens in {seconds:.1f} s "
              f"({tokens / seconds:,.0f} tokens/s); longest plan {max(r.planning_ms for r in records):.1f} ms")]
    if result.checkpoint is not None:
        lines.append(f"  checkpoint {result.checkpoint}")
    if config.metrics:
        lines.append(f"  metrics appended to {config.metrics}")
    return "\n".join(lines)
