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
the previous step runs, then executed exactly as planned, with AdamW (optionally warmed up and
cosine-decayed: --warmup-steps, --lr-schedule cosine, --min-lr), gradient clipping and a
progress bar showing loss and tokens/s. --out (default: a new folder lengthwise-runs/run-DATE-TIME,
named on stderr) receives a checkpoint (HF weights, optimizer, sampler position, RNG states)
every --save-every steps and after the last, the metrics (one JSON line per step, written after
the step's checkpoint), TensorBoard logs when tensorboard is installed, and the tokenizer; a
later run with the same --out resumes from the latest checkpoint, bit-exactly. --eval-every N
reports the loss of --eval-sequences documents held out of training.

Ctrl-C (SIGINT) or a scheduler's SIGTERM finishes the current step, writes a checkpoint, prints
the command that resumes the run, and exits 130; a second one leaves at once. A NaN or infinite
loss or gradient norm stops the run naming the step and the first parameter with a non-finite
gradient, before anything is saved (--skip-nonfinite skips such steps instead). A batch this
machine cannot hold is refused before training starts, with the estimate.

With --nproc N (local workers: gloo on CPU, NCCL on CUDA with one GPU each) or under torchrun,
the plan's ranks (N = dp * pp * cp * tp) run the same loop, each building only its own part of
the model: its pipeline stage's layers, split over the stage's --tp ranks (DTensor; with the
residual stream's rows split over them too unless --no-sequence-parallel), sharded over the
stage's data-parallel x CP ranks with FSDP2 (--zero 1 or 2: gathered once per step;
3: ZeRO-3; 0: whole copies). Every rank plans the same batch (checked by a plan hash each
step), AdamW updates the rank's shards (float32 master weights under bfloat16 compute with
--dtype bfloat16), clipping uses the global gradient norm, rank 0 alone writes metrics and the
progress bar, and checkpoints are each rank's own shards (safetensors and JSON, nothing gathered;
`lengthwise export` consolidates them) that a run with the same pp, cp and tp resumes exactly,
at the same or another dp (the shards are resharded). --allow-pickle-checkpoint resumes a
distributed checkpoint of an earlier lengthwise (pickled torch.distributed.checkpoint files, which
can run code): only for a run of your own. Without either, one process runs every
pipeline and stage of the plan.

--planner hydraulis across processes runs heterogeneous pipelines: --pipelines tp2-pp1,tp1-pp2
fixes one scheme per pipeline (N = the sum of their tp * pp * cp; leave out --dp/--pp/--cp/--tp),
otherwise the planner picks a strategy per batch over dp * pp * cp * tp GPUs and the ranks
switch between steps. AdamW's float32 master weights and moments of each element are kept by
one of the ranks holding it (a reduce-scatter and an all-gather among the holders each step; a
strategy switch moves them to the new owners), and a checkpoint resumes on N processes under
any strategy.

A TOML --config takes the same settings by their long names with underscores (batch_size,
tokens_per_batch, ...) and planner options as a table:

    steps = 100
    planner = "chunkflow"
    [options]
    chunk_size = 128
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lengthwise.commands.common import add_backend_arg, add_compile_arg, add_workload_args
from lengthwise.commands.planner_flags import add_planner_option_args, planner_options
from lengthwise.errors import UserError
from lengthwise.runtime.train.config import (
    DEVICES,
    DTYPES,
    LR_SCHEDULES,
    TrainConfig,
    load_toml,
    merge,
)
from lengthwise.runtime.train.outputs import METRICS_NAME, RUNS_FOLDER, with_outputs

