"""What `lengthwise train` runs: one keyword-only dataclass, from a TOML file and/or flags.

    config = TrainConfig(steps=50, lr=1e-3)                      # defaults for the rest
    config = load_toml("run.toml")                               # keys are the field names
    config = merge(load_toml("run.toml"), {"steps": 100})        # flags override the file

A TOML file uses the field names below as top-level keys, planner options as a table:

    model = "tiny"
    data = "stdlib"
    planner = "chunkflow"
    batch_size = 8
    steps = 200
    lr = 3e-3
    [options]
    chunk_size = 256
    k = 2

Imports no PyTorch: the command can parse and check a config before loading it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lengthwise.errors import UserError
from lengthwise.limits import (BATCH_SEQUENCES, CONTEXT_LENGTH, LOCAL_PROCESSES, THREADS, TOKENS_PER_BATCH, check_gpus,
                               check_seconds, check_size)

DTYPES = ("float32", "float64", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "cosine")
DEFAULT_BATCH_SIZE = 16


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Defaults train the tiny model on the stdlib corpus: 30 steps of 16
    sequences of at most 512 tokens (about 240K tokens; 44 s of one CPU core measured), the
    loss falling from 5.6 (ln 260) to about 3.3."""

    model: str = "tiny"
    """Model preset name, a Hugging Face config.json (random init), or a directory holding
    config.json and model.safetensors (weights loaded by their Hugging Face names)."""
    data: str = "stdlib"
    """Documents: 'stdlib' (Python's own sources), a .jsonl/.parquet file, a text folder, or a
    Hugging Face datasets folder (save_to_disk; needs the datasets package)."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory; None: bytes (vocab 260, the tiny preset's)."""
    text_field: str = "text"
    """JSONL field / Parquet column holding the text."""
    token_cache: str | None = "~/.cache/lengthwise/tokens"
    """Folder of tokenised corpora (workloads/token_cache.py), used with a tokenizer: each corpus is
    tokenised once and memory-mapped by later runs and every rank. None: tokenise in memory."""
    context_length: int = 512
    """Longest sequence trained on, tokens."""
    overlong: str = "truncate"
    """Documents over the context length: truncate (default), drop, or error."""
    seed: int = 0
    """Seeds the weights, the sampler's order and the planners."""
    planner: str = "chunkflow"
    """Planner run on every global batch (lengthwise.planners)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Planner options, e.g. {"chunk_size": 256, "k": 2}."""
    dp: int = 1
    """Data-parallel pipelines in the plan (run on this one process, or one rank per stage and
    CP rank with nproc or torchrun)."""
    pp: int = 1
    """Pipeline stages in the plan (likewise)."""
    cp: int = 1
    """Context-parallel ranks per stage in the plan (likewise; one process runs all shares)."""
    tp: int = 1
    """Tensor-parallel ranks per stage in the plan (across processes each holds its shard of the
    stage's layers, `runtime/parallel/tensor_parallel.py`; one process runs them whole)."""
    sequence_parallel: bool = True
    """Across processes with tp > 1: split the residual stream's rows over the TP ranks
    (sequence parallelism, `runtime/parallel/tensor_parallel.py`); False keeps whole activations
    on every TP rank, all-reduced after each block. One process runs the layers whole either way."""
    zero: int = 1
    """Across processes: 0 keeps whole parameters on every replica (gradients all-reduced); 1 / 2
    shard parameters, gradients and AdamW states with FSDP2, gathered once per step; 3 also
    reshards after each forward and backward (ZeRO-3)."""
    nproc: int | None = None
    """Local worker processes to start, one per (pipeline, stage, CP rank, TP rank):
    dp * pp * cp * tp of them, gloo on CPU, NCCL on CUDA (one GPU each). None: this process runs the whole plan
    (or, under torchrun, torchrun's processes do)."""
    cluster: str = "cpu"
    """Cluster preset the planners size chunks for (memory per GPU)."""
    batch_size: int | None = None
    """Sequences per global batch; None with no tokens_per_batch means 16."""
    tokens_per_batch: int | None = None
    """Token budget per global batch instead of a sequence count (Hydraulis §8)."""
    steps: int = 30
    """Total optimizer steps of the run (a resumed run stops at the same total)."""
    lr: float = 3e-3
    """AdamW peak learning rate (after warm-up; the schedule scales it)."""
    lr_schedule: str = "constant"
    """After warm-up: constant, or cosine (half a cosine from lr down to min_lr at the last step)."""
    warmup_steps: int = 0
    """Steps of linear warm-up: step s (from 1) of the first warmup_steps uses lr * s / (warmup_steps + 1)."""
    min_lr: float = 0.0
    """Learning rate the cosine schedule ends at."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on matrices only (not norms, biases)."""
    grad_clip: float = 1.0
    """Largest global gradient 2-norm; 0 turns clipping off."""
    dtype: str = "float32"
    """Parameter dtype: float32, float64 (exactness tests) or bfloat16."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    backend: str = "auto"
    """Attention backend: auto, reference, cpu-flash or varlen."""
    compile: bool | None = None
    """Compile each decoder layer with torch.compile (runtime/compile.py); None: on CUDA, not
    on a CPU."""
    compile_chain: bool = False
    """Compile up to four layers in one region, the attention inside (runtime/compile.py,
    "Chained"); implies compile."""
    threads: int | None = None
    """CPU threads for torch (torch.set_num_threads). None: 1 on CPU, torch's default with
    CUDA. The tiny model's small matrices gain little from more threads and lose much when
    other processes share the cores (measured on 2 shared cores, load 4.5: 3,600 tokens/s with
    1 thread, 1,000 with 2)."""
    metrics: str | None = None
    """JSONL file to append one line per step to; None: none."""
    out: str | None = None
    """Checkpoint directory (step-NNNNNN sub-directories); None: no checkpoints."""
    save_every: int | None = None
    """Checkpoint every N steps (and after the last); None: only after the last."""
    resume: str | None = None
    """Checkpoint directory to resume from; None: the latest under `out`, if any."""
    allow_pickle_checkpoint: bool = False
    """Resume a distributed checkpoint of an earlier lengthwise (torch.distributed.checkpoint's
    pickles, which can run code): only for one's own runs (`distributed/legacy_dcp.py`)."""
    progress: bool = True
    """Show a progress bar on stderr."""
    eval_every: int | None = None
    """Held-out loss every N steps (and after the last); None: no held-out slice, no evaluation."""
    eval_sequences: int = 16
    """Sequences of the corpus held out of training for the evaluation (with eval_every)."""
    skip_nonfinite: bool = False
    """A step whose loss or gradient norm is not finite: skip it (no update, counted) instead of
    stopping the run."""
    timeout: float = 300.0
    """Seconds a rank of a distributed run waits for the others before failing (collectives,
    receives; init_process_group's timeout)."""

    def validate(self) -> None:
        """UserError naming the first field out of range."""
        _positive(self, "context_length", "steps", "dp", "pp", "cp", "tp", "nproc", "batch_size",
                  "tokens_per_batch", "save_every", "threads", "eval_every")
        _bounded(self)
        if self.nproc is not None:
            check_degrees(self, self.nproc, "--nproc")
        if self.batch_size is not None and self.tokens_per_batch is not None:
            raise UserError(f"give batch_size ({self.batch_size}) or tokens_per_batch "
                            f"({self.tokens_per_batch}), not both")
        if not self.sequence_parallel and self.planner == "hydraulis":
            raise UserError("sequence_parallel off (--no-sequence-parallel): --planner hydraulis runs its "
                            "tensor-parallel pipelines with sequence parallelism only; leave it on")
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"zero {self.zero}: use 0, 1, 2 or 3")
        if self.compile_chain and self.compile is False:
            raise UserError("compile_chain (--compile-chain) compiles the layers: drop compile = false (--no-compile)")
        if self.seed < 0:
            raise UserError(f"seed {self.seed} must be >= 0")
        _finite_numbers(self)
        _positive(self, "eval_sequences")
        if self.warmup_steps < 0:
            raise UserError(f"warmup_steps {self.warmup_steps} must be >= 0")
        for name, choices in (("dtype", DTYPES), ("device", DEVICES), ("lr_schedule", LR_SCHEDULES),
                              ("overlong", ("truncate", "drop", "error"))):
            if getattr(self, name) not in choices:
                raise UserError(f"{name} {getattr(self, name)!r}: use one of {', '.join(choices)}")

    @property
    def pipeline_schemes(self) -> list[tuple[int, int, int]] | None:
        """(tp, pp, cp) of every pipeline when the planner's `pipelines` option fixes a
        heterogeneous strategy (hydraulis: tp2-pp1,tp1-pp2); None otherwise."""
        text = self.options.get("pipelines")
        if text is None:
            return None
        from lengthwise.planners.hydraulis.cost import parse_pipelines  # planning core: no torch

        return parse_pipelines(str(text))

    @property
    def num_ranks(self) -> int:
        """Processes a distributed run of this config needs: dp * pp * cp * tp, or the GPUs of
        the pipelines option's schemes."""
        schemes = self.pipeline_schemes
        if schemes is not None:
            return sum(tp * pp * cp for tp, pp, cp in schemes)
        return self.dp * self.pp * self.cp * self.tp

    @property
    def sampler_size(self) -> dict[str, int]:
        """The sampler's batch_size or token_budget keyword."""
        if self.tokens_per_batch is not None:
            return {"token_budget": self.tokens_per_batch}
        return {"batch_size": self.batch_size or DEFAULT_BATCH_SIZE}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_degrees(config: TrainConfig, world_size: int, where: str) -> None:
    """UserError showing the arithmetic when dp * pp * cp * tp is not the number of processes."""
    if config.pipeline_schemes is not None:
        if config.dp * config.pp * config.cp * config.tp != 1:
            raise UserError(f"--pipelines {config.options['pipelines']} fixes every pipeline's tp, pp and cp; "
                            f"leave out --dp/--pp/--cp/--tp")
        if config.num_ranks != world_size:
            raise UserError(f"--pipelines {config.options['pipelines']} uses {config.num_ranks} processes, "
                            f"{where} gives {world_size}: make them equal")
        return
    if config.num_ranks != world_size:
        tp = f" * tp({config.tp})" if config.tp > 1 else ""
        raise UserError(f"dp({config.dp}) * pp({config.pp}) * cp({config.cp}){tp} = {config.num_ranks} "
                        f"processes, {where} gives {world_size}: make them equal")