_WORKLOAD_HELP = {
    "context_length": "longest sequence trained on, tokens (default 512)",
    "overlong": "documents over the context length: truncate (default), drop or error",
    "data": "documents: 'stdlib' (default; Python's own sources, no download), a .jsonl or "
            ".parquet file, a folder of .txt/.md/.py files, or a Hugging Face datasets folder "
            "(save_to_disk; needs the datasets package)",
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
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                        help=f"after warm-up: constant, or cosine down to --min-lr at the last step (default {d.lr_schedule})")
    parser.add_argument("--warmup-steps", metavar="N", type=int,
                        help=f"linear learning-rate warm-up over the first N steps (default {d.warmup_steps})")
    parser.add_argument("--min-lr", metavar="LR", type=float, help=f"where the cosine ends (default {d.min_lr:g})")
    parser.add_argument("--eval-every", metavar="N", type=int,
                        help="held-out loss every N steps (and after the last), on --eval-sequences documents "
                             "kept out of training")
    parser.add_argument("--eval-sequences", metavar="N", type=int,
                        help=f"documents held out for --eval-every (default {d.eval_sequences})")
    parser.add_argument("--skip-nonfinite", action="store_true", default=None,
                        help="skip (and count) a step whose loss or gradient norm is NaN or infinite, "
                             "instead of stopping")


def _add_runtime(parser: argparse.ArgumentParser, d: TrainConfig) -> None:
    parser.add_argument("--dtype", choices=DTYPES, help=f"parameter dtype (default {d.dtype})")
    parser.add_argument("--device", choices=DEVICES, help="auto: cuda when available (default)")
    add_backend_arg(parser, default=None)
    add_compile_arg(parser)
    parser.add_argument("--dp", metavar="D", type=int, help="data-parallel pipelines in the plan (default 1)")
    parser.add_argument("--pp", metavar="P", type=int, help="pipeline stages in the plan (default 1)")
    parser.add_argument("--cp", metavar="C", type=int, help="context-parallel ranks per stage in the plan (default 1)")
    parser.add_argument("--tp", metavar="T", type=int,
                        help="tensor-parallel ranks per stage in the plan (default 1; each holds its shard "
                             "with --nproc or torchrun)")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false", default=None,
                        help="with --tp > 1 across processes: keep whole activations on every TP rank (all-reduce "
                             "after each block) instead of splitting the residual stream's rows over TP (the default)")
    parser.add_argument("--zero", metavar="Z", type=int, choices=(0, 1, 2, 3),
                        help="across processes: 0 = whole parameters on every replica, 1/2 = FSDP2 sharding "
                             "gathered once per step (default 1), 3 = resharded after each forward (ZeRO-3)")
    parser.add_argument("--nproc", metavar="N", type=int,
                        help="run on N local worker processes, N = dp * pp * cp * tp (gloo on CPU, NCCL on CUDA)")
    parser.add_argument("--cluster", metavar="PRESET", help="cluster the planner sizes for (default cpu)")
    parser.add_argument("--threads", metavar="N", type=int,
                        help="CPU threads for torch (default 1 on CPU, torch's choice with CUDA)")
    parser.add_argument("--token-cache", metavar="DIR",
                        help=f"with --tokenizer: tokenise each corpus once into DIR, memory-mapped by later runs "
                             f"and every rank (default {d.token_cache})")
    parser.add_argument("--timeout", metavar="SECONDS", type=float,
                        help=f"distributed runs: how long a rank waits for the others (default {d.timeout:g})")


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics", metavar="FILE.jsonl",
                        help="append one JSON line per step (default OUT/metrics.jsonl)")
    parser.add_argument("--out", metavar="DIR",
                        help=f"checkpoints, metrics and TensorBoard logs; resumes from its latest checkpoint "
                             f"(default: a new {RUNS_FOLDER}/run-DATE-TIME)")
    parser.add_argument("--save-every", metavar="N", type=int, help="checkpoint every N steps (and after the last)")
    parser.add_argument("--resume", metavar="DIR", help="resume from this checkpoint directory")
    parser.add_argument("--allow-pickle-checkpoint", action="store_true", default=None,
                        help="resume a distributed checkpoint of an earlier lengthwise, whose pickled files can "
                             "run code when loaded: only for a run of your own")
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
        "grad_clip", "dtype", "device", "backend", "compile", "compile_chain", "threads", "dp", "pp", "cp", "tp", "sequence_parallel", "zero", "nproc", "cluster",
        "metrics", "out",
        "save_every", "resume", "allow_pickle_checkpoint", "progress", "data", "tokenizer", "text_field", "context_length",
        "overlong", "seed", "lr_schedule", "warmup_steps", "min_lr", "eval_every", "eval_sequences",
        "skip_nonfinite", "timeout", "token_cache")}
    flags["options"] = planner_options(args) or None
    config = merge(config, flags)
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.nproc is not None:  # the workers' fork server imports torch while this process does
        from lengthwise.runtime.distributed.forkserver import start_fork_server

        start_fork_server()
    from lengthwise.runtime.distributed.launch import under_torchrun
    from lengthwise.runtime.train.loop import train
    from lengthwise.runtime.train.signals import EXIT_INTERRUPTED, StopRequest

    distributed = config.nproc is not None or under_torchrun()
    if not under_torchrun():  # under torchrun rank 0 names the folder for all (dist.py)
        config = with_outputs(config)
    for line in setting_notes(config):
        print(f"lengthwise train: notice: {line}", file=sys.stderr)
    with StopRequest(forward_to_children=distributed) as stop:  # signals during set-up count too
        if distributed:
            from lengthwise.runtime.train.dist_launch import train_distributed

            result = train_distributed(config)
            if result is None:  # a rank other than 0: rank 0 reports
                return EXIT_INTERRUPTED if stop.requested else 0
        else:
            result = train(config, stop=stop)
    print(summary(result.config or config, result))
    if stop.requested and not result.interrupted:  # the signal came during the last step
        print("  interrupted during the last step, which finished and was saved: the run is complete")
        return EXIT_INTERRUPTED
    if result.interrupted:
        launcher = f"torchrun --nproc-per-node {result.nproc} -m " if under_torchrun() else ""
        command = resume_command(result.config or config, from_out=result.checkpoint is not None)
        print(f"  interrupted; resume with:\n  {launcher}{command}")
        return EXIT_INTERRUPTED
    return 0