def _finite_numbers(config: TrainConfig) -> None:
    """lr > 0, the others >= 0, all finite: a NaN or infinity here makes every weight NaN
    (issue 16: `--weight-decay nan` used to train to exit 0)."""
    for name, flag in (("lr", "--lr"), ("weight_decay", "--weight-decay"), ("grad_clip", "--grad-clip"),
                       ("min_lr", "--min-lr"), ("timeout", "--timeout")):
        value = getattr(config, name)
        if not math.isfinite(value):
            raise UserError(f"{flag} {value}: must be a finite number")
        if value < 0 or (name in ("lr", "timeout") and value == 0):
            raise UserError(f"{flag} {value}: must be {'> 0' if name in ('lr', 'timeout') else '>= 0'}")
    if config.min_lr > config.lr:
        raise UserError(f"--min-lr {config.min_lr} is above --lr {config.lr}; give a smaller one")
    _applicable_rates(config)


DTYPE_MAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38,
             "float64": 1.7976931348623157e308}
"""Largest finite number of each parameter dtype (torch.finfo(dtype).max, named here without torch)."""


def _applicable_rates(config: TrainConfig) -> None:
    """Rates AdamW can apply: a learning rate the parameters' dtype can hold (torch raises mid-step
    otherwise), and lr * weight_decay below 1, since decoupled weight decay multiplies each matrix
    by 1 - lr * weight_decay every step (at 1 or more it zeroes or flips the weights, and far above
    it they overflow to infinity after one step whose loss was finite)."""
    largest = DTYPE_MAX.get(config.dtype, DTYPE_MAX["float32"])
    if config.lr > largest:
        raise UserError(f"--lr {config.lr:g} is over the largest {config.dtype} number ({largest:.3g}): "
                        "AdamW cannot apply it; give a learning rate below 1")
    if config.lr * config.weight_decay >= 1:
        raise UserError(f"--lr {config.lr:g} x --weight-decay {config.weight_decay:g} = "
                        f"{config.lr * config.weight_decay:g}: AdamW multiplies each matrix by 1 - lr x weight "
                        "decay every step, so keep the product below 1")