def setting_notes(config: TrainConfig) -> list[str]:
    """Settings that are valid but unlikely to be meant, one line each."""
    notes = []
    if config.warmup_steps >= config.steps:
        top = config.steps / (config.warmup_steps + 1)  # schedule.lr_factor of the last step
        notes.append(f"--warmup-steps {config.warmup_steps} is not shorter than --steps {config.steps}: the "
                     f"learning rate never leaves the warm-up and peaks at {top:.0%} of --lr {config.lr:g}")
    return notes


def resume_command(config: TrainConfig, *, from_out: bool = True) -> str:
    """The command line that continues `config`: every setting that differs from the defaults,
    as flags. `from_out`: the run checkpointed into --out, which a run resumes from by itself
    (a --resume given before would restart from the older checkpoint, so it is left out). Under
    torchrun the caller puts the launcher in front (one node assumed)."""
    default, words = TrainConfig(), ["lengthwise", "train"]
    for name, value in config.to_dict().items():
        if name == "options" or value == getattr(default, name) or (name == "resume" and from_out):
            continue
        if name == "metrics" and config.out is not None and Path(value) == Path(config.out) / METRICS_NAME:
            continue  # the default
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            words += [flag, str(value)]
    for key, value in config.options.items():
        words += ["--option", f"{key}={value}"]
    return " ".join(shlex.quote(w) for w in words)


def summary(config: TrainConfig, result) -> str:
    records = result.records
    if not records and result.interrupted:
        return f"train: interrupted at step {result.start_step} of {config.steps}, before running a step"
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
    evaluated = [r for r in records if r.eval_loss is not None]
    if evaluated:
        lines.append(f"  held-out loss {evaluated[-1].eval_loss:.4f} after step {evaluated[-1].step}")
    if result.skipped_steps:
        lines.append(f"  {result.skipped_steps} steps skipped for a non-finite loss or gradient norm")
    return "\n".join(lines)