def _bounded(config: TrainConfig) -> None:
    """Sizes within lengthwise.limits, so a stray digit fails now rather than after the corpus is read."""
    for name, limit in (("context_length", CONTEXT_LENGTH), ("batch_size", BATCH_SEQUENCES),
                        ("tokens_per_batch", TOKENS_PER_BATCH), ("nproc", LOCAL_PROCESSES),
                        ("threads", THREADS)):
        check_size(name, getattr(config, name), limit)
    check_gpus(dp=config.dp, tp=config.tp, pp=config.pp, cp=config.cp)
    if math.isfinite(config.timeout) and config.timeout > 0:  # NaN and <= 0: _finite_numbers says so
        check_seconds("--timeout", config.timeout)


def _positive(config: TrainConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise UserError(f"{name} {value} must be at least 1")


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}


def merge(config: TrainConfig, changes: dict[str, Any], *, where: str = "flags") -> TrainConfig:
    """`config` with `changes` applied (None values are left out); keys and types checked.
    Setting one of batch_size / tokens_per_batch clears the other."""
    changes = {k: v for k, v in changes.items() if v is not None}
    for key, value in changes.items():
        _check_key(key, value, where)
    for one, other in (("batch_size", "tokens_per_batch"), ("tokens_per_batch", "batch_size")):
        if one in changes and other not in changes:
            changes[other] = None
    if "options" in changes:
        changes["options"] = {**config.options, **changes["options"]}
    return dataclasses.replace(config, **changes)


def _check_key(key: str, value: Any, where: str) -> None:
    if key not in FIELDS:
        raise UserError(f"{where}: unknown key {key!r}; valid keys: {', '.join(FIELDS)}")
    kind = _field_kind(key)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise UserError(f"{where}: key {key!r} must be {kind.__name__}, got {value!r}")


def _field_kind(key: str) -> type:
    text = str(FIELDS[key].type)
    for name, kind in (("dict", dict), ("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return kind
    raise AssertionError(f"TrainConfig.{key} has an unhandled type {text}")


def load_toml(path: str | Path, base: TrainConfig | None = None) -> TrainConfig:
    """The config in a TOML file over `base` (default: the defaults)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--config {path} is a folder; give a TOML file") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"--config {path}: not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--config {path}: not valid TOML ({exc})") from None
    return merge(base or TrainConfig(), data, where=f"config {path}")
